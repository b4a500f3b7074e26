//! The model's vocabulary, loaded from a GGUF file without its weights (`vocab_only`).
//!
//! Every token id is checked against `n_vocab` before it is passed to llama.cpp: an out-of-range
//! id makes llama.cpp abort the whole process.

use std::path::Path;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use super::{backend, check_gguf, EngineError};
use crate::wire::Token;

/// The fill-in-the-middle control tokens of a model that has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimTokens {
    /// Precedes the text before the hole.
    pub pre: Token,
    /// Precedes the text after the hole.
    pub suf: Token,
    /// Asks for the middle.
    pub mid: Token,
}

/// A model's vocabulary and chat template (loaded with `vocab_only`, so no weights in memory).
///
/// `Send + Sync`: llama.cpp's vocabulary is immutable after load.
pub struct Vocab {
    model: LlamaModel,
    n_vocab: u32,
    chat_template: Option<String>,
    /// Finds control tokens' texts in client text (built on first use; see [`super::shield`]).
    control_matcher: std::sync::OnceLock<Option<aho_corasick::AhoCorasick>>,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("n_vocab", &self.n_vocab)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

/// SHA-256 of a model's vocabulary: its size, then every token's text
/// (control tokens as their text) in id order, each length-prefixed. Two
/// files whose digests differ do not give their ids the same meaning.
pub fn vocab_digest(model: &LlamaModel) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let vocab = model.vocab();
    let n = vocab.n_tokens().max(0);
    let mut h = Sha256::new();
    h.update(u64::from(n.unsigned_abs()).to_le_bytes());
    for t in 0..n {
        let piece = vocab.token_to_piece(LlamaToken(t), true, None);
        h.update((piece.len() as u64).to_le_bytes());
        h.update(&piece);
    }
    h.finalize().into()
}

impl Vocab {
    /// The digest of this vocabulary ([`vocab_digest`]).
    pub fn digest(&self) -> [u8; 32] {
        vocab_digest(&self.model)
    }

    /// Load the vocabulary of the GGUF model at `path`.
    ///
    /// The path must exist and start with the `GGUF` magic bytes; both are checked here, before
    /// llama.cpp sees the file, so a wrong path is an `Err`, never an abort.
    pub fn load(path: &Path) -> Result<Vocab, EngineError> {
        check_gguf(path)?;
        let backend = backend::backend()?;
        let params = LlamaModelParams::default().with_vocab_only(true);
        let model = LlamaModel::load_from_file(backend, path, &params).map_err(|e| {
            EngineError::ModelLoad {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        let n_vocab = u32::try_from(model.vocab().n_tokens()).unwrap_or(0);
        if n_vocab == 0 {
            return Err(EngineError::ModelLoad {
                path: path.to_path_buf(),
                reason: "the model has an empty vocabulary".to_owned(),
            });
        }
        let chat_template = model
            .chat_template(None)
            .ok()
            .and_then(|t| t.to_string().ok());
        Ok(Vocab {
            model,
            n_vocab,
            chat_template,
            control_matcher: std::sync::OnceLock::new(),
        })
    }

    /// The number of tokens in the vocabulary; valid ids are `0..n_vocab`.
    pub fn n_vocab(&self) -> u32 {
        self.n_vocab
    }

    /// Whether `t` is a token id of this vocabulary.
    pub fn is_valid(&self, t: Token) -> bool {
        t < self.n_vocab
    }

    /// `t` as llama.cpp's token type, or an error if it is out of range.
    fn llama_token(&self, t: Token) -> Result<LlamaToken, EngineError> {
        if self.is_valid(t) {
            // n_vocab came from an i32, so every valid id fits.
            Ok(LlamaToken(t as i32))
        } else {
            Err(EngineError::InvalidToken {
                token: t,
                n_vocab: self.n_vocab,
            })
        }
    }

    /// A llama.cpp token id (possibly `-1` for "none") as a valid [`Token`], if it is one.
    fn valid_from_llama(&self, t: LlamaToken) -> Option<Token> {
        u32::try_from(t.0).ok().filter(|&t| self.is_valid(t))
    }

    /// Tokenize `text`. Never adds BOS. With `parse_special`, the text of special/control tokens
    /// (e.g. `<|im_end|>`) becomes those tokens; without it, it is tokenized as plain text (use
    /// that for anything a user wrote).
    pub fn tokenize(&self, text: &str, parse_special: bool) -> Vec<Token> {
        if text.is_empty() {
            return Vec::new();
        }
        self.model
            .vocab()
            .tokenize(text.as_bytes(), false, parse_special)
            .into_iter()
            .map(|t| t.0 as Token)
            .collect()
    }

    /// The text of a span of tokens, control tokens rendered as their text (e.g. `<|im_end|>`).
    ///
    /// The bytes are decoded as UTF-8 once, at the end (lossily), so characters split across
    /// tokens come out whole. Ids outside the vocabulary are rendered as U+FFFD. For models with a
    /// space prefix (SentencePiece), llama.cpp drops the leading space of the first token, so
    /// `detokenize(tokenize(s)) == s`; use [`Vocab::piece`] to stream tokens one by one.
    pub fn detokenize(&self, span: &[Token]) -> String {
        let mut bytes = Vec::new();
        let vocab = self.model.vocab();
        for run in span.split_inclusive(|&t| !self.is_valid(t)) {
            let (valid, invalid) = match run.split_last() {
                Some((&last, rest)) if !self.is_valid(last) => (rest, true),
                _ => (run, false),
            };
            if !valid.is_empty() {
                let tokens: Vec<LlamaToken> = valid.iter().map(|&t| LlamaToken(t as i32)).collect();
                vocab.detokenize_into(&tokens, &mut bytes, false, true);
            }
            if invalid {
                bytes.extend_from_slice("\u{FFFD}".as_bytes());
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes of one token (control tokens as their text); may be part of a UTF-8 character.
    /// Empty for an invalid id.
    pub fn piece(&self, t: Token) -> Vec<u8> {
        match self.llama_token(t) {
            Ok(t) => self.model.vocab().token_to_piece(t, true, None),
            Err(_) => Vec::new(),
        }
    }

    /// The token's entry in the vocabulary as stored in the GGUF (e.g. `<|im_end|>`, or `Ġhello`
    /// for byte-level BPE), or `None` for an invalid id.
    pub fn token_text(&self, t: Token) -> Option<String> {
        let t = self.llama_token(t).ok()?;
        let vocab = self.model.vocab();
        vocab.text(t).map(|s| s.to_string_lossy().into_owned())
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<Token> {
        self.valid_from_llama(self.model.vocab().bos())
    }

    /// The end-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<Token> {
        self.valid_from_llama(self.model.vocab().eos())
    }

    /// Whether the model expects BOS at the start of its input (GGUF `tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.model.vocab().should_add_bos()
    }

    /// Whether `t` ends generation (EOS, EOT, ...). False for an invalid id.
    pub fn is_eog(&self, t: Token) -> bool {
        self.llama_token(t)
            .map(|t| self.model.vocab().is_eog(t))
            .unwrap_or(false)
    }

    /// Whether `t` is a control token. False for an invalid id.
    pub fn is_control(&self, t: Token) -> bool {
        self.llama_token(t)
            .map(|t| self.model.vocab().is_control(t))
            .unwrap_or(false)
    }

    /// A matcher for the texts of every control and unknown token (leftmost-longest), or `None`
    /// when the vocabulary has none with a text.
    pub fn control_matcher(&self) -> Option<&aho_corasick::AhoCorasick> {
        self.control_matcher
            .get_or_init(|| {
                // What llama.cpp parses as a special token when asked to:
                // CONTROL and UNKNOWN tokens. (USER_DEFINED ones it parses
                // in any text, as the model's reference tokenizer does with
                // its non-special added tokens: they are text by design.)
                let special = |t: Token| {
                    self.is_control(t)
                        || self.llama_token(t).is_ok_and(|lt| {
                            self.model
                                .vocab()
                                .attr(lt)
                                .contains(llama_cpp_2::token_type::LlamaTokenAttr::Unknown)
                        })
                };
                let texts: Vec<String> = (0..self.n_vocab)
                    .filter(|&t| special(t))
                    .filter_map(|t| self.token_text(t))
                    .filter(|s| !s.is_empty())
                    .collect();
                if texts.is_empty() {
                    return None;
                }
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&texts)
                    .map_err(|e| log::error!("cannot index the control tokens' texts: {e}"))
                    .ok()
            })
            .as_ref()
    }

    /// The Jinja chat template of the GGUF (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        self.chat_template.clone()
    }

    /// The fill-in-the-middle tokens, or `None` unless the model has all three.
    pub fn fim(&self) -> Option<FimTokens> {
        let vocab = self.model.vocab();
        Some(FimTokens {
            pre: self.valid_from_llama(vocab.fim_pre())?,
            suf: self.valid_from_llama(vocab.fim_suf())?,
            mid: self.valid_from_llama(vocab.fim_mid())?,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::{Arc, OnceLock};

    /// The default model ([`crate::engine::default_model_path`]).
    pub(crate) fn model() -> std::path::PathBuf {
        crate::engine::default_model_path().expect("HOME or SUPERFLUID_TEST_MODEL is set")
    }

    /// The SmolLM2 vocabulary, loaded once for all tests.
    pub(crate) fn smol() -> Arc<Vocab> {
        static VOCAB: OnceLock<Arc<Vocab>> = OnceLock::new();
        VOCAB
            .get_or_init(|| Arc::new(Vocab::load(&model()).expect("load SmolLM2 vocab")))
            .clone()
    }

    #[test]
    fn vocab_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<Vocab>();
    }

    #[test]
    fn smol_special_tokens() {
        let v = smol();
        assert_eq!(v.n_vocab(), 49152);
        assert_eq!(v.bos(), Some(1));
        assert_eq!(v.eos(), Some(2));
        assert!(!v.add_bos());
        assert!(v.is_eog(2));
        assert!(!v.is_eog(42));
        assert!(!v.is_eog(u32::MAX));
        assert!(v.is_control(1));
        assert_eq!(v.token_text(1).as_deref(), Some("<|im_start|>"));
        assert_eq!(v.token_text(2).as_deref(), Some("<|im_end|>"));
        assert_eq!(v.token_text(49152), None);
        assert!(v.is_valid(49151));
        assert!(!v.is_valid(49152));
        assert_eq!(v.fim(), None);
        let t = v.chat_template().expect("SmolLM2 has a template");
        assert!(t.contains("<|im_start|>"));
    }

    #[test]
    fn tokenize_never_adds_bos_and_respects_parse_special() {
        let v = smol();
        assert!(v.tokenize("", true).is_empty());
        let plain = v.tokenize("<|im_end|>", false);
        assert!(!plain.contains(&2), "{plain:?}");
        assert!(plain.len() > 1);
        assert_eq!(v.tokenize("<|im_end|>", true), vec![2]);
        assert_eq!(v.tokenize("<|im_start|>user\nhi", true)[0], 1);
        assert_ne!(v.tokenize("hi", true).first(), Some(&1));
    }

    #[test]
    fn detokenize_round_trips() {
        let v = smol();
        for s in [
            "Hello, world!",
            "  leading spaces and trailing  ",
            "héllo wörld — ünïcödé",
            "日本語のテキスト",
            "emoji 🦀🚀 and \u{1F600}",
            "line one\nline two\n\ttab",
        ] {
            assert_eq!(v.detokenize(&v.tokenize(s, false)), s);
        }
        let s = "<|im_start|>user\nhi<|im_end|>\n";
        assert_eq!(v.detokenize(&v.tokenize(s, true)), s);
        assert_eq!(v.detokenize(&[]), "");
    }

    #[test]
    fn pieces_and_invalid_ids() {
        let v = smol();
        assert_eq!(v.piece(2), b"<|im_end|>".to_vec());
        assert!(v.piece(49152).is_empty());
        assert!(v.piece(u32::MAX).is_empty());
        // A multi-byte character split over tokens comes out whole from detokenize.
        let toks = v.tokenize("🦀", false);
        let bytes: Vec<u8> = toks.iter().flat_map(|&t| v.piece(t)).collect();
        assert_eq!(bytes, "🦀".as_bytes());
        let hi = v.tokenize("hi", false);
        let mut with_bad = hi.clone();
        with_bad.push(u32::MAX);
        with_bad.extend(&hi);
        assert_eq!(v.detokenize(&with_bad), "hi\u{FFFD}hi");
    }

    #[test]
    fn missing_and_non_gguf_files_are_errors() {
        let err = Vocab::load(Path::new("/nonexistent/model.gguf")).unwrap_err();
        assert!(matches!(err, EngineError::ModelNotFound(_)), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("model.gguf");
        std::fs::write(&text, "this is not a model\n").unwrap();
        let err = Vocab::load(&text).unwrap_err();
        assert!(matches!(err, EngineError::NotGguf(_)), "{err}");
        let short = dir.path().join("short.gguf");
        std::fs::write(&short, "GG").unwrap();
        assert!(matches!(
            Vocab::load(&short).unwrap_err(),
            EngineError::NotGguf(_)
        ));
        let err = Vocab::load(dir.path()).unwrap_err();
        assert!(matches!(err, EngineError::ModelUnreadable { .. }), "{err}");
        // Right magic, garbage after it: llama.cpp must fail cleanly.
        let bad = dir.path().join("bad.gguf");
        std::fs::write(&bad, b"GGUF\x03\x00\x00\x00garbage").unwrap();
        let err = Vocab::load(&bad).unwrap_err();
        assert!(matches!(err, EngineError::ModelLoad { .. }), "{err}");
    }
}
