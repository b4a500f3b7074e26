//! SessionBook without a model: a byte-level fake renderer stands in for the
//! chat template.

use super::*;
use crate::session::grammar::GrammarError;
use crate::session::{EditError, RenderError};
use crate::wire::{
    Channel, Edit, Finish, LedgerStatus, LogRecord, Params, PurgeMode, QosClass, Record, Role,
    Token,
};

use crate::session::fake_render::Bytes;

const P: Params = Params {
    temperature: 0.7,
    top_p: 0.95,
    min_p: 0.0,
    top_k: 0,
    seed: 1,
};

/// Plans and applies in one go, as the actors do after the commit.
macro_rules! commit {
    ($book:ident, $plan:expr) => {{
        let record = $plan.expect("plan").into_record();
        $book.apply(&record).expect("apply");
        record
    }};
}

fn create(book: &mut SessionBook) -> SessionId {
    let id = book.reserve_id();
    commit!(book, book.plan_create(id, None, P, 10));
    id
}

fn say(book: &mut SessionBook, s: SessionId, text: &str) {
    commit!(
        book,
        book.plan_message(s, Role::User.into(), text.into(), &Bytes, 20)
    );
}

fn texts(book: &SessionBook, s: SessionId) -> Vec<String> {
    book.read(s, 0)
        .unwrap()
        .iter()
        .map(|e| match &e.body {
            Record::Message { text, .. } => text.clone(),
            other => other.name().to_string(),
        })
        .collect()
}

fn ids(book: &SessionBook, s: SessionId) -> Vec<u64> {
    book.read(s, 0)
        .unwrap()
        .iter()
        .map(|e| e.event_id)
        .collect()
}

#[test]
fn create_append_read() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    assert_eq!(s, 1);
    say(&mut b, s, "a");
    say(&mut b, s, "b");
    assert_eq!(texts(&b, s), ["Created", "a", "b"]);
    assert_eq!(ids(&b, s), [0, 1, 2]);
    // First message carries the BOS marker, later ones do not.
    let ev = b.read(s, 1).unwrap();
    assert_eq!(ev[0].body.span()[0], b'^' as u32);
    assert_ne!(ev[1].body.span()[0], b'^' as u32);
    assert_eq!(b.read(s, 3).unwrap(), vec![]);
    assert!(matches!(
        b.read(s, 4),
        Err(SessionError::CursorPastEnd { .. })
    ));
    assert!(matches!(b.read(9, 0), Err(SessionError::Unknown(9))));
}

#[test]
fn fork_shares_ids_and_never_rewrites_parent() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "a");
    say(&mut b, s, "b");
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, 2, None, 30));
    say(&mut b, f, "x");
    say(&mut b, s, "c");
    assert_eq!(texts(&b, f), ["Created", "a", "Forked", "x"]);
    assert_eq!(ids(&b, f), [0, 1, 2, 3]);
    assert_eq!(texts(&b, s), ["Created", "a", "b", "c"]);
    // Fork of a fork, at its end: keeps everything.
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, f, b.len(f).unwrap(), None, 30));
    assert_eq!(texts(&b, g), ["Created", "a", "Forked", "x", "Forked"]);
    assert_eq!(b.len(g).unwrap(), 5);
    assert_eq!(
        b.tree(),
        vec![
            (1, None, None),
            (2, Some(1), Some(2)),
            (3, Some(2), Some(4))
        ]
    );
    // Out of range.
    let h = b.reserve_id();
    assert!(b.plan_fork(h, s, 0, None, 1).is_err());
    assert!(b.plan_fork(h, s, 5, None, 1).is_err());
    assert!(b.plan_fork(h, s, 4, None, 1).is_ok());
}

#[test]
fn rebase_drops_and_replaces() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    for t in ["a", "b", "c", "d", "e"] {
        say(&mut b, s, t);
    }
    let r = b.reserve_id();
    let edits = vec![
        Edit::Replace {
            from: 2,
            to: 3,
            role: Role::User.into(),
            text: "B".into(),
        },
        Edit::Drop { from: 4, to: 5 },
    ];
    commit!(b, b.plan_rebase(r, s, edits, None, &Bytes, 40));
    assert_eq!(texts(&b, r), ["Created", "a", "Rebased", "B", "c", "e"]);
    assert_eq!(ids(&b, r), [0, 1, 2, 3, 4, 5]);
    assert_eq!(texts(&b, s), ["Created", "a", "b", "c", "d", "e"]);
    say(&mut b, r, "f");
    assert_eq!(b.len(r).unwrap(), 7);
    // Edit this message and drop what followed.
    let r2 = b.reserve_id();
    let edits = vec![Edit::Replace {
        from: 3,
        to: 6,
        role: Role::User.into(),
        text: "C".into(),
    }];
    commit!(b, b.plan_rebase(r2, s, edits, None, &Bytes, 40));
    assert_eq!(texts(&b, r2), ["Created", "a", "b", "Rebased", "C"]);
}

#[test]
fn rebase_takes_at_most_64_edits() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    for _ in 0..130 {
        say(&mut b, s, "m");
    }
    let drops = |n: u64| -> Vec<Edit> {
        (0..n)
            .map(|i| Edit::Drop {
                from: 1 + 2 * i,
                to: 2 + 2 * i,
            })
            .collect()
    };
    let r = b.reserve_id();
    assert_eq!(
        b.plan_rebase(r, s, drops(65), None, &Bytes, 40).err(),
        Some(EditError::TooMany(65).into())
    );
    commit!(b, b.plan_rebase(r, s, drops(64), None, &Bytes, 40));
    assert_eq!(b.len(r).unwrap(), 131 - 64 + 1);
}

/// `(view id, owner, owner's id)` of every event of `s`.
fn owned(book: &SessionBook, s: SessionId) -> Vec<(u64, SessionId, u64)> {
    let runs = book.owners(s).unwrap();
    assert_eq!(
        runs.iter().map(|r| r.len).sum::<u64>(),
        book.len(s).unwrap(),
        "the runs cover the view"
    );
    runs.iter()
        .flat_map(|r| (0..r.len).map(move |i| (r.at + i, r.owner, r.owner_at + i)))
        .collect()
}

#[test]
fn owners_name_each_event_by_the_session_that_made_it() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    for t in ["a", "b", "c", "d", "e"] {
        say(&mut b, s, t);
    }
    assert_eq!(owned(&b, s), (0..6).map(|i| (i, s, i)).collect::<Vec<_>>());
    // A fork of a fork: what it shares keeps its maker and its id.
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, 3, None, 30));
    say(&mut b, f, "x");
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, f, 5, None, 30));
    say(&mut b, g, "y");
    assert_eq!(
        owned(&b, g),
        [
            (0, s, 0),
            (1, s, 1),
            (2, s, 2),
            (3, f, 3),
            (4, f, 4),
            (5, g, 5),
            (6, g, 6)
        ]
    );
    // A rebase moves what follows its edit: "c" is s's event 3 at 4.
    let r = b.reserve_id();
    let edits = vec![
        Edit::Replace {
            from: 2,
            to: 3,
            role: Role::User.into(),
            text: "B".into(),
        },
        Edit::Drop { from: 4, to: 5 },
    ];
    commit!(b, b.plan_rebase(r, s, edits, None, &Bytes, 40));
    assert_eq!(texts(&b, r), ["Created", "a", "Rebased", "B", "c", "e"]);
    assert_eq!(
        owned(&b, r),
        [
            (0, s, 0),
            (1, s, 1),
            (2, r, 2),
            (3, r, 3),
            (4, s, 3),
            (5, s, 5)
        ]
    );
    assert!(matches!(b.owners(99), Err(SessionError::Unknown(99))));
}

#[test]
fn bad_rebase_edits_are_refused() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    for t in ["a", "b", "c", "d"] {
        say(&mut b, s, t);
    }
    let d = |from, to| Edit::Drop { from, to };
    use crate::session::EditError as E;
    let edit = |e: E| SessionError::Edit(e);
    for (edits, why) in [
        (vec![], edit(E::NoEdits)),
        (vec![d(0, 2)], edit(E::TouchesEventZero { index: 0 })),
        (
            vec![d(2, 2)],
            edit(E::EmptyOrReversed {
                index: 0,
                from: 2,
                to: 2,
            }),
        ),
        (
            vec![d(3, 2)],
            edit(E::EmptyOrReversed {
                index: 0,
                from: 3,
                to: 2,
            }),
        ),
        (
            vec![d(2, 9)],
            edit(E::PastTheEnd {
                index: 0,
                from: 2,
                to: 9,
                session: s,
                len: 5,
            }),
        ),
        (
            vec![d(3, 4), d(1, 2)],
            edit(E::Unsorted {
                index: 1,
                from: 1,
                to: 2,
            }),
        ),
        (
            vec![d(1, 3), d(2, 4)],
            edit(E::Unsorted {
                index: 1,
                from: 2,
                to: 4,
            }),
        ),
        (
            vec![Edit::Replace {
                from: 1,
                to: 2,
                role: 7,
                text: "x".into(),
            }],
            SessionError::UnknownCode(Role::try_from(7).unwrap_err()),
        ),
    ] {
        let err = b.plan_rebase(99, s, edits, None, &Bytes, 1).unwrap_err();
        assert_eq!(err, why, "{err}");
    }
}

#[test]
fn system_only_before_input_including_inherited() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    commit!(
        b,
        b.plan_system(
            s,
            Some("be brief".into()),
            vec!["{\"name\":\"f\"}".into()],
            &Bytes,
            1
        )
    );
    let err = b.plan_system(s, None, vec![], &Bytes, 1).unwrap_err();
    assert_eq!(err, SessionError::SystemAfterInput(s));
    let t = create(&mut b);
    say(&mut b, t, "hi");
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, t, 2, None, 1));
    assert!(
        b.plan_system(f, None, vec![], &Bytes, 1).is_err(),
        "inherited input counts"
    );
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, t, 1, None, 1));
    assert!(
        b.plan_system(g, None, vec![], &Bytes, 1).is_ok(),
        "a fork before any input may declare"
    );
}

#[test]
fn meta_and_purge_guards() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    assert!(matches!(
        b.plan_meta(s, 1, None, None, 1),
        Err(SessionError::Version { .. })
    ));
    let long = "t".repeat(super::plan_meta::MAX_TITLE_BYTES + 1);
    let refused = b.plan_meta(s, 0, Some(long), None, 1);
    assert!(
        matches!(&refused, Err(SessionError::Invalid(m)) if m.contains("1025 bytes")),
        "{refused:?}"
    );
    let longest = "t".repeat(super::plan_meta::MAX_TITLE_BYTES);
    assert!(b.plan_meta(s, 0, Some(longest), None, 1).is_ok());
    commit!(b, b.plan_meta(s, 0, Some("t".into()), None, 1));
    commit!(b, b.plan_meta(s, 1, None, Some(true), 1));
    let i = b.inspect(s).unwrap();
    assert_eq!(
        (i.version, i.title.as_deref(), i.archived),
        (2, Some("t"), true)
    );
    assert!(b.summaries(false).is_empty());
    assert_eq!(b.summaries(true).len(), 1);
    let gen = b.inspect(s).unwrap().generation;
    assert!(matches!(
        b.plan_purge(s, gen + 1, PurgeMode::Cascade, 1),
        Err(SessionError::Generation { .. })
    ));
}

/// Archiving hides the session from List, Tree and Sessions (unless asked),
/// and only it: a child stays, naming it as its parent; unarchiving shows it
/// again; it still reads, forks and takes appends.
#[test]
fn archived_sessions_are_hidden_from_list_and_tree() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "a");
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, 2, None, 1));
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, f, 3, None, 1));
    let other = create(&mut b);
    commit!(b, b.plan_meta(f, 0, None, Some(true), 1));
    assert_eq!(b.list_shown(), vec![s, g, other]);
    assert_eq!(b.list(), vec![s, f, g, other], "archived is still live");
    assert_eq!(
        b.tree(),
        vec![(s, None, None), (g, Some(f), Some(3)), (other, None, None)]
    );
    let summaries = |all| -> Vec<(SessionId, Option<SessionId>)> {
        b.summaries(all)
            .iter()
            .map(|x| (x.session, x.parent))
            .collect()
    };
    assert_eq!(
        summaries(false),
        vec![(s, None), (g, Some(f)), (other, None)]
    );
    assert_eq!(
        summaries(true),
        vec![(s, None), (f, Some(s)), (g, Some(f)), (other, None)]
    );
    // Everything is kept.
    assert_eq!(texts(&b, f), ["Created", "a", "Forked"]);
    assert_eq!(b.inspect(s).unwrap().children, vec![f]);
    say(&mut b, f, "still open");
    // Archiving the root too hides both; unarchiving f shows it again.
    commit!(b, b.plan_meta(s, 0, None, Some(true), 1));
    assert_eq!(b.list_shown(), vec![g, other]);
    commit!(b, b.plan_meta(f, 1, None, Some(false), 1));
    assert_eq!(b.list_shown(), vec![f, g, other]);
    assert_eq!(
        b.tree(),
        vec![
            (f, Some(s), Some(2)),
            (g, Some(f), Some(3)),
            (other, None, None)
        ]
    );
}

#[test]
fn purge_cascade_and_reroot() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "a");
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, 2, None, 1));
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, f, 3, None, 1));
    // Reroot the middle one: g stays and still reads its inherited events.
    let gen = b.inspect(f).unwrap().generation;
    let rec = commit!(b, b.plan_purge(f, gen, PurgeMode::Reroot, 1));
    assert!(matches!(rec, LogRecord::Purge { ref sessions, .. } if sessions == &vec![f]));
    assert!(matches!(b.read(f, 0), Err(SessionError::Purged(_))));
    assert_eq!(texts(&b, g), ["Created", "a", "Forked", "Forked"]);
    assert!(b.tree().contains(&(g, None, None)));
    // Cascade from the root takes the rest.
    let gen = b.inspect(s).unwrap().generation;
    let rec = commit!(b, b.plan_purge(s, gen, PurgeMode::Cascade, 1));
    assert!(matches!(rec, LogRecord::Purge { ref sessions, .. } if sessions == &vec![s]));
    assert_eq!(b.list(), vec![g]);
}

/// Applies `log` to a fresh book, through postcard as the log stores it.
fn replayed(log: &[LogRecord]) -> SessionBook {
    let mut again = SessionBook::new();
    for rec in log {
        let bytes = crate::wire::to_postcard(rec).unwrap();
        let back: LogRecord = crate::wire::from_postcard(&bytes).unwrap();
        again.apply(&back).unwrap();
    }
    again
}

/// The live book and its replay agree on sessions `ids`, purged or not.
fn assert_replays(b: &SessionBook, log: &[LogRecord], ids: &[SessionId]) {
    let again = replayed(log);
    assert_eq!(b.list(), again.list());
    assert_eq!(b.tree(), again.tree());
    assert_eq!(b.summaries(true), again.summaries(true));
    for &id in ids {
        assert_eq!(b.inspect(id), again.inspect(id), "session {id}");
    }
}

/// A cascade purge is committed (the log's fsync) before it is applied. A
/// fork of a descendant planned in that window, on the descendant's actor,
/// would see its parent live and leave a live child of a purged session: it
/// is refused as purged, and so is every other write to the sessions the
/// purge takes, until it is applied.
#[test]
fn a_fork_planned_while_a_cascade_purge_is_in_flight_is_refused() {
    let mut b = SessionBook::new();
    let s = b.reserve_id();
    let mut log = vec![commit!(b, b.plan_create(s, None, P, 1))];
    let f = b.reserve_id();
    log.push(commit!(b, b.plan_fork(f, s, 1, None, 1)));
    // A rebase of the descendant planned before the purge (off the actor
    // thread, under a read lock), begun after it.
    let r = b.reserve_id();
    log.push(commit!(
        b,
        b.plan_message(f, Role::User.into(), "a".into(), &Bytes, 1)
    ));
    let rebase = b
        .plan_rebase(r, f, vec![Edit::Drop { from: 1, to: 2 }], None, &Bytes, 2)
        .unwrap();
    let gen = b.inspect(s).unwrap().generation;
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 2).unwrap();
    b.begin(&purge).unwrap();
    // In the window: a fork (or trim) of the descendant or of the session, a
    // child of either by Create, an append, a title, a second purge.
    let g = b.reserve_id();
    assert_eq!(b.plan_fork(g, f, 1, None, 3), Err(SessionError::Purged(f)));
    assert_eq!(b.plan_fork(g, s, 1, None, 3), Err(SessionError::Purged(s)));
    assert_eq!(
        b.plan_create(g, Some(f), P, 3),
        Err(SessionError::Purged(f))
    );
    assert_eq!(b.begin(&rebase), Err(SessionError::Purged(f)));
    assert_eq!(
        b.plan_message(f, Role::User.into(), "x".into(), &Bytes, 3),
        Err(SessionError::Purged(f))
    );
    assert_eq!(
        b.plan_meta(f, 0, Some("t".into()), None, 3),
        Err(SessionError::Purged(f))
    );
    assert_eq!(
        b.plan_purge(f, b.inspect(f).unwrap().generation, PurgeMode::Reroot, 3),
        Err(SessionError::Purged(f))
    );
    assert!(
        b.inspect(f).is_ok(),
        "reads answer until the purge is applied"
    );
    let purge = purge.into_record();
    b.apply(&purge).unwrap();
    log.push(purge);
    assert_eq!(b.list(), Vec::<SessionId>::new());
    assert_eq!(b.plan_fork(g, f, 1, None, 4), Err(SessionError::Purged(f)));
    assert_replays(&b, &log, &[s, f, g, r]);
}

/// The other order: a new session under a descendant is in flight when a
/// cascade purge is planned, which would miss it. The purge is refused until
/// the new session is applied, and then takes it.
#[test]
fn a_cascade_purge_planned_while_a_fork_below_is_in_flight_waits_for_it() {
    let mut b = SessionBook::new();
    let s = b.reserve_id();
    let mut log = vec![commit!(b, b.plan_create(s, None, P, 1))];
    let f = b.reserve_id();
    log.push(commit!(b, b.plan_fork(f, s, 1, None, 1)));
    let g = b.reserve_id();
    let fork = b.plan_fork(g, f, 1, None, 2).unwrap();
    b.begin(&fork).unwrap();
    let c = b.reserve_id();
    let child = b.plan_create(c, Some(s), P, 2).unwrap();
    b.begin(&child).unwrap();
    let gen = b.inspect(s).unwrap().generation;
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 3).unwrap();
    assert_eq!(b.begin(&purge), Err(SessionError::Branching(s)));
    let child = child.into_record();
    b.apply(&child).unwrap();
    log.push(child);
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 3).unwrap();
    assert_eq!(b.begin(&purge), Err(SessionError::Branching(f)));
    // A commit that failed settles too.
    b.settle(&fork.clone().into_record());
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 3).unwrap();
    b.begin(&purge).unwrap();
    b.settle(&purge.into_record());
    // The fork is applied after all (a retry): the purge planned now takes it.
    b.begin(&fork).unwrap();
    let fork = fork.into_record();
    b.apply(&fork).unwrap();
    log.push(fork);
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 3).unwrap();
    b.begin(&purge).unwrap();
    let purge = purge.into_record();
    let LogRecord::Purge { sessions, .. } = &purge else {
        panic!("{purge:?}");
    };
    let mut taken = sessions.clone();
    taken.sort();
    assert_eq!(taken, vec![s, f, g, c]);
    b.apply(&purge).unwrap();
    log.push(purge);
    assert_eq!(b.list(), Vec::<SessionId>::new());
    assert_replays(&b, &log, &[s, f, g, c]);
}

/// A purge waiting for a fork below to be filed holds the sessions it would
/// take: no new session starts under them meanwhile (a busy tree cannot
/// keep it waiting forever), and once released they take new ones again.
#[test]
fn a_purge_waiting_for_a_fork_holds_the_tree() {
    let mut b = SessionBook::new();
    let s = b.reserve_id();
    commit!(b, b.plan_create(s, None, P, 1));
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, 1, None, 1));
    let g = b.reserve_id();
    let fork = b.plan_fork(g, f, 1, None, 2).unwrap();
    b.begin(&fork).unwrap();
    let gen = b.inspect(s).unwrap().generation;
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 3).unwrap();
    assert_eq!(b.begin(&purge), Err(SessionError::Branching(f)));
    let Planned::Purge { sessions, .. } = &purge else {
        panic!("{purge:?}");
    };
    b.hold(sessions);
    // Held: another fork below, a child and an append are refused.
    let h = b.reserve_id();
    assert!(matches!(
        b.plan_fork(h, f, 1, None, 3),
        Err(SessionError::Purged(_))
    ));
    let c = b.reserve_id();
    assert!(matches!(
        b.plan_create(c, Some(s), P, 3),
        Err(SessionError::Purged(_))
    ));
    assert!(matches!(
        b.plan_message(f, Role::User.into(), "x".into(), &Bytes, 3),
        Err(SessionError::Purged(_))
    ));
    // The fork in flight lands; released, the purge plans again and takes it.
    b.apply(&fork.into_record()).unwrap();
    b.release(sessions);
    let purge = b.plan_purge(s, gen, PurgeMode::Cascade, 4).unwrap();
    b.begin(&purge).unwrap();
    let LogRecord::Purge { sessions, .. } = purge.into_record() else {
        panic!();
    };
    assert_eq!(sessions.len(), 3);
    // Released without purging (a purge that gave up): writable again.
    b.settle(&LogRecord::Purge {
        session: s,
        mode: PurgeMode::Cascade,
        sessions,
        ts_unix_ms: 4,
    });
    assert!(b
        .plan_message(f, Role::User.into(), "x".into(), &Bytes, 5)
        .is_ok());
}

/// Reroot purges the session only and shows its children as roots. A child
/// filed under it while the purge is in flight (a Create with it as parent
/// runs on the registry, not on its actor) would be neither purged nor
/// rerooted: a live session under a purged parent. It is refused, and a
/// Reroot waits for a child in flight.
#[test]
fn a_child_planned_while_a_reroot_purge_is_in_flight_is_refused() {
    let mut b = SessionBook::new();
    let s = b.reserve_id();
    let mut log = vec![commit!(b, b.plan_create(s, None, P, 1))];
    let f = b.reserve_id();
    let fork = b.plan_fork(f, s, 1, None, 1).unwrap();
    b.begin(&fork).unwrap();
    let gen = b.inspect(s).unwrap().generation;
    let purge = b.plan_purge(s, gen, PurgeMode::Reroot, 2).unwrap();
    assert_eq!(b.begin(&purge), Err(SessionError::Branching(s)));
    let fork = fork.into_record();
    b.apply(&fork).unwrap();
    log.push(fork);
    let purge = b.plan_purge(s, gen, PurgeMode::Reroot, 2).unwrap();
    b.begin(&purge).unwrap();
    let c = b.reserve_id();
    assert_eq!(
        b.plan_create(c, Some(s), P, 3),
        Err(SessionError::Purged(s))
    );
    assert_eq!(b.plan_fork(c, s, 1, None, 3), Err(SessionError::Purged(s)));
    // The child, not being purged, still takes writes and forks.
    let g = b.reserve_id();
    log.push(commit!(b, b.plan_fork(g, f, 1, None, 3)));
    let purge = purge.into_record();
    b.apply(&purge).unwrap();
    log.push(purge);
    assert_eq!(b.tree(), vec![(f, None, None), (g, Some(f), Some(1))]);
    assert_replays(&b, &log, &[s, f, g, c]);
}

#[test]
fn append_text_or_span_and_vocab_check() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    commit!(b, b.plan_append(s, Some("hi".into()), vec![], &Bytes, 1));
    commit!(b, b.plan_append(s, None, vec![104, 105], &Bytes, 1));
    let ev = b.read(s, 1).unwrap();
    assert_eq!(
        ev[0].body,
        Record::Appended {
            text: "hi".into(),
            span: vec![104, 105]
        }
    );
    assert_eq!(ev[1].body, ev[0].body);
    assert!(b.plan_append(s, None, vec![256], &Bytes, 1).is_err());
    assert!(b.plan_append(s, None, vec![], &Bytes, 1).is_err());
    // A span over the cap is refused before it is checked or detokenized.
    let cap = super::plan_messages::MAX_APPEND_TOKENS;
    let refused = b.plan_append(s, None, vec![104; cap + 1], &Bytes, 1);
    assert!(
        matches!(&refused, Err(SessionError::Invalid(m)) if m.contains("131073 tokens")),
        "{refused:?}"
    );
    assert!(b.plan_append(s, None, vec![104; cap], &Bytes, 1).is_ok());
    assert!(b.plan_message(s, 4, "x".into(), &Bytes, 1).is_err());
}

#[test]
fn replay_of_committed_records_rebuilds_the_same_book() {
    let mut b = SessionBook::new();
    let boot = b.plan_boot(1);
    b.apply(&boot).unwrap();
    let mut log = vec![boot];
    let s = b.reserve_id();
    log.push(commit!(b, b.plan_create(s, None, P, 1)));
    for t in ["a", "b", "c"] {
        log.push(commit!(
            b,
            b.plan_message(s, Role::User.into(), t.into(), &Bytes, 2)
        ));
    }
    let f = b.reserve_id();
    log.push(commit!(
        b,
        b.plan_fork(f, s, 2, Some(Params { seed: 9, ..P }), 3)
    ));
    let r = b.reserve_id();
    log.push(commit!(
        b,
        b.plan_rebase(r, s, vec![Edit::Drop { from: 2, to: 3 }], None, &Bytes, 4)
    ));
    log.push(commit!(b, b.plan_meta(f, 0, Some("fork".into()), None, 5)));
    let mut again = SessionBook::new();
    for rec in &log {
        // Through postcard, as the log stores them.
        let bytes = crate::wire::to_postcard(rec).unwrap();
        let back: LogRecord = crate::wire::from_postcard(&bytes).unwrap();
        again.apply(&back).unwrap();
    }
    for id in b.list() {
        assert_eq!(b.read(id, 0), again.read(id, 0));
        assert_eq!(b.inspect(id), again.inspect(id));
    }
    assert_eq!(b.tree(), again.tree());
    assert_eq!(again.epoch(), 1);
}

/// A ToolUse as the generator would commit it.
fn tool_use(b: &mut SessionBook, s: SessionId, name: &str) -> EventId {
    let id = b.len(s).unwrap();
    b.apply(&LogRecord::Events {
        session: s,
        events: vec![Event {
            event_id: id,
            epoch: 0,
            ts_unix_ms: 1,
            body: Record::ToolUse {
                name: name.into(),
                arguments: "{}".into(),
            },
        }],
    })
    .unwrap();
    id
}

#[test]
fn tool_call_bookkeeping() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let call = tool_use(&mut b, s, "f");
    assert_eq!(
        b.open_tool_calls(s).unwrap(),
        vec![(call, "f".into(), "{}".into())]
    );
    assert!(b.plan_tool_result(s, 99, "x".into(), &Bytes, 1).is_err());
    commit!(b, b.plan_tool_result(s, call, "42".into(), &Bytes, 1));
    assert!(b.open_tool_calls(s).unwrap().is_empty());
    let err = b
        .plan_tool_result(s, call, "x".into(), &Bytes, 1)
        .unwrap_err();
    assert!(matches!(err, SessionError::CallAnswered { .. }), "{err}");
    assert_eq!(b.ledger(s).unwrap()[0].status, LedgerStatus::Answered);

    // Two more calls: one cancelled on request, one failed with a note.
    let (g, h) = (tool_use(&mut b, s, "g"), tool_use(&mut b, s, "h"));
    assert_eq!((g, h), (call + 2, call + 3));
    commit!(b, b.plan_tool_cancel(s, g, 1));
    assert_eq!(
        b.ledger(s).unwrap()[1].status,
        LedgerStatus::CancelRequested
    );
    commit!(b, b.plan_tool_outcome(s, g, 2, "stopped".into(), 1));
    assert!(
        b.plan_tool_outcome(s, h, 7, "x".into(), 1).is_err(),
        "outcome is 1 or 2"
    );
    let asked = commit!(b, b.plan_permission_request(s, h, "may I?".into(), 1));
    let LogRecord::Events { events, .. } = asked else {
        panic!()
    };
    let request_id = events[0].event_id;
    assert!(b.plan_permission_response(s, 999, true, 1).is_err());
    commit!(b, b.plan_permission_response(s, request_id, false, 1));
    assert!(
        b.plan_permission_response(s, request_id, true, 1).is_err(),
        "answered once"
    );
    commit!(b, b.plan_tool_outcome(s, h, 1, "denied".into(), 1));
    let ledger = b.ledger(s).unwrap();
    let statuses: Vec<&str> = ledger.iter().map(|e| e.status.name()).collect();
    assert_eq!(statuses, ["answered", "cancelled", "failed"]);
    assert_eq!(ledger[2].permission, Some(false));
    assert!(b.open_tool_calls(s).unwrap().is_empty());
}

#[test]
fn a_rebase_that_moves_calls_keeps_their_results_pointing_at_them() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "a");
    say(&mut b, s, "b");
    say(&mut b, s, "c");
    let f = tool_use(&mut b, s, "f");
    commit!(b, b.plan_tool_result(s, f, "1".into(), &Bytes, 1));
    let g = tool_use(&mut b, s, "g");
    commit!(b, b.plan_tool_cancel(s, g, 1));
    let asked = commit!(b, b.plan_permission_request(s, g, "may I?".into(), 1));
    let LogRecord::Events { events, .. } = asked else {
        panic!()
    };
    commit!(
        b,
        b.plan_permission_response(s, events[0].event_id, true, 1)
    );
    // Drop "b" and "c": everything after moves up by one (the header takes
    // one of the two places).
    let r = b.reserve_id();
    commit!(
        b,
        b.plan_rebase(r, s, vec![Edit::Drop { from: 2, to: 4 }], None, &Bytes, 40)
    );
    let events = b.read(r, 0).unwrap();
    let at = |name: &str| {
        events
            .iter()
            .find(|e| matches!(&e.body, Record::ToolUse { name: n, .. } if n == name))
            .unwrap()
            .event_id
    };
    let (f2, g2) = (at("f"), at("g"));
    assert_eq!((f2, g2), (f - 1, g - 1));
    let refs: Vec<(&str, EventId)> = events
        .iter()
        .filter_map(|e| match &e.body {
            Record::ToolResult { call_id, .. } => Some(("result", *call_id)),
            Record::ToolCancelRequested { call_id } => Some(("cancel", *call_id)),
            Record::PermissionRequested { call_id, .. } => Some(("asked", *call_id)),
            Record::PermissionResponded { request_id, .. } => Some(("answer", *request_id)),
            _ => None,
        })
        .collect();
    let asked_at = events
        .iter()
        .find(|e| matches!(e.body, Record::PermissionRequested { .. }))
        .unwrap()
        .event_id;
    assert_eq!(
        refs,
        [
            ("result", f2),
            ("cancel", g2),
            ("asked", g2),
            ("answer", asked_at)
        ]
    );
    // The ledger agrees: f answered, g open (cancel asked) and permitted.
    let ledger = b.ledger(r).unwrap();
    let got: Vec<(EventId, &str, Option<bool>)> = ledger
        .iter()
        .map(|x| (x.call_id, x.status.name(), x.permission))
        .collect();
    assert_eq!(
        got,
        [(f2, "answered", None), (g2, "cancel requested", Some(true))]
    );
    let err = b
        .plan_tool_result(r, f2, "again".into(), &Bytes, 1)
        .unwrap_err();
    assert!(matches!(err, SessionError::CallAnswered { .. }), "{err}");
    commit!(b, b.plan_tool_result(r, g2, "2".into(), &Bytes, 1));
    assert!(b.open_tool_calls(r).unwrap().is_empty());
    // The parent reads as before.
    assert_eq!(b.ledger(s).unwrap()[0].call_id, f);
}

#[test]
fn a_rebase_of_a_fork_translates_what_its_parents_made() {
    let mut b = SessionBook::new();
    let p = create(&mut b);
    say(&mut b, p, "a");
    say(&mut b, p, "b");
    let call = tool_use(&mut b, p, "f");
    // The fork answers the parent's call.
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, p, b.len(p).unwrap(), None, 30));
    commit!(b, b.plan_tool_result(f, call, "1".into(), &Bytes, 1));
    let second = tool_use(&mut b, f, "g");
    // A rebase of the fork drops "a" and "b": the call, made in p, and the
    // result, made in f, both move up by one.
    let r = b.reserve_id();
    commit!(
        b,
        b.plan_rebase(r, f, vec![Edit::Drop { from: 1, to: 3 }], None, &Bytes, 40)
    );
    let ledger = b.ledger(r).unwrap();
    let got: Vec<(EventId, &str)> = ledger
        .iter()
        .map(|x| (x.call_id, x.status.name()))
        .collect();
    assert_eq!(got, [(call - 1, "answered"), (second - 1, "open")]);
    // A fork of that rebase reads the same.
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, r, b.len(r).unwrap(), None, 30));
    assert_eq!(b.ledger(g).unwrap(), ledger);
    // Dropping the call but keeping its result: the result names no call
    // (its own id), and no call reads as answered by it.
    let d = b.reserve_id();
    commit!(
        b,
        b.plan_rebase(
            d,
            f,
            vec![Edit::Drop {
                from: call,
                to: call + 1
            }],
            None,
            &Bytes,
            40
        )
    );
    let events = b.read(d, 0).unwrap();
    let result = events
        .iter()
        .find(|e| matches!(e.body, Record::ToolResult { .. }))
        .unwrap();
    let Record::ToolResult { call_id, .. } = result.body else {
        panic!()
    };
    assert_eq!(call_id, result.event_id);
    let ledger = b.ledger(d).unwrap();
    let got: Vec<(&str, &str)> = ledger
        .iter()
        .map(|x| (x.name.as_str(), x.status.name()))
        .collect();
    assert_eq!(got, [("g", "open")]);
}

#[test]
fn turn_state_follows_the_last_generated_event() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "q");
    assert_eq!(b.turn_state(s, None).unwrap(), TurnState::Closed);
    let p = plan(&b, s, &Bytes);
    open(&mut b, &p);
    assert_eq!(
        b.turn_state(s, None).unwrap(),
        TurnState::Open {
            in_reasoning: false
        }
    );
    let gen = |text: &str, channel, finish| Record::Generated {
        span: vec![1],
        text: text.into(),
        channel,
        finish,
    };
    commit!(
        b,
        b.plan_output(s, gen("hmm", Channel::Reasoning, Finish::Open), 1)
    );
    assert_eq!(
        b.turn_state(s, Some("</think>")).unwrap(),
        TurnState::Open { in_reasoning: true }
    );
    commit!(
        b,
        b.plan_output(
            s,
            gen("ok</think>", Channel::Reasoning, Finish::MaxTokens),
            1
        )
    );
    assert_eq!(
        b.turn_state(s, Some("</think>")).unwrap(),
        TurnState::Open {
            in_reasoning: false
        }
    );
    commit!(
        b,
        b.plan_output(s, gen("done", Channel::Text, Finish::EndOfTurn), 1)
    );
    assert_eq!(b.turn_state(s, None).unwrap(), TurnState::Closed);
    assert_eq!(
        b.input(s).unwrap().len() as u64,
        b.inspect(s).unwrap().tokens
    );
    assert!(b
        .plan_output(
            s,
            Record::Appended {
                text: "x".into(),
                span: vec![]
            },
            1
        )
        .is_err());
}

#[test]
fn a_very_deep_chain_of_forks_reads_and_purges_without_recursion() {
    let mut b = SessionBook::new();
    let root = create(&mut b);
    say(&mut b, root, "a");
    let mut last = root;
    for _ in 0..20_000 {
        let f = b.reserve_id();
        commit!(b, b.plan_fork(f, last, 2, None, 1));
        last = f;
    }
    assert_eq!(texts(&b, last), ["Created", "a", "Forked"]);
    assert_eq!(ids(&b, last), [0, 1, 2]);
    let gen = b.inspect(root).unwrap().generation;
    let rec = commit!(b, b.plan_purge(root, gen, PurgeMode::Cascade, 1));
    let LogRecord::Purge { sessions, .. } = rec else {
        panic!()
    };
    assert_eq!(sessions.len(), 20_001);
    assert!(b.list().is_empty());
}

// ---- plan_generation ---------------------------------------------------

/// The byte renderer with a thinking template: the assistant header opens a
/// thinking block.
struct Thinking;

impl Render for Thinking {
    fn n_vocab(&self) -> u32 {
        Bytes.n_vocab()
    }
    fn tokenize(&self, text: &str) -> Vec<Token> {
        Bytes.tokenize(text)
    }
    fn detokenize(&self, span: &[Token]) -> String {
        Bytes.detokenize(span)
    }
    fn message_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
        new: &ChatMessage,
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        Bytes.message_span(history, tools, new, first)
    }
    fn system_span(&self, text: Option<&str>, tools: &[String]) -> Result<Vec<Token>, RenderError> {
        Bytes.system_span(text, tools)
    }
    fn generation_prompt_span(
        &self,
        _: &[ChatMessage],
        _: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        Ok(self.tokenize("<2><think>\n"))
    }
    fn piece(&self, token: Token) -> Vec<u8> {
        Bytes.piece(token)
    }
    fn is_eog(&self, token: Token) -> bool {
        Bytes.is_eog(token)
    }
    fn template_source(&self) -> String {
        "{{ '<think>' }}".into()
    }
    fn fim(&self) -> Option<[Token; 3]> {
        None
    }
}

/// A schema converter that accepts anything.
fn any_schema(_: &str) -> Result<String, GrammarError> {
    Ok("root ::= \"{}\"\n".into())
}

const N_CTX: u32 = 100;

fn plan(b: &SessionBook, s: SessionId, render: &dyn Render) -> GenerationPlan {
    b.plan_generation(s, 10, N_CTX, render, &any_schema, 30)
        .expect("plan_generation")
}

/// Commits a plan's opening record, as the actor does before admitting.
fn open(b: &mut SessionBook, plan: &GenerationPlan) {
    if let Some(opening) = plan.opening.clone() {
        b.apply(&opening.into_record()).expect("apply");
    }
}

fn generated(text: &str, finish: Finish) -> Record {
    Record::Generated {
        span: text.bytes().map(u32::from).collect(),
        text: text.into(),
        channel: Channel::Text,
        finish,
    }
}

#[test]
fn generation_on_a_closed_turn_opens_one() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "q");
    let input = b.input(s).unwrap();
    let p = plan(&b, s, &Bytes);
    assert_eq!(p.state, TurnState::Closed);
    let header = Bytes.tokenize("<2>");
    let Some(opening) = &p.opening else {
        panic!("a closed turn is opened: {:?}", p.opening)
    };
    assert_eq!(opening.session, s);
    assert_eq!(opening.event.event_id, b.len(s).unwrap());
    assert_eq!(
        opening.event.body,
        Record::GenerationPrompt {
            span: header.clone()
        }
    );
    assert_eq!(p.prompt, [input, header].concat());
    assert_eq!(
        p.grammar_from,
        p.prompt.len(),
        "the turn begins after its header"
    );
    assert!(p.turn.is_empty());
    assert_eq!(
        (p.class, p.batch_invariant, p.params),
        (QosClass::First, false, P)
    );
    assert_eq!((p.forced_tools.clone(), p.grammar.clone()), (None, None));
    assert!(!p.opened_in_reasoning);
    // Committed, the prompt is the session's input.
    open(&mut b, &p);
    assert_eq!(b.input(s).unwrap(), p.prompt);
}

#[test]
fn generation_refuses_bad_max_tokens_and_dead_sessions() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    for max_tokens in [0, N_CTX + 1] {
        assert_eq!(
            b.plan_generation(s, max_tokens, N_CTX, &Bytes, &any_schema, 1),
            Err(SessionError::MaxTokens { n_ctx: N_CTX })
        );
    }
    assert_eq!(
        b.plan_generation(9, 1, N_CTX, &Bytes, &any_schema, 1),
        Err(SessionError::Unknown(9))
    );
    let gen = b.inspect(s).unwrap().generation;
    commit!(b, b.plan_purge(s, gen, PurgeMode::Cascade, 1));
    assert_eq!(
        b.plan_generation(s, 1, N_CTX, &Bytes, &any_schema, 1),
        Err(SessionError::Purged(s))
    );
}

#[test]
fn generation_continues_an_open_turn_of_this_epoch() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "q");
    commit!(b, b.plan_qos(s, 2, true, 1));
    let first = plan(&b, s, &Bytes);
    open(&mut b, &first);
    commit!(b, b.plan_output(s, generated("ab", Finish::MaxTokens), 1));
    let p = plan(&b, s, &Bytes);
    assert_eq!(
        p.state,
        TurnState::Open {
            in_reasoning: false
        }
    );
    assert_eq!(p.opening, None, "same epoch: nothing to commit");
    assert_eq!(p.prompt, b.input(s).unwrap());
    assert_eq!(p.grammar_from, first.prompt.len());
    assert_eq!(
        p.turn,
        vec![(b'a' as u32, b"a".to_vec()), (b'b' as u32, b"b".to_vec())]
    );
    assert_eq!((p.class, p.batch_invariant), (QosClass::Third, true));
    // A turn the model ended is closed: the next one opens anew.
    commit!(b, b.plan_output(s, generated("c", Finish::EndOfTurn), 1));
    assert_eq!(plan(&b, s, &Bytes).state, TurnState::Closed);
}

#[test]
fn generation_after_an_epoch_change_bumps_the_epoch_first() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "q");
    let first = plan(&b, s, &Bytes);
    open(&mut b, &first);
    commit!(b, b.plan_output(s, generated("ab", Finish::Cancelled), 1));
    let boot = b.plan_boot(40);
    b.apply(&boot).unwrap();
    let p = plan(&b, s, &Bytes);
    let Some(bump) = &p.opening else {
        panic!("an epoch bump: {:?}", p.opening)
    };
    assert_eq!(bump.event.body, Record::EpochBump);
    assert_eq!(bump.event.epoch, b.epoch());
    assert_eq!(bump.event.event_id, b.len(s).unwrap());
    assert_eq!(p.prompt, b.input(s).unwrap(), "an epoch bump has no span");
    assert_eq!(p.turn.len(), 2);
    open(&mut b, &p);
    assert_eq!(plan(&b, s, &Bytes).opening, None, "bumped once");
}

#[test]
fn a_fork_trim_or_rebase_of_a_cut_reply_continues_it() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    say(&mut b, s, "q");
    let first = plan(&b, s, &Bytes);
    open(&mut b, &first);
    commit!(b, b.plan_output(s, generated("ab", Finish::MaxTokens), 1));
    let cut = TurnState::Open {
        in_reasoning: false,
    };
    // A fork (a trim is one) at the end, and a rebase that edits the question.
    let f = b.reserve_id();
    commit!(b, b.plan_fork(f, s, b.len(s).unwrap(), None, 30));
    let r = b.reserve_id();
    let edits = vec![Edit::Replace {
        from: 1,
        to: 2,
        role: Role::User.into(),
        text: "Q".into(),
    }];
    commit!(b, b.plan_rebase(r, s, edits, None, &Bytes, 40));
    for branch in [f, r] {
        let p = plan(&b, branch, &Bytes);
        assert_eq!(p.state, cut, "session {branch}");
        assert_eq!(p.opening, None, "same epoch, no new header: {branch}");
        assert_eq!(p.prompt, b.input(branch).unwrap());
        assert_eq!(
            p.turn,
            vec![(b'a' as u32, b"a".to_vec()), (b'b' as u32, b"b".to_vec())]
        );
        assert!(b.inspect(branch).unwrap().open_turn, "session {branch}");
    }
    // Forked after a restart, the turn cut before it is rebuilt by prefill:
    // the fork's own header is of the new epoch, the cut output is not.
    let boot = b.plan_boot(40);
    b.apply(&boot).unwrap();
    let g = b.reserve_id();
    commit!(b, b.plan_fork(g, s, b.len(s).unwrap(), None, 50));
    let p = plan(&b, g, &Bytes);
    assert_eq!(p.state, cut);
    assert_eq!(
        p.opening.map(|o| o.event.body),
        Some(Record::EpochBump),
        "a fork of a turn cut before the restart"
    );
    // Nor does a QoS set after the restart hide the turn's epoch.
    commit!(b, b.plan_qos(s, 2, false, 60));
    assert_eq!(
        plan(&b, s, &Bytes).opening.map(|o| o.event.body),
        Some(Record::EpochBump),
        "a QoS record after the restart"
    );
}

#[test]
fn generation_with_a_forced_tool_builds_its_grammar() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let tool = r#"{"name":"f","parameters":{"type":"object"}}"#;
    commit!(b, b.plan_system(s, None, vec![tool.into()], &Bytes, 1));
    say(&mut b, s, "q");
    commit!(b, b.plan_tool_choice(s, "required".into(), 1));
    let p = plan(&b, s, &Bytes);
    assert_eq!(
        p.forced_tools,
        Some(vec![(
            "f".to_string(),
            serde_json::json!({"type": "object"})
        )])
    );
    let grammar = p.grammar.clone().expect("a grammar");
    assert!(
        grammar.starts_with("root ::= \"<tool_call>\\n\""),
        "{grammar}"
    );
    // The finish rule: a forced turn the model ends completed its grammar.
    let mut out = p.output();
    out.finish(Finish::EndOfTurn, 1);
    assert_eq!(out.finished(), Some(Finish::Grammar));
    // "auto" forces nothing.
    commit!(b, b.plan_tool_choice(s, "auto".into(), 1));
    let p = plan(&b, s, &Bytes);
    assert_eq!((&p.forced_tools, &p.grammar), (&None, &None));
    let mut out = p.output();
    out.finish(Finish::EndOfTurn, 1);
    assert_eq!(out.finished(), Some(Finish::EndOfTurn));
}

/// A forced call whose grammar cannot be built is refused before anything is
/// planned for commit: no header is left in the log to be "continued" later.
#[test]
fn a_forced_call_without_a_grammar_commits_nothing() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let tool = r#"{"name":"f","parameters":{"type":"object"}}"#;
    commit!(b, b.plan_system(s, None, vec![tool.into()], &Bytes, 1));
    say(&mut b, s, "q");
    commit!(b, b.plan_tool_choice(s, "required".into(), 1));
    let refuse =
        |_: &str| -> Result<String, GrammarError> { Err(GrammarError::Convert("no".into())) };
    let len = b.len(s).unwrap();
    assert_eq!(
        b.plan_generation(s, 10, N_CTX, &Bytes, &refuse, 30).err(),
        Some(SessionError::Grammar(GrammarError::Convert("no".into())))
    );
    assert_eq!(b.len(s).unwrap(), len);
    assert_eq!(b.turn_state(s, None).unwrap(), TurnState::Closed);
}

/// `SetOutputFormat` puts a grammar on every later generation until it is
/// set back to None; a forced tool call wins over it; bad schemas are
/// refused before anything is committed.
#[test]
fn output_format_builds_a_grammar_until_set_back_and_a_forced_call_wins() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let tool = r#"{"name":"f","parameters":{"type":"object"}}"#;
    commit!(b, b.plan_system(s, None, vec![tool.into()], &Bytes, 1));
    say(&mut b, s, "q");
    assert_eq!(plan(&b, s, &Bytes).grammar, None);
    let len = b.len(s).unwrap();
    for bad in ["[1]", "not json", "\"x\""] {
        assert!(matches!(
            b.plan_output_format(s, Some(bad.into()), 1),
            Err(SessionError::Invalid(_))
        ));
    }
    let huge = format!(r#"{{"description":"{}"}}"#, "x".repeat(70_000));
    assert!(b.plan_output_format(s, Some(huge), 1).is_err());
    assert_eq!(b.len(s).unwrap(), len, "a refused schema commits nothing");
    let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
    commit!(b, b.plan_output_format(s, Some(schema.into()), 1));
    let p = plan(&b, s, &Bytes);
    let grammar = p.grammar.clone().expect("a grammar");
    assert!(!grammar.contains("<tool_call>"), "{grammar}");
    assert_eq!(p.forced_tools, None, "an answer is not a forced call");
    assert_eq!(b.turn_state(s, None).unwrap(), TurnState::Closed);
    commit!(b, b.plan_tool_choice(s, "required".into(), 1));
    let grammar = plan(&b, s, &Bytes).grammar.expect("a grammar");
    assert!(
        grammar.contains("<tool_call>"),
        "the forced call wins: {grammar}"
    );
    commit!(b, b.plan_tool_choice(s, "auto".into(), 1));
    commit!(b, b.plan_output_format(s, None, 1));
    assert_eq!(plan(&b, s, &Bytes).grammar, None);
}

#[test]
fn generation_of_a_turn_opened_in_reasoning() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let tool = r#"{"name":"f","parameters":{"type":"object"}}"#;
    commit!(b, b.plan_system(s, None, vec![tool.into()], &Thinking, 1));
    say(&mut b, s, "q");
    commit!(b, b.plan_tool_choice(s, "f".into(), 1));
    let p = plan(&b, s, &Thinking);
    assert!(p.opened_in_reasoning);
    // A forced call's block is parsed as a call, though this template
    // names no tool-call marker.
    assert_eq!(
        p.markers,
        crate::session::output::Markers::from_template("<think>").forcing_a_call()
    );
    assert!(p.markers.tool_call.is_some());
    let grammar = p.grammar.clone().expect("a grammar");
    assert!(
        grammar.starts_with("root ::= \"</think>\\n\\n\" \"<tool_call>"),
        "the grammar closes the thinking block first: {grammar}"
    );
    // Cut inside the thinking block, the turn continues there.
    open(&mut b, &p);
    let mut cut = generated("hm", Finish::MaxTokens);
    if let Record::Generated { channel, .. } = &mut cut {
        *channel = Channel::Reasoning;
    }
    commit!(b, b.plan_output(s, cut, 1));
    let p = plan(&b, s, &Thinking);
    assert_eq!(p.state, TurnState::Open { in_reasoning: true });
    assert!(p.opened_in_reasoning, "as the turn opened");
    assert_eq!(p.turn.len(), 2);
}

#[test]
fn the_finish_rule() {
    use crate::session::turn::{ends_turn, reported_finish};
    assert!(ends_turn(Finish::EndOfTurn) && ends_turn(Finish::Grammar));
    for open in [
        Finish::Open,
        Finish::MaxTokens,
        Finish::Cancelled,
        Finish::Error,
    ] {
        assert!(!ends_turn(open));
        assert_eq!(reported_finish(open, true), open);
    }
    assert_eq!(reported_finish(Finish::EndOfTurn, true), Finish::Grammar);
    assert_eq!(reported_finish(Finish::EndOfTurn, false), Finish::EndOfTurn);
}

#[test]
fn input_after_counts_what_the_appends_and_the_header_put_on_the_input() {
    let mut b = SessionBook::new();
    let s = create(&mut b);
    let tools = vec!["{\"name\":\"f\"}".to_string()];
    let hi = ChatMessage {
        role: Role::User,
        content: "hi".into(),
    };
    let system = Some((Some("be brief"), tools.as_slice()));
    let counted = input_after(
        &b.read(s, 0).unwrap(),
        system,
        &[hi.clone(), hi.clone()],
        &Bytes,
    );
    commit!(
        b,
        b.plan_system(s, Some("be brief".into()), tools.clone(), &Bytes, 1)
    );
    say(&mut b, s, "hi");
    say(&mut b, s, "hi");
    let plan = b
        .plan_generation(s, 1, N_CTX, &Bytes, &any_schema, 30)
        .unwrap();
    assert_eq!(counted.unwrap(), plan.prompt.len());
    // With input on the session, the system turn is not appended again.
    let more = input_after(
        &b.read(s, 0).unwrap(),
        system,
        std::slice::from_ref(&hi),
        &Bytes,
    )
    .unwrap();
    let span = Bytes.message_span(&[], &[], &hi, false).unwrap();
    assert_eq!(more, plan.prompt.len() + span.len());
    // The first message of a bare session renders as the first.
    let t = create(&mut b);
    let counted = input_after(&b.read(t, 0).unwrap(), None, &[hi], &Bytes).unwrap();
    say(&mut b, t, "hi");
    let plan = b
        .plan_generation(t, 1, N_CTX, &Bytes, &any_schema, 30)
        .unwrap();
    assert_eq!(counted, plan.prompt.len());
}
