//! A watch on the raw HTTP/1 bytes of a connection, for the two smuggling shapes the HTTP
//! parser resolves silently: a request with both `Content-Length` and `Transfer-Encoding`
//! (the parser drops the length and uses the encoding) and a repeated, equal `Content-Length`
//! (the parser keeps one). Both mean a front proxy may have framed the request differently, so
//! the gateway refuses them with 400 instead of forwarding.
//!
//! The watcher follows message boundaries as the bytes stream past (heads, fixed-length and
//! chunked bodies) without copying bodies, and stops watching at anything it can't follow
//! (HTTP/2, a malformed head): the parser refuses those itself.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use std::future::Future as _;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use tollgate_http1::chunked::Decoder;
use tollgate_http1::sanitize::HeadError;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Past this a head is refused by the parser anyway (431); stop watching.
const MAX_HEAD: usize = 256 * 1024;

/// What the watcher found, read by the request handler.
#[derive(Debug, Default)]
pub(crate) struct FlaggedHeads {
    /// Requests the handler has started on this connection.
    served: AtomicU64,
    /// (request index, why) for every head the watcher flagged.
    flagged: Mutex<Vec<(u64, HeadError)>>,
    /// Set when the connection switched protocols (a `101`): its bytes are no longer HTTP/1
    /// and the watcher, and its head timeout, step aside.
    switched: std::sync::atomic::AtomicBool,
}

impl FlaggedHeads {
    /// Called once per request, in order: the watcher's verdict on this request's head.
    pub(crate) fn next_request(&self) -> Option<HeadError> {
        let index = self.served.fetch_add(1, Ordering::AcqRel);
        let mut flagged = self.flagged.lock().unwrap_or_else(PoisonError::into_inner);
        let at = flagged.iter().position(|(i, _)| *i == index)?;
        Some(flagged.swap_remove(at).1)
    }

    /// The connection switched protocols: stop watching it.
    pub(crate) fn switched(&self) {
        self.switched.store(true, Ordering::Release);
    }

    fn flag(&self, index: u64, why: HeadError) {
        self.flagged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((index, why));
    }
}

#[derive(Debug)]
enum State {
    /// The first bytes: HTTP/2 prior knowledge or an HTTP/1 head.
    Preface(Vec<u8>),
    Head(Vec<u8>),
    Fixed(u64),
    Chunked(Decoder),
    Off,
}

struct Watcher {
    state: State,
    heads: u64,
    flagged: Arc<FlaggedHeads>,
}

/// The trimmed value of a header line named `name` (compared case-insensitively), if it is one.
fn value_of<'a>(line: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let rest = line.get(name.len()..)?;
    if !line[..name.len()].eq_ignore_ascii_case(name) || rest.first() != Some(&b':') {
        return None;
    }
    Some(rest[1..].trim_ascii())
}

fn head_end(buf: &[u8]) -> Option<usize> {
    // The parser accepts bare LF line ends too.
    for i in 0..buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some(i + 2);
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
    }
    None
}

impl Watcher {
    /// Reads one complete head and returns the state for its body. Only the two framing
    /// headers matter here, so this is a line scan, not a parse: malformed heads are the HTTP
    /// parser's to refuse, and then the connection ends.
    fn on_head(&mut self, head: &[u8]) -> State {
        let mut lines = head
            .split(|b| *b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
            .skip_while(|l| l.is_empty());
        if lines.next().is_none() {
            return State::Off;
        }
        let index = self.heads;
        self.heads += 1;
        let mut lengths = 0usize;
        let mut length: Option<u64> = None;
        let mut encodings = 0usize;
        let mut chunked = false;
        for line in lines.take_while(|l| !l.is_empty()) {
            if let Some(v) = value_of(line, b"content-length") {
                lengths += 1;
                length = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok());
            } else if let Some(v) = value_of(line, b"transfer-encoding") {
                encodings += 1;
                chunked = v
                    .rsplit(|b| *b == b',')
                    .next()
                    .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            }
        }
        if lengths > 0 && encodings > 0 {
            self.flagged.flag(index, HeadError::LengthAndEncoding);
        } else if lengths > 1 {
            self.flagged.flag(index, HeadError::DuplicateLength);
        }
        if encodings > 0 {
            return if chunked {
                State::Chunked(Decoder::default())
            } else {
                State::Off
            };
        }
        match (lengths, length) {
            (0, _) | (_, Some(0)) => State::Head(vec![]),
            (_, Some(n)) => State::Fixed(n),
            (_, None) => State::Off,
        }
    }

    fn feed(&mut self, mut input: &[u8]) {
        while !input.is_empty() {
            match &mut self.state {
                State::Off => return,
                State::Preface(buf) => {
                    let take = (H2_PREFACE.len() - buf.len()).min(input.len());
                    buf.extend_from_slice(&input[..take]);
                    if !H2_PREFACE.starts_with(buf) {
                        let buf = std::mem::take(buf);
                        input = &input[take..];
                        self.state = State::Head(vec![]);
                        self.feed(&buf);
                        continue;
                    }
                    if buf.len() == H2_PREFACE.len() {
                        self.state = State::Off;
                        return;
                    }
                    input = &input[take..];
                }
                State::Head(buf) => {
                    let start = buf.len().saturating_sub(3);
                    buf.extend_from_slice(input);
                    let Some(end) = head_end(&buf[start..]).map(|e| e + start) else {
                        if buf.len() > MAX_HEAD {
                            self.state = State::Off;
                        }
                        return;
                    };
                    let head = std::mem::take(buf);
                    let rest = head.len() - end;
                    self.state = self.on_head(&head[..end]);
                    input = &input[input.len() - rest..];
                }
                State::Fixed(n) => {
                    let take = (*n).min(input.len() as u64);
                    *n -= take;
                    input = &input[take as usize..];
                    if *n == 0 {
                        self.state = State::Head(vec![]);
                    }
                }
                State::Chunked(chunks) => match chunks.find_end(input) {
                    Ok(Some(end)) => {
                        input = &input[end..];
                        self.state = State::Head(vec![]);
                    }
                    Ok(None) => return,
                    // hyper's decoder refuses the same bytes and ends the connection.
                    Err(_) => {
                        self.state = State::Off;
                        return;
                    }
                },
            }
        }
    }
}

impl Watcher {
    /// Whether part of a request head has arrived and the rest has not.
    fn mid_head(&self) -> bool {
        match &self.state {
            State::Preface(b) | State::Head(b) => !b.is_empty(),
            _ => false,
        }
    }
}

/// A connection whose reads pass through the watcher. It also keeps the head timeout for
/// hyper's path: a head started and not finished within it gets `408` before the connection
/// ends (hyper's own timeout, a little later, would close it without a word).
pub(crate) struct Watched<IO> {
    io: IO,
    watcher: Watcher,
    head_timeout: Duration,
    deadline: Option<Pin<Box<Sleep>>>,
    /// The 408 being written, and how much of it is out.
    answering: Option<(&'static [u8], usize)>,
}

impl<IO> Watched<IO> {
    pub fn new(io: IO, flagged: Arc<FlaggedHeads>, head_timeout: Duration) -> Watched<IO> {
        Watched {
            io,
            watcher: Watcher {
                state: State::Preface(Vec::with_capacity(H2_PREFACE.len())),
                heads: 0,
                flagged,
            },
            head_timeout,
            deadline: None,
            answering: None,
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some((bytes, sent)) = &mut this.answering {
            while *sent < bytes.len() {
                match Pin::new(&mut this.io).poll_write(cx, &bytes[*sent..]) {
                    Poll::Ready(Ok(n)) if n > 0 => *sent += n,
                    Poll::Pending => return Poll::Pending,
                    _ => break,
                }
            }
            let _ = Pin::new(&mut this.io).poll_flush(cx);
            // End of stream: hyper gives up on the unfinished head and closes.
            return Poll::Ready(Ok(()));
        }
        if matches!(this.watcher.state, State::Off) && this.deadline.is_none() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        if this.watcher.flagged.switched.load(Ordering::Acquire) {
            this.watcher.state = State::Off;
            this.deadline = None;
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r
            && !matches!(this.watcher.state, State::Off)
        {
            let new = &buf.filled()[before..];
            this.watcher.feed(new);
        }
        if !this.watcher.mid_head() {
            this.deadline = None;
            return r;
        }
        let timeout = this.head_timeout;
        let deadline = this
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if r.is_pending() && deadline.as_mut().poll(cx).is_ready() {
            tracing::debug!("request head not finished in time");
            this.answering = Some((crate::respond::REQUEST_TIMEOUT_HTTP1, 0));
            return self.poll_read(cx, buf);
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> (Arc<FlaggedHeads>, u64) {
        let flagged = Arc::new(FlaggedHeads::default());
        let mut w = Watcher {
            state: State::Preface(vec![]),
            heads: 0,
            flagged: flagged.clone(),
        };
        for c in chunks {
            w.feed(c);
        }
        (flagged, w.heads)
    }

    #[test]
    fn follows_pipelined_messages_and_flags_only_the_bad_one() {
        let stream: &[u8] = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nGET /c HTTP/1.1\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /d HTTP/1.1\r\n\r\n";
        // Byte by byte and whole must agree.
        let (f1, h1) = run(&[stream]);
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        let (f2, h2) = run(&bytes);
        for (f, h) in [(f1, h1), (f2, h2)] {
            assert_eq!(h, 4);
            assert_eq!(f.next_request(), None);
            assert_eq!(f.next_request(), None);
            assert_eq!(f.next_request(), Some(HeadError::LengthAndEncoding));
            assert_eq!(f.next_request(), None);
        }
    }

    #[test]
    fn duplicate_equal_lengths_are_flagged() {
        let (f, _) = run(&[b"POST / HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc"]);
        assert_eq!(f.next_request(), Some(HeadError::DuplicateLength));
    }

    #[test]
    fn h2_prior_knowledge_is_not_watched() {
        let (_, heads) = run(&[H2_PREFACE, b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"]);
        assert_eq!(heads, 0);
    }

    #[test]
    fn a_body_that_looks_like_a_head_is_not_read_as_one() {
        let body = b"GET /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let head = format!("POST /up HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len());
        let (f, heads) = run(&[head.as_bytes(), body]);
        assert_eq!(heads, 1);
        assert_eq!(f.next_request(), None);
    }
}
