//! HTTP/1 request-line rules shared by every path into the gateway: how a request target is
//! read (canonical paths), whichever parser took the bytes.

pub mod path;
