//! `TokenBucket`: how `Complete` is metered. Plain data, time passed in, so
//! it is tested without a clock. One bucket per socket or /web/ws
//! connection, and one for the whole /web/rpc listener (the spec's); besides
//! those, one for all the socket's connections together and one for all of
//! /web/ws's, so opening more connections does not buy more completions.
//!
//! Tokens are counted in thousandths so a refill rate of `r` per second is
//! exactly `r` thousandths per millisecond: no floating point, no drift.

use std::time::Instant;

/// `Complete`s one connection may send at once...
pub const CONNECTION_COMPLETE_BURST: u32 = 8;
/// ...and per second after that.
pub const CONNECTION_COMPLETES_PER_SEC: u32 = 4;
/// `Complete`s all of /web/rpc may take at once...
pub const LISTENER_COMPLETE_BURST: u32 = 16;
/// ...and per second after that.
pub const LISTENER_COMPLETES_PER_SEC: u32 = 8;

const MILLI: u64 = 1000;

#[derive(Debug, Clone)]
pub struct TokenBucket {
    capacity_milli: u64,
    /// Thousandths of a token added per millisecond (= tokens per second).
    refill_per_ms: u64,
    tokens_milli: u64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket of `capacity` tokens, refilled at `per_sec` a second.
    pub fn new(capacity: u32, per_sec: u32, now: Instant) -> TokenBucket {
        let capacity_milli = u64::from(capacity.max(1)) * MILLI;
        TokenBucket {
            capacity_milli,
            refill_per_ms: u64::from(per_sec.max(1)),
            tokens_milli: capacity_milli,
            last: now,
        }
    }

    /// Per connection (socket, /web/ws).
    pub fn per_connection(now: Instant) -> TokenBucket {
        TokenBucket::new(CONNECTION_COMPLETE_BURST, CONNECTION_COMPLETES_PER_SEC, now)
    }

    /// The whole /web/rpc listener.
    pub fn per_listener(now: Instant) -> TokenBucket {
        TokenBucket::new(LISTENER_COMPLETE_BURST, LISTENER_COMPLETES_PER_SEC, now)
    }

    fn refill(&mut self, now: Instant) {
        let ms = now.saturating_duration_since(self.last).as_millis() as u64;
        if ms == 0 {
            return;
        }
        // Only whole milliseconds are consumed, so none is lost.
        self.last += std::time::Duration::from_millis(ms);
        self.tokens_milli = self
            .tokens_milli
            .saturating_add(ms.saturating_mul(self.refill_per_ms))
            .min(self.capacity_milli);
    }

    /// Takes one token, or says in how many milliseconds one will be there.
    pub fn try_take(&mut self, now: Instant) -> Result<(), u64> {
        self.ready(now)?;
        self.tokens_milli -= MILLI;
        Ok(())
    }

    /// Whether a token is there (none is taken), or in how many milliseconds one will be.
    fn ready(&mut self, now: Instant) -> Result<(), u64> {
        self.refill(now);
        if self.tokens_milli >= MILLI {
            return Ok(());
        }
        let missing = MILLI - self.tokens_milli;
        Err(missing.div_ceil(self.refill_per_ms).max(1))
    }

    /// Takes one token from each bucket when both have one, or none, saying in how many
    /// milliseconds both will (a connection's bucket and its listener's: a refusal by one never
    /// costs the other a token).
    pub fn try_take_both(
        a: &mut TokenBucket,
        b: &mut TokenBucket,
        now: Instant,
    ) -> Result<(), u64> {
        match (a.ready(now), b.ready(now)) {
            (Ok(()), Ok(())) => {
                a.tokens_milli -= MILLI;
                b.tokens_milli -= MILLI;
                Ok(())
            }
            (Err(x), Ok(())) | (Ok(()), Err(x)) => Err(x),
            (Err(x), Err(y)) => Err(x.max(y)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(3, 2, t0);
        for _ in 0..3 {
            assert_eq!(b.try_take(t0), Ok(()));
        }
        // Empty: one token comes back in 500 ms at 2 a second.
        assert_eq!(b.try_take(t0), Err(500));
        assert_eq!(b.try_take(t0 + Duration::from_millis(200)), Err(300));
        assert_eq!(b.try_take(t0 + Duration::from_millis(500)), Ok(()));
        assert_eq!(b.try_take(t0 + Duration::from_millis(500)), Err(500));
    }

    #[test]
    fn both_buckets_or_neither() {
        let t0 = Instant::now();
        let (mut conn, mut all) = (TokenBucket::new(2, 1, t0), TokenBucket::new(1, 1, t0));
        assert_eq!(TokenBucket::try_take_both(&mut conn, &mut all, t0), Ok(()));
        // The listener's is empty: the connection keeps its token.
        assert_eq!(
            TokenBucket::try_take_both(&mut conn, &mut all, t0),
            Err(1000)
        );
        let mut other = TokenBucket::new(2, 1, t0);
        assert_eq!(
            TokenBucket::try_take_both(&mut other, &mut all, t0),
            Err(1000)
        );
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(TokenBucket::try_take_both(&mut conn, &mut all, t1), Ok(()));
        assert_eq!(
            TokenBucket::try_take_both(&mut conn, &mut all, t1),
            Err(1000)
        );
    }

    #[test]
    fn refill_stops_at_capacity_and_loses_no_fraction() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2, 3, t0);
        let later = t0 + Duration::from_secs(60);
        assert_eq!(b.try_take(later), Ok(()));
        assert_eq!(b.try_take(later), Ok(()));
        assert!(b.try_take(later).is_err());
        // 3 a second: 334 ms (three steps of 111.3 ms would round down each time).
        let mut t = later;
        for _ in 0..3 {
            t += Duration::from_micros(111_300);
            let _ = b.try_take(t);
        }
        assert_eq!(b.try_take(later + Duration::from_millis(334)), Ok(()));
    }

    #[test]
    fn retry_after_is_never_zero() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1, 1000, t0);
        assert_eq!(b.try_take(t0), Ok(()));
        assert_eq!(b.try_take(t0), Err(1));
    }
}
