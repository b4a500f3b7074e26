//! A byte-level fake chat template for tests without a model: tokens are
//! bytes, a message renders as `<role>text|` (`^` before the first), the
//! assistant header as `<2>`.

use crate::session::{ChatMessage, Render, RenderError};
use crate::wire::Token;

/// Tokens are bytes; a message renders as `<role>text|`.
pub(crate) struct Bytes;

impl Render for Bytes {
    fn n_vocab(&self) -> u32 {
        256
    }
    fn tokenize(&self, text: &str) -> Vec<Token> {
        text.bytes().map(u32::from).collect()
    }
    fn detokenize(&self, span: &[Token]) -> String {
        span.iter().map(|&t| t as u8 as char).collect()
    }
    fn message_span(
        &self,
        _: &[ChatMessage],
        _: &[String],
        new: &ChatMessage,
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        let pre = if first { "^" } else { "" };
        Ok(self.tokenize(&format!("{pre}<{}>{}|", u8::from(new.role), new.content)))
    }
    fn system_span(&self, text: Option<&str>, tools: &[String]) -> Result<Vec<Token>, RenderError> {
        for t in tools {
            serde_json::from_str::<serde_json::Value>(t).map_err(|e| RenderError(e.to_string()))?;
        }
        Ok(self.tokenize(&format!("<sys>{}{}|", text.unwrap_or(""), tools.join(","))))
    }
    fn generation_prompt_span(
        &self,
        _: &[ChatMessage],
        _: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        Ok(self.tokenize("<2>"))
    }
    fn piece(&self, token: Token) -> Vec<u8> {
        vec![token as u8]
    }
    fn is_eog(&self, token: Token) -> bool {
        token == 0
    }
    fn template_source(&self) -> String {
        String::new()
    }
    fn fim(&self) -> Option<[Token; 3]> {
        None
    }
}
