//! The `tollgate replay` command, run from its flags ([`super::flags`]): read a trace (or
//! generate one), replay it under each `--design`, print the table or `--json`, write
//! `--decisions` and draw `--plot`; or hand the gateway's access logs to [`super::logs`].

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::sync::Arc;

use super::edge::EdgeConfig;
use super::flags::{Block, Generated, ReplayArgs};
use super::lines::Lines;
use super::logs::{self, Inputs};
use super::plot::{Admitted, Chart, Format};
use super::report::{DecisionWriter, Summary};
use super::trace::TraceReader;
use super::{Algorithm, Design, LimitSpec, Replay, ReplayError, Settings, generate, run_trace, setting};
use tollgate_limit::bucket::US_PER_S;
use tollgate_rules::CompileOptions;

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ReplayError {
    let what = what.into();
    move |e| ReplayError::Io {
        what,
        reason: e.to_string(),
    }
}

/// The designs to replay, in the order given; each at most once.
fn designs(a: &ReplayArgs) -> Result<Vec<Design>, ReplayError> {
    let mut out: Vec<Design> = Vec::with_capacity(a.design.len());
    for &d in &a.design {
        if out.contains(&d) {
            return Err(setting("--design", format!("{} is listed twice", d.name())));
        }
        out.push(d);
    }
    if out.is_empty() {
        out.push(Design::default());
    }
    if matches!(a.lease_block, Some(Block::Tokens(_))) && !out.contains(&Design::Lease) {
        return Err(setting(
            "--lease-block",
            "only means something with --design lease",
        ));
    }
    Ok(out)
}

/// The settings these arguments describe, one per design in `--design` order (the rules file
/// is loaded and compiled here, once).
pub fn settings(a: &ReplayArgs) -> Result<Vec<Settings>, ReplayError> {
    let designs = designs(a)?;
    let edge = designs.contains(&Design::Edge);
    let others = designs.iter().any(|&d| d != Design::Edge);
    let edge_flags = [
        ("--edge-rule", a.edge_rule.is_some()),
        ("--edge-check", a.edge_check.is_some()),
        ("--edge-delay", a.edge_delay.is_some()),
        ("--edge-count-blocked", a.edge_count_blocked.is_some()),
    ];
    if let Some((flag, _)) = edge_flags.iter().find(|f| f.1 && !edge) {
        return Err(setting(flag, "only means something with --design edge"));
    }
    if !others {
        let gateway_flags = [
            ("--rate", a.rate.is_some()),
            ("--burst", a.burst.is_some()),
            ("--rules", a.rules.is_some()),
            ("--queue", a.queue.is_some()),
            ("--algorithm", a.algorithm != Algorithm::default()),
        ];
        if let Some((flag, _)) = gateway_flags.iter().find(|f| f.1) {
            return Err(setting(
                flag,
                "the edge design replays its own rule, --edge-rule; add a design for the gateway's limit beside it, such as --design edge,central",
            ));
        }
    }
    let limit = match (&a.rules, a.rate) {
        _ if !others => None,
        (Some(path), _) => {
            let snap = tollgate_rules::load(path, CompileOptions::default())?;
            Some(LimitSpec::Rules(Arc::new(snap)))
        }
        (None, Some(rate)) => Some(LimitSpec::Single { rate, burst: a.burst }),
        (None, None) => {
            return Err(setting(
                "--rate",
                "give --rate N/P (with --burst B), or --rules FILE",
            ));
        }
    };
    let edge_cfg = match a.edge_rule {
        Some(rule) => Some(EdgeConfig {
            rule,
            check_us: a.edge_check.unwrap_or(10 * US_PER_S),
            delay_us: a.edge_delay.unwrap_or(30 * US_PER_S),
            count_blocked: a.edge_count_blocked.unwrap_or(true),
        }),
        None if edge => {
            return Err(setting(
                "--edge-rule",
                "required with --design edge: the rule's N requests per trailing window W from one address, such as 3000/60s",
            ));
        }
        None => None,
    };
    Ok(designs
        .into_iter()
        .filter_map(|design| {
            let limit = match design {
                Design::Edge => LimitSpec::Edge(edge_cfg?),
                _ => limit.clone()?,
            };
            Some(Settings {
                limit,
                design,
                algorithm: a.algorithm,
                gateways: a.gateways,
                seed: a.seed,
                lease_rtt_us: a.lease_rtt,
                lease_block: match a.lease_block {
                    Some(Block::Tokens(n)) if design == Design::Lease => Some(n),
                    _ => None,
                },
                excess_from_us: a.excess_from,
                queue: a.queue.filter(|_| design != Design::Edge),
            })
        })
        .collect())
}

/// Runs `tollgate replay`.
pub fn main(a: &ReplayArgs) -> Result<(), ReplayError> {
    if let Some(which) = a.generate {
        if a.gateways == 0 {
            return Err(setting("--gateways", "must be at least 1"));
        }
        if a.second_app.is_some() && which != Generated::Storm {
            return Err(setting("--second-app", "goes with --generate storm"));
        }
        let target = a
            .output
            .as_ref()
            .map_or("standard output".to_string(), |p| p.display().to_string());
        let mut out: Box<dyn Write> = match &a.output {
            Some(p) => Box::new(BufWriter::with_capacity(
                1 << 20,
                File::create(p).map_err(io_err(format!("cannot create {}", p.display())))?,
            )),
            None => Box::new(BufWriter::with_capacity(1 << 20, io::stdout().lock())),
        };
        let written = match (which, a.second_app) {
            (Generated::Storm, None) => {
                generate::write_csv(generate::storm(a.gateways).into_iter(), None, &mut out)
            }
            (Generated::Storm, Some(rate)) => generate::write_csv(
                generate::with_second_app(generate::storm(a.gateways), rate, a.gateways),
                Some(generate::PARTNER_IP),
                &mut out,
            ),
            (Generated::Hot, _) => generate::write_csv(generate::hot(a.gateways), None, &mut out),
        };
        written.map_err(io_err(format!("cannot write {target}")))?;
        return Ok(());
    }
    if a.trace.is_empty() {
        return Err(setting(
            "FILE",
            "give a trace file, access logs, - for standard input, or --generate",
        ));
    }
    let inputs = a
        .trace
        .iter()
        .map(|p| logs::open(p))
        .collect::<Result<Vec<_>, _>>()?;
    match logs::classify(inputs)? {
        Inputs::Trace(input) => {
            logs::refuse_log_flags(a)?;
            let (name, size) = (input.name.clone(), input.size);
            replay_trace(a, input.into_lines(), &name, size)
        }
        Inputs::Logs(inputs) => logs::main(a, inputs),
    }
}

/// Replays one CSV trace under each design.
fn replay_trace(
    a: &ReplayArgs,
    input: Lines<Box<dyn io::BufRead>>,
    name: &str,
    size: Option<u64>,
) -> Result<(), ReplayError> {
    let settings = settings(a)?;
    let designs: Vec<Design> = settings.iter().map(|s| s.design).collect();
    // Refuse a bad --plot before a long replay, not after it.
    if let Some(p) = &a.plot {
        Format::of(p)?;
    }
    let window = a.plot_window.unwrap_or_default();
    let mut replays = settings
        .into_iter()
        .map(Replay::new)
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(key) = &a.plot_tokens {
        for r in &mut replays {
            r.watch_tokens(key, a.plot_gateway, window)?;
        }
    }
    let mut reader = TraceReader::new(input, name)?;
    let mut decisions = match &a.decisions {
        Some(p) => {
            let f = File::create(p).map_err(io_err(format!("cannot create {}", p.display())))?;
            let columns: Vec<(&str, bool)> = designs
                .iter()
                .zip(&replays)
                .map(|(d, r)| (d.name(), r.waits()))
                .collect();
            Some(
                DecisionWriter::new(BufWriter::with_capacity(1 << 20, f), &columns)
                    .map_err(io_err(format!("cannot write {}", p.display())))?,
            )
        }
        None => None,
    };
    let dname = a
        .decisions
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut admitted = a.plot.as_ref().map(|_| Admitted::new(window, designs.len()));
    run_trace(&mut replays, &mut reader, true, size, &mut |t, v, replays| {
        if let Some(d) = decisions.as_mut() {
            d.write(t, v, &mut |i, b| replays[i].block_end(b, Some(t)))
                .map_err(io_err(format!("cannot write {dname}")))?;
        }
        if let Some(p) = admitted.as_mut() {
            p.row(t, v);
        }
        Ok(())
    })?;
    if let Some(d) = decisions {
        d.finish(&mut |i, b| replays[i].block_end(b, None))
            .map_err(io_err(format!("cannot write {dname}")))?;
    }
    let mut summaries: Vec<Summary> = replays.iter().map(Replay::summary).collect();
    for s in &mut summaries {
        s.too_long_rows = reader.too_long();
    }
    let mut out = io::stdout().lock();
    let written = match (a.json, summaries.as_slice()) {
        (true, [one]) => writeln!(out, "{}", one.to_json()),
        (true, many) => writeln!(out, "{}", Summary::many_to_json(many)),
        (false, many) => many.iter().enumerate().try_for_each(|(i, s)| {
            if i > 0 {
                writeln!(out)?;
            }
            s.write_table(&mut out)
        }),
    };
    written.map_err(io_err("cannot write to standard output"))?;
    // After the summary: a chart that cannot be written must not cost the figures.
    if let (Some(path), Some(admitted)) = (&a.plot, admitted) {
        plot(a, path, &designs, &replays, &summaries[0], admitted)?;
    }
    Ok(())
}

/// Draws `--plot` from what the replays recorded.
fn plot(
    a: &ReplayArgs,
    path: &std::path::Path,
    designs: &[Design],
    replays: &[Replay],
    summary: &Summary,
    admitted: Admitted,
) -> Result<(), ReplayError> {
    let tokens = match &a.plot_tokens {
        None => None,
        Some(key) => {
            let mut traces = Vec::with_capacity(replays.len());
            for (r, d) in replays.iter().zip(designs) {
                let Some(t) = r.token_trace() else {
                    return Err(setting(
                        "--plot-tokens",
                        format!("{key:?} is not a key of this trace"),
                    ));
                };
                let label = match d {
                    Design::Local | Design::Shares => format!("{} (gateway {})", d.name(), a.plot_gateway),
                    _ => d.name().to_string(),
                };
                traces.push((label, t.clone()));
            }
            Some((key.clone(), traces))
        }
    };
    let chart = Chart {
        subject: format!(
            "{}, {}, {} gateways",
            summary.limit, summary.algorithm, summary.gateways
        ),
        designs,
        admitted,
        tokens,
    };
    chart.write(path)
}
