//! Async locks by key, for the conversations' changes (one lock per
//! conversation): changes to the same key take turns, changes to
//! different keys never wait on each other, and the map holds an entry
//! only while some request holds or waits for its lock.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// One async mutex per key in use. An entry is made by the first
/// [`lock`](Self::lock) of its key and removed as soon as nothing holds or
/// waits for it, so the map never outgrows the requests in flight (plus, at
/// most until the next lock or release of any key, the entries of waits
/// cancelled just then).
pub struct KeyedLocks<K> {
    map: Mutex<BTreeMap<K, Arc<AsyncMutex<()>>>>,
}

/// A key's lock, held until dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct KeyGuard<'a, K: Ord> {
    // Dropped first (fields drop in order): the lock is released, then the
    // ticket removes the entry if nobody else holds or waits for it.
    _held: OwnedMutexGuard<()>,
    _ticket: Ticket<'a, K>,
}

/// Cleans the map when a lock, held or waited for, is given up (also when
/// a wait is cancelled: the request was dropped).
struct Ticket<'a, K: Ord> {
    locks: &'a KeyedLocks<K>,
}

impl<K: Ord> Drop for Ticket<'_, K> {
    fn drop(&mut self) {
        self.locks.sweep();
    }
}

impl<K: Ord> KeyedLocks<K> {
    /// An empty map (a `static` can hold one).
    pub const fn new() -> KeyedLocks<K> {
        KeyedLocks {
            map: Mutex::new(BTreeMap::new()),
        }
    }

    /// Waits for `key`'s lock: until every earlier holder of the same key
    /// has dropped its guard; another key's holders are not waited for.
    pub async fn lock(&self, key: K) -> KeyGuard<'_, K> {
        let mutex = {
            let mut map = self.map();
            Self::sweep_in(&mut map);
            map.entry(key).or_default().clone()
        };
        // From here a cancelled wait sweeps too.
        let ticket = Ticket { locks: self };
        let held = mutex.lock_owned().await;
        KeyGuard {
            _held: held,
            _ticket: ticket,
        }
    }

    /// How many keys have an entry (each held or waited for).
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether no key has an entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<K, Arc<AsyncMutex<()>>>> {
        // The map is consistent between any two statements: a panic while
        // it was locked leaves nothing half done.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sweep(&self) {
        Self::sweep_in(&mut self.map());
    }

    /// Drops the entries only the map holds. An entry is cloned only with
    /// the map locked, and every holder or waiter keeps its clone until it
    /// gives the lock up, so an entry with no other clone is neither held
    /// nor waited for, and none can take it while the map is locked.
    fn sweep_in(map: &mut BTreeMap<K, Arc<AsyncMutex<()>>>) {
        map.retain(|_, m| Arc::strong_count(m) > 1);
    }
}

impl<K: Ord> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use futures_util::FutureExt;

    use super::KeyedLocks;

    #[tokio::test]
    async fn same_key_waits_for_the_holder() {
        let locks = KeyedLocks::new();
        let first = locks.lock(1u64).await;
        let mut second = Box::pin(locks.lock(1));
        assert!(
            (&mut second).now_or_never().is_none(),
            "the same key was taken twice"
        );
        assert_eq!(locks.len(), 1);
        drop(first);
        let second = second
            .now_or_never()
            .expect("the key is taken once its holder drops it");
        assert_eq!(locks.len(), 1);
        drop(second);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn different_keys_do_not_wait() {
        let locks = KeyedLocks::new();
        let a = locks.lock(1u64).await;
        let b = locks
            .lock(2)
            .now_or_never()
            .expect("another key waited for a held one");
        assert_eq!(locks.len(), 2);
        drop(a);
        assert_eq!(locks.len(), 1);
        drop(b);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn the_map_shrinks_after_use_and_after_cancelled_waits() {
        let locks = KeyedLocks::new();
        for k in 0..100u64 {
            let g = locks.lock(k).await;
            drop(g);
        }
        assert!(locks.is_empty(), "{} entries left", locks.len());
        // A wait dropped before it got the lock (a request whose client
        // went away) leaves no entry once the holder is done.
        let held = locks.lock(7u64).await;
        let mut waiting = Box::pin(locks.lock(7));
        assert!((&mut waiting).now_or_never().is_none());
        drop(waiting);
        drop(held);
        assert!(locks.is_empty(), "{} entries left", locks.len());
        // And the key is free again.
        let again = locks.lock(7).now_or_never().expect("the key is free");
        drop(again);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn holders_of_one_key_take_turns() {
        // Tasks that yield while they hold the key: each sees nobody else
        // inside, and another key is taken meanwhile without waiting.
        let locks: &'static KeyedLocks<u64> = Box::leak(Box::new(KeyedLocks::new()));
        let inside = Arc::new(AtomicUsize::new(0));
        let gate = locks.lock(3).await;
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let inside = inside.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    let _g = locks.lock(3).await;
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
            }));
        }
        // The tasks run up to their wait for the key the test holds.
        tokio::task::yield_now().await;
        assert_eq!(inside.load(Ordering::SeqCst), 0);
        let other = locks
            .lock(4)
            .now_or_never()
            .expect("another key waited for a held one");
        assert_eq!(locks.len(), 2);
        drop(other);
        drop(gate);
        for t in tasks {
            t.await.expect("a task panicked");
        }
        assert!(locks.is_empty());
    }
}
