//! One node of a cast tree: forward a cast to the heads of its subtree's
//! chunks, deliver it to the selected local members, then gather what comes
//! back — replies, reductions or failures — until all have answered or the
//! node's budget runs out, and report one [`Contribution`] to the parent.
//!
//! Dispatch (forwarding and local delivery) runs to completion before the
//! next cast is taken, so casts from one sender keep their order at every
//! member; collection runs in its own task. A chunk whose head is lost is
//! routed around: its own members fail at once and its subtree's chunks are
//! forwarded to directly.

use std::collections::BTreeSet;
use std::ops::Range;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use ractor::ActorRef;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{EncodedReply, MemberError};
use crate::fabric::{ChildResult, Fabric, Pending, ResultsSender, Waiter};
use crate::mailbox::MemberMsg;
use crate::protocol::{
    CastEncoding, CastFrame, ChildCast, Collect, Contribution, MeshInfo, ProcCommand, ReplyTo,
};
use crate::reducer;
use crate::selection::Selected;
use crate::shape::Rank;
use crate::tree;

/// The share of its budget a node gives its children, so that they answer
/// before it gives up on them.
const CHILD_BUDGET_SHARE: f64 = 0.8;

/// The members of a mesh in this proc, by local index (`None` once gone).
pub(crate) type LocalMembers = Vec<Option<ActorRef<MemberMsg>>>;

/// Both ends of a node's channel of its children's results (the node keeps
/// the sender to hand a clone to each child's waiter).
type ResultsChannel = (
    ResultsSender,
    futures::channel::mpsc::UnboundedReceiver<(usize, ChildResult)>,
);

/// A dispatched cast, waiting for its results.
pub(crate) struct Dispatched {
    collect: Collect,
    deadline: Instant,
    /// Selected ranks of each child's chunk, for reporting a silent child.
    children: Vec<Vec<u32>>,
    child_calls: Vec<u64>,
    /// The channel of the children's results, made when the first child is
    /// asked for one: a node without children (a leaf, or a cast that
    /// selects only local members) makes none.
    results: Option<ResultsChannel>,
    local: LocalReplies,
    /// Local members whose reply is awaited.
    local_waiting: BTreeSet<u32>,
    acc: Contribution,
}

impl Dispatched {
    fn new(collect: Collect, deadline: Instant) -> Self {
        Self {
            collect,
            deadline,
            children: Vec::new(),
            child_calls: Vec::new(),
            results: None,
            local: LocalReplies::None,
            local_waiting: BTreeSet::new(),
            acc: Contribution::default(),
        }
    }

    /// Whether it waits on one child at most and on no local member.
    pub(crate) fn one_child_only(&self) -> bool {
        self.children.len() <= 1 && self.local.is_empty()
    }

    /// Where a child's result goes (the channel is made at the first
    /// child).
    fn results_sender(&mut self) -> ResultsSender {
        self.results
            .get_or_insert_with(futures::channel::mpsc::unbounded)
            .0
            .clone()
    }
}

/// A local member's reply, with its rank.
type LocalReply = BoxFuture<'static, (u32, EncodedReply)>;

/// The local members' replies a node waits for. Most casts wait for none
/// (fire-and-forget, acknowledged, or no local member: the root) and a call
/// to one member for one: those make no `FuturesUnordered` (its queue and
/// task allocations, and a wake through it per reply).
enum LocalReplies {
    None,
    One(LocalReply),
    Many(FuturesUnordered<LocalReply>),
}

impl LocalReplies {
    fn push(&mut self, reply: LocalReply) {
        *self = match std::mem::replace(self, Self::None) {
            Self::None => Self::One(reply),
            Self::One(first) => Self::Many([first, reply].into_iter().collect()),
            Self::Many(all) => {
                all.push(reply);
                Self::Many(all)
            }
        };
    }

    fn is_empty(&self) -> bool {
        match self {
            Self::None => true,
            Self::One(_) => false,
            Self::Many(all) => all.is_empty(),
        }
    }

    /// The next reply in; `None` once none is awaited. Cancel-safe: a
    /// reply not yet in stays awaited.
    async fn next(&mut self) -> Option<(u32, EncodedReply)> {
        match self {
            Self::None => None,
            Self::One(reply) => {
                let r = reply.await;
                *self = Self::None;
                Some(r)
            }
            Self::Many(all) => all.next().await,
        }
    }
}

/// The member ranks of a range of procs (checked: validated frames keep
/// them within `u32`).
pub(crate) fn member_ranks(per_proc: u32, procs: Range<u32>) -> Range<u32> {
    procs.start.saturating_mul(per_proc)..procs.end.saturating_mul(per_proc)
}

fn selected_in(selected: &Selected, ranks: Range<u32>) -> Vec<u32> {
    ranks.filter(|&r| selected.contains(Rank(r))).collect()
}

/// A cast frame with its selection bound to its view and seed. A frame is
/// bound once, where it is checked (the sender's [`super::frame`], a proc's
/// [`CastFrame::validate_at`]), and every later step of its handling
/// (dispatch, the checks of a held cast, a failure's reply) reads the
/// members it selects from here: binding is a pure function of the
/// selection, the view and the seed, so no step needs to bind it again.
///
/// The frame is on the heap: a bound cast passes through channels and
/// futures on its way to dispatch (the caster's queue, a proc's mesh
/// dispatcher, its held casts), each of which copies what it is given, and
/// a frame is 320 bytes.
pub(crate) struct Bound {
    pub(crate) frame: Box<CastFrame>,
    pub(crate) selected: Selected,
}

impl Bound {
    /// Binds `frame`'s selection.
    pub(crate) fn new(frame: CastFrame) -> Result<Self, crate::selection::SelectionError> {
        let selected = frame.selection.bind(&frame.view, frame.seed)?;
        Ok(Self {
            frame: Box::new(frame),
            selected,
        })
    }
}

/// Forwards `cast` down the tree and delivers it to `local` (the members of
/// proc `frame.procs.0`; `None` at the root, which holds no member). With
/// `replies` false (a fire-and-forget cast at the root), nothing is
/// registered and children are asked for no result.
///
/// Returns what each cast of the frame waits for: one for a single cast or
/// a fire-and-forget batch, and one per cast, in order, for a batch that
/// wants results (each child answers the `i`-th under the `i`-th of a block
/// of call numbers, [`Pending::register_block`]).
pub(crate) async fn dispatch(
    fabric: &dyn Fabric,
    pending: &Pending,
    info: &MeshInfo,
    cast: &Bound,
    local: Option<&LocalMembers>,
) -> Vec<Dispatched> {
    let Bound { frame, selected } = cast;
    let budget = Duration::from_millis(u64::from(frame.budget_ms));
    let deadline = Instant::now() + budget;
    // At the root, `reply` says whether the caller waits for results.
    let replies = frame.reply.is_some();
    let casts = if replies { 1 + frame.more.len() } else { 1 };
    let mut ds: Vec<Dispatched> = (0..casts)
        .map(|_| Dispatched::new(frame.collect.clone(), deadline))
        .collect();
    let (lo, hi) = frame.procs;
    let mut chunks: Vec<Range<u32>> = match local {
        Some(_) => tree::children(lo..hi, info.fanout).collect(),
        None => tree::root_children(info.proc_count(), info.fanout).collect(),
    };
    chunks.reverse(); // a stack, taken in order
    let child_budget = (f64::from(frame.budget_ms) * CHILD_BUDGET_SHARE) as u32;
    // The children's shared fields, encoded at the first child sent to.
    let mut encoded: Option<Result<CastEncoding, String>> = None;
    while let Some(chunk) = chunks.pop() {
        let ranks = member_ranks(info.per_proc, chunk.clone());
        let chosen = selected_in(selected, ranks);
        if chosen.is_empty() {
            continue;
        }
        let head_lost = frame.lost.contains(&chunk.start)
            || info
                .procs
                .get(chunk.start as usize)
                .is_some_and(|a| fabric.lost().contains(&a.proc));
        if head_lost {
            // Around a lost head: its members fail now, its subtree is
            // forwarded to directly (in order, before the next chunk).
            let head = member_ranks(info.per_proc, chunk.start..chunk.start + 1);
            fail_each(&mut ds, &selected_in(selected, head), "proc lost");
            let below: Vec<Range<u32>> = tree::children(chunk, info.fanout).collect();
            chunks.extend(below.into_iter().rev());
            continue;
        }
        let Some(head_proc) = info.procs.get(chunk.start as usize).map(|a| a.proc.clone()) else {
            continue; // validated frames keep chunks inside the mesh
        };
        let call = replies.then(|| {
            pending.register_block(ds.iter_mut().map(|d| Waiter::Child {
                results: d.results_sender(),
                index: d.children.len(),
                head: (frame.mesh, chunk.start),
                from: head_proc.clone(),
            }))
        });
        let procs = (chunk.start, chunk.end);
        let encoded = encoded.get_or_insert_with(|| {
            CastEncoding::new(frame, child_budget, replies.then(|| fabric.reply_port()))
        });
        let sent = match encoded {
            Ok(encoded) => {
                let child = ChildCast {
                    frame,
                    encoded,
                    procs,
                    call,
                };
                fabric.command_cast(info, chunk.start, child, deadline)
            }
            // The whole frame's encoding says why, as any command would.
            Err(_) => {
                let child = CastFrame {
                    procs,
                    reply: call.map(|call| ReplyTo {
                        port: fabric.reply_port(),
                        call,
                    }),
                    budget_ms: child_budget,
                    ..CastFrame::clone(frame)
                };
                fabric.command(info, chunk.start, ProcCommand::Cast(child), deadline)
            }
        };
        match sent.await {
            Ok(()) => {
                if let Some(call) = call {
                    for (d, call) in ds.iter_mut().zip(call..) {
                        d.children.push(chosen.clone());
                        d.child_calls.push(call);
                    }
                }
            }
            Err(e) => {
                if let Some(call) = call {
                    for call in (call..).take(ds.len()) {
                        pending.forget(call);
                    }
                }
                fail_each(&mut ds, &chosen, &format!("proc unreachable: {e}"));
            }
        }
    }
    if let Some(members) = local {
        let first = lo.saturating_mul(info.per_proc);
        for (i, member) in members.iter().enumerate() {
            let rank = first.saturating_add(i as u32);
            if !selected.contains(Rank(rank)) {
                continue;
            }
            deliver(&mut ds, rank, member.as_ref(), frame, replies);
        }
    }
    ds
}

/// Fails `ranks` as not running, for `why`, in each cast.
fn fail_each(ds: &mut [Dispatched], ranks: &[u32], why: &str) {
    for d in ds {
        d.acc.failed.extend(
            ranks
                .iter()
                .map(|&r| (r, MemberError::NotRunning(why.to_owned()))),
        );
    }
}

/// Hands each message of `frame` to the member at `rank`, in order; with
/// `replies`, each cast's reply (or acknowledgement) goes to its own of
/// `ds`, else `ds` holds one for the whole frame.
fn deliver(
    ds: &mut [Dispatched],
    rank: u32,
    member: Option<&ActorRef<MemberMsg>>,
    frame: &CastFrame,
    replies: bool,
) {
    let Some(member) = member else {
        fail_each(ds, &[rank], "member has exited");
        return;
    };
    let wants_reply = replies && frame.collect != Collect::Ack;
    if crate::bugs::planted(crate::bugs::PlantedBug::DuplicateDelivery) {
        let _ = member.send_message(MemberMsg::user(frame.payload.clone(), None));
    }
    for (i, payload) in frame.payloads().enumerate() {
        let (reply, rx) = if wants_reply {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        if let Err(e) = member.send_message(MemberMsg::user(payload.clone(), reply)) {
            // A closed mailbox fails the member for this cast and those
            // after it alike.
            let from = if replies { i } else { 0 };
            fail_each(
                &mut ds[from..],
                &[rank],
                &format!("member mailbox closed: {e}"),
            );
            return;
        }
        if !replies && i > 0 {
            continue;
        }
        let d = &mut ds[i];
        match rx {
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
        }
    }
}

/// Merges one reply or subtree result into the accumulator.
pub(crate) fn merge(collect: &Collect, acc: &mut Contribution, mut part: Contribution) {
    acc.failed.append(&mut part.failed);
    acc.ok = acc.ok.saturating_add(part.ok);
    match collect {
        Collect::Ack => {}
        Collect::Gather => acc.values.append(&mut part.values),
        Collect::Reduce(name) => {
            let Some(value) = part.reduced else { return };
            acc.reduced = Some(match acc.reduced.take() {
                None => value,
                Some(prev) => match reducer::reducer(name) {
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

/// Gives up on a dispatched cast that nobody collects: its children's
/// calls are forgotten.
pub(crate) fn abandon(pending: &Pending, d: Dispatched) {
    for &call in &d.child_calls {
        pending.forget(call);
    }
}

/// The children's calls of a cast being collected, forgotten if the
/// collection is dropped before it ends (its caller gave up), so that no
/// waiter stays registered for a child that never answers.
struct ChildCalls<'a> {
    pending: &'a Pending,
    calls: Vec<u64>,
}

impl Drop for ChildCalls<'_> {
    fn drop(&mut self) {
        for &call in &self.calls {
            self.pending.forget(call);
        }
    }
}

/// Waits for the local replies and the children's results until all are in
/// or the deadline passes; what is missing then is reported as timed out.
/// Dropped before then, it forgets its children's calls.
pub(crate) async fn collect(pending: &Pending, mut d: Dispatched) -> Contribution {
    let mut calls = ChildCalls {
        pending,
        calls: std::mem::take(&mut d.child_calls),
    };
    let mut waiting: Vec<bool> = vec![true; d.children.len()];
    let mut open_children = waiting.len();
    let deadline = tokio::time::sleep_until(d.deadline);
    tokio::pin!(deadline);
    while open_children > 0 || !d.local.is_empty() {
        tokio::select! {
            // A fixed order (so that a simulated run replays): local
            // replies, children's results, then the deadline. Both sources
            // are finite, so the deadline is reached if they stall.
            biased;
            Some((rank, reply)) = d.local.next(), if !d.local.is_empty() => {
                d.local_waiting.remove(&rank);
                let part = local_part(&d.collect, rank, reply);
                merge(&d.collect, &mut d.acc, part);
            }
            Some((index, result)) = recv(&mut d.results), if open_children > 0 => {
                if !waiting.get(index).copied().unwrap_or(false) {
                    continue;
                }
                match result {
                    ChildResult::Part(part) => {
                        let part = checked(part, &d.children[index]);
                        merge(&d.collect, &mut d.acc, part);
                    }
                    ChildResult::Done(part) => {
                        waiting[index] = false;
                        open_children -= 1;
                        let part = checked(part, &d.children[index]);
                        merge(&d.collect, &mut d.acc, part);
                    }
                    ChildResult::Lost(why) => {
                        waiting[index] = false;
                        open_children -= 1;
                        // Ranks that already answered (in parts) are not
                        // failed again.
                        let answered = answered(&d.acc);
                        d.acc.failed.extend(
                            d.children[index]
                                .iter()
                                .filter(|r| !answered.contains(r))
                                .map(|&r| (r, MemberError::NotRunning(format!("proc lost: {why}")))),
                        );
                    }
                }
            }
            () = &mut deadline => break,
        }
    }
    // Whatever has not answered by now is reported, not waited for.
    let answered = answered(&d.acc);
    for (index, still) in waiting.iter().enumerate() {
        if *still {
            pending.forget(calls.calls[index]);
            d.acc.failed.extend(
                d.children[index]
                    .iter()
                    .filter(|r| !answered.contains(r))
                    .map(|&r| (r, MemberError::Timeout)),
            );
        }
    }
    // Every call is now answered or forgotten.
    calls.calls.clear();
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

/// Runs `work` while the casts in `collecting` keep collecting (a node's
/// casts wait for their results in its own task: while it forwards the next
/// one, which can wait on a slow child's flow control, earlier ones still
/// answer); returns what `work` returns.
///
/// `work` is pinned where the caller keeps it: a future taken by value
/// would be moved into this one's state and pinned again there, two copies
/// of a state that is kilobytes for a node's dispatch.
pub(crate) async fn beside<T, F>(
    mut work: Pin<&mut impl Future<Output = T>>,
    collecting: &mut FuturesUnordered<F>,
) -> T
where
    F: Future<Output = ()>,
{
    loop {
        tokio::select! {
            biased;
            t = work.as_mut() => return t,
            Some(()) = collecting.next(), if !collecting.is_empty() => {}
        }
    }
}

/// The next child's result; never ready without a channel (no child was
/// asked, so none is open).
async fn recv(results: &mut Option<ResultsChannel>) -> Option<(usize, ChildResult)> {
    match results {
        Some((_, rx)) => rx.next().await,
        None => std::future::pending().await,
    }
}

/// A child's result, keeping only what concerns the ranks it was sent to (a
/// confused or malicious node cannot answer for others).
fn checked(mut part: Contribution, ranks: &[u32]) -> Contribution {
    let asked = |r: &u32| ranks.binary_search(r).is_ok();
    let before = part.values.len() + part.failed.len();
    part.values.retain(|(r, _)| asked(r));
    part.failed.retain(|(r, _)| asked(r));
    if part.values.len() + part.failed.len() != before {
        tracing::warn!(
            "a subtree answered for ranks it was not sent to; those answers are dropped"
        );
    }
    part.ok = part.ok.min(ranks.len() as u32);
    part
}

/// The ranks whose values or failures are already in (only gathers split
/// their results into parts; other collections answer once).
fn answered(acc: &Contribution) -> BTreeSet<u32> {
    acc.values
        .iter()
        .map(|(r, _)| *r)
        .chain(acc.failed.iter().map(|(r, _)| *r))
        .collect()
}

/// Bytes a gathered value adds to an encoded [`Contribution`] beyond its own
/// (rank and length varints).
pub(crate) const VALUE_OVERHEAD_BYTES: usize = 16;
/// Room left in every reply frame for the envelope and the reply's other
/// fields.
const REPLY_HEADROOM_BYTES: usize = 4096;

/// Bytes of a reply frame of `max_frame_bytes` that its results may fill.
pub(crate) fn reply_room(max_frame_bytes: usize) -> usize {
    max_frame_bytes.saturating_sub(REPLY_HEADROOM_BYTES).max(1)
}

/// Bytes `c` takes in a reply, at most (what [`reply_room`] is measured
/// against).
pub(crate) fn reply_bytes(c: &Contribution) -> usize {
    let failures: usize = c
        .failed
        .iter()
        .map(|(_, e)| e.to_string().len() + VALUE_OVERHEAD_BYTES)
        .sum();
    let values: usize = c
        .values
        .iter()
        .map(|(_, v)| v.len() + VALUE_OVERHEAD_BYTES)
        .sum();
    failures + values + c.reduced.as_ref().map_or(0, |v| v.len())
}

/// Splits a subtree's result into parts that each fit a frame of
/// `max_frame_bytes`: the values are spread over parts, and a value that
/// alone does not fit becomes a failure of its rank. All parts but the last
/// carry only values.
pub(crate) fn split(mut c: Contribution, max_frame_bytes: usize) -> Vec<Contribution> {
    let room = reply_room(max_frame_bytes);
    if reply_bytes(&c) <= room {
        return vec![c];
    }
    let mut parts = Vec::new();
    let mut part = Contribution::default();
    let mut used = 0;
    for (rank, value) in std::mem::take(&mut c.values) {
        let size = value.len() + VALUE_OVERHEAD_BYTES;
        if size > room {
            c.failed.push((
                rank,
                MemberError::BadReply(format!(
                    "a reply of {} bytes does not fit a frame (max_frame_bytes = {max_frame_bytes})",
                    value.len()
                )),
            ));
            c.ok = c.ok.saturating_sub(1);
            continue;
        }
        if used + size > room {
            parts.push(std::mem::take(&mut part));
            used = 0;
        }
        used += size;
        part.values.push((rank, value));
    }
    // Failures are spread over parts the same way; the last part carries
    // the count and the reduction.
    c.failed.sort_by_key(|(r, _)| *r);
    for (rank, error) in std::mem::take(&mut c.failed) {
        let size = error.to_string().len() + VALUE_OVERHEAD_BYTES;
        if used + size > room && !(part.values.is_empty() && part.failed.is_empty()) {
            parts.push(std::mem::take(&mut part));
            used = 0;
        }
        used += size;
        part.failed.push((rank, error));
    }
    if !part.values.is_empty() || !part.failed.is_empty() || parts.is_empty() {
        parts.push(part);
    }
    let last = parts.last_mut().expect("at least one part");
    last.ok = c.ok;
    last.reduced = c.reduced;
    parts
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::future::BoxFuture;
    use futures::stream::FuturesUnordered;
    use tokio::sync::oneshot;

    use futures::FutureExt;

    use super::{EncodedReply, LocalReplies, LocalReply, beside};

    /// A step that waits on what an earlier cast's collection does (as a
    /// forward waits on flow control that only the answers free) finishes:
    /// the collections run meanwhile, and the finished one leaves the set.
    #[tokio::test(flavor = "current_thread")]
    async fn collections_run_while_the_next_step_waits() {
        let (answered, answer) = oneshot::channel::<u32>();
        let mut collecting: FuturesUnordered<BoxFuture<'static, ()>> = FuturesUnordered::new();
        collecting.push(Box::pin(async move {
            tokio::task::yield_now().await;
            let _ = answered.send(7);
        }));
        // Never ready unless the collection above runs.
        let (tx, never) = oneshot::channel::<()>();
        collecting.push(Box::pin(async move {
            let _ = never.await;
        }));
        let got = tokio::time::timeout(
            Duration::from_secs(5),
            beside(std::pin::pin!(answer), &mut collecting),
        )
        .await
        .expect("the step waited on a collection that was not run")
        .expect("the collection answered");
        assert_eq!(got, 7);
        assert_eq!(collecting.len(), 1, "the finished collection is dropped");
        drop(tx);
    }

    fn reply(rank: u32, rx: oneshot::Receiver<EncodedReply>) -> LocalReply {
        async move { (rank, rx.await.expect("answered")) }.boxed()
    }

    /// Replies come out as they come in, however many are awaited, and a
    /// wait given up before a reply is in loses nothing.
    #[tokio::test]
    async fn local_replies_come_out_once_each_in_arrival_order() {
        for n in [1u32, 2, 5] {
            let mut local = LocalReplies::None;
            assert!(local.is_empty());
            let mut answers = Vec::new();
            for rank in 0..n {
                let (tx, rx) = oneshot::channel();
                local.push(reply(rank, rx));
                answers.push(tx);
            }
            assert!(!local.is_empty());
            // Nothing is in yet: a try gives up, and keeps waiting.
            assert!(local.next().now_or_never().is_none());
            // Answered last to first.
            let mut got = Vec::new();
            for (rank, tx) in answers.into_iter().enumerate().rev() {
                tx.send(Ok(bytes::Bytes::from(vec![rank as u8]))).unwrap();
                let (r, value) = local.next().await.expect("a reply awaited");
                assert_eq!(value.unwrap(), bytes::Bytes::from(vec![r as u8]));
                got.push(r);
            }
            assert_eq!(got, (0..n).rev().collect::<Vec<_>>(), "{n} replies");
            assert!(local.is_empty());
            assert!(local.next().await.is_none());
        }
    }
}
