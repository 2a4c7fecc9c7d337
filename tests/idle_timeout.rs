//! `--idle-timeout` on real `tollgate demo` processes: idle HTTP/1 keep-alive connections on the
//! express lane are closed within the idle timeout and a second.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{KBIG, Tollgate};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const IDLE: Duration = Duration::from_secs(2);
/// What "within the idle timeout" allows past it.
const SLACK: Duration = Duration::from_secs(1);

/// `tollgate demo --idle-timeout 2s` and `extra`.
fn gateway(extra: &[&str]) -> Tollgate {
    let mut args = vec!["demo", "--idle-timeout", "2s"];
    args.extend_from_slice(extra);
    Tollgate::spawn_with_env(&args, &[("TOLLGATE_LOG", "warn")])
}

/// Raises the descriptor limit (the gateway inherits it) to hold `conns` on each side.
fn descriptors_for(conns: usize) {
    let limit = rlimit::increase_nofile_limit(u64::MAX).expect("raise the descriptor limit");
    assert!(
        limit as usize > conns + 1000,
        "the descriptor limit is {limit}: this test needs {} (raise the hard limit)",
        conns + 1000
    );
}

fn worst(helds: &[Duration]) -> Duration {
    helds.iter().copied().max().unwrap_or_default()
}

/// `n` HTTP/1.1 keep-alive connections to `addr`, each idle after one GET of `path`: how long
/// each stayed open after its answer.
async fn many_h1(addr: SocketAddr, n: usize, path: &'static str) -> Vec<Duration> {
    let mut set = tokio::task::JoinSet::new();
    let opening = Arc::new(tokio::sync::Semaphore::new(100));
    for _ in 0..n {
        let opening = opening.clone();
        set.spawn(async move {
            let permit = opening.acquire_owned().await.unwrap();
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            let head = format!("GET {path} HTTP/1.1\r\nHost: gw\r\nX-API-Key: {KBIG}\r\n\r\n");
            tcp.write_all(head.as_bytes()).await.unwrap();
            assert_eq!(common::read_status(&mut tcp, Duration::from_secs(20)).await, 200);
            let idle_from = Instant::now();
            drop(permit);
            let mut one = [0u8; 1];
            match tokio::time::timeout(Duration::from_secs(30), tcp.read(&mut one)).await {
                Ok(Ok(0) | Err(_)) => idle_from.elapsed(),
                Ok(Ok(_)) => panic!("the gateway sent bytes on an idle connection"),
                Err(_) => panic!("the gateway kept an idle HTTP/1.1 connection open for 30 s"),
            }
        });
    }
    let mut helds = Vec::with_capacity(n);
    while let Some(held) = set.join_next().await {
        helds.push(held.unwrap());
    }
    helds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http1_connections_are_closed_on_the_lane() {
    const N: usize = 1_000;
    descriptors_for(N);
    let gw = gateway(&[]);
    let helds = many_h1(gw.addr, N, "/v1/orders").await;
    let late = helds.iter().filter(|h| **h > IDLE + SLACK).count();
    assert_eq!(
        late,
        0,
        "{late} of {N} idle connections stayed open past {:?} (longest {:?})",
        IDLE + SLACK,
        worst(&helds)
    );
}

/// The head timeout times a head from its first byte, not the wait for one: an idle
/// connection outlives it and is closed at the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_outlives_the_head_timeout() {
    let args = ["demo", "--header-timeout", "1s", "--idle-timeout", "5s"];
    let gw = Tollgate::spawn_with_env(&args, &[("TOLLGATE_LOG", "warn")]);
    for h in many_h1(gw.addr, 20, "/v1/orders").await {
        assert!(
            h >= Duration::from_secs(4) && h <= Duration::from_secs(6),
            "an idle connection closed after {h:?}"
        );
    }
}

/// Runs `tollgate demo` with `args` and `env` for at most 10 s: whether it failed, and its
/// stderr. One that starts is killed and counts as not failing.
fn start_fails(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("demo")
        .args(args)
        .args(["--listen", "127.0.0.1:0"])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break !status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
    (failed, err)
}

#[test]
fn an_idle_timeout_of_zero_or_no_duration_is_refused_by_name() {
    for value in ["0s", "0ms", "75", "soon"] {
        let (failed, err) = start_fails(&["--idle-timeout", value], &[]);
        assert!(
            failed && err.contains("--idle-timeout") && err.contains(value),
            "--idle-timeout {value}: {err}"
        );
    }
    let (failed, err) = start_fails(&[], &[("TOLLGATE_IDLE_TIMEOUT", "0s")]);
    assert!(
        failed && err.contains("--idle-timeout") && err.contains("must be above zero"),
        "TOLLGATE_IDLE_TIMEOUT=0s: {err}"
    );
}
