//! Lines read with a bound: a replay holds at most one line's maximum of a file in memory,
//! whatever the file's lines (or a gzip stream's expansion) hold, and a longer line is read on
//! to its end in chunks and reported as too long; the lines a file's format was told from,
//! given back before the rest; and the bound of each field a replay reads from a line.

use std::collections::VecDeque;
use std::io::{self, BufRead, Read};

/// The longest line a replay reads, its line end not counted: 64 KiB. The gateway writes a
/// request's path twice in a line (the request and `path`) and nothing else of any length, so
/// a real access line is a fraction of this.
pub const MAX_LINE: usize = 64 * 1024;

/// A key id: the gateway takes at most 128 characters, but older logs may hold longer ones.
pub const MAX_KEY_ID: usize = 1024;
/// A request's path, its query included.
pub const MAX_PATH: usize = 16 * 1024;
pub const MAX_METHOD: usize = 32;
/// An IPv4 or IPv6 address as text, a client's or the peer's.
pub const MAX_ADDRESS: usize = 64;
/// `none`, `unparsed` or 16 hex digits.
pub const MAX_FINGERPRINT: usize = 32;
/// A gateway's instance name.
pub const MAX_NAME: usize = 1024;
/// A number as text: a time, a count, a cost (a `u64` has 20 digits).
pub const MAX_NUMBER: usize = 32;
/// A status: three digits.
pub const MAX_STATUS: u16 = 999;

/// How a line read by [`read_line`] came.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Line {
    /// Bytes taken from the input, the line end included; 0 at the input's end.
    pub bytes: u64,
    /// Ended by `\n`, not by the input's end.
    pub ended: bool,
    /// Longer than the maximum: the buffer holds its first maximum bytes only.
    pub too_long: bool,
}

/// Reads one line into `buf` (cleared first), its `\n` included as `read_until` leaves it.
/// A line longer than `max` is read on to its end `max + 1` bytes at a time and dropped past
/// its first `max` bytes, so `buf` never holds more than `2 · max + 1`. On an error, `line`
/// says what came before it, as `buf` holds it.
pub fn read_line<R: BufRead + ?Sized>(
    r: &mut R,
    max: usize,
    buf: &mut Vec<u8>,
    line: &mut Line,
) -> io::Result<()> {
    buf.clear();
    *line = Line::default();
    loop {
        let before = buf.len();
        let read = (&mut *r).take(max as u64 + 1).read_until(b'\n', buf);
        let n = buf.len() - before;
        line.bytes += n as u64;
        line.ended = buf.last() == Some(&b'\n');
        if buf.len() > max + usize::from(line.ended) {
            line.too_long = true;
        }
        if line.too_long {
            buf.truncate(max);
        }
        read?;
        // Within the maximum, `read_until` stopped at the line's end or the input's.
        if line.ended || n == 0 || !line.too_long {
            return Ok(());
        }
    }
}

/// A line read ahead: all of it, or the start of one too long.
struct Ahead {
    text: Vec<u8>,
    line: Line,
}

/// How much of a line too long is kept when it is read ahead: enough to show in an error.
const AHEAD_PREVIEW: usize = 120;

/// A file's lines, each at most [`MAX_LINE`] long, the lines read ahead first.
pub struct Lines<R> {
    inner: R,
    max: usize,
    ahead: VecDeque<Ahead>,
    ahead_bytes: usize,
    bytes: u64,
}

impl<R: BufRead> Lines<R> {
    pub fn new(inner: R) -> Lines<R> {
        Lines::with_max(inner, MAX_LINE)
    }

    /// Lines of at most `max` bytes.
    pub fn with_max(inner: R, max: usize) -> Lines<R> {
        Lines {
            inner,
            max,
            ahead: VecDeque::new(),
            ahead_bytes: 0,
            bytes: 0,
        }
    }

    /// The next line into `buf`, as [`read_line`] reads it; `line.bytes` is 0 at the end.
    pub fn next(&mut self, buf: &mut Vec<u8>, line: &mut Line) -> io::Result<()> {
        if let Some(a) = self.ahead.pop_front() {
            self.ahead_bytes -= a.text.len();
            buf.clear();
            buf.extend_from_slice(&a.text);
            *line = a.line;
            self.bytes += line.bytes;
            return Ok(());
        }
        let read = read_line(&mut self.inner, self.max, buf, line);
        self.bytes += line.bytes;
        read
    }

    /// Reads a line ahead into `buf`: [`Lines::next`] gives it again, before the lines after
    /// it. Of a line too long, only its start is kept for then.
    pub fn look(&mut self, buf: &mut Vec<u8>) -> io::Result<Line> {
        let mut line = Line::default();
        read_line(&mut self.inner, self.max, buf, &mut line)?;
        if line.bytes > 0 {
            let keep = if line.too_long {
                buf.len().min(AHEAD_PREVIEW)
            } else {
                buf.len()
            };
            self.ahead_bytes += keep;
            self.ahead.push_back(Ahead {
                text: buf[..keep].to_vec(),
                line,
            });
        }
        Ok(line)
    }

    /// Bytes of the lines read ahead and not given yet.
    pub fn ahead_bytes(&self) -> usize {
        self.ahead_bytes
    }

    /// Bytes of the lines given so far, for progress.
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    /// The longest line these lines take.
    pub fn max(&self) -> usize {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of `text` read with `max`, through a reader that gives `chunk` bytes at a
    /// time: its text and how it came.
    fn all(text: &[u8], max: usize, chunk: usize) -> Vec<(String, Line)> {
        let mut r = io::BufReader::with_capacity(chunk, text);
        let mut out = Vec::new();
        let (mut buf, mut line) = (Vec::new(), Line::default());
        loop {
            read_line(&mut r, max, &mut buf, &mut line).unwrap();
            if line.bytes == 0 {
                return out;
            }
            assert!(buf.len() <= max + 1, "{} held", buf.len());
            out.push((String::from_utf8(buf.clone()).unwrap(), line));
        }
    }

    fn l(bytes: u64, ended: bool, too_long: bool) -> Line {
        Line {
            bytes,
            ended,
            too_long,
        }
    }

    #[test]
    fn a_line_over_the_maximum_is_read_to_its_end_and_cut() {
        let text = b"abcd\nabcde\nabcdef\n\nabcdefghijklmnop\nxyz";
        for chunk in [1, 2, 3, 7, 64] {
            assert_eq!(
                all(text, 5, chunk),
                [
                    ("abcd\n".into(), l(5, true, false)),
                    ("abcde\n".into(), l(6, true, false)),
                    ("abcde".into(), l(7, true, true)),
                    ("\n".into(), l(1, true, false)),
                    ("abcde".into(), l(17, true, true)),
                    ("xyz".into(), l(3, false, false)),
                ],
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn a_last_line_over_the_maximum_without_its_end() {
        assert_eq!(all(b"abcdef", 5, 4), [("abcde".into(), l(6, false, true))]);
        assert_eq!(all(b"abcde", 5, 4), [("abcde".into(), l(5, false, false))]);
        assert_eq!(all(b"", 5, 4), []);
    }

    #[test]
    fn lines_read_ahead_come_again_first() {
        let mut lines = Lines::with_max(&b"one\nmuch too long\ntwo\nthree\n"[..], 6);
        let mut buf = Vec::new();
        assert_eq!(lines.look(&mut buf).unwrap(), l(4, true, false));
        assert_eq!(lines.look(&mut buf).unwrap(), l(14, true, true));
        assert_eq!(buf, b"much t");
        assert_eq!(lines.ahead_bytes(), 4 + 6);
        let mut line = Line::default();
        let mut got = Vec::new();
        loop {
            lines.next(&mut buf, &mut line).unwrap();
            if line.bytes == 0 {
                break;
            }
            got.push((String::from_utf8(buf.clone()).unwrap(), line.too_long));
        }
        assert_eq!(
            got,
            [
                ("one\n".to_string(), false),
                ("much t".to_string(), true),
                ("two\n".to_string(), false),
                ("three\n".to_string(), false),
            ]
        );
        assert_eq!(lines.bytes_read(), 4 + 14 + 4 + 6);
        assert_eq!(lines.ahead_bytes(), 0);
    }

    /// A reader that fails after its bytes, as a gzip stream cut short does.
    struct Cut<'a>(&'a [u8]);

    impl Read for Cut<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let n = out.len().min(self.0.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn an_error_keeps_what_came_before_it() {
        let mut r = io::BufReader::with_capacity(4, Cut(b"abc\nabcdefghij"));
        let (mut buf, mut line) = (Vec::new(), Line::default());
        read_line(&mut r, 5, &mut buf, &mut line).unwrap();
        assert_eq!((&buf[..], line), (&b"abc\n"[..], l(4, true, false)));
        let e = read_line(&mut r, 5, &mut buf, &mut line).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!((&buf[..], line), (&b"abcde"[..], l(10, false, true)));
    }
}
