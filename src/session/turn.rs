//! `TurnOutput`: turns the tokens a generation draws into the records the
//! session commits: `Generated` chunks (one channel each), `ToolUse` and
//! `ToolParseFailure`. Plain data; the session actor commits what it returns,
//! in order.
//!
//! A chunk is cut when it holds `COMMIT_EVERY_TOKENS` tokens, when
//! `COMMIT_INTERVAL_MS` passed since its first token, when the channel
//! changes, before a tool call's event, and at the end (the last chunk
//! carries the finish code). Tokens not yet cut are the provisional text.
//!
//! The finish rule lives here, and only here: [`ends_turn`] says which finish
//! codes close the assistant turn, [`reported_finish`] turns the scheduler's
//! reason for stopping into the code the log and the client see.

use super::output::{Markers, OutputDecoder, Segment};
use crate::wire::{Channel, Finish, Record, Token};

/// A chunk is committed once it holds this many tokens...
pub const COMMIT_EVERY_TOKENS: usize = 16;
/// ...or once its first token is this old.
pub const COMMIT_INTERVAL_MS: u64 = 100;

/// True when a finish code closes the assistant turn: the model ended it, or
/// a forced tool call completed its grammar. Any other code (max_tokens, a
/// cancel, an error) leaves the turn open, and the next Generate continues it.
pub fn ends_turn(finish: Finish) -> bool {
    matches!(finish, Finish::EndOfTurn | Finish::Grammar)
}

/// The finish code of a generation the scheduler stopped with `drawn`: a turn
/// that ended while a grammar forced a tool call ended by completing that
/// call (GRAMMAR).
pub fn reported_finish(drawn: Finish, forced_call: bool) -> Finish {
    if forced_call && drawn == Finish::EndOfTurn {
        Finish::Grammar
    } else {
        drawn
    }
}

#[derive(Debug, Default)]
struct Chunk {
    channel: Channel,
    text: String,
    span: Vec<Token>,
    first_ms: u64,
}

/// The output side of one generation.
#[derive(Debug)]
pub struct TurnOutput {
    decoder: OutputDecoder,
    chunk: Option<Chunk>,
    tokens: u64,
    /// Text decoded since the last `take_fresh`, by channel, in order.
    fresh: Vec<(Channel, String)>,
    /// A grammar forces a tool call: the turn's end is reported as GRAMMAR.
    forced_call: bool,
    /// The finish code, once `finish` was called.
    finished: Option<Finish>,
}

impl TurnOutput {
    pub fn new(markers: Markers, in_reasoning: bool) -> TurnOutput {
        TurnOutput::resume(markers, in_reasoning, &[])
    }

    /// The output side of a generation that continues a cut turn: `turn`
    /// holds the turn's tokens so far with their pieces, `opened_in_reasoning`
    /// how the turn began (see [`OutputDecoder::resume`]).
    pub fn resume(
        markers: Markers,
        opened_in_reasoning: bool,
        turn: &[(Token, Vec<u8>)],
    ) -> TurnOutput {
        TurnOutput {
            decoder: OutputDecoder::resume(markers, opened_in_reasoning, turn),
            chunk: None,
            tokens: 0,
            fresh: Vec::new(),
            forced_call: false,
            finished: None,
        }
    }

    /// The same, for a generation whose grammar forces a tool call (see
    /// [`reported_finish`]).
    pub fn with_forced_call(mut self, forced_call: bool) -> TurnOutput {
        self.forced_call = forced_call;
        self
    }

    /// The finish code `finish` recorded, None before.
    pub fn finished(&self) -> Option<Finish> {
        self.finished
    }

    /// The text decoded since the last call, as `(channel, text)` pieces in
    /// order: what provisional readers have not seen yet, whether or not it
    /// was cut into a record meanwhile.
    pub fn take_fresh(&mut self) -> Vec<(Channel, String)> {
        std::mem::take(&mut self.fresh)
    }

    /// Tokens taken so far.
    pub fn tokens_generated(&self) -> u64 {
        self.tokens
    }

    /// The text drawn but not yet cut into a record: `(channel, text)`.
    pub fn provisional(&self) -> Option<(Channel, &str)> {
        self.chunk.as_ref().map(|c| (c.channel, c.text.as_str()))
    }

    fn cut(&mut self, out: &mut Vec<Record>, finish: Finish) {
        if let Some(c) = self.chunk.take() {
            out.push(Record::Generated {
                span: c.span,
                text: c.text,
                channel: c.channel,
                finish,
            });
        }
    }

    fn take_segments(&mut self, segments: Vec<Segment>, now_ms: u64, out: &mut Vec<Record>) {
        for seg in segments {
            match seg {
                Segment::Text {
                    channel,
                    text,
                    tokens,
                } => {
                    if !text.is_empty() {
                        match self.fresh.last_mut() {
                            Some((c, t)) if *c == channel => t.push_str(&text),
                            _ => self.fresh.push((channel, text.clone())),
                        }
                    }
                    if self.chunk.as_ref().is_some_and(|c| c.channel != channel) {
                        self.cut(out, Finish::Open);
                    }
                    let c = self.chunk.get_or_insert_with(|| Chunk {
                        channel,
                        first_ms: now_ms,
                        ..Chunk::default()
                    });
                    c.text.push_str(&text);
                    c.span.extend_from_slice(&tokens);
                }
                Segment::ToolCall { name, arguments } => {
                    self.cut(out, Finish::Open);
                    out.push(Record::ToolUse { name, arguments });
                }
                Segment::ParseFailure { text, error } => {
                    self.cut(out, Finish::Open);
                    out.push(Record::ToolParseFailure { text, error });
                }
            }
        }
    }

    /// Takes one drawn token; returns the records now ready to commit.
    pub fn push(&mut self, token: Token, piece: &[u8], eog: bool, now_ms: u64) -> Vec<Record> {
        self.tokens += 1;
        let mut out = Vec::new();
        if eog {
            // The end-of-turn token goes on the input, not into the text.
            let channel = self.decoder.channel();
            let c = self.chunk.get_or_insert_with(|| Chunk {
                channel,
                first_ms: now_ms,
                ..Chunk::default()
            });
            c.span.push(token);
            return out;
        }
        let segments = self.decoder.push(token, piece);
        self.take_segments(segments, now_ms, &mut out);
        if let Some(c) = &self.chunk {
            if c.span.len() >= COMMIT_EVERY_TOKENS
                || now_ms.saturating_sub(c.first_ms) >= COMMIT_INTERVAL_MS
            {
                self.cut(&mut out, Finish::Open);
            }
        }
        out
    }

    /// The scheduler stopped the generation with `drawn`: everything held
    /// back, the last chunk carrying the finish code (see [`reported_finish`];
    /// an empty chunk if nothing was left, so the log records how the turn
    /// ended).
    pub fn finish(&mut self, drawn: Finish, now_ms: u64) -> Vec<Record> {
        let mut out = Vec::new();
        let finish_code = reported_finish(drawn, self.forced_call);
        self.finished = Some(finish_code);
        let segments = self.decoder.finish(ends_turn(finish_code));
        self.take_segments(segments, now_ms, &mut out);
        if self.chunk.is_none() {
            self.chunk = Some(Chunk {
                channel: self.decoder.channel(),
                first_ms: now_ms,
                ..Chunk::default()
            });
        }
        self.cut(&mut out, finish_code);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(records: &[Record]) -> String {
        records
            .iter()
            .map(|r| match r {
                Record::Generated { text, .. } => text.clone(),
                _ => String::new(),
            })
            .collect()
    }

    #[test]
    fn chunks_by_size_and_keeps_every_token() {
        let mut t = TurnOutput::new(Markers::none(), false);
        let mut records = Vec::new();
        for i in 0..40u32 {
            records.extend(t.push(i, b"x", false, 0));
        }
        assert_eq!(records.len(), 2, "16 + 16 cut, 8 held back");
        assert_eq!(t.provisional(), Some((Channel::Text, "xxxxxxxx")));
        records.extend(t.push(99, b"", true, 0));
        records.extend(t.finish(Finish::EndOfTurn, 0));
        let spans: Vec<Token> = records.iter().flat_map(|r| r.span().to_vec()).collect();
        assert_eq!(spans.len(), 41);
        assert_eq!(
            *spans.last().unwrap(),
            99,
            "the end-of-turn token is on the input"
        );
        assert_eq!(texts(&records), "x".repeat(40));
        assert!(matches!(
            records.last(),
            Some(Record::Generated {
                finish: Finish::EndOfTurn,
                ..
            })
        ));
        assert_eq!(t.tokens_generated(), 41);
    }

    #[test]
    fn fresh_text_includes_what_a_cut_committed() {
        let mut t = TurnOutput::new(Markers::none(), false);
        let mut seen = String::new();
        for i in 0..40u32 {
            t.push(i, format!("{}", i % 10).as_bytes(), false, 0);
            for (_, text) in t.take_fresh() {
                seen.push_str(&text);
            }
        }
        let expected: String = (0..40).map(|i| format!("{}", i % 10)).collect();
        assert_eq!(seen, expected, "every token's text, cut or not");
    }

    #[test]
    fn chunks_by_time() {
        let mut t = TurnOutput::new(Markers::none(), false);
        assert!(t.push(1, b"a", false, 0).is_empty());
        assert_eq!(t.push(2, b"b", false, COMMIT_INTERVAL_MS).len(), 1);
    }

    #[test]
    fn channels_and_tool_calls_cut_chunks() {
        let mut t = TurnOutput::new(Markers::qwen(), false);
        let mut records = Vec::new();
        let text = "<think>hm</think>ok<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";
        for (i, ch) in text.chars().enumerate() {
            records.extend(t.push(i as u32, ch.to_string().as_bytes(), false, 0));
        }
        records.extend(t.finish(Finish::EndOfTurn, 0));
        let channels: Vec<u8> = records
            .iter()
            .filter_map(|r| match r {
                Record::Generated { channel, .. } => Some(u8::from(*channel)),
                _ => None,
            })
            .collect();
        assert_eq!(&channels[..3], &[1, 0, 2]);
        assert!(records.contains(&Record::ToolUse {
            name: "f".into(),
            arguments: "{\"a\":1}".into()
        }));
        assert_eq!(texts(&records), text);
    }

    #[test]
    fn finish_without_pending_text_still_records_the_finish() {
        let mut t = TurnOutput::new(Markers::none(), false);
        let r = t.finish(Finish::Cancelled, 0);
        assert_eq!(
            r,
            vec![Record::Generated {
                span: vec![],
                text: String::new(),
                channel: Channel::Text,
                finish: Finish::Cancelled
            }]
        );
    }
}
