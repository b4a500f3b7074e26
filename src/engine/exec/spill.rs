//! `SpillStore`: the worker's host-memory tier. Sequences the scheduler
//! evicts from the KV cells are exported here (llama.cpp's per-sequence
//! state, as the bytes `state_seq_get_data_ext` writes) under a key the
//! daemon chose, and imported back, whole or the prefix a prompt shares
//! (`engine::seq_state::prefix`), when a prompt reuses it. The daemon's
//! `scheduler::spill::SpillIndex` mirrors the keys, token ids and sizes and
//! decides everything; this store only holds the bytes, within its own cap
//! (checked against the state's size before the state is copied).

use std::collections::HashMap;

/// Stored states (llama.cpp's bytes, and the positions they hold) by key,
/// and their total size.
#[derive(Debug, Default)]
pub struct SpillStore {
    entries: HashMap<u64, (Vec<u8>, u32)>,
    bytes: u64,
    cap_bytes: u64,
}

impl SpillStore {
    /// A store that holds at most `cap_bytes` (0: stores nothing).
    pub fn new(cap_bytes: u64) -> SpillStore {
        SpillStore {
            entries: HashMap::new(),
            bytes: 0,
            cap_bytes,
        }
    }

    /// Whether `size` more bytes fit beside what is stored (with the entry
    /// under `key` replaced).
    pub fn fits(&self, key: u64, size: u64) -> bool {
        let replaced = self.entries.get(&key).map_or(0, |(s, _)| s.len() as u64);
        self.bytes - replaced + size <= self.cap_bytes
    }

    /// Stores `state` (of `len` positions) under `key`; returns its size.
    pub fn put(&mut self, key: u64, state: Vec<u8>, len: u32) -> u64 {
        let size = state.len() as u64;
        self.drop_key(key);
        self.bytes += size;
        self.entries.insert(key, (state, len));
        size
    }

    /// Takes the entry under `key` out of the store.
    pub fn take(&mut self, key: u64) -> Option<(Vec<u8>, u32)> {
        let (state, len) = self.entries.remove(&key)?;
        self.bytes -= state.len() as u64;
        Some((state, len))
    }

    pub fn drop_key(&mut self, key: u64) {
        let _ = self.take(key);
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
