//! A sans-IO streaming decoder of a model's generated output: token pieces in, channel-tagged
//! text, parsed tool calls and tool-call parse failures out. No model, no I/O, no actix.
//!
//! Channels: [`Channel::Text`] (0) the answer, [`Channel::Reasoning`] (1) the inside of the template's thinking
//! block (`<think>`...`</think>`), [`Channel::ToolCall`] (2) the inside of a tool-call block
//! (`<tool_call>`...`</tool_call>`).
//!
//! Rules:
//! - **Marker text is channel text.** The opening marker goes on the channel it opens, the closing
//!   marker on the channel it closes (`<think>` and `</think>` on 1, `<tool_call>` and
//!   `</tool_call>` on 2). So concatenating the text of every [`Segment::Text`], all channels, in
//!   order, gives back exactly the generated text (for invalid UTF-8: its lossy decoding, each
//!   invalid sequence a U+FFFD).
//! - Text after a closing marker is on channel 0, whitespace included (`</think>\n\nHi`: `\n\nHi`
//!   is channel-0 text).
//! - Markers are recognised only where they mean something: `<think>` and `<tool_call>` on
//!   channel 0, `</think>` on channel 1, `</tool_call>` on channel 2. A `<tool_call>` inside a
//!   reasoning block is reasoning text.
//! - Text that could be the start of a marker (a proper prefix of a marker recognised on the
//!   current channel, at the end of what has been decoded) is held back until a later piece
//!   settles it; [`OutputDecoder::finish`] flushes it as text. A UTF-8 character split across
//!   pieces is held back until complete; `finish` flushes an incomplete tail lossily (U+FFFD)
//!   when the turn ends, and leaves it out at a cut (max_tokens, a cancel): its tokens end in a
//!   segment before it, and the turn's continuation, replaying them, completes the character.
//! - **Tokens.** Every pushed token appears in the `tokens` of exactly one `Text` segment, in push
//!   order: the segment holding its last byte (a token ending inside a UTF-8 character ends where
//!   the character ends). So a token is attributed to the channel where it ends, and a marker's
//!   tokens go with the marker's text: the opening marker's on the new channel, the closing one's
//!   on the channel it closes. A `Text` segment can therefore have text and no tokens (e.g. the
//!   token `"so</think>\n\nHi"` puts `so</think>` on channel 1 with no tokens and `\n\nHi` on
//!   channel 0 with the token). A token with an empty piece, pushed while nothing is held back,
//!   comes out as a `Text` segment with empty text on the current channel.
//! - A closed tool-call block is followed, right after the `Text` segment holding its closing
//!   marker, by a [`Segment::ToolCall`] or a [`Segment::ParseFailure`]. A tool-call block still
//!   open when the turn ends (`finish(true)`) becomes a `ParseFailure`; one open at a cut
//!   (`finish(false)`: max_tokens, a cancel) is left open for the turn's continuation.
//! - **Continuing a cut turn.** [`OutputDecoder::resume`] replays the turn's tokens so far into a
//!   fresh decoder, emitting nothing: the next tokens then meet the state the cut left (the
//!   channel, a marker prefix, the open tool-call block), so a marker or a tool call split across
//!   the cut is recognised, and text the earlier part already committed is not emitted again.

use std::collections::VecDeque;

use serde_json::Value as Json;

use crate::wire::Channel;

/// The opening and closing marker of a thinking block in templates that have one.
pub const THINK: (&str, &str) = ("<think>", "</think>");
/// The opening and closing marker of a tool call (Hermes/Qwen style).
pub const TOOL_CALL_MARKERS: (&str, &str) = ("<tool_call>", "</tool_call>");

/// The markers the decoder recognises; `None` turns a kind of block off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Markers {
    /// Opening and closing marker of the thinking block (channel 1).
    pub think: Option<(String, String)>,
    /// Opening and closing marker of a tool call (channel 2).
    pub tool_call: Option<(String, String)>,
}

impl Markers {
    /// No markers: everything is channel-0 text.
    pub fn none() -> Markers {
        Markers::default()
    }

    /// Both `<think>`...`</think>` and `<tool_call>`...`</tool_call>` (Qwen3 style).
    pub fn qwen() -> Markers {
        Markers {
            think: Some(owned(THINK)),
            tool_call: Some(owned(TOOL_CALL_MARKERS)),
        }
    }

    /// The markers a chat template implies: the thinking block if the template mentions
    /// `<think>`; tool calls if it mentions `<tool_call>`, and also whenever it declares tools
    /// (mentions `tools`), since the Hermes-style `<tool_call>` block is what we parse then.
    /// A template that does neither gets tool calls once tools are declared
    /// ([`Markers::with_tools`]).
    pub fn from_template(template_source: &str) -> Markers {
        let think = template_source.contains(THINK.0).then(|| owned(THINK));
        let tool_call = (template_source.contains(TOOL_CALL_MARKERS.0)
            || template_source.contains("tools"))
        .then(|| owned(TOOL_CALL_MARKERS));
        Markers { think, tool_call }
    }

    /// These markers where `declared` tools are: a template that does not
    /// declare tools gets them declared in the Hermes form
    /// (`engine::template::tool_block`), so its `<tool_call>` blocks are
    /// parsed; with no tools, a template's plain text stays text.
    pub fn with_tools(mut self, declared: bool) -> Markers {
        if declared {
            self.tool_call
                .get_or_insert_with(|| owned(TOOL_CALL_MARKERS));
        }
        self
    }

    /// These markers for a generation forced to call a tool: the forced-call
    /// grammar writes a Hermes `<tool_call>` block, which is parsed as a call
    /// even where the template names no tool-call marker of its own.
    pub fn forcing_a_call(mut self) -> Markers {
        self.tool_call
            .get_or_insert_with(|| owned(TOOL_CALL_MARKERS));
        self
    }
}

fn owned((open, close): (&str, &str)) -> (String, String) {
    (open.to_owned(), close.to_owned())
}

/// One piece of decoded output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text on a channel with the tokens attributed to it (see the module doc: every pushed token
    /// is in exactly one `Text` segment; `tokens` may be empty, and `text` is empty only for a
    /// segment carrying an empty-piece token). Marker text is included.
    Text {
        channel: Channel,
        text: String,
        tokens: Vec<u32>,
    },
    /// A complete tool call `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    /// `arguments` is compact JSON (`{}` when absent or null); `"parameters"` is accepted for
    /// `"arguments"`, and arguments given as a JSON string holding JSON are unwrapped.
    ToolCall { name: String, arguments: String },
    /// A tool-call block that did not parse: `text` is the whole block, markers included (as far
    /// as it got, for a block cut off by the end of generation); `error` says why.
    ParseFailure { text: String, error: String },
}

/// What a marker does when found.
#[derive(Debug, Clone, Copy)]
enum Action {
    Open(Channel),
    Close,
}

/// Output of one scan, before tokens are attributed.
enum Scanned {
    /// Text on a channel; `end` is the absolute offset (in the decoded text) just past it.
    Text {
        channel: Channel,
        text: String,
        end: usize,
        tokens: Vec<u32>,
    },
    Event(Segment),
}

/// Streaming decoder of generated output into [`Segment`]s. See the module doc for the rules.
#[derive(Debug, Clone)]
pub struct OutputDecoder {
    markers: Markers,
    channel: Channel,
    /// Bytes of an incomplete UTF-8 character at the end of the input.
    raw: Vec<u8>,
    /// Decoded text not yet emitted (a possible marker prefix).
    buf: String,
    /// Absolute offset of `buf`'s start in the decoded text (= length of all text emitted).
    base: usize,
    /// Length of all decoded text (= `base + buf.len()`).
    decoded: usize,
    /// Tokens not yet attributed, with the absolute offset where they end (`None` while their
    /// last byte is part of an incomplete UTF-8 character).
    pending: VecDeque<(u32, Option<usize>)>,
    /// The current tool-call block's text so far, opening marker included.
    tool_block: String,
    /// Decoded text up to this offset was committed by an earlier part of the turn
    /// ([`OutputDecoder::resume`]): it is never emitted again.
    replayed: usize,
}

impl OutputDecoder {
    /// A decoder for one generation. With `start_in_reasoning`, output starts on channel 1 (the
    /// generation prompt opened a thinking block, or a turn cut inside one is continued).
    pub fn new(markers: Markers, start_in_reasoning: bool) -> Self {
        OutputDecoder {
            markers,
            channel: if start_in_reasoning {
                Channel::Reasoning
            } else {
                Channel::Text
            },
            raw: Vec::new(),
            buf: String::new(),
            base: 0,
            decoded: 0,
            pending: VecDeque::new(),
            tool_block: String::new(),
            replayed: 0,
        }
    }

    /// A decoder continuing a cut turn: `turn` is what the turn generated so far (token and
    /// piece), `start_in_reasoning` how the turn opened. Replays it and emits nothing of it.
    pub fn resume(markers: Markers, start_in_reasoning: bool, turn: &[(u32, Vec<u8>)]) -> Self {
        let mut d = OutputDecoder::new(markers, start_in_reasoning);
        for (token, piece) in turn {
            d.push(*token, piece);
        }
        // Every replayed token and all complete text are in the log already.
        d.pending.clear();
        d.replayed = d.decoded;
        d
    }

    /// The channel the next text would go to (0 text, 1 reasoning, 2 tool call). Text held back
    /// as a possible marker prefix is not accounted for: it goes here unless it completes a
    /// marker.
    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// The markers in use.
    pub fn markers(&self) -> &Markers {
        &self.markers
    }

    /// Feed one token's raw bytes (possibly part of a UTF-8 character or of a marker); returns the
    /// segments that became certain.
    pub fn push(&mut self, token: u32, piece: &[u8]) -> Vec<Segment> {
        self.decode(piece);
        let end = self.raw.is_empty().then_some(self.decoded);
        self.pending.push_back((token, end));
        self.run(false)
    }

    /// End of generation: flush everything held back (a marker prefix as text, an incomplete
    /// UTF-8 character lossily when the turn ends, not at all at a cut). When the turn ends (`turn_ends`), an unclosed tool-call block
    /// becomes a `ParseFailure`; at a cut it stays open for [`OutputDecoder::resume`]. An
    /// unclosed thinking block is simply ended; [`OutputDecoder::channel`] still says 1 after it.
    pub fn finish(&mut self, turn_ends: bool) -> Vec<Segment> {
        if !self.raw.is_empty() {
            if turn_ends {
                let text = String::from_utf8_lossy(&self.raw).into_owned();
                self.buf.push_str(&text);
                self.decoded += text.len();
            }
            // At a cut the bytes of a character not yet complete are no
            // text: the continuation, replaying this turn's tokens, completes
            // the character. The tokens waiting on it end before it.
            self.raw.clear();
            for (_, e) in self.pending.iter_mut().filter(|(_, e)| e.is_none()) {
                *e = Some(self.decoded);
            }
        }
        let mut out = self.run(true);
        if self.channel == Channel::ToolCall && turn_ends {
            out.push(Segment::ParseFailure {
                text: std::mem::take(&mut self.tool_block),
                error: ToolCallError::NotClosed.to_string(),
            });
        }
        out
    }

    /// Decode `piece` (after any held incomplete character) into `buf`, resolving the end of
    /// tokens that were waiting for their character to complete.
    fn decode(&mut self, piece: &[u8]) {
        let had_pending = !self.raw.is_empty();
        self.raw.extend_from_slice(piece);
        let mut text = String::new();
        let mut at = 0;
        loop {
            match std::str::from_utf8(&self.raw[at..]) {
                Ok(s) => {
                    text.push_str(s);
                    at = self.raw.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&self.raw[at..at + valid]));
                    match e.error_len() {
                        Some(n) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            at += valid + n;
                        }
                        None => {
                            at += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.raw.drain(..at);
        if had_pending {
            if let Some(c) = text.chars().next() {
                // The held bytes completed (or were replaced) as the first character decoded:
                // the tokens waiting on it end there.
                let end = self.decoded + c.len_utf8();
                for (_, e) in self.pending.iter_mut().filter(|(_, e)| e.is_none()) {
                    *e = Some(end);
                }
            }
        }
        self.buf.push_str(&text);
        self.decoded += text.len();
    }

    /// The markers recognised on the current channel.
    fn active(&self) -> Vec<(&str, Action)> {
        let mut v = Vec::new();
        match self.channel {
            Channel::Text => {
                if let Some((open, _)) = &self.markers.think {
                    v.push((open.as_str(), Action::Open(Channel::Reasoning)));
                }
                if let Some((open, _)) = &self.markers.tool_call {
                    v.push((open.as_str(), Action::Open(Channel::ToolCall)));
                }
            }
            Channel::Reasoning => {
                if let Some((_, close)) = &self.markers.think {
                    v.push((close.as_str(), Action::Close));
                }
            }
            _ => {
                if let Some((_, close)) = &self.markers.tool_call {
                    v.push((close.as_str(), Action::Close));
                }
            }
        }
        v.retain(|(m, _)| !m.is_empty());
        v
    }

    /// Scan `buf` for markers, emit what is certain, attribute tokens.
    fn run(&mut self, finishing: bool) -> Vec<Segment> {
        let start = self.base;
        let mut pieces: Vec<Scanned> = Vec::new();
        loop {
            let found = {
                let active = self.active();
                let mut best: Option<(usize, usize, Action)> = None;
                for (m, action) in &active {
                    if let Some(pos) = self.buf.find(m) {
                        let better = match best {
                            None => true,
                            Some((p, len, _)) => pos < p || (pos == p && m.len() > len),
                        };
                        if better {
                            best = Some((pos, m.len(), *action));
                        }
                    }
                }
                match best {
                    Some(b) => Ok(b),
                    None if finishing => Err(0),
                    None => Err(held_len(&self.buf, active.iter().map(|(m, _)| *m))),
                }
            };
            match found {
                Ok((pos, len, action)) => {
                    let before = self.buf[..pos].to_owned();
                    let marker = self.buf[pos..pos + len].to_owned();
                    self.buf.drain(..pos + len);
                    self.emit(&mut pieces, self.channel, &before);
                    match action {
                        Action::Open(ch) => {
                            self.channel = ch;
                            if ch == Channel::ToolCall {
                                self.tool_block.clear();
                            }
                            self.emit(&mut pieces, ch, &marker);
                        }
                        Action::Close => {
                            let ch = self.channel;
                            self.emit(&mut pieces, ch, &marker);
                            if ch == Channel::ToolCall {
                                let block = std::mem::take(&mut self.tool_block);
                                pieces.push(Scanned::Event(self.parse_block(block)));
                            }
                            self.channel = Channel::Text;
                        }
                    }
                }
                Err(hold) => {
                    let cut = self.buf.len() - hold;
                    let text: String = self.buf.drain(..cut).collect();
                    self.emit(&mut pieces, self.channel, &text);
                    break;
                }
            }
        }
        self.attribute(&mut pieces, start);
        pieces
            .into_iter()
            .filter_map(|p| match p {
                Scanned::Text {
                    channel,
                    text,
                    tokens,
                    ..
                } if !(text.is_empty() && tokens.is_empty()) => Some(Segment::Text {
                    channel,
                    text,
                    tokens,
                }),
                Scanned::Text { .. } => None,
                Scanned::Event(s) => Some(s),
            })
            .collect()
    }

    /// Append `text` on `channel` to `pieces` (merging with a preceding text piece on the same
    /// channel) and advance `base`.
    fn emit(&mut self, pieces: &mut Vec<Scanned>, channel: Channel, text: &str) {
        if text.is_empty() {
            return;
        }
        let start = self.base;
        self.base += text.len();
        if channel == Channel::ToolCall {
            self.tool_block.push_str(text);
        }
        // What an earlier part of the turn committed is not emitted again (`replayed` is a
        // character boundary of the decoded text, so of `text` too).
        let text = &text[self.replayed.saturating_sub(start).min(text.len())..];
        if text.is_empty() {
            return;
        }
        if let Some(Scanned::Text {
            channel: c,
            text: t,
            end,
            ..
        }) = pieces.last_mut()
        {
            if *c == channel {
                t.push_str(text);
                *end = self.base;
                return;
            }
        }
        pieces.push(Scanned::Text {
            channel,
            text: text.to_owned(),
            end: self.base,
            tokens: Vec::new(),
        });
    }

    /// Give each pending token whose last byte has been emitted to the text piece holding that
    /// byte. `start` is where this call's text began.
    fn attribute(&mut self, pieces: &mut Vec<Scanned>, start: usize) {
        while let Some(&(token, Some(end))) = self.pending.front() {
            if end > self.base {
                break;
            }
            self.pending.pop_front();
            let holder = if end > start {
                pieces.iter_mut().find_map(|p| match p {
                    Scanned::Text {
                        text,
                        end: e,
                        tokens,
                        ..
                    } if *e - text.len() < end && end <= *e => Some(tokens),
                    _ => None,
                })
            } else {
                None
            };
            match holder {
                Some(tokens) => tokens.push(token),
                None => {
                    // An empty piece with nothing held back: its own empty segment (or the one
                    // made for the previous such token).
                    match pieces.last_mut() {
                        Some(Scanned::Text {
                            channel,
                            text,
                            tokens,
                            ..
                        }) if text.is_empty() && *channel == self.channel => tokens.push(token),
                        _ => pieces.push(Scanned::Text {
                            channel: self.channel,
                            text: String::new(),
                            end: self.base,
                            tokens: vec![token],
                        }),
                    }
                }
            }
        }
    }

    /// Parse a closed tool-call block (markers included).
    fn parse_block(&self, block: String) -> Segment {
        let (open, close) = self
            .markers
            .tool_call
            .as_ref()
            .map(|(o, c)| (o.len(), c.len()))
            .unwrap_or((0, 0));
        let body = &block[open.min(block.len())..block.len().saturating_sub(close).max(open)];
        match parse_tool_call(body) {
            Ok((name, arguments)) => Segment::ToolCall { name, arguments },
            Err(error) => Segment::ParseFailure {
                text: block,
                error: error.to_string(),
            },
        }
    }
}

/// The length of the longest suffix of `buf` that is a proper prefix of one of `markers`.
fn held_len<'a>(buf: &str, markers: impl Iterator<Item = &'a str>) -> usize {
    let b = buf.as_bytes();
    let mut best = 0;
    for m in markers {
        let m = m.as_bytes();
        let max = (m.len().saturating_sub(1)).min(b.len());
        for n in (best + 1..=max).rev() {
            // A marker's prefix starts at a character boundary, so the cut is one too.
            if b.ends_with(&m[..n]) {
                best = n;
                break;
            }
        }
    }
    best
}

/// Why a tool-call block did not parse. Its text is the `error` of the
/// `ToolParseFailure` the log records.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolCallError {
    #[error("not valid JSON: {0}")]
    NotJson(String),
    #[error("the tool call is not a JSON object")]
    NotAnObject,
    #[error("the tool call's \"name\" is empty")]
    EmptyName,
    #[error("the tool call's \"name\" is not a string")]
    NameNotAString,
    #[error("the tool call has no \"name\"")]
    NoName,
    #[error("the tool call's arguments are a string that is not JSON: {0}")]
    ArgumentsNotJson(String),
    #[error("{0}")]
    Encode(String),
    #[error("the tool call was not closed before the end of generation")]
    NotClosed,
}

/// Parse a tool-call body `{"name": ..., "arguments": ...}` into the name and compact JSON
/// arguments.
pub fn parse_tool_call(body: &str) -> Result<(String, String), ToolCallError> {
    let value: Json =
        serde_json::from_str(body.trim()).map_err(|e| ToolCallError::NotJson(e.to_string()))?;
    let obj = value.as_object().ok_or(ToolCallError::NotAnObject)?;
    let name = match obj.get("name") {
        Some(Json::String(n)) if !n.is_empty() => n.clone(),
        Some(Json::String(_)) => return Err(ToolCallError::EmptyName),
        Some(_) => return Err(ToolCallError::NameNotAString),
        None => return Err(ToolCallError::NoName),
    };
    let args = obj.get("arguments").or_else(|| obj.get("parameters"));
    let args = match args {
        None | Some(Json::Null) => Json::Object(Default::default()),
        Some(Json::String(s)) => {
            serde_json::from_str(s).map_err(|e| ToolCallError::ArgumentsNotJson(e.to_string()))?
        }
        Some(v) => v.clone(),
    };
    let arguments =
        serde_json::to_string(&args).map_err(|e| ToolCallError::Encode(e.to_string()))?;
    Ok((name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Push `pieces` as tokens 0, 1, 2, ... then finish; all segments.
    fn run_with(markers: Markers, reasoning: bool, pieces: &[&[u8]]) -> Vec<Segment> {
        let mut d = OutputDecoder::new(markers, reasoning);
        let mut out = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            out.extend(d.push(i as u32, p));
        }
        out.extend(d.finish(true));
        out
    }

    fn run(pieces: &[&str]) -> Vec<Segment> {
        let pieces: Vec<&[u8]> = pieces.iter().map(|p| p.as_bytes()).collect();
        run_with(Markers::qwen(), false, &pieces)
    }

    /// The text of each channel, concatenated.
    fn channels(segs: &[Segment]) -> [String; 3] {
        let mut out: [String; 3] = Default::default();
        for s in segs {
            if let Segment::Text { channel, text, .. } = s {
                out[*channel as usize].push_str(text);
            }
        }
        out
    }

    fn all_text(segs: &[Segment]) -> String {
        segs.iter()
            .filter_map(|s| match s {
                Segment::Text { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    fn all_tokens(segs: &[Segment]) -> Vec<u32> {
        segs.iter()
            .flat_map(|s| match s {
                Segment::Text { tokens, .. } => tokens.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// (channel, token) for every token.
    fn token_channels(segs: &[Segment]) -> Vec<(u8, u32)> {
        segs.iter()
            .flat_map(|s| match s {
                Segment::Text {
                    channel, tokens, ..
                } => tokens.iter().map(|&t| (u8::from(*channel), t)).collect(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn events(segs: &[Segment]) -> Vec<Segment> {
        segs.iter()
            .filter(|s| !matches!(s, Segment::Text { .. }))
            .cloned()
            .collect()
    }

    /// The channel of every byte of the output.
    fn byte_channels(segs: &[Segment]) -> Vec<u8> {
        segs.iter()
            .flat_map(|s| match s {
                Segment::Text { channel, text, .. } => vec![u8::from(*channel); text.len()],
                _ => Vec::new(),
            })
            .collect()
    }

    /// Check the invariants: text reproduced, tokens 0..n each once in order.
    fn check(segs: &[Segment], text: &str, n: usize) {
        assert_eq!(all_text(segs), text);
        assert_eq!(all_tokens(segs), (0..n as u32).collect::<Vec<_>>());
    }

    fn call(name: &str, arguments: &str) -> Segment {
        Segment::ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn plain_text() {
        let segs = run(&["Hello", ",", " world", "!"]);
        check(&segs, "Hello, world!", 4);
        assert!(segs.iter().all(|s| matches!(
            s,
            Segment::Text {
                channel: Channel::Text,
                ..
            }
        )));
        // No marker prefix: every push comes out at once.
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        assert_eq!(
            d.push(7, b"Hi"),
            vec![Segment::Text {
                channel: Channel::Text,
                text: "Hi".into(),
                tokens: vec![7]
            }]
        );
        assert!(d.finish(true).is_empty());
    }

    #[test]
    fn no_markers_everything_is_text() {
        let text = "<think>a</think><tool_call>{}</tool_call>";
        let segs = run_with(Markers::none(), false, &[text.as_bytes()]);
        check(&segs, text, 1);
        assert_eq!(channels(&segs)[0], text);
    }

    #[test]
    fn think_then_answer() {
        let segs = run(&[
            "<think>", "\n", "Let me", " think.", "\n", "</think>", "\n\n", "Paris", ".",
        ]);
        check(&segs, "<think>\nLet me think.\n</think>\n\nParis.", 9);
        let [t, r, c] = channels(&segs);
        assert_eq!(r, "<think>\nLet me think.\n</think>");
        assert_eq!(t, "\n\nParis.");
        assert_eq!(c, "");
        let tc = token_channels(&segs);
        assert_eq!(
            tc[0],
            (1, 0),
            "the opening marker's token is on the reasoning channel"
        );
        assert_eq!(
            tc[5],
            (1, 5),
            "the closing marker's token is on the channel it closes"
        );
        assert_eq!(tc[6], (0, 6), "whitespace after </think> is on channel 0");
    }

    #[test]
    fn one_token_across_a_marker() {
        // "so</think>\n\nHi" in one token: the token ends on channel 0.
        let segs = run(&["<think>", "so</think>\n\nHi"]);
        check(&segs, "<think>so</think>\n\nHi", 2);
        assert_eq!(
            segs,
            vec![
                Segment::Text {
                    channel: Channel::Reasoning,
                    text: "<think>".into(),
                    tokens: vec![0]
                },
                Segment::Text {
                    channel: Channel::Reasoning,
                    text: "so</think>".into(),
                    tokens: vec![]
                },
                Segment::Text {
                    channel: Channel::Text,
                    text: "\n\nHi".into(),
                    tokens: vec![1]
                },
            ]
        );
    }

    #[test]
    fn channel_reports_where_text_goes() {
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        assert_eq!(u8::from(d.channel()), 0);
        d.push(0, b"<think>");
        assert_eq!(u8::from(d.channel()), 1);
        d.push(1, b"hm</think>");
        assert_eq!(u8::from(d.channel()), 0);
        d.push(2, b"<tool_call>");
        assert_eq!(u8::from(d.channel()), 2);
        d.push(3, br#"{"name":"f"}</tool_call>"#);
        assert_eq!(u8::from(d.channel()), 0);
    }

    #[test]
    fn tool_call_parsed() {
        let text = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
        let segs = run(&[
            "I'll check.\n",
            "<tool_call>",
            "\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n",
            "</tool_call>",
        ]);
        check(&segs, text, 5);
        assert_eq!(
            events(&segs),
            vec![call("get_weather", r#"{"city":"Paris","days":2}"#)]
        );
        let [t, _, c] = channels(&segs);
        assert_eq!(t, "I'll check.\n");
        assert!(c.starts_with("<tool_call>") && c.ends_with("</tool_call>"));
        // The ToolCall comes right after the text holding the closing marker.
        let pos = segs
            .iter()
            .position(|s| matches!(s, Segment::ToolCall { .. }))
            .unwrap();
        assert!(
            matches!(&segs[pos - 1], Segment::Text { channel: Channel::ToolCall, text, .. } if text.ends_with("</tool_call>"))
        );
    }

    #[test]
    fn tool_call_argument_order_and_text_after() {
        let text = r#"<tool_call>{"name":"f","arguments":{"z":1,"a":[1, 2]}}</tool_call>
<tool_call>{"name":"g","arguments":{}}</tool_call> done"#;
        let segs = run(&[text]);
        check(&segs, text, 1);
        assert_eq!(
            events(&segs),
            vec![call("f", r#"{"z":1,"a":[1,2]}"#), call("g", "{}")]
        );
        assert_eq!(channels(&segs)[0], "\n done");
    }

    #[test]
    fn tool_call_with_parameters() {
        let segs =
            run(&[r#"<tool_call>{"name": "search", "parameters": {"q": "rust"}}</tool_call>"#]);
        assert_eq!(events(&segs), vec![call("search", r#"{"q":"rust"}"#)]);
    }

    #[test]
    fn tool_call_arguments_as_string_or_missing() {
        let segs = run(&[r#"<tool_call>{"name": "f", "arguments": "{\"x\": 1}"}</tool_call>"#]);
        assert_eq!(events(&segs), vec![call("f", r#"{"x":1}"#)]);
        let segs = run(&[r#"<tool_call>{"name": "now"}</tool_call>"#]);
        assert_eq!(events(&segs), vec![call("now", "{}")]);
    }

    #[test]
    fn malformed_tool_calls_are_parse_failures() {
        for body in [
            r#"{"name": "f", "arguments": {"x": }"#,
            r#"not json"#,
            r#"{"arguments": {}}"#,
            r#"{"name": 3}"#,
            r#"["f"]"#,
            r#"{"name": "f", "arguments": "not json"}"#,
        ] {
            let block = format!("<tool_call>{body}</tool_call>");
            let text = format!("{block}after");
            let segs = run(&[&text]);
            check(&segs, &text, 1);
            match &events(&segs)[..] {
                [Segment::ParseFailure { text: t, error }] => {
                    assert_eq!(t, &block);
                    assert!(!error.is_empty());
                }
                other => panic!("{body}: {other:?}"),
            }
            assert_eq!(channels(&segs)[0], "after");
        }
    }

    /// A text using every marker, with multibyte characters around them.
    const FULL: &str = "<think>\nhmm é </think>\n\nOK 日本 <tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"😀\"}}\n</tool_call> bye";

    fn expected_full() -> (Vec<u8>, Vec<Segment>) {
        let segs = run(&[FULL]);
        (byte_channels(&segs), events(&segs))
    }

    #[test]
    fn full_text_in_one_piece() {
        let segs = run(&[FULL]);
        check(&segs, FULL, 1);
        let [t, r, c] = channels(&segs);
        assert_eq!(r, "<think>\nhmm é </think>");
        assert_eq!(t, "\n\nOK 日本  bye");
        assert_eq!(
            c,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"😀\"}}\n</tool_call>"
        );
        assert_eq!(events(&segs), vec![call("f", r#"{"s":"😀"}"#)]);
    }

    #[test]
    fn every_marker_split_at_every_byte() {
        let (want_channels, want_events) = expected_full();
        for marker in ["<think>", "</think>", "<tool_call>", "</tool_call>"] {
            let at = FULL.find(marker).unwrap();
            for k in 1..marker.len() {
                // Three tokens: up to the middle of the marker, the rest of it, the tail.
                let cut = at + k;
                let end = at + marker.len();
                let pieces = [
                    &FULL.as_bytes()[..cut],
                    &FULL.as_bytes()[cut..end],
                    &FULL.as_bytes()[end..],
                ];
                let segs = run_with(Markers::qwen(), false, &pieces);
                check(&segs, FULL, 3);
                assert_eq!(byte_channels(&segs), want_channels, "{marker} split at {k}");
                assert_eq!(events(&segs), want_events, "{marker} split at {k}");
                // The marker's token is on the marker's channel.
                let want = if marker.contains("think") {
                    Channel::Reasoning
                } else {
                    Channel::ToolCall
                };
                assert_eq!(
                    token_channels(&segs)[1],
                    (u8::from(want), 1),
                    "{marker} split at {k}"
                );
            }
            // Also one byte per token through the whole marker.
            let mut pieces: Vec<&[u8]> = vec![&FULL.as_bytes()[..at]];
            pieces.extend((at..at + marker.len()).map(|i| &FULL.as_bytes()[i..i + 1]));
            pieces.push(&FULL.as_bytes()[at + marker.len()..]);
            let segs = run_with(Markers::qwen(), false, &pieces);
            check(&segs, FULL, pieces.len());
            assert_eq!(byte_channels(&segs), want_channels, "{marker} byte by byte");
        }
    }

    #[test]
    fn marker_prefix_is_held_back_until_settled() {
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        assert_eq!(
            d.push(0, b"a <thi"),
            vec![Segment::Text {
                channel: Channel::Text,
                text: "a ".into(),
                tokens: vec![]
            }]
        );
        assert_eq!(
            d.push(1, b"nk>b"),
            vec![Segment::Text {
                channel: Channel::Reasoning,
                text: "<think>b".into(),
                tokens: vec![0, 1]
            }]
        );
        // A settled non-marker comes out as text.
        assert!(d
            .push(2, b" </thi")
            .iter()
            .all(|s| !matches!(s, Segment::Text { text, .. } if text.contains('<'))));
        assert_eq!(
            d.push(3, b"s"),
            vec![Segment::Text {
                channel: Channel::Reasoning,
                text: "</this".into(),
                tokens: vec![2, 3]
            }]
        );
    }

    #[test]
    fn marker_like_text_stays_text() {
        let segs = run(&[
            "<thin",
            "g>",
            " and <tool",
            "box> and </think> and <",
            "/tool_call>",
        ]);
        let text = "<thing> and <toolbox> and </think> and </tool_call>";
        check(&segs, text, 5);
        assert_eq!(channels(&segs)[0], text);
        assert!(events(&segs).is_empty());
        // A prefix held at the end is flushed as text.
        let segs = run(&["x <tool_ca"]);
        check(&segs, "x <tool_ca", 1);
        assert_eq!(channels(&segs)[0], "x <tool_ca");
    }

    #[test]
    fn tool_call_inside_reasoning_is_reasoning() {
        let text = "<think>maybe <tool_call>{\"name\":\"f\"}</tool_call>?</think>no";
        let segs = run(&[text]);
        check(&segs, text, 1);
        assert!(events(&segs).is_empty());
        assert_eq!(channels(&segs)[0], "no");
    }

    #[test]
    fn utf8_split_at_every_byte() {
        for s in ["é", "日本", "😀", "a😀b", "👩‍💻"] {
            let text = format!("<think>{s}</think>{s}");
            let bytes = text.as_bytes();
            for cut in 1..bytes.len() {
                let segs = run_with(Markers::qwen(), false, &[&bytes[..cut], &bytes[cut..]]);
                check(&segs, &text, 2);
                let [t, r, _] = channels(&segs);
                assert_eq!(r, format!("<think>{s}</think>"), "{s} cut at {cut}");
                assert_eq!(t, *s, "{s} cut at {cut}");
            }
            // One byte per token.
            let pieces: Vec<&[u8]> = (0..bytes.len()).map(|i| &bytes[i..i + 1]).collect();
            let segs = run_with(Markers::qwen(), false, &pieces);
            check(&segs, &text, pieces.len());
        }
    }

    #[test]
    fn incomplete_char_is_held_then_attributed_where_it_ends() {
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        assert!(d.push(0, &"日".as_bytes()[..1]).is_empty());
        assert!(d.push(1, &"日".as_bytes()[1..2]).is_empty());
        // The third byte completes the character, and a marker follows in the same token.
        let mut piece = "日".as_bytes()[2..].to_vec();
        piece.extend_from_slice(b"<think>x");
        let segs = d.push(2, &piece);
        assert_eq!(
            segs,
            vec![
                Segment::Text {
                    channel: Channel::Text,
                    text: "日".into(),
                    tokens: vec![0, 1]
                },
                Segment::Text {
                    channel: Channel::Reasoning,
                    text: "<think>x".into(),
                    tokens: vec![2]
                },
            ]
        );
    }

    #[test]
    fn invalid_utf8_is_flushed_lossily() {
        // An incomplete character at the end.
        let segs = run_with(Markers::qwen(), false, &[b"ok", &"😀".as_bytes()[..2]]);
        check(&segs, "ok\u{FFFD}", 2);
        // An invalid byte in the middle.
        let segs = run_with(Markers::qwen(), false, &[b"a\xFFb", b"c"]);
        check(&segs, "a\u{FFFD}bc", 2);
        // A broken character followed by text in the next piece.
        let segs = run_with(Markers::qwen(), false, &[b"\xE6", b"A"]);
        check(&segs, "\u{FFFD}A", 2);
    }

    #[test]
    fn a_cut_inside_a_character_leaves_it_out() {
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        let mut segs = d.push(0, b"ok");
        segs.extend(d.push(1, &"😀".as_bytes()[..2]));
        segs.extend(d.finish(false));
        // No U+FFFD; token 1 still appears, in a segment before the character.
        check(&segs, "ok", 2);
    }

    #[test]
    fn empty_pieces_still_get_a_segment() {
        let segs = run(&["a", "", "b", ""]);
        check(&segs, "ab", 4);
        // Empty piece while a prefix is held: attributed with the held text.
        let segs = run(&["<thi", "", "nk>x"]);
        check(&segs, "<think>x", 3);
        assert_eq!(token_channels(&segs), vec![(1, 0), (1, 1), (1, 2)]);
    }

    #[test]
    fn start_in_reasoning() {
        let segs = run_with(
            Markers::qwen(),
            true,
            &[b"still thinking", b"</think>", b"\nAnswer"],
        );
        check(&segs, "still thinking</think>\nAnswer", 3);
        let [t, r, _] = channels(&segs);
        assert_eq!(r, "still thinking</think>");
        assert_eq!(t, "\nAnswer");
    }

    #[test]
    fn finish_with_unclosed_think() {
        let mut d = OutputDecoder::new(Markers::qwen(), false);
        let mut segs = d.push(0, b"<think>cut here </thi");
        segs.extend(d.finish(true));
        check(&segs, "<think>cut here </thi", 1);
        assert_eq!(channels(&segs)[1], "<think>cut here </thi");
        assert!(events(&segs).is_empty());
        assert_eq!(
            u8::from(d.channel()),
            1,
            "a continuation starts in reasoning"
        );
    }

    #[test]
    fn finish_with_unclosed_tool_call() {
        let text = "sure <tool_call>{\"name\": \"f\", \"argu";
        let segs = run(&["sure ", "<tool_call>", "{\"name\": \"f\", \"argu"]);
        check(&segs, text, 3);
        match &events(&segs)[..] {
            [Segment::ParseFailure { text, error }] => {
                assert_eq!(text, "<tool_call>{\"name\": \"f\", \"argu");
                assert_eq!(error, &ToolCallError::NotClosed.to_string());
            }
            other => panic!("{other:?}"),
        }
        // Even a complete body is a failure without its closing marker.
        let segs = run(&["<tool_call>{\"name\": \"f\"}</tool_"]);
        assert!(matches!(&events(&segs)[..], [Segment::ParseFailure { .. }]));
    }

    #[test]
    fn markers_from_template() {
        assert_eq!(Markers::from_template("{{ messages }}"), Markers::none());
        // A template that does not declare tools gets them declared for it
        // in the Hermes form once there are tools, and parsed.
        let hermes = Some(("<tool_call>".into(), "</tool_call>".into()));
        let plain = Markers::from_template("{{ messages }}");
        assert_eq!(plain.clone().with_tools(false).tool_call, None);
        assert_eq!(plain.with_tools(true).tool_call, hermes);
        let m = Markers::from_template("{{ '<think>\\n' }}");
        assert_eq!(m.think, Some(("<think>".into(), "</think>".into())));
        assert_eq!(m.tool_call, None);
        let m = Markers::from_template("{% if tools %}{% endif %}");
        assert_eq!(m.think, None);
        assert_eq!(
            m.tool_call,
            Some(("<tool_call>".into(), "</tool_call>".into()))
        );
        assert_eq!(
            Markers::from_template("<tool_call><think>"),
            Markers::qwen()
        );
    }

    #[test]
    fn parse_tool_call_direct() {
        assert_eq!(
            parse_tool_call(" {\"name\": \"a\", \"arguments\": {\"k\": [1, {\"x\": null}]}} "),
            Ok(("a".into(), r#"{"k":[1,{"x":null}]}"#.into()))
        );
        assert_eq!(
            parse_tool_call("{\"name\": \"\"}"),
            Err(ToolCallError::EmptyName)
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        #[test]
        fn prop_random_splits(cuts in proptest::collection::btree_set(1usize..FULL.len(), 0..30), reasoning in proptest::prelude::any::<bool>()) {
            let bytes = FULL.as_bytes();
            let mut bounds = vec![0];
            bounds.extend(cuts.iter().copied());
            bounds.push(bytes.len());
            let pieces: Vec<&[u8]> = bounds.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
            let whole = run_with(Markers::qwen(), reasoning, &[bytes]);
            let segs = run_with(Markers::qwen(), reasoning, &pieces);
            proptest::prop_assert_eq!(all_text(&segs), FULL);
            proptest::prop_assert_eq!(all_tokens(&segs), (0..pieces.len() as u32).collect::<Vec<_>>());
            proptest::prop_assert_eq!(byte_channels(&segs), byte_channels(&whole));
            proptest::prop_assert_eq!(events(&segs), events(&whole));
            // Each token is on the channel of its last byte.
            let chans = byte_channels(&whole);
            let want: Vec<(u8, u32)> = bounds[1..].iter().enumerate().map(|(i, &end)| (chans[end - 1], i as u32)).collect();
            let got = token_channels(&segs);
            // A token ending inside a multibyte character ends where the character ends, on the
            // same channel as its last byte, so the channels agree.
            proptest::prop_assert_eq!(got, want);
        }
    }

    /// A turn cut after every token and continued with `resume`: together the two parts commit
    /// the whole text and every token once, and a tool call or marker split across the cut is
    /// recognised (one ToolCall, no ParseFailure), with the reasoning on channel 1.
    #[test]
    fn a_turn_cut_anywhere_and_resumed_decodes_as_the_uncut_one() {
        let pieces: Vec<&[u8]> = vec![
            b"<th",
            b"ink>",
            b"hm",
            b"m</",
            b"think>",
            b"\n\n",
            b"Sure. ",
            b"<tool",
            b"_call",
            b">\n{\"na",
            b"me\": \"f\", ",
            b"\"arguments\": {\"x\": \"",
            b"\xc3",
            b"\xa9",
            b"1\"}}\n</tool",
            b"_call>",
            b" done",
        ];
        let whole = run_with(Markers::qwen(), false, &pieces);
        let events = |segs: &[Segment]| -> Vec<Segment> {
            segs.iter()
                .filter(|s| !matches!(s, Segment::Text { .. }))
                .cloned()
                .collect()
        };
        assert_eq!(events(&whole).len(), 1);
        assert!(matches!(&events(&whole)[0], Segment::ToolCall { name, .. } if name == "f"));
        let tokens = |segs: &[Segment]| -> Vec<u32> {
            segs.iter()
                .flat_map(|s| match s {
                    Segment::Text { tokens, .. } => tokens.clone(),
                    _ => vec![],
                })
                .collect()
        };
        for cut in 1..pieces.len() {
            let mut first = OutputDecoder::new(Markers::qwen(), false);
            let mut out = Vec::new();
            for (i, p) in pieces[..cut].iter().enumerate() {
                out.extend(first.push(i as u32, p));
            }
            out.extend(first.finish(false));
            let so_far: Vec<(u32, Vec<u8>)> = pieces[..cut]
                .iter()
                .enumerate()
                .map(|(i, p)| (i as u32, p.to_vec()))
                .collect();
            let mut rest = OutputDecoder::resume(Markers::qwen(), false, &so_far);
            for (i, p) in pieces.iter().enumerate().skip(cut) {
                out.extend(rest.push(i as u32, p));
            }
            out.extend(rest.finish(true));
            assert_eq!(events(&out), events(&whole), "cut after {cut}");
            assert_eq!(
                tokens(&out),
                (0..pieces.len() as u32).collect::<Vec<_>>(),
                "cut after {cut}"
            );
            // The text, also for a character cut in half (cut 13): the
            // first part leaves it out, the rest commits it whole.
            assert_eq!(all_text(&out), all_text(&whole), "cut after {cut}");
            // Channels too, unless the cut fell inside a marker: the first part then committed
            // the marker's start as text of the channel it was on.
            if ![1, 4, 8, 9, 13, 15].contains(&cut) {
                assert_eq!(channels(&out), channels(&whole), "cut after {cut}");
            }
        }
    }
}
