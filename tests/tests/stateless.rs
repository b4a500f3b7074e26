//! `StatelessGen` with sampling extras, in process on the daemon's own actors
//! (`daemon::start_actors`) and the real worker: what an OpenAI-style route
//! runs. Logit bias and penalties reach the sampler through the scheduler's
//! planned and following steps, log-probabilities come back on each
//! `GenEvent::Token`, and a `logit_bias` id outside the vocabulary is refused
//! at admission.

use std::sync::Arc;
use std::time::Duration;

use superfluid::actors::bus::SUB_BUFFER_EVENTS;
use superfluid::actors::stateless::{StatelessError, StatelessGen};
use superfluid::actors::Shared;
use superfluid::daemon::{replay, start_actors, ModelRender, ServeConfig};
use superfluid::scheduler::{GenEvent, SchedulerError, DEFAULT_PIN_BUDGET_PCT};
use superfluid::store::{OpenMode, WalWriter};
use superfluid::wire::worker::WorkerConfig;
use superfluid::wire::{ExtrasError, Finish, SampleExtras, Token, TokenLogprob};

use crate::util::{model_path, params};

/// Runs `body` against the daemon's actors on a fresh directory.
fn with_actors<F, Fut>(body: F)
where
    F: FnOnce(Shared) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let dir = tempfile::tempdir().unwrap();
    let render = Arc::new(ModelRender::load(&model_path()).unwrap());
    let (file, book) = replay(dir.path(), OpenMode::Durable).unwrap();
    let writer = WalWriter::spawn(file, None).expect("wal-writer");
    let w = writer.clone();
    actix::System::new().block_on(async move {
        let config = ServeConfig {
            model: model_path(),
            sessions: dir.path().to_path_buf(),
            socket: dir.path().join("unused.sock"),
            sessions_cache: false,
            worker: WorkerConfig {
                n_ctx: 1024,
                n_seq: 2,
                n_batch: 256,
                threads: 2,
            },
            pin_budget_pct: DEFAULT_PIN_BUDGET_PCT,
            web: None,
            sub_buffer: SUB_BUFFER_EVENTS,
            cache_ram_mb: 0,
            idle_spill_ms: 0,
            turn_warm_ms: superfluid::scheduler::TURN_WARM_DELAY_MS,
            park_budget_bytes: None,
            park_lossy: false,
            kv_bits: 16,
            mmap: false,
            step_timeout: std::time::Duration::from_secs(60),
            load_timeout: std::time::Duration::from_secs(600),
            max_connections: superfluid::frontend::socket::DEFAULT_MAX_CONNECTIONS,
            more_models: Vec::new(),
            keep_alive_ms: None,
            max_loaded_models: 1,
            memory_limit_mb: None,
            placement: Default::default(),
            mmproj: None,
            more_mmproj: vec![],
        };
        let shared = start_actors(&config, crate::util::bin().into(), book, w, render, None);
        body(shared).await;
        actix::System::current().stop();
    });
    writer.shutdown();
}

/// Runs one generation to its end: its tokens and their log-probabilities.
async fn run(
    shared: &Shared,
    prompt: &[Token],
    max_tokens: u32,
    extras: Option<SampleExtras>,
) -> Result<Vec<(Token, Option<TokenLogprob>)>, StatelessError> {
    let generation = StatelessGen {
        prompt: prompt.to_vec(),
        params: params(0),
        max_tokens,
        grammar: None,
        pin: None,
        extras,
        media: vec![],
    };
    let mut rx = generation
        .start(&shared.scheduler, shared.generations.clone())
        .await?;
    let mut out = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), rx.recv())
            .await
            .expect("a generation event within 2 minutes")
            .expect("the generation ends with Finished or Failed");
        match event {
            GenEvent::Started { .. } => {}
            GenEvent::Token { token, logprob, .. } => out.push((token, logprob)),
            GenEvent::Finished { finish, .. } => {
                assert_eq!(finish, Finish::MaxTokens);
                return Ok(out);
            }
            GenEvent::Failed { message, .. } => panic!("failed: {message}"),
        }
    }
}

#[test]
fn stateless_generations_carry_extras_end_to_end() {
    with_actors(|shared| async move {
        let prompt = shared
            .render
            .tokenize("one, two, one, two, one, two, one, two, one, two, one,");
        // 12 tokens: the first planned, the rest in following steps (DecodeNext).
        let plain = run(&shared, &prompt, 12, None).await.unwrap();
        assert!(plain.iter().all(|(_, lp)| lp.is_none()));
        let plain: Vec<Token> = plain.into_iter().map(|t| t.0).collect();

        let asked = SampleExtras {
            logprobs: Some(3),
            ..SampleExtras::default()
        };
        let with_lp = run(&shared, &prompt, 12, Some(asked.clone()))
            .await
            .unwrap();
        assert_eq!(with_lp.iter().map(|t| t.0).collect::<Vec<_>>(), plain);
        for (token, lp) in &with_lp {
            let lp = lp.as_ref().expect("logprobs asked");
            assert!(lp.logprob <= 0.0, "{lp:?}");
            assert_eq!(lp.top.len(), 3);
            assert_eq!(
                lp.top[0],
                (*token, lp.logprob),
                "greedy draws the most likely"
            );
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
        }

        // +100 on one token forces it at every draw.
        let forced = shared.render.tokenize(" banana")[0];
        let bias = SampleExtras {
            logit_bias: vec![(forced, 100.0)],
            ..SampleExtras::default()
        };
        let out = run(&shared, &prompt, 6, Some(bias)).await.unwrap();
        assert!(out.iter().all(|t| t.0 == forced), "{out:?}");

        // A frequency penalty breaks the loop.
        let penalized = SampleExtras {
            frequency_penalty: 2.0,
            ..SampleExtras::default()
        };
        let out = run(&shared, &prompt, 12, Some(penalized)).await.unwrap();
        let out: Vec<Token> = out.into_iter().map(|t| t.0).collect();
        assert_eq!(out[0], plain[0]);
        assert_ne!(out, plain);

        // Refused at admission, with the reason.
        let n_vocab = shared.render.n_vocab();
        let bad = SampleExtras {
            logit_bias: vec![(n_vocab, 1.0)],
            ..SampleExtras::default()
        };
        match run(&shared, &prompt, 4, Some(bad)).await {
            Err(StatelessError::Refused(SchedulerError::Extras(ExtrasError::BiasToken {
                token,
                ..
            }))) => assert_eq!(token, n_vocab),
            other => panic!("{other:?}"),
        }
        // And the lane goes on.
        let again = run(&shared, &prompt, 3, None).await.unwrap();
        assert_eq!(
            again.into_iter().map(|t| t.0).collect::<Vec<_>>(),
            plain[..3]
        );
    });
}
