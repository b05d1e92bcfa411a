//! A [`Transport`] over the members of a mesh: the control messages travel
//! on a member data channel ([`regent_mesh::PeerChannel`], one QUIC stream
//! per pair: FIFO), the payload through the member's proc's buffer manager,
//! and failures come from the owner's supervision: as soon as the proc
//! learns that a member of the group failed (`Member::peer_state`), or that
//! the mesh moved to a newer generation, every receive fails naming it.
//!
//! A group is a list of mesh ranks (all of them, or a selection); a
//! transport belongs to one generation: build a new one (and a new
//! communicator) after a restart.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use regent_mesh::{ChannelSender, Member, PeerState, Rank};
use regent_net::Generation;
use regent_rdma::BufferManager;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::{Transport, TransportError};
use crate::error::Error;

/// Messages queued from one peer before the transport gives up on the
/// group (a peer flooding past every collective's needs).
pub const MESH_QUEUE_MESSAGES: usize = 1 << 16;

type Failure = Option<(usize, String)>;

/// One member's end of a group of mesh members (see the module docs).
pub struct MeshTransport {
    rank: usize,
    /// Group rank -> mesh rank.
    group: Vec<Rank>,
    sender: ChannelSender,
    buffers: Arc<BufferManager>,
    from: Vec<tokio::sync::Mutex<mpsc::Receiver<Bytes>>>,
    failed: watch::Receiver<Failure>,
    first_failure: Arc<Mutex<Failure>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for MeshTransport {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl std::fmt::Debug for MeshTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTransport")
            .field("rank", &self.rank)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl MeshTransport {
    /// This member's transport in the group of mesh ranks `group` (which
    /// must hold this member's rank), on data channel `tag`. Every member
    /// of the group opens the same `group` and `tag` in the same generation.
    pub fn new(member: &Member, group: Vec<Rank>, tag: u16) -> Result<Self, Error> {
        let rank = group
            .iter()
            .position(|r| *r == member.rank())
            .ok_or_else(|| {
                Error::Transport(TransportError::Closed(format!(
                    "rank {} is not in the group {group:?}",
                    member.rank().0
                )))
            })?;
        let buffers = member
            .buffers()
            .map_err(|e| Error::Transport(TransportError::Closed(e.to_string())))?
            .clone();
        let channel = member
            .channel(tag)
            .map_err(|e| Error::Transport(TransportError::Closed(e.to_string())))?;
        let generation = channel.generation();
        let (sender, mut receiver) = channel.split();
        let size = group.len();
        let mut to_queues = Vec::with_capacity(size);
        let mut from = Vec::with_capacity(size);
        for _ in 0..size {
            let (tx, rx) = mpsc::channel(MESH_QUEUE_MESSAGES);
            to_queues.push(tx);
            from.push(tokio::sync::Mutex::new(rx));
        }
        let (failed_tx, failed) = watch::channel(None);
        let failed_tx = Arc::new(failed_tx);
        let first_failure: Arc<Mutex<Failure>> = Arc::default();
        let fail = {
            let failed_tx = failed_tx.clone();
            let first = first_failure.clone();
            move |rank: usize, reason: String| {
                let mut first = first.lock().expect("first failure lock");
                if first.is_none() {
                    *first = Some((rank, reason.clone()));
                    failed_tx.send_replace(Some((rank, reason)));
                }
            }
        };
        // Messages from the group's members, into one queue per member.
        let index: std::collections::HashMap<u32, usize> =
            group.iter().enumerate().map(|(i, r)| (r.0, i)).collect();
        let pump = {
            let fail = fail.clone();
            tokio::spawn(async move {
                loop {
                    let far = Instant::now() + std::time::Duration::from_secs(24 * 3600);
                    match receiver.recv_any(far).await {
                        Ok((from, data)) => {
                            let Some(&i) = index.get(&from.0) else {
                                tracing::debug!(
                                    from = from.0,
                                    "a channel message from outside the group dropped"
                                );
                                continue;
                            };
                            match to_queues[i].try_send(data) {
                                Ok(()) => {}
                                Err(mpsc::error::TrySendError::Full(_)) => {
                                    fail(
                                        i,
                                        format!(
                                            "over {MESH_QUEUE_MESSAGES} messages queued from it"
                                        ),
                                    );
                                    return;
                                }
                                Err(mpsc::error::TrySendError::Closed(_)) => return,
                            }
                        }
                        Err(regent_mesh::ChannelError::Timeout(_)) => continue,
                        Err(e) => {
                            fail(rank, format!("the data channel ended: {e}"));
                            return;
                        }
                    }
                }
            })
        };
        // Failures of the group's members, and the end of this generation.
        let watch_peers = {
            let group = group.clone();
            let mut state = member.peer_state();
            tokio::spawn(async move {
                loop {
                    let verdict = failure_of(&state.borrow_and_update(), &group, generation);
                    if let Some((rank, reason)) = verdict {
                        fail(rank, reason);
                        return;
                    }
                    if state.changed().await.is_err() {
                        return;
                    }
                }
            })
        };
        Ok(Self {
            rank,
            group,
            sender,
            buffers,
            from,
            failed,
            first_failure,
            tasks: vec![pump, watch_peers],
        })
    }

    /// The mesh ranks of the group, by group rank.
    pub fn group(&self) -> &[Rank] {
        &self.group
    }
}

/// The first member of `group` the state reports failed, or the end of
/// `generation`.
fn failure_of(state: &PeerState, group: &[Rank], generation: Generation) -> Failure {
    if let Some((i, r)) = group
        .iter()
        .enumerate()
        .find(|(_, r)| state.failed.contains(r))
    {
        return Some((i, format!("mesh rank {} failed", r.0)));
    }
    if state.generation > generation {
        // The restarted ranks are not known here: name the first member.
        return Some((
            0,
            format!("the mesh moved to generation {}", state.generation.0),
        ));
    }
    None
}

impl Transport for MeshTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.len()
    }

    fn max_message_bytes(&self) -> usize {
        self.sender.max_message_bytes()
    }

    fn buffers(&self) -> &BufferManager {
        &self.buffers
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.first_failure
            .lock()
            .expect("first failure lock")
            .clone()
    }

    async fn send(&self, to: usize, msg: Bytes) -> Result<(), TransportError> {
        let size = self.group.len();
        let Some(&rank) = self.group.get(to).filter(|_| to != self.rank) else {
            return Err(TransportError::NoSuchRank { rank: to, size });
        };
        if let Some((rank, reason)) = self.failure() {
            return Err(TransportError::PeerFailed { rank, reason });
        }
        if msg.len() > self.max_message_bytes() {
            return Err(TransportError::TooLarge {
                len_bytes: msg.len(),
                max_bytes: self.max_message_bytes(),
            });
        }
        // Sends wait for room at most this long; collectives bound their
        // own waits with their deadlines.
        let deadline = Instant::now() + std::time::Duration::from_secs(60);
        self.sender
            .send(rank, msg, deadline)
            .await
            .map_err(|e| match e {
                regent_mesh::ChannelError::PeerFailed(_) => TransportError::PeerFailed {
                    rank: to,
                    reason: "failed".into(),
                },
                regent_mesh::ChannelError::Timeout(_) => TransportError::Timeout { rank: to },
                other => TransportError::Closed(other.to_string()),
            })
    }

    async fn recv(&self, from: usize, deadline: Instant) -> Result<Bytes, TransportError> {
        let size = self.group.len();
        let Some(queue) = self.from.get(from).filter(|_| from != self.rank) else {
            return Err(TransportError::NoSuchRank { rank: from, size });
        };
        let mut failed = self.failed.clone();
        let mut queue = queue.lock().await;
        loop {
            if let Some((rank, reason)) = failed.borrow_and_update().clone() {
                return Err(TransportError::PeerFailed { rank, reason });
            }
            tokio::select! {
                biased;
                r = failed.changed() => {
                    if r.is_err() {
                        return Err(TransportError::Closed("the transport's watcher ended".into()));
                    }
                }
                m = queue.recv() => {
                    return m.ok_or_else(|| TransportError::Closed("the data channel ended".into()));
                }
                () = tokio::time::sleep_until(deadline) => return Err(TransportError::Timeout { rank: from }),
            }
        }
    }
}
