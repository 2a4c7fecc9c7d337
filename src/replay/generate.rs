//! Two traces, generated exactly: a retry storm (k-7, 48,615 rows) and a hot key (k-big,
//! 6,000,000 rows). Times are seconds since midnight with 6 decimals, so
//! fixed windows aligned on multiples of P from time 0 fall on clock minutes.
//!
//! The storm: a partner's sync client that retries at once on every answer, refusals too:
//! - normal traffic at 5/s: 08:59:00.000, .200, … 08:59:59.800 (300 rows);
//! - the page load: 15 rows at 08:59:30.100, after the 08:59:30.000 normal row, so a central
//!   10/s burst-20 bucket is exactly full again at the 08:59:33.000 arrival;
//! - the storm: 40 closed-loop workers, each answer taking 100 ms, so worker `w` sends at
//!   09:00:00 + w × 2.5 ms + k × 100 ms: one arrival every 2.5 ms from 09:00:00.000 to
//!   09:01:59.9975 (48,000 rows);
//! - normal traffic again, 09:02:00.000 … 09:02:59.800 (300 rows).
//!
//! With a second app (`--second-app 20/1s`), the storm gains a second partner behind the same
//! NAT address: k-8 sending evenly at that rate from 08:59:00.000 until 09:05:00 (7,200 rows at
//! 20 a second), merged by time after the storm's rows of the same instant, and every row an
//! `ip` column with that one address, 198.51.100.7: what a rule per source address sees.
//!
//! The hot key: k-big sends 100,000 a second from 09:10:00.000 for 60 s, one arrival every
//! 10 µs, spread evenly (round-robin) over the gateways; nothing before, so its bucket is full
//! and no gateway holds any of its tokens.
//!
//! All write a `gateway` column assigned round-robin over all rows, starting at 0.

use std::io::{self, Write};

use tollgate_limit::bucket::{Rate, US_PER_S};

/// One generated row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenRow {
    pub time_us: u64,
    pub key: &'static str,
    pub gateway: u64,
}

const fn hms(h: u64, m: u64, s: u64) -> u64 {
    (h * 3_600 + m * 60 + s) * US_PER_S
}

/// 09:00:00.000, when the storm starts.
pub const STORM_START_US: u64 = hms(9, 0, 0);
/// 09:02:00.000, when the storm has ended.
pub const STORM_END_US: u64 = hms(9, 2, 0);
/// 09:10:00.000: the hot key's minute starts.
pub const HOT_START_US: u64 = hms(9, 10, 0);
/// Rows in the hot trace.
pub(crate) const HOT_ROWS: u64 = 6_000_000;
/// The second app's key.
pub const SECOND_APP_KEY: &str = "k-8";
/// 08:59:00.000, when the second app starts, with the storm's trace.
pub const SECOND_APP_START_US: u64 = hms(8, 59, 0);
/// 09:05:00.000: the second app has sent its last request before this.
pub const SECOND_APP_END_US: u64 = hms(9, 5, 0);
/// The partner's NAT address, in front of both apps (a documentation address, RFC 5737).
pub const PARTNER_IP: &str = "198.51.100.7";

/// The storm trace, in time order (48,615 rows).
pub fn storm(gateways: u64) -> Vec<GenRow> {
    let mut times = Vec::with_capacity(48_615);
    let normal = |start: u64, times: &mut Vec<u64>| {
        for i in 0..300 {
            times.push(start + i * 200_000);
        }
    };
    normal(hms(8, 59, 0), &mut times);
    // The page load follows the normal row of 08:59:30.000.
    let page = hms(8, 59, 30) + 100_000;
    let at = times.partition_point(|&t| t <= page);
    times.splice(at..at, std::iter::repeat_n(page, 15));
    // 40 workers × 1,200 answers of 100 ms each: arrivals every 2.5 ms.
    for w in 0..40u64 {
        for k in 0..1_200u64 {
            times.push(STORM_START_US + w * 2_500 + k * 100_000);
        }
    }
    normal(STORM_END_US, &mut times);
    // Stable: rows sharing a time keep the order they were built in.
    times.sort();
    times
        .into_iter()
        .enumerate()
        .map(|(i, time_us)| GenRow {
            time_us,
            key: "k-7",
            gateway: i as u64 % gateways.max(1),
        })
        .collect()
}

/// The storm with the second app at `rate` merged in by time (the storm's row first at the same
/// instant), gateways assigned round-robin over all rows again; lazily.
pub fn with_second_app(storm: Vec<GenRow>, rate: Rate, gateways: u64) -> impl Iterator<Item = GenRow> {
    let g = gateways.max(1);
    // Row i at start + ⌊i·P/N⌋: evenly spaced, exactly, whatever the rate.
    let (n, p) = (rate.tokens.max(1) as u128, rate.period_us as u128);
    let second = (0u128..)
        .map(move |i| SECOND_APP_START_US + (i * p / n).min(u64::MAX as u128) as u64)
        .take_while(|&t| t < SECOND_APP_END_US)
        .map(|time_us| GenRow {
            time_us,
            key: SECOND_APP_KEY,
            gateway: 0,
        });
    let mut second = second.peekable();
    let mut storm = storm.into_iter().peekable();
    std::iter::from_fn(move || match (storm.peek(), second.peek()) {
        (Some(a), Some(b)) if b.time_us < a.time_us => second.next(),
        (Some(_), _) => storm.next(),
        (None, _) => second.next(),
    })
    .enumerate()
    .map(move |(i, r)| GenRow {
        gateway: i as u64 % g,
        ..r
    })
}

/// The hot key's trace: k-big at 100,000 a second for one minute (6,000,000 rows), lazily.
pub fn hot(gateways: u64) -> impl Iterator<Item = GenRow> {
    let g = gateways.max(1);
    (0..HOT_ROWS).map(move |i| GenRow {
        time_us: HOT_START_US + i * 10,
        key: "k-big",
        gateway: i % g,
    })
}

/// Writes rows as a trace CSV: `time,key,gateway,method,path`, every request a `GET` of the
/// orders route (so a replay under a rules file finds its route), and `ip` with every row
/// from `ip`.
pub(crate) fn write_csv(
    rows: impl Iterator<Item = GenRow>,
    ip: Option<&str>,
    out: &mut impl Write,
) -> io::Result<()> {
    out.write_all(if ip.is_some() {
        b"time,key,gateway,method,path,ip\n"
    } else {
        b"time,key,gateway,method,path\n"
    })?;
    let mut n = itoa::Buffer::new();
    let mut frac = [b'0'; 6];
    for r in rows {
        out.write_all(n.format(r.time_us / US_PER_S).as_bytes())?;
        let mut f = r.time_us % US_PER_S;
        for d in frac.iter_mut().rev() {
            *d = b'0' + (f % 10) as u8;
            f /= 10;
        }
        out.write_all(b".")?;
        out.write_all(&frac)?;
        out.write_all(b",")?;
        out.write_all(r.key.as_bytes())?;
        out.write_all(b",")?;
        out.write_all(n.format(r.gateway).as_bytes())?;
        out.write_all(b",GET,/v1/orders")?;
        if let Some(ip) = ip {
            out.write_all(b",")?;
            out.write_all(ip.as_bytes())?;
        }
        out.write_all(b"\n")?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storm_has_its_documented_shape() {
        let rows = storm(20);
        assert_eq!(rows.len(), 48_615);
        assert!(rows.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        let in_storm: Vec<_> = rows
            .iter()
            .filter(|r| (STORM_START_US..STORM_END_US).contains(&r.time_us))
            .collect();
        assert_eq!(in_storm.len(), 48_000);
        assert!(in_storm.windows(2).all(|w| w[1].time_us - w[0].time_us == 2_500));
        assert_eq!(in_storm.last().unwrap().time_us, STORM_START_US + 119_997_500);
        // The page load sits right after the 08:59:30.000 row.
        let page = hms(8, 59, 30) + 100_000;
        let i = rows.iter().position(|r| r.time_us == page).unwrap();
        assert_eq!(rows[i - 1].time_us, hms(8, 59, 30));
        assert_eq!(rows[i + 15].time_us, hms(8, 59, 30) + 200_000);
        assert_eq!(rows[20].gateway, 0);
        assert_eq!(rows[21].gateway, 1);
        let mut csv = Vec::new();
        write_csv(rows[..2].iter().copied(), None, &mut csv).unwrap();
        assert_eq!(
            String::from_utf8(csv).unwrap(),
            "time,key,gateway,method,path\n32340.000000,k-7,0,GET,/v1/orders\n32340.200000,k-7,1,GET,/v1/orders\n"
        );
    }

    #[test]
    fn the_second_app_sends_evenly_behind_the_partners_address() {
        let storm = storm(20);
        let rows: Vec<GenRow> = with_second_app(storm.clone(), Rate::parse("20/1s").unwrap(), 20).collect();
        assert_eq!(rows.len(), 48_615 + 7_200);
        assert!(rows.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        let k8: Vec<u64> = rows
            .iter()
            .filter(|r| r.key == SECOND_APP_KEY)
            .map(|r| r.time_us)
            .collect();
        assert_eq!(
            (k8[0], *k8.last().unwrap()),
            (SECOND_APP_START_US, SECOND_APP_END_US - 50_000)
        );
        assert!(k8.windows(2).all(|w| w[1] - w[0] == 50_000));
        // The storm's rows keep their order, and come first at a shared instant.
        let k7: Vec<u64> = rows
            .iter()
            .filter(|r| r.key == "k-7")
            .map(|r| r.time_us)
            .collect();
        assert_eq!(k7, storm.iter().map(|r| r.time_us).collect::<Vec<_>>());
        assert_eq!((rows[0].key, rows[1].key), ("k-7", SECOND_APP_KEY));
        assert!(rows.iter().enumerate().all(|(i, r)| r.gateway == i as u64 % 20));
        let mut csv = Vec::new();
        write_csv(rows[..2].iter().copied(), Some(PARTNER_IP), &mut csv).unwrap();
        assert_eq!(
            String::from_utf8(csv).unwrap(),
            "time,key,gateway,method,path,ip\n32340.000000,k-7,0,GET,/v1/orders,198.51.100.7\n32340.000000,k-8,1,GET,/v1/orders,198.51.100.7\n"
        );
    }
}
