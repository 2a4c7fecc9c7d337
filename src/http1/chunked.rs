//! The one reader of chunked bodies (RFC 9112 §7.1), for every place that follows HTTP/1 bytes:
//! the smuggling watcher on client connections, the express lane relaying an upstream's body
//! verbatim, and the proxy decoding an upstream's body into frames for hyper's server.
//!
//! It is strict, as hyper's own decoder is: every line ends in CRLF, sizes are hex without a
//! sign or leading spaces. Two readers that disagree on where a body ends are how requests are
//! smuggled, so there is only this one, and it refuses what hyper refuses.

use std::ops::Range;

/// Largest chunk size accepted; more is an attack or a bug, never a real body.
const MAX_CHUNK: u64 = 1 << 48;
/// Longest chunk-size line extension or trailer line followed, so a peer can't make us scan
/// forever without progress.
const MAX_LINE: u32 = 8 * 1024;

/// Malformed chunked framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body")]
pub struct ChunkError;

/// Follows a chunked body as its bytes stream past, without copying them. Each call to
/// [`Decoder::scan`] continues where the last stopped.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    state: State,
    size: u64,
    /// Bytes of the current extension or trailer line.
    line: u32,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    #[default]
    Size,
    /// Past a `;` extension or whitespace, up to the line's end.
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// At the start of a trailer line, or of the final empty line.
    TrailerStart,
    TrailerLine,
    TrailerLf,
    EndLf,
}

impl Decoder {
    /// Scans `data`, calling `on_data` with the range of every piece of chunk data in it.
    /// Returns the offset just past the body's end when the end is in `data` (the decoder is
    /// then ready for the next body), `None` when more is needed.
    pub fn scan(
        &mut self,
        data: &[u8],
        mut on_data: impl FnMut(Range<usize>),
    ) -> Result<Option<usize>, ChunkError> {
        let mut i = 0;
        while i < data.len() {
            let c = data[i];
            match self.state {
                State::Size => match c {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (c as char).to_digit(16).ok_or(ChunkError)? as u64;
                        self.size = self.size * 16 + d;
                        if self.size > MAX_CHUNK {
                            return Err(ChunkError);
                        }
                    }
                    b';' | b' ' | b'\t' => {
                        self.line = 0;
                        self.state = State::Extension;
                    }
                    b'\r' => self.state = State::SizeLf,
                    _ => return Err(ChunkError),
                },
                State::Extension => match c {
                    b'\r' => self.state = State::SizeLf,
                    b'\n' => return Err(ChunkError),
                    _ => {
                        self.line += 1;
                        if self.line > MAX_LINE {
                            return Err(ChunkError);
                        }
                    }
                },
                State::SizeLf => {
                    if c != b'\n' {
                        return Err(ChunkError);
                    }
                    self.state = if self.size == 0 {
                        State::TrailerStart
                    } else {
                        State::Data
                    };
                }
                State::Data => {
                    let take = (data.len() - i).min(self.size as usize);
                    on_data(i..i + take);
                    self.size -= take as u64;
                    i += take;
                    if self.size == 0 {
                        self.state = State::DataCr;
                    }
                    continue;
                }
                State::DataCr => {
                    if c != b'\r' {
                        return Err(ChunkError);
                    }
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    if c != b'\n' {
                        return Err(ChunkError);
                    }
                    self.state = State::Size;
                }
                State::TrailerStart => match c {
                    b'\r' => self.state = State::EndLf,
                    b'\n' => return Err(ChunkError),
                    _ => {
                        self.line = 1;
                        self.state = State::TrailerLine;
                    }
                },
                State::TrailerLine => match c {
                    b'\r' => self.state = State::TrailerLf,
                    b'\n' => return Err(ChunkError),
                    _ => {
                        self.line += 1;
                        if self.line > MAX_LINE {
                            return Err(ChunkError);
                        }
                    }
                },
                State::TrailerLf => {
                    if c != b'\n' {
                        return Err(ChunkError);
                    }
                    self.state = State::TrailerStart;
                }
                State::EndLf => {
                    if c != b'\n' {
                        return Err(ChunkError);
                    }
                    *self = Decoder::default();
                    return Ok(Some(i + 1));
                }
            }
            i += 1;
        }
        Ok(None)
    }

    /// Like [`Decoder::scan`] when only the end matters.
    pub fn find_end(&mut self, data: &[u8]) -> Result<Option<usize>, ChunkError> {
        self.scan(data, |_| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scans `body` in pieces of `step` bytes; returns the end and the data it saw.
    fn scan_all(body: &[u8], step: usize) -> (Result<Option<usize>, ChunkError>, Vec<u8>) {
        let mut c = Decoder::default();
        let mut at = 0;
        let mut seen = Vec::new();
        for piece in body.chunks(step) {
            match c.scan(piece, |r| seen.extend_from_slice(&piece[r])) {
                Ok(Some(end)) => return (Ok(Some(at + end)), seen),
                Ok(None) => {}
                Err(e) => return (Err(e), seen),
            }
            at += piece.len();
        }
        (Ok(None), seen)
    }

    #[test]
    fn end_and_data_are_found_in_any_split() {
        let body = b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
        let end = body.len() - 4;
        for step in 1..body.len() {
            let (r, data) = scan_all(body, step);
            assert_eq!(r, Ok(Some(end)), "split every {step} bytes");
            assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz");
        }
        assert_eq!(scan_all(b"0\r\n\r\n", 1).0, Ok(Some(5)));
        assert_eq!(scan_all(b"5\r\nhel", 3).0, Ok(None));
    }

    #[test]
    fn malformed_chunks_are_refused() {
        for bad in [
            &b"z\r\n"[..],
            b"5\r\nhelloXX",
            b"5\n",
            b"5\r\nhello\n",
            b"0\r\n\n",
            b"0\r\nx: 1\n\r\n",
            b"5;ext\n",
            b"-5\r\n",
            b"fffffffffffffffff\r\n",
        ] {
            assert_eq!(
                scan_all(bad, 64).0,
                Err(ChunkError),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest::proptest! {
        /// Any bytes get an answer and no panic; a found end is inside the bytes scanned, and
        /// the data reported lies within them.
        #[test]
        fn any_bytes_get_an_answer(data in proptest::collection::vec(proptest::num::u8::ANY, 0..600), split in 1usize..64) {
            if let (Ok(Some(end)), _) = scan_all(&data, split) {
                proptest::prop_assert!(end <= data.len());
            }
        }

        /// Any chunked body, cut anywhere, ends where it was written to end and yields the
        /// data that was written.
        #[test]
        fn bodies_end_where_written(sizes in proptest::collection::vec(1usize..300, 0..8), split in 1usize..50) {
            let mut body = Vec::new();
            let mut want = Vec::new();
            for (k, n) in sizes.iter().enumerate() {
                body.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                let byte = b'a' + (k % 26) as u8;
                body.extend(std::iter::repeat_n(byte, *n));
                want.extend(std::iter::repeat_n(byte, *n));
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n\r\n");
            let end = body.len();
            body.extend_from_slice(b"GET / HTTP/1.1\r\n");
            let (r, data) = scan_all(&body, split);
            proptest::prop_assert_eq!(r, Ok(Some(end)));
            proptest::prop_assert_eq!(data, want);
        }
    }
}
