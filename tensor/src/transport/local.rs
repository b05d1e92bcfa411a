//! A [`Transport`] for ranks inside one process (tasks or threads): real
//! buffer managers (shm through this process's own memfds, or tcp), and a
//! bounded channel per ordered pair of ranks for the control messages.
//!
//! [`LocalGroup::fail`] plays the part of a mesh's failure detector: every
//! member's receives fail at once, naming the rank. A member whose
//! transport is dropped (its task ended or was aborted) is reported as
//! failed by receives from it once its queued messages are consumed.

use std::sync::Arc;

use bytes::Bytes;
use regent_net::{ClusterCa, ProcId};
use regent_rdma::{BufferManager, ManagerConfig};
use tokio::sync::{Mutex, mpsc, watch};
use tokio::time::Instant;

use super::{Transport, TransportError};
use crate::error::Error;

/// Messages queued per ordered pair before `send` waits.
pub const LOCAL_QUEUE_MESSAGES: usize = 4096;
/// The largest message a local transport carries.
pub const LOCAL_MAX_MESSAGE_BYTES: usize = 16 << 20;

type Failure = Option<(usize, String)>;

/// The shared state of a group of local transports.
#[derive(Clone, Debug)]
pub struct LocalGroup {
    failed: Arc<watch::Sender<Failure>>,
    size: usize,
}

/// One member's end of a [`LocalGroup`].
pub struct LocalTransport {
    rank: usize,
    size: usize,
    manager: BufferManager,
    to: Vec<Option<mpsc::Sender<Bytes>>>,
    from: Vec<Option<Mutex<mpsc::Receiver<Bytes>>>>,
    failed: watch::Receiver<Failure>,
}

impl std::fmt::Debug for LocalTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("proc", self.manager.proc())
            .finish_non_exhaustive()
    }
}

impl LocalGroup {
    /// A group whose rank `i` uses `managers[i]`. The same managers can be
    /// in several groups (a selection of ranks, or the next generation).
    pub fn new(managers: Vec<BufferManager>) -> (Self, Vec<LocalTransport>) {
        let size = managers.len();
        let (failed, _) = watch::channel(None);
        let failed = Arc::new(failed);
        let mut to: Vec<Vec<Option<mpsc::Sender<Bytes>>>> = (0..size)
            .map(|_| (0..size).map(|_| None).collect())
            .collect();
        let mut from: Vec<Vec<Option<Mutex<mpsc::Receiver<Bytes>>>>> = (0..size)
            .map(|_| (0..size).map(|_| None).collect())
            .collect();
        for a in 0..size {
            for b in 0..size {
                if a != b {
                    let (tx, rx) = mpsc::channel(LOCAL_QUEUE_MESSAGES);
                    to[a][b] = Some(tx);
                    from[b][a] = Some(Mutex::new(rx));
                }
            }
        }
        let transports = managers
            .into_iter()
            .zip(to.into_iter().zip(from))
            .enumerate()
            .map(|(rank, (manager, (to, from)))| LocalTransport {
                rank,
                size,
                manager,
                to,
                from,
                failed: failed.subscribe(),
            })
            .collect();
        (Self { failed, size }, transports)
    }

    /// Reports `rank` failed to every member, as a mesh's failure
    /// detector does: their receives fail from now on, naming it. The
    /// first report sticks.
    pub fn fail(&self, rank: usize, reason: impl Into<String>) {
        let reason = reason.into();
        self.failed.send_if_modified(|f| {
            if f.is_none() {
                *f = Some((rank, reason));
                true
            } else {
                false
            }
        });
    }

    /// The failure reported, if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.failed.borrow().clone()
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.size
    }
}

/// Starts `n` buffer managers with credentials from one new cluster CA
/// (procs `rank-0` ...), for local groups. Needs a tokio runtime.
pub async fn local_managers(n: usize, config: ManagerConfig) -> Result<Vec<BufferManager>, Error> {
    local_managers_with(vec![config; n]).await
}

/// Like [`local_managers`], one manager per config (e.g. with different
/// [`ManagerConfig::host`]s, to look like several hosts).
pub async fn local_managers_with(configs: Vec<ManagerConfig>) -> Result<Vec<BufferManager>, Error> {
    let ca = ClusterCa::generate("regent-tensor local group")
        .map_err(|e| Error::Invalid(format!("cluster CA: {e}")))?;
    let mut managers = Vec::with_capacity(configs.len());
    for (i, config) in configs.into_iter().enumerate() {
        let id = ProcId::new(&format!("rank-{i}"))
            .map_err(|e| Error::Invalid(format!("proc id: {e}")))?;
        let creds = ca
            .issue(&id, regent_net::Role::Proc, regent_net::Validity::job())
            .map_err(|e| Error::Invalid(format!("credentials: {e}")))?;
        managers.push(
            BufferManager::start(config, creds)
                .await
                .map_err(Error::Rdma)?,
        );
    }
    Ok(managers)
}

impl LocalTransport {
    fn failure_error(&self) -> Option<TransportError> {
        self.failed
            .borrow()
            .as_ref()
            .map(|(rank, reason)| TransportError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            })
    }

    fn check_rank(&self, rank: usize) -> Result<(), TransportError> {
        if rank >= self.size || rank == self.rank {
            return Err(TransportError::NoSuchRank {
                rank,
                size: self.size,
            });
        }
        Ok(())
    }

    /// Resolves when a failure is reported (never if the group is gone).
    async fn failed(&self) -> TransportError {
        let mut w = self.failed.clone();
        let failure = match w.wait_for(Option::is_some).await {
            Ok(f) => f.clone(),
            // The group handle is gone: nobody can report a failure.
            Err(_) => None,
        };
        match failure {
            Some((rank, reason)) => TransportError::PeerFailed { rank, reason },
            None => std::future::pending().await,
        }
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn max_message_bytes(&self) -> usize {
        LOCAL_MAX_MESSAGE_BYTES
    }

    fn buffers(&self) -> &BufferManager {
        &self.manager
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failed.borrow().clone()
    }

    async fn send(&self, to: usize, msg: Bytes) -> Result<(), TransportError> {
        self.check_rank(to)?;
        if msg.len() > LOCAL_MAX_MESSAGE_BYTES {
            return Err(TransportError::TooLarge {
                len_bytes: msg.len(),
                max_bytes: LOCAL_MAX_MESSAGE_BYTES,
            });
        }
        if let Some(e) = self.failure_error() {
            return Err(e);
        }
        // `check_rank` ruled out self, and every other pair has a channel.
        let tx = self.to[to].as_ref().expect("a channel to every other rank");
        tokio::select! {
            biased;
            e = self.failed() => Err(e),
            r = tx.send(msg) => r.map_err(|_| TransportError::PeerFailed {
                rank: to,
                reason: "its transport was dropped".into(),
            }),
        }
    }

    async fn recv(&self, from: usize, deadline: Instant) -> Result<Bytes, TransportError> {
        self.check_rank(from)?;
        if let Some(e) = self.failure_error() {
            return Err(e);
        }
        // `check_rank` ruled out self, and every other pair has a channel.
        let rx = self.from[from]
            .as_ref()
            .expect("a channel from every other rank");
        let mut rx = rx.lock().await;
        tokio::select! {
            biased;
            e = self.failed() => Err(e),
            m = rx.recv() => m.ok_or_else(|| TransportError::PeerFailed {
                rank: from,
                reason: "its transport was dropped".into(),
            }),
            () = tokio::time::sleep_until(deadline) => Err(TransportError::Timeout { rank: from }),
        }
    }
}
