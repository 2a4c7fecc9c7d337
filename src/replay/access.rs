//! The gateway's access lines read back: a JSON line (`--access-log-format json`) or a combined
//! line (`--access-log-format combined`) into the fields a replay needs, borrowed from the line
//! wherever no escape has to be undone. Anything else is not an access line: `None`.

use std::borrow::Cow;

use serde::Deserialize;

use super::lines::{MAX_ADDRESS, MAX_FINGERPRINT, MAX_KEY_ID, MAX_METHOD, MAX_NAME, MAX_PATH, MAX_STATUS};

/// A field that a gateway older than it does not write at all, beside one it wrote as none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Logged<T> {
    /// Not in the line.
    #[default]
    Absent,
    /// `null` in JSON, `-` in combined.
    Null,
    Value(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Logged<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.map_or(Logged::Null, Logged::Value))
    }
}

/// One access line's fields that a replay reads; the others are skipped unread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessLine<'a> {
    pub remote_addr: Cow<'a, str>,
    /// The caller's key id; `None` when the request had no valid key.
    pub remote_user: Option<Cow<'a, str>>,
    pub request_method: Cow<'a, str>,
    pub status: u16,
    /// The client's address after trusted proxies; `None` when it is `remote_addr`.
    pub client_ip: Option<Cow<'a, str>>,
    /// `none`, `unparsed` or 16 hex digits.
    pub fingerprint: Option<Cow<'a, str>>,
    /// µs since the Unix epoch that the limiter's check used; `Null` when no check was made.
    pub check_us: Logged<u64>,
    /// The canonical path the gateway routed, with the query as sent.
    pub path: Option<Cow<'a, str>>,
    pub instance: Option<Cow<'a, str>>,
    pub rules_version: Option<u64>,
    /// What the upstream's answer reported for a post-paid limit.
    pub cost_reported: Option<u64>,
}

impl AccessLine<'_> {
    /// The first field longer than its bound, which no gateway writes. Numbers need none: a
    /// number too large for its type is no access line.
    pub fn over_bound(&self) -> Option<&'static str> {
        let over = |v: Option<&str>, max: usize| v.is_some_and(|v| v.len() > max);
        [
            ("remote_addr", over(Some(&self.remote_addr), MAX_ADDRESS)),
            ("remote_user", over(self.remote_user.as_deref(), MAX_KEY_ID)),
            ("request_method", over(Some(&self.request_method), MAX_METHOD)),
            ("client_ip", over(self.client_ip.as_deref(), MAX_ADDRESS)),
            ("fingerprint", over(self.fingerprint.as_deref(), MAX_FINGERPRINT)),
            ("path", over(self.path.as_deref(), MAX_PATH)),
            ("instance", over(self.instance.as_deref(), MAX_NAME)),
        ]
        .into_iter()
        .find_map(|(name, over)| over.then_some(name))
    }
}

/// Text borrowed from the line when JSON needed no unescaping. `Option<Cow<str>>` would not
/// borrow: serde's `Cow` always copies unless it is the field itself.
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

fn text(t: Option<Text<'_>>) -> Option<Cow<'_, str>> {
    t.map(|t| t.0)
}

#[derive(Deserialize)]
struct JsonLine<'a> {
    #[serde(borrow)]
    remote_addr: Text<'a>,
    #[serde(borrow, default)]
    remote_user: Option<Text<'a>>,
    #[serde(borrow)]
    request_method: Text<'a>,
    status: u16,
    #[serde(borrow, default)]
    client_ip: Option<Text<'a>>,
    #[serde(borrow, default)]
    fingerprint: Option<Text<'a>>,
    #[serde(default)]
    check_us: Logged<u64>,
    #[serde(borrow, default)]
    path: Option<Text<'a>>,
    #[serde(borrow, default)]
    instance: Option<Text<'a>>,
    #[serde(default)]
    rules_version: Option<u64>,
    #[serde(default)]
    cost_reported: Option<u64>,
}

/// A JSON access line; `None` for any other line, the gateway's own JSON log lines included
/// (they have no `remote_addr`, `request_method` or `status`).
pub fn parse_json(line: &[u8]) -> Option<AccessLine<'_>> {
    let j: JsonLine<'_> = serde_json::from_slice(line).ok()?;
    if j.status > MAX_STATUS {
        return None;
    }
    Some(AccessLine {
        remote_addr: j.remote_addr.0,
        remote_user: text(j.remote_user),
        request_method: j.request_method.0,
        status: j.status,
        client_ip: text(j.client_ip),
        fingerprint: text(j.fingerprint),
        check_us: j.check_us,
        path: text(j.path),
        instance: text(j.instance),
        rules_version: j.rules_version,
        cost_reported: j.cost_reported,
    })
}

/// Reads a combined line left to right.
struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        (self.s.get(self.i) == Some(&b)).then(|| self.i += 1)
    }

    /// The bytes up to `end` (not included, but consumed), or `None` when it never comes.
    fn until(&mut self, end: u8) -> Option<&'a [u8]> {
        let rest = &self.s[self.i..];
        let n = rest.iter().position(|&b| b == end)?;
        self.i += n + 1;
        Some(&rest[..n])
    }

    /// A non-empty word ended by a space, which is consumed.
    fn word(&mut self) -> Option<&'a [u8]> {
        self.until(b' ').filter(|w| !w.is_empty())
    }

    /// A word ended by a space or the line's end; the space is left.
    fn last_word(&mut self) -> &'a [u8] {
        let rest = &self.s[self.i..];
        let n = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
        self.i += n;
        &rest[..n]
    }

    /// `"…"`: nginx writes a quote inside as `\x22`, so the next quote ends it.
    fn quoted(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        self.until(b'"')
    }
}

/// A value with nginx's `\xHH` escapes undone; bytes that are not UTF-8 become U+FFFD.
fn unescape(v: &[u8]) -> Cow<'_, str> {
    if !v.contains(&b'\\') {
        return String::from_utf8_lossy(v);
    }
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i] == b'\\'
            && v.get(i + 1) == Some(&b'x')
            && let (Some(h), Some(l)) = (
                v.get(i + 2).and_then(|&b| hex(b)),
                v.get(i + 3).and_then(|&b| hex(b)),
            )
        {
            out.push(h << 4 | l);
            i += 4;
        } else {
            out.push(v[i]);
            i += 1;
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// `-` is nginx's "none".
fn value(v: &[u8]) -> Option<Cow<'_, str>> {
    (v != b"-").then(|| unescape(v))
}

fn number(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0, |n, &d| n * 10 + u64::from(d - b'0')))
}

/// A number or `-`; `Err` for anything else, which makes the line no access line.
fn maybe_number(v: &[u8]) -> Result<Option<u64>, ()> {
    if v == b"-" {
        return Ok(None);
    }
    number(v).map(Some).ok_or(())
}

/// A combined access line: nginx's combined format, then Tollgate's `name=value` fields, of
/// which `latency_us` tells it from a plain nginx line. `None` for any other line.
pub fn parse_combined(line: &[u8]) -> Option<AccessLine<'_>> {
    let mut c = Cursor { s: line, i: 0 };
    let remote_addr = c.word()?;
    c.word()?;
    let remote_user = c.word()?;
    c.expect(b'[')?;
    c.until(b']')?;
    c.expect(b' ')?;
    let request = c.quoted()?;
    c.expect(b' ')?;
    let status = number(c.word()?).filter(|s| *s <= u64::from(MAX_STATUS))? as u16;
    c.word()?;
    c.quoted()?;
    c.expect(b' ')?;
    c.quoted()?;
    let method = &request[..request.iter().position(|&b| b == b' ')?];
    if method.is_empty() {
        return None;
    }
    let mut out = AccessLine {
        remote_addr: unescape(remote_addr),
        remote_user: value(remote_user),
        request_method: unescape(method),
        status,
        client_ip: None,
        fingerprint: None,
        check_us: Logged::Absent,
        path: None,
        instance: None,
        rules_version: None,
        cost_reported: None,
    };
    let mut tollgate = false;
    while !c.done() {
        c.expect(b' ')?;
        let name = c.until(b'=')?;
        let v = if c.s.get(c.i) == Some(&b'"') {
            c.quoted()?
        } else {
            c.last_word()
        };
        match name {
            b"client_ip" => out.client_ip = value(v),
            b"fingerprint" => out.fingerprint = value(v),
            b"latency_us" => tollgate = number(v).is_some(),
            b"check_us" => {
                out.check_us = match maybe_number(v).ok()? {
                    Some(t) => Logged::Value(t),
                    None => Logged::Null,
                }
            }
            b"path" => out.path = value(v),
            b"instance" => out.instance = value(v),
            b"rules_version" => out.rules_version = maybe_number(v).ok()?,
            b"cost_reported" => out.cost_reported = maybe_number(v).ok()?,
            _ => {}
        }
    }
    tollgate.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{"time":"2026-12-06T22:40:01.123+00:00","remote_addr":"127.0.0.1","remote_user":"k-7","request_method":"GET","request_uri":"/v1/orders","server_protocol":"HTTP/1.1","status":200,"body_bytes_sent":312,"http_referer":null,"http_user_agent":"curl/7.88.1","request_id":"abc","route":"orders","limit":"plan","client_ip":null,"fingerprint":"none","latency_us":850,"check_us":1765060801122456,"path":"/v1/orders","instance":"gw-1","rules_version":1,"cost_reported":null}"#;
    const COMBINED: &str = r#"127.0.0.1 - k-7 [06/Dec/2026:22:40:01 +0000] "GET /v1/orders HTTP/1.1" 200 312 "-" "curl/7.88.1" request_id=abc route="orders" limit="plan" client_ip=- fingerprint=none latency_us=850 check_us=1765060801122456 path="/v1/orders" instance=gw-1 rules_version=1 cost_reported=-"#;

    fn example() -> AccessLine<'static> {
        AccessLine {
            remote_addr: "127.0.0.1".into(),
            remote_user: Some("k-7".into()),
            request_method: "GET".into(),
            status: 200,
            client_ip: None,
            fingerprint: Some("none".into()),
            check_us: Logged::Value(1_765_060_801_122_456),
            path: Some("/v1/orders".into()),
            instance: Some("gw-1".into()),
            rules_version: Some(1),
            cost_reported: None,
        }
    }

    #[test]
    fn both_formats_read_the_example_line_alike() {
        assert_eq!(parse_json(JSON.as_bytes()), Some(example()));
        assert_eq!(parse_combined(COMBINED.as_bytes()), Some(example()));
    }

    #[test]
    fn json_borrows_what_needs_no_unescaping() {
        let line = parse_json(JSON.as_bytes()).unwrap();
        assert!(matches!(line.remote_user, Some(Cow::Borrowed(_))));
        assert!(matches!(line.path, Some(Cow::Borrowed(_))));
        let escaped = JSON.replace(r#""remote_user":"k-7""#, r#""remote_user":"k\"7""#);
        assert_eq!(
            parse_json(escaped.as_bytes()).unwrap().remote_user.as_deref(),
            Some("k\"7")
        );
    }

    #[test]
    fn combined_undoes_nginx_escapes() {
        let line = COMBINED
            .replace("- k-7 [", r"- k\x207\x5C [")
            .replace(r#"path="/v1/orders""#, r#"path="/v1/\x22q\x22?a=\xC3\xA9""#)
            .replace("instance=gw-1", r"instance=gw\x201")
            .replace(r#""curl/7.88.1""#, r#""curl \x228\x22 \xFF""#);
        let l = parse_combined(line.as_bytes()).unwrap();
        assert_eq!(l.remote_user.as_deref(), Some("k 7\\"));
        assert_eq!(l.path.as_deref(), Some("/v1/\"q\"?a=é"));
        assert_eq!(l.instance.as_deref(), Some("gw 1"));
        assert!(matches!(l.request_method, Cow::Borrowed("GET")));
    }

    #[test]
    fn dashes_and_nulls_are_none() {
        let combined = COMBINED
            .replace("- k-7 [", "- - [")
            .replace("check_us=1765060801122456", "check_us=-")
            .replace(r#"path="/v1/orders""#, r#"path="-""#)
            .replace("client_ip=-", "client_ip=10.1.2.3")
            .replace("cost_reported=-", "cost_reported=42");
        let json = JSON
            .replace(r#""remote_user":"k-7""#, r#""remote_user":null"#)
            .replace(r#""check_us":1765060801122456"#, r#""check_us":null"#)
            .replace(r#""path":"/v1/orders""#, r#""path":null"#)
            .replace(r#""client_ip":null"#, r#""client_ip":"10.1.2.3""#)
            .replace(r#""cost_reported":null"#, r#""cost_reported":42"#);
        for l in [
            parse_combined(combined.as_bytes()).unwrap(),
            parse_json(json.as_bytes()).unwrap(),
        ] {
            assert_eq!(l.remote_user, None);
            assert_eq!(l.check_us, Logged::Null);
            assert_eq!(l.path, None);
            assert_eq!(l.client_ip.as_deref(), Some("10.1.2.3"));
            assert_eq!(l.cost_reported, Some(42));
        }
    }

    #[test]
    fn lines_of_an_older_gateway_have_no_check_us() {
        let combined = &COMBINED[..COMBINED.find(" check_us=").unwrap()];
        let json = JSON.replace(r#""check_us":1765060801122456,"#, "");
        for l in [
            parse_combined(combined.as_bytes()).unwrap(),
            parse_json(json.as_bytes()).unwrap(),
        ] {
            assert_eq!(l.check_us, Logged::Absent);
        }
    }

    #[test]
    fn each_field_has_a_bound() {
        assert_eq!(example().over_bound(), None);
        let at = |n: usize| "k".repeat(n);
        let mut l = example();
        l.remote_user = Some(at(MAX_KEY_ID).into());
        assert_eq!(l.over_bound(), None, "a key id at its bound");
        l.remote_user = Some(at(MAX_KEY_ID + 1).into());
        assert_eq!(l.over_bound(), Some("remote_user"));
        type Set = fn(&mut AccessLine<'static>, String);
        let cases: [(&str, Set); 7] = [
            ("remote_addr", |l, v| l.remote_addr = v.into()),
            ("remote_user", |l, v| l.remote_user = Some(v.into())),
            ("request_method", |l, v| l.request_method = v.into()),
            ("client_ip", |l, v| l.client_ip = Some(v.into())),
            ("fingerprint", |l, v| l.fingerprint = Some(v.into())),
            ("path", |l, v| l.path = Some(format!("/{v}").into())),
            ("instance", |l, v| l.instance = Some(v.into())),
        ];
        for (name, set) in cases {
            let mut l = example();
            set(&mut l, at(MAX_PATH + 1));
            assert_eq!(l.over_bound(), Some(name));
        }
        // Read from a line, as the replay reads them.
        let key = at(MAX_KEY_ID + 1);
        let json = JSON.replace(r#""remote_user":"k-7""#, &format!(r#""remote_user":"{key}""#));
        let combined = COMBINED.replace("- k-7 [", &format!("- {key} ["));
        for l in [parse_json(json.as_bytes()), parse_combined(combined.as_bytes())] {
            assert_eq!(l.unwrap().over_bound(), Some("remote_user"));
        }
    }

    #[test]
    fn other_lines_are_not_access_lines() {
        let garbage = [
            "2026-12-06T22:40:01.000Z  INFO tollgate: listening on 127.0.0.1:8080",
            r#"{"timestamp":"2026-12-06T22:40:01Z","level":"INFO","fields":{"message":"listening"}}"#,
            "not a log line at all",
            "",
            // nginx's own combined line, without Tollgate's fields.
            r#"127.0.0.1 - - [06/Dec/2026:22:40:01 +0000] "GET / HTTP/1.1" 200 612 "-" "curl/7.88.1""#,
            // A bad number.
            &COMBINED.replace("check_us=1765060801122456", "check_us=12x"),
            &COMBINED.replace("\" 200 312", "\" 2000 312"),
            &JSON.replace(r#""status":200"#, r#""status":"200""#),
            &JSON.replace(r#""status":200"#, r#""status":1000"#),
        ];
        for g in garbage {
            assert_eq!(parse_combined(g.as_bytes()), None, "{g}");
            assert_eq!(parse_json(g.as_bytes()), None, "{g}");
        }
        // Cut short anywhere before its Tollgate fields, neither reads it.
        for cut in [10, 40, 80, COMBINED.find("latency_us").unwrap()] {
            assert_eq!(parse_combined(&COMBINED.as_bytes()[..cut]), None, "{cut}");
        }
        for cut in [1, 100, JSON.len() - 1] {
            assert_eq!(parse_json(&JSON.as_bytes()[..cut]), None, "{cut}");
        }
    }
}
