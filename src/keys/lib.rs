//! API keys managed at run time through the gateway's admin API, beside the keys of the rules
//! file: everything about them but HTTP. A key's record ([`record`]) holds its tenant, its own
//! numbers, its expiry and revocation, and the SHA-256 of each of its secrets; secrets are
//! made here in a checksummed form ([`secret`]) and shown once. The admin API's bodies are
//! read and applied to records by pure functions of the time handed in ([`change`]). Records
//! are kept in a SQLite file or in Redis ([`store`], [`sqlite`], [`redis`] with
//! `lua/keys_put.lua`, failing with an [`error`]), each write at a new generation, so gateways
//! follow one another's writes by asking what changed since the generation they hold.
//!
//! The gateway brings the HTTP: it routes the admin API to [`change`] and [`store`], compiles
//! the records beside the rules file's keys (`tollgate_rules::ManagedKey`), and on the request
//! path judges a presented secret with [`secret::looks_generated`] before it looks the key up
//! in its rules.

pub mod change;
pub mod error;
pub mod record;
pub mod redis;
pub mod secret;
pub mod sqlite;
pub mod store;

pub use change::{Create, FieldError, Patch, Refusal, Rotate};
pub use error::KeysError;
pub use record::{KeyRecord, Numbers, Secret, Status};
pub use secret::Verdict;
pub use store::KeyStore;
