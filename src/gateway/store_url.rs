//! Where the buckets are: `--store`'s URL (the embedded store, one Redis node, a cluster, or a
//! primary behind Sentinel, each plain or over TLS), as a `StoreUrl` that start-up, the
//! Regions and `check-store` read the same way.

/// Which store holds the buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Memory,
    /// One node: `redis://` or, over TLS, `rediss://`.
    Redis(String),
    /// A cluster reached through these nodes, over TLS or not.
    RedisCluster {
        nodes: Vec<String>,
        tls: bool,
    },
    /// The primary these sentinels name for `service`, over TLS or not.
    RedisSentinel {
        sentinels: Vec<String>,
        service: String,
        tls: bool,
    },
}

impl StoreUrl {
    pub fn parse(text: &str) -> Result<StoreUrl, String> {
        let t = text.trim();
        if t == "memory" {
            return Ok(StoreUrl::Memory);
        }
        let cluster = [
            ("redis-cluster://", false),
            ("rediss-cluster://", true),
            ("valkey-cluster://", false),
            ("valkeys-cluster://", true),
        ];
        if let Some((rest, tls)) = cluster
            .iter()
            .find_map(|(p, tls)| t.strip_prefix(p).map(|r| (r, *tls)))
        {
            let nodes: Vec<String> = rest
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            if nodes.is_empty() {
                return Err(format!(
                    "--store {text:?}: a cluster URL needs at least one HOST:PORT"
                ));
            }
            for n in &nodes {
                if !n.contains(':') {
                    return Err(format!("--store {text:?}: {n:?} must be HOST:PORT"));
                }
            }
            return Ok(StoreUrl::RedisCluster { nodes, tls });
        }
        for (scheme, tls) in [("redis-sentinel://", false), ("rediss-sentinel://", true)] {
            if let Some(rest) = t.strip_prefix(scheme) {
                return sentinel_url(text, rest, tls);
            }
        }
        // Valkey speaks Redis's protocol: its schemes are Redis's.
        for (scheme, as_redis) in [
            ("redis://", "redis://"),
            ("rediss://", "rediss://"),
            ("valkey://", "redis://"),
            ("valkeys://", "rediss://"),
        ] {
            if let Some(rest) = t.strip_prefix(scheme) {
                return Ok(StoreUrl::Redis(format!("{as_redis}{rest}")));
            }
        }
        Err(format!(
            "--store {text:?}: expected \"memory\", \"redis://HOST:PORT\", \"redis-cluster://H1:P1,H2:P2\" or \"redis-sentinel://S1:P1,S2:P2/SERVICE\" (\"rediss://\" and the like over TLS)"
        ))
    }
}

/// `S1:P1,S2:P2/SERVICE`, after `redis-sentinel://`.
fn sentinel_url(text: &str, rest: &str, tls: bool) -> Result<StoreUrl, String> {
    let (hosts, service) = rest.split_once('/').ok_or_else(|| {
        format!("--store {text:?}: a sentinel URL ends with the service's name: redis-sentinel://S1:26379,S2:26379/mymaster")
    })?;
    let service = service.trim_end_matches('/');
    if service.is_empty() || service.contains('/') {
        return Err(format!("--store {text:?}: {service:?} is not a service name"));
    }
    let sentinels: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if sentinels.is_empty() {
        return Err(format!(
            "--store {text:?}: a sentinel URL needs at least one HOST:PORT"
        ));
    }
    if let Some(n) = sentinels.iter().find(|n| !n.contains(':')) {
        return Err(format!("--store {text:?}: {n:?} must be HOST:PORT"));
    }
    Ok(StoreUrl::RedisSentinel {
        sentinels,
        service: service.to_string(),
        tls,
    })
}

impl StoreUrl {
    /// The URL as logs and pages may show it: its password replaced.
    pub fn redacted(&self) -> String {
        match self {
            StoreUrl::Memory => "memory".into(),
            StoreUrl::Redis(url) => tollgate_store::redis::redact(url),
            StoreUrl::RedisCluster { nodes, tls } => {
                format!(
                    "{}://{}",
                    if *tls { "rediss-cluster" } else { "redis-cluster" },
                    nodes.join(",")
                )
            }
            StoreUrl::RedisSentinel {
                sentinels,
                service,
                tls,
            } => format!(
                "{}://{}/{service}",
                if *tls { "rediss-sentinel" } else { "redis-sentinel" },
                sentinels.join(",")
            ),
        }
    }
}

impl StoreUrl {
    /// Where this store is, reached with `access`; `None` for the embedded store.
    pub fn target<'a>(
        &'a self,
        access: &'a tollgate_store::redis::Access,
    ) -> Option<tollgate_store::redis::Target<'a>> {
        use tollgate_store::redis::{Place, Target};
        let place = match self {
            StoreUrl::Memory => return None,
            StoreUrl::Redis(url) => Place::Node(url),
            StoreUrl::RedisCluster { nodes, tls } => Place::Cluster { nodes, tls: *tls },
            StoreUrl::RedisSentinel {
                sentinels,
                service,
                tls,
            } => Place::Sentinel {
                sentinels,
                service,
                tls: *tls,
            },
        };
        Some(Target { place, access })
    }
}
