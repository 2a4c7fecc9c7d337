//! HTTP/1 messages read by hand off raw sockets, for tests and fake upstreams that must see
//! the bytes as sent rather than as a client library would tidy them: a head split off at its
//! blank line, then a body by its `Content-Length`.

use std::time::Duration;

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

/// Reads one response with a `Content-Length` body from `tcp` into `buf` (cleared first): its
/// status and where its body lies in `buf`. For benches that drive raw connections and count
/// errors rather than fail on them.
pub async fn read_framed<S: tokio::io::AsyncRead + Unpin + ?Sized>(
    tcp: &mut S,
    buf: &mut Vec<u8>,
) -> std::io::Result<(u16, std::ops::Range<usize>)> {
    use tokio::io::AsyncReadExt;
    buf.clear();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(buf) {
            let body: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                .ok_or_else(|| std::io::Error::other("a response without Content-Length"))?;
            if buf.len() >= len + body {
                return Ok((resp.code.unwrap_or(0), len..len + body));
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tcp.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Reads one response with a `Content-Length` body from `tcp`, waiting at most `within` for each
/// read; its status. For tests that hold raw keep-alive connections.
pub async fn read_status(tcp: &mut tokio::net::TcpStream, within: Duration) -> u16 {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(&buf) {
            let body: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                .expect("a content-length");
            if buf.len() >= len + body {
                return resp.code.unwrap();
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(within, tcp.read(&mut chunk))
            .await
            .expect("the gateway answers")
            .expect("read a response");
        assert!(n > 0, "the gateway closed a connection mid-request");
        buf.extend_from_slice(&chunk[..n]);
    }
}
