//! The members a proc hosts, per mesh: their lives, the work that starts and
//! stops them, and the delivery of casts to them.
//!
//! Each hosted mesh has two tasks beside the proc's command loop: a worker
//! that runs spawns, respawns and stops one at a time (so a slow `new` or a
//! member slow to stop delays nothing else), and a dispatcher that forwards
//! and delivers the mesh's casts in arrival order. Every life has a watcher
//! that learns how it ended and, unless it was stopped on purpose (or never
//! finished starting: its spawn's answer says so), reports the exit to the
//! mesh's owner — one report per life, sent directly, so none is lost.
//!
//! A life is never replaced while it runs: a respawn first stops the old
//! life (stop, then kill after [`MEMBER_SHUTDOWN`], then [`KILL_WAIT`] for
//! it to end); a life that still runs then is stuck in code that never
//! yields, and the proc exits ([`ProcExit::MemberStuck`](super::ProcExit))
//! instead of starting a second one beside it.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use ractor::ActorRef;
use regent_net::{Generation, PortId};
use tokio::sync::{mpsc, oneshot, watch};

use super::{KILL_WAIT, MEMBER_SHUTDOWN};
use crate::cast::node::{self, Bound, LocalMembers};
use crate::life::{LifeEnd, LifeStart};
use crate::member::{
    KnownMesh, Member, MemberInner, MemberMsg, PeersRestarted, ProcServices, StartContext,
};
use crate::policy::{FailureCause, MeshFailure};
use crate::protocol::{
    CastFrame, Contribution, MemberExited, MeshId, ProcReply, ReplyBody, ReplyTo, Restart, names,
};
use crate::registry::ActorTypes;
use crate::shape::Rank;

/// Casts a proc queues for one mesh's dispatcher; a cast that finds the
/// queue full fails for its subtree at once (docs/semantics.md §4.6).
pub const QUEUED_CASTS: usize = 1024;
// A caster's fire-and-forget casts to a mesh that no proc has yet
// confirmed taking (its credit, docs/semantics.md §4.3) fit in the queue.
const _: () = assert!(
    (crate::cast::NOWAIT_PROBES + 1) * crate::cast::NOWAIT_PROBE_EVERY as usize <= QUEUED_CASTS
);
/// How long the owner's question about an owned mesh's failure may wait for
/// the owning member's answer.
const SUPERVISE_WAIT: Duration = Duration::from_secs(10);

const STARTING: u8 = 0;
const RUNNING: u8 = 1;
const STOPPING: u8 = 2;

static NEXT_LIFE: AtomicU64 = AtomicU64::new(0);

/// One life of a member.
#[derive(Clone)]
struct Life {
    id: u64,
    rank: u32,
    actor: ActorRef<MemberMsg>,
    /// `STARTING` until `new` returned, `RUNNING`, or `STOPPING` once the
    /// proc stops it on purpose.
    phase: Arc<AtomicU8>,
    /// How it ended, once it has.
    ended: watch::Receiver<Option<LifeEnd>>,
}

/// Work for a mesh's worker.
pub(super) enum MeshOp {
    Spawn {
        call: u64,
        reply_to: PortId,
        args: Bytes,
        start: Option<Restart>,
    },
    Respawn {
        call: u64,
        reply_to: PortId,
        ranks: Vec<u32>,
        args: Bytes,
        restart: Option<Restart>,
    },
    Stop {
        call: u64,
        reply_to: PortId,
    },
    Shutdown(oneshot::Sender<()>),
}

struct Shared {
    services: Arc<ProcServices>,
    known: Arc<KnownMesh>,
    proc_rank: u32,
    types: ActorTypes,
    /// The current life of each local member, by local index.
    slots: Mutex<Vec<Option<Life>>>,
    /// Lives taken out of their slots by a respawn, to be stopped.
    retired: Mutex<Vec<Life>>,
    /// Ranks retired for a respawn whose new lives are not in their slots
    /// yet: casts to them wait (see `run_dispatcher`).
    starting: watch::Sender<BTreeSet<u32>>,
    stuck: mpsc::UnboundedSender<(MeshId, u32)>,
}

/// A mesh whose members this proc hosts.
pub(super) struct Hosted {
    pub(super) known: Arc<KnownMesh>,
    pub(super) proc_rank: u32,
    shared: Arc<Shared>,
    ops: mpsc::UnboundedSender<MeshOp>,
    /// The dispatcher's queue. The dispatcher is not aborted when the mesh
    /// goes: it answers the casts still queued (their members are gone) and
    /// ends, so that no caller waits for them until its deadline.
    casts: mpsc::Sender<Bound>,
}

/// Starts the worker and dispatcher of a newly hosted mesh.
pub(super) fn start_worker(
    services: Arc<ProcServices>,
    known: Arc<KnownMesh>,
    proc_rank: u32,
    types: ActorTypes,
    stuck: mpsc::UnboundedSender<(MeshId, u32)>,
) -> Hosted {
    let per_proc = known.info().per_proc as usize;
    let shared = Arc::new(Shared {
        services,
        known: known.clone(),
        proc_rank,
        types,
        slots: Mutex::new(vec![None; per_proc]),
        retired: Mutex::new(Vec::new()),
        starting: watch::channel(BTreeSet::new()).0,
        stuck,
    });
    // Ops come from the owner, one request at a time per mesh, so this
    // queue holds a handful at most.
    let (ops, ops_rx) = mpsc::unbounded_channel();
    tokio::spawn(run_worker(shared.clone(), ops_rx));
    let (casts, casts_rx) = mpsc::channel(QUEUED_CASTS);
    tokio::spawn(run_dispatcher(shared.clone(), casts_rx));
    Hosted {
        known,
        proc_rank,
        shared,
        ops,
        casts,
    }
}

impl Hosted {
    pub(super) fn submit(&self, op: MeshOp) {
        // The worker runs until a stop or shutdown, which is the last op.
        let _ = self.ops.send(op);
    }

    /// Queues a cast for delivery (in order). The command loop never
    /// waits on it: a cast that finds the queue full (its dispatcher waits
    /// on children that do not take frames) fails for its whole subtree at
    /// once, so that renewals and the owner's commands are never starved.
    pub(super) fn cast(&self, cast: Bound) {
        use tokio::sync::mpsc::error::TrySendError;
        match self.casts.try_send(cast) {
            Ok(()) => {}
            Err(TrySendError::Full(cast)) => {
                tracing::warn!(
                    queued = QUEUED_CASTS,
                    "a cast refused: the mesh's casts are backed up"
                );
                fail(
                    &self.shared,
                    &cast,
                    "proc overloaded: its casts to this mesh are backed up",
                );
            }
            Err(TrySendError::Closed(cast)) => {
                fail(&self.shared, &cast, "the mesh is stopping here")
            }
        }
    }

    /// Takes the lives of `ranks` out of their slots: they get no more
    /// casts, and the next respawn stops them. Until that respawn puts new
    /// lives in their slots, casts to these ranks wait for them.
    pub(super) fn retire(&self, ranks: &[u32], first: u32) {
        self.shared
            .starting
            .send_modify(|starting| starting.extend(ranks.iter().copied()));
        let mut slots = self.shared.slots.lock().expect("slots lock");
        let mut retired = self.shared.retired.lock().expect("retired lock");
        for &r in ranks {
            if let Some(slot) = slots.get_mut((r - first) as usize)
                && let Some(life) = slot.take()
            {
                retired.push(life);
            }
        }
    }

    /// Tells the members that survived a restart what changed.
    pub(super) fn tell_survivors(&self, restart: &Restart) {
        let change = PeersRestarted::from(restart);
        for life in self
            .shared
            .slots
            .lock()
            .expect("slots lock")
            .iter()
            .flatten()
        {
            if !restart.ranks.contains(&life.rank) {
                let _ = life
                    .actor
                    .send_message(MemberMsg::PeersRestarted(change.clone()));
            }
        }
    }

    /// Asks the member at `rank` what to do about a failure of a mesh it
    /// owns; answers the owner.
    pub(super) fn supervise(&self, rank: u32, failure: MeshFailure, call: u64, reply_to: PortId) {
        let first = self.proc_rank * self.known.info().per_proc;
        let life = rank.checked_sub(first).and_then(|i| {
            self.shared
                .slots
                .lock()
                .expect("slots lock")
                .get(i as usize)
                .cloned()
                .flatten()
        });
        let fabric = self.shared.services.fabric.clone();
        tokio::spawn(async move {
            let decision = match life {
                None => None,
                Some(life) => {
                    let (tx, rx) = oneshot::channel();
                    if life
                        .actor
                        .send_message(MemberMsg::Supervise { failure, reply: tx })
                        .is_ok()
                    {
                        tokio::time::timeout(SUPERVISE_WAIT, rx)
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .flatten()
                    } else {
                        None
                    }
                }
            };
            fabric
                .reply(
                    reply_to,
                    ProcReply {
                        call,
                        body: ReplyBody::Decided(decision),
                    },
                )
                .await;
        });
    }
}

fn reply(shared: &Shared, port: PortId, call: u64, body: ReplyBody) {
    let fabric = shared.services.fabric.clone();
    tokio::spawn(async move { fabric.reply(port, ProcReply { call, body }).await });
}

async fn run_worker(shared: Arc<Shared>, mut ops: mpsc::UnboundedReceiver<MeshOp>) {
    while let Some(op) = ops.recv().await {
        match op {
            MeshOp::Spawn {
                call,
                reply_to,
                args,
                start,
            } => {
                let info = shared.known.info();
                let first = shared.proc_rank * info.per_proc;
                let ranks: Vec<u32> = (first..first + info.per_proc).collect();
                let r = spawn_lives(&shared, &ranks, &args, start.as_ref()).await;
                reply(&shared, reply_to, call, ReplyBody::Spawned(r));
            }
            MeshOp::Respawn {
                call,
                reply_to,
                ranks,
                args,
                restart,
            } => {
                let retired = std::mem::take(&mut *shared.retired.lock().expect("retired lock"));
                let mut r = Ok(());
                for life in retired {
                    if let Err(e) = stop_life(&shared, life).await {
                        r = Err(e);
                    }
                }
                if r.is_ok() {
                    r = spawn_lives(&shared, &ranks, &args, restart.as_ref()).await;
                }
                reply(&shared, reply_to, call, ReplyBody::Spawned(r));
            }
            MeshOp::Stop { call, reply_to } => {
                stop_all(&shared).await;
                reply(&shared, reply_to, call, ReplyBody::Stopped);
                return;
            }
            MeshOp::Shutdown(done) => {
                stop_all(&shared).await;
                let _ = done.send(());
                return;
            }
        }
    }
}

/// Stops every life, last rank first.
async fn stop_all(shared: &Shared) {
    let lives: Vec<Life> = {
        let mut slots = shared.slots.lock().expect("slots lock");
        let mut retired = shared.retired.lock().expect("retired lock");
        let mut lives: Vec<Life> = retired.drain(..).collect();
        lives.extend(slots.iter_mut().filter_map(Option::take));
        lives.sort_by_key(|l| std::cmp::Reverse(l.rank));
        lives
    };
    for life in lives {
        if stop_life(shared, life).await.is_err() {
            return; // the proc exits: nothing else to stop gracefully
        }
    }
}

/// Stops a life on purpose and waits until it has ended; a life that does
/// not end after the kill is stuck: the proc is told to exit.
async fn stop_life(shared: &Shared, life: Life) -> Result<(), String> {
    life.phase.store(STOPPING, Ordering::SeqCst);
    let mut ended = life.ended.clone();
    let done = |ended: &mut watch::Receiver<Option<LifeEnd>>| ended.borrow_and_update().is_some();
    if done(&mut ended) {
        return Ok(());
    }
    life.actor.stop(None);
    let wait = |ended: watch::Receiver<Option<LifeEnd>>, bound: Duration| async move {
        let mut ended = ended;
        tokio::time::timeout(bound, ended.wait_for(Option::is_some))
            .await
            .is_ok_and(|r| r.is_ok())
    };
    if wait(ended.clone(), MEMBER_SHUTDOWN).await {
        return Ok(());
    }
    tracing::warn!(
        rank = life.rank,
        "a member did not stop within its shutdown; killing it"
    );
    life.actor.kill();
    if wait(ended, KILL_WAIT).await {
        return Ok(());
    }
    let mesh = shared.known.info().id;
    tracing::error!(
        rank = life.rank,
        "a killed member still runs (code that never yields); the proc exits so that it is replaced"
    );
    let _ = shared.stuck.send((mesh, life.rank));
    Err(format!(
        "member of rank {} is stuck and cannot be stopped",
        life.rank
    ))
}

/// Starts lives for `ranks` (all hosted here) in the mesh's current
/// generation and waits until each `new` returned; if one fails, the others
/// are stopped and the first error is returned.
async fn spawn_lives(
    shared: &Arc<Shared>,
    ranks: &[u32],
    args: &Bytes,
    restart: Option<&Restart>,
) -> Result<(), String> {
    let info = shared.known.info();
    let services = &shared.services;
    let actor_type = (shared.types)(&info.actor_type).ok_or_else(|| {
        format!(
            "no actor type {:?} is registered in this proc",
            info.actor_type
        )
    })?;
    let first = shared.proc_rank * info.per_proc;
    let previous = Generation(info.generation.0.saturating_sub(1));
    let mut started = Vec::with_capacity(ranks.len());
    let mut failure = None;
    for &rank in ranks {
        let point = match info.shape.point_of(Rank(rank)) {
            Some(p) => p,
            None => {
                failure = Some(format!("rank {rank} outside the shape"));
                break;
            }
        };
        let member = Member {
            inner: Arc::new(MemberInner {
                mesh: info.id,
                name: info.name.clone(),
                rank: Rank(rank),
                point,
                proc: services.fabric.proc().clone(),
                start: StartContext::of(rank, info.generation, previous, restart),
                state: shared.known.state.subscribe(),
                controller: PortId {
                    actor: info.owner.actor.clone(),
                    port: names::SPAWN_PORT,
                },
                services: services.clone(),
            }),
        };
        let (started_tx, started_rx) = oneshot::channel();
        let start = LifeStart {
            member,
            args: args.clone(),
            started: started_tx,
            own_thread: services.fabric.own_threads(),
        };
        let running = match actor_type.spawn(start).await {
            Ok(r) => r,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        let phase = Arc::new(AtomicU8::new(STARTING));
        let (ended_tx, ended) = watch::channel(None);
        let life = Life {
            id: NEXT_LIFE.fetch_add(1, Ordering::Relaxed),
            rank,
            actor: running.actor,
            phase: phase.clone(),
            ended,
        };
        let (result_tx, result_rx) = oneshot::channel();
        tokio::spawn(watch_life(
            shared.clone(),
            life.clone(),
            info.generation,
            started_rx,
            result_tx,
            running.ended,
            ended_tx,
        ));
        shared.slots.lock().expect("slots lock")[(rank - first) as usize] = Some(life.clone());
        // Casts held for the rank go to the new life's mailbox now (they
        // wait there for its `new`, which may itself call peers).
        shared
            .starting
            .send_if_modified(|starting| starting.remove(&rank));
        started.push((life, result_rx));
    }
    // Ranks whose lives did not start are not waited for either.
    shared.starting.send_if_modified(|starting| {
        let before = starting.len();
        starting.retain(|r| !ranks.contains(r));
        starting.len() != before
    });
    // Every `new` runs at once (each on its own thread); wait for all.
    let mut lives = Vec::with_capacity(started.len());
    for (life, result) in started {
        match result.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failure.get_or_insert(e);
            }
            Err(_) => {
                failure.get_or_insert_with(|| "the member's thread ended while it started".into());
            }
        }
        lives.push(life);
    }
    let Some(e) = failure else { return Ok(()) };
    // The spawn fails as a whole: what started stops, slots are cleared.
    for life in lives {
        {
            let mut slots = shared.slots.lock().expect("slots lock");
            if let Some(slot) = slots.get_mut((life.rank - first) as usize)
                && slot.as_ref().is_some_and(|l| l.id == life.id)
            {
                *slot = None;
            }
        }
        if stop_life(shared, life).await.is_err() {
            break;
        }
    }
    Err(e)
}

/// Follows one life: passes on how its start went, then how it ended;
/// reports an exit the proc did not cause to the mesh's owner.
async fn watch_life(
    shared: Arc<Shared>,
    life: Life,
    generation: Generation,
    started: oneshot::Receiver<Result<(), String>>,
    result: oneshot::Sender<Result<(), String>>,
    ended: oneshot::Receiver<LifeEnd>,
    ended_tx: watch::Sender<Option<LifeEnd>>,
) {
    let start = started
        .await
        .unwrap_or_else(|_| Err("the member ended before it started".into()));
    if start.is_ok() {
        let _ = life
            .phase
            .compare_exchange(STARTING, RUNNING, Ordering::SeqCst, Ordering::SeqCst);
    }
    let _ = result.send(start);
    let end = ended.await.unwrap_or(LifeEnd::Killed);
    ended_tx.send_replace(Some(end.clone()));
    // Out of its slot, if still there.
    let info = shared.known.info();
    let first = shared.proc_rank * info.per_proc;
    {
        let mut slots = shared.slots.lock().expect("slots lock");
        if let Some(slot) = slots.get_mut((life.rank - first) as usize)
            && slot.as_ref().is_some_and(|l| l.id == life.id)
        {
            *slot = None;
        }
    }
    if life.phase.load(Ordering::SeqCst) != RUNNING {
        return; // stopped on purpose, or its spawn's answer tells
    }
    let cause = match end {
        LifeEnd::Stopped => FailureCause::Stopped,
        LifeEnd::StartFailed(m) => FailureCause::StartFailed(m),
        LifeEnd::Failed { message, panicked } => FailureCause::Actor { message, panicked },
        LifeEnd::Killed => FailureCause::Actor {
            message: "killed".into(),
            panicked: false,
        },
    };
    let report = MemberExited {
        mesh: info.id,
        rank: life.rank,
        generation,
        cause,
    };
    shared
        .services
        .fabric
        .notify(info.owner.clone(), report)
        .await;
}

/// Forwards and delivers the mesh's casts, in arrival order; collects the
/// results beside it.
///
/// A cast this proc cannot serve yet is held, not refused: one for a
/// generation newer than the proc knows, from a proc of the mesh (the
/// owner's update or respawn that brings the generation is on its way here;
/// the sender's proc learned it first — the command loop refuses it from
/// anyone else), or one for members being respawned (their new lives are
/// about to take their slots). A held cast keeps its place: a later cast of
/// the same origin waits behind it (a sender's generations only grow, so
/// one of an older generation does not: its sender is confused, and no
/// order is owed to it), while casts of other senders pass. Held casts fail
/// when they have waited `MAX_HOLD` or their budget, or the mesh stops.
async fn run_dispatcher(shared: Arc<Shared>, mut casts: mpsc::Receiver<Bound>) {
    let mut status = shared.known.status.subscribe();
    let mut starting = shared.starting.subscribe();
    let mut held: Vec<Held> = Vec::new();
    let mut order = Order::default();
    // The casts served here that still wait for their results, collected
    // in this task rather than a task each.
    let mut collecting: Collecting = FuturesUnordered::new();
    loop {
        let expiry = held.iter().map(Held::until).min();
        tokio::select! {
            // In a fixed order, so that a simulated run replays: casts
            // first; nothing starves, as every turn ends by going through
            // the held casts with the status and expiries as they are now.
            // Results before them: each served cast has one, so they
            // cannot hold casts back for long, and taking them frees what
            // the casts hold.
            biased;
            Some(()) = collecting.next(), if !collecting.is_empty() => continue,
            cast = casts.recv() => {
                let Some(cast) = cast else { break };
                if order.is_stale(&cast.frame) {
                    fail(&shared, &cast, STALE);
                    continue;
                }
                if !behind(&held, &cast.frame) && servable(&shared, &cast) {
                    order.served(&cast.frame);
                    serve(&shared, cast, &mut collecting).await;
                    continue;
                }
                if held.len() >= QUEUED_CASTS {
                    fail(&shared, &cast, "proc overloaded: its casts to this mesh are backed up");
                } else {
                    held.push(Held {
                        arrived: tokio::time::Instant::now(),
                        cast,
                    });
                }
            }
            changed = status.changed(), if !held.is_empty() => {
                if changed.is_err() {
                    break;
                }
            }
            changed = starting.changed(), if !held.is_empty() => {
                if changed.is_err() {
                    break;
                }
            }
            () = sleep_until_some(expiry), if expiry.is_some() => {}
        }
        let done = status.borrow_and_update().is_done();
        starting.borrow_and_update();
        release_held(&shared, &mut held, &mut order, done, &mut collecting).await;
    }
    for h in held {
        fail(&shared, &h.cast, "the mesh stopped");
    }
    // The casts already served still answer for their subtrees.
    while collecting.next().await.is_some() {}
}

/// Served casts collecting their results (see [`serve_cast`]).
type Collecting = FuturesUnordered<BoxFuture<'static, ()>>;

/// Serves a cast ([`serve_cast`]) and adds its collection to `collecting`.
/// Serving can wait (on a slow child's flow control): the casts already
/// served keep collecting and answering meanwhile.
async fn serve(shared: &Shared, cast: Bound, collecting: &mut Collecting) {
    let work = std::pin::pin!(serve_cast(shared, cast));
    if let Some(c) = node::beside(work, collecting).await {
        collecting.push(c);
    }
}

/// Why a cast is refused that came after a later one of its sender.
const STALE: &str =
    "cast overtaken by a later one of its sender (the tree's path changed under it)";

/// The most senders whose order a dispatcher keeps; past it, the one heard
/// from longest ago is forgotten (a sender's casts come from the
/// controller or the procs that hold a reference, so this is far more
/// than a mesh has).
const MAX_ORDERED_SENDERS: usize = 4096;

/// The last cast served of each sender (caster incarnation), so that an
/// earlier one arriving after it is refused rather than served out of order
/// (see `CastOrder`): FIFO per sender holds when a tree's path changes
/// under a sender's casts.
#[derive(Default)]
struct Order {
    /// Per caster incarnation (a random number drawn when the caster
    /// starts): its origin, the last seq served, and when (in `served`
    /// calls), for forgetting the oldest. Keyed by the incarnation alone so
    /// that a lookup clones nothing; an entry counts only for its origin.
    last: std::collections::BTreeMap<u64, (regent_net::ActorId, u64, u64)>,
    served: u64,
}

impl Order {
    /// Whether `frame` comes after a later cast of its sender was served
    /// (a batch, when its first cast does).
    fn is_stale(&self, frame: &CastFrame) -> bool {
        if crate::bugs::planted(crate::bugs::PlantedBug::UnorderedCasts) {
            return false;
        }
        frame.order.seq != 0
            && self
                .last
                .get(&frame.order.caster)
                .is_some_and(|(origin, seq, _)| *origin == frame.origin && frame.order.seq <= *seq)
    }

    /// Records that `frame` is served (a batch: up to its last cast).
    fn served(&mut self, frame: &CastFrame) {
        if frame.order.seq == 0 {
            return;
        }
        self.served += 1;
        let at = self.served;
        if let Some((origin, seq, when)) = self.last.get_mut(&frame.order.caster)
            && *origin == frame.origin
        {
            *seq = (*seq).max(frame.last_seq());
            *when = at;
            return;
        }
        if !self.last.contains_key(&frame.order.caster) && self.last.len() >= MAX_ORDERED_SENDERS {
            let oldest = self
                .last
                .iter()
                .min_by_key(|(_, (_, _, when))| *when)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.last.remove(&k);
            }
        }
        self.last.insert(
            frame.order.caster,
            (frame.origin.clone(), frame.last_seq(), at),
        );
    }
}

/// A cast waiting in the dispatcher.
struct Held {
    arrived: tokio::time::Instant,
    cast: Bound,
}

impl Held {
    fn budget(&self) -> Duration {
        Duration::from_millis(u64::from(self.cast.frame.budget_ms))
    }

    /// When it fails if still held.
    fn until(&self) -> tokio::time::Instant {
        self.arrived + self.budget().min(MAX_HOLD)
    }
}

/// The longest a cast is held for a generation or a respawn (see
/// `run_dispatcher`): well beyond the time the owner's commands take to
/// reach every proc, and about what stopping a member's old life may take.
const MAX_HOLD: Duration = Duration::from_secs(5);

/// Whether `frame` must wait behind a held cast: one of the same origin and
/// a generation no newer than its own.
fn behind(held: &[Held], frame: &CastFrame) -> bool {
    held.iter()
        .any(|h| h.cast.frame.origin == frame.origin && h.cast.frame.generation <= frame.generation)
}

/// Whether a cast can be forwarded and delivered now: its generation is
/// known here (one the proc has since left reaches only survivors, when
/// served) and none of the local members it selects is being respawned.
fn servable(shared: &Shared, cast: &Bound) -> bool {
    let known = shared.known.info().generation;
    if cast.frame.generation != known {
        return cast.frame.generation < known;
    }
    let starting = shared.starting.borrow();
    !starting.iter().any(|&r| cast.selected.contains(Rank(r)))
}

/// Sleeps until `until` (forever without one).
async fn sleep_until_some(until: Option<tokio::time::Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}

/// Goes through the held casts in order: fails those that waited too long
/// (all, once the mesh is done) and serves those that can be served and are
/// not behind one still held.
async fn release_held(
    shared: &Shared,
    held: &mut Vec<Held>,
    order: &mut Order,
    done: bool,
    collecting: &mut Collecting,
) {
    if held.is_empty() {
        return;
    }
    let now = tokio::time::Instant::now();
    let known = shared.known.info().generation;
    let mut kept: Vec<Held> = Vec::with_capacity(held.len());
    for h in std::mem::take(held) {
        let frame = &h.cast.frame;
        if done || h.until() <= now {
            let why = if done {
                "the mesh stopped"
            } else if frame.generation > known {
                "cast for a generation of the mesh this proc did not learn in time"
            } else {
                "the members it selects here did not restart in time"
            };
            fail(shared, &h.cast, why);
        } else if order.is_stale(frame) {
            fail(shared, &h.cast, STALE);
        } else if !behind(&kept, frame) && servable(shared, &h.cast) {
            order.served(frame);
            // What is left of its budget after the wait.
            let left = h
                .budget()
                .saturating_sub(now.saturating_duration_since(h.arrived));
            let mut cast = h.cast;
            cast.frame.budget_ms = u32::try_from(left.as_millis()).unwrap_or(u32::MAX);
            serve(shared, cast, collecting).await;
        } else {
            kept.push(h);
        }
    }
    *held = kept;
}

/// Forwards and delivers one cast; returns what collects its results and
/// answers for its subtree, if its sender wants them. The command loop took
/// it in its generation; if the proc has moved on since (a restart's update
/// arrived while the cast waited in the queue), it still reaches the lives
/// that began in that generation or before (survivors), never a life of a
/// later one, and procs further down judge it as they take it.
async fn serve_cast(shared: &Shared, cast: Bound) -> Option<BoxFuture<'static, ()>> {
    let fabric = shared.services.fabric.clone();
    let pending = shared.services.pending.clone();
    let info = shared.known.info();
    let frame = &cast.frame;
    if frame.generation > info.generation {
        fail(shared, &cast, "cast for another generation of the mesh");
        return None;
    }
    // Only a cast the proc has moved on from needs each life's generation.
    let older = frame.generation < info.generation
        && !crate::bugs::planted(crate::bugs::PlantedBug::NoFencing);
    let members: LocalMembers = shared
        .slots
        .lock()
        .expect("slots lock")
        .iter()
        .map(|s| {
            s.as_ref()
                .filter(|l| !older || shared.known.life_began(Rank(l.rank)) <= frame.generation)
                .map(|l| l.actor.clone())
        })
        .collect();
    let mut ds = node::dispatch(fabric.as_ref(), &pending, &info, &cast, Some(&members)).await;
    // A cast that wants results is answered once they are in; one that
    // does not is done.
    let reply = cast.frame.reply?;
    Some(Box::pin(async move {
        if ds.len() == 1 {
            let c = node::collect(&pending, ds.swap_remove(0)).await;
            return answer(fabric.as_ref(), &reply, vec![(0, c)]).await;
        }
        // A batch: each cast's results as they come in, those that are in
        // together in one reply.
        let mut collecting: FuturesUnordered<_> = ds
            .into_iter()
            .zip(0u32..)
            .map(|(d, i)| {
                let pending = &pending;
                async move { (i, node::collect(pending, d).await) }
            })
            .collect();
        while let Some(first) = collecting.next().await {
            let mut ready = vec![first];
            while let Some(Some(r)) = collecting.next().now_or_never() {
                ready.push(r);
            }
            answer(fabric.as_ref(), &reply, ready).await;
        }
    }))
}

/// Answers `reply` with results of the casts of one frame, each with its
/// place in the frame (0 for its own cast, `i` answering `reply.call +
/// i`): those that fit a reply frame together share one
/// ([`ReplyBody::Casts`]); one too large for a frame goes alone, split
/// into parts ([`node::split`]).
pub(super) async fn answer(
    fabric: &dyn crate::fabric::Fabric,
    reply: &ReplyTo,
    results: Vec<(u32, Contribution)>,
) {
    let room = node::reply_room(fabric.max_frame_bytes());
    let mut together = Vec::new();
    let mut used = 0;
    for (i, c) in results {
        let bytes = node::reply_bytes(&c) + node::VALUE_OVERHEAD_BYTES;
        if bytes > room {
            let Some(call) = reply.call.checked_add(u64::from(i)) else {
                continue;
            };
            let parts = node::split(c, fabric.max_frame_bytes());
            let last = parts.len() - 1;
            for (k, part) in parts.into_iter().enumerate() {
                let body = if k == last {
                    ReplyBody::Cast(part)
                } else {
                    ReplyBody::CastPart(part)
                };
                fabric
                    .reply(reply.port.clone(), ProcReply { call, body })
                    .await;
            }
            continue;
        }
        if used + bytes > room {
            answer_together(fabric, reply, std::mem::take(&mut together)).await;
            used = 0;
        }
        used += bytes;
        together.push((i, c));
    }
    answer_together(fabric, reply, together).await;
}

/// One reply with `results` (a cast's own when there is one).
async fn answer_together(
    fabric: &dyn crate::fabric::Fabric,
    reply: &ReplyTo,
    mut results: Vec<(u32, Contribution)>,
) {
    let (call, body) = match results.len() {
        0 => return,
        1 => {
            let (i, c) = results.swap_remove(0);
            let Some(call) = reply.call.checked_add(u64::from(i)) else {
                return;
            };
            (call, ReplyBody::Cast(c))
        }
        _ => (reply.call, ReplyBody::Casts(results)),
    };
    fabric
        .reply(reply.port.clone(), ProcReply { call, body })
        .await;
}

/// The same failure, `failed`, for each cast `frame` carries (at most
/// [`crate::protocol::MAX_BATCHED_CASTS`], for a frame refused as invalid).
pub(super) fn each_failed(
    frame: &CastFrame,
    failed: Vec<(u32, crate::error::MemberError)>,
) -> Vec<(u32, Contribution)> {
    let casts = (frame.more.len() + 1).min(crate::protocol::MAX_BATCHED_CASTS) as u32;
    (0..casts)
        .map(|i| {
            let c = Contribution {
                failed: failed.clone(),
                ..Contribution::default()
            };
            (i, c)
        })
        .collect()
}

fn fail(shared: &Shared, cast: &Bound, why: &str) {
    let frame = &cast.frame;
    let Some(reply_to) = frame.reply.clone() else {
        return;
    };
    let ranks = node::member_ranks(frame.per_proc, frame.procs.0..frame.procs.1);
    let Some(failed) = super::failed_in(&cast.selected, ranks, why) else {
        return;
    };
    let results = each_failed(frame, failed);
    let fabric = shared.services.fabric.clone();
    tokio::spawn(async move { answer(fabric.as_ref(), &reply_to, results).await });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serving a cast holds its work once: the work is pinned where it is
    /// kept, not moved into `beside` and pinned again there (a copy of a
    /// kilobytes-large state per cast, and twice its room in the
    /// dispatcher's own state).
    #[test]
    #[allow(unreachable_code, clippy::diverging_sub_expression)]
    fn serving_a_cast_holds_its_work_once() {
        let work = crate::returned_size(|| serve_cast(unreachable!(), unreachable!()));
        let serving =
            crate::returned_size(|| serve(unreachable!(), unreachable!(), unreachable!()));
        assert!(
            serving < work + work / 2,
            "serving holds {serving} bytes for {work} bytes of work"
        );
    }

    /// A frame of casts `seq..seq + batched` of caster 7.
    fn numbered(seq: u64, batched: usize) -> CastFrame {
        let origin = regent_net::ActorId {
            proc: regent_net::ProcId::new("controller").unwrap(),
            name: regent_net::ActorName::new("controller").unwrap(),
            index: 0,
        };
        CastFrame {
            mesh: crate::protocol::MeshId(1),
            generation: regent_net::Generation(0),
            token: crate::protocol::CastToken(1),
            origin,
            order: crate::protocol::CastOrder { caster: 7, seq },
            view: crate::shape::Shape::new([("procs", 1)]).unwrap(),
            selection: crate::selection::Selection::All,
            seed: 0,
            procs: (0, 1),
            per_proc: 1,
            lost: Vec::new(),
            payload: bytes::Bytes::new(),
            more: vec![bytes::Bytes::new(); batched - 1],
            reply: None,
            collect: crate::protocol::Collect::Ack,
            budget_ms: 1000,
        }
    }

    /// A batch of casts takes its sender's order up to its last cast: a
    /// later frame that repeats any of its casts, or a batch that starts
    /// before its end, is stale; what follows it is not.
    #[test]
    fn a_served_batch_orders_its_sender_up_to_its_last_cast() {
        let mut order = Order::default();
        let batch = numbered(5, 4); // casts 5..=8
        assert!(!order.is_stale(&batch));
        order.served(&batch);
        for (seq, batched) in [(5, 1), (8, 1), (2, 4), (7, 3), (8, 2)] {
            assert!(
                order.is_stale(&numbered(seq, batched)),
                "casts {seq}..{} after 5..=8",
                seq + batched as u64
            );
        }
        assert!(!order.is_stale(&numbered(9, 1)));
        assert!(!order.is_stale(&numbered(9, 30)));
        order.served(&numbered(9, 30));
        assert!(order.is_stale(&numbered(38, 1)));
        assert!(!order.is_stale(&numbered(39, 1)));
    }
}
