//! What the benchmarks under benches/ share: their `-- --name value` options, and nginx started
//! from one of benches/nginx/*.conf beside the gateway.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The value after `name` on the command line (`cargo bench --bench X -- --name value`), or
/// `default`; a value that does not parse stops the run, naming it.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)) {
        Some(v) => v.parse().unwrap_or_else(|_| panic!("{name}: can't read {v:?}")),
        None => default,
    }
}

/// An nginx started from one of benches/nginx/*.conf with its blanks filled (`__PORT__` and
/// `__DIR__` always, the rest from `fill`); killed on drop.
pub struct Nginx {
    pub child: Child,
    pub port: u16,
}

impl Nginx {
    pub fn start(conf: &str, dir: &Path, fill: &[(&str, String)]) -> Nginx {
        let port = super::free_port();
        let mut text = std::fs::read_to_string(super::repo().join("benches/nginx").join(conf)).expect(conf);
        text = text
            .replace("__PORT__", &port.to_string())
            .replace("__DIR__", dir.to_str().unwrap());
        for (k, v) in fill {
            text = text.replace(k, v);
        }
        let path = dir.join(conf);
        std::fs::write(&path, text).unwrap();
        let child = Command::new(super::require_binary("nginx"))
            .args(["-c", path.to_str().unwrap(), "-p", dir.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nginx");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nginx ({conf}) did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nginx { child, port }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
