//! Point-to-point data channels between the members of one mesh, beside
//! their mailboxes: what collectives and other peer protocols use while a
//! handler runs (a handler cannot take messages from its own mailbox).
//!
//! A channel is identified by a tag; members open the same tag to talk on
//! it. Each (sender, receiver) pair is FIFO (one control-plane stream).
//! Senders are authenticated: a message is taken as from rank `r` only if it
//! came from the proc that hosts `r` in the current generation. Messages of
//! an older generation are dropped, so a zombie cannot reach a survivor.
//! Receiving from a rank fails at once when the owner reports that rank
//! failed, and at the deadline otherwise.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use regent_net::{ActorId, Endpoint, Generation, Inbox, Message, PortId};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{KnownMesh, Member, PeerState};
use crate::error::MeshError;
use crate::shape::Rank;

/// Channel ports start here (below are the proc's own ports).
const CHANNEL_PORT_BASE: u32 = 16;
/// Messages from other ranks kept while a receiver waits for one rank.
const MAX_EARLY_MESSAGES: usize = 4096;
/// Bytes of those.
const MAX_EARLY_BYTES: usize = 256 << 20;

/// Why a channel operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    /// The peer was reported failed (its proc died, it panicked, or it was
    /// cut off); nothing more will come from this life.
    #[error("rank {} failed", .0.0)]
    PeerFailed(Rank),
    /// The mesh moved to a newer generation while waiting: the exchange
    /// began with lives that may be gone.
    #[error("the mesh moved to generation {} (rank {} was awaited)", .generation.0, .rank.0)]
    Restarted {
        /// The awaited rank.
        rank: Rank,
        /// The new generation.
        generation: Generation,
    },
    /// Nothing came from the rank before the deadline.
    #[error("nothing from rank {} before the deadline", .0.0)]
    Timeout(Rank),
    /// No such rank in the mesh.
    #[error("no rank {} in the mesh", .0.0)]
    NoSuchRank(Rank),
    /// Too much arrived from other ranks while waiting for one.
    #[error(
        "over {MAX_EARLY_MESSAGES} messages or {MAX_EARLY_BYTES} bytes from other ranks were waiting"
    )]
    Overflow,
    /// The control plane refused the send.
    #[error("send to rank {}: {message}", .rank.0)]
    Send {
        /// The receiver.
        rank: Rank,
        /// Why.
        message: String,
    },
    /// The channel's port closed (the proc is stopping).
    #[error("the channel closed")]
    Closed,
}

#[derive(Serialize, Deserialize)]
struct ChannelMsg(Bytes);

impl Message for ChannelMsg {
    const TYPE_NAME: &'static str = "regent/mesh/Channel";
}

/// A member's end of a data channel (see the module docs): a sending half
/// and a receiving half, which [`PeerChannel::split`] separates (to send
/// from one task and receive in another).
pub struct PeerChannel {
    sender: ChannelSender,
    receiver: ChannelReceiver,
}

/// The sending half of a [`PeerChannel`]; cheap to clone.
#[derive(Clone)]
pub struct ChannelSender {
    endpoint: Endpoint,
    me: ActorId,
    rank: Rank,
    port: u32,
    known: Arc<KnownMesh>,
    state: watch::Receiver<PeerState>,
}

/// The receiving half of a [`PeerChannel`].
pub struct ChannelReceiver {
    me: ActorId,
    inbox: Inbox,
    known: Arc<KnownMesh>,
    state: watch::Receiver<PeerState>,
    /// Messages that came before they were asked for, by sender rank
    /// (ordered: `recv_any` takes the lowest rank's first).
    early: BTreeMap<u32, VecDeque<Bytes>>,
    early_count: usize,
    early_bytes: usize,
}

impl std::fmt::Debug for PeerChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerChannel")
            .field("me", &self.sender.me)
            .field("port", &self.sender.port)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ChannelSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelSender")
            .field("me", &self.me)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ChannelReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelReceiver")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl PeerChannel {
    pub(crate) fn open(
        member: &Member,
        endpoint: Endpoint,
        known: Arc<KnownMesh>,
        tag: u16,
    ) -> Result<Self, MeshError> {
        let me = member.actor_id()?;
        let port = CHANNEL_PORT_BASE + u32::from(tag);
        let inbox = endpoint.open_port(me.port(port))?;
        let state = known.state.subscribe();
        inbox.set_fence(state.borrow().generation);
        Ok(Self {
            sender: ChannelSender {
                endpoint,
                me: me.clone(),
                rank: member.rank(),
                port,
                known: known.clone(),
                state: state.clone(),
            },
            receiver: ChannelReceiver {
                me,
                inbox,
                known,
                state,
                early: BTreeMap::new(),
                early_count: 0,
                early_bytes: 0,
            },
        })
    }

    /// This member's rank.
    pub fn rank(&self) -> Rank {
        self.sender.rank
    }

    /// The number of members of the mesh.
    pub fn size(&self) -> u32 {
        self.sender.known.info().members()
    }

    /// The mesh's generation now.
    pub fn generation(&self) -> Generation {
        self.sender.generation()
    }

    /// Sends `data` to `rank` (see [`ChannelSender::send`]).
    pub async fn send(
        &self,
        rank: Rank,
        data: Bytes,
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        self.sender.send(rank, data, deadline).await
    }

    /// The next message from `rank` (see [`ChannelReceiver::recv_from`]).
    pub async fn recv_from(
        &mut self,
        rank: Rank,
        deadline: Instant,
    ) -> Result<Bytes, ChannelError> {
        self.receiver.recv_from(rank, deadline).await
    }

    /// The two halves.
    pub fn split(self) -> (ChannelSender, ChannelReceiver) {
        (self.sender, self.receiver)
    }
}

impl ChannelSender {
    /// This member's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The mesh's generation now.
    pub fn generation(&self) -> Generation {
        self.state.borrow().generation
    }

    /// The largest message the channel carries.
    pub fn max_message_bytes(&self) -> usize {
        self.endpoint
            .config()
            .max_frame_bytes
            .saturating_sub(CHANNEL_HEADROOM_BYTES)
    }

    fn target(&self, rank: Rank) -> Result<PortId, ChannelError> {
        let info = self.known.info();
        if rank.0 >= info.members() {
            return Err(ChannelError::NoSuchRank(rank));
        }
        let addr = &info.procs[(rank.0 / info.per_proc) as usize];
        Ok(ActorId {
            proc: addr.proc.clone(),
            name: self.me.name.clone(),
            index: rank.0,
        }
        .port(self.port))
    }

    /// Sends `data` to `rank`, waiting at most until `deadline` for room in
    /// the pair's send buffer. `Ok` means the control plane took it.
    pub async fn send(
        &self,
        rank: Rank,
        data: Bytes,
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        if self.state.borrow().failed.contains(&rank) {
            return Err(ChannelError::PeerFailed(rank));
        }
        let to = self.target(rank)?;
        let generation = self.generation();
        let send = self
            .endpoint
            .send(&self.me, &to, generation, ChannelMsg(data));
        match tokio::time::timeout_at(deadline, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ChannelError::Send {
                rank,
                message: e.failure.to_string(),
            }),
            Err(_) => Err(ChannelError::Timeout(rank)),
        }
    }
}

/// Room in a frame for the envelope around a channel message.
const CHANNEL_HEADROOM_BYTES: usize = 1024;

impl ChannelReceiver {
    fn size(&self) -> u32 {
        self.known.info().members()
    }

    fn generation(&self) -> Generation {
        self.state.borrow().generation
    }

    /// The next message from `rank`, waiting until `deadline`; fails at once
    /// when `rank` is reported failed or the mesh restarts.
    pub async fn recv_from(
        &mut self,
        rank: Rank,
        deadline: Instant,
    ) -> Result<Bytes, ChannelError> {
        if let Some(queue) = self.early.get_mut(&rank.0)
            && let Some(data) = queue.pop_front()
        {
            self.early_count -= 1;
            self.early_bytes -= data.len();
            return Ok(data);
        }
        if rank.0 >= self.size() {
            return Err(ChannelError::NoSuchRank(rank));
        }
        let start = self.generation();
        loop {
            {
                let s = self.state.borrow_and_update();
                if s.failed.contains(&rank) {
                    return Err(ChannelError::PeerFailed(rank));
                }
                if s.generation > start {
                    return Err(ChannelError::Restarted {
                        rank,
                        generation: s.generation,
                    });
                }
            }
            let delivery = tokio::select! {
                // Fixed order (a simulated run replays): a message that
                // came is taken; a state change is checked at the loop's
                // top either way.
                biased;
                d = self.inbox.recv() => d.ok_or(ChannelError::Closed)?,
                r = self.state.changed() => {
                    if r.is_err() {
                        return Err(ChannelError::Closed);
                    }
                    continue;
                }
                () = tokio::time::sleep_until(deadline) => return Err(ChannelError::Timeout(rank)),
            };
            let Some((from, data)) = self.take(delivery) else {
                continue;
            };
            if from == rank.0 {
                return Ok(data);
            }
            if self.early_count >= MAX_EARLY_MESSAGES
                || self.early_bytes + data.len() > MAX_EARLY_BYTES
            {
                return Err(ChannelError::Overflow);
            }
            self.early_count += 1;
            self.early_bytes += data.len();
            self.early.entry(from).or_default().push_back(data);
        }
    }

    /// The next message from any rank (those kept by [`recv_from`]
    /// first), waiting until `deadline`. Peers' failures do not end it:
    /// watch [`Member::peer_state`] for them.
    ///
    /// [`recv_from`]: ChannelReceiver::recv_from
    pub async fn recv_any(&mut self, deadline: Instant) -> Result<(Rank, Bytes), ChannelError> {
        if let Some((&from, _)) = self.early.iter().find(|(_, q)| !q.is_empty()) {
            let data = self
                .early
                .get_mut(&from)
                .and_then(VecDeque::pop_front)
                .expect("a queue found non-empty");
            self.early_count -= 1;
            self.early_bytes -= data.len();
            return Ok((Rank(from), data));
        }
        loop {
            let delivery = tokio::select! {
                biased;
                d = self.inbox.recv() => d.ok_or(ChannelError::Closed)?,
                () = tokio::time::sleep_until(deadline) => return Err(ChannelError::Timeout(self.me_rank())),
            };
            if let Some((from, data)) = self.take(delivery) {
                return Ok((Rank(from), data));
            }
        }
    }

    fn me_rank(&self) -> Rank {
        Rank(self.me.index)
    }

    /// The sender's rank and the data of an authentic delivery of the
    /// current generation; `None` (logged) for anything else.
    fn take(&self, delivery: regent_net::Delivery) -> Option<(u32, Bytes)> {
        let generation = self.generation();
        if delivery.generation < generation {
            tracing::debug!(from = %delivery.sender, "channel message of an older generation dropped");
            return None;
        }
        let from = delivery.sender.index;
        let info = self.known.info();
        let authentic = from < info.members()
            && delivery.sender.name == self.me.name
            && info.procs[(from / info.per_proc) as usize].proc == delivery.sender.proc;
        if !authentic {
            tracing::warn!(from = %delivery.sender, "channel message from a sender that does not host that rank refused");
            return None;
        }
        match delivery.decode::<ChannelMsg>() {
            Ok(ChannelMsg(d)) => Some((from, d)),
            Err(e) => {
                tracing::warn!(error = %e, "undecodable channel message dropped");
                None
            }
        }
    }
}
