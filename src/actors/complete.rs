//! `Complete`: fill-in-the-middle on the lane without a session log.
//!
//! The prompt is laid out with the model's own FIM tokens: PSM (mode 0) is
//! `<pre> prefix <suf> suffix <mid>`, SPM (mode 1) is `<suf> suffix <pre>
//! prefix <mid>`. Decoding is greedy; nothing is recorded in the log. The
//! prompt goes through the cache like any generation: `cached` counts the
//! prompt tokens that came from the KV, `expired` the cached tokens this
//! request dropped (cells that no longer matched, sequences cleared for room).

use super::stateless::StatelessGen;
use super::Shared;
use crate::scheduler::GenEvent;
use crate::wire::{FimMode, Params, Response, Token};

/// Greedy: a completion has no sampling parameters.
const FIM_PARAMS: Params = Params::greedy(0);

/// A FIM mode that is neither PSM nor SPM.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("mode {0} is not 0 (PSM) or 1 (SPM)")]
pub struct BadFimMode(pub u8);

/// Lays out a FIM prompt. `fim` is `[prefix, suffix, middle]`.
pub fn fim_prompt(
    fim: [Token; 3],
    prefix: &[Token],
    suffix: &[Token],
    mode: FimMode,
) -> Vec<Token> {
    let [pre, suf, mid] = fim;
    let mut out = Vec::with_capacity(prefix.len() + suffix.len() + 3);
    match mode {
        FimMode::Psm => {
            out.push(pre);
            out.extend_from_slice(prefix);
            out.push(suf);
            out.extend_from_slice(suffix);
        }
        FimMode::Spm => {
            out.push(suf);
            out.extend_from_slice(suffix);
            out.push(pre);
            out.extend_from_slice(prefix);
        }
    }
    out.push(mid);
    out
}

/// Runs one `Complete`.
pub async fn complete(
    shared: &Shared,
    prefix: String,
    suffix: String,
    mode: u8,
    max_tokens: u32,
) -> Response {
    let render = shared.render.clone();
    let Some(fim) = render.fim() else {
        return Response::err(
            "this model has no fill-in-the-middle tokens (its GGUF names no \
             tokenizer.ggml.fim_pre/suf/mid_token_id), so it cannot Complete",
        );
    };
    if max_tokens == 0 || max_tokens > shared.n_ctx {
        return Response::err(format!(
            "max_tokens must be between 1 and the context size ({})",
            shared.n_ctx
        ));
    }
    let Ok(mode) = FimMode::try_from(mode) else {
        return Response::err(BadFimMode(mode).to_string());
    };
    // Large texts are tokenized off the actor thread.
    let bytes = prefix.len() + suffix.len();
    let tokenizer = render.clone();
    let tokenized = super::render_pool::run_sized(bytes, move || {
        (tokenizer.tokenize(&prefix), tokenizer.tokenize(&suffix))
    })
    .await;
    let Some((prefix, suffix)) = tokenized else {
        return Response::err("tokenizing the completion's texts failed");
    };
    let prompt = fim_prompt(fim, &prefix, &suffix, mode);
    let generation = StatelessGen {
        prompt,
        params: FIM_PARAMS,
        max_tokens,
        grammar: None,
        pin: None,
        extras: None,
        media: vec![],
    };
    let mut rx = match generation
        .start(&shared.scheduler, shared.generations.clone())
        .await
    {
        Ok(rx) => rx,
        Err(e) => return Response::err(e.to_string()),
    };
    let (mut tokens, mut cached, mut expired) = (Vec::new(), 0, 0);
    while let Some(e) = rx.recv().await {
        match e {
            GenEvent::Started {
                warm_prefix,
                evicted,
                ..
            } => (cached, expired) = (warm_prefix, evicted),
            GenEvent::Token { token, .. } => tokens.push(token),
            GenEvent::Finished { .. } => break,
            GenEvent::Failed { message, .. } => return Response::err(message),
        }
    }
    let generated = tokens.len() as u64;
    let text_tokens: Vec<Token> = tokens.into_iter().filter(|&t| !render.is_eog(t)).collect();
    Response::Completion {
        text: render.detokenize(&text_tokens),
        tokens: generated,
        cached,
        expired,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psm_and_spm_layouts() {
        let fim = [11, 12, 13];
        assert_eq!(
            fim_prompt(fim, &[1, 2], &[3], FimMode::Psm),
            vec![11, 1, 2, 12, 3, 13]
        );
        assert_eq!(
            fim_prompt(fim, &[1, 2], &[3], FimMode::Spm),
            vec![12, 3, 11, 1, 2, 13]
        );
        assert_eq!(fim_prompt(fim, &[], &[], FimMode::Psm), vec![11, 12, 13]);
        assert!(FimMode::try_from(2).is_err());
        assert_eq!(
            BadFimMode(2).to_string(),
            "mode 2 is not 0 (PSM) or 1 (SPM)"
        );
    }
}
