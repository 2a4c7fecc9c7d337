//! The outside health check of other Regions: one URL each, polled every rebalance interval.
//! It is the second signal, apart from the records: a Region whose records stopped may only be
//! cut off from the others, and then its gateways still serve and still spend its share.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use http::Uri;
use http_body_util::Empty;
use tokio::sync::watch;

/// How long one check may take before the Region counts as down.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// What the last check of a Region said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// No check has answered yet.
    Unknown,
    Up,
    Down,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Unknown => "unknown",
            Status::Up => "up",
            Status::Down => "down",
        }
    }
}

/// The checked Regions and what their last check said.
pub(crate) struct Health {
    urls: BTreeMap<String, Uri>,
    status: Mutex<BTreeMap<String, Status>>,
}

/// A plain `http://HOST:PORT/PATH`: the check runs beside the gateway, without TLS.
pub(crate) fn parse_url(text: &str) -> Result<Uri, String> {
    let uri: Uri = text.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("the health check must be an http:// URL".into());
    }
    if uri.authority().is_none() {
        return Err("the URL names no host".into());
    }
    Ok(uri)
}

impl Health {
    pub fn new(urls: &BTreeMap<String, String>) -> Health {
        let urls: BTreeMap<String, Uri> = urls
            .iter()
            .filter_map(|(r, u)| parse_url(u).ok().map(|u| (r.clone(), u)))
            .collect();
        let status = urls.keys().map(|r| (r.clone(), Status::Unknown)).collect();
        Health {
            urls,
            status: Mutex::new(status),
        }
    }

    /// The Regions the last check reported down. A Region without a URL is never here: without
    /// the second signal its share is never reclaimed.
    pub fn down(&self) -> Vec<String> {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, s)| **s == Status::Down)
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// `region → "up" | "down" | "unknown" | "unchecked"` for the given Regions.
    pub fn describe<'a>(
        &self,
        regions: impl Iterator<Item = &'a String>,
    ) -> serde_json::Map<String, serde_json::Value> {
        let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        regions
            .map(|r| {
                let s = status.get(r).map_or("unchecked", |s| s.as_str());
                (r.clone(), serde_json::Value::from(s))
            })
            .collect()
    }

    /// Checks every Region at once, so one slow Region delays no other's answer.
    async fn check_all(&self) {
        let mut checks = tokio::task::JoinSet::new();
        for (r, u) in &self.urls {
            let (r, u) = (r.clone(), u.clone());
            checks.spawn(async move { (r, check(&u).await) });
        }
        while let Some(done) = checks.join_next().await {
            let Ok((r, up)) = done else { continue };
            let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            status.insert(r, if up { Status::Up } else { Status::Down });
        }
    }
}

/// One GET: a 2xx answer within the timeout is up; anything else is down.
async fn check(uri: &Uri) -> bool {
    tokio::time::timeout(CHECK_TIMEOUT, get(uri))
        .await
        .is_ok_and(|r| r.is_ok_and(|s| s.is_success()))
}

async fn get(uri: &Uri) -> Result<http::StatusCode, String> {
    let authority = uri.authority().ok_or("no host")?;
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port))
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(conn);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let req = http::Request::get(path)
        .header(http::header::HOST, authority.as_str())
        .header(http::header::CONNECTION, "close")
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let status = send.send_request(req).await.map_err(|e| e.to_string())?.status();
    driver.abort();
    Ok(status)
}

/// Checks every Region with a URL once per `every`, concurrently, until stopped.
pub(crate) async fn run(health: std::sync::Arc<Health>, every: Duration, mut stop: watch::Receiver<bool>) {
    if health.urls.is_empty() {
        return;
    }
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        health.check_all().await;
    }
}
