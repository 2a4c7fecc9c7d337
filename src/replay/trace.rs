//! Trace input: a CSV file with a header row, read row by row into exact integer microseconds,
//! with errors that name the file, line, row and column.
//!
//! Columns are found by name in the header (case-insensitive): `time` and `key` are required;
//! `gateway`, `cost`, `cost_after`, `method`, `path`, `ip` and `fingerprint` are optional; other columns (an
//! access log's status, latency, …) are ignored. Fields may be quoted (`"…"`, with `""` for a quote), but a
//! quoted field can't span lines. Empty lines are skipped, and so are rows longer than 64 KiB
//! or with a field over its bound, which are counted ([`super::lines`]). The parser is
//! hand-written: the
//! trace format is small, and a byte-level fast path keeps the replay above ten million rows a
//! minute on one core.
//!
//! Its time parsers serve the command line too: `--excess-from`, `--plot-window` and the
//! duration flags read times as the trace's time column does.

use std::io::BufRead;

use super::RowError;
use super::lines::{Line, Lines, MAX_ADDRESS, MAX_FINGERPRINT, MAX_KEY_ID, MAX_METHOD, MAX_NUMBER, MAX_PATH};

/// Where each known column sits in a row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Columns {
    pub time: usize,
    pub key: usize,
    pub gateway: Option<usize>,
    pub cost: Option<usize>,
    /// What the upstream's answer reported for a post-paid limit (`--rules` only).
    pub cost_after: Option<usize>,
    pub method: Option<usize>,
    pub path: Option<usize>,
    pub ip: Option<usize>,
    pub fingerprint: Option<usize>,
    /// Fields every row must have.
    pub count: usize,
}

/// Why a trace can't be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("{file}: cannot read: {reason}")]
    Io { file: String, reason: String },
    #[error("{file}: the trace is empty; it needs a header row naming at least the time and key columns")]
    Empty { file: String },
    #[error("{file}: header (line 1): {reason}")]
    Header { file: String, reason: String },
    #[error("{file}: line {line} (row {row}): {reason}")]
    Line {
        file: String,
        line: u64,
        row: u64,
        reason: String,
    },
    #[error("{file}: line {line} (row {row}), column {column}: {reason}")]
    Field {
        file: String,
        line: u64,
        row: u64,
        column: String,
        reason: String,
    },
}

/// A field's bytes: in the line itself, or unescaped into the side buffer when it was quoted.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: u32,
    end: u32,
    unquoted: bool,
}

/// Reads a trace one row at a time, reusing its buffers.
pub(crate) struct TraceReader<R> {
    input: Lines<R>,
    file: String,
    cols: Columns,
    line: Vec<u8>,
    read: Line,
    side: Vec<u8>,
    spans: Vec<Span>,
    line_no: u64,
    row_no: u64,
    too_long: u64,
    /// Each known column and its longest value.
    bounds: Vec<(usize, usize)>,
}

/// One row's fields, borrowed from the reader until the next row is read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawRow<'a> {
    pub time: &'a [u8],
    pub key: &'a [u8],
    pub gateway: Option<&'a [u8]>,
    pub cost: Option<&'a [u8]>,
    pub cost_after: Option<&'a [u8]>,
    pub method: Option<&'a [u8]>,
    pub path: Option<&'a [u8]>,
    pub ip: Option<&'a [u8]>,
    pub fingerprint: Option<&'a [u8]>,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads the header. `file` names the trace in errors.
    pub fn new(mut input: Lines<R>, file: &str) -> Result<TraceReader<R>, TraceError> {
        let mut line = Vec::new();
        let mut read = Line::default();
        let mut line_no = 0;
        let header_err = |reason: String| TraceError::Header {
            file: file.to_string(),
            reason,
        };
        loop {
            input.next(&mut line, &mut read).map_err(|e| TraceError::Io {
                file: file.to_string(),
                reason: e.to_string(),
            })?;
            if read.bytes == 0 {
                return Err(TraceError::Empty {
                    file: file.to_string(),
                });
            }
            line_no += 1;
            if read.too_long {
                return Err(header_err(format!(
                    "longer than {} bytes; a header names a few columns",
                    input.max()
                )));
            }
            trim_eol(&mut line);
            if !line.iter().all(u8::is_ascii_whitespace) {
                break;
            }
        }
        let mut side = Vec::new();
        let mut spans = Vec::new();
        split(&line, &mut side, &mut spans).map_err(header_err)?;
        let names: Vec<String> = spans
            .iter()
            .map(|s| {
                String::from_utf8_lossy(field(&line, &side, *s))
                    .trim()
                    .to_ascii_lowercase()
            })
            .collect();
        let find = |name: &str| -> Result<Option<usize>, TraceError> {
            let mut at = names
                .iter()
                .enumerate()
                .filter(|(_, n)| *n == name)
                .map(|(i, _)| i);
            let first = at.next();
            if at.next().is_some() {
                return Err(header_err(format!("the column {name:?} appears twice")));
            }
            Ok(first)
        };
        let required = |name: &str| -> Result<usize, TraceError> {
            find(name)?.ok_or_else(|| {
                header_err(format!(
                    "no {name:?} column (the header has: {}); a trace needs time and key, and may have gateway, cost, cost_after, method, path, ip and fingerprint",
                    names.join(", ")
                ))
            })
        };
        let cols = Columns {
            time: required("time")?,
            key: required("key")?,
            gateway: find("gateway")?,
            cost: find("cost")?,
            cost_after: find("cost_after")?,
            method: find("method")?,
            path: find("path")?,
            ip: find("ip")?,
            fingerprint: find("fingerprint")?,
            count: names.len(),
        };
        let bounds = [
            (Some(cols.time), MAX_NUMBER),
            (Some(cols.key), MAX_KEY_ID),
            (cols.gateway, MAX_NUMBER),
            (cols.cost, MAX_NUMBER),
            (cols.cost_after, MAX_NUMBER),
            (cols.method, MAX_METHOD),
            (cols.path, MAX_PATH),
            (cols.ip, MAX_ADDRESS),
            (cols.fingerprint, MAX_FINGERPRINT),
        ]
        .into_iter()
        .filter_map(|(c, max)| Some((c?, max)))
        .collect();
        Ok(TraceReader {
            input,
            file: file.to_string(),
            cols,
            line,
            read,
            side,
            spans,
            line_no,
            row_no: 0,
            too_long: 0,
            bounds,
        })
    }

    pub(crate) fn columns(&self) -> &Columns {
        &self.cols
    }

    pub fn file(&self) -> &str {
        &self.file
    }

    /// Bytes consumed so far, for progress.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.input.bytes_read()
    }

    /// Rows skipped so far for being too long, or a field of theirs.
    pub(crate) fn too_long(&self) -> u64 {
        self.too_long
    }

    /// The error for a field of the row last read.
    pub(crate) fn field_error(&self, e: RowError) -> TraceError {
        TraceError::Field {
            file: self.file.clone(),
            line: self.line_no,
            row: self.row_no,
            column: e.column.to_string(),
            reason: e.reason,
        }
    }

    /// The next row, or `None` at the end of the trace.
    pub(crate) fn next_row(&mut self) -> Result<Option<RawRow<'_>>, TraceError> {
        loop {
            if !self.next_line()? {
                return Ok(None);
            }
            let over = self
                .bounds
                .iter()
                .any(|&(c, max)| trim(field(&self.line, &self.side, self.spans[c])).len() > max);
            if !over {
                break;
            }
            self.too_long += 1;
        }
        let get = |i: usize| trim(field(&self.line, &self.side, self.spans[i]));
        let opt = |i: Option<usize>| i.map(get);
        Ok(Some(RawRow {
            time: get(self.cols.time),
            key: get(self.cols.key),
            gateway: opt(self.cols.gateway),
            cost: opt(self.cols.cost),
            cost_after: opt(self.cols.cost_after),
            method: opt(self.cols.method),
            path: opt(self.cols.path),
            ip: opt(self.cols.ip),
            fingerprint: opt(self.cols.fingerprint),
        }))
    }

    /// Reads the next row that is not empty or too long, and splits it into its fields;
    /// `false` at the end of the trace.
    fn next_line(&mut self) -> Result<bool, TraceError> {
        loop {
            self.input
                .next(&mut self.line, &mut self.read)
                .map_err(|e| TraceError::Io {
                    file: self.file.clone(),
                    reason: format!("after line {}: {e}", self.line_no),
                })?;
            if self.read.bytes == 0 {
                return Ok(false);
            }
            self.line_no += 1;
            if self.read.too_long {
                self.row_no += 1;
                self.too_long += 1;
                continue;
            }
            trim_eol(&mut self.line);
            if self.line.is_empty() {
                continue;
            }
            self.row_no += 1;
            break;
        }
        split(&self.line, &mut self.side, &mut self.spans).map_err(|reason| TraceError::Line {
            file: self.file.clone(),
            line: self.line_no,
            row: self.row_no,
            reason,
        })?;
        if self.spans.len() != self.cols.count {
            return Err(TraceError::Line {
                file: self.file.clone(),
                line: self.line_no,
                row: self.row_no,
                reason: format!(
                    "{} fields, but the header names {} columns",
                    self.spans.len(),
                    self.cols.count
                ),
            });
        }
        Ok(true)
    }
}

fn trim_eol(line: &mut Vec<u8>) {
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
}

fn trim(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

#[inline]
fn field<'a>(line: &'a [u8], side: &'a [u8], s: Span) -> &'a [u8] {
    let src = if s.unquoted { side } else { line };
    &src[s.start as usize..s.end as usize]
}

/// Splits one line into field spans; a quoted field is unescaped into `side`.
fn split(line: &[u8], side: &mut Vec<u8>, spans: &mut Vec<Span>) -> Result<(), String> {
    spans.clear();
    side.clear();
    if line.len() > u32::MAX as usize {
        return Err("the line is longer than 4 GiB".into());
    }
    if find_quote(line).is_none() {
        // Fast path: no quotes anywhere.
        let mut start = 0;
        for (i, &b) in line.iter().enumerate() {
            if b == b',' {
                spans.push(Span {
                    start: start as u32,
                    end: i as u32,
                    unquoted: false,
                });
                start = i + 1;
            }
        }
        spans.push(Span {
            start: start as u32,
            end: line.len() as u32,
            unquoted: false,
        });
        return Ok(());
    }
    let mut i = 0;
    loop {
        // Leading spaces before a quote are admitted.
        let mut j = i;
        while j < line.len() && line[j] == b' ' {
            j += 1;
        }
        if j < line.len() && line[j] == b'"' {
            let start = side.len();
            let mut k = j + 1;
            loop {
                match line.get(k) {
                    None => {
                        return Err(format!(
                            "field {} opens a quote that the line never closes (fields can't span lines)",
                            spans.len() + 1
                        ));
                    }
                    Some(b'"') if line.get(k + 1) == Some(&b'"') => {
                        side.push(b'"');
                        k += 2;
                    }
                    Some(b'"') => {
                        k += 1;
                        break;
                    }
                    Some(&b) => {
                        side.push(b);
                        k += 1;
                    }
                }
            }
            while k < line.len() && line[k] == b' ' {
                k += 1;
            }
            spans.push(Span {
                start: start as u32,
                end: side.len() as u32,
                unquoted: true,
            });
            match line.get(k) {
                None => return Ok(()),
                Some(b',') => i = k + 1,
                Some(_) => {
                    return Err(format!(
                        "field {}: text after the closing quote; write a quote inside a quoted field as \"\"",
                        spans.len()
                    ));
                }
            }
        } else {
            let end = line[i..].iter().position(|&b| b == b',').map(|p| i + p);
            let stop = end.unwrap_or(line.len());
            if line[i..stop].contains(&b'"') {
                return Err(format!(
                    "field {}: a quote inside an unquoted field; quote the whole field and double the quote",
                    spans.len() + 1
                ));
            }
            spans.push(Span {
                start: i as u32,
                end: stop as u32,
                unquoted: false,
            });
            match end {
                None => return Ok(()),
                Some(e) => i = e + 1,
            }
        }
    }
}

#[inline]
fn find_quote(line: &[u8]) -> Option<usize> {
    line.iter().position(|&b| b == b'"')
}

/// Parses decimal seconds with at most 6 decimals (`32400.0025`) into integer microseconds,
/// digit by digit: a float would turn `0.1` into `0.1000000000000000055…` and round arrivals
/// that the storm trace puts exactly on token boundaries.
pub(crate) fn parse_time_us(text: &[u8]) -> Result<u64, String> {
    let show = || String::from_utf8_lossy(text).into_owned();
    if text.is_empty() {
        return Err("empty; a time is decimal seconds such as 32400.0025".into());
    }
    let (whole, frac) = match text.iter().position(|&b| b == b'.') {
        Some(p) => (&text[..p], Some(&text[p + 1..])),
        None => (text, None),
    };
    if whole.is_empty() || !whole.iter().all(u8::is_ascii_digit) {
        return Err(format!(
            "{:?} is not decimal seconds (digits, then optionally '.' and up to 6 digits)",
            show()
        ));
    }
    let mut us: u64 = 0;
    for &d in whole {
        us = us
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
            .ok_or_else(|| format!("{:?} is too large", show()))?;
    }
    us = us
        .checked_mul(1_000_000)
        .ok_or_else(|| format!("{:?} is too large", show()))?;
    if let Some(frac) = frac {
        if frac.is_empty() || !frac.iter().all(u8::is_ascii_digit) {
            return Err(format!(
                "{:?} is not decimal seconds (digits, then optionally '.' and up to 6 digits)",
                show()
            ));
        }
        if frac.len() > 6 {
            return Err(format!(
                "{:?} has {} decimals; times are exact to the microsecond, at most 6 decimals",
                show(),
                frac.len()
            ));
        }
        let mut f: u64 = 0;
        for &d in frac {
            f = f * 10 + u64::from(d - b'0');
        }
        for _ in frac.len()..6 {
            f *= 10;
        }
        us = us
            .checked_add(f)
            .ok_or_else(|| format!("{:?} is too large", show()))?;
    }
    Ok(us)
}

/// `250us`, `1ms`, `2s`, or `0`: the durations flags and `--plot-window` give, here beside
/// [`parse_time_us`] so the flags and the charts share them without needing each other.
pub(crate) fn parse_micros(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(0);
    }
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} needs a unit: us, ms or s"))?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{text:?} must start with a whole number"))?;
    let mult = match unit {
        "us" | "µs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use us, ms or s)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{text:?} is too long"))
}

/// Formats microseconds as decimal seconds with 6 decimals, the inverse of [`parse_time_us`].
pub(crate) fn format_time_us(us: u64) -> String {
    format!("{}.{:06}", us / 1_000_000, us % 1_000_000)
}

/// Parses a whole number, naming the column's meaning in the error.
pub(crate) fn parse_whole(text: &[u8], what: &str) -> Result<u64, String> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return Err(format!(
            "{:?} is not a whole number ({what})",
            String::from_utf8_lossy(text)
        ));
    }
    let mut v: u64 = 0;
    for &d in text {
        v = v
            .checked_mul(10)
            .and_then(|x| x.checked_add(u64::from(d - b'0')))
            .ok_or_else(|| format!("{:?} is too large ({what})", String::from_utf8_lossy(text)))?;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_exact() {
        assert_eq!(parse_time_us(b"32400.0025").unwrap(), 32_400_002_500);
        assert_eq!(parse_time_us(b"0.1").unwrap(), 100_000);
        assert_eq!(parse_time_us(b"7").unwrap(), 7_000_000);
        assert_eq!(parse_time_us(b"1.000001").unwrap(), 1_000_001);
        for bad in [
            &b""[..],
            b".5",
            b"5.",
            b"-1",
            b"1e3",
            b"1.0000001",
            b"12:00",
            b"99999999999999999999",
        ] {
            assert!(parse_time_us(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(format_time_us(32_400_002_500), "32400.002500");
    }

    #[test]
    fn reads_quoted_fields_and_names_columns() {
        let text = "Time,key,path,status\n1.5,k-7,\"/v1/a,b\",200\n\n2,\"k \"\"8\"\"\",/x,200\r\n";
        let mut r = TraceReader::new(Lines::new(text.as_bytes()), "t.csv").unwrap();
        assert_eq!(r.columns().path, Some(2));
        let row = r.next_row().unwrap().unwrap();
        assert_eq!(
            (row.time, row.key, row.path),
            (&b"1.5"[..], &b"k-7"[..], Some(&b"/v1/a,b"[..]))
        );
        let key = r.next_row().unwrap().unwrap().key.to_vec();
        assert_eq!((r.line_no, r.row_no, &key[..]), (4, 2, &b"k \"8\""[..]));
        assert!(r.next_row().unwrap().is_none());
    }

    #[test]
    fn header_and_row_errors_name_the_place() {
        let e = TraceReader::new(Lines::new("time,gateway\n".as_bytes()), "t.csv")
            .err()
            .unwrap();
        assert!(e.to_string().contains("no \"key\" column"), "{e}");
        let e = TraceReader::new(Lines::new("time,key,key\n".as_bytes()), "t.csv")
            .err()
            .unwrap();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let mut r = TraceReader::new(Lines::new("time,key\n1,a,b\n".as_bytes()), "t.csv").unwrap();
        let e = r.next_row().err().unwrap();
        assert_eq!(
            e.to_string(),
            "t.csv: line 2 (row 1): 3 fields, but the header names 2 columns"
        );
        let mut r = TraceReader::new(Lines::new("time,key\n1,\"a\n".as_bytes()), "t.csv").unwrap();
        assert!(r.next_row().err().unwrap().to_string().contains("never closes"));
    }

    #[test]
    fn rows_too_long_are_counted_and_skipped() {
        let key = |n: usize| "k".repeat(n);
        let text = format!(
            "time,key,path\n1,{},/a\n2,{},/a\n3,k,/{}\n4,k,/a\n5,{}\n6,k,/a\n",
            key(MAX_KEY_ID),
            key(MAX_KEY_ID + 1),
            "p".repeat(MAX_PATH),
            key(super::super::lines::MAX_LINE),
        );
        let mut r = TraceReader::new(Lines::new(text.as_bytes()), "t.csv").unwrap();
        let mut times = Vec::new();
        while let Some(row) = r.next_row().unwrap() {
            times.push(String::from_utf8(row.time.to_vec()).unwrap());
        }
        assert_eq!(times, ["1", "4", "6"]);
        assert_eq!((r.too_long(), r.row_no, r.line_no), (3, 6, 7));
        // The rows after keep their numbers in errors.
        let text = format!("time,key\n{}\n1,a,b\n", key(70_000));
        let mut r = TraceReader::new(Lines::new(text.as_bytes()), "t.csv").unwrap();
        let e = r.next_row().err().unwrap();
        assert_eq!(
            e.to_string(),
            "t.csv: line 3 (row 2): 3 fields, but the header names 2 columns"
        );
        let e = TraceReader::new(Lines::new(format!("time,{}\n", key(70_000)).as_bytes()), "t.csv")
            .err()
            .unwrap();
        assert!(
            e.to_string().contains("header (line 1): longer than 65536 bytes"),
            "{e}"
        );
    }
}
