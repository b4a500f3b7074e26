//! Planning with the chat template off the actor thread.
//!
//! Rendering a message renders the whole conversation with the template
//! (several times), and an `Append` of a large text tokenizes all of it:
//! work that grows with the session and would hold every other session's
//! requests on the actor thread. So a request whose texts are large (over
//! [`INLINE_BYTES`]) is planned against a [`Prepared`] render, which answers only from results already computed
//! and notes each call it cannot answer. The noted calls then run on a
//! render thread (`actors::render_pool`) (the session's other requests wait, being serialised by
//! its actor; no other session does), and the request is planned again,
//! now answered. Planning is a pure read of the book, so planning twice is
//! safe; the session cannot change in between.

use std::collections::hash_map::{DefaultHasher, RandomState};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use crate::actors::Shared;
use crate::session::SessionBook;
use crate::session::{ChatMessage, Render, RenderError, RenderedConversation, SessionError};
use crate::wire::{Role, Token};

/// A render call whose answer is not known yet: its inputs, owned.
#[derive(Debug, Clone, Hash)]
enum Call {
    Tokenize(String),
    Message {
        history: Vec<ChatMessage>,
        tools: Vec<String>,
        new: ChatMessage,
        first: bool,
    },
    System {
        text: Option<String>,
        tools: Vec<String>,
    },
    Prompt {
        history: Vec<ChatMessage>,
        tools: Vec<String>,
    },
    Tail {
        history: Vec<ChatMessage>,
        tools: Vec<String>,
    },
    Image {
        history: Vec<ChatMessage>,
        tools: Vec<String>,
        role: Role,
        texts: Vec<String>,
        images: Vec<Vec<Token>>,
        first: bool,
    },
}

/// What a call answered.
type Answer = Result<Vec<Token>, RenderError>;

impl Call {
    fn run(&self, render: &dyn Render) -> Answer {
        match self {
            Call::Tokenize(text) => Ok(render.tokenize(text)),
            Call::Message {
                history,
                tools,
                new,
                first,
            } => render.message_span(history, tools, new, *first),
            Call::System { text, tools } => render.system_span(text.as_deref(), tools),
            Call::Prompt { history, tools } => render.generation_prompt_span(history, tools),
            Call::Tail { history, tools } => render.turn_tail(history, tools),
            Call::Image {
                history,
                tools,
                role,
                texts,
                images,
                first,
            } => render.image_span(history, tools, *role, texts, images, *first),
        }
    }
}

/// A call's key: a hash of its kind and inputs, under keys drawn at random
/// per request (so no client can craft two calls that collide); hashed,
/// never compared whole, so a key costs one pass over the inputs and no copy.
fn key(seed: &RandomState, kind: u8, hash: impl FnOnce(&mut DefaultHasher)) -> u64 {
    let mut h = seed.build_hasher();
    kind.hash(&mut h);
    hash(&mut h);
    h.finish()
}

/// A `Render` answering the span and tokenize calls from `answers`; every
/// other method goes to the real one.
struct Prepared<'a> {
    inner: &'a dyn Render,
    seed: &'a RandomState,
    answers: &'a HashMap<u64, Answer>,
    missing: Mutex<Vec<(u64, Call)>>,
}

/// What an unanswered call returns; the plan is thrown away anyway.
fn pending() -> RenderError {
    RenderError("the rendering is being computed".into())
}

/// Calls whose inputs (texts and tool definitions together) are smaller
/// than this render inline (`render_pool::INLINE_BYTES`).
pub use crate::actors::render_pool::INLINE_BYTES;

fn messages_bytes(m: &[ChatMessage]) -> usize {
    m.iter().map(|m| m.content.len()).sum()
}

fn tools_bytes(t: &[String]) -> usize {
    t.iter().map(String::len).sum()
}

impl Prepared<'_> {
    /// The answer to a call of `bytes` of input: inline when small, else
    /// from what was computed off the thread (or noted as missing).
    fn answer(
        &self,
        bytes: usize,
        key: impl FnOnce() -> u64,
        inline: impl FnOnce() -> Answer,
        call: impl FnOnce() -> Call,
    ) -> Answer {
        if bytes < INLINE_BYTES {
            return inline();
        }
        let key = key();
        match self.answers.get(&key) {
            Some(a) => a.clone(),
            None => {
                self.missing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((key, call()));
                Err(pending())
            }
        }
    }
}

impl Prepared<'_> {
    /// A call that renders `history` with `tools` (kind `kind` in the
    /// keys): `render` on the real renderer inline, or `call` off the
    /// thread.
    fn on_history(
        &self,
        kind: u8,
        history: &[ChatMessage],
        tools: &[String],
        render: fn(&dyn Render, &[ChatMessage], &[String]) -> Answer,
        call: fn(Vec<ChatMessage>, Vec<String>) -> Call,
    ) -> Answer {
        self.answer(
            messages_bytes(history) + tools_bytes(tools),
            || key(self.seed, kind, |h| (history, tools).hash(h)),
            || render(self.inner, history, tools),
            || call(history.to_vec(), tools.to_vec()),
        )
    }
}

impl Render for Prepared<'_> {
    fn n_vocab(&self) -> u32 {
        self.inner.n_vocab()
    }
    fn vocab_digest(&self) -> Option<[u8; 32]> {
        self.inner.vocab_digest()
    }
    fn tokenize(&self, text: &str) -> Vec<Token> {
        self.answer(
            text.len(),
            || key(self.seed, 0, |h| text.hash(h)),
            || Ok(self.inner.tokenize(text)),
            || Call::Tokenize(text.to_owned()),
        )
        .unwrap_or_default()
    }
    fn detokenize(&self, span: &[Token]) -> String {
        self.inner.detokenize(span)
    }
    fn message_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
        new: &ChatMessage,
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        self.answer(
            messages_bytes(history) + tools_bytes(tools) + new.content.len(),
            || key(self.seed, 1, |h| (history, tools, new, first).hash(h)),
            || self.inner.message_span(history, tools, new, first),
            || Call::Message {
                history: history.to_vec(),
                tools: tools.to_vec(),
                new: new.clone(),
                first,
            },
        )
    }
    fn image_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
        role: Role,
        texts: &[String],
        images: &[Vec<Token>],
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        self.answer(
            // Always off the thread: it renders the conversation twice.
            INLINE_BYTES + messages_bytes(history),
            || {
                key(self.seed, 4, |h| {
                    (history, tools, role, texts, images, first).hash(h)
                })
            },
            || {
                self.inner
                    .image_span(history, tools, role, texts, images, first)
            },
            || Call::Image {
                history: history.to_vec(),
                tools: tools.to_vec(),
                role,
                texts: texts.to_vec(),
                images: images.to_vec(),
                first,
            },
        )
    }
    fn system_span(&self, text: Option<&str>, tools: &[String]) -> Result<Vec<Token>, RenderError> {
        self.answer(
            text.map_or(0, str::len) + tools_bytes(tools),
            || key(self.seed, 2, |h| (text, tools).hash(h)),
            || self.inner.system_span(text, tools),
            || Call::System {
                text: text.map(str::to_owned),
                tools: tools.to_vec(),
            },
        )
    }
    fn generation_prompt_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        self.on_history(
            3,
            history,
            tools,
            |r: &dyn Render, h: &[ChatMessage], t: &[String]| r.generation_prompt_span(h, t),
            |history, tools| Call::Prompt { history, tools },
        )
    }
    fn turn_tail(
        &self,
        history: &[ChatMessage],
        tools: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        self.on_history(
            5,
            history,
            tools,
            |r: &dyn Render, h: &[ChatMessage], t: &[String]| r.turn_tail(h, t),
            |history, tools| Call::Tail { history, tools },
        )
    }
    fn conversation(
        &self,
        messages: &[ChatMessage],
        tools: &[String],
    ) -> Result<RenderedConversation, RenderError> {
        crate::session::conversation_by_spans(self, messages, tools)
    }
    fn piece(&self, token: Token) -> Vec<u8> {
        self.inner.piece(token)
    }
    fn is_eog(&self, token: Token) -> bool {
        self.inner.is_eog(token)
    }
    fn template_source(&self) -> String {
        self.inner.template_source()
    }
    fn fim(&self) -> Option<[Token; 3]> {
        self.inner.fim()
    }
}

/// The most rounds of "plan, compute what was missing": each round answers
/// at least one more call (a Rebase needs one per Replace edit, its calls
/// depending on the answers before), so this only stops a runaway plan.
const ROUNDS: usize = 4096;

/// The answers computed off the actor thread for one request's planning,
/// under keys drawn at random for it.
pub(super) struct Answers {
    seed: RandomState,
    map: HashMap<u64, Answer>,
    rounds: usize,
}

/// The render calls a plan could not answer yet.
pub(super) struct Missing(Vec<(u64, Call)>);

impl Answers {
    pub(super) fn new() -> Answers {
        Answers {
            seed: RandomState::new(),
            map: HashMap::new(),
            rounds: 0,
        }
    }

    /// Plans with `plan` against what is computed so far (small calls
    /// answered inline): its result, or the calls to compute first.
    pub(super) fn plan<T>(
        &self,
        book: &SessionBook,
        render: &dyn Render,
        plan: impl FnOnce(&SessionBook, &dyn Render) -> Result<T, SessionError>,
    ) -> Result<Result<T, SessionError>, Missing> {
        let prepared = Prepared {
            inner: render,
            seed: &self.seed,
            answers: &self.map,
            missing: Mutex::new(Vec::new()),
        };
        let result = plan(book, &prepared);
        let missing = prepared
            .missing
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        if missing.is_empty() {
            Ok(result)
        } else {
            Err(Missing(missing))
        }
    }

    /// Computes `missing` on a render thread and keeps the answers; at most
    /// [`ROUNDS`] times for one request.
    pub(super) async fn compute(
        mut self,
        render: Arc<dyn Render>,
        missing: Missing,
    ) -> Result<Answers, SessionError> {
        if self.rounds >= ROUNDS {
            return Err(SessionError::Render(RenderError(format!(
                "the request needs more than {ROUNDS} renders"
            ))));
        }
        self.rounds += 1;
        let computed = crate::actors::render_pool::run(move || {
            missing
                .0
                .into_iter()
                .map(|(k, call)| (k, call.run(render.as_ref())))
                .collect::<Vec<_>>()
        })
        .await
        .ok_or_else(|| SessionError::Render(RenderError("the rendering failed".into())))?;
        self.map.extend(computed);
        Ok(self)
    }
}

/// Plans with `plan`, every render call computed off the actor thread.
pub(super) async fn plan_off_thread<T>(
    shared: &Shared,
    plan: impl Fn(&SessionBook, &dyn Render) -> Result<T, SessionError>,
) -> Result<T, SessionError> {
    let mut answers = Answers::new();
    loop {
        let planned = answers.plan(&shared.read(), shared.render.as_ref(), &plan);
        match planned {
            Ok(result) => return result,
            Err(missing) => answers = answers.compute(shared.render.clone(), missing).await?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::fake_render::Bytes;
    use crate::wire::Params;

    fn book_with(text: &str, render: &dyn Render) -> SessionBook {
        let mut book = SessionBook::new();
        let s = book.reserve_id();
        let r = book
            .plan_create(s, None, Params::greedy(1), 1)
            .unwrap()
            .into_record();
        book.apply(&r).unwrap();
        let r = book
            .plan_message(s, Role::User.into(), text.into(), render, 2)
            .unwrap()
            .into_record();
        book.apply(&r).unwrap();
        book
    }

    /// The header of a closed turn renders the whole conversation: for a
    /// large one, the plan names the render instead of running it on the
    /// planning (actor) thread; it runs on a render thread, and the next
    /// plan takes its answer.
    #[actix_rt::test]
    async fn a_large_conversation_s_header_renders_off_the_planning_thread() {
        let render: Arc<dyn Render> = Arc::new(Bytes);
        let no_schema = |_: &str| -> Result<String, crate::session::grammar::GrammarError> {
            unreachable!("no schema")
        };
        let plan = |book: &SessionBook, r: &dyn Render| {
            book.plan_generation(1, 8, 1 << 20, r, &no_schema, 3)
        };
        // Small: inline, at once.
        let book = book_with("hello", render.as_ref());
        let planned = Answers::new().plan(&book, render.as_ref(), plan);
        assert!(matches!(planned, Ok(Ok(_))));
        // Large: named, not run, on this thread (a Prepared render answers
        // an unknown call without calling the template).
        let book = book_with(&"x".repeat(INLINE_BYTES), render.as_ref());
        let answers = Answers::new();
        let Err(missing) = answers.plan(&book, render.as_ref(), plan) else {
            panic!("planned on the planning thread");
        };
        assert_eq!(missing.0.len(), 1);
        assert!(matches!(missing.0[0].1, Call::Prompt { .. }));
        let answers = answers.compute(render.clone(), missing).await.unwrap();
        let Ok(Ok(p)) = answers.plan(&book, render.as_ref(), plan) else {
            panic!("still missing after the render");
        };
        assert!(p.prompt.ends_with(&render.tokenize("<2>")));
    }
}
