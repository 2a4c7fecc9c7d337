//! What the Dockerfile promises, checked without a Docker daemon: the file its
//! `TOLLGATE_RULES` names is one the image copies and `rules/` holds (so mounting `rules/`
//! over `/etc/tollgate` finds it), that file passes `check-rules`, every `TOLLGATE_*` it sets is
//! a flag `tollgate serve --help` names, and its HEALTHCHECK command answers for a real
//! gateway and fails for none.

mod common;

use std::collections::BTreeSet;

use common::Tollgate;
use common::cli::{fails, ok, tollgate};

fn dockerfile() -> String {
    std::fs::read_to_string(common::repo().join("Dockerfile")).unwrap()
}

/// The run stage's `ENV` settings, `NAME=value` over continued lines.
fn env(docker: &str) -> Vec<(String, String)> {
    let run_stage = docker.rsplit("\nFROM ").next().unwrap();
    let joined = run_stage.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ENV "))
        .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

#[test]
fn the_image_names_a_rules_file_that_rules_holds_and_that_passes() {
    let docker = dockerfile();
    let vars = env(&docker);
    let rules = vars
        .iter()
        .find(|(k, _)| k == "TOLLGATE_RULES")
        .map(|(_, v)| v.clone())
        .expect("the image sets TOLLGATE_RULES");
    let name = rules.strip_prefix("/etc/tollgate/").unwrap_or_else(|| {
        panic!("TOLLGATE_RULES={rules} is not under /etc/tollgate, where rules/ is mounted")
    });
    let local = common::repo().join("rules").join(name);
    assert!(
        local.is_file(),
        "rules/{name} is missing: mounting rules/ would not find it"
    );
    assert!(
        docker.lines().any(|l| l.starts_with("COPY rules/")
            && l.contains(&format!("rules/{name}"))
            && l.trim_end().ends_with("/etc/tollgate/")),
        "the image does not bake rules/{name} into /etc/tollgate/"
    );
    let summary = ok(&tollgate(&["check-rules", local.to_str().unwrap()]));
    assert!(summary.contains("version"), "{summary}");

    let help = ok(&tollgate(&["serve", "--help"]));
    let named: BTreeSet<&str> = help
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("TOLLGATE_"))
        .collect();
    for (k, _) in &vars {
        assert!(
            named.contains(k.as_str()),
            "{k} is no flag of tollgate serve: {named:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_healthcheck_answers_for_a_live_gateway_and_fails_for_none() {
    let docker = dockerfile();
    let check = docker
        .lines()
        .find(|l| l.starts_with("HEALTHCHECK"))
        .expect("the image has a HEALTHCHECK");
    assert!(check.contains(r#"CMD ["tollgate", "healthcheck"]"#), "{check}");

    let gw = Tollgate::spawn(&["demo"]);
    let admin = gw.admin.expect("admin listener");
    let o = tollgate(&["healthcheck", "--admin-listen", &admin.to_string()]);
    ok(&o);
    // As the image sets it: every address, asked on loopback.
    let any = format!("0.0.0.0:{}", admin.port());
    ok(&tollgate(&["healthcheck", "--admin-listen", &any]));
    // A path that is not 200 fails, and says what it got.
    let err = fails(&tollgate(&[
        "healthcheck",
        "--admin-listen",
        &admin.to_string(),
        "--path",
        "/nope",
    ]));
    assert!(err.contains("404"), "{err}");
    drop(gw);
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = fails(&tollgate(&["healthcheck", "--admin-listen", &free.to_string()]));
    assert!(err.contains("tollgate healthcheck"), "{err}");
}

/// What a SIGTERM does, in order: `/readyz` answers 503 at once while the public port still
/// serves; after `--shutdown-delay` the listener stops (new connections are refused); the
/// request in flight finishes; the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_fails_readiness_then_stops_the_listener_then_finishes_what_is_in_flight() {
    use std::time::{Duration, Instant};
    let mut gw = Tollgate::spawn(&["demo", "--shutdown-delay", "4s", "--drain-timeout", "10s"]);
    let http = common::Http::new();
    let auth = format!("Bearer {}", common::K7);
    let headers = [("authorization", auth.as_str())];
    assert_eq!(http.get(&gw.admin_url("/readyz"), &[]).await.status, 200);

    let slow = {
        let (http, url, auth) = (http.clone(), gw.url("/v1/slow?ms=5500"), auth.clone());
        tokio::spawn(async move { http.get(&url, &[("authorization", auth.as_str())]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let signalled = Instant::now();
    gw.signal("TERM");

    // 1. Not ready, at once.
    let mut ready = http.get(&gw.admin_url("/readyz"), &[]).await;
    while ready.status == 200 && signalled.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ready = http.get(&gw.admin_url("/readyz"), &[]).await;
    }
    assert_eq!(ready.status, 503);
    assert_eq!(ready.json()["status"], "draining");
    // 2. Still serving new connections within the delay.
    let fresh = common::Http::new();
    assert_eq!(fresh.get(&gw.url("/v1/orders"), &headers).await.status, 200);
    assert!(
        signalled.elapsed() < Duration::from_secs(4),
        "the check came too late to mean anything"
    );
    // 3. Then the listener stops: new connections are refused.
    let addr = gw.addr;
    let refused = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(_) => break signalled.elapsed(),
            Ok(_) if signalled.elapsed() > Duration::from_secs(10) => {
                panic!("still accepting 10 s after SIGTERM")
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    assert!(
        refused >= Duration::from_secs(4),
        "stopped accepting after {refused:?}, before the delay"
    );
    // 4. The request in flight finishes, and the process exits cleanly.
    let answer = slow.await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let status = gw.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}
