//! One node of a cast tree: forward a cast to the heads of its subtree's
//! chunks, deliver it to the selected local members, then gather what comes
//! back — replies, reductions or failures — until all have answered or the
//! node's budget runs out, and report one [`Contribution`] to the parent.
//!
//! Dispatch (forwarding and local delivery) runs to completion before the
//! next cast is taken, so casts from one sender keep their order at every
//! member; collection runs in its own task.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use ractor::ActorRef;
use regent_net::{PortId, ProcId};
use tokio::sync::{mpsc, oneshot};

use crate::actor::{EncodedReply, MemberError, MemberMsg};
use crate::protocol::{
    CastFrame, Collect, Contribution, MemberExited, MeshId, MeshInfo, ProcCommand, ProcReply,
    ReplyBody, ReplyTo, SpawnChild,
};
use crate::registry;
use crate::selection::Selected;
use crate::shape::Rank;
use crate::tree;

/// The share of its budget a node gives its children, so that they answer
/// before it gives up on them.
const CHILD_BUDGET_SHARE: f64 = 0.8;

/// How a node reaches other procs: the control plane, or memory in a
/// simulation.
pub(crate) trait Fabric: Send + Sync {
    /// Sends a command to the proc of rank `proc` in `info`.
    fn command(
        &self,
        info: &MeshInfo,
        proc: u32,
        cmd: ProcCommand,
    ) -> BoxFuture<'_, Result<(), String>>;
    /// Sends an answer or a subtree's result to `port`.
    fn reply(&self, port: PortId, reply: ProcReply) -> BoxFuture<'_, ()>;
    /// The port where this node receives its children's results.
    fn reply_port(&self) -> PortId;
    /// This node's proc.
    fn proc(&self) -> &ProcId;
    /// The actor type procs know by `name` (the registry's, unless the
    /// fabric brings its own, as the simulation does).
    fn actor_type(&self, name: &str) -> Option<&'static registry::ActorType> {
        registry::actor_type(name)
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

/// Calls this node waits on, by number: each child of each cast has one.
#[derive(Default)]
pub(crate) struct Pending {
    next: AtomicU64,
    calls: Mutex<HashMap<u64, Waiter>>,
}

enum Waiter {
    Child {
        results: mpsc::UnboundedSender<(usize, ChildResult)>,
        index: usize,
        /// The subtree's head: its mesh and proc rank.
        head: (MeshId, u32),
    },
    Request(oneshot::Sender<ReplyBody>),
}

impl Pending {
    fn register(&self, waiter: Waiter) -> u64 {
        let call = self.next.fetch_add(1, Ordering::Relaxed);
        self.calls
            .lock()
            .expect("pending calls lock")
            .insert(call, waiter);
        call
    }

    /// Registers a request (spawn, stop) and returns its number and answer.
    pub(crate) fn request(&self) -> (u64, oneshot::Receiver<ReplyBody>) {
        let (tx, rx) = oneshot::channel();
        (self.register(Waiter::Request(tx)), rx)
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
                let _ = results.send((index, ChildResult::Lost(why.to_owned())));
            }
        }
    }

    /// Routes an answer to whoever waits for it; unknown or late answers are
    /// dropped.
    pub(crate) fn resolve(&self, call: u64, body: ReplyBody) {
        let waiter = self.calls.lock().expect("pending calls lock").remove(&call);
        match (waiter, body) {
            (Some(Waiter::Child { results, index, .. }), ReplyBody::Cast(c)) => {
                let _ = results.send((index, ChildResult::Done(c)));
            }
            (Some(Waiter::Request(tx)), body) => {
                let _ = tx.send(body);
            }
            (Some(_), _) => tracing::warn!(call, "answer of the wrong kind dropped"),
            (None, _) => tracing::debug!(call, "late or unknown answer dropped"),
        }
    }
}

/// What a subtree's head sent back, or that it is gone.
pub(crate) enum ChildResult {
    /// The subtree's result.
    Done(Contribution),
    /// The head's proc is gone; nothing will come.
    Lost(String),
}

/// The members of a mesh in this proc, by local index (`None` once gone).
pub(crate) type LocalMembers = Vec<Option<ActorRef<MemberMsg>>>;

/// A dispatched cast, waiting for its results.
pub(crate) struct Dispatched {
    collect: Collect,
    deadline: tokio::time::Instant,
    /// Selected ranks of each child's chunk, for reporting a silent child.
    children: Vec<Option<Vec<u32>>>,
    child_calls: Vec<u64>,
    results: mpsc::UnboundedReceiver<(usize, ChildResult)>,
    local: FuturesUnordered<BoxFuture<'static, (u32, EncodedReply)>>,
    /// Local members whose reply is awaited.
    local_waiting: HashSet<u32>,
    acc: Contribution,
}

fn member_ranks(info: &MeshInfo, procs: Range<u32>) -> Range<u32> {
    procs.start * info.per_proc..procs.end * info.per_proc
}

fn selected_in(selected: &Selected, ranks: Range<u32>) -> Vec<u32> {
    ranks.filter(|&r| selected.contains(Rank(r))).collect()
}

fn any_selected(selected: &Selected, ranks: Range<u32>) -> bool {
    ranks.into_iter().any(|r| selected.contains(Rank(r)))
}

/// Forwards `frame` down the tree and delivers it to `local` (the members of
/// proc `frame.procs.0`; `None` at the root, which holds no member).
pub(crate) async fn dispatch(
    fabric: &dyn Fabric,
    pending: &Pending,
    info: &MeshInfo,
    frame: &CastFrame,
    local: Option<&LocalMembers>,
) -> Dispatched {
    let budget = Duration::from_millis(u64::from(frame.budget_ms));
    let deadline = tokio::time::Instant::now() + budget;
    let (tx, results) = mpsc::unbounded_channel();
    let mut d = Dispatched {
        collect: frame.collect.clone(),
        deadline,
        children: Vec::new(),
        child_calls: Vec::new(),
        results,
        local: FuturesUnordered::new(),
        local_waiting: HashSet::new(),
        acc: Contribution::default(),
    };
    let selected = match frame.selection.bind(&frame.view, frame.seed) {
        Ok(s) => s,
        Err(e) => {
            // The sender checks selections before casting; one that fails
            // here selects nothing.
            tracing::warn!(error = %e, "cast with a selection that does not bind; nothing selected");
            return d;
        }
    };
    let (lo, hi) = frame.procs;
    let chunks: Vec<Range<u32>> = match local {
        Some(_) => tree::children(lo..hi, info.fanout).collect(),
        None => tree::root_children(info.proc_count(), info.fanout).collect(),
    };
    let child_budget = (f64::from(frame.budget_ms) * CHILD_BUDGET_SHARE) as u32;
    for chunk in chunks {
        if !any_selected(&selected, member_ranks(info, chunk.clone())) {
            continue;
        }
        let index = d.children.len();
        let call = pending.register(Waiter::Child {
            results: tx.clone(),
            index,
            head: (frame.mesh, chunk.start),
        });
        let mut child = frame.clone();
        child.procs = (chunk.start, chunk.end);
        child.budget_ms = child_budget;
        child.reply = Some(ReplyTo {
            port: fabric.reply_port(),
            call,
        });
        match fabric
            .command(info, chunk.start, ProcCommand::Cast(child))
            .await
        {
            Ok(()) => {
                d.children
                    .push(Some(selected_in(&selected, member_ranks(info, chunk))));
                d.child_calls.push(call);
            }
            Err(e) => {
                pending.forget(call);
                d.children.push(None);
                d.child_calls.push(call);
                for r in selected_in(&selected, member_ranks(info, chunk)) {
                    d.acc
                        .failed
                        .push((r, MemberError::NotRunning(format!("proc unreachable: {e}"))));
                }
            }
        }
    }
    if let Some(members) = local {
        let first = lo * info.per_proc;
        for (i, member) in members.iter().enumerate() {
            let rank = first + i as u32;
            if !selected.contains(Rank(rank)) {
                continue;
            }
            deliver(&mut d, rank, member.as_ref(), frame);
        }
    }
    d
}

fn deliver(d: &mut Dispatched, rank: u32, member: Option<&ActorRef<MemberMsg>>, frame: &CastFrame) {
    let Some(member) = member else {
        d.acc
            .failed
            .push((rank, MemberError::NotRunning("member has exited".into())));
        return;
    };
    let wants_reply = frame.collect != Collect::Ack;
    let (reply, rx) = if wants_reply {
        let (tx, rx) = oneshot::channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let msg = MemberMsg {
        payload: frame.payload.clone(),
        reply,
    };
    match member.send_message(msg) {
        Ok(()) => match rx {
            None => d.acc.ok += 1,
            Some(rx) => {
                d.local_waiting.insert(rank);
                d.local.push(Box::pin(async move {
                    let r = rx.await.unwrap_or_else(|_| {
                        Err(MemberError::NotRunning(
                            "member failed before it replied".into(),
                        ))
                    });
                    (rank, r)
                }));
            }
        },
        Err(e) => d.acc.failed.push((
            rank,
            MemberError::NotRunning(format!("member mailbox closed: {e}")),
        )),
    }
}

/// Merges one reply or subtree result into the accumulator.
fn merge(collect: &Collect, acc: &mut Contribution, mut part: Contribution) {
    acc.failed.append(&mut part.failed);
    acc.ok += part.ok;
    match collect {
        Collect::Ack => {}
        Collect::Gather => acc.values.append(&mut part.values),
        Collect::Reduce(name) => {
            let Some(value) = part.reduced else { return };
            acc.reduced = Some(match acc.reduced.take() {
                None => value,
                Some(prev) => match registry::reducer(name) {
                    Some(r) => match r.reduce(&prev, &value) {
                        Ok(v) => v,
                        Err(e) => {
                            tracing::error!(reducer = %name, error = %e, "reducer failed; keeping one side");
                            prev
                        }
                    },
                    None => {
                        tracing::error!(reducer = %name, "no such reducer in this proc");
                        prev
                    }
                },
            });
        }
    }
}

fn local_part(collect: &Collect, rank: u32, reply: EncodedReply) -> Contribution {
    let mut part = Contribution::default();
    match reply {
        Err(e) => part.failed.push((rank, e)),
        Ok(value) => {
            part.ok = 1;
            match collect {
                Collect::Ack => {}
                Collect::Gather => part.values.push((rank, value)),
                Collect::Reduce(_) => part.reduced = Some(value),
            }
        }
    }
    part
}

/// Casts `frame` from the root of its tree (the controller, or a member
/// that owns the mesh: it holds no member of it) and waits for what comes
/// back.
pub(crate) async fn from_root(
    fabric: &dyn Fabric,
    pending: &Pending,
    info: &MeshInfo,
    frame: &CastFrame,
) -> Contribution {
    let d = dispatch(fabric, pending, info, frame, None).await;
    collect(pending, d).await
}

/// Waits for the local replies and the children's results until all are in
/// or the deadline passes; what is missing then is reported as timed out.
pub(crate) async fn collect(pending: &Pending, mut d: Dispatched) -> Contribution {
    let mut waiting: Vec<bool> = d.children.iter().map(Option::is_some).collect();
    let mut open_children = waiting.iter().filter(|w| **w).count();
    let deadline = tokio::time::sleep_until(d.deadline);
    tokio::pin!(deadline);
    while open_children > 0 || !d.local.is_empty() {
        tokio::select! {
            Some((rank, reply)) = d.local.next(), if !d.local.is_empty() => {
                d.local_waiting.remove(&rank);
                let part = local_part(&d.collect, rank, reply);
                merge(&d.collect, &mut d.acc, part);
            }
            Some((index, result)) = d.results.recv(), if open_children > 0 => {
                if std::mem::replace(&mut waiting[index], false) {
                    open_children -= 1;
                    match result {
                        ChildResult::Done(part) => merge(&d.collect, &mut d.acc, part),
                        ChildResult::Lost(why) => {
                            if let Some(ranks) = &d.children[index] {
                                d.acc.failed.extend(ranks.iter().map(|&r| {
                                    (r, MemberError::NotRunning(format!("proc lost: {why}")))
                                }));
                            }
                        }
                    }
                }
            }
            () = &mut deadline => break,
        }
    }
    // Whatever has not answered by now is reported, not waited for.
    for (index, still) in waiting.iter().enumerate() {
        if *still {
            pending.forget(d.child_calls[index]);
            if let Some(ranks) = &d.children[index] {
                d.acc
                    .failed
                    .extend(ranks.iter().map(|&r| (r, MemberError::Timeout)));
            }
        }
    }
    if !d.local_waiting.is_empty() {
        tracing::warn!(
            late = d.local_waiting.len(),
            "members did not reply within the budget"
        );
    }
    let mut acc = d.acc;
    acc.failed
        .extend(d.local_waiting.iter().map(|&r| (r, MemberError::Timeout)));
    acc.failed.sort_by_key(|(r, _)| *r);
    acc.values.sort_by_key(|(r, _)| *r);
    acc
}
