//! The scheduler stepped by hand, with a fake worker that draws token 100+n.

use super::*;
use crate::wire::worker::Drawn;

const P: Params = Params {
    temperature: 0.0,
    top_p: 1.0,
    min_p: 0.0,
    top_k: 0,
    seed: 1,
};
const EOG: Token = 2;

fn admit(session: SessionId, prompt: &[Token], max_tokens: u32) -> Admit {
    Admit {
        session,
        prompt: prompt.to_vec(),
        params: P,
        max_tokens,
        class: 0,
        batch_invariant: false,
        grammar: None,
    }
}

/// Runs one step with a worker that draws `draw(seq)` for every sampling item.
fn step_with(s: &mut SchedulerState, draw: impl Fn(u32) -> Token) -> (Option<Step>, Vec<GenEvent>) {
    let (step, mut events) = s.plan();
    if let Some(step) = &step {
        let drawn = step
            .decode
            .iter()
            .filter(|i| i.sample.is_some())
            .map(|i| {
                let token = draw(i.seq);
                Drawn {
                    seq: i.seq,
                    token,
                    eog: token == EOG,
                }
            })
            .collect();
        events.extend(s.complete(step, Ok(drawn)));
    }
    (step, events)
}

fn run_to_end(s: &mut SchedulerState) -> Vec<GenEvent> {
    let mut all = Vec::new();
    for _ in 0..1000 {
        let (step, events) = step_with(s, |seq| 100 + seq);
        all.extend(events);
        if step.is_none() {
            break;
        }
    }
    all
}

#[test]
fn second_turn_prefills_only_new_tokens() {
    let mut s = SchedulerState::new(4096, 2, 512);
    let g = s.admit(admit(1, &[1, 2, 3, 4], 3)).unwrap();
    let events = run_to_end(&mut s);
    assert!(events.contains(&GenEvent::Started {
        gen: g,
        warm_prefix: 0,
        evicted: 0
    }));
    assert!(events.contains(&GenEvent::Finished {
        gen: g,
        finish: finish::MAX_TOKENS
    }));
    // The KV holds the prompt and the first two drawn tokens (the third was never fed).
    assert_eq!(s.resident(0), &[1, 2, 3, 4, 100, 100]);
    // Turn 2: history + the last drawn token + a new message.
    let g2 = s
        .admit(admit(1, &[1, 2, 3, 4, 100, 100, 100, 7, 8], 1))
        .unwrap();
    let (step, events) = step_with(&mut s, |_| 9);
    assert!(events.contains(&GenEvent::Started {
        gen: g2,
        warm_prefix: 6,
        evicted: 0
    }));
    let step = step.unwrap();
    assert_eq!(step.decode[0].pos, 6);
    assert_eq!(step.decode[0].tokens, vec![100, 7, 8]);
}

#[test]
fn same_prompt_again_redecodes_only_the_last_token() {
    let mut s = SchedulerState::new(4096, 1, 512);
    s.admit(admit(1, &[1, 2, 3], 1)).unwrap();
    run_to_end(&mut s);
    let g = s.admit(admit(1, &[1, 2, 3], 1)).unwrap();
    let (step, events) = step_with(&mut s, |_| 5);
    let step = step.unwrap();
    assert_eq!(step.ops, vec![WorkerRequest::KvTrim { seq: 0, from: 2 }]);
    assert!(events.contains(&GenEvent::Started {
        gen: g,
        warm_prefix: 2,
        evicted: 1
    }));
    assert_eq!(
        (step.decode[0].pos, step.decode[0].tokens.clone()),
        (2, vec![3])
    );
}

#[test]
fn fork_starts_from_a_copy_of_its_parents_cells() {
    let mut s = SchedulerState::new(4096, 4, 512);
    s.admit(admit(1, &[1, 2, 3, 4, 5], 1)).unwrap();
    run_to_end(&mut s);
    let g = s.admit(admit(2, &[1, 2, 3, 4, 5, 6], 1)).unwrap();
    let (step, events) = step_with(&mut s, |_| 9);
    let step = step.unwrap();
    assert_eq!(
        step.ops,
        vec![WorkerRequest::KvCopy {
            src: 0,
            dst: 1,
            len: 5
        }]
    );
    assert!(events.contains(&GenEvent::Started {
        gen: g,
        warm_prefix: 5,
        evicted: 0
    }));
    assert_eq!(step.decode[0].tokens, vec![6]);
    // The parent's sequence is untouched.
    assert_eq!(s.resident(0), &[1, 2, 3, 4, 5]);
}

#[test]
fn all_running_generations_share_each_step() {
    let mut s = SchedulerState::new(4096, 4, 512);
    for session in 1..=4 {
        s.admit(admit(session, &[1, 2, session as Token + 10], 5))
            .unwrap();
    }
    let (step, _) = step_with(&mut s, |seq| 50 + seq);
    assert_eq!(step.unwrap().decode.len(), 4);
    for _ in 0..4 {
        let (step, _) = step_with(&mut s, |seq| 50 + seq);
        let step = step.unwrap();
        assert_eq!(step.decode.len(), 4, "all four decode in the same step");
        assert!(step.decode.iter().all(|i| i.tokens.len() == 1));
    }
    assert_eq!(s.running(), 0);
}

#[test]
fn eog_ends_the_turn_and_draw_pos_is_the_stream_position() {
    let mut s = SchedulerState::new(4096, 1, 512);
    let g = s.admit(admit(1, &[1, 2, 3], 10)).unwrap();
    let (step, _) = step_with(&mut s, |_| 7);
    assert_eq!(step.unwrap().decode[0].sample.as_ref().unwrap().draw_pos, 3);
    let (step, events) = step_with(&mut s, |_| EOG);
    assert_eq!(step.unwrap().decode[0].sample.as_ref().unwrap().draw_pos, 4);
    assert!(events.contains(&GenEvent::Finished {
        gen: g,
        finish: finish::END_OF_TURN
    }));
}

#[test]
fn cancel_before_and_during() {
    let mut s = SchedulerState::new(4096, 1, 512);
    let a = s.admit(admit(1, &[1, 2], 100)).unwrap();
    let b = s.admit(admit(2, &[1, 3], 100)).unwrap();
    step_with(&mut s, |_| 5);
    // b waits for the only sequence: cancelling it finishes it at once.
    assert_eq!(
        s.cancel(b),
        vec![GenEvent::Finished {
            gen: b,
            finish: finish::CANCELLED
        }]
    );
    assert!(s.cancel(a).is_empty());
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(events.contains(&GenEvent::Finished {
        gen: a,
        finish: finish::CANCELLED
    }));
    assert_eq!(s.running(), 0);
}

#[test]
fn prefill_is_chunked_by_the_batch_budget() {
    let mut s = SchedulerState::new(4096, 1, 4);
    let prompt: Vec<Token> = (10..20).collect();
    s.admit(admit(1, &prompt, 1)).unwrap();
    let sizes: Vec<usize> = (0..3)
        .map(|_| step_with(&mut s, |_| 5).0.unwrap().decode[0].tokens.len())
        .collect();
    assert_eq!(sizes, vec![4, 4, 2]);
}

#[test]
fn idle_sequences_are_evicted_for_room() {
    let mut s = SchedulerState::new(16, 2, 512);
    s.admit(admit(1, &[1; 8], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(admit(2, &[3; 10], 1)).unwrap();
    let (step, _) = step_with(&mut s, |_| 5);
    assert!(step
        .unwrap()
        .ops
        .contains(&WorkerRequest::KvClear { seq: 0 }));
    assert!(
        s.admit(admit(3, &[1; 16], 1)).is_err(),
        "larger than the context"
    );
}

#[test]
fn failure_fails_everything_and_forgets_the_kv() {
    let mut s = SchedulerState::new(4096, 2, 512);
    let a = s.admit(admit(1, &[1, 2], 5)).unwrap();
    let (step, _) = s.plan();
    let events = s.complete(&step.unwrap(), Err("worker crashed".into()));
    assert_eq!(
        events,
        vec![GenEvent::Failed {
            gen: a,
            message: "worker crashed".into()
        }]
    );
    assert!(s.resident(0).is_empty());
}

#[test]
fn qos_and_background_rate_and_batch_invariance() {
    let mut s = SchedulerState::new(4096, 1, 512);
    let low = s
        .admit(Admit {
            class: 2,
            ..admit(1, &[1], 1)
        })
        .unwrap();
    let high = s
        .admit(Admit {
            class: 0,
            ..admit(2, &[2], 1)
        })
        .unwrap();
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(
        events.contains(&GenEvent::Started {
            gen: high,
            warm_prefix: 0,
            evicted: 0
        }),
        "class 0 admitted first"
    );
    assert!(!events
        .iter()
        .any(|e| matches!(e, GenEvent::Started { gen, .. } if *gen == low)));

    let mut s = SchedulerState::new(4096, 2, 512);
    s.set_background_divisor(4);
    s.admit(Admit {
        class: BACKGROUND_CLASS,
        ..admit(1, &[1], 100)
    })
    .unwrap();
    s.admit(admit(2, &[2], 100)).unwrap();
    let mut bg_steps = 0;
    for _ in 0..16 {
        let (step, _) = step_with(&mut s, |_| 5);
        // Class 0 was admitted first, onto sequence 0; the background one is on 1.
        if step.unwrap().decode.iter().any(|i| i.seq == 1) {
            bg_steps += 1;
        }
    }
    assert_eq!(bg_steps, 4, "background advances every 4th step");

    let mut s = SchedulerState::new(4096, 3, 512);
    s.admit(Admit {
        batch_invariant: true,
        ..admit(1, &[1], 100)
    })
    .unwrap();
    s.admit(admit(2, &[2], 100)).unwrap();
    s.admit(admit(3, &[3], 100)).unwrap();
    for _ in 0..10 {
        let (step, _) = step_with(&mut s, |_| 5);
        let step = step.unwrap();
        let has_inv = step.decode.iter().any(|i| i.seq == 0);
        assert!(
            !has_inv || step.decode.len() == 1,
            "the invariant one always runs alone"
        );
    }
}

#[test]
fn pinned_sequences_are_evicted_last_and_within_their_budget() {
    // Two sequences, 16 cells: session 1 pinned, session 2 not.
    let mut s = SchedulerState::new(16, 2, 512).with_pin_budget_pct(50);
    s.set_clock(1_000);
    s.admit(admit(1, &[1; 6], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(admit(2, &[2; 6], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.pin(1, 5_000), 5_000);
    // A third session needs a sequence: the unpinned one (older pins aside) goes.
    s.admit(admit(3, &[3; 6], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.resident(0), &[1; 6], "the pinned session stays");
    // Past its deadline the pin no longer protects.
    s.set_clock(6_000);
    s.admit(admit(4, &[4; 6], 1)).unwrap();
    run_to_end(&mut s);
    assert_ne!(s.resident(0), &[1; 6]);
    assert_eq!(s.pin(1, 0), 0, "0 clears");
    // A pin larger than the budget protects nothing.
    let mut s = SchedulerState::new(16, 2, 512).with_pin_budget_pct(10);
    s.admit(admit(1, &[1; 6], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(admit(2, &[2; 6], 1)).unwrap();
    run_to_end(&mut s);
    s.pin(1, u64::MAX);
    s.admit(admit(3, &[3; 6], 1)).unwrap();
    run_to_end(&mut s);
    assert_ne!(s.resident(0), &[1; 6], "over budget, the pin yields");
}

#[test]
fn a_full_cache_evicts_idle_sequences_then_ends_the_youngest() {
    let mut s = SchedulerState::new(4096, 3, 512);
    s.admit(admit(1, &[1; 8], 1)).unwrap();
    run_to_end(&mut s);
    let a = s.admit(admit(2, &[2; 8], 100)).unwrap();
    let b = s.admit(admit(3, &[3; 8], 100)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    // The worker says its cache is full: the idle sequence goes first.
    let events = s.complete(&step, Err(format!("{KV_FULL}: n_ctx=4096 cells")));
    assert!(events.is_empty());
    let (step, _) = s.plan();
    let step = step.unwrap();
    assert!(step.ops.contains(&WorkerRequest::KvClear { seq: 0 }));
    assert_eq!(step.decode.len(), 2, "both retry");
    // Full again with nothing idle: the youngest ends, the other goes on.
    let events = s.complete(&step, Err(format!("{KV_FULL}: n_ctx=4096 cells")));
    assert_eq!(
        events,
        vec![GenEvent::Finished {
            gen: b,
            finish: finish::ERROR
        }]
    );
    let (step, _) = s.plan();
    assert_eq!(step.unwrap().gens, vec![a]);
}

#[test]
fn admission_waits_for_room_beside_running_sequences() {
    let mut s = SchedulerState::new(64, 2, 512);
    let a = s.admit(admit(1, &[1; 40], 100)).unwrap();
    let b = s.admit(admit(2, &[2; 30], 100)).unwrap();
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(events
        .iter()
        .any(|e| matches!(e, GenEvent::Started { gen, .. } if *gen == a)));
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, GenEvent::Started { gen, .. } if *gen == b)),
        "40 running + 31 would overflow 64 cells: b waits"
    );
}

#[test]
fn a_lone_background_generation_runs_at_full_speed() {
    let mut s = SchedulerState::new(4096, 1, 512);
    s.set_background_divisor(4);
    let g = s
        .admit(Admit {
            class: BACKGROUND_CLASS,
            ..admit(1, &[1], 3)
        })
        .unwrap();
    let events = run_to_end(&mut s);
    assert!(events.contains(&GenEvent::Finished {
        gen: g,
        finish: finish::MAX_TOKENS
    }));
}
