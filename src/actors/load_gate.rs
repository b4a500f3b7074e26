//! Which models are loaded: the daemon-wide gate every lane asks before it
//! starts a worker (`serve --model`).
//!
//! The first model is loaded when the daemon starts and stays loaded (it is
//! what `serve` was started for, and the session API's default). A model
//! added with `--model` loads on its first request and unloads after
//! `--keep-alive` without a step (Ollama's `keep_alive`, which a request can
//! change for its model). Before a lane loads, the gate checks that the
//! model fits: at most `--max-loaded-models` loaded at once, and its memory
//! (the file plus its KV cache) within what is free: `--memory-limit-mb`
//! less what the loaded models need, or the machine's available memory.
//! Idle models, least recently used first, are unloaded to make room; a
//! model that still does not fit is refused with a message saying why, so
//! no load ends in an OOM kill.
//!
//! [`GateState`] is the decision, a plain struct tested without actors; the
//! [`LoadGate`] the lanes share is it behind a mutex.

use std::sync::{Arc, Mutex};

use actix::Addr;

use super::lane::{LaneActor, Load, Unload};

/// A lane counts as idle, and may be unloaded for another model, when it
/// has had no step for this long and has none in flight.
pub const IDLE_MS: u64 = 1_000;

/// One model's line in the gate.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The model's id (what requests name it by).
    pub id: String,
    /// The memory it needs loaded, in bytes (an estimate: its file and its
    /// KV cache).
    pub need: u64,
    /// Its worker runs (or is starting).
    pub loaded: bool,
    /// Never unloaded: the first model.
    pub pinned: bool,
    /// A step is in flight or waiting for the worker.
    pub active: bool,
    /// When it last had a step (unix ms).
    pub last_used_ms: u64,
    /// How long it stays loaded with no step; `None`: for ever.
    pub keep_alive_ms: Option<u64>,
}

impl Entry {
    /// When an idle model unloads (unix ms), if it does.
    pub fn expires_ms(&self) -> Option<u64> {
        self.keep_alive_ms
            .filter(|_| !self.pinned)
            .map(|k| self.last_used_ms.saturating_add(k))
    }

    fn idle(&self, now_ms: u64) -> bool {
        !self.active && now_ms.saturating_sub(self.last_used_ms) >= IDLE_MS
    }
}

/// The gate's decision state.
#[derive(Debug, Clone)]
pub struct GateState {
    pub entries: Vec<Entry>,
    /// `--max-loaded-models`.
    pub max_loaded: usize,
    /// `--memory-limit-mb`, in bytes: what all loaded models may need
    /// together. `None`: the machine's available memory decides.
    pub limit: Option<u64>,
}

const MIB: u64 = 1 << 20;

impl GateState {
    /// Whether `slot` may load now, given `available` bytes of free memory
    /// on the machine: the lanes to unload first (least recently used
    /// first), or why it cannot load. On success the victims are marked
    /// unloaded and `slot` loaded, so a second load planned at once counts
    /// them.
    pub fn plan_load(
        &mut self,
        slot: usize,
        available: u64,
        now_ms: u64,
    ) -> Result<Vec<usize>, String> {
        let need = self.entries[slot].need;
        let id = self.entries[slot].id.clone();
        let loaded: Vec<usize> = (0..self.entries.len())
            .filter(|&i| i != slot && self.entries[i].loaded)
            .collect();
        let mut count = loaded.len();
        // What is free now: under the limit, the limit less what the loaded
        // models need; else what the machine has available (which already
        // excludes them).
        let mut free = match self.limit {
            Some(limit) => {
                limit.saturating_sub(loaded.iter().map(|&i| self.entries[i].need).sum::<u64>())
            }
            None => available,
        };
        let mut candidates: Vec<usize> = loaded
            .iter()
            .copied()
            .filter(|&i| !self.entries[i].pinned && self.entries[i].idle(now_ms))
            .collect();
        candidates.sort_by_key(|&i| self.entries[i].last_used_ms);
        let mut victims = Vec::new();
        let mut candidates = candidates.into_iter();
        while count >= self.max_loaded || need > free {
            let Some(v) = candidates.next() else {
                return Err(if count >= self.max_loaded {
                    format!(
                        "cannot load the model {id:?}: {count} models are loaded \
                         (--max-loaded-models {}) and none is idle to unload; try again \
                         when one is, or raise --max-loaded-models",
                        self.max_loaded
                    )
                } else {
                    let whence = match self.limit {
                        Some(limit) => format!("under --memory-limit-mb {}", limit / MIB),
                        None => "of the machine's available memory".into(),
                    };
                    format!(
                        "cannot load the model {id:?}: it needs about {} MiB (its file and \
                         its KV cache) and {} MiB are free {whence}, counting the idle \
                         models it could unload; lower --ctx-size or --parallel, or serve \
                         fewer models",
                        need.div_ceil(MIB),
                        free / MIB
                    )
                });
            };
            free = free.saturating_add(self.entries[v].need);
            count -= 1;
            victims.push(v);
        }
        for &v in &victims {
            self.entries[v].loaded = false;
        }
        let e = &mut self.entries[slot];
        e.loaded = true;
        e.last_used_ms = now_ms;
        Ok(victims)
    }
}

/// The gate the lanes share: the state, and each lane's address (for
/// [`Unload`]), in the order of the entries.
#[derive(Clone)]
pub struct LoadGate {
    state: Arc<Mutex<GateState>>,
    lanes: Arc<Mutex<Vec<Option<Addr<LaneActor>>>>>,
}

impl std::fmt::Debug for LoadGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LoadGate").field(&self.entries()).finish()
    }
}

impl LoadGate {
    pub fn new(state: GateState) -> LoadGate {
        let n = state.entries.len();
        LoadGate {
            state: Arc::new(Mutex::new(state)),
            lanes: Arc::new(Mutex::new(vec![None; n])),
        }
    }

    /// Runs `f` on the state.
    pub fn with<R>(&self, f: impl FnOnce(&mut GateState) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Tells the gate where lane `slot` is (when it starts).
    pub fn register(&self, slot: usize, lane: Addr<LaneActor>) {
        if let Some(l) = self
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(slot)
        {
            *l = Some(lane);
        }
    }

    fn lane(&self, slot: usize) -> Option<Addr<LaneActor>> {
        self.lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(slot)
            .cloned()
            .flatten()
    }

    /// Asks lane `slot` to unload its idle model.
    pub fn unload(&self, slot: usize) {
        if let Some(lane) = self.lane(slot) {
            lane.do_send(Unload);
        }
    }

    /// Asks lane `slot` to load its model (Ollama's empty request); Err
    /// when it cannot.
    pub async fn load(&self, slot: usize) -> Result<(), String> {
        match self.lane(slot) {
            Some(lane) => lane
                .send(Load)
                .await
                .map_err(|e| format!("the model lane is gone: {e}"))?,
            None => Ok(()),
        }
    }

    /// Sets how long model `slot` stays loaded with no request (a request's
    /// `keep_alive`); the first model stays loaded whatever it says.
    pub fn set_keep_alive(&self, slot: usize, keep_alive_ms: Option<u64>) {
        self.update(slot, |e| {
            if !e.pinned {
                e.keep_alive_ms = keep_alive_ms;
            }
        });
    }

    /// Every model's line, as it is now.
    pub fn entries(&self) -> Vec<Entry> {
        self.with(|g| g.entries.clone())
    }

    /// One model's line, as it is now.
    pub fn entry(&self, slot: usize) -> Entry {
        self.with(|g| g.entries[slot].clone())
    }

    /// Updates one model's line.
    pub fn update(&self, slot: usize, f: impl FnOnce(&mut Entry)) {
        self.with(|g| f(&mut g.entries[slot]))
    }
}

/// A keep-alive as Ollama writes it: a duration (`"5m"`, `"30s"`, `"1h"`,
/// `"500ms"`, `"1h30m"`), a number of seconds, or a negative number for
/// "for ever"; in ms, None for ever.
pub fn parse_keep_alive(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    let bad = || {
        format!(
            "keep-alive {text:?}: expected a duration like 5m, 30s, 1h or 500ms, a number of \
             seconds, or -1 for ever"
        )
    };
    if let Ok(secs) = t.parse::<f64>() {
        if !secs.is_finite() {
            return Err(bad());
        }
        return Ok((secs >= 0.0).then(|| (secs.min(1e12) * 1e3) as u64));
    }
    if t.starts_with('-') {
        return Ok(None);
    }
    let mut ms = 0f64;
    let mut rest = t;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let n: f64 = rest[..n_end].parse().map_err(|_| bad())?;
        rest = &rest[n_end..];
        let u_end = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..u_end] {
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return Err(bad()),
        };
        ms += n * unit;
        rest = &rest[u_end..];
    }
    Ok(Some(ms.min(1e15) as u64))
}

/// The machine's available memory (`MemAvailable` in /proc/meminfo), in
/// bytes; `u64::MAX` where it cannot be read.
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kib| kib.saturating_mul(1024))
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, need_mib: u64, loaded: bool, last_used_ms: u64) -> Entry {
        Entry {
            id: id.into(),
            need: need_mib * MIB,
            loaded,
            pinned: false,
            active: false,
            last_used_ms,
            keep_alive_ms: Some(300_000),
        }
    }

    fn gate(entries: Vec<Entry>, max_loaded: usize, limit_mib: Option<u64>) -> GateState {
        GateState {
            entries,
            max_loaded,
            limit: limit_mib.map(|m| m * MIB),
        }
    }

    #[test]
    fn a_model_that_fits_loads_and_unloads_nothing() {
        let mut g = gate(
            vec![entry("a", 100, true, 0), entry("b", 100, false, 0)],
            3,
            None,
        );
        assert_eq!(g.plan_load(1, 1_000 * MIB, 10_000), Ok(vec![]));
        assert!(g.entries[1].loaded && g.entries[0].loaded);
    }

    #[test]
    fn past_max_loaded_the_least_recently_used_idle_model_unloads() {
        let mut first = entry("a", 100, true, 0);
        first.pinned = true;
        let mut g = gate(
            vec![
                first,
                entry("b", 100, true, 5_000),
                entry("c", 100, true, 2_000),
                entry("d", 100, false, 0),
            ],
            3,
            None,
        );
        // c was used least recently; a is pinned though older.
        assert_eq!(g.plan_load(3, 1_000 * MIB, 10_000), Ok(vec![2]));
        assert!(!g.entries[2].loaded && g.entries[3].loaded);
    }

    #[test]
    fn a_busy_or_just_used_model_is_not_unloaded() {
        let mut first = entry("a", 100, true, 0);
        first.pinned = true;
        let mut busy = entry("b", 100, true, 0);
        busy.active = true;
        let just_used = entry("c", 100, true, 9_500);
        let mut g = gate(
            vec![first, busy, just_used, entry("d", 100, false, 0)],
            3,
            None,
        );
        let e = g.plan_load(3, 1_000 * MIB, 10_000).unwrap_err();
        assert!(e.contains("--max-loaded-models 3"), "{e}");
        assert!(!g.entries[3].loaded && g.entries[1].loaded && g.entries[2].loaded);
    }

    #[test]
    fn a_model_too_large_is_refused_naming_its_need_and_what_is_free() {
        let mut first = entry("a", 300, true, 0);
        first.pinned = true;
        let mut g = gate(vec![first, entry("big", 800, false, 0)], 3, Some(1_000));
        let e = g.plan_load(1, u64::MAX, 10_000).unwrap_err();
        assert!(e.contains("about 800 MiB"), "{e}");
        assert!(
            e.contains("700 MiB are free under --memory-limit-mb 1000"),
            "{e}"
        );
        // Without a limit the machine's available memory decides.
        let mut g = gate(g.entries.clone(), 3, None);
        assert!(g.plan_load(1, 500 * MIB, 10_000).is_err());
        assert_eq!(g.plan_load(1, 900 * MIB, 10_000), Ok(vec![]));
    }

    #[test]
    fn idle_models_unload_to_make_room_in_memory() {
        let mut first = entry("a", 300, true, 0);
        first.pinned = true;
        let mut g = gate(
            vec![
                first,
                entry("b", 400, true, 1_000),
                entry("c", 200, true, 3_000),
                entry("d", 500, false, 0),
            ],
            4,
            Some(1_000),
        );
        // Free: 1000 - 900 = 100; b (the older) frees 400 → 500: enough.
        assert_eq!(g.plan_load(3, u64::MAX, 10_000), Ok(vec![1]));
    }

    #[test]
    fn keep_alives_parse_as_ollama_writes_them() {
        assert_eq!(parse_keep_alive("5m"), Ok(Some(300_000)));
        assert_eq!(parse_keep_alive("30s"), Ok(Some(30_000)));
        assert_eq!(parse_keep_alive("1h30m"), Ok(Some(5_400_000)));
        assert_eq!(parse_keep_alive("500ms"), Ok(Some(500)));
        assert_eq!(parse_keep_alive("0"), Ok(Some(0)));
        assert_eq!(parse_keep_alive("2.5"), Ok(Some(2_500)));
        assert_eq!(parse_keep_alive("-1"), Ok(None));
        assert_eq!(parse_keep_alive("-5m"), Ok(None));
        for bad in ["", "m", "5x", "five", "NaN", "5m3"] {
            assert!(parse_keep_alive(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_pinned_model_never_expires() {
        let mut e = entry("a", 1, true, 1_000);
        assert_eq!(e.expires_ms(), Some(301_000));
        e.pinned = true;
        assert_eq!(e.expires_ms(), None);
    }
}
