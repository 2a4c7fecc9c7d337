//! A headless Chromium driven over the DevTools protocol, for tests of pages the gateway
//! serves: navigate, evaluate, collect console errors and uncaught exceptions, take
//! screenshots. Chromium must be installed (tests/run.sh installs Debian's `chromium`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One headless browser with one page; killed on drop.
pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: Ws,
    next_id: u64,
    /// Console errors and uncaught exceptions seen so far, as text.
    pub errors: Vec<String>,
}

impl Browser {
    /// Starts Chromium with a fresh profile and opens one blank page.
    pub async fn launch() -> Browser {
        let bin = super::require_binary("chromium");
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(bin)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let browser_ws = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("chromium printed its DevTools address within 30 s");
        let port = browser_ws
            .trim_start_matches("ws://127.0.0.1:")
            .split('/')
            .next()
            .unwrap()
            .to_string();
        // A page target of its own, through the HTTP side of the protocol.
        let r = super::Http::new()
            .send(
                http::Method::PUT,
                &format!("http://127.0.0.1:{port}/json/new?about:blank"),
                &[],
                b"",
            )
            .await;
        let v: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&r.body)));
        let page = v["webSocketDebuggerUrl"].as_str().unwrap().to_string();
        let (ws, _) = tokio_tungstenite::connect_async(page.as_str())
            .await
            .expect("the page's DevTools socket");
        let mut b = Browser {
            child,
            _profile: profile,
            ws,
            next_id: 0,
            errors: Vec::new(),
        };
        b.call("Runtime.enable", json!({})).await;
        b.call("Log.enable", json!({})).await;
        b.call("Page.enable", json!({})).await;
        b
    }

    /// Sends one command and returns its result; events that arrive meanwhile are read for
    /// errors.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(msg)).await.expect("send to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = tokio::time::timeout(left, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("chromium did not answer {method} within 30 s"));
            let Some(Ok(Message::Text(text))) = next else {
                continue;
            };
            let v: Value = serde_json::from_str(&text).unwrap();
            if v["id"] == id {
                if let Some(e) = v.get("error") {
                    panic!("{method} failed: {e}");
                }
                return v["result"].clone();
            }
            self.note(&v);
        }
    }

    fn note(&mut self, event: &Value) {
        let p = &event["params"];
        match event["method"].as_str() {
            Some("Runtime.consoleAPICalled") if p["type"] == "error" => {
                self.errors.push(format!("console.error: {}", p["args"]));
            }
            Some("Runtime.exceptionThrown") => {
                self.errors.push(format!("exception: {}", p["exceptionDetails"]));
            }
            Some("Log.entryAdded") if p["entry"]["level"] == "error" => {
                self.errors.push(format!("log: {}", p["entry"]));
            }
            _ => {}
        }
    }

    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
    }

    /// The value of a JavaScript expression in the page.
    pub async fn eval(&mut self, expr: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expr} threw: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is true in the page; fails naming what it waited for.
    pub async fn wait_for(&mut self, expr: &str, what: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        // Until the page has loaded, the elements an expression reads may not exist yet.
        let guarded =
            format!("(() => {{ try {{ return ({expr}) === true; }} catch (e) {{ return false; }} }})()");
        loop {
            if self.eval(&guarded).await == Value::Bool(true) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "waited {limit:?} for {what}; errors: {:?}",
                self.errors
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the page as it looks now.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine;
        let r = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .expect("base64 PNG")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
