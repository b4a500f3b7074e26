//! The engine: the only code in superfluid that calls llama.cpp.
//!
//! Every call into llama.cpp (through the `llama-cpp-2` / `llama-cpp-sys-2` crates) lives under this
//! module, so the rules that keep the process alive (validate every token id, never hand llama.cpp a
//! file that is not a GGUF, initialise the backend once) are enforced in one place.
//!
//! This part is the daemon-side vocabulary and chat template:
//! - [`backend`]: the process-wide llama.cpp backend, with its log output routed into the `log` crate;
//! - [`vocab`]: a vocabulary-only model load (tokenize, detokenize, special tokens, the GGUF template);
//! - [`template`]: the model's Jinja chat template rendered with minijinja, and tool normalisation;
//! - [`render`]: the exact token spans a chat message (or a generation prompt) adds to the input.
//!
//! And the worker side:
//! - [`sample`]: position-indexed sampling, a pure function of logits, params, seed and position;
//! - [`exec`]: the model and its one context ([`exec::WorkerEngine`]), executing worker requests:
//!   the sequence table and request checks (`exec/seqs.rs`), grammar state (`exec/grammar.rs`);
//! - [`worker`]: `superfluid worker`, frames on stdin/stdout around a [`exec::WorkerEngine`];
//! - [`rpc`]: a model's layers on ggml RPC servers on other hosts (`serve --rpc`);
//! - [`hugepages`]: the weights and KV buffers advised onto 2 MiB pages once loaded;
//! - [`attention`]: superfluid's trimmed tiled flash attention in llama.cpp (`ggml-patch/`).
//!
//! Token ids are [`crate::wire::Token`]s, `< n_vocab` once validated by [`vocab::Vocab`] (in the
//! daemon) or [`exec::seqs::SeqTable`] (in the worker).

pub mod attention;
pub mod backend;
pub mod exec;
pub mod hugepages;
pub mod park;
pub mod park_q8;
pub mod render;
pub mod rpc;
pub mod sample;
pub mod seq_state;
pub mod shield;
pub mod template;
pub mod vocab;
pub mod worker;

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::wire::{FrameError, Token, WireError};

/// Where `scripts/fetch-model.sh` puts the default model (SmolLM2-135M-Instruct
/// Q4_1): `$HOME/.cache/superfluid/models/`. `$SUPERFLUID_TEST_MODEL` replaces
/// it for the tests and benchmarks. None when neither `HOME` nor the variable
/// is set.
pub fn default_model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SUPERFLUID_TEST_MODEL") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    Some(PathBuf::from(home).join(".cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

/// Everything that can go wrong in the engine layer.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `--rpc`: a server could not be registered, or the model's layer count is unknown.
    #[error("RPC backend: {0}")]
    Rpc(String),
    /// `--mmproj`: the vision projector could not be loaded for the model.
    #[error("vision projector: {0}")]
    Projector(String),
    /// `--park`: the park directory or the model's identity could not be set up.
    #[error("cannot set up parking: {0}")]
    Park(std::io::Error),
    /// llama.cpp's JSON-schema-to-grammar converter refused a schema.
    #[error("{0}")]
    SchemaToGrammar(String),
    /// llama.cpp's backend could not be initialised.
    #[error("cannot initialise the llama.cpp backend: {0}")]
    Backend(String),
    /// The model path does not exist.
    #[error("model file not found: {}", .0.display())]
    ModelNotFound(PathBuf),
    /// The model path could not be read (permissions, a directory, an I/O error).
    #[error("cannot read model file {}: {source}", path.display())]
    ModelUnreadable {
        /// The path that was tried.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic bytes.
    #[error("not a GGUF model file (bad magic bytes): {}", .0.display())]
    NotGguf(PathBuf),
    /// llama.cpp refused to load the file (corrupt, unsupported architecture, non-UTF-8 path, ...).
    #[error("llama.cpp failed to load {}: {reason}", path.display())]
    ModelLoad {
        /// The path that was tried.
        path: PathBuf,
        /// What llama-cpp-2 reported.
        reason: String,
    },
    /// The model declares no `tokenizer.chat_template`.
    #[error("the model has no chat template (GGUF key tokenizer.chat_template is missing)")]
    NoChatTemplate,
    /// A token id outside `0..n_vocab`.
    #[error("invalid token id {token}: the vocabulary has {n_vocab} tokens")]
    InvalidToken {
        /// The offending id.
        token: Token,
        /// The vocabulary size.
        n_vocab: u32,
    },
    /// The chat template failed to compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The chat template failed while rendering (including `raise_exception` from the template).
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
    /// Rendering with more messages did not extend the shorter rendering, so no delta exists.
    #[error("chat template rendering is not incremental: {0}")]
    TemplateNotIncremental(String),
    /// A tool definition that cannot be normalised to the OpenAI function-tool form.
    #[error("invalid tool definition: {0}")]
    InvalidTool(String),
    /// A worker configuration out of range (context size, sequences, batch, threads).
    #[error("{0}")]
    InvalidConfig(String),
    /// The model's vocabulary has no tokens.
    #[error("the model has an empty vocabulary")]
    EmptyVocabulary,
    /// llama.cpp could not create the worker's context.
    #[error("cannot create a context (n_ctx {n_ctx}, n_seq {n_seq}, n_batch {n_batch}): {reason}")]
    Context {
        n_ctx: u32,
        n_seq: u32,
        n_batch: u32,
        reason: String,
    },
    /// The worker could not take its stdout for frames.
    #[error("cannot set up stdout for frames")]
    Stdout(#[source] std::io::Error),
    /// The worker's request stream broke (a frame over the cap, or cut short).
    #[error("reading a request")]
    ReadRequest(#[source] FrameError),
    /// The worker could not write a reply.
    #[error("writing a reply")]
    WriteReply(#[source] FrameError),
    /// The worker could not encode a reply.
    #[error(transparent)]
    Encode(#[from] WireError),
}

/// The four magic bytes every GGUF file starts with.
const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// Check that `path` exists and starts with the GGUF magic bytes, before llama.cpp sees it (it
/// aborts on some bad files): the vocabulary load and the worker's model load both call it.
pub(crate) fn check_gguf(path: &Path) -> Result<(), EngineError> {
    let unreadable = |source| EngineError::ModelUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EngineError::ModelNotFound(path.to_path_buf()))
        }
        Err(e) => return Err(unreadable(e)),
    };
    if !meta.is_file() {
        return Err(unreadable(std::io::Error::other("not a regular file")));
    }
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    match file.read_exact(&mut magic) {
        Ok(()) if &magic == GGUF_MAGIC => Ok(()),
        Ok(()) => Err(EngineError::NotGguf(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(EngineError::NotGguf(path.to_path_buf()))
        }
        Err(e) => Err(unreadable(e)),
    }
}

/// llama.cpp's JSON-schema-to-GBNF converter (no model needed): the grammar
/// that forces a tool call's arguments to follow the tool's schema.
///
/// The bindings drop the converter's own reason ("ffi error -3"), so a
/// refusal names the likeliest one found in the schema: a `$ref` that
/// points at nothing in it.
pub fn json_schema_grammar(schema: &str) -> Result<String, EngineError> {
    // Unanchored patterns anchored, so that the converter keeps them.
    let anchored = serde_json::from_str::<serde_json::Value>(schema)
        .ok()
        .and_then(|mut v| crate::session::grammar::anchor_patterns(&mut v).then(|| v.to_string()));
    let gbnf = llama_cpp_2::json_schema_to_grammar(anchored.as_deref().unwrap_or(schema)).map_err(
        |e| {
            let dangling = serde_json::from_str::<serde_json::Value>(schema)
                .ok()
                .and_then(|v| crate::session::grammar::unresolved_ref(&v));
            EngineError::SchemaToGrammar(match dangling {
                Some(r) => format!("the schema's $ref {r:?} points at nothing in the schema"),
                None => format!(
                    "llama.cpp's JSON-schema converter refused the schema ({e}; it gives no \
                 reason: look at its $ref targets, patterns and numeric bounds)"
                ),
            })
        },
    )?;
    // What llama.cpp's grammar code would take from it, refused here
    // rather than in the worker's step.
    crate::session::gbnf_cost::check(&gbnf).map_err(EngineError::SchemaToGrammar)?;
    Ok(gbnf)
}

#[cfg(test)]
mod tests {
    /// An unanchored pattern is kept (anchored): its grammar is not any
    /// string's, and what surrounds the match cannot be a quote.
    #[test]
    fn an_unanchored_pattern_still_shapes_the_grammar() {
        let any = super::json_schema_grammar(r#"{"type":"string"}"#).unwrap();
        let g = super::json_schema_grammar(r#"{"type":"string","pattern":"ab+c"}"#).unwrap();
        assert_ne!(g, any);
        assert!(
            g.contains(r#""a""#) && g.contains(r#"[^"\\\x7F\x00-\x1F]"#),
            "{g}"
        );
    }
}
