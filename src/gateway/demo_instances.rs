//! The demo's instances of its upstream: `tollgate demo --targets N` runs N demo upstreams, each
//! on a port of its own and answering with its name (`orders-1` …), all behind the demo's
//! upstreams; the admin listener stops and starts each one, so a user can watch the gateway
//! route around a lost instance with nothing but curl.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::demo::DemoUpstream;
use crate::server::{self, ServerLimits};

/// The most instances `--targets` starts.
pub const MAX_INSTANCES: u32 = 9;

/// One instance: its name and address, and while it runs, what stops it.
struct Instance {
    name: Arc<str>,
    addr: SocketAddr,
    stop: Mutex<Option<watch::Sender<bool>>>,
}

/// The demo's upstream instances.
pub struct DemoInstances {
    list: Vec<Instance>,
    limits: ServerLimits,
    /// The gateway's own stop: every instance stops a little after it.
    gateway_stop: watch::Receiver<bool>,
}

impl DemoInstances {
    /// Starts `n` instances on loopback ports the OS picks; a single one answers without a
    /// name, as the demo always did.
    pub async fn start(
        n: u32,
        limits: ServerLimits,
        gateway_stop: watch::Receiver<bool>,
    ) -> std::io::Result<Arc<DemoInstances>> {
        let mut list = Vec::new();
        let mut listeners = Vec::new();
        for i in 1..=n.max(1) {
            let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
            list.push(Instance {
                name: format!("orders-{i}").into(),
                addr: l.local_addr()?,
                stop: Mutex::new(None),
            });
            listeners.push(l);
        }
        let all = Arc::new(DemoInstances {
            list,
            limits,
            gateway_stop,
        });
        for (i, l) in listeners.into_iter().enumerate() {
            all.run(i, l);
        }
        Ok(all)
    }

    /// Their addresses, in order: the demo's upstreams' targets.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.list.iter().map(|i| i.addr).collect()
    }

    fn run(&self, i: usize, listener: TcpListener) {
        let inst = &self.list[i];
        let (tx, rx) = watch::channel(false);
        *inst.stop.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        let upstream = DemoUpstream {
            instance: (self.list.len() > 1).then(|| inst.name.clone()),
        };
        let gateway = self.gateway_stop.clone();
        let drain = self.limits.drain_timeout;
        tokio::spawn(server::run(
            listener,
            None,
            Arc::new(upstream),
            self.limits.clone(),
            async move {
                tokio::select! {
                    () = server::stopped(rx) => {}
                    () = server::stopped(gateway) => {
                        // The demo upstream outlives the gateway's drain.
                        tokio::time::sleep(drain + Duration::from_secs(1)).await;
                    }
                }
            },
        ));
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.list.iter().position(|i| &*i.name == name)
    }

    /// Stops the instance `name`: `None` when there is none; false when it was not running.
    pub fn stop(&self, name: &str) -> Option<bool> {
        let i = self.find(name)?;
        let tx = self.list[i]
            .stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Some(tx.is_some_and(|tx| tx.send(true).is_ok()))
    }

    /// Starts the instance `name` again on its address: `Ok(None)` when there is none,
    /// `Ok(Some(false))` when it was running.
    pub async fn start_again(&self, name: &str) -> std::io::Result<Option<bool>> {
        let Some(i) = self.find(name) else {
            return Ok(None);
        };
        if self.list[i]
            .stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return Ok(Some(false));
        }
        let l = TcpListener::bind(self.list[i].addr).await?;
        self.run(i, l);
        Ok(Some(true))
    }

    /// Each instance: its name, address and whether it runs.
    pub fn view(&self) -> serde_json::Value {
        let list: Vec<_> = self
            .list
            .iter()
            .map(|i| {
                let running = i.stop.lock().unwrap_or_else(PoisonError::into_inner).is_some();
                json!({"name": &*i.name, "addr": i.addr.to_string(), "running": running})
            })
            .collect();
        json!({ "instances": list })
    }
}
