//! Latency histograms for `/metrics`: lock-free buckets any thread observes
//! into (the WAL writer's group commits, the HTTP routes' requests), and
//! their Prometheus text form. Sans-IO: plain atomics, tested alone.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds in seconds, 1 ms to 60 s (a group commit is a few ms; a
/// generation through an HTTP route can take a minute).
pub const BOUNDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 60.0,
];

/// Counts observations into [`BOUNDS`] (plus `+Inf`), with their sum.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_micros: AtomicU64,
}

/// A histogram read at one moment: non-cumulative counts per bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub buckets: [u64; BOUNDS.len() + 1],
    pub sum_micros: u64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BOUNDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(BOUNDS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            d.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for (out, b) in s.buckets.iter_mut().zip(&self.buckets) {
            *out = b.load(Ordering::Relaxed);
        }
        s.sum_micros = self.sum_micros.load(Ordering::Relaxed);
        s
    }
}

impl Snapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The `_bucket`, `_sum` and `_count` lines of `name` with `labels`
    /// (`key="value"` pairs, already escaped, or empty).
    pub fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            cumulative += n;
            let le = BOUNDS
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum_micros as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// `# HELP` and `# TYPE` of a histogram family.
pub fn render_header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
}

/// Histograms of the HTTP routes' requests, by route and status. Routes are
/// the handlers' own `&'static str` paths, so the label set is bounded.
#[derive(Debug, Default)]
pub struct RouteLatency {
    by_route: Mutex<BTreeMap<(&'static str, u16), Histogram>>,
}

impl RouteLatency {
    pub const fn new() -> RouteLatency {
        RouteLatency {
            by_route: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn observe(&self, route: &'static str, status: u16, d: Duration) {
        let mut map = self.by_route.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((route, status)).or_default().observe(d);
    }

    /// The whole family as Prometheus text (the header even when empty).
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        render_header(out, name, help);
        let map = self.by_route.lock().unwrap_or_else(|e| e.into_inner());
        for ((route, status), h) in map.iter() {
            let labels = format!("route=\"{route}\",status=\"{status}\"");
            h.snapshot().render_series(out, name, &labels);
        }
    }
}

/// The compatible HTTP routes' request durations, process-wide (one daemon
/// per process): `superfluid_http_request_duration_seconds`.
pub static HTTP_REQUESTS: RouteLatency = RouteLatency::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket_and_render_cumulatively() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500)); // <= 1 ms
        h.observe(Duration::from_millis(3)); // <= 5 ms
        h.observe(Duration::from_millis(5)); // <= 5 ms (inclusive)
        h.observe(Duration::from_secs(100)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.count(), 4);
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[2], 2);
        assert_eq!(s.buckets[BOUNDS.len()], 1);
        assert_eq!(s.sum_micros, 100_008_500);
        let mut out = String::new();
        s.render_series(&mut out, "x", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.001\"} 1\n"));
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.005\"} 3\n"));
        assert!(out.contains("x_bucket{a=\"b\",le=\"60\"} 3\n"));
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_count{a=\"b\"} 4\n"));
        let mut bare = String::new();
        s.render_series(&mut bare, "y", "");
        assert!(bare.contains("y_bucket{le=\"+Inf\"} 4\n"));
        assert!(bare.contains("y_sum 100.0085\n"));
    }

    #[test]
    fn routes_are_labelled_by_path_and_status() {
        let r = RouteLatency::new();
        r.observe("/v1/chat/completions", 200, Duration::from_millis(20));
        r.observe("/v1/chat/completions", 200, Duration::from_millis(40));
        r.observe("/v1/messages", 401, Duration::from_micros(100));
        let mut out = String::new();
        r.render(&mut out, "h", "help");
        assert!(out.starts_with("# HELP h help\n# TYPE h histogram\n"));
        assert!(out.contains("h_count{route=\"/v1/chat/completions\",status=\"200\"} 2\n"));
        assert!(out.contains("h_count{route=\"/v1/messages\",status=\"401\"} 1\n"));
    }
}
