//! The errors of the stores of managed keys, whichever keeps them: its own module so that
//! the SQLite file and the Redis store name them without going through the interface that
//! picks between the two.

/// Why the store could not do what was asked; each names its file or server and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error("{file}: {reason}")]
    File { file: String, reason: String },
    #[error("Redis store {server}: {what}: {reason}")]
    Redis {
        server: String,
        what: String,
        reason: String,
    },
    /// A stored record that doesn't read: written by hand, or by a newer gateway that changed
    /// a field's meaning. Loading stops rather than leave the key out, which would refuse its
    /// callers without a word.
    #[error("{place}: key {id:?}: {reason}")]
    Unreadable {
        place: String,
        id: String,
        reason: String,
    },
}
