//! Sampling extras: what OpenAI-style requests add to [`super::Params`]
//! (presence and frequency penalties, logit bias, log-probabilities), and
//! the log-probabilities that come back with a drawn token.
//!
//! They travel on the worker pipe (`Sample::extras`) and never in the
//! session log: a session's `Params` are unchanged. A plain generation
//! carries `None` and pays nothing.

use serde::{Deserialize, Serialize};

use super::Token;

/// The most alternatives `logprobs` may ask for (OpenAI's `top_logprobs` cap).
pub const MAX_TOP_LOGPROBS: u8 = 20;
/// Penalties are within `-PENALTY_MAX..=PENALTY_MAX`.
pub const PENALTY_MAX: f32 = 2.0;
/// A logit bias is within `-BIAS_MAX..=BIAS_MAX`.
pub const BIAS_MAX: f32 = 100.0;
/// The most `logit_bias` entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Sampling extras of one generation.
///
/// Applied to each row of logits before anything else (before the grammar's
/// verdict, temperature, top-k, top-p and min-p):
/// `logit[t] += bias[t] - presence_penalty * (count[t] > 0) - frequency_penalty * count[t]`,
/// where `count[t]` is how many times this generation has drawn `t` so far
/// (its prompt does not count; a new generation starts from zero).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SampleExtras {
    /// `-2..=2`: subtracted once from every token drawn at least once.
    pub presence_penalty: f32,
    /// `-2..=2`: subtracted per time a token was drawn.
    pub frequency_penalty: f32,
    /// `(token id, bias)`, bias in `-100..=100`, added to the token's logit
    /// (an id listed twice gets the sum). Ids must be `< n_vocab`.
    pub logit_bias: Vec<(Token, f32)>,
    /// `Some(n)`: report each drawn token's log-probability and the `n`
    /// (`0..=20`) most likely tokens' ([`TokenLogprob`]).
    pub logprobs: Option<u8>,
}

/// The log-probabilities of one drawn token, from the model's distribution
/// after logit bias and penalties, before temperature, top-k, top-p, min-p
/// and any grammar (what OpenAI reports).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The drawn token's log-probability (`<= 0`).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first
    /// (ties: lowest id first); as many as asked (fewer only when the
    /// vocabulary has fewer finite logits). The drawn token is among them
    /// only if it is one of the most likely.
    pub top: Vec<(Token, f32)>,
}

/// Why a [`SampleExtras`] is refused. The text is what the client sees.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExtrasError {
    #[error("presence_penalty {0} is out of range (-2 to 2)")]
    PresencePenalty(f32),
    #[error("frequency_penalty {0} is out of range (-2 to 2)")]
    FrequencyPenalty(f32),
    #[error("logit_bias for token {token}: {bias} is out of range (-100 to 100)")]
    Bias { token: Token, bias: f32 },
    #[error("logit_bias: token id {token} is not in the vocabulary ({n_vocab} tokens)")]
    BiasToken { token: Token, n_vocab: u32 },
    #[error("logit_bias has {0} entries, more than {MAX_LOGIT_BIAS}")]
    TooManyBiases(usize),
    #[error("top_logprobs {0} is out of range (0 to {MAX_TOP_LOGPROBS})")]
    TopLogprobs(u8),
}

impl ExtrasError {
    /// The request field it names, as OpenAI's chat route calls it.
    pub fn field(&self) -> &'static str {
        match self {
            ExtrasError::PresencePenalty(_) => "presence_penalty",
            ExtrasError::FrequencyPenalty(_) => "frequency_penalty",
            ExtrasError::Bias { .. }
            | ExtrasError::BiasToken { .. }
            | ExtrasError::TooManyBiases(_) => "logit_bias",
            ExtrasError::TopLogprobs(_) => "top_logprobs",
        }
    }
}

impl SampleExtras {
    /// Checks every value's range, and every `logit_bias` id against
    /// `n_vocab` (valid ids are `0..n_vocab`). NaN is out of range.
    pub fn check(&self, n_vocab: u32) -> Result<(), ExtrasError> {
        let within = |v: f32, max: f32| (-max..=max).contains(&v);
        if !within(self.presence_penalty, PENALTY_MAX) {
            return Err(ExtrasError::PresencePenalty(self.presence_penalty));
        }
        if !within(self.frequency_penalty, PENALTY_MAX) {
            return Err(ExtrasError::FrequencyPenalty(self.frequency_penalty));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(ExtrasError::TooManyBiases(self.logit_bias.len()));
        }
        for &(token, bias) in &self.logit_bias {
            if token >= n_vocab {
                return Err(ExtrasError::BiasToken { token, n_vocab });
            }
            if !within(bias, BIAS_MAX) {
                return Err(ExtrasError::Bias { token, bias });
            }
        }
        match self.logprobs {
            Some(n) if n > MAX_TOP_LOGPROBS => Err(ExtrasError::TopLogprobs(n)),
            _ => Ok(()),
        }
    }

    /// Whether the draw needs the counts of earlier draws.
    pub fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_refuses_out_of_range_values_with_a_clear_message() {
        let ok = SampleExtras {
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logit_bias: vec![(0, -100.0), (99, 100.0)],
            logprobs: Some(20),
        };
        assert_eq!(ok.check(100), Ok(()));
        assert!(ok.penalizes());
        assert!(!SampleExtras::default().penalizes());
        let msg = |e: SampleExtras| e.check(100).unwrap_err().to_string();
        assert_eq!(
            msg(SampleExtras {
                logit_bias: vec![(100, 1.0)],
                ..ok.clone()
            }),
            "logit_bias: token id 100 is not in the vocabulary (100 tokens)"
        );
        assert_eq!(
            msg(SampleExtras {
                logit_bias: vec![(3, -100.5)],
                ..ok.clone()
            }),
            "logit_bias for token 3: -100.5 is out of range (-100 to 100)"
        );
        assert_eq!(
            msg(SampleExtras {
                presence_penalty: f32::NAN,
                ..ok.clone()
            }),
            "presence_penalty NaN is out of range (-2 to 2)"
        );
        assert_eq!(
            msg(SampleExtras {
                frequency_penalty: 2.1,
                ..ok.clone()
            }),
            "frequency_penalty 2.1 is out of range (-2 to 2)"
        );
        assert_eq!(
            msg(SampleExtras {
                logprobs: Some(21),
                ..ok.clone()
            }),
            "top_logprobs 21 is out of range (0 to 20)"
        );
        assert!(matches!(
            SampleExtras {
                logit_bias: vec![(1, 0.0); MAX_LOGIT_BIAS + 1],
                ..ok
            }
            .check(100),
            Err(ExtrasError::TooManyBiases(_))
        ));
    }
}
