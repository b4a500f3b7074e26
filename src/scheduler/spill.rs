//! `SpillIndex`: the daemon's index of the worker's host-memory tier.
//!
//! When the scheduler evicts a sequence's cells (for room, or to take its
//! sequence for another generation), the worker first exports the
//! sequence's state into its host-memory store (`WorkerRequest::KvSpill`);
//! this index keeps, per stored key, the token ids the state holds and its
//! size, and answers the longest prefix of a prompt that any stored state
//! holds. A generation whose prompt matches a stored prefix better than any
//! resident sequence imports it (`KvRestore`) instead of prefilling; the
//! entry leaves the store then (it is resident again).
//!
//! Bounded by `--cache-ram-mb`: least recently used first, entries spilled
//! from pinned sequences last. Sizes are estimates (the tokens times the
//! bytes per token seen so far) until the worker's `Spilled` reply gives
//! the real one. Plain data, no IO: the keys it drops are handed back for
//! the scheduler to send as `KvDrop`.

use std::collections::BTreeMap;

use crate::wire::Token;

/// A restore from host memory is worth it for this many tokens past what
/// the cells hold: the worker imports only the cells restored (a copy of
/// some kilobytes a token), where a prefill computes each token through
/// the whole model.
pub const RESTORE_MIN_TOKENS: usize = 4;

/// Sequences shorter than this are not spilled: no restore of them could
/// gain [`RESTORE_MIN_TOKENS`]. Every prefix that could come back is kept
/// (the spec: a prefix that leaves the pool is kept in host memory until
/// that room is full); a 28-token prompt was not, at 32.
pub const SPILL_MIN_TOKENS: usize = RESTORE_MIN_TOKENS;

/// A park artifact is read whole from disk and checked before a restore:
/// worth it for at least this many tokens past what the cells hold.
pub const PARK_RESTORE_MIN_TOKENS: usize = 32;

#[derive(Debug, Clone)]
struct Entry {
    tokens: Vec<Token>,
    /// Estimated until the worker's reply (`sized`).
    bytes: u64,
    sized: bool,
    pinned: bool,
    last_used: u64,
    /// A park artifact (`--park`) of this session rather than host memory:
    /// it takes no host memory, outlives the worker, and stays on disk
    /// when restored.
    disk: Option<u64>,
}

/// Where a restore comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The worker's host-memory store: the entry leaves it, unless `keep`
    /// (only a prefix of it is restored, and the rest stays worth having).
    Memory { keep: bool },
    /// The session's park artifact.
    Disk { session: u64 },
}

/// Keys and token ids of the states the worker holds in host memory.
#[derive(Debug, Clone)]
pub struct SpillIndex {
    budget_bytes: u64,
    min_tokens: usize,
    entries: BTreeMap<u64, Entry>,
    next_key: u64,
    clock: u64,
    /// The largest bytes per token the worker reported (0: none yet).
    bytes_per_token: u64,
}

impl SpillIndex {
    /// An index of at most `budget_bytes` (0: nothing is ever spilled).
    pub fn new(budget_bytes: u64) -> SpillIndex {
        SpillIndex {
            budget_bytes,
            min_tokens: SPILL_MIN_TOKENS,
            entries: BTreeMap::new(),
            next_key: 1,
            clock: 0,
            bytes_per_token: 0,
        }
    }

    /// Spill sequences of at least `min_tokens` tokens.
    pub fn with_min_tokens(mut self, min_tokens: usize) -> SpillIndex {
        self.min_tokens = min_tokens.max(1);
        self
    }

    pub fn enabled(&self) -> bool {
        self.budget_bytes > 0
    }

    /// Bytes the stored states take in host memory (estimated for those not
    /// yet sized).
    pub fn bytes(&self) -> u64 {
        self.entries
            .values()
            .filter(|e| e.disk.is_none())
            .map(|e| e.bytes)
            .sum()
    }

    /// Entries in host memory.
    pub fn len(&self) -> usize {
        self.entries.values().filter(|e| e.disk.is_none()).count()
    }

    /// Park artifacts known.
    pub fn parked(&self) -> usize {
        self.entries.values().filter(|e| e.disk.is_some()).count()
    }

    /// A session's park artifact holds `tokens` (sealed now, or found at
    /// start): it replaces the one the session had.
    pub fn add_parked(&mut self, session: u64, tokens: &[Token]) {
        self.entries.retain(|_, e| e.disk != Some(session));
        if tokens.is_empty() {
            return;
        }
        self.clock += 1;
        let key = self.next_key;
        self.next_key += 1;
        self.entries.insert(
            key,
            Entry {
                tokens: tokens.to_vec(),
                bytes: 0,
                sized: true,
                pinned: false,
                last_used: self.clock,
                disk: Some(session),
            },
        );
    }

    /// Whether a state of `tokens` would fit beside what host memory holds,
    /// dropping nothing but the states it extends (None while no state has
    /// been sized, so its size is not known).
    pub fn fits_beside(&self, tokens: &[Token]) -> Option<bool> {
        if self.bytes_per_token == 0 {
            return None;
        }
        let extended: u64 = self
            .entries
            .values()
            .filter(|e| e.disk.is_none() && lcp(&e.tokens, tokens) == e.tokens.len())
            .map(|e| e.bytes)
            .sum();
        let estimate = tokens.len() as u64 * self.bytes_per_token;
        Some(self.bytes() - extended + estimate <= self.budget_bytes)
    }

    /// Whether a state in host memory holds all of `tokens`.
    pub fn in_memory(&self, tokens: &[Token]) -> bool {
        self.entries
            .values()
            .any(|e| e.disk.is_none() && lcp(&e.tokens, tokens) == tokens.len())
    }

    /// Whether sealing `tokens` for `session` is new: its artifact does not
    /// hold exactly them already.
    pub fn park_is_new(&self, session: u64, tokens: &[Token]) -> bool {
        !self
            .entries
            .values()
            .any(|e| e.disk == Some(session) && e.tokens == tokens)
    }

    /// Whether restoring `n` tokens of `key` beats a prefill from `keep`:
    /// from host memory, at least [`RESTORE_MIN_TOKENS`] more than the
    /// cells hold; from a park artifact (read whole from disk), at least
    /// [`PARK_RESTORE_MIN_TOKENS`] more and at least half of it.
    pub fn worth_restoring(&self, key: u64, n: usize, keep: usize) -> bool {
        let Some(e) = self.entries.get(&key) else {
            return false;
        };
        let more = n.saturating_sub(keep);
        match e.disk {
            None => more >= RESTORE_MIN_TOKENS.min(self.min_tokens),
            Some(_) => more >= PARK_RESTORE_MIN_TOKENS && 2 * n >= e.tokens.len(),
        }
    }

    /// For a restore of `n` tokens from `key`: its tokens and where they
    /// come from. A host-memory entry restored whole leaves the index (and
    /// the store); one only a prefix of which is restored, and a park
    /// artifact, stay.
    pub fn restore(&mut self, key: u64, n: usize) -> Option<(Vec<Token>, Source)> {
        self.clock += 1;
        let e = self.entries.get_mut(&key)?;
        match e.disk {
            Some(session) => {
                e.last_used = self.clock;
                Some((e.tokens.clone(), Source::Disk { session }))
            }
            None if n < e.tokens.len() => {
                e.last_used = self.clock;
                Some((e.tokens.clone(), Source::Memory { keep: true }))
            }
            None => self
                .entries
                .remove(&key)
                .map(|e| (e.tokens, Source::Memory { keep: false })),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The token ids stored under `key`.
    pub fn tokens(&self, key: u64) -> Option<&[Token]> {
        self.entries.get(&key).map(|e| e.tokens.as_slice())
    }

    /// The stored state sharing the longest prefix with `prompt`, and that
    /// prefix's length (None when none shares a token). Ties: the most
    /// recently used.
    pub fn longest(&self, prompt: &[Token]) -> Option<(u64, usize)> {
        self.entries
            .iter()
            .map(|(&k, e)| (lcp(&e.tokens, prompt), e.disk.is_none(), e.last_used, k))
            .filter(|&(n, _, _, _)| n > 0)
            .max()
            .map(|(n, _, _, k)| (k, n))
    }

    /// Plans the spill of a sequence holding `tokens`: Some((key, dropped))
    /// when it is to be stored under `key`, after the worker forgets the
    /// keys in `dropped` (least recently used, to make room, and entries
    /// the new one extends). None when it is not worth it (too short, the
    /// tier is off, it would not fit the budget alone, or a state in host
    /// memory already holds all of it; a park artifact that does is read
    /// from disk and checked whole, slower than a copy in memory, so it
    /// does not count).
    pub fn insert(&mut self, tokens: &[Token], pinned: bool) -> Option<(u64, Vec<u64>)> {
        if !self.enabled() || tokens.len() < self.min_tokens {
            return None;
        }
        if self.in_memory(tokens) {
            return None;
        }
        let estimate = tokens.len() as u64 * self.bytes_per_token;
        if estimate > self.budget_bytes {
            return None;
        }
        // Entries the new one extends hold nothing it does not.
        let mut dropped: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.disk.is_none() && lcp(&e.tokens, tokens) == e.tokens.len())
            .map(|(&k, _)| k)
            .collect();
        for k in &dropped {
            self.entries.remove(k);
        }
        self.clock += 1;
        let key = self.next_key;
        self.next_key += 1;
        self.entries.insert(
            key,
            Entry {
                tokens: tokens.to_vec(),
                bytes: estimate,
                sized: false,
                pinned,
                last_used: self.clock,
                disk: None,
            },
        );
        dropped.extend(self.fit(key));
        Some((key, dropped))
    }

    /// The worker's reply to a spill: the state's real size (0: it was not
    /// stored, and the entry goes). Returns the keys dropped to fit the
    /// budget, for the worker to forget.
    pub fn sized(&mut self, key: u64, bytes: u64) -> Vec<u64> {
        if bytes == 0 {
            self.entries.remove(&key);
            return vec![];
        }
        let Some(e) = self.entries.get_mut(&key) else {
            // Dropped while the spill was in flight: the worker holds it.
            return vec![key];
        };
        e.bytes = bytes;
        e.sized = true;
        let per = bytes.div_ceil(e.tokens.len().max(1) as u64);
        self.bytes_per_token = self.bytes_per_token.max(per);
        self.fit(key)
    }

    /// Takes `key` out of the index (a restore: the state leaves the
    /// store). Returns its tokens.
    pub fn take(&mut self, key: u64) -> Option<Vec<Token>> {
        self.entries.remove(&key).map(|e| e.tokens)
    }

    /// Forgets a restore's entry that turned out unusable (a park
    /// artifact gone stale).
    pub fn forget(&mut self, key: u64) {
        self.entries.remove(&key);
    }

    /// Forgets every host-memory entry (the worker's store is gone or
    /// untrusted); returns their keys. Park artifacts stay.
    pub fn clear(&mut self) -> Vec<u64> {
        let keys: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.disk.is_none())
            .map(|(&k, _)| k)
            .collect();
        for k in &keys {
            self.entries.remove(k);
        }
        keys
    }

    /// Drops entries other than `keep`, pinned last and least recently
    /// used first, until the total fits the budget.
    fn fit(&mut self, keep: u64) -> Vec<u64> {
        let mut dropped = Vec::new();
        while self.bytes() > self.budget_bytes {
            let victim = self
                .entries
                .iter()
                .filter(|(&k, e)| k != keep && e.disk.is_none())
                .min_by_key(|(_, e)| (e.pinned, e.last_used))
                .map(|(&k, _)| k);
            match victim {
                Some(k) => {
                    self.entries.remove(&k);
                    dropped.push(k);
                }
                None => {
                    // `keep` alone is over the budget.
                    self.entries.remove(&keep);
                    dropped.push(keep);
                    break;
                }
            }
        }
        dropped
    }
}

fn lcp(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(range: std::ops::Range<u32>) -> Vec<Token> {
        range.collect()
    }

    #[test]
    fn longest_prefix_wins_and_extends_are_partial() {
        let mut ix = SpillIndex::new(1 << 30).with_min_tokens(1);
        let (a, _) = ix.insert(&toks(0..10), false).unwrap();
        let mut other = toks(0..4);
        other.extend(50..60);
        let (b, _) = ix.insert(&other, false).unwrap();
        // A prompt extending a's tokens matches all of a.
        assert_eq!(ix.longest(&toks(0..20)), Some((a, 10)));
        // One diverging after 4 tokens of a but following b matches b.
        let mut p = toks(0..4);
        p.extend(50..55);
        assert_eq!(ix.longest(&p), Some((b, 9)));
        assert_eq!(ix.longest(&[99, 1]), None);
        assert_eq!(ix.take(a), Some(toks(0..10)));
        assert_eq!(ix.longest(&toks(0..20)), Some((b, 4)));
    }

    #[test]
    fn short_sequences_and_an_off_tier_are_not_spilled() {
        let mut ix = SpillIndex::new(1 << 30);
        assert!(ix
            .insert(&toks(0..(SPILL_MIN_TOKENS as u32 - 1)), false)
            .is_none());
        assert!(ix
            .insert(&toks(0..SPILL_MIN_TOKENS as u32), false)
            .is_some());
        let mut off = SpillIndex::new(0).with_min_tokens(1);
        assert!(off.insert(&toks(0..100), false).is_none());
    }

    #[test]
    fn a_covered_prefix_is_not_stored_twice_and_an_extension_replaces_it() {
        let mut ix = SpillIndex::new(1 << 30).with_min_tokens(1);
        let (a, _) = ix.insert(&toks(0..10), false).unwrap();
        assert!(ix.insert(&toks(0..6), false).is_none());
        let (b, dropped) = ix.insert(&toks(0..12), false).unwrap();
        assert_eq!(dropped, vec![a]);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.tokens(b), Some(&toks(0..12)[..]));
    }

    #[test]
    fn budget_drops_least_recently_used_then_pinned() {
        // 100 bytes a token, learned from the first reply; room for 25 tokens.
        let mut ix = SpillIndex::new(2500).with_min_tokens(1);
        let (a, _) = ix.insert(&toks(0..10), true).unwrap();
        assert!(ix.sized(a, 1000).is_empty());
        let (b, d) = ix.insert(&toks(100..110), false).unwrap();
        assert!(d.is_empty());
        assert!(ix.sized(b, 1000).is_empty());
        // A third of 10 tokens: over budget; the unpinned b goes, not the
        // older pinned a.
        let (c, d) = ix.insert(&toks(200..210), false).unwrap();
        assert_eq!(d, vec![b]);
        assert_eq!(ix.bytes(), 2000);
        // A fourth: now the pinned one is all that is left to drop.
        let (_, d) = ix.insert(&toks(300..310), false).unwrap();
        assert_eq!(d, vec![c]);
        let (_, d) = ix.insert(&toks(400..410), false).unwrap();
        assert_eq!(d.len(), 1);
        assert!(ix.bytes() <= 2500);
        // One state bigger than the whole budget is never planned.
        assert!(ix.insert(&toks(500..530), false).is_none());
    }

    #[test]
    fn a_failed_spill_leaves_no_entry_and_a_real_size_can_drop_others() {
        let mut ix = SpillIndex::new(1500).with_min_tokens(1);
        let (a, _) = ix.insert(&toks(0..10), false).unwrap();
        assert!(ix.sized(a, 0).is_empty());
        assert!(ix.is_empty());
        let (a, _) = ix.insert(&toks(0..10), false).unwrap();
        let (b, _) = ix.insert(&toks(20..30), false).unwrap();
        // Both were estimated at 0 bytes; the real sizes overflow.
        assert!(ix.sized(a, 1000).is_empty());
        assert_eq!(ix.sized(b, 1000), vec![a]);
        assert_eq!(ix.clear(), vec![b]);
        assert_eq!(ix.bytes(), 0);
    }

    #[test]
    fn a_restore_must_gain_enough_and_an_artifact_must_be_half_used() {
        let mut ix = SpillIndex::new(1 << 30).with_min_tokens(8);
        let (mem, _) = ix.insert(&toks(0..100), false).unwrap();
        // From host memory, a few tokens more than the cells hold are
        // worth it (only those cells are imported).
        assert!(ix.worth_restoring(mem, 12 + RESTORE_MIN_TOKENS, 12));
        assert!(!ix.worth_restoring(mem, 11 + RESTORE_MIN_TOKENS, 12));
        // A prefix of an entry leaves it in host memory; all of it takes it.
        assert_eq!(
            ix.restore(mem, 10).unwrap().1,
            Source::Memory { keep: true }
        );
        assert_eq!(ix.len(), 1);
        assert_eq!(
            ix.restore(mem, 100).unwrap().1,
            Source::Memory { keep: false }
        );
        assert_eq!(ix.len(), 0);
        let (mem, _) = ix.insert(&toks(0..100), false).unwrap();
        ix.add_parked(5, &toks(1000..1100));
        let disk = ix.longest(&toks(1000..1010)).unwrap().0;
        // A rewritten history sharing a tenth of the artifact: prefilled.
        assert!(!ix.worth_restoring(disk, 10, 0));
        assert!(ix.worth_restoring(disk, 50, 0));
        // Parked entries survive a cleared host tier and take no memory.
        assert_eq!(ix.clear(), vec![mem]);
        assert_eq!((ix.len(), ix.parked(), ix.bytes()), (0, 1, 0));
        // A new seal of the session replaces its entry.
        ix.add_parked(5, &toks(1000..1200));
        assert_eq!(ix.parked(), 1);
        assert_eq!(ix.longest(&toks(1000..1300)).map(|x| x.1), Some(200));
    }
}
