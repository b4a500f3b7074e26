//! `Bus`: where committed events are published to live subscriptions. Plain
//! data behind a mutex, no actor: `Shared::commit` publishes while it holds
//! the book's write lock, so a subscriber that registers (under the read
//! lock) and then reads the book misses nothing; it may see an event twice,
//! once from the book and once live, and drops the copy by its id.
//!
//! **The publisher never blocks.** Each subscriber has a bounded queue of
//! `capacity` items; publishing uses `try_send`, and a subscriber whose queue
//! is full is ended as `lagged` (its sender is dropped, so it sees the end
//! after the items already queued). Others are unaffected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::mpsc;

use crate::wire::{Channel, Event, SessionId};

/// Items a subscriber may have queued before it is ended as lagged
/// (`--sub-buffer` overrides it).
pub const SUB_BUFFER_EVENTS: usize = 256;

/// Why a subscription ended, as `SubEnded { reason }` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    Unsubscribed,
    Lagged,
    PublisherClosed,
    Purged,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Unsubscribed => "unsubscribed",
            EndReason::Lagged => "lagged",
            EndReason::PublisherClosed => "publisher closed",
            EndReason::Purged => "purged",
        }
    }
}

/// What a subscriber receives.
#[derive(Debug, Clone, PartialEq)]
pub enum BusItem {
    Event(Event),
    /// Text drawn ahead of its commit (only to subscribers that asked).
    Provisional {
        channel: Channel,
        text: String,
    },
    /// The last item: the bus let go of this subscriber.
    Ended(EndReason),
}

struct Slot {
    sub: u64,
    provisional: bool,
    tx: mpsc::Sender<BusItem>,
    /// Set before `tx` is dropped, so the receiver knows why it closed.
    reason: Arc<OnceLock<EndReason>>,
}

#[derive(Default)]
struct State {
    slots: HashMap<SessionId, Vec<Slot>>,
    closed: bool,
}

/// The event bus; cheap to clone (all clones are the same bus).
#[derive(Clone)]
pub struct Bus {
    state: Arc<Mutex<State>>,
    capacity: usize,
}

/// Subscription ids, unique across every bus of the process (a connection
/// may hold subscriptions on more than one model's bus).
static NEXT_SUB: AtomicU64 = AtomicU64::new(1);

impl Default for Bus {
    fn default() -> Self {
        Bus::new(SUB_BUFFER_EVENTS)
    }
}

/// One registration on the bus. Dropping it unregisters.
pub struct Subscriber {
    pub sub: u64,
    pub session: SessionId,
    rx: mpsc::Receiver<BusItem>,
    reason: Arc<OnceLock<EndReason>>,
    state: Arc<Mutex<State>>,
    done: bool,
}

impl Subscriber {
    /// The next item; `Ended` once, then `None`.
    pub async fn recv(&mut self) -> Option<BusItem> {
        if self.done {
            return None;
        }
        match self.rx.recv().await {
            Some(item) => Some(item),
            None => {
                self.done = true;
                let reason = self
                    .reason
                    .get()
                    .copied()
                    .unwrap_or(EndReason::PublisherClosed);
                Some(BusItem::Ended(reason))
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slots) = state.slots.get_mut(&self.session) {
            slots.retain(|s| s.sub != self.sub);
            if slots.is_empty() {
                state.slots.remove(&self.session);
            }
        }
    }
}

impl Bus {
    /// A bus whose subscribers each queue at most `capacity` items.
    pub fn new(capacity: usize) -> Bus {
        Bus {
            state: Arc::default(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a subscriber of `session`'s events. Call it before reading
    /// the backlog, with the book locked (read) so no commit is half-seen.
    /// A closed bus answers with a subscriber that ends at once.
    pub fn subscribe(&self, session: SessionId, provisional: bool) -> Subscriber {
        let sub = NEXT_SUB.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.capacity);
        let reason = Arc::new(OnceLock::new());
        let mut state = self.lock();
        if state.closed {
            let _ = reason.set(EndReason::PublisherClosed);
        } else {
            state.slots.entry(session).or_default().push(Slot {
                sub,
                provisional,
                tx,
                reason: reason.clone(),
            });
        }
        Subscriber {
            sub,
            session,
            rx,
            reason,
            state: self.state.clone(),
            done: false,
        }
    }

    /// Hands `item` to every subscriber of `session` it is for, ending the
    /// ones that cannot take it.
    fn publish(&self, session: SessionId, provisional: bool, item: impl Fn() -> BusItem) {
        let mut state = self.lock();
        let Some(slots) = state.slots.get_mut(&session) else {
            return;
        };
        slots.retain(|slot| {
            if provisional && !slot.provisional {
                return true;
            }
            match slot.tx.try_send(item()) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let _ = slot.reason.set(EndReason::Lagged);
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        });
        if slots.is_empty() {
            state.slots.remove(&session);
        }
    }

    /// Committed events of one session, in order.
    pub fn publish_events(&self, session: SessionId, events: &[Event]) {
        for event in events {
            self.publish(session, false, || BusItem::Event(event.clone()));
        }
    }

    /// Text a generation drew ahead of its commit.
    pub fn publish_provisional(&self, session: SessionId, channel: Channel, text: &str) {
        self.publish(session, true, || BusItem::Provisional {
            channel,
            text: text.to_string(),
        });
    }

    /// Sessions purged: their subscribers end with `purged`.
    pub fn publish_purge(&self, sessions: &[SessionId]) {
        let mut state = self.lock();
        for s in sessions {
            for slot in state.slots.remove(s).unwrap_or_default() {
                let _ = slot.reason.set(EndReason::Purged);
            }
        }
    }

    /// The daemon is shutting down: every subscriber ends with
    /// `publisher closed`, and later ones end at once. Returns how many
    /// were live.
    pub fn close(&self) -> usize {
        let mut state = self.lock();
        state.closed = true;
        let mut n = 0;
        for (_, slots) in state.slots.drain() {
            for slot in slots {
                let _ = slot.reason.set(EndReason::PublisherClosed);
                n += 1;
            }
        }
        n
    }

    /// Live subscribers (for tests and metrics).
    pub fn subscribers(&self) -> usize {
        self.lock().slots.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Record;

    fn ev(id: u64) -> Event {
        Event {
            event_id: id,
            epoch: 1,
            ts_unix_ms: 0,
            body: Record::EpochBump,
        }
    }

    fn drain(s: &mut Subscriber) -> Vec<BusItem> {
        let mut out = Vec::new();
        while let Ok(item) = s.rx.try_recv() {
            out.push(item);
        }
        out
    }

    #[test]
    fn a_full_subscriber_is_lagged_and_the_others_are_not() {
        let bus = Bus::new(2);
        let mut slow = bus.subscribe(1, false);
        let mut fast = bus.subscribe(1, false);
        let mut got = Vec::new();
        for id in 0..5 {
            bus.publish_events(1, &[ev(id)]);
            got.extend(drain(&mut fast));
        }
        assert_eq!(got.len(), 5);
        assert_eq!(
            drain(&mut slow),
            vec![BusItem::Event(ev(0)), BusItem::Event(ev(1))]
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(
            rt.block_on(slow.recv()),
            Some(BusItem::Ended(EndReason::Lagged))
        );
        assert_eq!(rt.block_on(slow.recv()), None);
        assert_eq!(bus.subscribers(), 1);
    }

    #[test]
    fn provisional_only_to_those_who_asked_and_purge_and_close_end() {
        let bus = Bus::new(8);
        let mut plain = bus.subscribe(1, false);
        let mut prov = bus.subscribe(1, true);
        let mut other = bus.subscribe(2, false);
        bus.publish_provisional(1, Channel::Text, "hi");
        assert!(drain(&mut plain).is_empty());
        assert_eq!(drain(&mut prov).len(), 1);
        bus.publish_purge(&[1]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(
            rt.block_on(plain.recv()),
            Some(BusItem::Ended(EndReason::Purged))
        );
        assert_eq!(bus.close(), 1);
        assert_eq!(
            rt.block_on(other.recv()),
            Some(BusItem::Ended(EndReason::PublisherClosed))
        );
        let mut late = bus.subscribe(3, false);
        assert_eq!(
            rt.block_on(late.recv()),
            Some(BusItem::Ended(EndReason::PublisherClosed))
        );
    }

    #[test]
    fn dropping_a_subscriber_unregisters_it() {
        let bus = Bus::new(8);
        let s = bus.subscribe(1, false);
        assert_eq!(bus.subscribers(), 1);
        drop(s);
        assert_eq!(bus.subscribers(), 0);
    }
}
