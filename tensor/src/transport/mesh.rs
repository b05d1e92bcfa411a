//! A [`Transport`] over the members of a mesh: the control messages travel
//! on a member data channel ([`regent_mesh::PeerChannel`], one QUIC stream
//! per pair: FIFO), the payload through the member's proc's buffer manager,
//! and failures come from the owner's supervision: as soon as the proc
//! learns that a member of the group failed ([`Member::failures`],
//! [`Member::peer_state`]), or that the mesh moved to a newer generation,
//! every receive and send fails, naming the member.
//!
//! A group is a list of mesh ranks (all of them, or a selection); a
//! transport belongs to one generation: build a new one (and a new
//! communicator) after a restart.
//!
//! # Opening
//!
//! The control plane drops a message for a channel its receiver has not
//! opened yet, and members open theirs when their handlers get there, at
//! different times. So each transport first says hello to every member of
//! the group (again, with backoff, until it hears from it), and answers
//! the first message it hears from a member with a hello of its own; a
//! member is sent data only once it has been heard from, when its end is
//! known to be open. The member that opens last reaches the others at its
//! first hello, so the exchange costs one message each way.
//!
//! On the wire each message is one byte of kind ([`HELLO`] or [`DATA`])
//! and, for data, the caller's bytes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use regent_mesh::{ChannelError, ChannelSender, Member, MeshFailure, PeerState, Rank};
use regent_net::Generation;
use regent_rdma::BufferManager;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;

use super::{Transport, TransportError};
use crate::error::Error;

/// Messages queued from one peer before the transport gives up on the
/// group (a peer flooding past every collective's needs: the collectives
/// cut a pipelined span into at most 1,024 pieces, and check at compile
/// time that this bound stays above theirs).
pub const MESH_QUEUE_MESSAGES: usize = 1 << 16;
/// The kind byte of a hello (a member's end of the channel is open).
pub const HELLO: u8 = 0;
/// The kind byte of a data message.
pub const DATA: u8 = 1;
/// The first interval between hellos to a member not yet heard from; it
/// doubles up to [`HELLO_MAX_INTERVAL`].
const HELLO_FIRST_INTERVAL: Duration = Duration::from_millis(10);
/// The longest interval between hellos.
const HELLO_MAX_INTERVAL: Duration = Duration::from_millis(500);
/// How long one hello may wait for room.
const HELLO_SEND_WAIT: Duration = Duration::from_secs(1);
/// How long a send waits for the receiver's end to open and for room;
/// collectives bound their own waits with their deadlines.
const SEND_WAIT: Duration = Duration::from_secs(60);

/// Why the group can do no more.
#[derive(Clone, Debug)]
enum End {
    /// A member of the group failed (group rank, what is known).
    Member(usize, String),
    /// The group ended without a member of it being named (the mesh moved
    /// to a newer generation, the channel closed).
    Closed(String),
}

impl End {
    fn error(&self) -> TransportError {
        match self {
            End::Member(rank, reason) => TransportError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            },
            End::Closed(reason) => TransportError::Closed(reason.clone()),
        }
    }
}

/// Records the first end of the group; later ones change nothing.
#[derive(Clone)]
struct Ender(Arc<watch::Sender<Option<End>>>);

impl Ender {
    fn end(&self, end: End) {
        self.0.send_if_modified(|e| {
            if e.is_none() {
                tracing::debug!(?end, "mesh transport: the group ended");
                *e = Some(end);
                true
            } else {
                false
            }
        });
    }
}

/// One member's end of a group of mesh members (see the module docs).
pub struct MeshTransport {
    rank: usize,
    /// Group rank -> mesh rank.
    group: Vec<Rank>,
    sender: ChannelSender,
    buffers: Arc<BufferManager>,
    from: Vec<tokio::sync::Mutex<mpsc::Receiver<Bytes>>>,
    /// Which members were heard from (their end is open).
    heard: watch::Receiver<Vec<bool>>,
    ended: watch::Receiver<Option<End>>,
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

fn closed(e: impl std::fmt::Display) -> Error {
    Error::Transport(TransportError::Closed(e.to_string()))
}

impl MeshTransport {
    /// This member's transport in the group of mesh ranks `group` (which
    /// must hold this member's rank, and no rank twice), on data channel
    /// `tag`. Every member of the group opens the same `group` and `tag`
    /// in the same generation. Needs a tokio runtime (it starts tasks that
    /// end when the transport is dropped).
    ///
    /// A member has one channel per tag: a transport on a tag whose
    /// previous transport was just dropped may find the port still open
    /// (it closes when that transport's tasks have ended, at the runtime's
    /// next turn). Use a tag per generation (e.g. derived from
    /// [`Member::generation`]).
    pub fn new(member: &Member, group: Vec<Rank>, tag: u16) -> Result<Self, Error> {
        let rank = group
            .iter()
            .position(|r| *r == member.rank())
            .ok_or_else(|| {
                closed(format!(
                    "rank {} is not in the group {group:?}",
                    member.rank().0
                ))
            })?;
        let members = member.size();
        let mut seen = std::collections::HashSet::new();
        if let Some(r) = group.iter().find(|r| r.0 >= members || !seen.insert(r.0)) {
            return Err(Error::Invalid(format!(
                "rank {} is twice in the group, or not in a mesh of {members}",
                r.0
            )));
        }
        let buffers = member.buffers().map_err(closed)?.clone();
        // Subscribed before the channel opens, so that no report between
        // the two is missed.
        let failures = member.failures().map_err(closed)?;
        let channel = member.channel(tag).map_err(closed)?;
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
        let (ended_tx, ended) = watch::channel(None);
        let ender = Ender(Arc::new(ended_tx));
        let mut is_heard = vec![false; size];
        is_heard[rank] = true;
        let (heard_tx, heard) = watch::channel(is_heard);
        // Messages from the group's members, into one queue per member.
        let index: HashMap<u32, usize> = group.iter().enumerate().map(|(i, r)| (r.0, i)).collect();
        let pump = {
            let ender = ender.clone();
            tokio::spawn(async move {
                loop {
                    let far = Instant::now() + Duration::from_secs(24 * 3600);
                    let (from, mut data) = match receiver.recv_any(far).await {
                        Ok(m) => m,
                        Err(ChannelError::Timeout(_)) => continue,
                        Err(e) => {
                            ender.end(End::Closed(format!("the data channel ended: {e}")));
                            return;
                        }
                    };
                    let Some(&i) = index.get(&from.0) else {
                        tracing::debug!(
                            from = from.0,
                            "a channel message from outside the group dropped"
                        );
                        continue;
                    };
                    heard_tx.send_if_modified(|h| !std::mem::replace(&mut h[i], true));
                    match data.first().copied() {
                        Some(HELLO) if data.len() == 1 => {}
                        Some(DATA) => {
                            let _kind = data.split_to(1);
                            match to_queues[i].try_send(data) {
                                Ok(()) => {}
                                Err(mpsc::error::TrySendError::Full(_)) => {
                                    ender.end(End::Member(
                                        i,
                                        format!(
                                            "over {MESH_QUEUE_MESSAGES} messages queued from it"
                                        ),
                                    ));
                                    return;
                                }
                                Err(mpsc::error::TrySendError::Closed(_)) => return,
                            }
                        }
                        other => {
                            ender.end(End::Member(
                                i,
                                format!(
                                    "it sent a message of kind {other:?} and {} bytes, which this transport cannot read",
                                    data.len()
                                ),
                            ));
                            return;
                        }
                    }
                }
            })
        };
        let hello = tokio::spawn(say_hello(
            sender.clone(),
            group.clone(),
            rank,
            heard.clone(),
            ended.clone(),
        ));
        let watch_peers = tokio::spawn(watch_group(
            member.peer_state(),
            failures,
            group.clone(),
            generation,
            ender,
        ));
        Ok(Self {
            rank,
            group,
            sender,
            buffers,
            from,
            heard,
            ended,
            tasks: vec![pump, hello, watch_peers],
        })
    }

    /// The mesh ranks of the group, by group rank.
    pub fn group(&self) -> &[Rank] {
        &self.group
    }

    fn ended(&self) -> Option<TransportError> {
        self.ended.borrow().as_ref().map(End::error)
    }

    /// Resolves when the group ends.
    async fn wait_end(ended: &mut watch::Receiver<Option<End>>) -> TransportError {
        match ended.wait_for(Option::is_some).await {
            Ok(e) => e.as_ref().map_or_else(
                || TransportError::Closed("the transport ended".into()),
                End::error,
            ),
            Err(_) => TransportError::Closed("the transport's tasks ended".into()),
        }
    }
}

/// Says hello to every member of the group until it is heard from, and
/// once more to each the first time it is heard from (its end is open
/// then, so that hello arrives).
async fn say_hello(
    sender: ChannelSender,
    group: Vec<Rank>,
    rank: usize,
    mut heard: watch::Receiver<Vec<bool>>,
    mut ended: watch::Receiver<Option<End>>,
) {
    let size = group.len();
    let hello = Bytes::from_static(&[HELLO]);
    let mut answered = vec![false; size];
    answered[rank] = true;
    let now = Instant::now();
    let mut due = vec![now; size];
    let mut interval = vec![HELLO_FIRST_INTERVAL; size];
    loop {
        let now = Instant::now();
        let is_heard = heard.borrow_and_update().clone();
        for q in 0..size {
            if answered[q] || (!is_heard[q] && now < due[q]) {
                continue;
            }
            let r = sender
                .send(group[q], hello.clone(), now + HELLO_SEND_WAIT)
                .await;
            if let Err(e) = r {
                tracing::debug!(to = group[q].0, error = %e, "a hello was not sent");
            }
            if is_heard[q] {
                answered[q] = true;
            } else {
                due[q] = now + interval[q];
                interval[q] = (interval[q] * 2).min(HELLO_MAX_INTERVAL);
            }
        }
        let Some(wake) = (0..size).filter(|&q| !answered[q]).map(|q| due[q]).min() else {
            return;
        };
        tokio::select! {
            r = heard.changed() => {
                if r.is_err() {
                    return;
                }
            }
            _ = ended.wait_for(Option::is_some) => return,
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// Ends the group at the first failure of one of its members the owner
/// reports, or when the mesh moves past `generation`.
async fn watch_group(
    mut state: watch::Receiver<PeerState>,
    failures: broadcast::Receiver<MeshFailure>,
    group: Vec<Rank>,
    generation: Generation,
    ender: Ender,
) {
    let mut failures = Some(failures);
    loop {
        // The reports first: they say why (the state only says who).
        while let Some(f) = failures.as_mut() {
            match f.try_recv() {
                Ok(report) => {
                    if let Some(end) = member_failed(&report, &group) {
                        ender.end(end);
                        return;
                    }
                }
                Err(TryRecvError::Lagged(_)) => {}
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Closed) => failures = None,
            }
        }
        if let Some(end) = state_ends(&state.borrow_and_update(), &group, generation) {
            ender.end(end);
            return;
        }
        let report = async {
            match failures.as_mut() {
                Some(f) => f.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = state.changed() => {
                if r.is_err() {
                    ender.end(End::Closed("the mesh is gone from this proc".into()));
                    return;
                }
            }
            r = report => match r {
                Ok(report) => {
                    if let Some(end) = member_failed(&report, &group) {
                        ender.end(end);
                        return;
                    }
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => failures = None,
            },
        }
    }
}

/// The first member of `group` a report names. The proc passes on only
/// reports about current lives (not about lives a restart already
/// replaced), and the subscription began before the transport's channel
/// opened: a report names a life that was a member of the group. That
/// life may be older than the transport's generation (a survivor of a
/// restart of others), so the report's generation is not compared with
/// it.
fn member_failed(report: &MeshFailure, group: &[Rank]) -> Option<End> {
    let (i, r) = group
        .iter()
        .enumerate()
        .find(|(_, r)| report.ranks.contains(r))?;
    Some(End::Member(
        i,
        format!(
            "mesh rank {} failed (generation {}): {}",
            r.0, report.generation.0, report.cause
        ),
    ))
}

/// The first member of `group` the state reports failed, or the end of
/// `generation`.
fn state_ends(state: &PeerState, group: &[Rank], generation: Generation) -> Option<End> {
    if state.generation > generation {
        // A restart ended the generation; its failure report, which would
        // name the rank, did not reach this proc (or named none of the
        // group, which is cut off all the same: messages of the old
        // generation are dropped).
        return Some(End::Closed(format!(
            "the mesh moved from generation {} to {}",
            generation.0, state.generation.0
        )));
    }
    let (i, r) = group
        .iter()
        .enumerate()
        .find(|(_, r)| state.failed.contains(r))?;
    Some(End::Member(i, format!("mesh rank {} failed", r.0)))
}

impl Transport for MeshTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.len()
    }

    fn max_message_bytes(&self) -> usize {
        // One byte of kind.
        self.sender.max_message_bytes().saturating_sub(1)
    }

    fn buffers(&self) -> &BufferManager {
        &self.buffers
    }

    fn failure(&self) -> Option<(usize, String)> {
        match self.ended.borrow().as_ref() {
            Some(End::Member(rank, reason)) => Some((*rank, reason.clone())),
            _ => None,
        }
    }

    async fn send(&self, to: usize, msg: Bytes) -> Result<(), TransportError> {
        let size = self.group.len();
        let Some(&rank) = self.group.get(to).filter(|_| to != self.rank) else {
            return Err(TransportError::NoSuchRank { rank: to, size });
        };
        if let Some(e) = self.ended() {
            return Err(e);
        }
        if msg.len() > self.max_message_bytes() {
            return Err(TransportError::TooLarge {
                len_bytes: msg.len(),
                max_bytes: self.max_message_bytes(),
            });
        }
        let deadline = Instant::now() + SEND_WAIT;
        if !self.heard.borrow()[to] {
            // Its end is not known open yet: a message now could be lost.
            let mut heard = self.heard.clone();
            let mut ended = self.ended.clone();
            let open = async {
                match heard.wait_for(|h| h[to]).await {
                    Ok(_) => Ok(()),
                    Err(_) => Err(TransportError::Closed("the transport's tasks ended".into())),
                }
            };
            tokio::select! {
                biased;
                e = Self::wait_end(&mut ended) => return Err(e),
                r = open => r?,
                () = tokio::time::sleep_until(deadline) => {
                    return Err(TransportError::Timeout { rank: to });
                }
            }
        }
        let mut framed = BytesMut::with_capacity(msg.len() + 1);
        framed.put_u8(DATA);
        framed.extend_from_slice(&msg);
        let mut ended = self.ended.clone();
        tokio::select! {
            biased;
            e = Self::wait_end(&mut ended) => Err(e),
            r = self.sender.send(rank, framed.freeze(), deadline) => r.map_err(|e| match e {
                ChannelError::PeerFailed(_) => self.ended().unwrap_or(TransportError::PeerFailed {
                    rank: to,
                    reason: format!("mesh rank {} failed", rank.0),
                }),
                ChannelError::Timeout(_) => TransportError::Timeout { rank: to },
                other => TransportError::Closed(format!("sending to rank {to}: {other}")),
            }),
        }
    }

    async fn recv(&self, from: usize, deadline: Instant) -> Result<Bytes, TransportError> {
        let size = self.group.len();
        let Some(queue) = self.from.get(from).filter(|_| from != self.rank) else {
            return Err(TransportError::NoSuchRank { rank: from, size });
        };
        if let Some(e) = self.ended() {
            return Err(e);
        }
        let mut ended = self.ended.clone();
        let mut queue = queue.lock().await;
        tokio::select! {
            biased;
            e = Self::wait_end(&mut ended) => Err(e),
            m = queue.recv() => m.ok_or_else(|| TransportError::Closed("the data channel ended".into())),
            () = tokio::time::sleep_until(deadline) => Err(TransportError::Timeout { rank: from }),
        }
    }
}

#[cfg(test)]
mod tests {
    use regent_mesh::FailureCause;

    use super::*;

    fn report(ranks: &[u32], generation: u64) -> MeshFailure {
        MeshFailure {
            mesh: "m".into(),
            ranks: ranks.iter().copied().map(Rank).collect(),
            cause: FailureCause::Stopped,
            generation: Generation(generation),
        }
    }

    #[test]
    fn a_report_names_the_first_failed_member_of_the_group_with_its_cause() {
        let group = [Rank(4), Rank(1), Rank(2)];
        match member_failed(&report(&[2, 1], 3), &group) {
            Some(End::Member(1, why)) => {
                assert!(why.contains("mesh rank 1 failed (generation 3)"), "{why}");
                assert!(why.contains(&FailureCause::Stopped.to_string()), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(member_failed(&report(&[0, 3], 3), &group).is_none());
    }

    /// A survivor of a restart of other ranks keeps its life from an older
    /// generation; when it fails, the report says that generation. A
    /// transport of the new generation ends on it, with the cause.
    #[test]
    fn a_survivor_of_an_earlier_restart_is_named_with_its_cause() {
        let group = [Rank(0), Rank(1), Rank(2)];
        match member_failed(&report(&[2], 0), &group) {
            Some(End::Member(2, why)) => assert!(why.contains("(generation 0)"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_state_ends_a_group_on_a_newer_generation_or_a_failed_member() {
        let group = [Rank(0), Rank(1)];
        let state = |generation, failed: &[u32]| PeerState {
            generation: Generation(generation),
            failed: failed.iter().copied().map(Rank).collect(),
        };
        assert!(state_ends(&state(2, &[]), &group, Generation(2)).is_none());
        assert!(state_ends(&state(2, &[5]), &group, Generation(2)).is_none());
        assert!(matches!(
            state_ends(&state(2, &[1]), &group, Generation(2)),
            Some(End::Member(1, _))
        ));
        assert!(matches!(
            state_ends(&state(3, &[]), &group, Generation(2)),
            Some(End::Closed(_))
        ));
    }
}
