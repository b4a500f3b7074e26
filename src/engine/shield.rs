//! Control-token text inside what clients write never becomes a control token.
//!
//! A chat template's output is tokenized with special tokens parsed, because the template's own
//! text (`<|im_start|>`, `<|eot_id|>`, ...) must become control tokens. Text a client wrote
//! (message content, tool definitions) flows through the same template, and a template may trim,
//! repeat or otherwise transform it, so it cannot always be cut back out of the rendering. The
//! [`Shield`] makes that safe on every path: before rendering, each occurrence of a control
//! token's text in client text is swapped for a marker (`@@<nonce digits>-<k>@@`: digits, `@`
//! and `-` only, which trimming, case changes and escaping leave alone); after rendering,
//! [`Shield::tokenize`] parses specials in the template's text and tokenizes each marker's
//! original text as plain text.

use std::borrow::Cow;

use serde_json::Value as Json;

use super::template::ChatMessage;
use super::vocab::Vocab;
use crate::wire::Token;

/// Markers for the control-token texts found in one rendering's inputs.
#[derive(Debug)]
pub struct Shield<'v> {
    vocab: &'v Vocab,
    /// `@@<20 digits>-`: what every marker of this shield starts with.
    prefix: String,
    /// The original text of marker `k`.
    originals: Vec<String>,
}

impl<'v> Shield<'v> {
    /// An empty shield for a rendering with `vocab`.
    pub fn new(vocab: &'v Vocab) -> Shield<'v> {
        let mut nonce = [0u8; 8];
        // A fixed nonce still works: the markers only need to differ from the template's text.
        let _ = getrandom::fill(&mut nonce);
        Shield {
            vocab,
            prefix: format!("@@{:020}-", u64::from_le_bytes(nonce)),
            originals: Vec::new(),
        }
    }

    /// Whether any text was covered (when not, [`Shield::tokenize`] is a plain tokenize).
    pub fn is_empty(&self) -> bool {
        self.originals.is_empty()
    }

    /// `text` with each control token's text replaced by a marker; borrowed when it has none.
    pub fn cover<'t>(&mut self, text: &'t str) -> Cow<'t, str> {
        let Some(ac) = self.vocab.control_matcher() else {
            return Cow::Borrowed(text);
        };
        let mut found = ac.find_iter(text).peekable();
        if found.peek().is_none() {
            return Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len() + 32);
        let mut last = 0;
        for m in found {
            out.push_str(&text[last..m.start()]);
            out.push_str(&self.prefix);
            out.push_str(&self.originals.len().to_string());
            out.push_str("@@");
            self.originals.push(text[m.start()..m.end()].to_owned());
            last = m.end();
        }
        out.push_str(&text[last..]);
        Cow::Owned(out)
    }

    /// `messages` with their contents covered.
    pub fn cover_messages<'m>(&mut self, messages: &'m [ChatMessage]) -> Cow<'m, [ChatMessage]> {
        let mut out: Option<Vec<ChatMessage>> = None;
        for (i, m) in messages.iter().enumerate() {
            if let Cow::Owned(content) = self.cover(&m.content) {
                let all = out.get_or_insert_with(|| messages.to_vec());
                all[i].content = content;
            }
        }
        out.map_or(Cow::Borrowed(messages), Cow::Owned)
    }

    /// One message with its content covered.
    pub fn cover_message<'m>(&mut self, message: &'m ChatMessage) -> Cow<'m, ChatMessage> {
        match self.cover(&message.content) {
            Cow::Borrowed(_) => Cow::Borrowed(message),
            Cow::Owned(content) => Cow::Owned(ChatMessage::new(message.role, content)),
        }
    }

    /// Tool definitions with every string in them (keys included) covered.
    pub fn cover_tools<'j>(&mut self, tools: &'j [Json]) -> Cow<'j, [Json]> {
        let mut out: Option<Vec<Json>> = None;
        for (i, t) in tools.iter().enumerate() {
            if let Some(covered) = self.cover_json(t) {
                out.get_or_insert_with(|| tools.to_vec())[i] = covered;
            }
        }
        out.map_or(Cow::Borrowed(tools), Cow::Owned)
    }

    /// `v` covered, or `None` when nothing in it needed covering.
    fn cover_json(&mut self, v: &Json) -> Option<Json> {
        match v {
            Json::String(s) => match self.cover(s) {
                Cow::Owned(c) => Some(Json::String(c)),
                Cow::Borrowed(_) => None,
            },
            Json::Array(items) => {
                let mut out: Option<Vec<Json>> = None;
                for (i, item) in items.iter().enumerate() {
                    if let Some(c) = self.cover_json(item) {
                        out.get_or_insert_with(|| items.clone())[i] = c;
                    }
                }
                out.map(Json::Array)
            }
            Json::Object(map) => {
                let mut changed = false;
                let mut out = serde_json::Map::with_capacity(map.len());
                for (k, item) in map {
                    let key = self.cover(k);
                    changed |= matches!(key, Cow::Owned(_));
                    let value = match self.cover_json(item) {
                        Some(c) => {
                            changed = true;
                            c
                        }
                        None => item.clone(),
                    };
                    out.insert(key.into_owned(), value);
                }
                changed.then_some(Json::Object(out))
            }
            _ => None,
        }
    }

    /// Tokenize a rendering: special tokens parsed in the template's text, each marker's original
    /// text tokenized as plain text.
    pub fn tokenize(&self, rendered: &str) -> Vec<Token> {
        if self.originals.is_empty() {
            return self.vocab.tokenize(rendered, true);
        }
        let mut tokens = Vec::new();
        let mut rest = rendered;
        while let Some(at) = rest.find(&self.prefix) {
            let after = &rest[at + self.prefix.len()..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            let marker = after[digits..]
                .starts_with("@@")
                .then(|| after[..digits].parse::<usize>().ok())
                .flatten()
                .and_then(|k| self.originals.get(k));
            match marker {
                Some(original) => {
                    tokens.extend(self.vocab.tokenize(&rest[..at], true));
                    tokens.extend(self.vocab.tokenize(original, false));
                    rest = &after[digits + 2..];
                }
                None => {
                    // Not one of ours (cannot come from a client: they never see the nonce).
                    let end = at + self.prefix.len();
                    tokens.extend(self.vocab.tokenize(&rest[..end], true));
                    rest = &rest[end..];
                }
            }
        }
        tokens.extend(self.vocab.tokenize(rest, true));
        tokens
    }
}
