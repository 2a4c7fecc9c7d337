//! The files a replay of access logs reads: each opened (gzip or not), told apart by what its
//! first lines hold (a JSON or combined access log, or a CSV trace), and the inputs sorted
//! into logs or traces before anything is replayed.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

use super::super::ReplayError;
use super::super::access;
use super::super::lines::Lines;

/// What a file holds, as its first lines tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// JSON access lines (`--access-log-format json`).
    Json,
    /// Combined access lines (`--access-log-format combined`).
    Combined,
    /// A CSV trace: its first line is a header naming `time` and `key`.
    Csv,
    /// Nothing but blank lines.
    Empty,
    /// None of these.
    Unknown,
}

impl Format {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Json => "JSON",
            Format::Combined => "combined",
            Format::Csv => "CSV",
            Format::Empty => "empty",
            Format::Unknown => "unknown",
        }
    }
}

/// An opened file, its format known, read from its start.
pub struct Input {
    pub name: String,
    pub format: Format,
    pub gzip: bool,
    /// Its size on disk, when it is a file not compressed: what a CSV replay's progress
    /// counts its bytes against.
    pub size: Option<u64>,
    pub(crate) lines: Lines<Box<dyn BufRead>>,
    /// The first line that is not blank, and its number, for an error about the file.
    pub(crate) first: Option<(u64, String)>,
}

impl Input {
    /// The whole content, first lines included.
    pub(crate) fn into_lines(self) -> Lines<Box<dyn BufRead>> {
        self.lines
    }
}

/// How many lines a log may begin with that are not access lines (the gateway's own start-up
/// lines, when both go to one stream) before its format is given up on; and how many bytes of
/// them, so that lines near the maximum length can't hold a thousand times it in memory.
const LOOK_AHEAD: usize = 1_000;
const LOOK_AHEAD_BYTES: usize = 4 << 20;

const BUFFER: usize = 1 << 20;

pub(crate) fn read_err(name: &str) -> impl FnOnce(io::Error) -> ReplayError + '_ {
    move |e| ReplayError::Io {
        what: format!("cannot read {name}"),
        reason: e.to_string(),
    }
}

/// Opens `path` (`-`: standard input), decompressing gzip, and tells its format.
pub fn open(path: &Path) -> Result<Input, ReplayError> {
    if path.as_os_str() == "-" {
        return Input::new("standard input".into(), None, Box::new(io::stdin()));
    }
    let f = File::open(path).map_err(|e| ReplayError::Io {
        what: format!("cannot open the trace or log {}", path.display()),
        reason: e.to_string(),
    })?;
    let size = f.metadata().ok().map(|m| m.len());
    Input::new(path.display().to_string(), size, Box::new(f))
}

impl Input {
    /// `raw` read as [`open`] reads a file; `name` names it in errors and the summary.
    pub fn new(name: String, size: Option<u64>, raw: Box<dyn Read>) -> Result<Input, ReplayError> {
        let mut raw = BufReader::with_capacity(BUFFER, raw);
        let gzip = raw
            .fill_buf()
            .map_err(read_err(&name))?
            .starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn BufRead> = if gzip {
            Box::new(BufReader::with_capacity(BUFFER, MultiGzDecoder::new(raw)))
        } else {
            Box::new(raw)
        };
        let mut lines = Lines::new(reader);
        let (format, first) = detect(&mut lines).map_err(read_err(&name))?;
        Ok(Input {
            name,
            format,
            gzip,
            size: size.filter(|_| !gzip),
            lines,
            first,
        })
    }
}

/// Reads lines ahead until one tells the format: a first line that is a CSV header, or a JSON
/// or combined access line among the first [`LOOK_AHEAD`] (and [`LOOK_AHEAD_BYTES`]). A line
/// too long is none of these.
fn detect<R: BufRead>(lines: &mut Lines<R>) -> io::Result<(Format, Option<(u64, String)>)> {
    let mut first = None;
    let mut line_no = 0;
    let mut buf = Vec::new();
    while line_no < LOOK_AHEAD as u64 && lines.ahead_bytes() < LOOK_AHEAD_BYTES {
        let read = lines.look(&mut buf)?;
        if read.bytes == 0 {
            let format = if first.is_none() {
                Format::Empty
            } else {
                Format::Unknown
            };
            return Ok((format, first));
        }
        line_no += 1;
        let line = trim_eol(&buf);
        if !read.too_long && is_blank(line) {
            continue;
        }
        let is_first = first.is_none();
        if is_first {
            let shown = String::from_utf8_lossy(&line[..line.len().min(120)]).into_owned();
            first = Some((line_no, shown));
        }
        if read.too_long {
            continue;
        }
        if line.first() == Some(&b'{') {
            return Ok((Format::Json, first));
        }
        if is_first && csv_header(line) {
            return Ok((Format::Csv, first));
        }
        if access::parse_combined(line).is_some() {
            return Ok((Format::Combined, first));
        }
    }
    Ok((Format::Unknown, first))
}

pub(crate) fn trim_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

pub(crate) fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

/// A CSV header naming `time` and `key` columns.
fn csv_header(line: &[u8]) -> bool {
    let names: Vec<Vec<u8>> = line
        .split(|&b| b == b',')
        .map(|n| {
            let n = n.trim_ascii();
            let n = n
                .strip_prefix(b"\"")
                .and_then(|n| n.strip_suffix(b"\""))
                .unwrap_or(n);
            n.trim_ascii().to_ascii_lowercase()
        })
        .collect();
    names.iter().any(|n| n == b"time") && names.iter().any(|n| n == b"key")
}

/// What the files on the command line are: one CSV trace, or access logs.
pub(crate) enum Inputs {
    Trace(Input),
    Logs(Vec<Input>),
}

pub(crate) fn input_err(file: &str, reason: impl Into<String>) -> ReplayError {
    ReplayError::Input {
        file: file.to_string(),
        reason: reason.into(),
    }
}

pub(crate) const EXPECTED: &str = "expected the gateway's access log (--access-log-format json or combined, one request a line), or a CSV trace whose header names time and key columns";

/// Sorts the opened files into one CSV trace or several access logs, or says why neither.
pub(crate) fn classify(inputs: Vec<Input>) -> Result<Inputs, ReplayError> {
    if let [one] = inputs.as_slice() {
        // A trace as the CSV reader takes it, whose own errors say what its header lacks.
        let csv_like = match one.format {
            Format::Csv | Format::Empty => true,
            Format::Unknown => one.first.as_ref().is_some_and(|(_, l)| l.contains(',')),
            Format::Json | Format::Combined => false,
        };
        if csv_like {
            return Ok(Inputs::Trace(inputs.into_iter().next().expect("one input")));
        }
    }
    for i in &inputs {
        match (i.format, &i.first) {
            (Format::Csv, _) => {
                return Err(input_err(
                    &i.name,
                    "is a CSV trace; only access logs can be merged: give one CSV trace, or access logs only",
                ));
            }
            (Format::Unknown, Some((n, line))) => {
                return Err(input_err(
                    &i.name,
                    format!("line {n} is neither an access line nor a CSV header ({line:?}); {EXPECTED}"),
                ));
            }
            (Format::Unknown, None) => {
                return Err(input_err(
                    &i.name,
                    format!("nothing but blank lines at its start; {EXPECTED}"),
                ));
            }
            _ => {}
        }
    }
    if inputs.iter().all(|i| i.format == Format::Empty) {
        return Err(input_err(&inputs[0].name, format!("is empty; {EXPECTED}")));
    }
    Ok(Inputs::Logs(inputs))
}
