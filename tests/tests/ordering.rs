//! The ordering invariant, in process: **no reply carrying an event leaves
//! before the fsync that covers it**. The WAL writer's failpoint holds the
//! fsync; while it is held, neither the Committed reply nor a Read may show
//! the event.

use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use actix::prelude::*;
use superfluid::actors::lane::{LaneActor, LaneConfig};
use superfluid::actors::registry::{Dispatch, Registry};
use superfluid::actors::scheduler::SchedulerActor;
use superfluid::actors::wal::WalActor;
use superfluid::actors::Shared;
use superfluid::daemon::{replay, ModelRender};
use superfluid::scheduler::SchedulerState;
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
        let wal = WalActor::new(w.clone()).start();
        // The lane is not used here, but every Shared has one.
        let worker = WorkerConfig {
            n_ctx: 512,
            n_seq: 1,
            n_batch: 512,
            threads: 1,
        };
        let lane = LaneActor::new(LaneConfig {
            model: model_path(),
            worker: worker.clone(),
            exe: crate::util::bin().into(),
        })
        .start();
        let scheduler = SchedulerActor::new(SchedulerState::new(512, 1, 512), lane).start();
        let shared = Shared {
            book: Arc::new(RwLock::new(book)),
            render,
            wal,
            scheduler,
            n_ctx: worker.n_ctx,
            bus: Default::default(),
        };
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
        // ...and a Read through the registry from another task neither
        // (it queues behind the append, or answers without the event).
        let mut read =
            actix_rt::spawn(registry.send(Dispatch(Request::Read { session, cursor: 0 })));
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(100), &mut read).await {
            match r.unwrap().unwrap() {
                Response::Events { events } => {
                    assert_eq!(events.len(), 1, "a Read saw an event before its fsync")
                }
                other => panic!("{other:?}"),
            }
        }

        gate.set(false);
        let event = match reply.await.unwrap().unwrap() {
            Response::Committed { event } => event,
            other => panic!("{other:?}"),
        };
        assert_eq!(event.event_id, 1);
        let on_disk = std::fs::metadata(&wal_path).unwrap().len();
        assert!(
            w.durable_len() >= on_disk,
            "durable_len {} < record end {on_disk}",
            w.durable_len()
        );
        assert_eq!(shared.read().read(session, 0).unwrap().len(), 2);
        if !read.is_finished() {
            match read.await.unwrap().unwrap() {
                Response::Events { events } => assert!(events.len() <= 2),
                other => panic!("{other:?}"),
            }
        }
        System::current().stop();
    });
    writer.shutdown();
}
