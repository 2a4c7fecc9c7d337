//! The addresses behind upstream targets' names: a hosts file first (`--hosts-file`, read
//! again when it changes), then the system's resolver, each name asked again every
//! `dns_refresh_ms` of its upstream. A name that answers several addresses is that many
//! targets, so the instances behind one name (a Kubernetes headless Service's pods) are
//! followed as they come and go. Requests never wait on a lookup: they use the addresses last
//! learned, and a background task learns the next ones.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tollgate_rules::Snapshot;

/// The longest a lookup may take: a resolver that hangs must not hold back the other names.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// A hosts(5) file as last read: each name (lower case) with its addresses in file order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HostsFile {
    names: HashMap<String, Vec<IpAddr>>,
}

impl HostsFile {
    /// Reads `path`, naming the file, line and reason when it can't.
    pub fn read(path: &Path) -> Result<HostsFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        HostsFile::parse(&text).map_err(|(line, why)| format!("{}:{line}: {why}", path.display()))
    }

    /// hosts(5): an address, then one or more names; `#` starts a comment. A name on several
    /// lines has each line's address.
    pub fn parse(text: &str) -> Result<HostsFile, (usize, String)> {
        let mut names: HashMap<String, Vec<IpAddr>> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default();
            let mut words = line.split_whitespace();
            let Some(addr) = words.next() else { continue };
            let ip: IpAddr = addr
                .parse()
                .map_err(|_| (i + 1, format!("{addr:?} is not an IP address")))?;
            let mut any = false;
            for name in words {
                any = true;
                let list = names.entry(name.to_ascii_lowercase()).or_default();
                if !list.contains(&ip) {
                    list.push(ip);
                }
            }
            if !any {
                return Err((i + 1, format!("{addr} names no host")));
            }
        }
        Ok(HostsFile { names })
    }

    fn get(&self, name: &str) -> Option<&Vec<IpAddr>> {
        self.names.get(&name.to_ascii_lowercase())
    }
}

/// What a file looked like when last read: a change to any of these reads it again.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// One name as last resolved.
struct Learned {
    addrs: Vec<IpAddr>,
    /// When it is asked again.
    next: Instant,
}

/// The names of every upstream's targets and the addresses each was last found at.
pub struct Names {
    hosts: Option<(PathBuf, Mutex<(Stamp, HostsFile)>)>,
    learned: Mutex<HashMap<String, Learned>>,
}

impl Names {
    /// Names answered by the system's resolver only.
    pub fn system() -> Names {
        Names {
            hosts: None,
            learned: Mutex::new(HashMap::new()),
        }
    }

    /// Names answered from `path` first: start-up fails on a file that can't be read.
    pub fn with_hosts_file(path: &Path) -> Result<Names, String> {
        let file = HostsFile::read(path)?;
        Ok(Names {
            hosts: Some((path.to_path_buf(), Mutex::new((stamp(path), file)))),
            learned: Mutex::new(HashMap::new()),
        })
    }

    /// The addresses to reach `host` at, as last learned: an address itself, the hosts file's
    /// answer, or the resolver's; `None` for a name not resolved yet (its connections then
    /// resolve it as they are made).
    pub fn addresses(&self, host: &str) -> Option<Vec<IpAddr>> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Some(vec![ip]);
        }
        if let Some((_, hosts)) = &self.hosts {
            let hosts = hosts.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(addrs) = hosts.1.get(bare) {
                return Some(addrs.clone());
            }
        }
        let learned = self.learned.lock().unwrap_or_else(PoisonError::into_inner);
        learned
            .get(&bare.to_ascii_lowercase())
            .filter(|l| !l.addrs.is_empty())
            .map(|l| l.addrs.clone())
    }

    /// Reads the hosts file again if it changed, and asks the resolver again for every name
    /// whose time has come. Says whether any target's addresses changed.
    pub async fn refresh(&self, snap: &Snapshot) -> bool {
        let mut changed = self.reread_hosts();
        let now = Instant::now();
        let mut due: Vec<(String, u16, Duration)> = Vec::new();
        {
            let learned = self.learned.lock().unwrap_or_else(PoisonError::into_inner);
            for u in &snap.upstreams {
                for t in &u.targets {
                    let host = t.authority.host().trim_start_matches('[').trim_end_matches(']');
                    if host.parse::<IpAddr>().is_ok() || self.in_hosts_file(host) {
                        continue;
                    }
                    let name = host.to_ascii_lowercase();
                    let fresh = learned.get(&name).is_some_and(|l| l.next > now);
                    if !fresh && !due.iter().any(|(n, ..)| *n == name) {
                        due.push((name, t.authority.port_u16().unwrap_or(80), u.dns_refresh));
                    }
                }
            }
        }
        for (name, port, every) in due {
            let found =
                tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host((name.clone(), port))).await;
            let mut addrs: Vec<IpAddr> = match found {
                Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
                Ok(Err(e)) => {
                    tracing::warn!(name = %name, error = %e, "upstream target name did not resolve; keeping its last addresses");
                    vec![]
                }
                Err(_) => {
                    tracing::warn!(name = %name, "upstream target name did not resolve within 5 s; keeping its last addresses");
                    vec![]
                }
            };
            addrs.sort();
            addrs.dedup();
            let mut learned = self.learned.lock().unwrap_or_else(PoisonError::into_inner);
            let next = Instant::now() + every;
            match learned.get_mut(&name) {
                // A failed lookup keeps what worked: an outage of the resolver is not one of
                // the upstream.
                Some(l) if addrs.is_empty() => l.next = next,
                None if addrs.is_empty() => {
                    learned.insert(name, Learned { addrs, next });
                }
                Some(l) => {
                    if l.addrs != addrs {
                        tracing::info!(name = %name, addresses = ?addrs, "upstream target name resolves to new addresses");
                        l.addrs = addrs;
                        changed = true;
                    }
                    l.next = next;
                }
                None => {
                    learned.insert(name, Learned { addrs, next });
                    changed = true;
                }
            }
        }
        changed
    }

    fn in_hosts_file(&self, host: &str) -> bool {
        self.hosts.as_ref().is_some_and(|(_, h)| {
            h.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .1
                .get(host)
                .is_some()
        })
    }

    /// Reads the hosts file again when its time or size changed; a file that no longer parses
    /// keeps the last one, and says why.
    fn reread_hosts(&self) -> bool {
        let Some((path, hosts)) = &self.hosts else {
            return false;
        };
        let now = stamp(path);
        let mut hosts = hosts.lock().unwrap_or_else(PoisonError::into_inner);
        if now == hosts.0 {
            return false;
        }
        hosts.0 = now;
        match HostsFile::read(path) {
            Ok(file) if file == hosts.1 => false,
            Ok(file) => {
                tracing::info!(file = %path.display(), "hosts file read again");
                hosts.1 = file;
                true
            }
            Err(why) => {
                tracing::error!(error = %why, "hosts file not read again; keeping the last one");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hosts_file_gives_every_line_of_a_name() {
        let f = HostsFile::parse(
            "# pods\n127.0.0.2 orders.test  # first\n127.0.0.3\tOrders.Test other\n\n::1 v6.test\n",
        )
        .unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            f.get("orders.test"),
            Some(&vec![ip("127.0.0.2"), ip("127.0.0.3")])
        );
        assert_eq!(f.get("OTHER"), Some(&vec![ip("127.0.0.3")]));
        assert_eq!(f.get("v6.test"), Some(&vec![ip("::1")]));
        assert_eq!(f.get("nope"), None);
        assert_eq!(
            HostsFile::parse("127.0.0.1 a\n10.0.0.300 b\n").unwrap_err(),
            (2, "\"10.0.0.300\" is not an IP address".to_string())
        );
        assert_eq!(
            HostsFile::parse("127.0.0.1\n").unwrap_err(),
            (1, "127.0.0.1 names no host".to_string())
        );
    }

    #[test]
    fn an_address_is_its_own_answer_and_an_unknown_name_has_none_yet() {
        let n = Names::system();
        assert_eq!(n.addresses("[::1]"), Some(vec!["::1".parse().unwrap()]));
        assert_eq!(n.addresses("10.1.2.3"), Some(vec!["10.1.2.3".parse().unwrap()]));
        assert_eq!(n.addresses("orders.internal"), None);
    }
}
