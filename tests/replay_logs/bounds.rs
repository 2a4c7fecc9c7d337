//! Hostile input to `tollgate replay`: a key id of a megabyte in each format is a line too long,
//! counted and read past, and a gzip bomb (a small file expanding to hundreds of megabytes of
//! one line, or of lines too long) is replayed within a few tens of megabytes of memory.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::cli::{ok, p, tollgate};
use crate::{combined, json, k7, logs, replay_json};

/// A key id of 1 MiB: a line holding it passes any line's bound.
fn huge_key() -> String {
    "k".repeat(1 << 20)
}

#[test]
fn a_key_id_of_a_megabyte_is_a_line_too_long_in_each_format() {
    let l = logs();
    let (huge, long) = (huge_key(), "k".repeat(2048));
    for (name, line) in [("json", json(&k7(0), 2)), ("combined", combined(&k7(0), 2))] {
        let log = l.path(&format!("huge.{name}.log"));
        let (huge, long) = (line.replace("k-7", &huge), line.replace("k-7", &long));
        std::fs::write(&log, format!("{line}\n{huge}\n{long}\n{line}\n")).unwrap();
        let text = ok(&tollgate(&["replay", p(&log), "--rules", p(&l.running)]));
        assert!(
            text.contains("skipped: 2 that are not access lines, 2 too long (over 65,536 bytes"),
            "{name}: {text}"
        );
        assert!(text.lines().any(|r| r.starts_with("k-7 ")), "{name}: {text}");
        let v = replay_json(&[p(&log), "--rules", p(&l.running)]);
        let lines = &v["lines"];
        let counts = ["read", "access", "skipped", "too_long"].map(|f| lines[f].as_u64());
        assert_eq!(counts, [4, 2, 2, 2].map(Some), "{name}: {lines}");
        assert_eq!(v["inputs"][0]["too_long"], 2, "{name}");
    }

    let csv = l.path("huge.csv");
    std::fs::write(
        &csv,
        format!("time,key\n1.0,k-7\n2.0,{huge}\n2.5,{long}\n3.0,k-8\n"),
    )
    .unwrap();
    let args = ["replay", p(&csv), "--rate", "10/1s", "--burst", "5"];
    let text = ok(&tollgate(&args));
    assert!(
        text.contains("skipped: 2 rows too long (over 65,536 bytes"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&tollgate(&[&args[..], &["--json"]].concat()))).unwrap();
    let counts = ["requests", "too_long_rows"].map(|f| v[f].as_u64());
    assert_eq!(counts, [2, 2].map(Some), "{v}");
}

/// Peak memory a replay may take, whatever a file expands to: the binary itself, a line's
/// bound twice over, the read buffers and the gzip window take a few megabytes.
const PEAK_KIB: u64 = 64 * 1024;

/// 200 MB when expanded.
const BOMB: usize = 200 << 20;

/// `to`, gzip of what `write` writes.
fn gzip(to: &Path, write: impl FnOnce(&mut dyn Write)) {
    let mut e = flate2::write::GzEncoder::new(
        std::io::BufWriter::new(File::create(to).unwrap()),
        flate2::Compression::fast(),
    );
    write(&mut e);
    e.finish().unwrap().flush().unwrap();
}

/// Runs `tollgate args` to its end, sampling its peak resident memory (VmHWM) as it runs:
/// its exit status, standard output and peak in KiB. Its output goes to files, which can't
/// fill up and stall it as a pipe could.
fn measured(dir: &Path, args: &[&str]) -> (Option<i32>, String, u64) {
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .stdout(Stdio::from(File::create(&out).unwrap()))
        .stderr(Stdio::from(File::create(&err).unwrap()))
        .spawn()
        .expect("run tollgate");
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    let code = loop {
        // Read before the wait: once it has ended its status holds no memory figures.
        if let Ok(s) = std::fs::read_to_string(&status)
            && let Some(kib) = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak = peak.max(kib);
        }
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert!(peak > 0, "no memory figure read for {args:?}");
    let stdout = std::fs::read_to_string(&out).unwrap();
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
    (code, stdout, peak)
}

#[test]
fn a_gzip_bomb_replays_in_bounded_memory() {
    let l = logs();
    let access = format!("{}\n", json(&k7(0), 2));
    let a = vec![b'a'; 1 << 20];
    let one_line = |w: &mut dyn Write| {
        for _ in 0..BOMB / a.len() {
            w.write_all(&a).unwrap();
        }
    };

    let log = l.path("one-line.log.gz");
    gzip(&log, |w| {
        w.write_all(access.as_bytes()).unwrap();
        one_line(w);
    });
    // Before the first access line, where the format is told.
    let lines_first = l.path("lines-first.log.gz");
    gzip(&lines_first, |w| {
        for _ in 0..999 {
            w.write_all(&a[..BOMB / 1_000]).unwrap();
            w.write_all(b"\n").unwrap();
        }
        w.write_all(access.as_bytes()).unwrap();
    });
    // Access lines of a megabyte each, every one a key id of its own.
    let huge_lines = l.path("huge-lines.log.gz");
    gzip(&huge_lines, |w| {
        w.write_all(access.as_bytes()).unwrap();
        let line = json(&k7(1), 2).replace("k-7", &huge_key());
        for i in 0..BOMB >> 20 {
            writeln!(w, "{}", line.replacen("kkkk", &format!("{i:04}"), 1)).unwrap();
        }
    });
    let csv = l.path("one-row.csv.gz");
    gzip(&csv, |w| {
        w.write_all(b"time,key\n1.0,k-7\n").unwrap();
        one_line(w);
    });

    for (file, too_long) in [(&log, 1), (&lines_first, 999), (&huge_lines, 200)] {
        let size = std::fs::metadata(file).unwrap().len();
        assert!(size < 1 << 20, "{file:?} is {size} bytes");
        let (code, out, peak) = measured(
            l.dir.path(),
            &["replay", p(file), "--rules", p(&l.running), "--json"],
        );
        eprintln!("{file:?}: peak {peak} KiB");
        assert!(peak < PEAK_KIB, "{file:?}: peak {peak} KiB");
        assert_eq!(code, Some(0), "{file:?}: {out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (&v["lines"]["access"], &v["lines"]["too_long"]),
            (&1.into(), &too_long.into()),
            "{file:?}: {out}"
        );
    }
    let (code, out, peak) = measured(
        l.dir.path(),
        &["replay", p(&csv), "--rate", "10/1s", "--burst", "5", "--json"],
    );
    eprintln!("{csv:?}: peak {peak} KiB");
    assert!(peak < PEAK_KIB, "CSV: peak {peak} KiB");
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["requests"], &v["too_long_rows"]),
        (&1.into(), &1.into()),
        "{out}"
    );
}
