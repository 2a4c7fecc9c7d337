//! Demo upstream instances behind one upstream of a real gateway, for the tests of an
//! upstream's targets: each instance answers with its own name.

use std::net::SocketAddr;

use http::StatusCode;
use serde_json::{Value, json};

use super::{Http, Tollgate};

/// A `tollgate demo-upstream` process answering as `name`.
pub struct Instance(super::DemoUpstreamProc);

impl Instance {
    /// On `listen` (a port of 0: one the OS picks), each request taking `latency_ms` when given.
    pub fn spawn(name: &str, listen: &str, latency_ms: Option<u64>) -> Instance {
        let ms = latency_ms.map(|ms| ms.to_string());
        let mut args = vec!["--listen", listen, "--instance", name];
        if let Some(ms) = &ms {
            args.extend(["--workers", "64", "--latency-ms", ms]);
        }
        Instance(super::DemoUpstreamProc::spawn_with(&args))
    }

    pub fn addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// Killed with SIGKILL, as a crash or an evicted pod would be.
    pub fn kill(&mut self) {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
    }
}

/// A gateway on the demo rules whose `orders` upstream is `upstream` (its `targets` and the
/// rest), on the embedded store.
pub fn gateway(upstream: Value) -> (Tollgate, tempfile::TempDir) {
    let mut rules: Value =
        serde_json::from_str(&super::demo_rules_for("127.0.0.1:9".parse().unwrap())).unwrap();
    rules["upstreams"]["orders"] = upstream;
    let (dir, path) = super::rules_file(&rules.to_string());
    let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap(), "--store", "memory"]);
    (gw, dir)
}

pub fn targets(instances: &[&Instance]) -> Value {
    json!(
        instances
            .iter()
            .map(|i| json!({"url": format!("http://{}", i.addr())}))
            .collect::<Vec<_>>()
    )
}

/// A GET of `/v1/orders` with `key`: its status and the instance that answered.
pub async fn get(http: &Http, gw: &Tollgate, path: &str, key: &str) -> (StatusCode, Option<String>) {
    let a = http.get(&gw.url(path), &[("x-api-key", key)]).await;
    let who = serde_json::from_slice::<Value>(&a.body)
        .ok()
        .and_then(|v| v["instance"].as_str().map(str::to_string));
    (a.status, who)
}

/// The value of the gateway's metric line that starts with `prefix`, 0 when none.
pub async fn metric(http: &Http, gw: &Tollgate, prefix: &str) -> f64 {
    let text = String::from_utf8(http.get(&gw.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
