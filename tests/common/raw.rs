//! HTTP/1 messages read by hand off raw sockets, for tests and fake upstreams that must see
//! the bytes as sent rather than as a client library would tidy them: a head split off at its
//! blank line, then a body by its `Content-Length`.

use tokio::io::{AsyncRead, AsyncReadExt};

/// Takes the first message head, blank line and all, off the front of `buf`; `None` while
/// `buf` holds no whole head. What follows the head stays in `buf`, since on a kept
/// connection it is the body or the next message.
pub fn take_head(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    Some(buf.drain(..end).collect())
}

/// The first `Content-Length` in `head` whose value is a number.
pub fn content_length(head: &[u8]) -> Option<usize> {
    String::from_utf8_lossy(head).lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())
            .flatten()
    })
}

/// Reads from `s` into `buf` until it holds a whole head, and takes that head with its
/// `Content-Length` (0 without one); `None` if `s` closes or fails first.
pub async fn read_head<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<(Vec<u8>, usize)> {
    loop {
        if let Some(head) = take_head(buf) {
            let len = content_length(&head).unwrap_or(0);
            return Some((head, len));
        }
        if !fill(s, buf).await {
            return None;
        }
    }
}

/// Reads from `s` until `buf` holds at least `len` bytes; false if `s` closes or fails first.
pub async fn read_body<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>, len: usize) -> bool {
    while buf.len() < len {
        if !fill(s, buf).await {
            return false;
        }
    }
    true
}

/// One read from `s` onto the end of `buf`; false at the end of the stream or on an error.
async fn fill<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match s.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}
