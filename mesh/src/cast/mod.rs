//! Casts and calls through cast trees, shared by every side that roots one:
//! the controller (for the meshes it owns) and members (for their own mesh
//! and the meshes they own or were given).
//!
//! - [`Caster`]: the root of one sender's casts. Frames are dispatched by one
//!   task in the order they were handed over, so casts from one sender keep
//!   their order at every member however many are in flight; results are
//!   collected beside it. Casts queued behind each other to the same
//!   members share a frame (`JobBatch::join`), fire-and-forget ones
//!   together and calls together, each call answered on its own.
//! - The outcome of every operation lists what succeeded and what failed the
//!   same way: [`Delivered`] (a cast), [`ValueMesh`] (a call), [`Reduced`] (a
//!   reduction) — each with `failed()`, `is_complete()` and `into_result()`.
//! - [`node`]: one node of a tree (forward, deliver, collect).

pub(crate) mod node;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot};

use crate::entropy::Entropy;
use crate::error::{MemberError, MembersFailed, MeshError};
use crate::fabric::{Fabric, Pending};
use crate::protocol::{
    CastFrame, CastOrder, Collect, Contribution, MAX_BATCHED_CASTS, MeshInfo, ReplyTo, decode,
    encode,
};
use crate::selection::Selection;
use crate::shape::{Rank, Shape};

/// How many casts one sender may have handed to its caster and not yet
/// dispatched; more wait (in order).
const HANDED_CASTS: usize = 1024;

/// Fire-and-forget casts to one mesh from one caster between two that it
/// sends acknowledged (credit probes, see [`Credit`]).
pub(crate) const NOWAIT_PROBE_EVERY: u64 = 256;

/// Credit probes to one mesh a caster has unacknowledged before it waits
/// for the oldest: with probes every [`NOWAIT_PROBE_EVERY`] casts, at most
/// `(NOWAIT_PROBES + 1) × NOWAIT_PROBE_EVERY` = 768 of a caster's casts to
/// a mesh are not yet known to be taken by every proc, below the 1024 a
/// proc queues for a mesh (checked at compile time where that bound is
/// defined).
pub(crate) const NOWAIT_PROBES: usize = 2;

/// Meshes a caster counts fire-and-forget casts for before it forgets
/// those with no probe out and no cast since their last probe (all their
/// casts acknowledged, so a count that starts again at 0 is safe).
const CREDIT_MESHES: usize = 1024;

/// Bytes a cast frame needs beyond its payload (selection, view, lost procs
/// and the envelope), checked against the frame limit before sending.
const FRAME_HEADROOM_BYTES: usize = 4096;

/// Bytes a cast batched into another's frame may add to it beyond its
/// payload (the payload's length prefix), counted against the frame limit.
const BATCHED_OVERHEAD_BYTES: usize = 16;

struct Job {
    info: Arc<MeshInfo>,
    cast: node::Bound,
    done: Option<oneshot::Sender<Handed>>,
}

/// What the caster hands a caller that waits for its cast's results.
enum Handed {
    /// The results, collected by the caster.
    Done(Contribution),
    /// A cast that waits on one child and no local member (a call to one
    /// member, or to a mesh of one proc), dispatched: the caller collects
    /// it on its own task. That takes the collection (its timer, the wake
    /// through the caster's set, the hand-over of the result) off the
    /// caster's task, which dispatches every cast of its sender, at no cost
    /// in wakes: the caller is woken once either way. A cast with several
    /// children stays with the caster, which wakes the caller once when all
    /// are in rather than once per child.
    Collect(node::Dispatched),
}

/// The root of one sender's casts (see the module docs). Cheap to share.
pub(crate) struct Caster {
    jobs: mpsc::Sender<Job>,
    fabric: Arc<dyn Fabric>,
    pending: Arc<Pending>,
    origin: regent_net::ActorId,
    /// Where the seeds of its casts (and its owner's cast tokens) come from.
    entropy: Arc<Entropy>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Caster {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Caster {
    /// A caster sending as `origin` through `fabric`, drawing its casts'
    /// seeds from `entropy`; its task runs on the current runtime.
    pub(crate) fn start(
        fabric: Arc<dyn Fabric>,
        pending: Arc<Pending>,
        origin: regent_net::ActorId,
        entropy: Arc<Entropy>,
    ) -> Self {
        let (jobs, rx) = mpsc::channel(HANDED_CASTS);
        let incarnation = entropy.next_u64();
        let task = tokio::spawn(run_caster(fabric.clone(), pending.clone(), incarnation, rx));
        Self {
            jobs,
            fabric,
            pending,
            origin,
            entropy,
            task,
        }
    }

    /// Hands a frame over; with `wait`, returns what came back from the tree.
    /// Frames handed over from one task go out in that order.
    ///
    /// The hand-over happens in this call, not when the future is first
    /// polled (callers are `async` and call it where they are polled), so
    /// the future keeps none of the frame: a call's future, and every
    /// future that awaits one, is copied whole each time it is built into
    /// its caller's, and the frame was most of it (a `call_one` future of
    /// 1,952 bytes, copied four or five times per call).
    pub(crate) fn cast(
        &self,
        info: Arc<MeshInfo>,
        cast: node::Bound,
        wait: bool,
    ) -> impl Future<Output = Result<Option<Contribution>, MeshError>> + '_ {
        let handed = self.hand_over(info, cast, wait);
        async move {
            let HandedOver {
                name,
                queued,
                answer,
            } = handed?;
            if let Some((wait, budget)) = queued {
                match wait.await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return Err(MeshError::Stopped(name)),
                    Err(_) => {
                        return Err(MeshError::Timeout {
                            what: format!(
                                "handing a cast to {name}'s tree (the sender's queue stayed full)"
                            ),
                            after: budget,
                        });
                    }
                }
            }
            let Some(answer) = answer else {
                return Ok(None);
            };
            let d = match answer.await {
                Ok(Handed::Done(c)) => return Ok(Some(c)),
                Ok(Handed::Collect(d)) => d,
                Err(_) => return Err(MeshError::Stopped(name)),
            };
            // On the heap: it is most of a call's state, though every call
            // to one member collects.
            Ok(Some(Box::pin(node::collect(&self.pending, d)).await))
        }
    }

    /// The synchronous part of [`Caster::cast`]: the frame checked and
    /// queued for the caster's task (or its wait for room, boxed), and
    /// where the answer comes if one is wanted.
    fn hand_over(
        &self,
        info: Arc<MeshInfo>,
        mut cast: node::Bound,
        wait: bool,
    ) -> Result<HandedOver<'_>, MeshError> {
        let frame = &mut cast.frame;
        frame.lost = self.fabric.lost().ranks_of(&info);
        let max = self.fabric.max_frame_bytes();
        if frame.payload.len().saturating_add(FRAME_HEADROOM_BYTES) > max {
            return Err(MeshError::TooLarge {
                bytes: frame.payload.len(),
                max_frame_bytes: max,
            });
        }
        let (done, answer) = if wait {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        // At the root, `reply` only says whether results are wanted.
        frame.reply = wait.then(|| ReplyTo {
            port: self.fabric.reply_port(),
            call: u64::MAX,
        });
        let name = info.name.clone();
        // The hand-over is the cast's place in the order, so it must not
        // yield to tokio's cooperative budget: a budget-exhausted send
        // returns `Pending` without queueing, and when many casts are polled
        // together (`join_all`) a later one would take its place. So the
        // job is queued at once if there is room (never behind a sender
        // already waiting: the channel gives room to waiters first), else
        // it waits in the channel's FIFO queue, unbudgeted, within the
        // cast's budget. That wait is on the heap: it is rare, and in the
        // cast's future it would make every cast's (and its callers') state
        // larger by a job and a timer, all copied as each is built.
        let budget = Duration::from_millis(u64::from(frame.budget_ms));
        let queued = match self.jobs.try_send(Job { info, cast, done }) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(MeshError::Stopped(name)),
            Err(mpsc::error::TrySendError::Full(job)) => {
                let wait: QueueWait<'_> = Box::pin(tokio::task::unconstrained(
                    tokio::time::timeout(budget, self.jobs.send(job)),
                ));
                Some((wait, budget))
            }
        };
        Ok(HandedOver {
            name,
            queued,
            answer,
        })
    }
}

/// A frame handed to the caster's task: what [`Caster::cast`]'s future
/// still waits on.
struct HandedOver<'a> {
    /// The mesh's name, for errors.
    name: String,
    /// The wait for room in the queue, and its budget, if it was full.
    queued: Option<(QueueWait<'a>, Duration)>,
    /// Where the tree's answer comes, if one is wanted.
    answer: Option<oneshot::Receiver<Handed>>,
}

/// A job's wait for room in the caster's queue (past its budget, a
/// timeout).
type QueueWait<'a> = Pin<
    Box<
        dyn Future<
                Output = Result<
                    Result<(), mpsc::error::SendError<Job>>,
                    tokio::time::error::Elapsed,
                >,
            > + Send
            + 'a,
    >,
>;

/// End-to-end credit for fire-and-forget casts, per mesh: a proc queues at
/// most 1024 casts for a mesh and refuses more, and a caster that never
/// hears back could outrun a slow proc and lose casts to that refusal. So
/// every [`NOWAIT_PROBE_EVERY`]th fire-and-forget cast to a mesh goes out
/// acknowledged (its sender still waits for nothing): FIFO per sender, so
/// once it is acknowledged every proc has taken the casts before it. With
/// [`NOWAIT_PROBES`] probes to a mesh unacknowledged, the caster waits for
/// the oldest (its casts to every mesh, in order) before it sends more: a
/// sender faster than a mesh's slowest proc is slowed to that proc's pace
/// instead of losing casts.
#[derive(Default)]
struct Credit {
    /// Fx-hashed: looked up for every fire-and-forget cast, by ids of the
    /// meshes this caster's owner casts to, at most [`CREDIT_MESHES`].
    meshes: regent_net::fxhash::FxHashMap<crate::protocol::MeshId, MeshCredit>,
}

struct MeshCredit {
    /// Fire-and-forget casts since the last probe.
    since: u64,
    /// One permit per probe that may be out.
    probes: Arc<tokio::sync::Semaphore>,
}

impl Credit {
    /// Counts a fire-and-forget cast to `mesh` that joins an earlier one's
    /// frame, if it is not to go out as a probe (then it is not counted:
    /// it goes on its own, through [`Credit::count`]).
    fn join(&mut self, mesh: crate::protocol::MeshId) -> bool {
        match self.meshes.get_mut(&mesh) {
            Some(credit) if credit.since + 1 < NOWAIT_PROBE_EVERY => {
                credit.since += 1;
                true
            }
            _ => false,
        }
    }

    /// Counts a fire-and-forget cast to `mesh`; when it is to go out as a
    /// probe, the permit it holds until acknowledged (waiting for one
    /// while `collecting` keeps collecting).
    async fn count<F: Future<Output = ()>>(
        &mut self,
        mesh: crate::protocol::MeshId,
        collecting: &mut FuturesUnordered<F>,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        if self.meshes.len() >= CREDIT_MESHES && !self.meshes.contains_key(&mesh) {
            self.meshes
                .retain(|_, c| c.since > 0 || c.probes.available_permits() < NOWAIT_PROBES);
        }
        let credit = self.meshes.entry(mesh).or_insert_with(|| MeshCredit {
            since: 0,
            probes: Arc::new(tokio::sync::Semaphore::new(NOWAIT_PROBES)),
        });
        credit.since += 1;
        if credit.since < NOWAIT_PROBE_EVERY {
            return None;
        }
        credit.since = 0;
        let probes = credit.probes.clone();
        // The semaphore is never closed.
        node::beside(std::pin::pin!(probes.acquire_owned()), collecting)
            .await
            .ok()
    }
}

/// Dispatches the jobs in the order handed over, numbering them in that
/// order (`CastOrder`) as casts of the caster `incarnation`.
async fn run_caster(
    fabric: Arc<dyn Fabric>,
    pending: Arc<Pending>,
    incarnation: u64,
    mut jobs: mpsc::Receiver<Job>,
) {
    let mut seq = 0u64;
    // The casts waiting for their results, collected in this task rather
    // than a task each: a call then costs no task of its own.
    let mut collecting = FuturesUnordered::new();
    // Jobs taken from the channel and not yet dispatched: taken in batches,
    // so that a sender waiting for room is woken once per batch, not once
    // per job (each wake is a futex call and a context switch).
    let mut taken = JobBatch::default();
    let mut credit = Credit::default();
    loop {
        let mut job = tokio::select! {
            // Results first (they end casts), then new casts; a fixed order,
            // so that a simulated run replays.
            biased;
            Some(()) = collecting.next(), if !collecting.is_empty() => continue,
            job = taken.next(&mut jobs) => match job {
                Some(job) => job,
                None => break,
            },
        };
        let probe = match job.done {
            Some(_) => None,
            None => credit.count(job.info.id, &mut collecting).await,
        };
        if probe.is_some() {
            job.cast.frame.reply = Some(ReplyTo {
                port: fabric.reply_port(),
                call: u64::MAX,
            });
        }
        seq += 1;
        job.cast.frame.order = CastOrder {
            caster: incarnation,
            seq,
        };
        // The callers of the casts that join its frame, in order.
        let mut joined = Vec::new();
        if probe.is_none() {
            // The casts taken behind it that go to the same members, and
            // wait for results as it does or not, go with it as one frame.
            seq += taken.join(&mut job, &mut credit, fabric.max_frame_bytes(), &mut joined);
        }
        // Dispatch can wait (on a proc's flow control): the casts already
        // sent keep collecting and answering their callers meanwhile.
        let dispatch = std::pin::pin!(node::dispatch(
            fabric.as_ref(),
            &pending,
            &job.info,
            &job.cast,
            None
        ));
        let ds = node::beside(dispatch, &mut collecting).await;
        match job.done {
            // One per cast of the frame, in order.
            Some(done) => {
                for (d, done) in ds.into_iter().zip(std::iter::once(done).chain(joined)) {
                    if !d.one_child_only() {
                        collecting.push(finish(&pending, d, Some(done), None));
                    } else if let Err(Handed::Collect(d)) = done.send(Handed::Collect(d)) {
                        // The caller gave up: nobody collects.
                        node::abandon(&pending, d);
                    }
                }
            }
            None => {
                if let Some(d) = ds.into_iter().next().filter(|_| probe.is_some()) {
                    collecting.push(finish(&pending, d, None, probe));
                }
            }
        }
    }
    // The casts already sent still answer their callers.
    while collecting.next().await.is_some() {}
}

/// The most jobs the caster takes from its channel at once.
const JOB_BATCH: usize = 64;

// A batch is at most the jobs taken at once (`JobBatch::join` looks at no
// other), so it never holds more casts than a proc takes in one frame.
const _: () = assert!(JOB_BATCH <= MAX_BATCHED_CASTS);

/// Jobs taken from the caster's channel, in order.
#[derive(Default)]
struct JobBatch {
    /// Taken, reversed: the next job is last.
    jobs: Vec<Job>,
}

impl JobBatch {
    /// The next job: one already taken, else up to [`JOB_BATCH`] more from
    /// `rx` (waiting for one); `None` when `rx` is closed and empty.
    async fn next(&mut self, rx: &mut mpsc::Receiver<Job>) -> Option<Job> {
        if self.jobs.is_empty() && rx.recv_many(&mut self.jobs, JOB_BATCH).await > 0 {
            self.jobs.reverse();
        }
        self.jobs.pop()
    }

    /// Moves into `first`'s frame ([`CastFrame::more`]) the jobs taken
    /// right behind it that can share it: casts to the same members of the
    /// same mesh info that wait for results as `first` does or not (see
    /// [`batches_with`]), their callers pushed onto `callers` in order; a
    /// fire-and-forget one counted against the mesh's credit up to its
    /// next probe, which goes on its own; within the frame limit (and
    /// [`MAX_BATCHED_CASTS`], as it looks at no more than [`JOB_BATCH`]
    /// jobs taken at once). Returns how many joined. Only jobs already
    /// taken join, so no cast waits for another: a sender that outruns the
    /// caster gets one frame, one dispatch and one check at each proc per
    /// batch instead of per cast.
    fn join(
        &mut self,
        first: &mut Job,
        credit: &mut Credit,
        max_frame_bytes: usize,
        callers: &mut Vec<oneshot::Sender<Handed>>,
    ) -> u64 {
        // A batch carries its first cast's seed, and `any` may pick other
        // members for another cast's: such a selection never batches.
        // Checked once per frame, not once per cast that would join.
        if first.cast.frame.selection.uses_seed() {
            return 0;
        }
        let mut bytes = first.cast.frame.payload.len() + FRAME_HEADROOM_BYTES;
        let mut joined = 0;
        while let Some(next) = self.jobs.last_mut() {
            let adds = next.cast.frame.payload.len() + BATCHED_OVERHEAD_BYTES;
            if bytes.saturating_add(adds) > max_frame_bytes
                || !Arc::ptr_eq(&first.info, &next.info)
                || !batches_with(&first.cast.frame, &next.cast.frame)
                || (first.done.is_none() && !credit.join(first.info.id))
            {
                break;
            }
            bytes += adds;
            let payload = std::mem::take(&mut next.cast.frame.payload);
            first.cast.frame.more.push(payload);
            // Set for a cast that waits for results (`batches_with` keeps
            // the two kinds apart).
            callers.extend(next.done.take());
            self.jobs.pop();
            joined += 1;
        }
        joined
    }
}

/// Whether `next` may travel in `first`'s frame: both fire-and-forget or
/// both waiting for results (a cast handed over to wait has a `reply` from
/// the start, the same for all of one caster; a credit probe gets one when
/// taken, and goes alone), and the same but for the message and the seed
/// (which [`JobBatch::join`] lets differ only for a selection that does not
/// use it).
fn batches_with(first: &CastFrame, next: &CastFrame) -> bool {
    first.reply == next.reply
        && first.mesh == next.mesh
        && first.generation == next.generation
        && first.token == next.token
        && first.origin == next.origin
        && first.procs == next.procs
        && first.per_proc == next.per_proc
        && first.collect == next.collect
        && first.budget_ms == next.budget_ms
        && first.lost == next.lost
        && first.view == next.view
        && first.selection == next.selection
}

/// Collects a dispatched cast's results and hands them to its caller, if
/// it has one; a credit probe's permit is returned once they are in.
async fn finish(
    pending: &Pending,
    d: node::Dispatched,
    done: Option<oneshot::Sender<Handed>>,
    probe: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    let c = node::collect(pending, d).await;
    if let Some(done) = done {
        let _ = done.send(Handed::Done(c));
    }
    drop(probe);
}

/// The frame that casts `msg` to `selection` of `view` (the whole mesh when
/// `None`) with `timeout` to spend, from `caster`, bound. The selection is
/// checked here, so that procs never see one that does not bind, and is
/// bound here, on the sender's thread, with the seed the frame carries, so
/// that the caster's task (which dispatches every cast of its sender) does
/// not bind it again.
pub(crate) fn frame<M: Serialize>(
    info: &MeshInfo,
    view: Option<&Shape>,
    caster: &Caster,
    selection: &Selection,
    msg: &M,
    collect: Collect,
    timeout: Duration,
) -> Result<node::Bound, MeshError> {
    let view = view.cloned().unwrap_or_else(|| info.shape.clone());
    let seed = caster.entropy.next_seed();
    let selected = selection.bind(&view, seed)?;
    let frame = CastFrame {
        mesh: info.id,
        generation: info.generation,
        token: info.token,
        origin: caster.origin.clone(),
        // Numbered when dispatched.
        order: CastOrder::NONE,
        view,
        selection: selection.clone(),
        seed,
        procs: (0, info.proc_count()),
        per_proc: info.per_proc,
        lost: Vec::new(),
        payload: encode(msg).map_err(MeshError::Encode)?,
        more: Vec::new(),
        reply: None,
        collect,
        budget_ms: u32::try_from(timeout.as_millis())
            .unwrap_or(u32::MAX)
            .min(crate::protocol::MAX_BUDGET_MS),
    };
    Ok(node::Bound {
        frame: Box::new(frame),
        selected,
    })
}

fn failures(failed: Vec<(u32, MemberError)>) -> Vec<(Rank, MemberError)> {
    failed.into_iter().map(|(r, e)| (Rank(r), e)).collect()
}

/// What a cast did: how many selected members have the message in their
/// mailbox, and which could not be reached, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a cast may reach only some members: check `failed()` or call `into_result()`"]
pub struct Delivered {
    delivered: u32,
    failed: Vec<(Rank, MemberError)>,
    generation: regent_net::Generation,
}

impl Delivered {
    pub(crate) fn from(c: Contribution, generation: regent_net::Generation) -> Self {
        Self {
            delivered: c.ok,
            failed: failures(c.failed),
            generation,
        }
    }

    /// The generation the cast was sent in (its last try's, when it was
    /// retried in the next generation): fencing keeps it from every life
    /// born in a later generation.
    pub fn generation(&self) -> regent_net::Generation {
        self.generation
    }

    /// How many members have the message.
    pub fn delivered(&self) -> u32 {
        self.delivered
    }

    /// Members that could not be reached, by rank.
    pub fn failed(&self) -> &[(Rank, MemberError)] {
        &self.failed
    }

    /// Whether every selected member has the message.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// `Ok` if every selected member has the message.
    pub fn into_result(self) -> Result<u32, MembersFailed> {
        if self.failed.is_empty() {
            Ok(self.delivered)
        } else {
            Err(MembersFailed {
                failed: self.failed,
            })
        }
    }
}

/// Replies of a call, by rank, and the members that did not reply.
#[derive(Debug, Clone)]
#[must_use = "a call may be answered by only some members: check `failed()` or call `into_result()`"]
pub struct ValueMesh<R> {
    shape: Shape,
    values: Vec<(Rank, R)>,
    failed: Vec<(Rank, MemberError)>,
}

impl<R> ValueMesh<R> {
    /// The shape of the view that was called.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The replies, sorted by rank.
    pub fn values(&self) -> &[(Rank, R)] {
        &self.values
    }

    /// The reply of `rank`, if it replied.
    pub fn get(&self, rank: Rank) -> Option<&R> {
        self.values
            .binary_search_by_key(&rank, |(r, _)| *r)
            .ok()
            .map(|i| &self.values[i].1)
    }

    /// Members that did not reply, and why.
    pub fn failed(&self) -> &[(Rank, MemberError)] {
        &self.failed
    }

    /// Whether every selected member replied.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// How many replied.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether none replied.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The replies, or the failures if any member failed.
    pub fn into_result(self) -> Result<Vec<(Rank, R)>, MembersFailed> {
        if self.failed.is_empty() {
            Ok(self.values)
        } else {
            Err(MembersFailed {
                failed: self.failed,
            })
        }
    }
}

/// What a call returns: the replies of a view of `shape` by rank, and the
/// members that failed (a reply that does not decode is a failure).
pub(crate) fn gathered<R: DeserializeOwned>(shape: Shape, c: Contribution) -> ValueMesh<R> {
    let mut failed = failures(c.failed);
    let mut values = Vec::with_capacity(c.values.len());
    for (rank, bytes) in c.values {
        match decode::<R>(&bytes) {
            Ok(v) => values.push((Rank(rank), v)),
            Err(e) => failed.push((Rank(rank), MemberError::BadReply(e))),
        }
    }
    failed.sort_by_key(|(r, _)| *r);
    ValueMesh {
        shape,
        values,
        failed,
    }
}

/// A reduced reply, and the members that did not contribute.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "a reduction may lack some members: check `failed` or call `into_result()`"]
pub struct Reduced<T> {
    /// The combined value, if any member replied.
    pub value: Option<T>,
    /// How many members contributed.
    pub contributors: u32,
    /// Members that did not reply, and why.
    pub failed: Vec<(Rank, MemberError)>,
}

impl<T> Reduced<T> {
    /// Members that did not contribute, by rank.
    pub fn failed(&self) -> &[(Rank, MemberError)] {
        &self.failed
    }

    /// Whether every selected member contributed.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// The value if every selected member contributed (and one did).
    pub fn into_result(self) -> Result<Option<T>, MembersFailed> {
        if self.failed.is_empty() {
            Ok(self.value)
        } else {
            Err(MembersFailed {
                failed: self.failed,
            })
        }
    }
}

/// What a reduction returns.
pub(crate) fn reduced<T: DeserializeOwned>(c: Contribution) -> Result<Reduced<T>, MeshError> {
    let value = match c.reduced {
        Some(bytes) => Some(decode::<T>(&bytes).map_err(MeshError::Encode)?),
        None => None,
    };
    Ok(Reduced {
        value,
        contributors: c.ok,
        failed: failures(c.failed),
    })
}

#[cfg(test)]
mod tests;
