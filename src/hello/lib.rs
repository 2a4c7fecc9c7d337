//! The TLS ClientHello a client sends first, read from bytes alone, and the fingerprint of the
//! client software it names: the `fingerprint` dimension of the rules.
//!
//! A crate of its own, at the bottom layer, because three layers above it need the same type:
//! the gateway peeks the bytes off a socket and hands them here, `tollgate-rules` names a
//! fingerprint's bucket, and `tollgate-replay` reads one back from a trace. It is not part of
//! `tollgate-http1` (the one reader of HTTP/1; a ClientHello is not HTTP) nor of the gateway's
//! `server` (the rules and the replay could not name its type from there). Like the other
//! readers at this layer it owns no socket and never panics: any bytes get an answer.
//!
//! - [`parse`]: TLS records to one ClientHello, bounded, with a reason when it can't.
//! - [`fingerprint`]: what of a ClientHello is hashed, and the text form operators read.

pub mod fingerprint;
pub mod parse;

pub use fingerprint::{BadFingerprint, Fingerprint};
pub use parse::{ClientHello, MAX_PEEK, Read, Unparsed, read};
