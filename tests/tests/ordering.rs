//! The ordering invariant, in process: **no reply carrying an event leaves
//! before the fsync that covers it**. The WAL writer's failpoint holds the
//! fsync; while it is held, neither the Committed reply, a Read nor a
//! subscriber may show the event. The actors are the daemon's own, built by
//! `daemon::start_actors`.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use actix::prelude::*;
use superfluid::actors::bus::{BusItem, SUB_BUFFER_EVENTS};
use superfluid::actors::lane::LaneState;
use superfluid::actors::registry::{Dispatch, Registry};
use superfluid::daemon::{replay, start_actors, ModelRender, ServeConfig};
use superfluid::scheduler::DEFAULT_PIN_BUDGET_PCT;
use superfluid::store::{OpenMode, WalWriter};
use superfluid::wire::worker::WorkerConfig;
use superfluid::wire::{Request, Response, Role};

use crate::util::{model_path, params};

/// A gate the writer thread waits at before every fdatasync.
#[derive(Default)]
struct Gate {
    held: Mutex<bool>,
    cv: Condvar,
    /// fsyncs that reached the gate.
    arrived: Mutex<u64>,
}

impl Gate {
    fn set(&self, held: bool) {
        *self.held.lock().unwrap() = held;
        self.cv.notify_all();
    }
    fn wait(&self) {
        *self.arrived.lock().unwrap() += 1;
        let mut held = self.held.lock().unwrap();
        while *held {
            held = self.cv.wait(held).unwrap();
        }
    }
    fn arrived(&self) -> u64 {
        *self.arrived.lock().unwrap()
    }
}

/// How long the lane's worker may take to load the model.
const WORKER_LOAD_TIMEOUT_SECS: u64 = 60;

/// How long a Read sent while the fsync is held is watched for an answer.
const READ_WAIT_MS: u64 = 100;

#[test]
fn no_reply_before_the_fsync_that_covers_it() {
    let dir = tempfile::tempdir().unwrap();
    let render = Arc::new(ModelRender::load(&model_path()).unwrap());
    let (file, book) = replay(dir.path(), OpenMode::Durable).unwrap();
    let gate = Arc::new(Gate::default());
    let hook_gate = gate.clone();
    let writer =
        WalWriter::spawn(file, Some(Arc::new(move || hook_gate.wait()))).expect("wal-writer");
    let wal_path = dir.path().join("wal.log");

    let w = writer.clone();
    actix::System::new().block_on(async move {
        // The daemon's own actors; the lane is not used here.
        let config = ServeConfig {
            model: model_path(),
            sessions: dir.path().to_path_buf(),
            socket: dir.path().join("unused.sock"),
            sessions_cache: false,
            worker: WorkerConfig {
                n_ctx: 512,
                n_seq: 1,
                n_batch: 512,
                threads: 1,
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
        let shared = start_actors(
            &config,
            crate::util::bin().into(),
            book,
            w.clone(),
            render,
            None,
        );
        let registry = Registry::new(shared.clone()).start();
        let session = match registry
            .send(Dispatch(Request::Create {
                parent: None,
                params: params(1),
            }))
            .await
            .unwrap()
        {
            Response::Created { session } => session,
            other => panic!("{other:?}"),
        };

        // A subscriber of the session, registered as a Subscribe does.
        let mut sub = shared.bus.subscribe(session, true);

        gate.set(true);
        let durable_before = w.durable_len();
        let arrived_before = gate.arrived();
        let mut reply = actix_rt::spawn(registry.send(Dispatch(Request::AppendMessage {
            session,
            role: Role::User.into(),
            text: "held at the fsync".into(),
        })));
        // Wait until the writer is parked at the failpoint: the record is
        // written (not yet synced).
        while gate.arrived() == arrived_before {
            actix_rt::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(200), &mut reply)
                .await
                .is_err(),
            "the reply left before the fsync covering its record"
        );
        assert_eq!(w.durable_len(), durable_before);
        assert!(std::fs::metadata(&wal_path).unwrap().len() > durable_before);
        // The book does not show the event...
        assert_eq!(shared.read().read(session, 0).unwrap().len(), 1);
        // ...nor does a subscriber get it...
        assert!(
            tokio::time::timeout(Duration::from_millis(READ_WAIT_MS), sub.recv())
                .await
                .is_err(),
            "a subscriber got an event before the fsync covering its record"
        );
        // ...and a Read through the registry from another task neither: a
        // session runs its requests in order, so the Read queues behind the
        // append, answers only after the fsync, and then shows the event.
        let mut read =
            actix_rt::spawn(registry.send(Dispatch(Request::Read { session, cursor: 0 })));
        assert!(
            tokio::time::timeout(Duration::from_millis(READ_WAIT_MS), &mut read)
                .await
                .is_err(),
            "a Read answered while an append before it waited for its fsync"
        );
        gate.set(false);
        let event = match reply.await.unwrap().unwrap() {
            Response::Committed { event } => event,
            other => panic!("{other:?}"),
        };
        assert_eq!(event.event_id, 1);
        // Once it is durable, the subscriber gets it.
        match tokio::time::timeout(Duration::from_secs(5), sub.recv()).await {
            Ok(Some(BusItem::Event(e))) => assert_eq!(e, event),
            other => panic!("the subscriber after the fsync: {other:?}"),
        }
        let on_disk = std::fs::metadata(&wal_path).unwrap().len();
        assert!(
            w.durable_len() >= on_disk,
            "durable_len {} < record end {on_disk}",
            w.durable_len()
        );
        assert_eq!(shared.read().read(session, 0).unwrap().len(), 2);
        let events = match read.await.unwrap().unwrap() {
            Response::Events { events } => events,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            events.len(),
            2,
            "a Read queued behind the append answered without its event"
        );
        // The lane built beside them publishes its state: its worker loads,
        // and the lane says it is ready.
        let mut lane = shared.lane.clone();
        let ready = tokio::time::timeout(
            Duration::from_secs(WORKER_LOAD_TIMEOUT_SECS),
            lane.wait_for(|s| *s == LaneState::Ready),
        )
        .await;
        assert!(
            matches!(ready, Ok(Ok(_))),
            "the lane never said it was ready"
        );
        System::current().stop();
    });
    writer.shutdown();
}
