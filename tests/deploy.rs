//! What the deployment files promise, checked without a Docker daemon or a cluster: the
//! Dockerfile's `TOLLGATE_RULES` names a file the image copies and `rules/` holds (so mounting
//! `rules/` over `/etc/tollgate` finds it) and that passes `check-rules`, every `TOLLGATE_*` it
//! sets is a flag of `tollgate serve`, and its HEALTHCHECK answers for a real gateway and fails
//! for none; README.md's Kubernetes manifests agree with the binary and with the image (its user,
//! its working directory, where it keeps its rules, its ports); and a real gateway's SIGTERM goes
//! in the order the README gives. `benches/image.sh` builds and runs the image itself.

mod common;

use std::collections::BTreeSet;

use common::Tollgate;
use common::cli::{fails, ok, tollgate};

fn dockerfile() -> String {
    std::fs::read_to_string(common::repo().join("Dockerfile")).unwrap()
}

/// The run stage's instructions in order, each as its keyword (upper case) and the rest of its
/// line, continued lines joined and comments dropped.
fn run_stage(docker: &str) -> Vec<(String, String)> {
    let stage = docker.rsplit("\nFROM ").next().unwrap();
    let logical = stage
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("\\\n", " ");
    logical
        .lines()
        .filter_map(|l| {
            let (k, rest) = l.trim().split_once(char::is_whitespace)?;
            Some((k.to_ascii_uppercase(), rest.trim().to_string()))
        })
        .collect()
}

/// The one value of a run-stage instruction (the last, as Docker takes it).
fn instruction(stage: &[(String, String)], keyword: &str) -> String {
    stage
        .iter()
        .rev()
        .find(|(k, _)| k == keyword)
        .map(|(_, v)| v.trim_matches(|c| c == '[' || c == ']' || c == '"').to_string())
        .unwrap_or_else(|| panic!("the Dockerfile's run stage has no {keyword}"))
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

/// The manifests of README.md's "Running on Kubernetes", every document of every `yaml` block.
fn manifests() -> Vec<serde_yaml_ng::Value> {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).unwrap();
    let section = readme
        .split("\n## Running on Kubernetes\n")
        .nth(1)
        .expect("README.md has a section \"Running on Kubernetes\"");
    let section = section.split("\n## ").next().unwrap();
    let mut docs = Vec::new();
    for block in section.split("```yaml\n").skip(1) {
        let yaml = block.split("\n```").next().unwrap();
        for doc in yaml.split("\n---\n") {
            docs.push(serde_yaml_ng::from_str(doc).unwrap_or_else(|e| panic!("{e}:\n{doc}")));
        }
    }
    docs
}

fn named<'a>(docs: &'a [serde_yaml_ng::Value], kind: &str, name: &str) -> &'a serde_yaml_ng::Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the README's manifests"))
}

fn text(v: &serde_yaml_ng::Value) -> String {
    match v {
        serde_yaml_ng::Value::String(s) => s.clone(),
        serde_yaml_ng::Value::Number(n) => n.to_string(),
        other => panic!("{other:?} is not text"),
    }
}

fn secs(v: &str) -> u64 {
    let d = v
        .strip_suffix('s')
        .unwrap_or_else(|| panic!("{v:?} is not in seconds"));
    d.parse().unwrap()
}

#[test]
fn the_kubernetes_manifests_agree_with_the_binary() {
    let docs = manifests();
    let kinds: BTreeSet<String> = docs.iter().map(|d| text(&d["kind"])).collect();
    for k in [
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    ] {
        assert!(kinds.contains(k), "no {k}: {kinds:?}");
    }
    let gw = named(&docs, "Deployment", "tollgate");
    let pod = &gw["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env: Vec<(String, Option<String>)> = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| (text(&e["name"]), e.get("value").map(text)))
        .collect();
    let value = |k: &str| {
        env.iter()
            .find(|(n, _)| n == k)
            .and_then(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("the Deployment sets no {k}"))
    };

    // Every variable is a flag of `tollgate serve`.
    let help = ok(&tollgate(&["serve", "--help"]));
    for (k, _) in &env {
        assert!(
            help.contains(&format!("[env: {k}=")),
            "{k} is no flag of tollgate serve"
        );
    }

    // The rules: the ConfigMap mounted as the directory TOLLGATE_RULES names a file in.
    let rules_path = value("TOLLGATE_RULES");
    let (dir, file) = rules_path.rsplit_once('/').unwrap();
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never sees the ConfigMap change"
    );
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let cm = named(&docs, "ConfigMap", &text(&volume["configMap"]["name"]));
    let rules = text(&cm["data"][file]);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(file);
    std::fs::write(&path, rules).unwrap();
    ok(&tollgate(&["check-rules", path.to_str().unwrap()]));

    // Ports: the listeners', by the names the probes and the Service use.
    let port_of = |name: &str| {
        let p = c["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no container port {name}"));
        p["containerPort"].as_u64().unwrap()
    };
    let listen_port = |k: &str| value(k).rsplit_once(':').unwrap().1.parse::<u64>().unwrap();
    assert_eq!(port_of("http"), listen_port("TOLLGATE_LISTEN"));
    assert_eq!(port_of("admin"), listen_port("TOLLGATE_ADMIN_LISTEN"));
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(text(&get["path"]), path, "{probe}");
        assert_eq!(
            port_of(&text(&get["port"])),
            listen_port("TOLLGATE_ADMIN_LISTEN"),
            "{probe}"
        );
    }
    let svc = named(&docs, "Service", "tollgate");
    assert_eq!(
        port_of(&text(&svc["spec"]["ports"][0]["targetPort"])),
        port_of("http")
    );

    // The store is the Redis Service.
    let store = value("TOLLGATE_STORE");
    let host = store.trim_start_matches("redis://").split(':').next().unwrap();
    named(&docs, "Service", host);

    // The grace covers the preStop, the shutdown delay, the drain and the upgrades' grace.
    let pre_stop = &c["lifecycle"]["preStop"]["exec"]["command"];
    assert_eq!(text(&pre_stop[0]), "sleep");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    let need = text(&pre_stop[1]).parse::<u64>().unwrap()
        + secs(&value("TOLLGATE_SHUTDOWN_DELAY"))
        + secs(&value("TOLLGATE_DRAIN_TIMEOUT"))
        + secs(&value("TOLLGATE_UPGRADE_GRACE"));
    assert!(
        grace > need,
        "terminationGracePeriodSeconds {grace} does not cover {need} s"
    );

    // Non-root, read-only, with resources.
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    assert!(c["resources"]["requests"]["cpu"].is_string() || c["resources"]["requests"]["cpu"].is_number());
    assert!(c["resources"]["limits"]["memory"].is_string());

    // The budget and the autoscaler are this Deployment's.
    let labels = &gw["spec"]["template"]["metadata"]["labels"];
    assert!(!labels.is_null(), "the pods have no labels");
    let pdb = named(&docs, "PodDisruptionBudget", "tollgate");
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(&svc["spec"]["selector"], labels);
    let hpa = named(&docs, "HorizontalPodAutoscaler", "tollgate");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["kind"], "Deployment");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], "tollgate");
}

/// The Deployment runs what the image holds: as the image's user, with an emptyDir where the
/// image keeps the embedded store's files, the ConfigMap mounted where the image bakes its
/// rules, on ports the image exposes, through the image's entrypoint.
#[test]
fn the_kubernetes_manifests_agree_with_the_image() {
    let docker = dockerfile();
    let stage = run_stage(&docker);
    let docs = manifests();
    let pod = &named(&docs, "Deployment", "tollgate")["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let mounts = c["volumeMounts"].as_sequence().unwrap();
    let volume_at = |path: &str| {
        let m = mounts
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("the Deployment mounts nothing at {path}"));
        pod["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap_or_else(|| panic!("no volume {:?}", m["name"]))
            .clone()
    };

    // The user: the image's USER is the pod's runAsUser and runAsGroup.
    let user = instruction(&stage, "USER");
    let (uid, gid) = user.split_once(':').unwrap_or((&user, &user));
    let ctx = &pod["securityContext"];
    assert_eq!(
        ctx["runAsUser"].as_u64().map(|u| u.to_string()).as_deref(),
        Some(uid),
        "runAsUser against USER {user}"
    );
    assert_eq!(
        ctx["runAsGroup"].as_u64().map(|g| g.to_string()).as_deref(),
        Some(gid),
        "runAsGroup against USER {user}"
    );

    // The working directory: the user's in the image, a VOLUME, and an emptyDir in the pod,
    // since the root filesystem is read-only and the embedded store writes its files there.
    let workdir = instruction(&stage, "WORKDIR");
    assert!(
        stage
            .iter()
            .any(|(k, v)| k == "RUN" && v.contains(&format!("chown {uid}:{gid} {workdir}"))),
        "the image does not give {workdir} to {uid}:{gid}"
    );
    assert_eq!(
        instruction(&stage, "VOLUME"),
        workdir,
        "the VOLUME is not the working directory"
    );
    assert!(
        volume_at(&workdir).get("emptyDir").is_some(),
        "the volume on {workdir} is no emptyDir"
    );

    // The rules: the ConfigMap goes over the directory the image copies its rules into, where the
    // image's own TOLLGATE_RULES points too.
    let baked = stage
        .iter()
        .find(|(k, v)| k == "COPY" && v.starts_with("rules/"))
        .map(|(_, v)| {
            v.split_whitespace()
                .last()
                .unwrap()
                .trim_end_matches('/')
                .to_string()
        })
        .expect("the image copies no rules");
    let image_rules = env(&docker)
        .into_iter()
        .find(|(k, _)| k == "TOLLGATE_RULES")
        .map(|(_, v)| v)
        .expect("the image sets TOLLGATE_RULES");
    assert_eq!(image_rules.rsplit_once('/').unwrap().0, baked);
    let rules = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "TOLLGATE_RULES")
        .map(|e| text(&e["value"]))
        .expect("the Deployment sets TOLLGATE_RULES");
    assert_eq!(
        rules.rsplit_once('/').unwrap().0,
        baked,
        "the rules are not where the image keeps them"
    );
    assert!(
        volume_at(&baked).get("configMap").is_some(),
        "no ConfigMap on {baked}"
    );

    // Ports the image exposes, and the image's entrypoint with the Deployment's arguments.
    let exposed: BTreeSet<u64> = instruction(&stage, "EXPOSE")
        .split_whitespace()
        .map(|p| p.trim_end_matches("/tcp").parse().unwrap())
        .collect();
    for p in c["ports"].as_sequence().unwrap() {
        let port = p["containerPort"].as_u64().unwrap();
        assert!(
            exposed.contains(&port),
            "container port {port} is not exposed: {exposed:?}"
        );
    }
    assert_eq!(instruction(&stage, "ENTRYPOINT"), "tollgate");
    assert!(
        c.get("command").is_none(),
        "the Deployment replaces the image's entrypoint"
    );
    let args: Vec<String> = c["args"].as_sequence().unwrap().iter().map(text).collect();
    ok(&tollgate(&[args[0].as_str(), "--help"]));
}
