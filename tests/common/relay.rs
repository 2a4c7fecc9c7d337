//! A cuttable TCP relay on loopback: a test puts it between one process and one server, then
//! cuts that path alone while every other path to the server stays up.

use std::net::SocketAddr;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Relays every connection accepted on `addr()` to the target until cut.
pub struct Relay {
    addr: SocketAddr,
    /// `true` while cut. Every relayed connection watches it, so a cut closes them all.
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl Relay {
    /// Listens on 127.0.0.1:0 and relays to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay binds");
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, target, cut.clone()));
        Relay { addr, cut, accept }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every relayed connection, and from now on every new one as soon as it is
    /// accepted: the client sees its peer close, as when a link between sites goes away,
    /// rather than a refused connection, which would say the server itself is gone.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Relays new connections again.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }

    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        // Ends the relayed connections too: a relay that outlived its test would keep a
        // process's store connection up behind the test's back.
        self.cut.send_replace(true);
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, cut: watch::Sender<bool>) {
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            // Out of descriptors, say: wait rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let mut watch = cut.subscribe();
        if *watch.borrow_and_update() {
            let _ = client.shutdown().await;
            continue;
        }
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(target).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            // `wait_for` looks at the current value first, so a cut that came between the
            // check above and this line still closes the connection.
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = watch.wait_for(|cut| *cut) => {}
            }
            // Dropping both ends closes them: the client reads EOF.
        });
    }
}
