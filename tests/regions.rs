//! `tollgate regions simulate` as a user runs it: the figures in its JSON, and a clear refusal
//! of a run it does not know.

use std::process::Command;

fn simulate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["regions", "simulate"])
        .args(args)
        .output()
        .expect("tollgate runs")
}

fn json(run: &str) -> serde_json::Value {
    let out = simulate(&["--run", run, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[test]
fn each_run_prints_its_figures() {
    let shift = json("demand-shift");
    assert_eq!(shift["run"], "demand-shift");
    assert_eq!(shift["max_sum"], 10_000.0);
    assert_eq!(shift["min_sum"].as_f64().unwrap().round(), 8_102.0);
    assert_eq!(
        shift["max_excess_over_contract"].as_f64().unwrap().round(),
        2_700.0
    );
    assert_eq!(
        json("demand-shift-jump")["max_sum"].as_f64().unwrap().round(),
        11_898.0
    );
    assert_eq!(json("all-at-once")["min_sum"].as_f64().unwrap().round(), 5_554.0);

    let admitted = |v: &serde_json::Value, t: &str| {
        v["seconds"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["t"] == t)
            .unwrap()["admitted"]
            .as_f64()
            .unwrap()
            .round()
    };
    assert_eq!(admitted(&json("lost-region-freeze"), "14:05:40"), 7_800.0);
    let two = json("lost-region-two-signals");
    assert!(admitted(&two, "14:05:38") < 10_000.0);
    assert_eq!(admitted(&two, "14:05:39"), 10_000.0);
    let silence = json("cut-off-silence");
    assert_eq!(admitted(&silence, "14:05:20"), 13_600.0);
    assert_eq!(silence["contract_broken_at"], "14:05:19.58");
    assert_eq!(silence["contract_measured_from"], "14:05:11.70");
    let cut = json("cut-off-two-signals");
    assert_eq!(admitted(&cut, "14:05:40"), 10_000.0);
    assert!(cut["contract_broken_at"].is_null());
    let row = &cut["seconds"][0];
    for field in ["shares", "pools", "grants_in_flight", "sum_of_shares", "admitted"] {
        assert!(row.get(field).is_some(), "no {field} in {row}");
    }
}

#[test]
fn the_table_ends_with_the_figures() {
    let out = simulate(&["--run", "demand-shift"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("min sum of shares 8102 at 14:00:06.70"), "{text}");
    assert!(text.starts_with("run demand-shift "), "{text}");
}

#[test]
fn a_name_an_earlier_release_printed_runs_under_its_new_name() {
    // G1-naive is what an earlier release called demand-shift-jump.
    let old = json("G1-naive");
    assert_eq!(old["run"], "demand-shift-jump");
    assert_eq!(old["max_sum"], json("demand-shift-jump")["max_sum"]);
}

#[test]
fn an_unknown_run_is_refused_naming_the_flag() {
    let out = simulate(&["--run", "G3"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--run") && err.contains("G3") && err.contains("demand-shift-jump"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
