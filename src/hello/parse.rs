//! TLS records to one ClientHello: the handshake records at the start of a connection, joined
//! and read as far as the fingerprint needs, within fixed bounds.
//!
//! The gateway peeks at the socket and may see only a prefix of what the client sent, so a
//! short input is [`Read::Partial`] with how many bytes are needed, never an error. What this
//! reader can't follow is [`Read::Unparsed`] with the reason; rustls, not this reader, decides
//! whether the handshake goes on.

use std::borrow::Cow;

/// The largest ClientHello read (the handshake message's body). Browsers send under 2 KiB,
/// post-quantum key shares included; rustls refuses larger handshake messages anyway.
pub const MAX_HELLO: usize = 16 * 1024;
/// The most records a ClientHello may be split over. A client splits only a hello larger than
/// one record (16 KiB); more records than this is someone probing the reader.
pub const MAX_RECORDS: usize = 16;
const RECORD_HEADER: usize = 5;
/// A plaintext record's most payload (RFC 8446 §5.1).
const MAX_FRAGMENT: usize = 1 << 14;
const HANDSHAKE_HEADER: usize = 4;
/// The most bytes [`read`] ever asks for: a whole hello in its records.
pub const MAX_PEEK: usize = HANDSHAKE_HEADER + MAX_HELLO + MAX_RECORDS * RECORD_HEADER;

const CONTENT_HANDSHAKE: u8 = 22;
const CLIENT_HELLO: u8 = 1;
const EXT_SIGNATURE_ALGORITHMS: u16 = 0x000d;
const EXT_ALPN: u16 = 0x0010;
const EXT_SUPPORTED_VERSIONS: u16 = 0x002b;

/// What the first bytes of a connection say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// A whole ClientHello.
    Hello(ClientHello),
    /// A ClientHello so far: nothing more can be said before `needed` bytes in all (never more
    /// than [`MAX_PEEK`]).
    Partial { needed: usize },
    /// Not a ClientHello this reader can follow.
    Unparsed(Unparsed),
}

/// Why a connection's first bytes are not a ClientHello this reader can follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unparsed {
    #[error("not a TLS handshake record")]
    NotTls,
    #[error("the first handshake message is not a ClientHello")]
    NotClientHello,
    #[error("the ClientHello is longer than {MAX_HELLO} bytes")]
    TooLarge,
    #[error("the ClientHello is split over more than {MAX_RECORDS} records")]
    TooFragmented,
    #[error("malformed ClientHello: {0}")]
    Malformed(&'static str),
}

/// The parts of a ClientHello a fingerprint is made of, in the order the client sent them,
/// GREASE values (RFC 8701) left out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientHello {
    /// The hello's `legacy_version` field.
    pub legacy_version: u16,
    /// The `supported_versions` extension's list; empty without the extension.
    pub supported_versions: Vec<u16>,
    pub cipher_suites: Vec<u16>,
    /// Extension types.
    pub extensions: Vec<u16>,
    /// The `signature_algorithms` extension's list.
    pub signature_schemes: Vec<u16>,
    /// The ALPN extension's protocol names.
    pub alpn: Vec<Vec<u8>>,
}

impl ClientHello {
    /// The highest protocol version offered: from `supported_versions` when the client sent
    /// it (TLS 1.3 clients keep `legacy_version` at 1.2), else `legacy_version`.
    pub fn version(&self) -> u16 {
        self.supported_versions
            .iter()
            .copied()
            .max()
            .unwrap_or(self.legacy_version)
    }
}

/// A GREASE value (RFC 8701): 0x0a0a, 0x1a1a, … 0xfafa. Clients pick one at random per
/// connection, so a fingerprint must not see them.
pub fn is_grease(v: u16) -> bool {
    v >> 8 == v & 0xff && v & 0x0f == 0x0a
}

/// Reads the first bytes of a connection.
pub fn read(bytes: &[u8]) -> Read {
    match handshake_message(bytes) {
        Ok(body) => match hello(&body) {
            Ok(h) => Read::Hello(h),
            Err(e) => Read::Unparsed(e),
        },
        Err(Short::Needs(needed)) => Read::Partial { needed },
        Err(Short::Unparsed(e)) => Read::Unparsed(e),
    }
}

/// Why the records don't give a whole handshake message.
enum Short {
    Needs(usize),
    Unparsed(Unparsed),
}

fn partial(needed: usize) -> Short {
    if needed > MAX_PEEK {
        Short::Unparsed(Unparsed::TooLarge)
    } else {
        Short::Needs(needed)
    }
}

/// The body of the first handshake message, joined from as many records as it spans.
fn handshake_message(bytes: &[u8]) -> Result<Cow<'_, [u8]>, Short> {
    let mut at = 0;
    let mut records = 0;
    // The usual hello fits one record and is borrowed; a split one is joined.
    let mut first: &[u8] = &[];
    let mut joined: Option<Vec<u8>> = None;
    loop {
        let msg = joined.as_deref().unwrap_or(first);
        if msg.first().is_some_and(|&t| t != CLIENT_HELLO) {
            return Err(Short::Unparsed(Unparsed::NotClientHello));
        }
        if msg.len() >= HANDSHAKE_HEADER {
            let len = u32::from_be_bytes([0, msg[1], msg[2], msg[3]]) as usize;
            if len > MAX_HELLO {
                return Err(Short::Unparsed(Unparsed::TooLarge));
            }
            let end = HANDSHAKE_HEADER + len;
            if msg.len() >= end {
                return Ok(match joined {
                    None => Cow::Borrowed(&first[HANDSHAKE_HEADER..end]),
                    Some(mut j) => {
                        j.truncate(end);
                        j.drain(..HANDSHAKE_HEADER);
                        Cow::Owned(j)
                    }
                });
            }
        }
        if records == MAX_RECORDS {
            return Err(Short::Unparsed(Unparsed::TooFragmented));
        }
        // The header's bytes are judged as they arrive, so what is not TLS at all (plain HTTP
        // to the TLS port) is known from its first byte.
        let header = &bytes[at.min(bytes.len())..bytes.len().min(at + RECORD_HEADER)];
        if header.first().is_some_and(|&t| t != CONTENT_HANDSHAKE) {
            return Err(Short::Unparsed(if at == 0 {
                Unparsed::NotTls
            } else {
                Unparsed::Malformed("a record other than a handshake inside the ClientHello")
            }));
        }
        if header.get(1).is_some_and(|&major| major != 3) {
            return Err(Short::Unparsed(Unparsed::NotTls));
        }
        if header.len() < RECORD_HEADER {
            return Err(partial(at + RECORD_HEADER));
        }
        let len = u16::from_be_bytes([header[3], header[4]]) as usize;
        if len == 0 {
            return Err(Short::Unparsed(Unparsed::Malformed("an empty handshake record")));
        }
        if len > MAX_FRAGMENT {
            return Err(Short::Unparsed(Unparsed::Malformed(
                "a record longer than 16 KiB",
            )));
        }
        let end = at + RECORD_HEADER + len;
        let Some(fragment) = bytes.get(at + RECORD_HEADER..end) else {
            return Err(partial(end));
        };
        records += 1;
        if records == 1 {
            first = fragment;
        } else {
            joined
                .get_or_insert_with(|| first.to_vec())
                .extend_from_slice(fragment);
        }
        at = end;
    }
}

/// Reads a ClientHello's body (RFC 8446 §4.1.2; TLS 1.2's is the same shape).
fn hello(body: &[u8]) -> Result<ClientHello, Unparsed> {
    let mut c = Cursor(body);
    let mut h = ClientHello {
        legacy_version: c.u16("no version")?,
        ..ClientHello::default()
    };
    c.take(32, "a short random")?;
    if c.vec8("a cut session id")?.0.len() > 32 {
        return Err(Unparsed::Malformed("a session id longer than 32 bytes"));
    }
    let suites = c.vec16("cut cipher suites")?;
    if suites.0.is_empty() {
        return Err(Unparsed::Malformed("no cipher suites"));
    }
    h.cipher_suites = suites.u16s("an odd length of cipher suites")?;
    if c.vec8("cut compression methods")?.0.is_empty() {
        return Err(Unparsed::Malformed("no compression methods"));
    }
    // TLS 1.2 lets a hello end here, without extensions.
    if c.0.is_empty() {
        return Ok(h);
    }
    let mut exts = c.vec16("cut extensions")?;
    if !c.0.is_empty() {
        return Err(Unparsed::Malformed("bytes after the extensions"));
    }
    while !exts.0.is_empty() {
        let ty = exts.u16("a cut extension type")?;
        let mut data = exts.vec16("a cut extension")?;
        if !is_grease(ty) {
            h.extensions.push(ty);
        }
        match ty {
            EXT_SUPPORTED_VERSIONS => {
                h.supported_versions = data
                    .vec8("cut supported_versions")?
                    .u16s("an odd length of supported_versions")?;
            }
            EXT_SIGNATURE_ALGORITHMS => {
                h.signature_schemes = data
                    .vec16("cut signature_algorithms")?
                    .u16s("an odd length of signature_algorithms")?;
            }
            EXT_ALPN => {
                let mut names = data.vec16("cut ALPN")?;
                h.alpn.clear();
                while !names.0.is_empty() {
                    let name = names.vec8("a cut ALPN protocol name")?;
                    if name.0.is_empty() {
                        return Err(Unparsed::Malformed("an empty ALPN protocol name"));
                    }
                    h.alpn.push(name.0.to_vec());
                }
            }
            _ => {}
        }
    }
    Ok(h)
}

/// The unread rest of a message; every read is checked, so short input is an error.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Unparsed> {
        if self.0.len() < n {
            return Err(Unparsed::Malformed(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, Unparsed> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, Unparsed> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a one-byte length.
    fn vec8(&mut self, what: &'static str) -> Result<Cursor<'a>, Unparsed> {
        let n = self.u8(what)? as usize;
        Ok(Cursor(self.take(n, what)?))
    }

    /// A vector with a two-byte length.
    fn vec16(&mut self, what: &'static str) -> Result<Cursor<'a>, Unparsed> {
        let n = self.u16(what)? as usize;
        Ok(Cursor(self.take(n, what)?))
    }

    /// The rest as two-byte values, GREASE left out.
    fn u16s(self, what: &'static str) -> Result<Vec<u16>, Unparsed> {
        if !self.0.len().is_multiple_of(2) {
            return Err(Unparsed::Malformed(what));
        }
        Ok(self
            .0
            .chunks_exact(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .filter(|&v| !is_grease(v))
            .collect())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A ClientHello's handshake message, written field by field.
    #[derive(Clone, Debug)]
    pub(crate) struct Hello {
        pub version: u16,
        pub suites: Vec<u16>,
        /// (type, data) in the order sent.
        pub extensions: Vec<(u16, Vec<u8>)>,
    }

    fn vec8(b: &[u8]) -> Vec<u8> {
        let mut v = vec![b.len() as u8];
        v.extend_from_slice(b);
        v
    }

    fn vec16(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    fn u16s(vals: &[u16]) -> Vec<u8> {
        vals.iter().flat_map(|v| v.to_be_bytes()).collect()
    }

    pub(crate) fn versions_ext(vals: &[u16]) -> (u16, Vec<u8>) {
        (EXT_SUPPORTED_VERSIONS, vec8(&u16s(vals)))
    }

    pub(crate) fn sigs_ext(vals: &[u16]) -> (u16, Vec<u8>) {
        (EXT_SIGNATURE_ALGORITHMS, vec16(&u16s(vals)))
    }

    pub(crate) fn alpn_ext(names: &[&[u8]]) -> (u16, Vec<u8>) {
        let list: Vec<u8> = names.iter().flat_map(|n| vec8(n)).collect();
        (EXT_ALPN, vec16(&list))
    }

    impl Hello {
        /// A TLS 1.3 hello in the manner of a browser.
        pub(crate) fn browser() -> Hello {
            Hello {
                version: 0x0303,
                suites: vec![0x1301, 0x1302, 0x1303, 0xc02b, 0xc02f],
                extensions: vec![
                    (0x0000, vec16(&vec8(b"example.com"))),
                    (0x000a, vec16(&u16s(&[0x001d, 0x0017]))),
                    sigs_ext(&[0x0403, 0x0804, 0x0401]),
                    alpn_ext(&[b"h2", b"http/1.1"]),
                    versions_ext(&[0x0304, 0x0303]),
                    (0x0033, vec16(&[0u8; 36])),
                ],
            }
        }

        pub(crate) fn message(&self) -> Vec<u8> {
            let mut body = self.version.to_be_bytes().to_vec();
            body.extend_from_slice(&[7u8; 32]);
            body.extend(vec8(&[9u8; 32]));
            body.extend(vec16(&u16s(&self.suites)));
            body.extend(vec8(&[0]));
            let exts: Vec<u8> = self
                .extensions
                .iter()
                .flat_map(|(t, d)| {
                    let mut e = t.to_be_bytes().to_vec();
                    e.extend(vec16(d));
                    e
                })
                .collect();
            body.extend(vec16(&exts));
            let mut msg = vec![CLIENT_HELLO];
            msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
            msg.extend(body);
            msg
        }

        /// The message in one record.
        pub(crate) fn bytes(&self) -> Vec<u8> {
            records(&self.message(), &[])
        }
    }

    /// A handshake message split into records at the given offsets.
    pub(crate) fn records(msg: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain(std::iter::once(&msg.len())) {
            if end <= start {
                continue;
            }
            out.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&((end - start) as u16).to_be_bytes());
            out.extend_from_slice(&msg[start..end]);
            start = end;
        }
        out
    }

    fn parsed(bytes: &[u8]) -> ClientHello {
        match read(bytes) {
            Read::Hello(h) => h,
            other => panic!("not a hello: {other:?}"),
        }
    }

    #[test]
    fn reads_a_hello_and_leaves_grease_out() {
        let mut hello = Hello::browser();
        hello.suites.insert(0, 0x2a2a);
        hello.extensions.insert(0, (0xbaba, vec![]));
        hello.extensions.push(versions_ext(&[0x7a7a, 0x0304, 0x0303]));
        let h = parsed(&hello.bytes());
        assert_eq!(h.legacy_version, 0x0303);
        assert_eq!(h.version(), 0x0304);
        assert_eq!(h.cipher_suites, [0x1301, 0x1302, 0x1303, 0xc02b, 0xc02f]);
        assert_eq!(
            h.extensions,
            [0x0000, 0x000a, 0x000d, 0x0010, 0x002b, 0x0033, 0x002b]
        );
        assert_eq!(h.signature_schemes, [0x0403, 0x0804, 0x0401]);
        assert_eq!(h.alpn, [b"h2".to_vec(), b"http/1.1".to_vec()]);
    }

    #[test]
    fn grease_is_exactly_the_sixteen_values() {
        let grease: Vec<u16> = (0..=u16::MAX).filter(|&v| is_grease(v)).collect();
        let expected: Vec<u16> = (0..16).map(|i| 0x0a0a + 0x1010 * i).collect();
        assert_eq!(grease, expected);
    }

    #[test]
    fn without_supported_versions_the_legacy_version_counts() {
        let mut hello = Hello::browser();
        hello.extensions.retain(|(t, _)| *t != EXT_SUPPORTED_VERSIONS);
        assert_eq!(parsed(&hello.bytes()).version(), 0x0303);
        // A TLS 1.2 hello may carry no extensions at all.
        let mut msg = Hello::browser().message();
        let bare = {
            let body_len = 2 + 32 + 33 + 2 + 10 + 2;
            msg.truncate(4 + body_len);
            msg[1..4].copy_from_slice(&(body_len as u32).to_be_bytes()[1..]);
            msg
        };
        let h = parsed(&records(&bare, &[]));
        assert!(h.extensions.is_empty() && h.version() == 0x0303, "{h:?}");
    }

    #[test]
    fn a_hello_split_over_records_reads_the_same() {
        let hello = Hello::browser();
        let msg = hello.message();
        let whole = parsed(&hello.bytes());
        assert_eq!(parsed(&records(&msg, &[1, 2, 3, 50, 51])), whole);
        let cuts: Vec<usize> = (1..MAX_RECORDS).collect();
        assert_eq!(parsed(&records(&msg, &cuts)), whole);
        let cuts: Vec<usize> = (1..=MAX_RECORDS).collect();
        assert_eq!(
            read(&records(&msg, &cuts)),
            Read::Unparsed(Unparsed::TooFragmented)
        );
    }

    #[test]
    fn a_prefix_says_how_much_more_it_needs() {
        let bytes = Hello::browser().bytes();
        assert_eq!(read(&[]), Read::Partial { needed: 5 });
        assert_eq!(read(&bytes[..3]), Read::Partial { needed: 5 });
        assert_eq!(read(&bytes[..5]), Read::Partial { needed: bytes.len() });
        assert_eq!(
            read(&bytes[..bytes.len() - 1]),
            Read::Partial { needed: bytes.len() }
        );
        // The bytes after the hello (a client's early data) don't matter.
        let mut more = bytes.clone();
        more.extend_from_slice(&[23, 3, 3, 0, 1, 0]);
        assert_eq!(read(&more), read(&bytes));
    }

    #[test]
    fn what_is_not_a_hello_says_why() {
        assert_eq!(read(b"GET / HTTP/1.1\r\n"), Read::Unparsed(Unparsed::NotTls));
        assert_eq!(read(b"G"), Read::Unparsed(Unparsed::NotTls));
        assert_eq!(read(&[22, 2]), Read::Unparsed(Unparsed::NotTls));
        assert_eq!(
            read(&[22, 3, 1, 0, 0]),
            Read::Unparsed(Unparsed::Malformed("an empty handshake record"))
        );
        assert_eq!(
            read(&[22, 3, 1, 0x40, 1]),
            Read::Unparsed(Unparsed::Malformed("a record longer than 16 KiB"))
        );
        assert_eq!(
            read(&[22, 3, 1, 0, 1, 2]),
            Read::Unparsed(Unparsed::NotClientHello)
        );
        // A hello claiming 16 KiB + 1 is refused before its bytes are waited for.
        let big = (MAX_HELLO as u32 + 1).to_be_bytes();
        assert_eq!(
            read(&[22, 3, 1, 0, 4, 1, big[1], big[2], big[3]]),
            Read::Unparsed(Unparsed::TooLarge)
        );
        // Alerts or application data between the fragments of a hello.
        let msg = Hello::browser().message();
        let mut bytes = records(&msg[..10], &[]);
        bytes.extend_from_slice(&[21, 3, 3, 0, 2, 2, 40]);
        assert!(matches!(read(&bytes), Read::Unparsed(Unparsed::Malformed(_))));
    }

    #[test]
    fn malformed_bodies_are_named() {
        let mut h = Hello::browser();
        h.suites.clear();
        assert_eq!(
            read(&h.bytes()),
            Read::Unparsed(Unparsed::Malformed("no cipher suites"))
        );
        let mut h = Hello::browser();
        h.extensions.push((EXT_ALPN, vec16(&[0])));
        assert_eq!(
            read(&h.bytes()),
            Read::Unparsed(Unparsed::Malformed("an empty ALPN protocol name"))
        );
        let mut h = Hello::browser();
        h.extensions.push((EXT_SUPPORTED_VERSIONS, vec8(&[3, 4, 3])));
        assert_eq!(
            read(&h.bytes()),
            Read::Unparsed(Unparsed::Malformed("an odd length of supported_versions"))
        );
        // A body that ends inside a field.
        let msg = Hello::browser().message();
        let mut cut = msg[..40].to_vec();
        cut[1..4].copy_from_slice(&36u32.to_be_bytes()[1..]);
        assert_eq!(
            read(&records(&cut, &[])),
            Read::Unparsed(Unparsed::Malformed("a cut session id"))
        );
    }

    proptest! {
        /// Any bytes get an answer, and a Partial never asks for what it already has nor for
        /// more than the bound.
        #[test]
        fn any_bytes_get_an_answer(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Read::Partial { needed } = read(&bytes) {
                prop_assert!(needed > bytes.len() && needed <= MAX_PEEK);
            }
        }

        /// Bytes that start like a hello reach the deeper parts of the reader.
        #[test]
        fn any_hello_like_bytes_get_an_answer(
            cut in 0usize..400,
            flips in proptest::collection::vec((0usize..400, any::<u8>()), 0..6),
        ) {
            let mut bytes = Hello::browser().bytes();
            for (at, b) in flips {
                if let Some(x) = bytes.get_mut(at) {
                    *x = b;
                }
            }
            bytes.truncate(cut);
            if let Read::Partial { needed } = read(&bytes) {
                prop_assert!(needed > bytes.len() && needed <= MAX_PEEK);
            }
        }

        /// However a hello is split into records, and however much of it has arrived, the
        /// reader waits for the rest or reads the same hello.
        #[test]
        fn splitting_and_prefixes_never_change_the_hello(
            cuts in proptest::collection::btree_set(1usize..150, 0..(MAX_RECORDS - 1)),
            upto in 0usize..400,
        ) {
            let hello = Hello::browser();
            let whole = parsed(&hello.bytes());
            let cuts: Vec<usize> = cuts.into_iter().collect();
            let bytes = records(&hello.message(), &cuts);
            prop_assert_eq!(parsed(&bytes), whole.clone());
            let upto = upto.min(bytes.len());
            match read(&bytes[..upto]) {
                Read::Partial { needed } => prop_assert!(needed > upto && needed <= bytes.len()),
                Read::Hello(h) => prop_assert_eq!(h, whole),
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }
}
