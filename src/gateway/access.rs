//! The access log in a conventional format (`--access-log-format json|combined`): each
//! request's record, the writer thread that formats and writes it, and the two formats.
//!
//! A request only fills a boxed [`AccessEntry`] of plain values as it goes and hands the box over a
//! bounded channel; the text (the local time, the escaping, the JSON) is made on the writer
//! thread, so a request pays for neither, and written in batches (`GATHER`). When the channel
//! is full the record is dropped and counted, never waited for (README "Access lines").

use std::borrow::Cow;
use std::io::Write;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use http::{HeaderMap, HeaderValue, Method, Uri, Version};
use tollgate_rules::Fingerprint;

/// The shape of an access line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AccessLogFormat {
    /// One JSON object per line (README "Access log formats").
    Json,
    /// NCSA combined, as nginx writes it, then Tollgate's fields as `name=value`.
    Combined,
}

/// One request as its access line tells it: made when the request begins (boxed, so the
/// request carries one pointer), filled in as it goes, and formatted by the writer thread.
pub(crate) struct AccessEntry {
    /// When the line was recorded: the end of the request, as nginx's `$time_local`.
    pub(crate) time: SystemTime,
    /// The TCP peer (nginx's `$remote_addr`).
    pub(crate) peer: IpAddr,
    /// The client's address after trusted proxies, when the request got that far.
    pub(crate) client_ip: Option<IpAddr>,
    pub(crate) method: Method,
    pub(crate) version: Version,
    pub(crate) status: u16,
    /// Bytes of the response body sent; `None`: not known.
    pub(crate) body_bytes: Option<u64>,
    /// The client's bytes the line shows, copied: a `Uri` or `HeaderValue` would share the
    /// connection's whole read buffer, kept alive while the line waits for the writer. The
    /// target as sent (before the path is made canonical), then Referer, User-Agent and the
    /// request id where `referer`, `user_agent` and `request_id` say. A `Vec`, not room in the
    /// record: a record that holds its text is larger, and a request's moves of it cost more
    /// than the allocation saved (callgrind, benches/README.md "Access lines beside nginx's").
    text: Vec<u8>,
    target: Part,
    referer: Option<Part>,
    user_agent: Option<Part>,
    request_id: Option<Part>,
    pub(crate) route: Option<Arc<str>>,
    pub(crate) limit: Option<Arc<str>>,
    /// The caller's public id (an API key's or a verified token's), never a secret.
    pub(crate) key_id: Option<Arc<str>>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) latency_us: u64,
    /// The time the limiter's check used (the store's clock), µs since the Unix epoch; `None`
    /// when no check was made. What `tollgate replay` replays the line at.
    pub(crate) check_us: Option<u64>,
    /// The canonical path and query the request was routed on, in [`AccessEntry::text`].
    path: Option<Part>,
    /// The version of the rules that served it.
    pub(crate) rules_version: u64,
    /// What the upstream's answer reported for a post-paid limit.
    pub(crate) cost_reported: Option<u64>,
    /// The `host:port` of the upstream's target that answered (or, when none did, the last
    /// one tried); `None` when no upstream was asked.
    pub(crate) upstream_target: Option<Arc<str>>,
    /// How many of the upstream's targets were tried; 0 when none was.
    pub(crate) attempts: u8,
}

/// A range of [`AccessEntry::text`].
#[derive(Clone, Copy)]
struct Part(u32, u32);

fn push(text: &mut Vec<u8>, bytes: &[u8]) -> Part {
    let start = text.len() as u32;
    text.extend_from_slice(bytes);
    Part(start, text.len() as u32)
}

/// Room for a request id of the usual length, so adding it does not move the text.
const ID_ROOM: usize = 32;

impl AccessEntry {
    /// A record of a request whose head is `headers`; the rest is filled in as it goes.
    pub(crate) fn begin(
        peer: IpAddr,
        method: Method,
        uri: &Uri,
        version: Version,
        headers: &HeaderMap,
        fingerprint: Fingerprint,
    ) -> Box<AccessEntry> {
        let referer = headers.get(http::header::REFERER).map(HeaderValue::as_bytes);
        let user_agent = headers.get(http::header::USER_AGENT).map(HeaderValue::as_bytes);
        let sent_target = target(uri, version);
        // The target twice: the routed path, added later, is the target's path made canonical,
        // rarely longer. Then neither it nor the request id moves the text.
        let mut text = Vec::with_capacity(
            2 * sent_target.len()
                + referer.map_or(0, <[u8]>::len)
                + user_agent.map_or(0, <[u8]>::len)
                + ID_ROOM,
        );
        let target = push(&mut text, sent_target.as_bytes());
        let referer = referer.map(|v| push(&mut text, v));
        let user_agent = user_agent.map(|v| push(&mut text, v));
        Box::new(AccessEntry {
            time: SystemTime::UNIX_EPOCH,
            peer,
            client_ip: None,
            method,
            version,
            status: 0,
            body_bytes: None,
            text,
            target,
            referer,
            user_agent,
            request_id: None,
            route: None,
            limit: None,
            key_id: None,
            fingerprint,
            latency_us: 0,
            check_us: None,
            path: None,
            rules_version: 0,
            cost_reported: None,
            upstream_target: None,
            attempts: 0,
        })
    }

    pub(crate) fn set_request_id(&mut self, id: &HeaderValue) {
        self.request_id = Some(push(&mut self.text, id.as_bytes()));
    }

    /// The canonical path and query the request was routed on.
    pub(crate) fn set_path(&mut self, path_and_query: &[u8]) {
        self.path = Some(push(&mut self.text, path_and_query));
    }

    fn path(&self) -> Option<&[u8]> {
        self.path.map(|p| self.part(p))
    }

    fn part(&self, p: Part) -> &[u8] {
        &self.text[p.0 as usize..p.1 as usize]
    }

    fn target(&self) -> &[u8] {
        self.part(self.target)
    }

    fn referer(&self) -> Option<&[u8]> {
        self.referer.map(|p| self.part(p))
    }

    fn user_agent(&self) -> Option<&[u8]> {
        self.user_agent.map(|p| self.part(p))
    }

    fn request_id(&self) -> &[u8] {
        self.request_id.map_or(b"-", |p| self.part(p))
    }
}

/// A record whose line waits for its body (on hyper's path, which sends the body after the
/// request's steps end): the body's bytes counted as they go, and the line handed over when
/// the body is done or dropped, with the time and latency of then.
pub(crate) struct Pending {
    record: Option<Box<AccessEntry>>,
    log: AccessLog,
    started: Instant,
}

impl Pending {
    pub(crate) fn new(mut record: Box<AccessEntry>, log: AccessLog, started: Instant) -> Pending {
        record.body_bytes = Some(0);
        Pending {
            record: Some(record),
            log,
            started,
        }
    }

    /// `n` more bytes of the body handed to the client's connection.
    pub(crate) fn count(&mut self, n: usize) {
        if let Some(r) = &mut self.record {
            *r.body_bytes.get_or_insert(0) += n as u64;
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut r) = self.record.take() {
            r.time = SystemTime::now();
            r.latency_us = self.started.elapsed().as_micros() as u64;
            self.log.send(r);
        }
    }
}

enum Msg {
    Line(Box<AccessEntry>),
    Stop,
}

/// Where requests hand their records: cheap to clone, never blocks.
#[derive(Clone)]
pub struct AccessLog {
    tx: Sender<Msg>,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("waiting", &self.tx.len())
            .finish()
    }
}

impl AccessLog {
    /// Hands a finished record to the writer; when `buffer` records already wait (or the
    /// writer has stopped) it is dropped and counted instead.
    pub(crate) fn send(&self, r: Box<AccessEntry>) {
        match self.tx.try_send(Msg::Line(r)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Records dropped so far because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Held until the process ends: dropping it writes the records still waiting (for up to a
/// second each to hand over the stop and to hear it done, as the other logs' writer does).
pub struct Flush {
    tx: Sender<Msg>,
    done: Receiver<()>,
}

impl Drop for Flush {
    fn drop(&mut self) {
        const WAIT: Duration = Duration::from_secs(1);
        if self.tx.send_timeout(Msg::Stop, WAIT).is_ok() {
            let _ = self.done.recv_timeout(WAIT);
        }
    }
}

/// Starts the writer thread: records in `format` to `out`, at most `buffer` of them waiting.
/// `out` is flushed whenever the thread has caught up, so give it a buffer.
pub fn start(
    format: AccessLogFormat,
    buffer: usize,
    instance: String,
    out: impl Write + Send + 'static,
) -> std::io::Result<(AccessLog, Flush)> {
    let (tx, rx) = crossbeam_channel::bounded(buffer);
    let (done_tx, done) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("tollgate-access-log".into())
        .spawn(move || write_lines(format, &instance, &rx, out, &done_tx))?;
    let log = AccessLog {
        tx: tx.clone(),
        dropped: Arc::new(AtomicU64::new(0)),
    };
    Ok((log, Flush { tx, done }))
}

/// How long the writer gathers lines after the first one it waited for, before it flushes and
/// waits again. While it sleeps no request wakes it: with the writer waiting in `recv` and
/// flushing whenever it had caught up, a line cost the request a spin or a futex wake-up and the
/// writer a `write` of that one line, about two system calls a request (benches/README.md
/// "Access log formats"). A line reaches the file at most this much later; nginx's `buffer=`
/// waits up to its `flush=`.
const GATHER: Duration = Duration::from_millis(10);

fn write_lines(
    format: AccessLogFormat,
    instance: &str,
    rx: &Receiver<Msg>,
    mut out: impl Write,
    done: &Sender<()>,
) {
    let mut lines = Lines::new(format, instance, LocalClock::new());
    let mut line = Vec::with_capacity(1024);
    let mut write = |r: &AccessEntry, out: &mut dyn Write| {
        line.clear();
        lines.render(r, &mut line);
        // A log that cannot be written has nowhere to say so.
        let _ = out.write_all(&line);
    };
    'wait: while let Ok(msg) = rx.recv() {
        let mut next = Some(msg);
        let until = Instant::now() + GATHER;
        loop {
            while let Some(msg) = next.take().or_else(|| rx.try_recv().ok()) {
                match msg {
                    Msg::Line(r) => write(&r, &mut out),
                    Msg::Stop => break 'wait,
                }
            }
            let now = Instant::now();
            if now >= until {
                break;
            }
            std::thread::sleep(until - now);
        }
        let _ = out.flush();
    }
    // Lines handed over after the stop, while the process was ending.
    while let Ok(Msg::Line(r)) = rx.try_recv() {
        write(&r, &mut out);
    }
    let _ = out.flush();
    let _ = done.send(());
}

/// Formats times in the process's local zone (`TZ`, else the system's), read once at start.
/// Both formats are made once a second (a zone's offset changes only on a second boundary), so
/// a line pays for neither the zone lookup nor `strftime`: only the JSON line's milliseconds
/// are its own.
pub(crate) struct LocalClock {
    tz: jiff::tz::TimeZone,
    /// The second `local` and `iso` were made for.
    second: i64,
    /// `$time_local` for `second`.
    local: String,
    /// RFC 3339 for `second`, its milliseconds left out: `2026-12-02T13:05:09+01:00`.
    iso: String,
    /// Where the milliseconds go in `iso`.
    iso_dot: usize,
}

impl LocalClock {
    pub(crate) fn new() -> LocalClock {
        LocalClock::in_zone(jiff::tz::TimeZone::system())
    }

    pub(crate) fn in_zone(tz: jiff::tz::TimeZone) -> LocalClock {
        LocalClock {
            tz,
            second: i64::MIN,
            local: String::new(),
            iso: String::new(),
            iso_dot: 0,
        }
    }

    /// `t`'s timestamp, with the texts of its second made when it is a new one.
    fn at(&mut self, t: SystemTime) -> jiff::Timestamp {
        let ts = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
        if ts.as_second() != self.second {
            let zoned = ts.to_zoned(self.tz.clone());
            self.local = zoned.strftime("%d/%b/%Y:%H:%M:%S %z").to_string();
            let mut iso = zoned.strftime("%Y-%m-%dT%H:%M:%S").to_string();
            self.iso_dot = iso.len();
            iso.push_str(&zoned.strftime("%:z").to_string());
            self.iso = iso;
            self.second = ts.as_second();
        }
        ts
    }

    /// `02/Dec/2026:13:05:09 +0100`, nginx's `$time_local`.
    fn time_local(&mut self, t: SystemTime) -> &str {
        self.at(t);
        &self.local
    }

    /// RFC 3339 with milliseconds and the local offset, `2026-12-02T13:05:09.120+01:00`, into
    /// `out`, which it empties first.
    fn iso(&mut self, t: SystemTime, out: &mut String) {
        let ms = self.at(t).subsec_millisecond().unsigned_abs();
        out.clear();
        out.push_str(&self.iso[..self.iso_dot]);
        out.push('.');
        for d in [ms / 100, ms / 10 % 10, ms % 10] {
            out.push(char::from(b'0' + d as u8));
        }
        out.push_str(&self.iso[self.iso_dot..]);
    }
}

/// What makes a writer's lines: its format and gateway name, and what consecutive lines share,
/// made once and reused rather than formatted again for each line: the time of the current
/// second, the text of the last peer and of the last fingerprint (a connection's requests come
/// together), the instance as the format writes it.
pub(crate) struct Lines {
    format: AccessLogFormat,
    instance: String,
    /// `instance` escaped for `combined`.
    instance_escaped: Vec<u8>,
    clock: LocalClock,
    peer: Option<IpAddr>,
    peer_text: String,
    fingerprint: Option<Fingerprint>,
    fingerprint_text: String,
    /// The JSON line's time.
    time: String,
}

impl Lines {
    pub(crate) fn new(format: AccessLogFormat, instance: &str, clock: LocalClock) -> Lines {
        let mut instance_escaped = Vec::new();
        escape(&mut instance_escaped, instance.as_bytes(), true);
        Lines {
            format,
            instance: instance.to_string(),
            instance_escaped,
            clock,
            peer: None,
            peer_text: String::new(),
            fingerprint: None,
            fingerprint_text: String::new(),
            time: String::new(),
        }
    }

    /// One line, newline included, at the end of `out`.
    pub(crate) fn render(&mut self, r: &AccessEntry, out: &mut Vec<u8>) {
        if self.peer != Some(r.peer) {
            self.peer = Some(r.peer);
            self.peer_text = r.peer.to_string();
        }
        if self.fingerprint != Some(r.fingerprint) {
            self.fingerprint = Some(r.fingerprint);
            self.fingerprint_text = r.fingerprint.to_string();
        }
        match self.format {
            AccessLogFormat::Combined => self.combined(r, out),
            AccessLogFormat::Json => self.json(r, out),
        }
    }
}

fn protocol(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/1.1",
    }
}

/// The target as the request line had it: an HTTP/2 request's path and query (its authority
/// is a pseudo-header, as nginx logs it), an HTTP/1 target whole.
fn target(uri: &Uri, version: Version) -> Cow<'_, str> {
    match (version, uri.path_and_query()) {
        (Version::HTTP_2, Some(pq)) => Cow::Borrowed(pq.as_str()),
        _ if uri.scheme().is_none() && uri.authority().is_none() => {
            Cow::Borrowed(uri.path_and_query().map_or("/", |pq| pq.as_str()))
        }
        _ => Cow::Owned(uri.to_string()),
    }
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Which bytes nginx escapes in a logged value: `"`, `\`, control bytes and bytes above 0x7E
/// (1), and a space too in a value that is not quoted (2).
const ESCAPED: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = if b == b'"' as usize || b == b'\\' as usize || b < 0x20 || b >= 0x7f {
            1
        } else if b == b' ' as usize {
            2
        } else {
            0
        };
        b += 1;
    }
    t
};

const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);

/// Whether any of the eight bytes of `w` is one [`escape`] escapes: below 0x20 or above 0x7E,
/// `"` or `\`, or, with `space`, a space. Each test is the high bit of `w`'s bytes minus or
/// exclusive-or a constant (the "has a zero byte" trick), so a value's bytes are looked at
/// eight at a time.
fn any_escaped(w: u64, space: bool) -> bool {
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let equal = |b: u8| zero(w ^ (ONES * u64::from(b)));
    let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGHS;
    let mut hit = below_space | (w & HIGHS) | equal(0x7f) | equal(b'"') | equal(b'\\');
    if space {
        hit |= equal(b' ');
    }
    hit != 0
}

/// Where in `v` the first byte is that [`escape`] escapes, if any: eight bytes at a time, then
/// the last few one by one.
fn first_escaped(v: &[u8], space: bool) -> Option<usize> {
    let mut i = 0;
    while let Some(w) = v.get(i..i + 8) {
        if any_escaped(u64::from_ne_bytes(w.try_into().unwrap_or_default()), space) {
            break;
        }
        i += 8;
    }
    let mask = if space { 3 } else { 1 };
    v[i..]
        .iter()
        .position(|&b| ESCAPED[b as usize] & mask != 0)
        .map(|at| i + at)
}

/// nginx's escaping of a logged value: `"`, `\`, control bytes and bytes above 0x7E as `\xHH`.
/// `space` too for a value that is not quoted, so it stays one field. Most values have nothing
/// to escape and are copied whole, in one go.
fn escape(out: &mut Vec<u8>, v: &[u8], space: bool) {
    let mut rest = v;
    while let Some(i) = first_escaped(rest, space) {
        let b = rest[i];
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(&[b'\\', b'x', HEX[(b >> 4) as usize], HEX[(b & 0xf) as usize]]);
        rest = &rest[i + 1..];
    }
    out.extend_from_slice(rest);
}

/// A number, or `-` when there is none.
fn number(out: &mut Vec<u8>, num: &mut itoa::Buffer, v: Option<u64>) {
    match v {
        Some(n) => out.extend_from_slice(num.format(n).as_bytes()),
        None => out.push(b'-'),
    }
}

/// A value, or `-` when there is none, as nginx logs an unset variable.
fn field(out: &mut Vec<u8>, v: Option<&[u8]>, space: bool) {
    match v {
        Some(v) => escape(out, v, space),
        None => out.push(b'-'),
    }
}

fn quoted(out: &mut Vec<u8>, v: Option<&[u8]>) {
    out.push(b'"');
    field(out, v, false);
    out.push(b'"');
}

/// A client's bytes for JSON: bytes that are not UTF-8 become U+FFFD.
fn text(v: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(v)
}

#[derive(serde::Serialize)]
struct JsonLine<'a> {
    time: &'a str,
    remote_addr: &'a str,
    remote_user: Option<&'a str>,
    request_method: &'a str,
    request_uri: Cow<'a, str>,
    server_protocol: &'static str,
    status: u16,
    body_bytes_sent: Option<u64>,
    http_referer: Option<Cow<'a, str>>,
    http_user_agent: Option<Cow<'a, str>>,
    request_id: Cow<'a, str>,
    route: Option<&'a str>,
    limit: Option<&'a str>,
    client_ip: Option<IpAddr>,
    fingerprint: &'a str,
    latency_us: u64,
    check_us: Option<u64>,
    path: Option<Cow<'a, str>>,
    instance: &'a str,
    rules_version: u64,
    cost_reported: Option<u64>,
    target: Option<&'a str>,
    attempts: u8,
}

impl Lines {
    /// `$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent
    /// "$http_referer" "$http_user_agent"`, then `request_id=… route="…" limit="…" client_ip=…
    /// fingerprint=… latency_us=… check_us=… path="…" instance=… rules_version=… cost_reported=…
    /// target=… attempts=…`.
    fn combined(&mut self, r: &AccessEntry, out: &mut Vec<u8>) {
        let mut num = itoa::Buffer::new();
        out.extend_from_slice(self.peer_text.as_bytes());
        out.extend_from_slice(b" - ");
        field(out, r.key_id.as_deref().map(str::as_bytes), true);
        out.extend_from_slice(b" [");
        out.extend_from_slice(self.clock.time_local(r.time).as_bytes());
        out.extend_from_slice(b"] \"");
        escape(out, r.method.as_str().as_bytes(), false);
        out.push(b' ');
        escape(out, r.target(), false);
        out.push(b' ');
        out.extend_from_slice(protocol(r.version).as_bytes());
        out.extend_from_slice(b"\" ");
        out.extend_from_slice(num.format(r.status).as_bytes());
        out.push(b' ');
        number(out, &mut num, r.body_bytes);
        out.push(b' ');
        quoted(out, r.referer());
        out.push(b' ');
        quoted(out, r.user_agent());
        out.extend_from_slice(b" request_id=");
        escape(out, r.request_id(), true);
        out.extend_from_slice(b" route=");
        quoted(out, r.route.as_deref().map(str::as_bytes));
        out.extend_from_slice(b" limit=");
        quoted(out, r.limit.as_deref().map(str::as_bytes));
        out.extend_from_slice(b" client_ip=");
        match r.client_ip.filter(|ip| *ip != r.peer) {
            Some(ip) => {
                let _ = write!(out, "{ip}");
            }
            None => out.push(b'-'),
        }
        out.extend_from_slice(b" fingerprint=");
        out.extend_from_slice(self.fingerprint_text.as_bytes());
        out.extend_from_slice(b" latency_us=");
        out.extend_from_slice(num.format(r.latency_us).as_bytes());
        out.extend_from_slice(b" check_us=");
        number(out, &mut num, r.check_us);
        out.extend_from_slice(b" path=");
        quoted(out, r.path());
        out.extend_from_slice(b" instance=");
        out.extend_from_slice(&self.instance_escaped);
        out.extend_from_slice(b" rules_version=");
        out.extend_from_slice(num.format(r.rules_version).as_bytes());
        out.extend_from_slice(b" cost_reported=");
        number(out, &mut num, r.cost_reported);
        out.extend_from_slice(b" target=");
        field(out, r.upstream_target.as_deref().map(str::as_bytes), true);
        out.extend_from_slice(b" attempts=");
        out.extend_from_slice(num.format(r.attempts).as_bytes());
        out.push(b'\n');
    }

    fn json(&mut self, r: &AccessEntry, out: &mut Vec<u8>) {
        self.clock.iso(r.time, &mut self.time);
        let line = JsonLine {
            time: &self.time,
            remote_addr: &self.peer_text,
            remote_user: r.key_id.as_deref(),
            request_method: r.method.as_str(),
            request_uri: text(r.target()),
            server_protocol: protocol(r.version),
            status: r.status,
            body_bytes_sent: r.body_bytes,
            http_referer: r.referer().map(text),
            http_user_agent: r.user_agent().map(text),
            request_id: text(r.request_id()),
            route: r.route.as_deref(),
            limit: r.limit.as_deref(),
            client_ip: r.client_ip.filter(|ip| *ip != r.peer),
            fingerprint: &self.fingerprint_text,
            latency_us: r.latency_us,
            check_us: r.check_us,
            path: r.path().map(text),
            instance: &self.instance,
            rules_version: r.rules_version,
            cost_reported: r.cost_reported,
            target: r.upstream_target.as_deref(),
            attempts: r.attempts,
        };
        let start = out.len();
        // Every field serializes: strings, numbers and addresses.
        if serde_json::to_writer(&mut *out, &line).is_ok() {
            out.push(b'\n');
        } else {
            out.truncate(start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Box<AccessEntry> {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_bytes(b"curl \"8\"\\x\xff\t").unwrap(),
        );
        let uri: Uri = "/v1/orders?id=7&q=%22".parse().unwrap();
        let mut r = AccessEntry::begin(
            "10.0.0.1".parse().unwrap(),
            Method::GET,
            &uri,
            Version::HTTP_11,
            &headers,
            Fingerprint::None,
        );
        r.time = SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_680_709_120);
        r.status = 429;
        r.body_bytes = Some(112);
        r.set_request_id(&HeaderValue::from_static("abc-1"));
        r.route = Some(Arc::from("GET /v1/orders"));
        r.limit = Some(Arc::from("per-key"));
        r.key_id = Some(Arc::from("k 7"));
        r.client_ip = Some("203.0.113.9".parse().unwrap());
        r.latency_us = 250;
        r.check_us = Some(1_764_680_709_119_875);
        r.set_path(b"/v1/orders?id=7&q=%22");
        r.rules_version = 3;
        r.cost_reported = Some(1200);
        r.upstream_target = Some(Arc::from("10.0.0.5:8080"));
        r.attempts = 2;
        r
    }

    fn zone() -> LocalClock {
        LocalClock::in_zone(jiff::tz::TimeZone::get("Asia/Kolkata").unwrap())
    }

    #[test]
    fn combined_escapes_as_nginx_and_appends_the_gateway_fields() {
        let mut out = Vec::new();
        Lines::new(AccessLogFormat::Combined, "gw 1", zone()).render(&record(), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "10.0.0.1 - k\\x207 [02/Dec/2025:18:35:09 +0530] \"GET /v1/orders?id=7&q=%22 HTTP/1.1\" \
             429 112 \"-\" \"curl \\x228\\x22\\x5Cx\\xFF\\x09\" request_id=abc-1 route=\"GET /v1/orders\" \
             limit=\"per-key\" client_ip=203.0.113.9 fingerprint=none latency_us=250 \
             check_us=1764680709119875 path=\"/v1/orders?id=7&q=%22\" instance=gw\\x201 rules_version=3 \
             cost_reported=1200 target=10.0.0.5:8080 attempts=2\n"
        );
    }

    #[test]
    fn combined_leaves_unknowns_as_dashes() {
        let mut r = record();
        r.body_bytes = None;
        r.route = None;
        r.limit = None;
        r.key_id = None;
        r.client_ip = Some(r.peer);
        r.user_agent = None;
        r.referer = None;
        r.check_us = None;
        r.path = None;
        r.cost_reported = None;
        r.upstream_target = None;
        r.attempts = 0;
        let mut out = Vec::new();
        Lines::new(AccessLogFormat::Combined, "gw", zone()).render(&r, &mut out);
        let line = String::from_utf8(out).unwrap();
        assert!(
            line.starts_with("10.0.0.1 - - [") && line.contains("\" 429 - \"-\" \"-\" request_id="),
            "{line}"
        );
        assert!(line.contains("route=\"-\" limit=\"-\" client_ip=- "), "{line}");
        assert!(
            line.ends_with(
                " check_us=- path=\"-\" instance=gw rules_version=3 cost_reported=- target=- attempts=0\n"
            ),
            "{line}"
        );
    }

    #[test]
    fn json_has_the_stable_names() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_bytes(b"curl \"8\"\\x\xff").unwrap(),
        );
        let uri: Uri = "https://api.example/v1/x?y=1".parse().unwrap();
        let mut r = AccessEntry::begin(
            "10.0.0.1".parse().unwrap(),
            Method::GET,
            &uri,
            Version::HTTP_2,
            &headers,
            Fingerprint::None,
        );
        let full = record();
        r.time = full.time;
        r.status = 429;
        r.body_bytes = Some(112);
        r.set_request_id(&HeaderValue::from_static("abc-1"));
        r.route = full.route.clone();
        r.limit = full.limit.clone();
        r.key_id = full.key_id.clone();
        r.client_ip = full.client_ip;
        r.latency_us = 250;
        r.check_us = full.check_us;
        r.set_path(b"/v1/x?y=1");
        r.rules_version = 3;
        r.upstream_target = full.upstream_target.clone();
        r.attempts = 2;
        let mut out = Vec::new();
        Lines::new(AccessLogFormat::Json, "gw-1", zone()).render(&r, &mut out);
        assert_eq!(out.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["time"], "2025-12-02T18:35:09.120+05:30");
        assert_eq!(v["remote_addr"], "10.0.0.1");
        assert_eq!(v["remote_user"], "k 7");
        assert_eq!(v["request_method"], "GET");
        assert_eq!(v["request_uri"], "/v1/x?y=1");
        assert_eq!(v["server_protocol"], "HTTP/2.0");
        assert_eq!(v["status"], 429);
        assert_eq!(v["body_bytes_sent"], 112);
        assert_eq!(v["http_referer"], serde_json::Value::Null);
        assert_eq!(v["http_user_agent"], "curl \"8\"\\x\u{fffd}");
        assert_eq!(v["request_id"], "abc-1");
        assert_eq!(v["route"], "GET /v1/orders");
        assert_eq!(v["limit"], "per-key");
        assert_eq!(v["client_ip"], "203.0.113.9");
        assert_eq!(v["fingerprint"], "none");
        assert_eq!(v["latency_us"], 250);
        assert_eq!(v["check_us"], 1_764_680_709_119_875u64);
        assert_eq!(v["path"], "/v1/x?y=1");
        assert_eq!(v["instance"], "gw-1");
        assert_eq!(v["rules_version"], 3);
        assert_eq!(v["cost_reported"], serde_json::Value::Null);
        assert_eq!(v["target"], "10.0.0.5:8080");
        assert_eq!(v["attempts"], 2);
        assert_eq!(v.as_object().unwrap().len(), 23);
    }

    /// Eight at a time or one by one, the same bytes are escaped: every byte value at every
    /// place of a word and in the tail, quoted and not.
    #[test]
    fn escaping_in_words_agrees_with_byte_by_byte() {
        let by_byte = |v: &[u8], space: bool| {
            let mut out = Vec::new();
            for &b in v {
                if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) || (space && b == b' ') {
                    out.extend_from_slice(&[b'\\', b'x', HEX[(b >> 4) as usize], HEX[(b & 0xf) as usize]]);
                } else {
                    out.push(b);
                }
            }
            out
        };
        for b in 0..=255u8 {
            for at in [0, 3, 7, 8, 12, 16, 19] {
                let mut v = b"abcdefghijklmnopqrst".to_vec();
                v[at] = b;
                for space in [false, true] {
                    let mut out = Vec::new();
                    escape(&mut out, &v, space);
                    assert_eq!(out, by_byte(&v, space), "byte {b:#x} at {at}, space {space}");
                }
            }
        }
    }

    /// The texts kept from line to line (the second's time, the peer, the fingerprint) are
    /// those of each line's own record, whichever line came before.
    #[test]
    fn what_lines_share_is_made_again_when_it_changes() {
        let tz = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        let mut lines = Lines::new(AccessLogFormat::Json, "gw", LocalClock::in_zone(tz.clone()));
        // Across the change to summer time, a millisecond before and after seconds, and peers
        // and fingerprints that change and come back.
        let change = 1_774_746_000_000u64; // 2026-03-29T01:00:00Z
        let times = [0, 1, 999, 1000, 1001, 59_999, 3_600_000]
            .into_iter()
            .flat_map(|d| [change - d, change + d]);
        let peers = ["10.0.0.1", "::1", "10.0.0.1", "203.0.113.9"];
        let prints = [
            Fingerprint::None,
            Fingerprint::Hello([0xab; 8]),
            Fingerprint::Unparsed,
        ];
        for (i, ms) in times.enumerate() {
            let mut r = record();
            r.time = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
            r.peer = peers[i % peers.len()].parse().unwrap();
            r.fingerprint = prints[i % prints.len()];
            let mut out = Vec::new();
            lines.render(&r, &mut out);
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            let want = jiff::Timestamp::try_from(r.time)
                .unwrap()
                .to_zoned(tz.clone())
                .strftime("%Y-%m-%dT%H:%M:%S%.3f%:z")
                .to_string();
            assert_eq!(v["time"], want, "{ms}");
            assert_eq!(v["remote_addr"], r.peer.to_string(), "{ms}");
            assert_eq!(v["fingerprint"], r.fingerprint.to_string(), "{ms}");
        }
    }

    #[test]
    fn json_says_null_and_0_when_no_upstream_was_asked() {
        let mut r = record();
        r.upstream_target = None;
        r.attempts = 0;
        let mut out = Vec::new();
        Lines::new(AccessLogFormat::Json, "gw", zone()).render(&r, &mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["target"], serde_json::Value::Null);
        assert_eq!(v["attempts"], 0);
    }

    #[test]
    fn a_full_channel_drops_and_counts_and_the_flush_writes_the_rest() {
        #[derive(Clone, Default)]
        struct Shared(Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        // A writer held up until the test lets it go, so the channel fills.
        let gate = Arc::new(std::sync::Mutex::new(()));
        struct Gated(Shared, Arc<std::sync::Mutex<()>>);
        impl Write for Gated {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                let _open = self.1.lock().unwrap();
                self.0.write(b)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let written = Shared::default();
        let held = gate.lock().unwrap();
        let (log, flush) = start(
            AccessLogFormat::Combined,
            2,
            "gw".into(),
            Gated(written.clone(), gate.clone()),
        )
        .unwrap();
        for _ in 0..10 {
            log.send(record());
        }
        // The writer took at most one record off the channel before blocking: 2 wait, one is
        // being written, the rest were dropped.
        assert!(log.dropped() >= 7, "dropped {}", log.dropped());
        drop(held);
        drop(flush);
        let lines = written.0.lock().unwrap().split(|b| *b == b'\n').count() - 1;
        assert_eq!(lines as u64 + log.dropped(), 10);
    }
}
