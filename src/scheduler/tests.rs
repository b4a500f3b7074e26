//! The scheduler stepped by hand, with a fake worker that draws token 100+n.

use std::collections::VecDeque;

use super::pipeline::{Pipeline, StepId, StepOutput, StepResult};
use super::*;
use crate::engine::exec::error::RequestError;
use crate::engine::exec::seqs::SeqTable;
use crate::wire::worker::{DecodeItem, Drawn, Refused, WorkerResponse};

const P: Params = Params::greedy(1);
const EOG: Token = 2;

fn admit(session: SessionId, prompt: &[Token], max_tokens: u32) -> Admit {
    Admit {
        session,
        prompt: prompt.to_vec(),
        params: P,
        max_tokens,
        class: QosClass::First,
        batch_invariant: false,
        grammar: None,
        grammar_from: 0,
        pin: None,
        extras: None,
        media: vec![],
    }
}

/// One draw: `token` for sequence `seq`.
fn drew(seq: u32, token: Token) -> Vec<Drawn> {
    vec![Drawn {
        seq,
        token,
        eog: token == EOG,
        logprob: None,
        grammar_us: 0,
    }]
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
                    logprob: None,
                    grammar_us: 0,
                }
            })
            .collect();
        events.extend(s.step_done(step, Ok(drawn)));
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
        finish: Finish::MaxTokens
    }));
    // The KV holds the prompt and the first two drawn tokens (the third was never fed).
    assert_eq!(s.resident(0), &[1, 2, 3, 4, 100, 100]);
    // Prefill was the prompt; the drawn tokens fed back are not counted.
    assert_eq!(s.stats().prefilled_tokens, 4);
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
    assert_eq!(s.stats().prefilled_tokens, 4 + 3);
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
    // Prompts that share nothing (sharing all but the last token, the later
    // ones would wait for the first one's prefill).
    for session in 1..=4 {
        s.admit(admit(session, &[session as Token + 10, 1, 2], 5))
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
        finish: Finish::EndOfTurn
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
            finish: Finish::Cancelled
        }]
    );
    assert!(s.cancel(a).is_empty());
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(events.contains(&GenEvent::Finished {
        gen: a,
        finish: Finish::Cancelled
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
    let events = s.step_done(
        &step.unwrap(),
        Err(StepError::Failed("worker crashed".into())),
    );
    assert_eq!(
        events,
        vec![GenEvent::Failed {
            gen: a,
            message: "worker crashed".into(),
            own: false,
        }]
    );
    assert!(s.resident(0).is_empty());
}

/// Issue 15, item 3: an item the worker refused on its own (a grammar that
/// does not parse) fails its generation alone; the other generation of the
/// step takes its draw and runs on, and the refused one's sequence is as it
/// was before the step.
#[test]
fn a_refused_item_fails_only_its_generation() {
    let mut s = SchedulerState::new(4096, 2, 512);
    let a = s.admit(admit(1, &[1, 2, 3], 4)).unwrap();
    let b = s.admit(admit(2, &[4, 5, 6], 4)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    assert_eq!(step.gens.len(), 2, "both prefill in one step");
    let seq_of = |g: GenId| step.decode[step.gens.iter().position(|x| *x == g).unwrap()].seq;
    let (seq_a, seq_b) = (seq_of(a), seq_of(b));
    let drawn = vec![Drawn {
        seq: seq_a,
        token: 100,
        eog: false,
        logprob: None,
        grammar_us: 0,
    }];
    let refused = [Refused {
        seq: seq_b,
        message: "the grammar does not parse".into(),
    }];
    let events = s.step_done_refusing(&step, Ok(drawn), &refused);
    assert!(
        events.contains(&GenEvent::Failed {
            gen: b,
            message: "the grammar does not parse".into(),
            own: true,
        }),
        "{events:?}"
    );
    assert_eq!(tokens_of(&events, a), [100]);
    assert!(s.resident(seq_b).is_empty());
    assert_eq!(s.resident(seq_a), [1, 2, 3]);
    assert_eq!(s.stats().refused, 1);
    let events = run_to_end(&mut s);
    assert_eq!(finish_of(&events, a), Some(Finish::MaxTokens));
    assert_eq!(tokens_of(&events, a).len(), 3, "a's other three tokens");
    assert!(tokens_of(&events, b).is_empty());
}

/// A step the worker never got (it had died) fails nothing that had not
/// drawn: the step's generations run again from their prompts on the next
/// worker. One that had drawn tokens fails (it was running on the dead
/// worker), and so do the generations of a step the worker did get.
#[test]
fn a_step_the_dead_worker_never_got_runs_again() {
    let mut s = SchedulerState::new(4096, 2, 512);
    let a = s.admit(admit(1, &[1, 2, 3], 5)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    assert_eq!(step.gens, vec![a]);
    let events = s.step_done(&step, Err(StepError::NotDelivered("worker died".into())));
    assert_eq!(events, vec![], "nothing of a ran, so nothing fails");
    assert!(
        s.resident(0).is_empty(),
        "the dead worker's KV is forgotten"
    );
    // It runs again, from its prompt, to its end.
    let events = run_to_end(&mut s);
    assert_eq!(finish_of(&events, a), Some(Finish::MaxTokens));
    assert_eq!(tokens_of(&events, a).len(), 5);

    // b has drawn; c waits for a sequence: the worker dies under a step of
    // b's that it never got. b fails, c runs.
    let mut s = SchedulerState::new(4096, 1, 512);
    let b = s.admit(admit(2, &[4, 5], 5)).unwrap();
    let c = s.admit(admit(3, &[6, 7], 2)).unwrap();
    let (step, _) = s.plan();
    let drawn = vec![Drawn {
        seq: 0,
        token: 9,
        eog: false,
        logprob: None,
        grammar_us: 0,
    }];
    s.step_done(&step.unwrap(), Ok(drawn));
    let (step, _) = s.plan();
    let events = s.step_done(&step.unwrap(), Err(StepError::NotDelivered("gone".into())));
    assert_eq!(
        events,
        vec![GenEvent::Failed {
            gen: b,
            message: "gone".into(),
            own: false,
        }]
    );
    let events = run_to_end(&mut s);
    assert_eq!(finish_of(&events, c), Some(Finish::MaxTokens));

    // A step the worker got fails its generations even before they drew.
    let mut s = SchedulerState::new(4096, 1, 512);
    let d = s.admit(admit(4, &[1], 3)).unwrap();
    let (step, _) = s.plan();
    let events = s.step_done(&step.unwrap(), Err(StepError::Failed("died".into())));
    assert_eq!(
        events,
        vec![GenEvent::Failed {
            gen: d,
            message: "died".into(),
            own: false,
        }]
    );
}

#[test]
fn qos_and_background_rate_and_batch_invariance() {
    let mut s = SchedulerState::new(4096, 1, 512);
    let low = s
        .admit(Admit {
            class: QosClass::Third,
            ..admit(1, &[1], 1)
        })
        .unwrap();
    let high = s
        .admit(Admit {
            class: QosClass::First,
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
        class: QosClass::Background,
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

    // Two invariant generations beside a shared one: each gets its turns.
    let mut s = SchedulerState::new(4096, 3, 512);
    for session in [1, 2] {
        s.admit(Admit {
            batch_invariant: true,
            ..admit(session, &[session as Token], 100)
        })
        .unwrap();
    }
    s.admit(admit(3, &[3], 100)).unwrap();
    let mut alone = [0; 3];
    for _ in 0..12 {
        let (step, _) = step_with(&mut s, |_| 5);
        let step = step.unwrap();
        if let [item] = step.decode.as_slice() {
            alone[item.seq as usize] += 1;
        }
    }
    assert_eq!(
        alone[..2],
        [3, 3],
        "each invariant one ran alone: {alone:?}"
    );
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
    // A newer pin over the whole budget yields alone: an older one that
    // fits stays protected (it lost its protection to the one that never
    // held, and was evicted as the least recently used).
    let mut s = SchedulerState::new(64, 2, 512).with_pin_budget_pct(25);
    s.set_clock(1_000);
    s.admit(admit(1, &[1; 6], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(admit(2, &[2; 20], 1)).unwrap();
    run_to_end(&mut s);
    s.pin(1, 60_000);
    s.set_clock(2_000);
    s.pin(2, 60_000);
    s.admit(admit(3, &[3; 6], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.resident(0), &[1; 6], "the older pin that fits holds");
    assert_ne!(s.resident(1), &[2; 20], "the pin over the budget yields");
}

#[test]
fn a_full_cache_evicts_idle_sequences_then_preempts_the_youngest() {
    let mut s = SchedulerState::new(4096, 3, 512);
    s.admit(admit(1, &[1; 8], 1)).unwrap();
    run_to_end(&mut s);
    let a = s.admit(admit(2, &[2; 8], 100)).unwrap();
    let b = s.admit(admit(3, &[3; 8], 100)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    // The worker says its cache is full: the idle sequence goes first.
    let events = s.step_done(&step, Err(StepError::KvFull { spilled: vec![] }));
    assert!(events.is_empty());
    let (step, _) = s.plan();
    let step = step.unwrap();
    assert!(step.ops.contains(&WorkerRequest::KvClear { seq: 0 }));
    assert_eq!(step.decode.len(), 2, "both retry");
    // Full again with nothing idle: the youngest waits off its sequence
    // (a_full_cache_preempts_the_youngest_which_goes_on_later), the other
    // goes on.
    let events = s.step_done(&step, Err(StepError::KvFull { spilled: vec![] }));
    assert!(events.is_empty(), "{events:?}");
    assert!(s.gens[&b].seq.is_none());
    let (step, _) = s.plan();
    assert_eq!(step.unwrap().gens, vec![a]);
}

#[test]
fn a_full_cache_evicts_idle_sequences_one_rank_at_a_time() {
    let mut s = SchedulerState::new(4096, 4, 512).with_pin_budget_pct(50);
    s.set_clock(1_000);
    // Three idle sessions, the oldest first; the middle one pinned.
    for session in 1..=3 {
        s.admit(admit(session, &[session as Token; 8], 1)).unwrap();
        run_to_end(&mut s);
    }
    assert_eq!(s.pin(2, 60_000), 60_000);
    s.admit(admit(4, &[4; 8], 100)).unwrap();
    let cleared = |step: &Step| -> Vec<u32> {
        step.ops
            .iter()
            .filter_map(|op| match op {
                WorkerRequest::KvClear { seq } => Some(*seq),
                _ => None,
            })
            .collect()
    };
    let (step, _) = s.plan();
    let mut step = step.unwrap();
    // Each KvFull evicts one more (8 cells cover the step's tokens):
    // the least recently used unpinned, the next one, the pinned one last.
    let mut order = vec![];
    for _ in 0..3 {
        assert!(s
            .step_done(&step, Err(StepError::KvFull { spilled: vec![] }))
            .is_empty());
        let (next, _) = s.plan();
        step = next.unwrap();
        let c = cleared(&step);
        assert_eq!(c.len(), 1, "one eviction per KvFull: {c:?}");
        order.extend(c);
    }
    assert_eq!(order, vec![0, 2, 1], "sessions 1, 3, then the pinned 2");
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

/// Whether `events` start `gen`.
fn started(events: &[GenEvent], gen: GenId) -> bool {
    events
        .iter()
        .any(|e| matches!(e, GenEvent::Started { gen: g, .. } if *g == gen))
}

#[test]
fn a_long_prompt_that_waits_for_room_is_not_passed_by_shorter_ones() {
    // 64 cells; a runs on 31 of them (its prompt and its next draw).
    let mut s = SchedulerState::new(64, 4, 512);
    let a = s.admit(admit(1, &[1; 30], 4)).unwrap();
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(started(&events, a));
    // big needs 41 cells: not beside a. small needs 9: it would fit beside
    // a, but not beside a and big's claim.
    let big = s.admit(admit(2, &[2; 40], 1)).unwrap();
    let small = s.admit(admit(3, &[3; 8], 1)).unwrap();
    let mut all = vec![];
    loop {
        let (step, events) = step_with(&mut s, |_| 5);
        all.extend(events.clone());
        if started(&events, big) {
            // a ended and left the room to big first, then the room beyond
            // it to small, in the same step.
            assert_eq!(finish_of(&all, a), Some(Finish::MaxTokens));
            assert!(started(&events, small), "41 + 9 cells fit in 64");
            break;
        }
        assert!(!started(&events, small), "small passed big: {all:?}");
        assert!(step.is_some(), "big never started: {all:?}");
    }
    run_to_end(&mut s);

    // A higher class is still admitted first: the class order comes before
    // the claim of a waiting lower one.
    let mut s = SchedulerState::new(64, 4, 512);
    let a = s.admit(admit(1, &[1; 30], 4)).unwrap();
    step_with(&mut s, |_| 5);
    let big = s
        .admit(Admit {
            class: QosClass::Second,
            ..admit(2, &[2; 40], 1)
        })
        .unwrap();
    let high = s.admit(admit(3, &[3; 8], 1)).unwrap();
    let low = s
        .admit(Admit {
            class: QosClass::Second,
            ..admit(4, &[4; 8], 1)
        })
        .unwrap();
    let (_, events) = step_with(&mut s, |_| 5);
    assert!(started(&events, high), "class 0 fits beside a: {events:?}");
    assert!(!started(&events, big) && !started(&events, low));
    let events = run_to_end(&mut s);
    assert_eq!(finish_of(&events, a), Some(Finish::MaxTokens));
    let order: Vec<GenId> = events
        .iter()
        .filter_map(|e| match e {
            GenEvent::Started { gen, .. } => Some(*gen),
            _ => None,
        })
        .collect();
    assert_eq!(order, vec![big, low], "low after big, never before");
}

#[test]
fn a_steady_stream_of_short_prompts_does_not_starve_a_long_one() {
    // 256 cells. a holds 62 and more for its 10 draws; big needs 201, so
    // it fits only beside at most 55 running cells.
    let mut s = SchedulerState::new(256, 12, 512);
    let a = s.admit(admit(1, &[1; 60], 10)).unwrap();
    let (_, mut all) = step_with(&mut s, |_| 5);
    let big = s.admit(admit(2, &[2; 200], 1)).unwrap();
    let mut smalls = vec![];
    let mut big_at = None;
    for k in 0..40u32 {
        // A short prompt every step, each from a session of its own: they
        // fit beside a, and the seven or so running at once (11 to 18
        // cells each) hold more than the 55 big can start beside.
        let g = s
            .admit(admit(u64::from(k) + 10, &[10 + k as Token; 10], 8))
            .unwrap();
        smalls.push(g);
        let (_, events) = step_with(&mut s, |_| 5);
        all.extend(events.clone());
        if started(&events, big) {
            big_at = Some(k);
            break;
        }
        for &g in &smalls {
            assert!(!started(&events, g), "a short prompt passed big at {k}");
        }
    }
    // As soon as a ended (one draw before the loop, one a step), not never.
    assert_eq!(finish_of(&all, a), Some(Finish::MaxTokens));
    assert!(big_at.is_some_and(|k| k <= 9), "big started at {big_at:?}");
    all.extend(run_to_end(&mut s));
    for g in smalls {
        assert_eq!(finish_of(&all, g), Some(Finish::MaxTokens));
    }
}

#[test]
fn a_lone_background_generation_runs_at_full_speed() {
    let mut s = SchedulerState::new(4096, 1, 512);
    s.set_background_divisor(4);
    let g = s
        .admit(Admit {
            class: QosClass::Background,
            ..admit(1, &[1], 3)
        })
        .unwrap();
    let events = run_to_end(&mut s);
    assert!(events.contains(&GenEvent::Finished {
        gen: g,
        finish: Finish::MaxTokens
    }));
}

/// A fake worker with the real one's contract: per-sequence KV contents, and
/// the real worker's sequence table (`SeqTable`: lengths, the last draw that
/// `DecodeNext` feeds, forgotten on any KV change and on any failure, EOG
/// skipped, and every request checked as the worker checks it). It draws a
/// function of the whole sequence, as a model would; `eog_at` ends a turn
/// when a sequence reaches that length.
struct FakeWorker {
    kv: Vec<Vec<Token>>,
    table: SeqTable,
    eog_at: Option<usize>,
    /// DecodeNext requests run.
    follows: usize,
    /// A DecodeNext step fails (KV full) when the cells in use are this many.
    fail_at: Option<usize>,
    /// Tokens decoded, prompt and fed draws.
    decoded: usize,
    /// The host-memory store: spilled sequences by key.
    store: std::collections::HashMap<u64, Vec<Token>>,
    /// `Spilled` replies of the step being run.
    spilled: Vec<(u64, u64)>,
    /// Restores fail (as when llama.cpp finds no room).
    fail_restores: bool,
    /// Park artifacts by session.
    parked: std::collections::HashMap<u64, Vec<Token>>,
}

/// What one token of spilled state takes in the fake worker's store.
const FAKE_BYTES_PER_TOKEN: u64 = 10;

/// The fake worker's context and vocabulary.
const FAKE_N_CTX: u32 = 4096;
const FAKE_N_VOCAB: u32 = 1000;

impl FakeWorker {
    fn new(n_seq: usize) -> FakeWorker {
        FakeWorker {
            kv: vec![vec![]; n_seq],
            table: SeqTable::new(n_seq as u32, FAKE_N_CTX, FAKE_N_VOCAB),
            eog_at: None,
            follows: 0,
            fail_at: None,
            decoded: 0,
            store: Default::default(),
            spilled: vec![],
            fail_restores: false,
            parked: Default::default(),
        }
    }

    fn draw(&self, seq: usize) -> Drawn {
        let kv = &self.kv[seq];
        let h = kv
            .iter()
            .fold(7u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64));
        let token = if self.eog_at == Some(kv.len()) {
            EOG
        } else {
            100 + (h % 50) as Token
        };
        Drawn {
            seq: seq as u32,
            token,
            eog: token == EOG,
            logprob: None,
            grammar_us: 0,
        }
    }

    fn decode(&mut self, items: &[DecodeItem]) -> Result<Vec<Drawn>, RequestError> {
        self.table.validate_decode(items)?;
        let mut drawn = vec![];
        for item in items {
            let s = item.seq as usize;
            self.kv[s].extend_from_slice(&item.tokens);
            self.decoded += item.tokens.len();
            if item.sample.is_some() {
                drawn.push(self.draw(s));
            }
        }
        self.table.decoded(items, &drawn);
        Ok(drawn)
    }

    /// Sets what sequence `s` holds after a KV operation.
    fn kv_op(&mut self, s: usize, tokens: Vec<Token>) {
        self.table.set_len(s, tokens.len() as u32);
        self.table.kv_changed(s);
        self.kv[s] = tokens;
    }

    /// Runs one step's requests, as the lane sends them.
    fn run(&mut self, requests: &[WorkerRequest]) -> StepResult {
        self.spilled.clear();
        // Like the lane, every request runs and the first failure is the
        // step's: a failed restore leaves its sequence empty, and the
        // decode behind it is then refused untouched.
        // Failed restores are read together, with whether the decode went
        // through beside them (StepOutput::from_replies).
        let mut first_err = None;
        let mut not_restored = vec![];
        let mut decoded = false;
        let mut drawn = vec![];
        for request in requests {
            match self.run_one(request) {
                Ok(Some(d)) => {
                    decoded = true;
                    drawn = d;
                }
                Ok(None) => {}
                Err(StepError::NotRestored { seqs, .. }) => not_restored.extend(seqs),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if !not_restored.is_empty() {
            // The worker keeps its draws (a failed restore is not a failed
            // request); what decoded beside it is trimmed by the scheduler.
            return Err(StepError::NotRestored {
                seqs: not_restored,
                decoded,
                spilled: self.spilled.clone(),
                unparked: vec![],
            });
        }
        if let Some(e) = first_err {
            self.table.forget_draws();
            // A full cache keeps the step's spills (StepOutput::from_replies).
            return Err(match e {
                StepError::KvFull { .. } => StepError::KvFull {
                    spilled: self.spilled.clone(),
                },
                e => e,
            });
        }
        Ok(StepOutput {
            drawn,
            spilled: self.spilled.clone(),
            ..StepOutput::default()
        })
    }

    fn run_one(&mut self, request: &WorkerRequest) -> Result<Option<Vec<Drawn>>, StepError> {
        let failed = |e: RequestError| StepError::Failed(e.to_string());
        let mut drawn = vec![];
        {
            match request {
                WorkerRequest::KvSpill { seq, key, len } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    let bytes = if self.kv[s].len() == *len as usize {
                        self.store.insert(*key, self.kv[s].clone());
                        *len as u64 * FAKE_BYTES_PER_TOKEN
                    } else {
                        0
                    };
                    self.spilled.push((*key, bytes));
                    return Ok(None);
                }
                WorkerRequest::KvRestore {
                    seq,
                    key,
                    len,
                    keep,
                } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    self.kv_op(s, vec![]);
                    let stored = match keep {
                        true => self.store.get(key).cloned(),
                        false => self.store.remove(key),
                    };
                    match stored {
                        Some(t) if !self.fail_restores && t.len() >= *len as usize => {
                            self.kv_op(s, t[..*len as usize].to_vec());
                        }
                        _ => {
                            return Err(StepError::NotRestored {
                                seqs: vec![*seq],
                                decoded: false,
                                spilled: vec![],
                                unparked: vec![],
                            })
                        }
                    }
                    return Ok(None);
                }
                WorkerRequest::KvDrop { key } => {
                    self.store.remove(key);
                    return Ok(None);
                }
                WorkerRequest::MediaLayout { .. } => return Ok(None),
                WorkerRequest::KvPark {
                    seq,
                    session,
                    tokens,
                } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    if self.kv[s] == *tokens {
                        self.parked.insert(*session, tokens.clone());
                    }
                    return Ok(None);
                }
                WorkerRequest::KvUnpark {
                    seq,
                    session,
                    tokens,
                    len,
                } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    self.kv_op(s, vec![]);
                    match self.parked.get(session) {
                        Some(t) if t == tokens && t.len() >= *len as usize => {
                            let t = t[..*len as usize].to_vec();
                            self.kv_op(s, t);
                        }
                        _ => {
                            return Err(StepError::NotRestored {
                                seqs: vec![*seq],
                                decoded: false,
                                spilled: vec![],
                                unparked: vec![],
                            })
                        }
                    }
                    return Ok(None);
                }
                WorkerRequest::KvTrim { seq, from } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    if (*from as usize) < self.kv[s].len() {
                        let kept = self.kv[s][..*from as usize].to_vec();
                        self.kv_op(s, kept);
                    }
                }
                WorkerRequest::KvClear { seq } => {
                    let s = self.table.check_seq(*seq).map_err(failed)?;
                    self.kv_op(s, vec![]);
                }
                WorkerRequest::KvCopy { src, dst, len } => {
                    let (s, d) = self.table.check_copy(*src, *dst, *len).map_err(failed)?;
                    let copied = self.kv[s][..*len as usize].to_vec();
                    self.kv_op(d, copied);
                }
                WorkerRequest::Decode { items } => {
                    drawn = self.decode(items).map_err(failed)?;
                }
                WorkerRequest::DecodeNext { items } => {
                    self.follows += 1;
                    self.table.validate_next(items).map_err(failed)?;
                    let before: Vec<usize> = self.kv.iter().map(Vec::len).collect();
                    for j in 0..items.iter().map(|i| i.steps).max().unwrap_or(0) {
                        let plain: Vec<DecodeItem> = items
                            .iter()
                            .filter(|i| j < i.steps)
                            .filter_map(|i| {
                                let d = self.table.next_input(i.seq)?;
                                Some(DecodeItem {
                                    media: vec![],
                                    seq: i.seq,
                                    pos: self.table.len(i.seq)?,
                                    tokens: vec![d.token],
                                    sample: Some(i.sample.clone()),
                                })
                            })
                            .collect();
                        if plain.is_empty() {
                            break;
                        }
                        let used: usize = self.kv.iter().map(Vec::len).sum();
                        if self.fail_at == Some(used) {
                            self.fail_at = None;
                            for (seq, kv) in self.kv.iter_mut().enumerate() {
                                kv.truncate(before[seq]);
                                self.table.set_len(seq, before[seq] as u32);
                            }
                            return Err(StepError::KvFull { spilled: vec![] });
                        }
                        drawn.extend(self.decode(&plain).map_err(failed)?);
                    }
                }
                WorkerRequest::Shutdown => {}
            }
        }
        Ok(matches!(
            request,
            WorkerRequest::Decode { .. } | WorkerRequest::DecodeNext { .. }
        )
        .then_some(drawn))
    }
}

/// Drives a scheduler through the actor's own `Pipeline`, with `depth` steps
/// in flight; the worker runs each step when it is sent, and its replies
/// come back in order. `between(k, s)` runs before the k-th reply is taken.
/// Returns every event.
fn drive(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    depth: usize,
    between: impl FnMut(usize, &mut SchedulerState) -> Vec<GenEvent>,
) -> Vec<GenEvent> {
    drive_clocked(s, w, depth, |_| 0, between)
}

/// `drive` with the clock at `now_ms`.
fn drive_at(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    depth: usize,
    now_ms: u64,
    between: impl FnMut(usize, &mut SchedulerState) -> Vec<GenEvent>,
) -> Vec<GenEvent> {
    drive_clocked(s, w, depth, |_| now_ms, between)
}

/// `drive` with the clock at `clock(k)` when step `k` is planned.
fn drive_clocked(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    depth: usize,
    clock: impl Fn(usize) -> u64,
    mut between: impl FnMut(usize, &mut SchedulerState) -> Vec<GenEvent>,
) -> Vec<GenEvent> {
    let mut events = vec![];
    let mut pipeline = Pipeline::new(depth);
    let mut replies: VecDeque<(StepId, StepResult)> = VecDeque::new();
    for k in 0..10_000 {
        let (sent, planned) = pipeline.kick(s, clock(k));
        events.extend(planned);
        for (id, requests) in sent {
            replies.push_back((id, w.run(&requests)));
        }
        let Some((id, r)) = replies.pop_front() else {
            return events;
        };
        events.extend(between(k, s));
        let failed = r.is_err();
        events.extend(pipeline.arrived(s, id, r));
        if pipeline.is_empty() && !failed {
            for seq in 0..w.kv.len() {
                assert_eq!(
                    s.resident(seq as u32),
                    &w.kv[seq][..],
                    "seq {seq} after step {k}"
                );
            }
        }
    }
    panic!("did not finish");
}

fn tokens_of(events: &[GenEvent], gen: GenId) -> Vec<Token> {
    events
        .iter()
        .filter_map(|e| match e {
            GenEvent::Token { gen: g, token, .. } if *g == gen => Some(*token),
            _ => None,
        })
        .collect()
}

fn finish_of(events: &[GenEvent], gen: GenId) -> Option<Finish> {
    events.iter().find_map(|e| match e {
        GenEvent::Finished { gen: g, finish } if *g == gen => Some(*finish),
        _ => None,
    })
}

#[test]
fn pipelined_steps_draw_what_lockstep_draws() {
    for eog_at in [None, Some(9), Some(30)] {
        let run = |depth| {
            let mut s = SchedulerState::new(4096, 4, 8);
            let mut w = FakeWorker::new(4);
            w.eog_at = eog_at;
            let a = s.admit(admit(1, &[1, 2, 3, 4, 5], 20)).unwrap();
            let b = s.admit(admit(2, &[9, 8, 7], 25)).unwrap();
            // A third arrives mid-way and a fourth later, with a long prompt.
            let mut late = vec![];
            let events = drive(&mut s, &mut w, depth, |k, s| {
                if k == 2 {
                    late.push(s.admit(admit(3, &[4, 4, 4], 7)).unwrap());
                }
                if k == 5 {
                    let long: Vec<Token> = (0..30).collect();
                    late.push(s.admit(admit(4, &long, 12)).unwrap());
                }
                vec![]
            });
            let gens = [a, b, late[0], late[1]];
            let out: Vec<_> = gens
                .iter()
                .map(|&g| (tokens_of(&events, g), finish_of(&events, g)))
                .collect();
            (out, s.stats(), w.follows)
        };
        let (lockstep, st1, f1) = run(1);
        let (pipelined, st2, f2) = run(2);
        assert_eq!((f1, f2 > 3), (0, true), "steps followed");
        assert_eq!(lockstep, pipelined, "eog_at {eog_at:?}");
        assert!(lockstep.iter().all(|(_, f)| f.is_some()));
        assert_eq!(st1.drawn, st2.drawn);
        if eog_at.is_none() {
            assert_eq!(lockstep[0].0.len(), 20);
            assert_eq!(lockstep[0].1, Some(Finish::MaxTokens));
        }
    }
}

#[test]
fn follow_waits_for_what_changes_the_batch() {
    let mut s = SchedulerState::new(4096, 4, 512);
    s.admit(admit(1, &[1, 2, 3], 10)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    // The next step follows the first at once, fed by the worker.
    let next = s.follow(&step).expect("a following step");
    assert!(next.decode.is_empty() && next.ops.is_empty());
    assert_eq!(next.next[0].pos, 3);
    assert_eq!(next.next[0].sample.draw_pos, 4);
    assert!(matches!(
        &next.requests()[..],
        [WorkerRequest::DecodeNext { items }] if items.len() == 1 && items[0].pos == 3
    ));
    // An admission waiting for a sequence: no following step.
    s.admit(admit(2, &[5, 6], 10)).unwrap();
    assert!(s.follow(&next).is_none());

    // A grammar holds the pipeline back too.
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut g = admit(1, &[1, 2, 3], 10);
    g.grammar = Some("root ::= \"a\"".into());
    s.admit(g).unwrap();
    let (step, _) = s.plan();
    assert!(s.follow(&step.unwrap()).is_none());

    // So does a prefill still in progress.
    let mut s = SchedulerState::new(4096, 2, 4);
    s.admit(admit(1, &(0..10).collect::<Vec<_>>(), 10)).unwrap();
    let (step, _) = s.plan();
    assert!(s.follow(&step.unwrap()).is_none());

    // And a generation at its max_tokens is not stepped again.
    let mut s = SchedulerState::new(4096, 2, 512);
    s.admit(admit(1, &[1, 2, 3], 1)).unwrap();
    let (step, _) = s.plan();
    assert!(s.follow(&step.unwrap()).is_none());
}

#[test]
fn a_lane_reset_heard_while_a_step_is_in_flight_is_kept_until_it_answers() {
    // The worker answered two steps (one queued behind the other), then
    // died; the scheduler hears of the death before it reads the answers.
    // The cells are gone all the same: once the last answer is in, the
    // state forgets them, and nothing is sent meanwhile (a step planned on
    // them would run on the next worker).
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut w = FakeWorker::new(2);
    let mut pipeline = Pipeline::new(2);
    let gen = s.admit(admit(1, &[1, 2, 3], 100)).unwrap();
    let (sent, _) = pipeline.kick(&mut s, 0);
    assert_eq!(sent.len(), 2, "a step and the one following it");
    let answers: Vec<(StepId, StepResult)> = sent
        .into_iter()
        .map(|(id, requests)| (id, w.run(&requests)))
        .collect();
    assert!(answers.iter().all(|(_, a)| a.is_ok()));
    assert!(pipeline.lane_reset(&mut s, "the worker died").is_empty());
    let mut answers = answers.into_iter();
    let (id, answer) = answers.next().unwrap();
    let mut events = pipeline.arrived(&mut s, id, answer);
    let (sent, _) = pipeline.kick(&mut s, 0);
    assert!(sent.is_empty(), "a step was sent before the reset");
    let (id, answer) = answers.next().unwrap();
    events.extend(pipeline.arrived(&mut s, id, answer));
    assert!(!tokens_of(&events, gen).is_empty());
    assert!(
        events.iter().any(
            |e| matches!(e, GenEvent::Failed { gen: g, message, own: false } if *g == gen && message == "the worker died")
        ),
        "{events:?}"
    );
    assert!(s.resident(0).is_empty() && s.resident(1).is_empty());
    // With nothing in flight, a reset forgets the cells at once.
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut w = FakeWorker::new(2);
    let mut pipeline = Pipeline::new(1);
    s.admit(admit(1, &[1, 2, 3], 1)).unwrap();
    let (sent, _) = pipeline.kick(&mut s, 0);
    let (id, requests) = sent.into_iter().next().unwrap();
    let answer = w.run(&requests);
    pipeline.arrived(&mut s, id, answer);
    assert!(!s.resident(0).is_empty() || !s.resident(1).is_empty());
    pipeline.lane_reset(&mut s, "unloaded");
    assert!(s.resident(0).is_empty() && s.resident(1).is_empty());
}

#[test]
fn nothing_follows_a_step_holding_an_image() {
    // A short prompt whose image the worker could refuse on its own: the
    // next step waits for that reply (a step queued behind a refused item
    // would decode past cells that are not there).
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut g = admit(1, &[1, MEDIA_TOKEN, MEDIA_TOKEN, MEDIA_TOKEN, 5], 10);
    g.media = vec![MediaSpan {
        at: 1,
        len: 3,
        blob: "ab".repeat(32),
    }];
    s.admit(g).unwrap();
    let step = s.plan().0.unwrap();
    assert_eq!(step.decode[0].media.len(), 1);
    assert!(s.follow(&step).is_none());
    // The same prompt without an image is followed at once.
    let mut s = SchedulerState::new(4096, 2, 512);
    s.admit(admit(1, &[1, 2, 3, 4, 5], 10)).unwrap();
    let step = s.plan().0.unwrap();
    assert!(s.follow(&step).is_some());
}

#[test]
fn a_generation_admitted_during_a_long_prefill_joins_the_next_step() {
    let mut s = SchedulerState::new(4096, 4, 512);
    let long: Vec<Token> = (0..FOLLOW_MAX_PREFILL as Token + 1).collect();
    let a = s.admit(admit(1, &long, 10)).unwrap();
    let step = s.plan().0.unwrap();
    // Nothing is queued behind a long prefill...
    assert!(s.follow(&step).is_none());
    // ...so a generation admitted while it runs is in the very next step,
    // not behind FOLLOW_STEPS of the first one's draws.
    let b = s.admit(admit(2, &[5, 6, 7], 10)).unwrap();
    let drawn = drew(0, 100);
    assert_eq!(tokens_of(&s.step_done(&step, Ok(drawn)), a), [100]);
    let next = s.plan().0.unwrap();
    assert_eq!(next.gens, [a, b]);
    assert_eq!(next.decode[1].tokens, [5, 6, 7]);
    // A prompt of FOLLOW_MAX_PREFILL tokens is still followed, and so is a
    // step of more one-token items than that (a decode of many streams).
    let mut s = SchedulerState::new(4096, 4, 512);
    s.admit(admit(1, &long[..FOLLOW_MAX_PREFILL], 10)).unwrap();
    let step = s.plan().0.unwrap();
    assert!(s.follow(&step).is_some());
    let n = FOLLOW_MAX_PREFILL as u32 + 6;
    let mut s = SchedulerState::new(4096, n, 512);
    for k in 0..n {
        s.admit(admit(u64::from(k) + 1, &[k + 10], 10)).unwrap();
    }
    let step = s.plan().0.unwrap();
    assert_eq!(step.decode.len(), n as usize);
    assert!(s.follow(&step).is_some());
}

#[test]
fn a_cancel_during_a_followed_step_drops_the_extra_draws() {
    let run = |depth| {
        let mut s = SchedulerState::new(4096, 2, 512);
        let mut w = FakeWorker::new(2);
        let g = s.admit(admit(1, &[1, 2, 3], 50)).unwrap();
        let events = drive(&mut s, &mut w, depth, |k, s| {
            if k == 3 {
                s.cancel(g)
            } else {
                vec![]
            }
        });
        (
            tokens_of(&events, g),
            finish_of(&events, g),
            s.resident(0).to_vec(),
        )
    };
    let (t1, f1, r1) = run(1);
    let (t2, f2, r2) = run(2);
    assert_eq!((f1, f2), (Some(Finish::Cancelled), Some(Finish::Cancelled)));
    // Pipelined, the cancel lands a few tokens later; the tokens are the
    // same stream, and the KV holds them (and draws past them, which the
    // next turn trims).
    assert!(t2.len() > t1.len() && t2.len() <= t1.len() + 2 * FOLLOW_STEPS as usize);
    assert_eq!(&t2[..t1.len()], &t1[..]);
    assert_eq!(
        &r2[..3 + t2.len() - 1],
        &[&[1, 2, 3][..], &t2[..t2.len() - 1]].concat()[..]
    );
    assert_eq!(r1.len(), 3 + t1.len() - 1);
}

#[test]
fn a_follow_step_stops_at_max_tokens_and_the_context() {
    // max_tokens 6 = 1 planned + 4 + 1: the second following step asks 1.
    let mut s = SchedulerState::new(4096, 1, 512);
    s.admit(admit(1, &[1, 2, 3], 6)).unwrap();
    let (step, _) = s.plan();
    let a = s.follow(&step.unwrap()).unwrap();
    assert_eq!(a.next[0].steps, FOLLOW_STEPS);
    assert_eq!((a.next[0].pos, a.next[0].sample.draw_pos), (3, 4));
    let b = s.follow(&a).unwrap();
    assert_eq!(b.next[0].steps, 1);
    assert_eq!((b.next[0].pos, b.next[0].sample.draw_pos), (7, 8));
    assert!(s.follow(&b).is_none());
    // A 16-cell context: 3 prompt + 1 drawn + 4 + 4, then 16 - 12 - 1 = 3.
    let mut s = SchedulerState::new(16, 1, 512);
    s.admit(admit(1, &[1, 2, 3], 100)).unwrap();
    let (step, _) = s.plan();
    let mut last = step.unwrap();
    let mut asked = vec![];
    while let Some(n) = s.follow(&last) {
        asked.push(n.next[0].steps);
        last = n;
    }
    assert_eq!(asked, [4, 4, 3]);
}

#[test]
fn a_failed_follow_step_rolls_back_and_the_generation_retries() {
    for fail_at in [6, 9, 13] {
        let mut s = SchedulerState::new(4096, 2, 512);
        let mut w = FakeWorker::new(2);
        w.fail_at = Some(fail_at);
        // An idle sequence to evict when the cache is "full".
        let idle = s.admit(admit(2, &[7, 7], 1)).unwrap();
        drive(&mut s, &mut w, 2, |_, _| vec![]);
        let g = s.admit(admit(1, &[1, 2, 3], 20)).unwrap();
        let events = drive(&mut s, &mut w, 2, |_, _| vec![]);
        assert_ne!(idle, g);
        assert_eq!(
            finish_of(&events, g),
            Some(Finish::MaxTokens),
            "fail_at {fail_at}"
        );
        assert_eq!(tokens_of(&events, g).len(), 20);
        let mut w2 = FakeWorker::new(2);
        let mut s2 = SchedulerState::new(4096, 2, 512);
        let g2 = s2.admit(admit(1, &[1, 2, 3], 20)).unwrap();
        let clean = drive(&mut s2, &mut w2, 1, |_, _| vec![]);
        assert_eq!(tokens_of(&events, g), tokens_of(&clean, g2));
    }
}

#[test]
fn a_failed_step_drops_the_step_behind_it() {
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut w = FakeWorker::new(2);
    let g = s.admit(admit(1, &[1, 2, 3], 50)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    let next = s.follow(&step).unwrap();
    // The worker's cache was full for the first step: it rolls back, and the
    // step behind it has no draw to follow.
    let events = s.step_done(&step, Err(StepError::KvFull { spilled: vec![] }));
    assert!(w.run(&next.requests()).is_err());
    // The generation lived on (there was nothing idle to evict, so the
    // youngest, itself, ended) or retries: either way the state is
    // consistent with the worker, and nothing waits on a dropped step.
    let finished = finish_of(&events, g);
    let rest = drive(&mut s, &mut w, 2, |_, _| vec![]);
    assert!(finished.is_some() || finish_of(&rest, g).is_some());
    for seq in 0..2 {
        assert_eq!(s.resident(seq), &w.kv[seq as usize][..]);
    }
}

#[test]
fn a_full_cache_on_a_following_step_falls_back_to_single_steps() {
    let mut s = SchedulerState::new(4096, 1, 512);
    let g = s.admit(admit(1, &[1, 2, 3], 50)).unwrap();
    let step = s.plan().0.unwrap();
    let next = s.follow(&step).unwrap();
    let drawn = drew(0, 100);
    assert_eq!(tokens_of(&s.step_done(&step, Ok(drawn)), g), [100]);
    // The 4 cells the following step asked for are not there: nothing ends.
    let events = s.step_done(&next, Err(StepError::KvFull { spilled: vec![] }));
    assert!(events.is_empty(), "{events:?}");
    // One token at a time now, and no following step until room is freed.
    let single = s.plan().0.unwrap();
    assert!(single.next.is_empty());
    assert_eq!(single.decode[0].tokens, [100]);
    assert!(s.follow(&single).is_none());
    // When even one token does not fit, the youngest generation ends.
    let events = s.step_done(&single, Err(StepError::KvFull { spilled: vec![] }));
    assert_eq!(finish_of(&events, g), Some(Finish::Error));
}

fn stateless(prompt: &[Token], max_tokens: u32) -> Admit {
    admit(NO_SESSION, prompt, max_tokens)
}

fn warm_of(events: &[GenEvent], gen: GenId) -> Option<u64> {
    events.iter().find_map(|e| match e {
        GenEvent::Started {
            gen: g,
            warm_prefix,
            ..
        } if *g == gen => Some(*warm_prefix),
        _ => None,
    })
}

#[test]
fn cached_prefixes_are_evicted_before_sessions() {
    // 32 cells, 3 sequences: a session's idle sequence (the older one) and
    // a cached prefix (the newer one).
    let mut s = SchedulerState::new(32, 3, 512);
    s.admit(admit(1, &[1; 10], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[2; 10], 1)).unwrap();
    run_to_end(&mut s);
    // A new session needs 16 cells: one of the two must go, and it is the
    // cached prefix, though it was used last.
    s.admit(admit(3, &[3; 15], 1)).unwrap();
    let (step, _) = step_with(&mut s, |_| 5);
    let step = step.unwrap();
    assert!(step.ops.contains(&WorkerRequest::KvClear { seq: 1 }));
    assert!(!step.ops.contains(&WorkerRequest::KvClear { seq: 0 }));
    run_to_end(&mut s);
    assert_eq!(s.resident(0), &[1; 10], "the session's sequence stays");
    assert!(s.resident(1).is_empty());

    // With no free sequence, a new generation runs on the cached prefix's
    // sequence, not the session's.
    let mut s = SchedulerState::new(4096, 2, 512);
    s.admit(admit(1, &[1; 10], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[2; 10], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(admit(3, &[3; 10], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.resident(0), &[1; 10]);
    assert_eq!(s.resident(1), &[3; 10]);
}

#[test]
fn identical_prompts_admitted_together_prefill_once() {
    let prompt: Vec<Token> = (0..40).collect();
    let mut s = SchedulerState::new(4096, 4, 16);
    let mut w = FakeWorker::new(4);
    // The forks are seeded from the first while it still runs.
    let gens: Vec<GenId> = (0..3)
        .map(|_| s.admit(stateless(&prompt, 3)).unwrap())
        .collect();
    let events = drive(&mut s, &mut w, 2, |_, _| vec![]);
    let warm: Vec<Option<u64>> = gens.iter().map(|&g| warm_of(&events, g)).collect();
    let n = prompt.len() as u64;
    assert_eq!(warm, [Some(0), Some(n - 1), Some(n - 1)]);
    // The prompt once, then each fork's last prompt token for its logits.
    assert_eq!(s.stats().prefilled_tokens, n + 2);
    // The worker decoded as much, and the two draws of each fed back.
    assert_eq!(w.decoded, n as usize + 2 + 3 * 2);
    // Seeded from the same prefill, they draw the same tokens.
    let drawn: Vec<Vec<Token>> = gens.iter().map(|&g| tokens_of(&events, g)).collect();
    assert!(drawn.iter().all(|t| t.len() == 3 && *t == drawn[0]));
}

#[test]
fn a_long_shared_prefix_waits_for_the_running_prefill() {
    let a: Vec<Token> = (0..1500).map(|t| t % 97).collect();
    let b: Vec<Token> = a[..1200].iter().copied().chain([500; 300]).collect();
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut w = FakeWorker::new(2);
    let ga = s.admit(stateless(&a, 1)).unwrap();
    let gb = s.admit(stateless(&b, 1)).unwrap();
    let events = drive(&mut s, &mut w, 2, |_, _| vec![]);
    assert_eq!(warm_of(&events, ga), Some(0));
    assert_eq!(warm_of(&events, gb), Some(1200));
    assert_eq!(s.stats().prefilled_tokens, 1500 + 300);
    assert_eq!(finish_of(&events, gb), Some(Finish::MaxTokens));

    // Sharing less than WAIT_MIN_SHARED, the second does not wait.
    let c: Vec<Token> = a[..WAIT_MIN_SHARED - 1]
        .iter()
        .copied()
        .chain([500; 300])
        .collect();
    let mut s = SchedulerState::new(4096, 2, 512);
    let mut w = FakeWorker::new(2);
    s.admit(stateless(&a, 1)).unwrap();
    let gc = s.admit(stateless(&c, 1)).unwrap();
    let events = drive(&mut s, &mut w, 2, |_, _| vec![]);
    assert_eq!(warm_of(&events, gc), Some(0));
    assert_eq!(s.stats().prefilled_tokens, (1500 + c.len()) as u64);
}

#[test]
fn a_waiter_runs_when_the_generation_it_waits_on_is_cancelled() {
    let prompt: Vec<Token> = (0..40).collect();
    let mut s = SchedulerState::new(4096, 2, 8);
    let mut w = FakeWorker::new(2);
    let a = s.admit(stateless(&prompt, 5)).unwrap();
    let b = s.admit(stateless(&prompt, 5)).unwrap();
    let events = drive(&mut s, &mut w, 2, |k, s| {
        if k == 1 {
            // b is still waiting: a's prefill is 8 tokens a step.
            assert_eq!(s.gens[&b].seq, None);
            s.cancel(a)
        } else {
            vec![]
        }
    });
    assert_eq!(finish_of(&events, a), Some(Finish::Cancelled));
    assert_eq!(finish_of(&events, b), Some(Finish::MaxTokens));
    // b took what a had prefilled (two 8-token chunks) and computed the rest.
    assert_eq!(warm_of(&events, b), Some(16));
    assert_eq!(tokens_of(&events, b).len(), 5);
    assert_eq!(s.stats().prefilled_tokens, prompt.len() as u64);

    // A waiter whose awaited generation fails stops waiting and runs: the
    // step failed only what it held, and nothing waits on a dead generation.
    let mut s = SchedulerState::new(4096, 2, 8);
    let a = s.admit(stateless(&prompt, 5)).unwrap();
    let b = s.admit(stateless(&prompt, 5)).unwrap();
    let (step, _) = s.plan();
    let step = step.unwrap();
    assert_eq!(step.gens, vec![a], "b waits for a's prefill");
    let failed = s.step_done(&step, Err(StepError::Failed("boom".into())));
    assert_eq!(
        failed,
        vec![GenEvent::Failed {
            gen: a,
            message: "boom".into(),
            own: false,
        }]
    );
    let c = s.admit(stateless(&prompt, 1)).unwrap();
    let events = run_to_end(&mut s);
    assert_eq!(finish_of(&events, b), Some(Finish::MaxTokens));
    assert_eq!(finish_of(&events, c), Some(Finish::MaxTokens));
}

#[test]
fn a_prefix_pin_protects_a_cached_prefix_until_its_ttl() {
    let pin = |len| Some(PrefixPin { len, ttl_ms: 4_000 });
    let mut s = SchedulerState::new(64, 3, 512).with_pin_budget_pct(50);
    s.set_clock(1_000);
    // Pinned (older) and unpinned (newer) cached prefixes.
    s.admit(Admit {
        pin: pin(20),
        ..stateless(&[1; 20], 1)
    })
    .unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[2; 20], 1)).unwrap();
    run_to_end(&mut s);
    // A later request seeded from the pinned prefix copies it and leaves
    // its protection in place.
    let hit: Vec<Token> = [1; 20].iter().copied().chain([7; 9]).collect();
    let g = s.admit(stateless(&hit, 1)).unwrap();
    let events = run_to_end(&mut s);
    assert_eq!(warm_of(&events, g), Some(20));
    assert_eq!(
        s.resident(0),
        &[1; 20],
        "the pinned prefix is copied, not taken"
    );
    // Pressure: a 30-token request needs room; the unpinned prefixes go.
    s.admit(stateless(&[3; 30], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.resident(0), &[1; 20], "the pinned prefix stays");
    // Past its ttl it is evictable like any other, oldest first.
    s.set_clock(5_000);
    s.admit(stateless(&[4; 30], 1)).unwrap();
    run_to_end(&mut s);
    assert_ne!(s.resident(0), &[1; 20]);

    // A pin larger than the budget protects nothing.
    let mut s = SchedulerState::new(64, 3, 512).with_pin_budget_pct(10);
    s.set_clock(1_000);
    s.admit(Admit {
        pin: pin(20),
        ..stateless(&[1; 20], 1)
    })
    .unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[2; 20], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[3; 30], 1)).unwrap();
    run_to_end(&mut s);
    assert!(s.resident(0).is_empty(), "over budget, the oldest goes");

    // What counts against the budget is the pinned prefix (`len`), not the
    // whole sequence: 10 of a 30-token sequence fit 25% of 64 cells.
    let mut s = SchedulerState::new(64, 3, 512).with_pin_budget_pct(25);
    s.set_clock(1_000);
    s.admit(Admit {
        pin: pin(10),
        ..stateless(&[1; 30], 1)
    })
    .unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[2; 10], 1)).unwrap();
    run_to_end(&mut s);
    s.admit(stateless(&[3; 30], 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(
        s.resident(0),
        &[1; 30],
        "the pin protects the whole sequence"
    );
}

/// Sampling extras are checked at admission, ride on every draw the generation asks for (planned
/// and following steps alike, naming the generation's first draw), and the log-probabilities a
/// draw brings come back on its `GenEvent::Token`.
#[test]
fn extras_reach_every_draw_and_logprobs_come_back() {
    let extras = SampleExtras {
        presence_penalty: 0.5,
        frequency_penalty: 1.0,
        logit_bias: vec![(7, -100.0)],
        logprobs: Some(2),
    };
    let mut s = SchedulerState::new(4096, 2, 512).with_n_vocab(1000);
    let bad = |x: SampleExtras| Admit {
        extras: Some(x),
        ..admit(1, &[1, 2, 3], 10)
    };
    let refused = s.admit(bad(SampleExtras {
        logit_bias: vec![(1000, 1.0)],
        ..extras.clone()
    }));
    assert_eq!(
        refused.unwrap_err().to_string(),
        "logit_bias: token id 1000 is not in the vocabulary (1000 tokens)"
    );
    assert!(s
        .admit(bad(SampleExtras {
            frequency_penalty: 3.0,
            ..extras.clone()
        }))
        .is_err());
    let g = s.admit(bad(extras.clone())).unwrap();
    let plain = s.admit(admit(2, &[5, 6], 10)).unwrap();
    let want = Some(DrawExtras {
        extras: extras.clone(),
        first_draw: 3,
    });
    let step = s.plan().0.unwrap();
    let sample_of = |seq: u32| {
        step.decode
            .iter()
            .find(|i| i.seq == seq)
            .and_then(|i| i.sample.clone())
            .unwrap()
    };
    assert_eq!(sample_of(0).extras, want);
    assert_eq!(sample_of(1).extras, None);
    let next = s.follow(&step).unwrap();
    assert_eq!(next.next[0].sample.extras, want);
    assert_eq!(next.next[1].sample.extras, None);
    let lp = TokenLogprob {
        logprob: -0.25,
        top: vec![(100, -0.25), (101, -2.0)],
    };
    let drawn = vec![
        Drawn {
            seq: 0,
            token: 100,
            eog: false,
            logprob: Some(lp.clone()),
            grammar_us: 0,
        },
        Drawn {
            seq: 1,
            token: 100,
            eog: false,
            logprob: None,
            grammar_us: 0,
        },
    ];
    let events = s.step_done(&step, Ok(drawn));
    assert!(events.contains(&GenEvent::Token {
        gen: g,
        token: 100,
        logprob: Some(lp)
    }));
    assert!(events.contains(&GenEvent::Token {
        gen: plain,
        token: 100,
        logprob: None
    }));
}

// --- The host-memory tier (spill, restore) ---

/// A scheduler of `n_seq` sequences with the host-memory tier on
/// (`budget` bytes; sequences of 4 tokens and more are spilled).
fn spilling(n_seq: u32, budget: u64) -> SchedulerState {
    SchedulerState::new(FAKE_N_CTX, n_seq, 512)
        .with_spill(spill::SpillIndex::new(budget).with_min_tokens(4))
}

/// A 40-token prompt of its own for conversation `c` (the first token is
/// shared, as a chat template's opening is).
fn conversation(c: u32) -> Vec<Token> {
    let mut p = vec![1];
    p.extend((0..39).map(|i| 200 + c * 50 + i));
    p
}

/// Runs one generation to its end; returns its id and every event.
fn run_one(s: &mut SchedulerState, w: &mut FakeWorker, a: Admit) -> (GenId, Vec<GenEvent>) {
    let g = s.admit(a).unwrap();
    let events = drive(s, w, 2, |_, _| vec![]);
    assert!(finish_of(&events, g).is_some(), "{events:?}");
    (g, events)
}

/// Turn 1 of conversations 0..n (sessions 1..=n, or stateless), then turn 2
/// of conversation 0: its events, the tokens turn 1 left resident, and the
/// tokens turn 2 prefilled.
fn five_then_first_again(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    n: u32,
    stateless: bool,
) -> (GenId, Vec<GenEvent>, usize, u64) {
    let session = |c: u32| {
        if stateless {
            NO_SESSION
        } else {
            c as SessionId + 1
        }
    };
    let (g0, e0) = run_one(s, w, admit(session(0), &conversation(0), 8));
    let reply = tokens_of(&e0, g0);
    for c in 1..n {
        run_one(s, w, admit(session(c), &conversation(c), 8));
    }
    let mut turn2 = conversation(0);
    turn2.extend(&reply);
    turn2.extend([7, 8, 9]);
    let history = conversation(0).len() + reply.len() - 1;
    let before = s.stats().prefilled_tokens;
    let (g, events) = run_one(s, w, admit(session(0), &turn2, 8));
    (g, events, history, s.stats().prefilled_tokens - before)
}

#[test]
fn a_conversation_evicted_beyond_parallel_comes_back_from_host_memory() {
    for stateless in [false, true] {
        let mut s = spilling(2, 1 << 20);
        let mut w = FakeWorker::new(2);
        let (g, events, history, prefilled) = five_then_first_again(&mut s, &mut w, 5, stateless);
        // Its history came from host memory, not a prefill.
        assert_eq!(
            warm_of(&events, g),
            Some(history as u64),
            "stateless {stateless}"
        );
        let st = s.stats();
        assert_eq!(
            st.restored_tokens, history as u64,
            "stateless {stateless} {st:?}"
        );
        assert!(st.spills >= 3, "{st:?}");
        // Turn 2 prefilled only its new tokens (the last reply token and
        // the new message).
        assert_eq!(prefilled, 4, "stateless {stateless}");
        // The index mirrors the worker's store.
        assert_eq!(st.spilled_entries as usize, w.store.len());
        assert_eq!(
            st.spilled_bytes,
            w.store
                .values()
                .map(|t| t.len() as u64 * FAKE_BYTES_PER_TOKEN)
                .sum::<u64>()
        );

        // The reply is what it is when everything stays resident.
        let mut big = SchedulerState::new(FAKE_N_CTX, 8, 512);
        let mut wb = FakeWorker::new(8);
        let (gb, eb, _, _) = five_then_first_again(&mut big, &mut wb, 5, stateless);
        assert_eq!(warm_of(&eb, gb), Some(history as u64));
        assert_eq!(tokens_of(&events, g), tokens_of(&eb, gb));
    }
}

#[test]
fn without_the_tier_the_evicted_conversation_is_prefilled_again() {
    let mut s = spilling(2, 0);
    let mut w = FakeWorker::new(2);
    let (g, events, _, _) = five_then_first_again(&mut s, &mut w, 5, false);
    assert!(warm_of(&events, g).unwrap() < 2);
    assert_eq!(s.stats().spills, 0);
    assert!(w.store.is_empty());
}

#[test]
fn a_failed_restore_prefills_and_draws_the_same() {
    let mut s = spilling(2, 1 << 20);
    let mut w = FakeWorker::new(2);
    w.fail_restores = true;
    let (g, events, history, prefilled) = five_then_first_again(&mut s, &mut w, 3, false);
    assert!(finish_of(&events, g).is_some());
    assert_eq!(s.stats().restored_tokens, 0);
    // Its owner heard the restore planned, then the warm prefix it got.
    let started: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            GenEvent::Started {
                gen, warm_prefix, ..
            } if *gen == g => Some(*warm_prefix),
            _ => None,
        })
        .collect();
    assert_eq!(started, vec![history as u64, 0]);
    // All of turn 2 was prefilled.
    assert_eq!(prefilled, history as u64 + 4);
    let mut big = SchedulerState::new(FAKE_N_CTX, 8, 512);
    let mut wb = FakeWorker::new(8);
    let (gb, eb, _, _) = five_then_first_again(&mut big, &mut wb, 3, false);
    assert_eq!(tokens_of(&events, g), tokens_of(&eb, gb));
}

/// Conversations 0 and 1 (sessions 1 and 2) run a turn, then 2 and 3
/// push them out to host memory; then both come back at once with turn 2,
/// and (with `foreground`) conversation 4 generates beside them. Returns the
/// events of that last part and the turn-2 generations.
fn two_come_back_together(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    foreground: bool,
    class: QosClass,
) -> (Vec<GenEvent>, Vec<GenId>) {
    let mut replies = vec![];
    for c in 0..4u32 {
        let (g, e) = run_one(s, w, admit(u64::from(c) + 1, &conversation(c), 8));
        replies.push(tokens_of(&e, g));
    }
    let mut gens = vec![];
    if foreground {
        gens.push(s.admit(admit(5, &conversation(4), 24)).unwrap());
    }
    for (c, reply) in replies.iter().take(2).enumerate() {
        let mut turn2 = conversation(c as u32);
        turn2.extend(reply);
        turn2.extend([7, 8, 9]);
        gens.push(
            s.admit(Admit {
                class,
                ..admit(c as SessionId + 1, &turn2, 8)
            })
            .unwrap(),
        );
    }
    (drive(s, w, 2, |_, _| vec![]), gens)
}

#[test]
fn restores_that_fail_together_or_beside_a_decode_only_prefill() {
    // Together; beside a decode that fails with them; and background ones
    // left out of the decode that goes on beside their failed restores.
    for (foreground, class) in [
        (false, QosClass::First),
        (true, QosClass::First),
        (true, QosClass::Background),
    ] {
        let mut s = spilling(3, 1 << 20);
        s.set_background_divisor(4);
        let mut w = FakeWorker::new(3);
        w.fail_restores = true;
        let (events, gens) = two_come_back_together(&mut s, &mut w, foreground, class);
        let failed: Vec<_> = events
            .iter()
            .filter(|e| matches!(e, GenEvent::Failed { .. }))
            .collect();
        assert!(failed.is_empty(), "foreground {foreground}: {failed:?}");
        assert_eq!(s.stats().restored_tokens, 0);
        // What they drew is what they draw with everything resident.
        let mut big = SchedulerState::new(FAKE_N_CTX, 8, 512);
        big.set_background_divisor(4);
        let mut wb = FakeWorker::new(8);
        let (eb, gb) = two_come_back_together(&mut big, &mut wb, foreground, class);
        for (g, gb) in gens.iter().zip(&gb) {
            assert!(finish_of(&events, *g).is_some(), "{events:?}");
            assert_eq!(tokens_of(&events, *g), tokens_of(&eb, *gb));
        }
        // Only what the failed restores were to bring back is prefilled
        // again: a generation decoding beside them is not rebuilt.
        let restored: u64 = gb[gb.len() - 2..]
            .iter()
            .map(|g| warm_of(&eb, *g).unwrap())
            .sum();
        assert_eq!(
            s.stats().prefilled_tokens,
            big.stats().prefilled_tokens + restored,
            "foreground {foreground} {class:?}"
        );
    }
}

#[test]
fn a_step_that_finds_the_cache_full_keeps_the_spills_it_made() {
    // The worker stored the state (bytes), or could not (0).
    for stored in [true, false] {
        let mut s = spilling(1, 1 << 20);
        let mut w = FakeWorker::new(1);
        let (g1, e1) = run_one(&mut s, &mut w, admit(1, &conversation(0), 8));
        let held = s.resident(0).to_vec();
        // Session 2 takes the one sequence: its step spills session 1's
        // cells first, then its decode finds no room.
        s.admit(admit(2, &conversation(1), 8)).unwrap();
        let mut pipeline = Pipeline::new(1);
        let (sent, _) = pipeline.kick(&mut s, 0);
        let [(id, requests)] = sent.as_slice() else {
            panic!("one step: {sent:?}");
        };
        let (key, len) = requests
            .iter()
            .find_map(|r| match r {
                WorkerRequest::KvSpill { key, len, .. } => Some((*key, *len)),
                _ => None,
            })
            .expect("the step spills session 1");
        let bytes = if stored {
            u64::from(len) * FAKE_BYTES_PER_TOKEN
        } else {
            0
        };
        let replies = requests
            .iter()
            .map(|r| match r {
                WorkerRequest::KvSpill { .. } => WorkerResponse::Spilled { key, bytes },
                WorkerRequest::Decode { .. } => WorkerResponse::KvFull {
                    n_ctx: FAKE_N_CTX,
                    tokens: 41,
                },
                _ => WorkerResponse::Done,
            })
            .collect();
        let result = StepOutput::from_replies(replies);
        assert!(
            matches!(result, Err(StepError::KvFull { .. })),
            "{result:?}"
        );
        pipeline.arrived(&mut s, *id, result);
        let st = s.stats();
        if stored {
            // The index holds the key, at the size the worker reported.
            assert_eq!(s.spill.tokens(key), Some(&held[..]));
            assert_eq!((st.spilled_entries, st.spilled_bytes), (1, bytes));
        } else {
            // Nothing was stored: the index forgets the key, and session
            // 1's next turn prefills instead of restoring what is not there.
            assert_eq!(s.spill.tokens(key), None);
            assert_eq!(st.spilled_entries, 0);
            let mut turn2 = conversation(0);
            turn2.extend(tokens_of(&e1, g1));
            s.admit(admit(1, &turn2, 1)).unwrap();
            let (step, _) = s.plan();
            let step = step.unwrap();
            assert!(
                !step
                    .ops
                    .iter()
                    .any(|op| matches!(op, WorkerRequest::KvRestore { .. })),
                "{:?}",
                step.ops
            );
        }
    }
}

#[test]
fn the_tier_keeps_within_its_budget_least_recently_used_first() {
    // Room for two 47-token conversations (10 bytes a token).
    let mut s = spilling(1, 1000);
    let mut w = FakeWorker::new(1);
    for c in 0..5u32 {
        run_one(&mut s, &mut w, admit(u64::from(c) + 1, &conversation(c), 8));
        let st = s.stats();
        let held: u64 = w
            .store
            .values()
            .map(|t| t.len() as u64 * FAKE_BYTES_PER_TOKEN)
            .sum();
        assert!(held <= 1000, "the worker holds {held} bytes");
        assert_eq!(st.spilled_entries as usize, w.store.len());
    }
    // The oldest conversations went; the two newest spilled ones stayed.
    assert_eq!(w.store.len(), 2);
    let mut kept: Vec<Token> = w.store.values().map(|t| t[1]).collect();
    kept.sort();
    assert_eq!(kept, vec![200 + 2 * 50, 200 + 3 * 50]);
}

#[test]
fn a_failed_lane_forgets_the_tier_and_the_worker_drops_it() {
    let mut s = spilling(1, 1 << 20);
    let mut w = FakeWorker::new(1);
    run_one(&mut s, &mut w, admit(1, &conversation(0), 8));
    run_one(&mut s, &mut w, admit(2, &conversation(1), 8));
    assert_eq!(w.store.len(), 1);
    s.lane_failed(&[], "the worker died");
    assert_eq!(s.stats().spilled_entries, 0);
    // The next step drops the keys in a worker that still has them.
    let g = s.admit(admit(1, &conversation(0), 1)).unwrap();
    let (step, events) = s.plan();
    let step = step.unwrap();
    assert!(step
        .ops
        .iter()
        .any(|op| matches!(op, WorkerRequest::KvDrop { .. })));
    assert!(!step
        .ops
        .iter()
        .any(|op| matches!(op, WorkerRequest::KvRestore { .. })));
    assert_eq!(warm_of(&events, g), Some(0));
    w.run(&step.requests()).unwrap();
    assert!(w.store.is_empty());
}

#[test]
fn a_resident_prefix_beats_a_shorter_spilled_one() {
    let mut s = spilling(2, 1 << 20);
    let mut w = FakeWorker::new(2);
    // Conversation 0 is spilled with its turn-1 history; a fork of it that
    // is resident on the other sequence holds more of the next prompt.
    let (g0, e0) = run_one(&mut s, &mut w, admit(1, &conversation(0), 8));
    let mut longer = conversation(0);
    longer.extend(tokens_of(&e0, g0));
    longer.extend(300..320);
    run_one(&mut s, &mut w, admit(2, &longer, 4));
    run_one(&mut s, &mut w, admit(3, &conversation(3), 4));
    let mut p = longer.clone();
    p.extend([5, 6]);
    let g = s.admit(admit(4, &p, 1)).unwrap();
    let events = drive(&mut s, &mut w, 1, |_, _| vec![]);
    assert!(warm_of(&events, g).unwrap() >= longer.len() as u64 - 1);
    assert_eq!(s.stats().restored_tokens, 0, "{:?}", s.stats());
}

// --- Parking (--park) ---

#[test]
fn a_parked_session_restores_after_a_restart_and_a_stale_artifact_prefills() {
    let mut s = SchedulerState::new(FAKE_N_CTX, 2, 512).with_park(vec![]);
    let mut w = FakeWorker::new(2);
    let (g0, e0) = run_one(&mut s, &mut w, admit(1, &conversation(0), 8));
    // Stateless requests never park.
    run_one(&mut s, &mut w, stateless(&conversation(1), 8));
    assert_eq!(s.stats().parks, 1);
    // The sealing runs before the next step: the fake holds it now that
    // the stateless request ran.
    assert_eq!(w.parked.len(), 1);
    let history = w.parked[&1].clone();
    assert_eq!(history.len(), 40 + 7);
    let mut turn2 = conversation(0);
    turn2.extend(tokens_of(&e0, g0));
    turn2.extend([7, 8]);

    // A restart: a new scheduler and worker, the artifact found on disk.
    let restart = |w: &FakeWorker| {
        let s = SchedulerState::new(FAKE_N_CTX, 2, 512)
            .with_park(w.parked.iter().map(|(k, v)| (*k, v.clone())).collect());
        let mut fresh = FakeWorker::new(2);
        fresh.parked = w.parked.clone();
        (s, fresh)
    };
    let (mut s2, mut w2) = restart(&w);
    let (g, events) = run_one(&mut s2, &mut w2, admit(1, &turn2, 8));
    assert_eq!(warm_of(&events, g), Some(history.len() as u64));
    assert_eq!(s2.stats().restored_tokens, history.len() as u64);
    // Resealed with the longer history.
    assert!(w2.parked[&1].len() > history.len());

    // The same turn on a never-restarted daemon draws the same.
    let (g1, e1) = run_one(&mut s, &mut w, admit(1, &turn2, 8));
    assert_eq!(tokens_of(&events, g), tokens_of(&e1, g1));

    // An artifact whose contents are not what its index says (rewritten,
    // corrupt): the worker refuses it, the turn prefills, and draws the same.
    let (mut s3, mut w3) = restart(&w);
    w3.parked.insert(1, vec![1, 2, 3, 4, 5]);
    let before = s3.stats().prefilled_tokens;
    let (g3, e3) = run_one(&mut s3, &mut w3, admit(1, &turn2, 8));
    assert_eq!(tokens_of(&e3, g3), tokens_of(&e1, g1));
    assert_eq!(s3.stats().prefilled_tokens - before, turn2.len() as u64);
    assert_eq!(s3.stats().restored_tokens, 0);
}

#[test]
fn a_park_not_sent_before_the_lane_failed_is_not_counted_on() {
    // A turn ends and its park waits for the next step; the worker dies
    // first. The park never ran: the next turn must not plan a restore of
    // an artifact that was not sealed.
    let mut s = SchedulerState::new(FAKE_N_CTX, 2, 512).with_park(vec![]);
    let w = FakeWorker::new(2);
    let g0 = s.admit(admit(1, &conversation(0), 8)).unwrap();
    let mut e0 = vec![];
    while finish_of(&e0, g0).is_none() {
        e0.extend(step_with(&mut s, |_| 100).1);
    }
    assert_eq!(s.stats().parks, 1);
    assert!(s
        .pending_ops
        .iter()
        .any(|op| matches!(op, WorkerRequest::KvPark { .. })));
    s.lane_failed(&[], "the worker died");
    assert!(w.parked.is_empty());
    let mut turn2 = conversation(0);
    turn2.extend(tokens_of(&e0, g0));
    turn2.extend([7, 8]);
    s.admit(admit(1, &turn2, 8)).unwrap();
    let step = s.plan().0.unwrap();
    assert!(
        !step.ops.iter().any(|op| matches!(
            op,
            WorkerRequest::KvUnpark { .. } | WorkerRequest::KvPark { .. }
        )),
        "{:?}",
        step.ops
    );
}

// --- Idle sequences (`--idle-spill-ms`) ---

/// Runs one generation to its end with the clock at `now_ms`.
fn run_one_at(
    s: &mut SchedulerState,
    w: &mut FakeWorker,
    a: Admit,
    now_ms: u64,
) -> (GenId, Vec<GenEvent>) {
    let g = s.admit(a).unwrap();
    let events = drive_at(s, w, 2, now_ms, |_, _| vec![]);
    assert!(finish_of(&events, g).is_some(), "{events:?}");
    (g, events)
}

#[test]
fn a_shared_opening_comes_from_host_memory_and_its_conversation_stays_there() {
    let mut s = spilling(2, 1 << 20).with_idle_spill_ms(1000);
    let mut w = FakeWorker::new(2);
    // Session 1's conversation leaves the cells when it has been idle a
    // period; session 2's prompt shares its 10-token opening.
    let opening: Vec<Token> = (1..=10).collect();
    let first = [&opening[..], &(500..530).collect::<Vec<_>>()].concat();
    let (g1, e1) = run_one_at(&mut s, &mut w, admit(1, &first, 4), 10_000);
    drive_at(&mut s, &mut w, 2, 11_000, |_, _| vec![]);
    assert_eq!(s.stats().idle_spills, 1);
    assert!(s.resident(0).is_empty() && s.resident(1).is_empty());
    let second = [&opening[..], &(600..630).collect::<Vec<_>>()].concat();
    let (g2, e2) = run_one_at(&mut s, &mut w, admit(2, &second, 4), 11_000);
    // The opening was restored (only it), and the conversation it came
    // from is still in host memory, whole.
    assert_eq!(warm_of(&e2, g2), Some(10));
    assert_eq!(s.stats().restored_tokens, 10);
    let history = first.len() + tokens_of(&e1, g1).len() - 1;
    assert_eq!(w.store.len(), 1);
    assert_eq!(w.store.values().next().unwrap().len(), history);
    // So session 1's next turn restores all of its history.
    let mut turn2 = first.clone();
    turn2.extend(tokens_of(&e1, g1));
    turn2.extend([7, 8, 9]);
    let (g, events) = run_one_at(&mut s, &mut w, admit(1, &turn2, 4), 11_000);
    assert_eq!(warm_of(&events, g), Some(history as u64));
    assert_eq!(s.stats().restored_tokens, 10 + history as u64);
}

#[test]
fn a_prefix_from_host_memory_evicts_nothing_for_the_rest_of_its_state() {
    // 100 cells: session 1's 60-token conversation goes to host memory,
    // session 2's stays resident; session 3 shares session 1's opening.
    let mut s = SchedulerState::new(100, 3, 512)
        .with_spill(spill::SpillIndex::new(1 << 20).with_min_tokens(4))
        .with_idle_spill_ms(1000);
    let mut w = FakeWorker::new(3);
    let opening: Vec<Token> = (1..=10).collect();
    let first = [&opening[..], &(500..550).collect::<Vec<_>>()].concat();
    run_one_at(&mut s, &mut w, admit(1, &first, 2), 10_000);
    drive_at(&mut s, &mut w, 2, 11_000, |_, _| vec![]);
    assert_eq!(s.stats().idle_spills, 1);
    let (_, e2) = run_one_at(
        &mut s,
        &mut w,
        admit(2, &(600..630).collect::<Vec<_>>(), 2),
        11_000,
    );
    assert!(e2
        .iter()
        .all(|e| !matches!(e, GenEvent::Started { evicted, .. } if *evicted > 0)));
    let second = (0..3)
        .find(|&q| s.resident(q).first() == Some(&600))
        .expect("resident");
    // Only the opening's 10 cells are imported: the 31 this turn needs fit
    // beside session 2's 31, and nothing is evicted for the 50 it leaves.
    let third = [&opening[..], &(700..730).collect::<Vec<_>>()].concat();
    let (g3, e3) = run_one_at(&mut s, &mut w, admit(3, &third, 2), 11_000);
    assert_eq!(warm_of(&e3, g3), Some(10));
    assert_eq!(
        s.resident(second).len(),
        31,
        "session 2 stayed in the cells"
    );
    assert!(e3
        .iter()
        .any(|e| matches!(e, GenEvent::Started { evicted: 0, .. })));
}

#[test]
fn idle_sequences_leave_the_cells_after_the_period_and_come_back_warm() {
    let mut s = spilling(4, 1 << 20).with_idle_spill_ms(1000);
    let mut w = FakeWorker::new(4);
    let (g1, e1) = run_one_at(&mut s, &mut w, admit(1, &conversation(0), 8), 10_000);
    run_one_at(&mut s, &mut w, admit(2, &conversation(1), 8), 10_000);
    s.set_clock(10_000);
    s.pin(2, 100_000);
    // Session 1's sequence is due a period after its generation ended;
    // the pinned one never.
    assert_eq!(s.idle_spill_due_at(), Some(11_000));
    drive_at(&mut s, &mut w, 2, 10_999, |_, _| vec![]);
    assert_eq!(s.stats().idle_spills, 0);
    let history = conversation(0).len() + tokens_of(&e1, g1).len() - 1;
    assert_eq!(s.resident(0).len(), history);

    // A third session decodes beside them past the period: the idle
    // sequence leaves the cells mid-generation (a following step stops
    // for it), the pinned one stays, and the third gets all its tokens.
    let g3 = s.admit(admit(3, &conversation(2), 30)).unwrap();
    let mut spilled_with = None;
    let e3 = drive_clocked(
        &mut s,
        &mut w,
        2,
        |k| if k < 3 { 10_900 } else { 11_000 },
        |_, s| {
            if s.stats().idle_spills > 0 && spilled_with.is_none() {
                spilled_with = Some(s.stats().drawn);
            }
            vec![]
        },
    );
    assert_eq!(tokens_of(&e3, g3).len(), 30);
    // Within two following steps of the period's end, not after the
    // generation beside it.
    let drawn = spilled_with.expect("no idle spill") + 30 - s.stats().drawn;
    assert!(
        drawn < 20,
        "the idle sequence left after {drawn} of 30 tokens"
    );
    assert_eq!(s.stats().idle_spills, 1);
    assert!(w.kv[0].is_empty() && s.resident(0).is_empty());
    assert!(!w.kv[1].is_empty(), "the pinned sequence left the cells");
    assert_eq!(w.store.len(), 1);
    assert_eq!(s.stats().spilled_entries, 1);

    // Its next turn restores it instead of a prefill, and draws what it
    // draws when it stays resident.
    let mut turn2 = conversation(0);
    turn2.extend(tokens_of(&e1, g1));
    turn2.extend([7, 8, 9]);
    let (g, events) = run_one_at(&mut s, &mut w, admit(1, &turn2, 8), 11_000);
    assert_eq!(warm_of(&events, g), Some(history as u64));
    assert_eq!(s.stats().restored_tokens, history as u64);
    let mut resident = spilling(4, 1 << 20);
    let mut wr = FakeWorker::new(4);
    run_one_at(&mut resident, &mut wr, admit(1, &conversation(0), 8), 0);
    let (gr, er) = run_one_at(&mut resident, &mut wr, admit(1, &turn2, 8), 0);
    assert_eq!(tokens_of(&events, g), tokens_of(&er, gr));
}

#[test]
fn an_idle_sequence_host_memory_will_not_take_stays_in_the_cells() {
    // Too short for the tier (under its 4 tokens): the idle sequence stays
    // resident, and nothing waits for it (the generation beside it runs,
    // following steps go on, its next turn is warm).
    let mut s = spilling(2, 1 << 20).with_idle_spill_ms(1000);
    let mut w = FakeWorker::new(2);
    let (g1, e1) = run_one_at(&mut s, &mut w, admit(1, &[1, 5, 6], 1), 0);
    let g2 = s.admit(admit(2, &conversation(1), 30)).unwrap();
    let e2 = drive_at(&mut s, &mut w, 2, 5_000, |_, _| vec![]);
    assert_eq!(tokens_of(&e2, g2).len(), 30);
    assert_eq!(s.stats().idle_spills, 0);
    assert_eq!(w.kv[0], vec![1, 5, 6]);
    // Only the sequence that just ended is due (the one that stays is not).
    assert_eq!(s.idle_spill_due_at(), Some(6_000));
    let mut turn2 = vec![1, 5, 6];
    turn2.extend(tokens_of(&e1, g1));
    turn2.extend([7, 8, 9]);
    let (g, events) = run_one_at(&mut s, &mut w, admit(1, &turn2, 8), 5_000);
    assert_eq!(warm_of(&events, g), Some(3));
}

#[test]
fn without_the_period_idle_sequences_stay() {
    let mut s = spilling(4, 1 << 20);
    let mut w = FakeWorker::new(4);
    run_one_at(&mut s, &mut w, admit(1, &conversation(0), 8), 0);
    assert_eq!(s.idle_spill_due_at(), None);
    let g = s.admit(admit(2, &conversation(1), 30)).unwrap();
    let e = drive_at(&mut s, &mut w, 2, 1 << 40, |_, _| vec![]);
    assert_eq!(tokens_of(&e, g).len(), 30);
    assert_eq!(s.stats().idle_spills, 0);
    assert!(!w.kv[0].is_empty());
}

/// A session's turn that draws end of turn at once on a lane whose turn
/// opening is [7, 8].
fn ended_turn(s: &mut SchedulerState, session: SessionId, prompt: &[Token]) -> GenId {
    let g = s.admit(admit(session, prompt, 5)).unwrap();
    let (_, events) = step_with(s, |_| EOG);
    assert!(events.contains(&GenEvent::Finished {
        gen: g,
        finish: Finish::EndOfTurn
    }));
    g
}

#[test]
fn an_ended_turn_gets_its_end_and_the_turn_opening_decoded_while_idle() {
    let mut s = SchedulerState::new(4096, 2, 512).with_turn_opening(vec![7, 8]);
    ended_turn(&mut s, 1, &[1, 2, 3]);
    assert_eq!(s.resident(0), &[1, 2, 3]);
    // Not at once (a client that goes on at once gets them in its own
    // step): the actor is woken when they are due.
    assert!(step_with(&mut s, |_| 9).0.is_none());
    assert_eq!(s.wake_due_at(), Some(TURN_WARM_DELAY_MS));
    // Idle that long: the next step decodes the end of turn and the
    // opening, no draw.
    s.set_clock(TURN_WARM_DELAY_MS);
    let (step, events) = step_with(&mut s, |_| 9);
    let step = step.expect("a warm step");
    assert!(events.is_empty());
    assert_eq!(step.gens, vec![WARM]);
    assert_eq!(
        (
            step.decode[0].pos,
            step.decode[0].tokens.clone(),
            step.decode[0].sample.is_none()
        ),
        (3, vec![EOG, 7, 8], true)
    );
    assert_eq!(s.resident(0), &[1, 2, 3, EOG, 7, 8]);
    assert_eq!(s.stats().turn_warmed_tokens, 3);
    // Once: nothing more to do.
    assert!(step_with(&mut s, |_| 9).0.is_none());
    assert_eq!(s.wake_due_at(), None);
    // The next turn opens as predicted: only its own tokens are computed.
    let g = s.admit(admit(1, &[1, 2, 3, EOG, 7, 8, 40, 41], 1)).unwrap();
    let (step, events) = step_with(&mut s, |_| 9);
    assert!(events.contains(&GenEvent::Started {
        gen: g,
        warm_prefix: 6,
        evicted: 0
    }));
    assert_eq!(step.unwrap().decode[0].tokens, vec![40, 41]);
    assert_eq!(s.stats().turn_warm_missed_tokens, 0);
}

#[test]
fn a_turn_that_follows_at_once_computes_the_opening_itself() {
    let mut s = SchedulerState::new(4096, 1, 512).with_turn_opening(vec![7, 8]);
    ended_turn(&mut s, 1, &[1, 2, 3]);
    // The next turn comes before the delay: nothing was decoded ahead, and
    // its one step takes the end of turn and the opening with its message.
    s.set_clock(TURN_WARM_DELAY_MS - 1);
    assert!(step_with(&mut s, |_| 9).0.is_none(), "no step of its own");
    let g = s.admit(admit(1, &[1, 2, 3, EOG, 7, 8, 40, 41], 1)).unwrap();
    let (step, events) = step_with(&mut s, |_| 9);
    assert_eq!(warm_of(&events, g), Some(3));
    assert_eq!(step.unwrap().decode[0].tokens, vec![EOG, 7, 8, 40, 41]);
    assert_eq!(s.stats().turn_warmed_tokens, 0);
    // And nothing is left to decode ahead on the sequence it took.
    s.set_clock(1 << 30);
    run_to_end(&mut s);
    assert_eq!(s.stats().turn_warmed_tokens, 0);
}

#[test]
fn no_wake_up_for_a_turn_opening_while_a_generation_waits() {
    let mut s = SchedulerState::new(4096, 2, 512).with_turn_opening(vec![7, 8]);
    ended_turn(&mut s, 1, &[1, 2, 3]);
    assert_eq!(s.wake_due_at(), Some(TURN_WARM_DELAY_MS));
    // Another session's generation is admitted: the opening waits for the
    // lane to be idle, so nothing wakes the actor for it meanwhile.
    s.admit(admit(2, &[20, 21], 1)).unwrap();
    assert_eq!(s.wake_due_at(), None);
}

#[test]
fn a_next_turn_that_opens_otherwise_drops_what_was_decoded_ahead() {
    let mut s = SchedulerState::new(4096, 1, 512).with_turn_opening(vec![7, 8]);
    ended_turn(&mut s, 1, &[1, 2, 3]);
    s.set_clock(TURN_WARM_DELAY_MS);
    step_with(&mut s, |_| 9);
    // A tool result opens with 7 but not 8.
    let g = s.admit(admit(1, &[1, 2, 3, EOG, 7, 50, 51], 1)).unwrap();
    let (step, events) = step_with(&mut s, |_| 9);
    let step = step.unwrap();
    assert_eq!(step.ops, vec![WorkerRequest::KvTrim { seq: 0, from: 5 }]);
    assert!(events.contains(&GenEvent::Started {
        gen: g,
        warm_prefix: 5,
        evicted: 1
    }));
    assert_eq!(step.decode[0].tokens, vec![50, 51]);
    assert_eq!(s.stats().turn_warm_missed_tokens, 1);
}

#[test]
fn nothing_is_decoded_ahead_beside_work_or_for_turns_that_must_not_be() {
    // Beside a running generation: not until the lane is idle.
    let mut s = SchedulerState::new(4096, 2, 512).with_turn_opening(vec![7]);
    let long = s.admit(admit(2, &[60, 61], 3)).unwrap();
    let short = s.admit(admit(1, &[1, 2], 3)).unwrap();
    let (_, events) = step_with(&mut s, |seq| if seq == 1 { EOG } else { 9 });
    assert!(events.contains(&GenEvent::Finished {
        gen: short,
        finish: Finish::EndOfTurn
    }));
    let (step, _) = step_with(&mut s, |_| 9);
    assert_eq!(step.unwrap().gens, vec![long]);
    assert_eq!(s.resident(1), &[1, 2]);
    let events = run_to_end(&mut s);
    assert!(events.contains(&GenEvent::Finished {
        gen: long,
        finish: Finish::MaxTokens
    }));
    s.set_clock(TURN_WARM_DELAY_MS);
    run_to_end(&mut s);
    assert_eq!(s.resident(1), &[1, 2, EOG, 7], "warmed once idle");
    // A stateless generation, a batch-invariant one, a turn cut by
    // max_tokens: none.
    for (session, invariant, draw) in [(NO_SESSION, false, EOG), (3, true, EOG), (3, false, 9)] {
        let mut s = SchedulerState::new(4096, 1, 512).with_turn_opening(vec![7]);
        let mut a = admit(session, &[1, 2], 1);
        a.batch_invariant = invariant;
        s.admit(a).unwrap();
        run_to_end_drawing(&mut s, draw);
        s.set_clock(1 << 30);
        run_to_end_drawing(&mut s, draw);
        assert_eq!(
            s.stats().turn_warmed_tokens,
            0,
            "{session} {invariant} {draw}"
        );
        assert_eq!(s.resident(0), &[1, 2]);
    }
}

fn run_to_end_drawing(s: &mut SchedulerState, token: Token) {
    for _ in 0..100 {
        if step_with(s, |_| token).0.is_none() {
            break;
        }
    }
}

/// A generation whose grammar took longer to constrain its token than the
/// step's decode sits out that many times a step while the others run, then
/// runs again; alone it is not rested, and a cancel wakes it.
#[test]
fn a_costly_grammar_rests_while_the_others_run() {
    let mut s = SchedulerState::new(4096, 3, 512);
    let mut costly = admit(1, &[1, 2, 3], 100);
    costly.grammar = Some("root ::= [a-z]*".into());
    let slow = s.admit(costly).unwrap();
    let fast = s.admit(admit(2, &[4, 5, 6], 100)).unwrap();
    // Each step: 10 ms of decode; the grammar took 35 ms for its token.
    let step_of = |s: &mut SchedulerState| {
        let (step, _) = s.plan();
        let step = step.expect("a step");
        let seqs: Vec<u32> = step.decode.iter().map(|i| i.seq).collect();
        let drawn = step
            .decode
            .iter()
            .filter(|i| i.sample.is_some())
            .map(|i| Drawn {
                seq: i.seq,
                token: 100,
                eog: false,
                logprob: None,
                grammar_us: if i.sample.as_ref().unwrap().grammar.is_some() {
                    35_000
                } else {
                    0
                },
            })
            .collect();
        s.note_decode(1, 10_000);
        s.step_done(&step, Ok(drawn));
        seqs
    };
    let first = step_of(&mut s);
    assert_eq!(first.len(), 2, "both prefill in the first step");
    // 35 / 10: three steps without it, then it runs again.
    for _ in 0..3 {
        assert_eq!(step_of(&mut s).len(), 1);
    }
    assert_eq!(step_of(&mut s).len(), 2);
    assert_eq!(s.stats().grammar_rested_steps, 3);
    let produced = |s: &SchedulerState, g: GenId| s.gens[&g].produced;
    assert_eq!((produced(&s, slow), produced(&s, fast)), (2, 5));
    // A cancel wakes it: it is in the very next step.
    s.cancel(slow);
    assert_eq!(step_of(&mut s).len(), 2);
    assert!(!s.gens.contains_key(&slow));
    // Alone, a costly grammar is never rested.
    s.cancel(fast);
    step_of(&mut s);
    let mut costly = admit(3, &[7, 8, 9], 100);
    costly.grammar = Some("root ::= [a-z]*".into());
    let alone = s.admit(costly).unwrap();
    for _ in 0..4 {
        assert_eq!(step_of(&mut s).len(), 1);
    }
    assert_eq!(produced(&s, alone), 4);
    assert_eq!(s.stats().grammar_rested_steps, 3);
}

/// The cells run out while two generations run and nothing idle is left:
/// the youngest is taken off its sequence, waits for room to finish, then
/// goes on where it stopped and draws all its max_tokens (it used to end
/// with `Finish::Error`, which the compatible routes called a normal end).
#[test]
fn a_full_cache_preempts_the_youngest_which_goes_on_later() {
    let mut s = SchedulerState::new(64, 2, 512);
    let a = s.admit(admit(1, &[1; 10], 30)).unwrap();
    let b = s.admit(admit(2, &[2; 10], 30)).unwrap();
    let mut events = Vec::new();
    for _ in 0..5 {
        events.extend(step_with(&mut s, |seq| 100 + seq).1);
    }
    let (step, _) = s.plan();
    let step = step.unwrap();
    let full = s.step_done(&step, Err(StepError::KvFull { spilled: vec![] }));
    assert!(full.is_empty(), "nothing ends: {full:?}");
    assert_eq!(s.stats().preempted, 1);
    assert!(s.gens[&b].seq.is_none() && s.gens[&b].preempted);
    let b_drawn = s.gens[&b].produced;
    assert!(b_drawn > 0);
    // Only a runs now; b needs room for its prompt, its draws and the rest
    // of its max_tokens (41 cells), which a's 41 leave only once a is done.
    let (step, _) = s.plan();
    assert_eq!(step.as_ref().unwrap().gens, vec![a]);
    s.step_done(&step.unwrap(), Ok(drew(0, 100)));
    events.extend(run_to_end(&mut s));
    let tokens = |g: GenId| {
        events
            .iter()
            .filter(|e| matches!(e, GenEvent::Token { gen, .. } if *gen == g))
            .count()
    };
    assert_eq!((tokens(a) + 1, tokens(b)), (30, 30));
    for g in [a, b] {
        assert!(events.contains(&GenEvent::Finished {
            gen: g,
            finish: Finish::MaxTokens
        }));
    }
    // b's prompt went back in with its draws (its own cells, kept idle).
    assert!(s.resident(1).starts_with(&[2; 10]));
    // Alone, a generation has nothing to wait for: it ends.
    let c = s.admit(admit(3, &[3; 10], 30)).unwrap();
    let (step, _) = s.plan();
    let full = s.step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }));
    assert!(full.is_empty(), "an idle sequence is evicted first");
    let (step, _) = s.plan();
    let step = step.unwrap();
    let full = s.step_done(&step, Err(StepError::KvFull { spilled: vec![] }));
    let full = if full.is_empty() {
        let (step, _) = s.plan();
        s.step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }))
    } else {
        full
    };
    assert_eq!(
        full,
        vec![GenEvent::Finished {
            gen: c,
            finish: Finish::Error
        }]
    );
}

/// A review of the preemption: the resumed generation is not announced
/// again (its warm count stands), a later arrival does not take the room a
/// preempted one claims, a preempted one is not left waiting when the
/// others end without a decode, and a cancelled youngest ends cancelled.
#[test]
fn preemption_keeps_its_claim_its_start_and_never_strands_a_generation() {
    let mut s = SchedulerState::new(64, 3, 512);
    let a = s.admit(admit(1, &[1; 10], 30)).unwrap();
    let b = s.admit(admit(2, &[2; 10], 30)).unwrap();
    let mut events = Vec::new();
    for _ in 0..3 {
        events.extend(step_with(&mut s, |seq| 100 + seq).1);
    }
    let warm_before = s.stats().warm_tokens;
    let (step, _) = s.plan();
    assert!(s
        .step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }))
        .is_empty());
    assert!(s.gens[&b].preempted);
    // A later arrival that fits beside the running one but not beside b's
    // claim waits too.
    let c = s.admit(admit(3, &[3; 10], 5)).unwrap();
    let (step, ev) = s.plan();
    assert_eq!(step.unwrap().gens, vec![a], "{ev:?}");
    assert!(s.gens[&c].seq.is_none(), "c took b's room");
    // a's step finds the cache full again: alone, it ends; nothing was
    // decoded since b was taken off, and b must not wait for that.
    let (step, _) = s.plan();
    let _ = s.step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }));
    let (step, _) = s.plan();
    let step = s.step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }));
    events.extend(step);
    assert!(events.contains(&GenEvent::Finished {
        gen: a,
        finish: Finish::Error
    }));
    let (step, ev) = s.plan();
    events.extend(ev);
    assert!(step.unwrap().gens.contains(&b), "b stranded");
    events.extend(run_to_end(&mut s));
    let started = |g: GenId| {
        events
            .iter()
            .filter(|e| matches!(e, GenEvent::Started { gen, .. } if *gen == g))
            .count()
    };
    assert_eq!(started(b), 1, "b announced again on its resume");
    assert!(events.contains(&GenEvent::Finished {
        gen: b,
        finish: Finish::MaxTokens
    }));
    assert!(s.stats().warm_tokens >= warm_before);
    // A cancelled youngest ends cancelled at the full cache.
    let mut s = SchedulerState::new(64, 2, 512);
    s.admit(admit(1, &[1; 10], 30)).unwrap();
    let y = s.admit(admit(2, &[2; 10], 30)).unwrap();
    step_with(&mut s, |seq| 100 + seq);
    s.cancel(y);
    let (step, _) = s.plan();
    let ev = s.step_done(&step.unwrap(), Err(StepError::KvFull { spilled: vec![] }));
    assert_eq!(
        ev,
        vec![GenEvent::Finished {
            gen: y,
            finish: Finish::Cancelled
        }]
    );
}
