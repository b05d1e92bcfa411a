//! How frames move between the nodes of cast trees: the [`Fabric`] trait
//! (the control plane in production, memory in the simulation), its
//! control-plane implementation [`NetFabric`], the calls a node waits on
//! ([`Pending`]), and the procs a node knows to be lost ([`LostProcs`]).
//!
//! Every send has a deadline: a frame that cannot be handed to the control
//! plane before the cast's budget runs out fails, and a frame to a proc
//! known to be lost fails at once, without waiting for the control plane.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use regent_net::{
    ActorId, Endpoint, Generation, Message, PortId, ProcId, SendFailure, TypeTag, WireError,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::protocol::{
    ChildCast, Contribution, MAX_BATCHED_CASTS, MemberExited, MeshId, MeshInfo, ProcCommand,
    ProcReply, ReplyBody, SpawnChild, names,
};

/// Why a frame could not be handed to the control plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SendProblem {
    /// The proc is known to be gone (it exited, or its host or link failed).
    #[error("proc {0} is lost (it exited, or its host or link failed)")]
    Lost(ProcId),
    /// The frame is larger than the control plane carries.
    #[error("a frame of {bytes} bytes exceeds max_frame_bytes = {max}")]
    TooLarge {
        /// The frame's size.
        bytes: u64,
        /// The limit.
        max: usize,
    },
    /// The deadline passed while the proc's send buffer was full.
    #[error("the deadline passed before proc {0} took the frame")]
    Deadline(ProcId),
    /// Anything else the control plane said.
    #[error("{0}")]
    Other(String),
}

impl SendProblem {
    fn of(proc: &ProcId, failure: &SendFailure) -> Self {
        match failure {
            SendFailure::Wire(WireError::FrameTooLarge { len, max }) => Self::TooLarge {
                bytes: *len,
                max: *max,
            },
            other => Self::Other(format!("proc {proc}: {other}")),
        }
    }
}

/// How a node reaches other procs: the control plane, or memory in a
/// simulation.
pub(crate) trait Fabric: Send + Sync {
    /// Sends a command to the proc of rank `proc` in `info`, giving up at
    /// `deadline`.
    fn command(
        &self,
        info: &MeshInfo,
        proc: u32,
        cmd: ProcCommand,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>>;
    /// Sends `child`, one of a fan-out's cast frames, to the proc of rank
    /// `proc` like [`Self::command`]: encoded from the fan-out's shared
    /// runs by a fabric that sends bytes, as a frame by the others.
    fn command_cast(
        &self,
        info: &MeshInfo,
        proc: u32,
        child: ChildCast<'_>,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        self.command(info, proc, ProcCommand::Cast(child.frame()), deadline)
    }
    /// Sends a command to the proc at `addr` (a relay's hop), giving up at
    /// `deadline`.
    fn send_to(
        &self,
        addr: &regent_net::ProcAddr,
        cmd: ProcCommand,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>>;
    /// Sends an answer or a subtree's result to `port`.
    fn reply(&self, port: PortId, reply: ProcReply) -> BoxFuture<'_, ()>;
    /// The port where this node receives its children's results.
    fn reply_port(&self) -> PortId;
    /// This node's proc.
    fn proc(&self) -> &ProcId;
    /// The largest frame the fabric carries.
    fn max_frame_bytes(&self) -> usize {
        usize::MAX
    }
    /// The procs this node knows to be lost.
    fn lost(&self) -> &LostProcs;
    /// Whether members run on threads of their own (not in the simulation,
    /// where a proc holds thousands of members as tasks).
    fn own_threads(&self) -> bool {
        true
    }
    /// Learns where a mesh's procs are.
    fn learn(&self, info: &MeshInfo) {
        let _ = info;
    }
    /// Reports a member's exit to its mesh's owner.
    fn notify(&self, port: PortId, report: MemberExited) -> BoxFuture<'_, ()> {
        let _ = (port, report);
        Box::pin(async {})
    }
    /// Asks the controller to spawn a mesh a member will own.
    fn spawn_child(&self, port: PortId, request: SpawnChild) -> BoxFuture<'_, Result<(), String>> {
        let _ = (port, request);
        Box::pin(async { Err("this fabric cannot reach a controller".to_owned()) })
    }
}

/// The bound on remembered lost procs; the oldest are forgotten first.
const MAX_LOST: usize = 1 << 16;

/// Procs known to be dead or unreachable, as soon as any report says so:
/// frames to them fail at once, and trees route around them. Bounded
/// ([`MAX_LOST`]; the oldest are forgotten first, by which time no mesh
/// addresses them).
#[derive(Default)]
pub(crate) struct LostProcs {
    inner: Mutex<LostInner>,
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct LostInner {
    set: HashSet<ProcId>,
    order: VecDeque<ProcId>,
}

impl LostProcs {
    /// Records a lost proc and wakes whoever waits on one; returns whether it
    /// is new.
    pub(crate) fn insert(&self, proc: &ProcId) -> bool {
        let mut inner = self.inner.lock().expect("lost procs lock");
        if !inner.set.insert(proc.clone()) {
            return false;
        }
        inner.order.push_back(proc.clone());
        if inner.order.len() > MAX_LOST
            && let Some(oldest) = inner.order.pop_front()
        {
            inner.set.remove(&oldest);
        }
        drop(inner);
        self.changed.notify_waiters();
        true
    }

    /// Whether a proc is known to be lost.
    pub(crate) fn contains(&self, proc: &ProcId) -> bool {
        let inner = self.inner.lock().expect("lost procs lock");
        // Asked for every frame sent: no hashing while none is lost.
        !inner.set.is_empty() && inner.set.contains(proc)
    }

    /// The proc ranks of `info` known to be lost.
    pub(crate) fn ranks_of(&self, info: &MeshInfo) -> Vec<u32> {
        let inner = self.inner.lock().expect("lost procs lock");
        if inner.set.is_empty() {
            return Vec::new();
        }
        info.procs
            .iter()
            .enumerate()
            .filter(|(_, a)| inner.set.contains(&a.proc))
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// A future that completes at the next insertion (enable it before
    /// checking, so that none is missed in between).
    pub(crate) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

/// Calls this node waits on, by number: each child of each cast has one,
/// and so has each request (spawn, stop, ...).
#[derive(Default)]
pub(crate) struct Pending {
    next: AtomicU64,
    /// Ordered: a lost proc fails its calls in the order they were made.
    calls: Mutex<BTreeMap<u64, Waiter>>,
}

/// Where a cast-tree node's children's results go. `futures`' channel, not
/// tokio's: a node makes one for every cast that asks a child for results
/// (every call), and tokio's allocates a cache-line-aligned channel and a
/// 32-slot block each time; with its drop that was about 1,200
/// instructions of each call's 35,000 at the controller.
pub(crate) type ResultsSender = futures::channel::mpsc::UnboundedSender<(usize, ChildResult)>;

pub(crate) enum Waiter {
    Child {
        results: ResultsSender,
        index: usize,
        /// The subtree's head: its mesh and proc rank.
        head: (MeshId, u32),
        /// The head's proc: the only one whose answer counts.
        from: ProcId,
    },
    Request {
        answer: oneshot::Sender<ReplyBody>,
        /// The proc asked: the only one whose answer counts.
        from: ProcId,
    },
}

impl Waiter {
    fn from(&self) -> &ProcId {
        match self {
            Self::Child { from, .. } | Self::Request { from, .. } => from,
        }
    }
}

/// What a subtree's head sent back, or that it is gone.
pub(crate) enum ChildResult {
    /// A part of the subtree's result; more follows.
    Part(Contribution),
    /// The subtree's (last part of its) result.
    Done(Contribution),
    /// The head's proc is gone; nothing (more) will come.
    Lost(String),
}

impl Pending {
    /// Calls waited on now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.calls.lock().expect("pending calls lock").len()
    }

    pub(crate) fn register(&self, waiter: Waiter) -> u64 {
        let call = self.next.fetch_add(1, Ordering::Relaxed);
        self.calls
            .lock()
            .expect("pending calls lock")
            .insert(call, waiter);
        call
    }

    /// Registers `waiters` under consecutive numbers (the children's
    /// results of the casts of one batch, whose `i`-th answers the first
    /// number plus `i`); returns the first.
    pub(crate) fn register_block(&self, waiters: impl ExactSizeIterator<Item = Waiter>) -> u64 {
        let first = self.next.fetch_add(waiters.len() as u64, Ordering::Relaxed);
        let mut calls = self.calls.lock().expect("pending calls lock");
        for (call, waiter) in (first..).zip(waiters) {
            calls.insert(call, waiter);
        }
        first
    }

    /// Registers a request (spawn, stop) to `from` and returns its number
    /// and answer.
    pub(crate) fn request(&self, from: &ProcId) -> (u64, oneshot::Receiver<ReplyBody>) {
        let (answer, rx) = oneshot::channel();
        let waiter = Waiter::Request {
            answer,
            from: from.clone(),
        };
        (self.register(waiter), rx)
    }

    /// Forgets a call (its waiter gave up).
    pub(crate) fn forget(&self, call: u64) {
        self.calls.lock().expect("pending calls lock").remove(&call);
    }

    /// Gives up at once on every subtree headed by proc `proc` of `mesh`
    /// (its proc is known to be gone), instead of waiting for deadlines.
    pub(crate) fn lose_proc(&self, mesh: MeshId, proc: u32, why: &str) {
        let mut calls = self.calls.lock().expect("pending calls lock");
        let lost: Vec<u64> = calls
            .iter()
            .filter(|(_, w)| matches!(w, Waiter::Child { head, .. } if *head == (mesh, proc)))
            .map(|(c, _)| *c)
            .collect();
        for call in lost {
            if let Some(Waiter::Child { results, index, .. }) = calls.remove(&call) {
                let _ = results.unbounded_send((index, ChildResult::Lost(why.to_owned())));
            }
        }
    }

    /// Routes an answer from `sender` to whoever waits for it; unknown or
    /// late answers, and answers from another proc than the one asked, are
    /// dropped. The results of a batch's casts ([`ReplyBody::Casts`]) are
    /// routed each as its own call's answer.
    pub(crate) fn resolve(&self, call: u64, body: ReplyBody, sender: &ProcId) {
        let mut calls = self.calls.lock().expect("pending calls lock");
        let ReplyBody::Casts(results) = body else {
            return route(&mut calls, call, body, sender);
        };
        if results.len() > MAX_BATCHED_CASTS {
            tracing::warn!(call, from = %sender, "an answer for more casts than a batch holds dropped");
            return;
        }
        for (i, c) in results {
            match call
                .checked_add(u64::from(i))
                .filter(|_| (i as usize) < MAX_BATCHED_CASTS)
            {
                Some(call) => route(&mut calls, call, ReplyBody::Cast(c), sender),
                None => tracing::warn!(call, from = %sender, "an answer outside its batch dropped"),
            }
        }
    }
}

/// Routes one answer to the waiter of `call` (see [`Pending::resolve`]).
fn route(calls: &mut BTreeMap<u64, Waiter>, call: u64, body: ReplyBody, sender: &ProcId) {
    if calls.get(&call).is_some_and(|w| w.from() != sender) {
        tracing::warn!(call, from = %sender, "an answer from another proc than the one asked dropped");
        return;
    }
    if let ReplyBody::CastPart(part) = body {
        match calls.get(&call) {
            Some(Waiter::Child { results, index, .. }) => {
                let _ = results.unbounded_send((*index, ChildResult::Part(part)));
            }
            Some(_) => tracing::warn!(call, "answer of the wrong kind dropped"),
            None => tracing::debug!(call, "late or unknown answer dropped"),
        }
        return;
    }
    match (calls.remove(&call), body) {
        (Some(Waiter::Child { results, index, .. }), ReplyBody::Cast(c)) => {
            let _ = results.unbounded_send((index, ChildResult::Done(c)));
        }
        (Some(Waiter::Request { answer, .. }), body) => {
            let _ = answer.send(body);
        }
        (Some(_), _) => tracing::warn!(call, "answer of the wrong kind dropped"),
        (None, _) => tracing::debug!(call, "late or unknown answer dropped"),
    }
}

/// The port `port` of the proc runtime actor of `proc`.
pub(crate) fn proc_port(proc: &ProcId, port: u32) -> PortId {
    proc_actor(proc).port(port)
}

/// The proc runtime actor of `proc`.
pub(crate) fn proc_actor(proc: &ProcId) -> ActorId {
    // Made once: every command a node sends names it (a clone shares it).
    static NAME: std::sync::LazyLock<regent_net::ActorName> = std::sync::LazyLock::new(|| {
        regent_net::ActorName::new(names::PROC).expect("a valid constant name")
    });
    ActorId {
        proc: proc.clone(),
        name: NAME.clone(),
        index: 0,
    }
}

/// The control plane as a cast-tree node of a proc (or controller) uses it.
pub(crate) struct NetFabric {
    pub(crate) endpoint: Endpoint,
    pub(crate) me: ActorId,
    /// Cast-tree commands this node has sent (its share of the fan-out).
    pub(crate) commands_sent: AtomicU64,
    pub(crate) lost: LostProcs,
    /// Whether the members of this proc run on threads of their own.
    member_threads: bool,
}

impl NetFabric {
    /// The control plane of `endpoint`, as `me`; members on threads of
    /// their own.
    pub(crate) fn new(endpoint: Endpoint, me: ActorId) -> Self {
        Self {
            endpoint,
            me,
            commands_sent: AtomicU64::new(0),
            lost: LostProcs::default(),
            member_threads: true,
        }
    }

    /// Sets whether members run on threads of their own (`false`: as tasks
    /// of the current runtime, as a deterministic simulation needs).
    pub(crate) fn member_threads(mut self, on: bool) -> Self {
        self.member_threads = on;
        self
    }

    /// Sends `message` to `to`, giving up at `deadline`; a proc known to be
    /// lost fails at once. The message is encoded when the send starts and
    /// only its bytes are kept (`Endpoint::send_ref`): a command is hundreds
    /// of bytes, which every future between here and the endpoint would
    /// otherwise copy as each is built.
    pub(crate) async fn send_by<M: Message>(
        &self,
        to: &PortId,
        generation: Generation,
        message: &M,
        deadline: Instant,
    ) -> Result<(), SendProblem> {
        let send = self.endpoint.send_ref(&self.me, to, generation, message);
        self.send_until(to.proc(), deadline, send).await
    }

    /// [`Self::send_by`] for a message already encoded as a `type_tag`.
    async fn send_encoded_by(
        &self,
        to: &PortId,
        generation: Generation,
        type_tag: TypeTag,
        bytes: Bytes,
        deadline: Instant,
    ) -> Result<(), SendProblem> {
        let send = self
            .endpoint
            .send_raw(&self.me, to, generation, type_tag, bytes)
            .map(|sent| sent.map_err(|e| e.failure));
        self.send_until(to.proc(), deadline, send).await
    }

    /// Runs `send` to `proc` until `deadline`, unless `proc` is known lost.
    async fn send_until(
        &self,
        proc: &ProcId,
        deadline: Instant,
        send: impl Future<Output = Result<(), SendFailure>>,
    ) -> Result<(), SendProblem> {
        if self.lost.contains(proc) {
            return Err(SendProblem::Lost(proc.clone()));
        }
        match tokio::time::timeout_at(deadline, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(failure)) => Err(SendProblem::of(proc, &failure)),
            Err(_) => Err(SendProblem::Deadline(proc.clone())),
        }
    }
}

/// How long replies and reports may wait for a full send buffer: they are
/// small, and a parent that does not take them within this is gone.
const REPLY_SEND_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

impl Fabric for NetFabric {
    fn command(
        &self,
        info: &MeshInfo,
        proc: u32,
        cmd: ProcCommand,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        let target = info.procs.get(proc as usize).map(|a| a.proc.clone());
        self.commands_sent.fetch_add(1, Ordering::Relaxed);
        let generation = info.generation;
        async move {
            let proc =
                target.ok_or_else(|| SendProblem::Other(format!("no proc {proc} in the mesh")))?;
            self.send_by(
                &proc_port(&proc, names::COMMAND_PORT),
                generation,
                &cmd,
                deadline,
            )
            .await
        }
        .boxed()
    }

    fn command_cast(
        &self,
        info: &MeshInfo,
        proc: u32,
        child: ChildCast<'_>,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        let (Some(target), Ok(bytes)) = (
            info.procs.get(proc as usize).map(|a| a.proc.clone()),
            child.bytes(),
        ) else {
            // The whole frame says why, as any command would.
            return self.command(info, proc, ProcCommand::Cast(child.frame()), deadline);
        };
        self.commands_sent.fetch_add(1, Ordering::Relaxed);
        let generation = info.generation;
        async move {
            let to = proc_port(&target, names::COMMAND_PORT);
            self.send_encoded_by(
                &to,
                generation,
                TypeTag::of::<ProcCommand>(),
                bytes,
                deadline,
            )
            .await
        }
        .boxed()
    }

    fn send_to(
        &self,
        addr: &regent_net::ProcAddr,
        cmd: ProcCommand,
        deadline: Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        // A hop is not signed: it may not move a route the owner set.
        self.endpoint.add_route_if_unknown(addr.clone());
        self.commands_sent.fetch_add(1, Ordering::Relaxed);
        let port = proc_port(&addr.proc, names::COMMAND_PORT);
        async move { self.send_by(&port, Generation(0), &cmd, deadline).await }.boxed()
    }

    fn reply_port(&self) -> PortId {
        self.me.port(names::REPLY_PORT)
    }

    fn reply(&self, port: PortId, reply: ProcReply) -> BoxFuture<'_, ()> {
        async move {
            let deadline = Instant::now() + REPLY_SEND_BOUND;
            if let Err(e) = self.send_by(&port, Generation(0), &reply, deadline).await {
                tracing::warn!(to = %port, error = %e, "could not send a reply");
            }
        }
        .boxed()
    }

    fn proc(&self) -> &ProcId {
        self.endpoint.proc()
    }

    fn max_frame_bytes(&self) -> usize {
        self.endpoint.config().max_frame_bytes
    }

    fn lost(&self) -> &LostProcs {
        &self.lost
    }

    fn own_threads(&self) -> bool {
        self.member_threads
    }

    fn learn(&self, info: &MeshInfo) {
        for addr in &info.procs {
            self.endpoint.add_route(addr.clone());
        }
    }

    fn spawn_child(&self, port: PortId, request: SpawnChild) -> BoxFuture<'_, Result<(), String>> {
        async move {
            let deadline = Instant::now() + REPLY_SEND_BOUND;
            self.send_by(&port, Generation(0), &request, deadline)
                .await
                .map_err(|e| e.to_string())
        }
        .boxed()
    }

    fn notify(&self, port: PortId, report: MemberExited) -> BoxFuture<'_, ()> {
        async move {
            let deadline = Instant::now() + REPLY_SEND_BOUND;
            let generation = report.generation;
            if let Err(e) = self.send_by(&port, generation, &report, deadline).await {
                tracing::warn!(to = %port, error = %e, "could not report a member exit");
            }
        }
        .boxed()
    }
}
