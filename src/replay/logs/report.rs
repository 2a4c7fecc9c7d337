//! What a replay of access logs found, per key and in all: the report's figures, its text
//! summary and its JSON.

use std::collections::BTreeMap;
use std::io::{self, Write};

use serde::Serialize;
use serde::ser::SerializeStruct;

use crate::lines::{MAX_KEY_ID, MAX_LINE};
use crate::logs::{InputReport, LineCounts, Reason};
use crate::report::group;

/// Per logged key id: the replay's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyReport {
    /// The key id as logged; `-` for callers without one.
    pub key: String,
    pub requests: u64,
    pub logged_admitted: u64,
    pub logged_refused: u64,
    /// Under the running rules (`--rules`).
    pub replayed_admitted: u64,
    pub replayed_refused: u64,
    /// The replayed decision is the logged one.
    pub agree: u64,
    pub disagree: u64,
    /// With a proposal (`--against`), the rest; `None` without.
    pub admitted_proposed: Option<u64>,
    /// Admitted under the running rules, refused under the proposal.
    pub newly_refused: u64,
    pub newly_admitted: u64,
    /// The longest Retry-After the proposal gives a newly refused request, whole seconds.
    pub longest_retry_after_s: Option<u64>,
}

impl Serialize for KeyReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.admitted_proposed {
            None => {
                let mut m = s.serialize_struct("KeyReport", 7)?;
                m.serialize_field("key", &self.key)?;
                m.serialize_field("requests", &self.requests)?;
                m.serialize_field("logged_admitted", &self.logged_admitted)?;
                m.serialize_field("logged_refused", &self.logged_refused)?;
                m.serialize_field("replayed_admitted", &self.replayed_admitted)?;
                m.serialize_field("agree", &self.agree)?;
                m.serialize_field("disagree", &self.disagree)?;
                m.end()
            }
            Some(proposed) => {
                let mut m = s.serialize_struct("KeyReport", 9)?;
                m.serialize_field("key", &self.key)?;
                m.serialize_field("requests", &self.requests)?;
                m.serialize_field("admitted_running", &self.replayed_admitted)?;
                m.serialize_field("admitted_proposed", &proposed)?;
                m.serialize_field("newly_refused", &self.newly_refused)?;
                m.serialize_field("newly_admitted", &self.newly_admitted)?;
                m.serialize_field("longest_retry_after_s", &self.longest_retry_after_s)?;
                m.serialize_field("agree", &self.agree)?;
                m.serialize_field("disagree", &self.disagree)?;
                m.end()
            }
        }
    }
}

/// A rules file a replay ran under, and the logged key ids it does not know, which it replayed
/// as callers without a key, with their lines.
#[derive(Clone, Debug, Serialize)]
pub struct RulesReport {
    pub file: String,
    pub version: u64,
    pub unknown_keys: BTreeMap<String, u64>,
}

/// `--max-newly-refused`: the threshold, and the keys over it.
#[derive(Clone, Debug, Serialize)]
pub struct HeldReport {
    pub pct: f64,
    pub over: Vec<String>,
}

/// What a replay of access logs found.
#[derive(Clone, Debug, Serialize)]
pub struct LogsReport {
    pub files: usize,
    pub inputs: Vec<InputReport>,
    pub lines: LineCounts,
    /// The most lines first.
    pub not_replayable: Vec<Reason>,
    /// Access lines per rules version the gateways logged.
    pub rules_versions: BTreeMap<u64, u64>,
    /// Set when the log ran other versions than the `--rules` file's.
    pub versions_note: Option<String>,
    /// Access lines per gateway instance.
    pub instances: BTreeMap<String, u64>,
    pub rules: RulesReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub against: Option<RulesReport>,
    /// The first and last check replayed, µs since the Unix epoch.
    pub first_check_us: Option<u64>,
    pub last_check_us: Option<u64>,
    /// Sorted worst first: by newly refused with a proposal, by disagreements without; then
    /// by key.
    pub keys: Vec<KeyReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_newly_refused: Option<HeldReport>,
}

impl LogsReport {
    /// The keys whose newly refused requests are more than `pct` % of those the running rules
    /// admit.
    pub fn over(&self, pct: f64) -> Vec<&KeyReport> {
        self.keys
            .iter()
            .filter(|k| {
                k.newly_refused > 0 && k.newly_refused as f64 * 100.0 > pct * k.replayed_admitted as f64
            })
            .collect()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The summary for a person.
    pub fn write_text(&self, out: &mut impl Write) -> io::Result<()> {
        self.write_inputs(out)?;
        self.write_lines(out)?;
        self.write_logged(out)?;
        writeln!(out)?;
        self.write_keys(out)
    }

    /// The rules replayed under, and each file as it was read.
    fn write_inputs(&self, out: &mut impl Write) -> io::Result<()> {
        let l = &self.lines;
        write!(
            out,
            "replay: access logs under {} (version {})",
            self.rules.file, self.rules.version
        )?;
        if let Some(a) = &self.against {
            write!(out, ", against {} (version {})", a.file, a.version)?;
        }
        writeln!(out)?;
        writeln!(
            out,
            "{}: {} ({} JSON, {} combined)",
            plural(self.files as u64, "file", "files"),
            plural(l.read, "line", "lines"),
            group(l.json),
            group(l.combined)
        )?;
        let width = self.inputs.iter().map(|i| i.file.len()).max().unwrap_or(0);
        for i in &self.inputs {
            let format = if i.gzip {
                format!("{}, gzip", i.format)
            } else {
                i.format.to_string()
            };
            write!(
                out,
                "  {:<width$}  {format}: {}",
                i.file,
                plural(i.lines, "line", "lines")
            )?;
            if i.skipped > 0 {
                write!(out, ", {} skipped", group(i.skipped))?;
            }
            if i.truncated > 0 {
                write!(out, " (a truncated last line)")?;
            }
            if i.too_long > 0 {
                write!(out, " ({} too long)", group(i.too_long))?;
            }
            if i.cut {
                write!(out, "; its gzip stream ends early")?;
            }
            writeln!(out)?;
        }
        Ok(())
    }

    /// What became of the lines, over all files, and why some were not replayed.
    fn write_lines(&self, out: &mut impl Write) -> io::Result<()> {
        let l = &self.lines;
        write!(out, "skipped: {} that are not access lines", group(l.skipped))?;
        if l.truncated > 0 {
            write!(out, ", {} of them truncated", group(l.truncated))?;
        }
        if l.too_long > 0 {
            write!(
                out,
                ", {} too long (over {} bytes, or a field over its bound)",
                group(l.too_long),
                group(MAX_LINE as u64)
            )?;
        }
        writeln!(out)?;
        writeln!(
            out,
            "replayed: {} of {} access lines",
            group(l.replayed),
            group(l.access)
        )?;
        writeln!(
            out,
            "not checked: {} (the gateway made no limit check: no route, or refused before it)",
            group(l.not_checked)
        )?;
        if l.without_check_us > 0 {
            writeln!(
                out,
                "without check_us: {} (written by a gateway that did not log it yet)",
                group(l.without_check_us)
            )?;
        }
        writeln!(out, "not replayable: {}", group(l.not_replayable))?;
        for r in &self.not_replayable {
            write!(out, "  {:>12}  {}", group(r.lines), r.reason)?;
            if let Some(e) = &r.example {
                write!(out, " (first: {e})")?;
            }
            writeln!(out)?;
        }
        Ok(())
    }

    /// What the log says beside its requests: key ids the rules don't know, the rules
    /// versions and the instances that wrote it.
    fn write_logged(&self, out: &mut impl Write) -> io::Result<()> {
        for rules in std::iter::once(&self.rules).chain(&self.against) {
            if !rules.unknown_keys.is_empty() {
                let list: Vec<String> = rules
                    .unknown_keys
                    .iter()
                    .map(|(k, n)| format!("{k} ({})", group(*n)))
                    .collect();
                writeln!(
                    out,
                    "key ids not in {}, replayed as callers without a key: {}",
                    rules.file,
                    list.join(", ")
                )?;
            }
        }
        if !self.rules_versions.is_empty() {
            let list: Vec<String> = self
                .rules_versions
                .iter()
                .map(|(v, n)| format!("{v} ({})", group(*n)))
                .collect();
            writeln!(out, "rules versions logged: {}", list.join(", "))?;
        }
        if let Some(note) = &self.versions_note {
            writeln!(out, "note: {note}")?;
        }
        if !self.instances.is_empty() {
            let list: Vec<String> = self
                .instances
                .iter()
                .map(|(i, n)| format!("{i} ({})", group(*n)))
                .collect();
            writeln!(out, "instances: {}", list.join(", "))?;
        }
        Ok(())
    }

    fn write_keys(&self, out: &mut impl Write) -> io::Result<()> {
        // Key ids are bounded as they are read; the cap keeps a width the formatter takes.
        let w = self
            .keys
            .iter()
            .map(|k| k.key.len())
            .max()
            .unwrap_or(3)
            .clamp(3, MAX_KEY_ID);
        let against = self.against.is_some();
        let heads: &[&str] = if against {
            &[
                "requests",
                "admitted running",
                "admitted proposed",
                "newly refused",
                "newly admitted",
                "longest Retry-After",
                "agree",
                "disagree",
            ]
        } else {
            &[
                "requests",
                "logged admitted",
                "logged refused",
                "replayed admitted",
                "replayed refused",
                "agree",
                "disagree",
            ]
        };
        write!(out, "{:<w$}", "key")?;
        for h in heads {
            write!(out, "  {h:>12}")?;
        }
        writeln!(out)?;
        for k in &self.keys {
            let cells: Vec<String> = if against {
                vec![
                    group(k.requests),
                    group(k.replayed_admitted),
                    group(k.admitted_proposed.unwrap_or(0)),
                    group(k.newly_refused),
                    group(k.newly_admitted),
                    k.longest_retry_after_s
                        .map_or("-".into(), |s| format!("{} s", group(s))),
                    group(k.agree),
                    group(k.disagree),
                ]
            } else {
                vec![
                    group(k.requests),
                    group(k.logged_admitted),
                    group(k.logged_refused),
                    group(k.replayed_admitted),
                    group(k.replayed_refused),
                    group(k.agree),
                    group(k.disagree),
                ]
            };
            write!(out, "{:<w$}", k.key)?;
            for (h, c) in heads.iter().zip(cells) {
                let cw = h.len().max(12);
                write!(out, "  {c:>cw$}")?;
            }
            writeln!(out)?;
        }
        if let Some(h) = &self.max_newly_refused {
            writeln!(out)?;
            if h.over.is_empty() {
                writeln!(
                    out,
                    "newly refused: no key above {}% of its admitted requests",
                    h.pct
                )?;
            } else {
                writeln!(
                    out,
                    "newly refused: above {}% of their admitted requests: {}",
                    h.pct,
                    h.over.join(", ")
                )?;
            }
        }
        Ok(())
    }
}

/// `n` and its noun, one or many.
fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", group(n), if n == 1 { one } else { many })
}
