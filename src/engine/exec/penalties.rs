//! The draws each sequence's generation has made, for presence and frequency penalties.
//!
//! A draw with extras names its generation's first draw position (`DrawExtras::first_draw`);
//! the sequence keeps the tokens drawn from there on, in order, and their counts. A draw at
//! `draw_pos` sees the counts of the draws at `first_draw..draw_pos` only: draws kept beyond
//! that (a request that drew and then was rolled back, and is asked again) are forgotten first;
//! a draw at `first_draw` starts afresh. So the counts, like the draw, are a function of the
//! generation's own history, the same whether its steps came one by one (`Decode`) or were run
//! by the worker on its own draws (`DecodeNext`). A history that cannot be the generation's
//! (another generation's, or one shorter than `draw_pos - first_draw`: the worker restarted) is
//! refused rather than guessed.

use std::collections::HashMap;

use super::error::RequestError;
use crate::wire::Token;

/// One sequence's generation so far.
#[derive(Debug, Default)]
struct History {
    first_draw: u64,
    tokens: Vec<Token>,
    counts: HashMap<Token, u32>,
}

impl History {
    /// Forgets the draws from index `n` on.
    fn truncate(&mut self, n: usize) {
        for t in self.tokens.drain(n.min(self.tokens.len())..) {
            if let Some(c) = self.counts.get_mut(&t) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&t);
                }
            }
        }
    }
}

/// Every sequence's history.
#[derive(Debug)]
pub(super) struct Penalties(Vec<Option<History>>);

impl Penalties {
    pub(super) fn new(n_seq: u32) -> Penalties {
        Penalties((0..n_seq).map(|_| None).collect())
    }

    /// The counts a draw at `draw_pos` of sequence `seq` sees, for the generation whose first
    /// draw was at `first_draw`.
    pub(super) fn counts(
        &mut self,
        seq: u32,
        first_draw: u64,
        draw_pos: u64,
    ) -> Result<&HashMap<Token, u32>, RequestError> {
        let lost = || RequestError::PenaltyHistory {
            seq,
            first_draw,
            draw_pos,
        };
        let slot = self.0.get_mut(seq as usize).ok_or_else(lost)?;
        let n = draw_pos.checked_sub(first_draw).ok_or_else(lost)?;
        if n == 0 {
            *slot = Some(History {
                first_draw,
                ..History::default()
            });
        }
        match slot {
            Some(h) if h.first_draw == first_draw && h.tokens.len() as u64 >= n => {
                h.truncate(n as usize);
                Ok(&h.counts)
            }
            _ => Err(lost()),
        }
    }

    /// Records the token just drawn for `seq` (after [`Penalties::counts`] for that draw).
    pub(super) fn drew(&mut self, seq: u32, token: Token) {
        if let Some(Some(h)) = self.0.get_mut(seq as usize) {
            h.tokens.push(token);
            *h.counts.entry(token).or_insert(0) += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(m: &HashMap<Token, u32>) -> Vec<(Token, u32)> {
        let mut v: Vec<_> = m.iter().map(|(&t, &c)| (t, c)).collect();
        v.sort();
        v
    }

    #[test]
    fn counts_follow_the_generation_and_forget_rolled_back_draws() {
        let mut p = Penalties::new(2);
        assert!(sorted(p.counts(0, 10, 10).unwrap()).is_empty());
        p.drew(0, 5);
        assert_eq!(sorted(p.counts(0, 10, 11).unwrap()), [(5, 1)]);
        p.drew(0, 5);
        p.drew(0, 7); // drawn at 12, then rolled back: asked again at 12
        assert_eq!(sorted(p.counts(0, 10, 12).unwrap()), [(5, 2)]);
        p.drew(0, 8);
        assert_eq!(sorted(p.counts(0, 10, 13).unwrap()), [(5, 2), (8, 1)]);
        // A draw further than the history reaches, or another generation's: refused.
        assert!(p.counts(0, 10, 20).is_err());
        assert!(p.counts(0, 9, 13).is_err());
        assert!(p.counts(0, 10, 9).is_err());
        assert!(p.counts(1, 0, 1).is_err());
        assert!(p.counts(2, 0, 0).is_err());
        // A new generation starts afresh, at its first draw.
        assert!(sorted(p.counts(0, 13, 13).unwrap()).is_empty());
        assert!(sorted(p.counts(0, 10, 10).unwrap()).is_empty());
    }
}
