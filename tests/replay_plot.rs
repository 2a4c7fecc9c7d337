//! `tollgate replay --plot`: the SVG chart parses and holds one series per design, the PNG
//! decodes at its size, one bucket's tokens follow the first 300 ms of the storm as worked out by hand, and
//! bad plot flags are refused with errors that name them.

mod common;

use std::path::Path;

use common::cli::{fails, ok, p, tollgate};
use tollgate_limit::bucket::Rate;
use tollgate_replay::generate::{self, STORM_START_US};
use tollgate_replay::plot::{Window, colour};
use tollgate_replay::{Design, Replay, Request, Settings};

fn storm(dir: &Path) -> std::path::PathBuf {
    let trace = dir.join("storm.csv");
    ok(&tollgate(&["replay", "--generate", "storm", "-o", p(&trace)]));
    trace
}

fn hex(d: Design) -> String {
    let c = colour(d);
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// The polylines drawn in a design's colour, as their point counts.
fn polylines(svg: &roxmltree::Document, d: Design) -> Vec<usize> {
    let stroke = hex(d);
    svg.descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(stroke.as_str()))
        .map(|n| n.attribute("points").unwrap_or("").split_whitespace().count())
        .collect()
}

fn texts(svg: &roxmltree::Document) -> Vec<String> {
    svg.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect()
}

#[test]
fn the_svg_parses_and_holds_one_series_per_design() {
    let dir = tempfile::tempdir().unwrap();
    let trace = storm(dir.path());
    let chart = dir.path().join("storm.svg");
    let out = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--design",
        "central,local,shares",
        "--json",
        "--plot",
        p(&chart),
    ]));
    // Plotting changes nothing else the command prints.
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json.as_array().map(Vec::len), Some(3));

    // Valid XML, one line per design with a point pair per second of the trace (08:59:00 to
    // 09:02:59, 240 seconds), and a legend entry naming each.
    let text = std::fs::read_to_string(&chart).unwrap();
    let svg = roxmltree::Document::parse(&text).expect("the SVG parses as XML");
    assert_eq!(svg.root_element().tag_name().name(), "svg");
    let labels = texts(&svg);
    for d in [Design::Central, Design::Local, Design::Shares] {
        let lines = polylines(&svg, d);
        let series: Vec<_> = lines.iter().filter(|&&n| n > 2).collect();
        assert_eq!(series, [&480], "{}: {lines:?}", d.name());
        assert!(
            labels.iter().any(|t| t == d.name()),
            "no legend for {}: {labels:?}",
            d.name()
        );
    }
    assert!(polylines(&svg, Design::Lease).is_empty());
    let title = "Admitted per second: 600/60s burst 20, token-bucket, 20 gateways";
    assert!(labels.iter().any(|t| t == title), "{labels:?}");
    assert!(labels.iter().any(|t| t == "admitted per second"), "{labels:?}");
    assert!(
        labels
            .iter()
            .any(|t| t == "seconds after 08:59:00.000 (trace time 32340.000000)"),
        "{labels:?}"
    );

    // One design draws one series; central is the default when --design is not given.
    let one = dir.path().join("one.svg");
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--plot",
        p(&one),
    ]));
    let text = std::fs::read_to_string(&one).unwrap();
    let svg = roxmltree::Document::parse(&text).expect("the SVG parses as XML");
    assert_eq!(
        polylines(&svg, Design::Central)
            .iter()
            .filter(|&&n| n > 2)
            .count(),
        1
    );
    assert!(polylines(&svg, Design::Local).is_empty());
}

#[test]
fn the_png_decodes_at_its_size_with_both_panels_drawn() {
    let dir = tempfile::tempdir().unwrap();
    let trace = storm(dir.path());
    let chart = dir.path().join("first-300ms.png");
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--design",
        "central,local",
        "--plot-tokens",
        "k-7",
        "--plot-window",
        "32400..+300ms",
        "--plot",
        p(&chart),
    ]));
    let file = std::io::BufReader::new(std::fs::File::open(&chart).unwrap());
    let mut reader = png::Decoder::new(file).read_info().expect("a PNG header");
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).expect("the PNG decodes");
    assert_eq!((info.width, info.height), (1000, 1040));
    assert_eq!(info.color_type, png::ColorType::Rgb);
    let pixels = &buf[..info.buffer_size()];
    for d in [Design::Central, Design::Local] {
        let c = colour(d);
        let n = pixels
            .chunks_exact(3)
            .filter(|px| px[0] == c.0 && px[1] == c.1 && px[2] == c.2)
            .count();
        assert!(n > 500, "{}: only {n} pixels of its colour", d.name());
    }
}

#[test]
fn tokens_follow_the_first_300_ms_of_the_storm() {
    let dir = tempfile::tempdir().unwrap();
    let trace = storm(dir.path());
    let chart = dir.path().join("tokens.svg");
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--design",
        "central,local",
        "--plot-tokens",
        "k-7",
        "--plot-gateway",
        "3",
        "--plot-window",
        "32400..+300ms",
        "--plot",
        p(&chart),
    ]));
    let text = std::fs::read_to_string(&chart).unwrap();
    let svg = roxmltree::Document::parse(&text).expect("the SVG parses as XML");
    let labels = texts(&svg);
    for (d, label) in [(Design::Central, "central"), (Design::Local, "local (gateway 3)")] {
        // Two series (admitted, tokens) and two legend marks.
        let lines = polylines(&svg, d);
        assert_eq!(
            lines.iter().filter(|&&n| n > 2).count(),
            2,
            "{}: {lines:?}",
            d.name()
        );
        assert!(
            labels.iter().any(|t| t == label),
            "no legend {label:?}: {labels:?}"
        );
    }
    assert!(labels.iter().any(|t| t == "Tokens in k-7's bucket"), "{labels:?}");
    assert!(
        labels
            .iter()
            .any(|t| t.starts_with("Admitted per second (10ms bins)")),
        "{labels:?}"
    );
    assert!(
        labels
            .iter()
            .any(|t| t.starts_with("milliseconds after 09:00:00.000")),
        "{labels:?}"
    );

    // What the panel draws, exactly: the central bucket is full when the storm starts, one
    // request every 2.5 ms takes a token each while refill adds 0.025, and the 21st finds
    // less than one.
    let mut s = Settings::single(Rate::parse("600/60s").unwrap(), Some(20));
    s.design = Design::Central;
    let mut replay = Replay::new(s).unwrap();
    let window = Window::parse("32400..+300ms").unwrap();
    replay.watch_tokens("k-7", 0, window).unwrap();
    for r in generate::storm(20) {
        replay
            .check(&Request {
                time_us: r.time_us,
                key: r.key,
                gateway: Some(r.gateway),
                ..Request::default()
            })
            .unwrap();
    }
    let t = replay.token_trace().expect("k-7 was checked");
    let scale = t.params().scale;
    let events = t.events();
    assert_eq!(events.len(), 120, "one arrival every 2.5 ms for 300 ms");
    assert_eq!(events[0], (STORM_START_US, 20 * scale, 19 * scale));
    // After 20 admissions in 47.5 ms the bucket holds what 47.5 ms refilled: 0.475 token.
    let (t20, _, after20) = events[19];
    assert_eq!(t20, STORM_START_US + 47_500);
    assert_eq!(after20, 47_500 * t.params().refill);
    assert_eq!(after20 * 1_000, 475 * scale);
    // The 21st is refused: it takes nothing.
    let (_, before21, after21) = events[20];
    assert_eq!(before21, after21);
    assert!(before21 < scale);
}

#[test]
fn bad_plot_flags_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let trace = storm(dir.path());
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", p(&trace), "--rate", "600/60s", "--burst", "20"];
        args.extend_from_slice(extra);
        tollgate(&args)
    };
    let jpg = dir.path().join("chart.jpg");
    let e = fails(&run(&["--plot", p(&jpg)]));
    assert!(
        e.contains("--plot") && e.contains("unknown extension \".jpg\"") && e.contains(".svg or .png"),
        "{e}"
    );
    assert!(!jpg.exists());
    let e = fails(&run(&["--plot", p(&dir.path().join("chart"))]));
    assert!(e.contains("--plot") && e.contains("no extension"), "{e}");
    let svg = dir.path().join("c.svg");
    let e = fails(&run(&["--plot", p(&svg), "--plot-tokens", "k-9"]));
    assert!(
        e.contains("--plot-tokens") && e.contains("\"k-9\" is not a key"),
        "{e}"
    );
    let e = fails(&run(&["--plot", p(&svg), "--plot-window", "32400"]));
    assert!(e.contains("--plot-window") && e.contains("FROM..TO"), "{e}");
    let e = fails(&run(&[
        "--design",
        "local",
        "--plot",
        p(&svg),
        "--plot-tokens",
        "k-7",
        "--plot-gateway",
        "20",
    ]));
    assert!(e.contains("--plot-gateway") && e.contains("0 to 19"), "{e}");
    let e = fails(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--algorithm",
        "fixed-window",
        "--plot",
        p(&svg),
        "--plot-tokens",
        "k-7",
    ]));
    assert!(
        e.contains("--plot-tokens") && e.contains("fixed-window keeps no tokens"),
        "{e}"
    );
    assert!(!svg.exists());
    // A chart that cannot be written fails the command, after the figures are printed.
    let nowhere = dir.path().join("missing").join("c.svg");
    let o = run(&["--plot", p(&nowhere), "--json"]);
    let e = fails(&o);
    assert!(e.contains("cannot write") && e.contains("c.svg"), "{e}");
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json["admitted"], 1_834);
}
