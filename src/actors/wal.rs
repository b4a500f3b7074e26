//! `WalActor`: the WAL writer as an actor. It encodes nothing and waits for
//! nothing itself: records go to the writer thread of `store::wal::writer`, which
//! group-commits them, and each reply resolves after the fsync that covers
//! its record returned.

use actix::prelude::*;

use crate::store::{Durable, StoreError, WalStats, WalWriter, WriterFailure};

/// Append one encoded record; resolves once it is durable.
#[derive(Message)]
#[rtype(result = "Result<Durable, StoreError>")]
pub struct Commit(pub Vec<u8>);

/// Flush and stop the writer thread (clean shutdown).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// The writer thread's counters and health (for Metrics); the default
/// once it is shut down.
#[derive(Message)]
#[rtype(result = "WalStats")]
pub struct GetWalStats;

pub struct WalActor {
    writer: Option<WalWriter>,
}

impl WalActor {
    pub fn new(writer: WalWriter) -> WalActor {
        WalActor {
            writer: Some(writer),
        }
    }
}

impl Actor for WalActor {
    type Context = Context<Self>;
}

impl Handler<Commit> for WalActor {
    type Result = ResponseFuture<Result<Durable, StoreError>>;

    fn handle(&mut self, msg: Commit, _: &mut Context<Self>) -> Self::Result {
        let Some(writer) = self.writer.clone() else {
            return Box::pin(async { Err(StoreError::WriterFailed(WriterFailure::ShutDown)) });
        };
        let rx = writer.append(msg.0);
        Box::pin(async move {
            let durable = rx
                .await
                .map_err(|_| StoreError::WriterFailed(WriterFailure::Gone))??;
            // The ordering invariant, checked on every commit: the fsync
            // that covers this record has returned before anyone hears of it.
            if writer.durable_len() < durable.end {
                return Err(StoreError::WriterFailed(WriterFailure::NotDurable {
                    end: durable.end,
                    durable: writer.durable_len(),
                }));
            }
            Ok(durable)
        })
    }
}

impl Handler<Shutdown> for WalActor {
    type Result = ();

    fn handle(&mut self, _: Shutdown, _: &mut Context<Self>) {
        if let Some(w) = self.writer.take() {
            w.shutdown();
        }
    }
}

impl Handler<GetWalStats> for WalActor {
    type Result = MessageResult<GetWalStats>;

    fn handle(&mut self, _: GetWalStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.writer
                .as_ref()
                .map(WalWriter::stats)
                .unwrap_or_default(),
        )
    }
}
