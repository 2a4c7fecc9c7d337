//! Replays the gateway's own access logs under a rules file, and beside it under a proposed
//! one: whether the rules decide each logged request as the gateway did, and which keys a
//! proposal would refuse that the running rules admit.
//!
//! Files are told apart by what they hold, not by their names: gzip by its magic bytes, then a
//! JSON or combined access log, or a CSV trace (which [`super::args`] replays as before).
//! Several files are several gateways: their lines are merged by the instant each limit check
//! used (`check_us`). A gateway writes a line when its request ends, so each file is only nearly
//! in that order, and all lines are read (compactly: key ids, requests and clients interned)
//! and sorted before any is replayed.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use http::Method;
use serde::Serialize;

use super::access::{self, AccessLine, Logged};
use super::algorithms::Verdict;
use super::flags::ReplayArgs;
use super::lines::Line;
use super::report::group;
use super::rules::{RulesFleet, needs_caller};
use super::{Algorithm, Design, PROGRESS_EVERY, ReplayError, setting};
use tollgate_rules::{CompileOptions, Dimension, Fingerprint, Identity, Snapshot};

mod input;
mod report;

use input::{EXPECTED, input_err, is_blank, read_err, trim_eol};
pub use input::{Format, Input, open};
pub(crate) use input::{Inputs, classify};
pub use report::{HeldReport, KeyReport, LogsReport, RulesReport};

/// The interned line a replay reads: 32 bytes whatever the line's length.
#[derive(Clone, Copy, Debug)]
struct Rec {
    check_us: u64,
    /// [`NO_COST`]: none reported.
    cost: u64,
    /// Method and path without the query, interned.
    shape: u32,
    /// The logged key id, interned; [`NO_KEY`]: none.
    key: u32,
    /// Address and fingerprint, interned.
    client: u32,
    /// What the gateway decided: any status but 429.
    logged_admitted: bool,
}

const NO_KEY: u32 = u32::MAX;
const NO_COST: u64 = u64::MAX;

/// Why lines were not replayed, each with how many and the first line's request, when the
/// reason depends on it.
#[derive(Debug, Default)]
struct Reasons {
    list: Vec<Reason>,
}

/// Lines left out of the replay for one reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reason {
    pub reason: String,
    pub lines: u64,
    /// The first such line's method and path, where the reason is about the request.
    pub example: Option<String>,
}

impl Reasons {
    fn id(&mut self, reason: String) -> usize {
        if let Some(i) = self.list.iter().position(|r| r.reason == reason) {
            return i;
        }
        self.list.push(Reason {
            reason,
            lines: 0,
            example: None,
        });
        self.list.len() - 1
    }

    fn count(&mut self, id: usize, example: Option<&dyn Fn() -> String>) {
        let r = &mut self.list[id];
        if r.lines == 0 {
            r.example = example.map(|e| e());
        }
        r.lines += 1;
    }
}

/// One file as it was read.
#[derive(Clone, Debug, Serialize)]
pub struct InputReport {
    pub file: String,
    pub format: &'static str,
    pub gzip: bool,
    /// Lines that are not blank.
    pub lines: u64,
    pub access: u64,
    /// Not access lines: the gateway's own log lines, anything else, a truncated last line,
    /// lines too long.
    pub skipped: u64,
    /// A last line without its end (the writer was cut off, or the file is still written).
    pub truncated: u64,
    /// Lines longer than the maximum ([`MAX_LINE`]), read past unparsed, and access lines with
    /// a field over its bound.
    pub too_long: u64,
    /// Whether its gzip stream ended before its end.
    pub cut: bool,
}

impl InputReport {
    /// A file's report before any of its lines is read.
    fn unread(file: String, format: Format, gzip: bool) -> InputReport {
        InputReport {
            file,
            format: format.name(),
            gzip,
            lines: 0,
            access: 0,
            skipped: 0,
            truncated: 0,
            too_long: 0,
            cut: false,
        }
    }
}

/// What became of the lines read, over all files.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LineCounts {
    /// Lines that are not blank: `access` + `skipped`.
    pub read: u64,
    pub json: u64,
    pub combined: u64,
    pub access: u64,
    pub skipped: u64,
    pub truncated: u64,
    pub too_long: u64,
    /// Access lines of a gateway that did not log `check_us` yet.
    pub without_check_us: u64,
    /// No limit check was made: no route, or refused before it (a seat, a quota, a bad request).
    pub not_checked: u64,
    pub not_replayable: u64,
    pub replayed: u64,
}

/// The lines of all files, interned, before they are sorted and replayed.
#[derive(Default)]
struct Collector {
    recs: Vec<Rec>,
    key_ids: HashMap<Box<str>, u32>,
    keys: Vec<Box<str>>,
    shape_ids: HashMap<Box<[u8]>, u32>,
    shapes: Vec<(Method, Box<str>)>,
    client_ids: HashMap<(IpAddr, Fingerprint), u32>,
    clients: Vec<(IpAddr, Fingerprint)>,
    versions: BTreeMap<u64, u64>,
    instances: Vec<(Box<str>, u64)>,
    last_instance: usize,
    counts: LineCounts,
    reasons: Reasons,
    shape_buf: Vec<u8>,
}

impl Collector {
    /// Takes one access line; `false` when it is not one after all (an address or fingerprint
    /// the gateway would never write).
    fn add(&mut self, l: &AccessLine<'_>) -> bool {
        let Ok(ip) = l.client_ip.as_deref().unwrap_or(&l.remote_addr).parse::<IpAddr>() else {
            return false;
        };
        let fingerprint = match l.fingerprint.as_deref() {
            None => Fingerprint::None,
            Some(f) => match f.parse() {
                Ok(f) => f,
                Err(_) => return false,
            },
        };
        let Ok(method) = Method::from_bytes(l.request_method.as_bytes()) else {
            return false;
        };
        self.counts.access += 1;
        if let Some(v) = l.rules_version {
            *self.versions.entry(v).or_default() += 1;
        }
        if let Some(i) = l.instance.as_deref() {
            self.count_instance(i);
        }
        let check_us = match l.check_us {
            Logged::Absent => {
                self.counts.without_check_us += 1;
                return true;
            }
            Logged::Null => {
                self.counts.not_checked += 1;
                return true;
            }
            Logged::Value(t) => t,
        };
        let Some(path) = l.path.as_deref() else {
            let id = self.reasons.id("the line names no path".into());
            self.reasons.count(id, None);
            self.counts.not_replayable += 1;
            return true;
        };
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        self.shape_buf.clear();
        self.shape_buf.extend_from_slice(method.as_str().as_bytes());
        self.shape_buf.push(b' ');
        self.shape_buf.extend_from_slice(path.as_bytes());
        let shape = match self.shape_ids.get(self.shape_buf.as_slice()) {
            Some(&s) => s,
            None => {
                let s = self.shapes.len() as u32;
                self.shapes.push((method, path.into()));
                self.shape_ids.insert(self.shape_buf.as_slice().into(), s);
                s
            }
        };
        let key = match l.remote_user.as_deref() {
            None => NO_KEY,
            Some(id) => match self.key_ids.get(id) {
                Some(&k) => k,
                None => {
                    let k = self.keys.len() as u32;
                    self.keys.push(id.into());
                    self.key_ids.insert(id.into(), k);
                    k
                }
            },
        };
        let client = *self.client_ids.entry((ip, fingerprint)).or_insert_with(|| {
            self.clients.push((ip, fingerprint));
            self.clients.len() as u32 - 1
        });
        self.recs.push(Rec {
            check_us,
            cost: l.cost_reported.unwrap_or(NO_COST),
            shape,
            key,
            client,
            logged_admitted: l.status != 429,
        });
        true
    }

    fn count_instance(&mut self, name: &str) {
        // A file is one gateway's, so the last line's instance is nearly always this one's.
        if let Some(e) = self.instances.get_mut(self.last_instance)
            && *e.0 == *name
        {
            e.1 += 1;
            return;
        }
        match self.instances.iter().position(|e| *e.0 == *name) {
            Some(i) => {
                self.instances[i].1 += 1;
                self.last_instance = i;
            }
            None => {
                self.instances.push((name.into(), 1));
                self.last_instance = self.instances.len() - 1;
            }
        }
    }

    /// Reads every line of each of `inputs`, in turn.
    fn read_all(&mut self, inputs: Vec<Input>, progress: bool) -> Result<Vec<InputReport>, ReplayError> {
        let mut reports = Vec::with_capacity(inputs.len());
        for input in inputs {
            if input.format == Format::Empty {
                reports.push(InputReport::unread(input.name, Format::Empty, input.gzip));
                continue;
            }
            reports.push(self.read(input, progress)?);
        }
        Ok(reports)
    }

    /// Reads every line of `input`.
    fn read(&mut self, input: Input, progress: bool) -> Result<InputReport, ReplayError> {
        let mut report = InputReport::unread(input.name.clone(), input.format, input.gzip);
        let Input {
            name,
            format,
            mut lines,
            ..
        } = input;
        let mut buf = Vec::with_capacity(4096);
        let mut read = Line::default();
        loop {
            let ended = match lines.next(&mut buf, &mut read) {
                Ok(()) if read.bytes == 0 => break,
                Ok(()) => read.ended,
                // A gzip stream cut short (a rotation still compressing it): what came is kept.
                Err(e) if input_is_cut(&e) && read.bytes == 0 => {
                    report.cut = true;
                    break;
                }
                Err(e) if input_is_cut(&e) => {
                    report.cut = true;
                    false
                }
                Err(e) => return Err(read_err(&name)(e)),
            };
            let line = trim_eol(&buf);
            if !read.too_long && is_blank(line) {
                if report.cut {
                    break;
                }
                continue;
            }
            report.lines += 1;
            if progress && (self.counts.read + report.lines).is_multiple_of(PROGRESS_EVERY) {
                eprintln!("replay: {} lines read", group(self.counts.read + report.lines));
            }
            // The gateway ends every line it writes: one without its end was cut off.
            let parsed = if read.too_long {
                report.too_long += 1;
                None
            } else if ended {
                match format {
                    Format::Json => access::parse_json(line),
                    _ => access::parse_combined(line),
                }
            } else {
                report.truncated += 1;
                None
            };
            let parsed = parsed.filter(|l| {
                let over = l.over_bound().is_some();
                report.too_long += u64::from(over);
                !over
            });
            if parsed.is_some_and(|l| self.add(&l)) {
                report.access += 1;
            } else {
                report.skipped += 1;
            }
            if report.cut {
                break;
            }
        }
        let c = &mut self.counts;
        c.read += report.lines;
        match format {
            Format::Json => c.json += report.lines,
            _ => c.combined += report.lines,
        }
        c.skipped += report.skipped;
        c.truncated += report.truncated;
        c.too_long += report.too_long;
        Ok(report)
    }
}

fn input_is_cut(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::UnexpectedEof
}

/// A rules file, as named on the command line, and its compiled snapshot.
#[derive(Clone)]
pub struct RulesFile {
    pub name: String,
    pub snap: Arc<Snapshot>,
}

impl RulesFile {
    pub fn load(path: &Path) -> Result<RulesFile, ReplayError> {
        let snap = tollgate_rules::load(path, CompileOptions::default())?;
        Ok(RulesFile {
            name: path.display().to_string(),
            snap: Arc::new(snap),
        })
    }
}

const UNRESOLVED: u32 = u32::MAX;
const NO_ROUTE: u32 = u32::MAX - 1;

/// One rules file replaying the lines: a central store for the fleet, and what each interned
/// request and key id is under these rules, found once.
struct Side {
    file: RulesFile,
    fleet: RulesFleet,
    /// Per shape: its route, [`NO_ROUTE`], or [`UNRESOLVED`] until first seen.
    routes: Vec<u32>,
    /// Per logged key id: the key of these rules.
    keys: Vec<Option<usize>>,
    /// Per route: why a caller with a key id can't be replayed on it, as a reason id.
    blocked: Vec<Option<usize>>,
    no_route: usize,
}

impl Side {
    fn new(file: RulesFile, c: &mut Collector) -> Side {
        let snap = file.snap.clone();
        let blocked = snap
            .routes
            .iter()
            .map(|route| {
                let why = if route.identity == Identity::Jwt {
                    Some("names its callers by JWT claims, which the log does not carry".to_string())
                } else {
                    route.costs.iter().find_map(|&(li, _)| {
                        let l = &snap.limits[li as usize];
                        matches!(
                            l.dimension,
                            Dimension::Header(_) | Dimension::BodyField(_) | Dimension::Claim(_)
                        )
                        .then(|| {
                            format!(
                                "charges limit {:?}, keyed on {}, which the log does not carry",
                                l.name,
                                l.dimension.describe()
                            )
                        })
                    })
                };
                why.map(|w| c.reasons.id(format!("{}: route {:?} {w}", file.name, route.name)))
            })
            .collect();
        let no_route = c.reasons.id(format!("{}: no route matches", file.name));
        Side {
            fleet: RulesFleet::new(snap.clone(), Design::Central, 1),
            routes: vec![UNRESOLVED; c.shapes.len()],
            keys: c.keys.iter().map(|k| snap.key_by_id(k)).collect(),
            blocked,
            no_route,
            file,
        }
    }

    /// The line's route and key under these rules, or the reason it can't be replayed.
    fn resolve(&mut self, r: &Rec, shapes: &[(Method, Box<str>)]) -> Result<(usize, Option<usize>), usize> {
        let s = r.shape as usize;
        if self.routes[s] == UNRESOLVED {
            let (method, path) = &shapes[s];
            self.routes[s] = self
                .file
                .snap
                .route(method, path)
                .map_or(NO_ROUTE, |ri| ri as u32);
        }
        if self.routes[s] == NO_ROUTE {
            return Err(self.no_route);
        }
        let ri = self.routes[s] as usize;
        let route = &self.file.snap.routes[ri];
        let logged = r.key != NO_KEY;
        // A token's caller is logged by its claim's id, which no key of the rules has; without
        // a valid token, the gateway charged only the address's bucket.
        if route.identity == Identity::Jwt {
            return match (logged, self.blocked[ri]) {
                (true, Some(why)) => Err(why),
                _ => Ok((ri, None)),
            };
        }
        let key = if logged { self.keys[r.key as usize] } else { None };
        if key.is_none() && needs_caller(route) {
            return Ok((ri, None));
        }
        match self.blocked[ri] {
            Some(why) => Err(why),
            None => Ok((ri, key)),
        }
    }
}

/// Replays access logs (JSON or combined, gzip or not, any mix) under `rules`, and under
/// `against` beside it when given. Files that are CSV traces are refused.
pub fn replay_logs(
    files: &[PathBuf],
    rules: &Path,
    against: Option<&Path>,
) -> Result<LogsReport, ReplayError> {
    let inputs = files.iter().map(|f| open(f)).collect::<Result<Vec<_>, _>>()?;
    if let Some(csv) = inputs.iter().find(|i| i.format == Format::Csv) {
        return Err(input_err(
            &csv.name,
            "is a CSV trace; replay it alone, without --against",
        ));
    }
    let inputs = match classify(inputs)? {
        Inputs::Logs(l) => l,
        Inputs::Trace(i) => return Err(input_err(&i.name, EXPECTED)),
    };
    let running = RulesFile::load(rules)?;
    let proposed = against.map(RulesFile::load).transpose()?;
    replay(inputs, running, proposed, false)
}

/// Reads, merges and replays `inputs`.
pub(crate) fn replay(
    inputs: Vec<Input>,
    running: RulesFile,
    proposed: Option<RulesFile>,
    progress: bool,
) -> Result<LogsReport, ReplayError> {
    let mut c = Collector::default();
    let reports = c.read_all(inputs, progress)?;
    // Stable: lines of one instant keep their file's order, and files theirs.
    c.recs.sort_by_key(|r| r.check_us);
    let recs = std::mem::take(&mut c.recs);
    let mut run = Side::new(running, &mut c);
    let mut alt = proposed.map(|p| Side::new(p, &mut c));
    let tallies = run_lines(&recs, &mut c, &mut run, alt.as_mut());
    Ok(settle(c, reports, &run, alt.as_ref(), tallies))
}

/// What replaying the lines counted: per logged key id, then callers without one, and the
/// first and last check replayed.
struct Tallies {
    keys: Vec<KeyReport>,
    first: Option<u64>,
    last: Option<u64>,
}

/// Replays the sorted lines under both sides, counting each line replayed against its key.
fn run_lines(recs: &[Rec], c: &mut Collector, run: &mut Side, mut alt: Option<&mut Side>) -> Tallies {
    let mut t = Tallies {
        keys: vec![KeyReport::default(); c.keys.len() + 1],
        first: None,
        last: None,
    };
    for r in recs {
        let Some((v, p)) = replay_line(r, c, run, alt.as_deref_mut()) else {
            continue;
        };
        c.counts.replayed += 1;
        t.first.get_or_insert(r.check_us);
        t.last = Some(r.check_us);
        let slot = if r.key == NO_KEY {
            c.keys.len()
        } else {
            r.key as usize
        };
        tally(&mut t.keys[slot], r.logged_admitted, v, p);
    }
    t
}

/// One line's verdicts under the running rules and the proposal, or `None`, its reason
/// counted, when either side can't replay it.
fn replay_line(
    r: &Rec,
    c: &mut Collector,
    run: &mut Side,
    mut alt: Option<&mut Side>,
) -> Option<(Verdict, Option<Verdict>)> {
    let shapes = &c.shapes;
    let example = || {
        let (m, p) = &shapes[r.shape as usize];
        format!("{m} {p}")
    };
    let resolved = run.resolve(r, shapes).and_then(|a| match alt.as_deref_mut() {
        Some(alt) => alt.resolve(r, shapes).map(|b| (a, Some(b))),
        None => Ok((a, None)),
    });
    let ((ri, key), alt_at) = match resolved {
        Ok(x) => x,
        Err(why) => {
            let by_request = why == run.no_route || alt.as_ref().is_some_and(|a| why == a.no_route);
            c.reasons
                .count(why, by_request.then_some(&example as &dyn Fn() -> String));
            c.counts.not_replayable += 1;
            return None;
        }
    };
    let (ip, fp) = c.clients[r.client as usize];
    let cost = (r.cost != NO_COST).then_some(r.cost);
    let check = |side: &mut Side, ri: usize, key: Option<usize>| {
        side.fleet
            .check_route(ri, key, ip, fp, 0, r.check_us, None, cost)
            .map(|p| p.verdict)
            .map_err(|e| format!("{}: {}", side.file.name, e.reason))
    };
    let verdicts = check(run, ri, key).and_then(|a| match (alt.as_deref_mut(), alt_at) {
        (Some(side), Some((ri, key))) => check(side, ri, key).map(|b| (a, Some(b))),
        _ => Ok((a, None)),
    });
    let (v, mut p) = match verdicts {
        Ok(x) => x,
        Err(why) => {
            let id = c.reasons.id(why);
            c.reasons.count(id, Some(&example));
            c.counts.not_replayable += 1;
            return None;
        }
    };
    // A key the proposal drops is a caller without a key there: where the route needs
    // one, its request would get 401 however its address's bucket stands, and the
    // partner loses it as surely as to a limit.
    if let (Some(_), Some(side), Some((ari, None))) = (key, alt.as_deref(), alt_at)
        && needs_caller(&side.file.snap.routes[ari])
    {
        p = Some(Verdict::refuse(None));
    }
    Some((v, p))
}

/// Counts one replayed line in its key's figures: `v` under the running rules, `p` under the
/// proposal.
fn tally(t: &mut KeyReport, logged_admitted: bool, v: Verdict, p: Option<Verdict>) {
    t.requests += 1;
    if logged_admitted {
        t.logged_admitted += 1;
    } else {
        t.logged_refused += 1;
    }
    if v.admitted {
        t.replayed_admitted += 1;
    } else {
        t.replayed_refused += 1;
    }
    if v.admitted == logged_admitted {
        t.agree += 1;
    } else {
        t.disagree += 1;
    }
    if let Some(p) = p {
        *t.admitted_proposed.get_or_insert(0) += u64::from(p.admitted);
        match (v.admitted, p.admitted) {
            (true, false) => {
                t.newly_refused += 1;
                if let Some(s) = p.retry_after {
                    t.longest_retry_after_s = Some(t.longest_retry_after_s.map_or(s, |l| l.max(s)));
                }
            }
            (false, true) => t.newly_admitted += 1,
            _ => {}
        }
    }
}

/// Turns what was read and counted into the report.
fn settle(
    c: Collector,
    inputs: Vec<InputReport>,
    run: &Side,
    alt: Option<&Side>,
    tallies: Tallies,
) -> LogsReport {
    let rules = rules_report(run, &tallies.keys, &c.keys);
    let against = alt.map(|side| rules_report(side, &tallies.keys, &c.keys));
    let keys = key_reports(tallies.keys, &c.keys, against.is_some());
    let versions_note = versions_note(&c.versions, &run.file);
    LogsReport {
        files: inputs.len(),
        inputs,
        lines: c.counts,
        not_replayable: sorted_reasons(c.reasons),
        rules_versions: c.versions,
        versions_note,
        instances: c.instances.into_iter().map(|(n, l)| (n.into(), l)).collect(),
        rules,
        against,
        first_check_us: tallies.first,
        last_check_us: tallies.last,
        keys,
        max_newly_refused: None,
    }
}

/// A side's rules file, and the logged key ids it does not know that came with requests.
fn rules_report(side: &Side, tallies: &[KeyReport], ids: &[Box<str>]) -> RulesReport {
    let unknown_keys = side
        .keys
        .iter()
        .enumerate()
        .filter(|(k, known)| known.is_none() && tallies[*k].requests > 0)
        .map(|(k, _)| (ids[k].to_string(), tallies[k].requests))
        .collect();
    RulesReport {
        file: side.file.name.clone(),
        version: side.file.snap.version,
        unknown_keys,
    }
}

/// The keys that came with requests, named, worst first: by newly refused with a proposal,
/// by disagreements without; then by key.
fn key_reports(tallies: Vec<KeyReport>, ids: &[Box<str>], against: bool) -> Vec<KeyReport> {
    let mut keys: Vec<KeyReport> = tallies
        .into_iter()
        .enumerate()
        .filter(|(_, t)| t.requests > 0)
        .map(|(i, mut t)| {
            // The slot past the logged ids is the callers without one.
            t.key = ids.get(i).map_or("-".to_string(), |k| k.to_string());
            if against {
                t.admitted_proposed.get_or_insert(0);
            }
            t
        })
        .collect();
    if against {
        keys.sort_by(|a, b| {
            b.newly_refused
                .cmp(&a.newly_refused)
                .then_with(|| a.key.cmp(&b.key))
        });
    } else {
        keys.sort_by(|a, b| b.disagree.cmp(&a.disagree).then_with(|| a.key.cmp(&b.key)));
    }
    keys
}

/// The reasons some line had, the most lines first.
fn sorted_reasons(reasons: Reasons) -> Vec<Reason> {
    let mut list: Vec<Reason> = reasons.list.into_iter().filter(|r| r.lines > 0).collect();
    list.sort_by(|a, b| b.lines.cmp(&a.lines).then_with(|| a.reason.cmp(&b.reason)));
    list
}

/// Said when the log ran other rules than the file it is replayed under.
fn versions_note(versions: &BTreeMap<u64, u64>, rules: &RulesFile) -> Option<String> {
    let version = rules.snap.version;
    if versions.is_empty() || (versions.len() == 1 && versions.contains_key(&version)) {
        return None;
    }
    let list: Vec<String> = versions.keys().map(u64::to_string).collect();
    let noun = if list.len() == 1 { "version" } else { "versions" };
    Some(format!(
        "the log ran rules {noun} {}; replayed under version {version} of {}",
        list.join(", "),
        rules.name
    ))
}

/// The flags that mean something for a CSV trace only.
fn refuse_trace_flags(a: &ReplayArgs) -> Result<(), ReplayError> {
    let why_rules = "access logs are replayed under --rules, the limits the gateway enforces";
    let flags: [(&'static str, bool, &str); 13] = [
        ("--rate", a.rate.is_some(), why_rules),
        ("--burst", a.burst.is_some(), why_rules),
        ("--queue", a.queue.is_some(), why_rules),
        (
            "--algorithm",
            a.algorithm != Algorithm::default(),
            "access logs replay the gateway's own token buckets",
        ),
        (
            "--design",
            a.design.iter().any(|d| *d != Design::Central),
            "access logs are replayed as the fleet ran: one central store for all its gateways",
        ),
        (
            "--decisions",
            a.decisions.is_some(),
            "writes one row per CSV trace row; access logs have --json",
        ),
        (
            "--plot",
            a.plot.is_some(),
            "draws a CSV trace's replay, not access logs'",
        ),
        (
            "--lease-block",
            a.lease_block.is_some(),
            "goes with --design lease, for a CSV trace",
        ),
        (
            "--excess-from",
            a.excess_from.is_some(),
            "goes with a CSV trace's worst excess",
        ),
        (
            "--edge-rule",
            a.edge_rule.is_some(),
            "goes with --design edge, for a CSV trace",
        ),
        (
            "--edge-check",
            a.edge_check.is_some(),
            "goes with --design edge, for a CSV trace",
        ),
        (
            "--edge-delay",
            a.edge_delay.is_some(),
            "goes with --design edge, for a CSV trace",
        ),
        (
            "--edge-count-blocked",
            a.edge_count_blocked.is_some(),
            "goes with --design edge, for a CSV trace",
        ),
    ];
    match flags.iter().find(|f| f.1) {
        Some((flag, _, why)) => Err(setting(flag, *why)),
        None => Ok(()),
    }
}

/// `--against` and `--max-newly-refused`, refused for a CSV trace.
pub(crate) fn refuse_log_flags(a: &ReplayArgs) -> Result<(), ReplayError> {
    if a.against.is_some() {
        return Err(setting(
            "--against",
            "compares two rules files over the gateway's access logs; a CSV trace is replayed under one, --rules",
        ));
    }
    if a.max_newly_refused.is_some() {
        return Err(setting(
            "--max-newly-refused",
            "goes with access logs and --against",
        ));
    }
    Ok(())
}

/// Runs `tollgate replay LOG...`: prints the summary, then holds (exit status 3) when a key's
/// newly refused requests pass `--max-newly-refused`.
pub(crate) fn main(a: &ReplayArgs, inputs: Vec<Input>) -> Result<(), ReplayError> {
    refuse_trace_flags(a)?;
    let Some(rules) = &a.rules else {
        return Err(setting(
            "--rules",
            "required with access logs: the rules file the gateway ran (and --against a proposed one to compare)",
        ));
    };
    let running = RulesFile::load(rules)?;
    let proposed = a.against.as_deref().map(RulesFile::load).transpose()?;
    let mut report = replay(inputs, running, proposed, true)?;
    let held = a.max_newly_refused.map(|pct| HeldReport {
        pct,
        over: report.over(pct).into_iter().map(|k| k.key.clone()).collect(),
    });
    report.max_newly_refused = held.clone();
    let mut out = io::stdout().lock();
    let written = if a.json {
        writeln!(out, "{}", report.to_json())
    } else {
        report.write_text(&mut out)
    };
    written.map_err(|e| ReplayError::Io {
        what: "cannot write to standard output".into(),
        reason: e.to_string(),
    })?;
    match held {
        Some(h) if !h.over.is_empty() => {
            let keys: Vec<String> = report
                .over(h.pct)
                .iter()
                .map(|k| {
                    format!(
                        "{} ({} of {} admitted, {:.2}%)",
                        k.key,
                        group(k.newly_refused),
                        group(k.replayed_admitted),
                        k.newly_refused as f64 * 100.0 / k.replayed_admitted as f64
                    )
                })
                .collect();
            Err(ReplayError::Held(format!(
                "{} would newly refuse more than {}% of the requests {} admits for {}",
                report
                    .against
                    .as_ref()
                    .map_or("the proposal", |r| r.file.as_str()),
                h.pct,
                report.rules.file,
                keys.join(", ")
            )))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
