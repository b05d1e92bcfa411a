//! The proc runtime: what runs in every proc process after boot. It hosts
//! the members of meshes (each life on a thread of its own, see
//! `life`), forwards and delivers casts as a node of each cast
//! tree, follows its owner's commands, and stops itself when its owner's
//! lease lapses or a member cannot be stopped.
//!
//! The command loop never waits on members: spawning, respawning and
//! stopping run per mesh in a task of their own (`members`), so a slow
//! `new` or a member slow to stop delays neither casts to other members nor
//! lease renewals. Only the owner (authenticated by the control plane)
//! commands the proc; casts must carry the mesh's capability.

mod members;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use regent_net::{ActorId, Endpoint, PortId, ProcId};
use regent_rdma::BufferManager;
use tokio::sync::mpsc;

use crate::cast::Caster;
use crate::cast::node::{self, Bound};
use crate::entropy::Entropy;
use crate::error::MemberError;
use crate::fabric::{Fabric, NetFabric, Pending};
use crate::member::{KnownMesh, ProcServices};
use crate::protocol::{CastFrame, MeshId, ProcCommand, ProcReply, ProcStats, ReplyBody, names};
use crate::registry::ActorTypes;
use crate::relay::{self, OwnerKey, RelayBody, RelayFrame, RelayGate, RelayOutcome};
use crate::selection::Selected;
use crate::shape::Rank;

use members::{Hosted, MeshOp};

/// How long a member may take to stop before it is killed.
pub(crate) const MEMBER_SHUTDOWN: Duration = Duration::from_secs(5);
/// How long a killed member may take to end before the proc gives up on it
/// (it is stuck in code that never yields) and exits.
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(1);
/// The longest owner lease a proc takes (longer ones are cut to it; a boot
/// carrying one does not decode).
pub use crate::boot::MAX_OWNER_LEASE;
pub use members::QUEUED_CASTS;
/// How long members' own requests and casts wait by default.
const MEMBER_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the proc runtime ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcExit {
    /// The owner told it to exit.
    Requested,
    /// The owner was not heard from within its lease.
    LeaseLapsed,
    /// The endpoint closed.
    EndpointClosed,
    /// A member did not end after it was killed (it runs code that never
    /// yields): the proc exits so that its owner replaces it, and no second
    /// life of that member ever runs beside the stuck one.
    MemberStuck {
        /// The mesh.
        mesh: MeshId,
        /// The member's rank.
        rank: u32,
    },
}

/// Why the proc runtime could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// A port could not be opened.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
    /// The proc's own names are invalid (a bug).
    #[error(transparent)]
    Id(#[from] regent_net::IdError),
    /// Reporting ready failed.
    #[error("could not report ready: {0}")]
    Ready(String),
}

/// What a proc needs to serve.
pub struct ProcSetup {
    /// Its endpoint.
    pub endpoint: Endpoint,
    /// The controller that owns it: the only one that commands it.
    pub owner: ProcId,
    /// How long it runs without hearing from the owner.
    pub owner_lease: Duration,
    /// The owner's key: commands relayed by other procs must carry its
    /// signature (`None`: none is taken).
    pub owner_key: Option<OwnerKey>,
    /// Its payload plane (members reach it through `Member::buffers`).
    pub buffers: Option<Arc<BufferManager>>,
    /// Whether each member life runs on a thread of its own (a current-thread
    /// runtime), so that blocking handlers delay only their own mailbox:
    /// `true` in production. A deterministic simulation runs them as tasks
    /// of the one runtime instead.
    pub member_threads: bool,
    /// Where the proc's random numbers (the seeds of its members' casts)
    /// come from: `None` draws from the OS, a seed makes them replay.
    pub seed: Option<u64>,
    /// Where the owner's lease deadline is published for a watcher outside
    /// the serve loop (a proc process's watchdog thread), which must be
    /// able to end the process when the loop's thread is held.
    pub lease_clock: Option<LeaseClock>,
}

/// The owner's lease deadline of a serving proc, shared with a watcher on
/// another thread: [`serve`] moves it at every sign of the owner, and
/// disarms it once its loop has ended (the loop then exits on its own).
/// A proc process watches it from a thread of its own, so that a proc
/// whose control thread is held (a member of `MemberThread::Proc` in code
/// that never yields) still ends when its lease lapses, as a proc that
/// hears nothing from its owner must.
#[derive(Debug, Clone)]
pub struct LeaseClock(Arc<LeaseClockInner>);

#[derive(Debug)]
struct LeaseClockInner {
    base: std::time::Instant,
    /// Milliseconds after `base`; `u64::MAX`: disarmed.
    deadline_ms: AtomicU64,
}

impl LeaseClock {
    /// A clock whose lease lapses `lease` from now (never, for a lease
    /// past what an `Instant` or the clock holds).
    pub fn new(lease: Duration) -> Self {
        let clock = Self(Arc::new(LeaseClockInner {
            base: std::time::Instant::now(),
            deadline_ms: AtomicU64::new(u64::MAX),
        }));
        clock.store(lease);
        clock
    }

    fn set(&self, deadline: std::time::Instant) {
        self.store(deadline.saturating_duration_since(self.0.base));
    }

    /// Arms the clock `after` its base.
    fn store(&self, after: Duration) {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX - 1);
        self.0
            .deadline_ms
            .store(ms.min(u64::MAX - 1), Ordering::Relaxed);
    }

    fn disarm(&self) {
        self.0.deadline_ms.store(u64::MAX, Ordering::Relaxed);
    }

    /// When the lease lapses (`None`: disarmed, the serve loop has ended,
    /// or never).
    pub fn deadline(&self) -> Option<std::time::Instant> {
        match self.0.deadline_ms.load(Ordering::Relaxed) {
            u64::MAX => None,
            // A deadline past what an `Instant` holds never comes.
            ms => self.0.base.checked_add(Duration::from_millis(ms)),
        }
    }
}

/// The proc runtime's state and command handling, independent of how
/// commands arrive (the control plane, or memory in a simulation).
pub(crate) struct ProcRuntime {
    fabric: Arc<dyn Fabric>,
    services: Arc<ProcServices>,
    /// The meshes whose members this proc hosts (ordered: shutdown goes
    /// through them in a fixed order).
    hosted: BTreeMap<MeshId, Hosted>,
    /// Tells the serve loop that a member is stuck.
    stuck: mpsc::UnboundedSender<(MeshId, u32)>,
    stuck_rx: mpsc::UnboundedReceiver<(MeshId, u32)>,
    /// Commands refused (not from the owner, or casts without the mesh's
    /// capability).
    refused: u64,
    types: ActorTypes,
    /// Checks relayed commands: the owner's key, replays.
    gate: RelayGate,
    /// Whether a command the owner signed came since this was last taken
    /// (`Some(true)`: a renewal).
    owner_heard: Option<bool>,
}

impl ProcRuntime {
    /// Starts a proc runtime; `endpoint` and `buffers` are given to members,
    /// whose casts draw their seeds from `entropy`.
    pub(crate) fn start(
        fabric: Arc<dyn Fabric>,
        pending: Arc<Pending>,
        endpoint: Option<Endpoint>,
        buffers: Option<Arc<BufferManager>>,
        types: ActorTypes,
        entropy: Entropy,
    ) -> Self {
        let origin = ActorId {
            proc: fabric.proc().clone(),
            name: regent_net::ActorName::new(names::PROC).expect("a valid constant name"),
            index: 0,
        };
        let caster = Arc::new(Caster::start(
            fabric.clone(),
            pending.clone(),
            origin,
            Arc::new(entropy),
        ));
        let services = Arc::new(ProcServices {
            fabric: fabric.clone(),
            pending: pending.clone(),
            caster,
            known: Arc::default(),
            endpoint,
            buffers,
            timeout: MEMBER_CALL_TIMEOUT,
        });
        let (stuck, stuck_rx) = mpsc::unbounded_channel();
        Self {
            fabric,
            services,
            hosted: BTreeMap::new(),
            stuck,
            stuck_rx,
            refused: 0,
            types,
            gate: RelayGate::new(None),
            owner_heard: None,
        }
    }

    /// Takes relayed commands signed with `key` (the owner's, from the
    /// boot); without one, none.
    pub(crate) fn trust(&mut self, key: Option<OwnerKey>) {
        self.gate = RelayGate::new(key);
    }

    /// Whether a relayed command the owner signed was taken since the last
    /// call (`Some(true)`: a renewal): the owner is alive, as when it
    /// commands directly.
    pub(crate) fn take_owner_heard(&mut self) -> Option<bool> {
        std::mem::take(&mut self.owner_heard)
    }

    /// A member did not end after it was killed, if one did not.
    pub(crate) async fn stuck(&mut self) -> (MeshId, u32) {
        match self.stuck_rx.recv().await {
            Some(s) => s,
            // The runtime holds a sender: never closes.
            None => std::future::pending().await,
        }
    }

    fn reply(&self, port: PortId, call: u64, body: ReplyBody) {
        let fabric = self.fabric.clone();
        tokio::spawn(async move { fabric.reply(port, ProcReply { call, body }).await });
    }

    fn known(&self, mesh: MeshId) -> Option<Arc<KnownMesh>> {
        self.services.known(mesh)
    }

    /// Handles one command from `sender`; returns `Some` when the proc must
    /// exit. Only casts may come from others than the owner. Synchronous:
    /// what waits (a spawn, a relayed command's answers) is handed to tasks,
    /// and a command moved into a future would be copied whole (400 bytes,
    /// a cast's among them) where this takes it in place.
    pub(crate) fn handle(
        &mut self,
        cmd: ProcCommand,
        from_owner: bool,
        sender: &ProcId,
    ) -> Option<ProcExit> {
        if let Err(e) = cmd.validate() {
            self.refused += 1;
            tracing::warn!(from = %sender, error = %e, "an invalid command refused");
            return None;
        }
        let cmd = match cmd {
            ProcCommand::Relay(frame) => self.relay(frame, sender)?,
            ProcCommand::Cast(_) => cmd,
            cmd if from_owner => cmd,
            _ => {
                self.refused += 1;
                tracing::warn!(from = %sender, refused = self.refused, "a command from another than the owner refused");
                return None;
            }
        };
        match cmd {
            ProcCommand::Spawn {
                call,
                reply_to,
                info,
                proc_rank,
                args,
                start,
            } => {
                if let Some(hosted) = self.hosted.get(&info.id) {
                    // An earlier attempt of a restart left members here (the
                    // restart failed elsewhere): a newer generation replaces
                    // them all.
                    if info.generation > hosted.known.info().generation
                        && proc_rank == hosted.proc_rank
                    {
                        let first = proc_rank.saturating_mul(info.per_proc);
                        let ranks: Vec<u32> = (first..first + info.per_proc).collect();
                        self.fabric.learn(&info);
                        hosted.retire(&ranks, first);
                        hosted.known.update(info);
                        if let Some(restart) = &start {
                            hosted.known.restarted(restart);
                        }
                        hosted.submit(MeshOp::Respawn {
                            call,
                            reply_to,
                            ranks,
                            args,
                            restart: start,
                        });
                        return None;
                    }
                    let body = ReplyBody::Spawned(Err(format!(
                        "mesh {} already has members here",
                        info.name
                    )));
                    self.reply(reply_to, call, body);
                    return None;
                }
                if let Err(e) = self.actor_type_known(&info.actor_type) {
                    self.reply(reply_to, call, ReplyBody::Spawned(Err(e)));
                    return None;
                }
                self.fabric.learn(&info);
                let known = KnownMesh::new(info.clone());
                if let Some(restart) = &start {
                    known.restarted(restart);
                }
                self.services
                    .known
                    .lock()
                    .expect("known meshes lock")
                    .insert(info.id, known.clone());
                let hosted = members::start_worker(
                    self.services.clone(),
                    known,
                    proc_rank,
                    self.types,
                    self.stuck.clone(),
                );
                hosted.submit(MeshOp::Spawn {
                    call,
                    reply_to,
                    args,
                    start,
                });
                self.hosted.insert(info.id, hosted);
            }
            ProcCommand::Stop {
                call,
                reply_to,
                mesh,
            } => match self.hosted.remove(&mesh) {
                Some(hosted) => {
                    self.services
                        .known
                        .lock()
                        .expect("known meshes lock")
                        .remove(&mesh);
                    hosted.known.gone();
                    hosted.submit(MeshOp::Stop { call, reply_to });
                }
                None => self.reply(reply_to, call, ReplyBody::Stopped),
            },
            ProcCommand::Respawn {
                call,
                reply_to,
                mesh,
                change,
                ranks,
                args,
                restart,
            } => {
                let Some(hosted) = self.hosted.get(&mesh) else {
                    let body =
                        ReplyBody::Spawned(Err(format!("mesh {} has no members here", mesh.0)));
                    self.reply(reply_to, call, body);
                    return None;
                };
                let info = match change
                    .apply(&hosted.known.info())
                    .and_then(|info| restart.validate_for(&info).map(|()| info))
                {
                    Ok(info) => info,
                    Err(e) => {
                        self.reply(reply_to, call, ReplyBody::Spawned(Err(e)));
                        return None;
                    }
                };
                let first = hosted.proc_rank.saturating_mul(info.per_proc);
                if let Some(r) = ranks
                    .iter()
                    .find(|&&r| r < first || r - first >= info.per_proc)
                {
                    let body = ReplyBody::Spawned(Err(format!("rank {r} is not hosted here")));
                    self.reply(reply_to, call, body);
                    return None;
                }
                self.fabric.learn(&info);
                // The new generation is in force at once: casts of the old
                // one are refused, and the replaced lives get nothing more.
                hosted.retire(&ranks, first);
                hosted.known.update(info);
                hosted.known.restarted(&restart);
                // The members of this proc that survived are told, as on
                // procs that only enroll in the new generation.
                hosted.tell_survivors(&restart);
                hosted.submit(MeshOp::Respawn {
                    call,
                    reply_to,
                    ranks,
                    args,
                    restart: Some(restart),
                });
            }
            ProcCommand::Update {
                call,
                reply_to,
                mesh,
                change,
                restart,
            } => {
                let body = match self.hosted.get(&mesh) {
                    None => ReplyBody::Spawned(Err(format!("mesh {} has no members here", mesh.0))),
                    Some(h) => match change
                        .apply(&h.known.info())
                        .and_then(|info| match &restart {
                            Some(r) => r.validate_for(&info).map(|()| info),
                            None => Ok(info),
                        }) {
                        Err(e) => ReplyBody::Spawned(Err(e)),
                        Ok(info) => {
                            self.fabric.learn(&info);
                            h.known.update(info);
                            if let Some(restart) = restart {
                                h.known.restarted(&restart);
                                h.tell_survivors(&restart);
                            }
                            ReplyBody::Updated
                        }
                    },
                };
                self.reply(reply_to, call, body);
            }
            ProcCommand::Failed {
                mesh,
                failure,
                lost,
            } => {
                for p in &lost {
                    self.fabric.lost().insert(p);
                }
                if let Some(known) = self.known(mesh) {
                    // Casts this proc's members (or this proc, as a node of
                    // a tree) wait on through a lost proc end now, as the
                    // owner's own do, not at their deadline.
                    let info = known.info();
                    let why = failure.cause.to_string();
                    for p in &lost {
                        if let Some(rank) = info.proc_rank(p) {
                            self.services.pending.lose_proc(mesh, rank, &why);
                        }
                    }
                    known.failed(&failure);
                }
            }
            ProcCommand::Cast(frame) => self.cast(frame, sender),
            ProcCommand::ChildInfo { info } => {
                self.fabric.learn(&info);
                let id = info.id;
                let mut known = self.services.known.lock().expect("known meshes lock");
                match known.get(&id) {
                    Some(k) => k.update(info),
                    None => {
                        known.insert(id, KnownMesh::new(info));
                    }
                }
            }
            ProcCommand::ChildGone { mesh } => {
                if let Some(k) = self
                    .services
                    .known
                    .lock()
                    .expect("known meshes lock")
                    .remove(&mesh)
                {
                    k.gone();
                }
            }
            ProcCommand::Supervise {
                call,
                reply_to,
                owner,
                rank,
                failure,
            } => match self.hosted.get(&owner) {
                Some(h) => h.supervise(rank, failure, call, reply_to),
                None => self.reply(reply_to, call, ReplyBody::Decided(None)),
            },
            ProcCommand::Renew => {}
            // Relayed commands carry none (`relay` gives what it carries).
            ProcCommand::Relay(_) => {}
            ProcCommand::Exit => return Some(ProcExit::Requested),
        }
        None
    }

    /// Takes a relayed command if the owner signed it and it was not taken
    /// before: forwards it down its route, and returns what this proc does
    /// of it (`None` for a renewal), whose answer joins the subtree's
    /// outcome. A refused one is answered for its whole route.
    fn relay(&mut self, frame: RelayFrame, sender: &ProcId) -> Option<ProcCommand> {
        let me = self.fabric.proc().clone();
        let admitted = self.gate.admit(&frame).and_then(|body| {
            let head = &frame.route[0].addr.proc;
            if *head == me {
                Ok(body)
            } else {
                Err(format!("the route's head is {head}, not this proc"))
            }
        });
        let body = match admitted {
            Ok(body) => body,
            Err(e) => {
                self.refused += 1;
                tracing::warn!(from = %sender, error = %e, refused = self.refused, "a relayed command refused");
                if let Some(to) = frame.reply {
                    let mut out = RelayOutcome::default();
                    out.fail_all(&frame.route, &format!("refused by {me}: {e}"));
                    self.reply(to.port, to.call, ReplyBody::Relayed(out));
                }
                return None;
            }
        };
        self.owner_heard = Some(matches!(body, RelayBody::Renew));
        let pending = self.services.pending.clone();
        // This proc's part: a renewal is done when taken; a spawn or update
        // answers this proc's own reply port.
        let (local, answer): (_, BoxFuture<'static, Result<(), String>>) = match body {
            RelayBody::Renew => (None, Box::pin(async { Ok(()) })),
            body => {
                let (call, rx) = pending.request(&me);
                let reply_to = self.fabric.reply_port();
                let cmd = body.command(frame.route[0].rank, call, reply_to);
                match cmd.validate() {
                    Ok(()) => (
                        Some(cmd),
                        Box::pin(async move {
                            match rx.await {
                                Ok(ReplyBody::Spawned(Ok(())) | ReplyBody::Updated) => Ok(()),
                                Ok(ReplyBody::Spawned(Err(e))) => Err(e),
                                Ok(_) => Err("an answer of another kind".to_owned()),
                                Err(_) => Err("the command was dropped".to_owned()),
                            }
                        }),
                    ),
                    Err(e) => {
                        pending.forget(call);
                        let why = format!("an invalid command: {e}");
                        (None, Box::pin(async move { Err(why) }))
                    }
                }
            }
        };
        let fabric = self.fabric.clone();
        tokio::spawn(async move {
            let replies = frame.reply.is_some();
            let out = relay::spread(&*fabric, &pending, &frame, replies, Some(answer)).await;
            if let Some(to) = frame.reply {
                let body = ReplyBody::Relayed(out);
                fabric
                    .reply(
                        to.port,
                        ProcReply {
                            call: to.call,
                            body,
                        },
                    )
                    .await;
            }
        });
        local
    }

    fn actor_type_known(&self, name: &str) -> Result<(), String> {
        match (self.types)(name) {
            Some(_) => Ok(()),
            None => Err(format!(
                "no actor type {name:?} is registered in this proc (registered: {:?})",
                crate::registry::actor_types()
            )),
        }
    }

    /// Forwards and delivers a cast; answers for its subtree if this proc
    /// cannot serve it.
    fn cast(&mut self, frame: CastFrame, sender: &ProcId) {
        let Some(hosted) = self.hosted.get(&frame.mesh) else {
            return self.fail_subtree(frame, "proc does not host the mesh");
        };
        let info = hosted.known.info();
        if frame.token != info.token {
            self.refused += 1;
            tracing::warn!(from = %sender, mesh = %info.name, refused = self.refused, "a cast without the mesh's capability refused");
            return self.fail_subtree(
                frame,
                "refused: the cast does not carry the mesh's capability",
            );
        }
        // A cast for a newer generation from a proc of the mesh waits in the
        // mesh's dispatcher for the owner's update (the sender's proc
        // learned it first); from anyone else it is refused.
        let ahead = frame.generation > info.generation && info.proc_rank(sender).is_some();
        let unfenced = frame.generation < info.generation
            && crate::bugs::planted(crate::bugs::PlantedBug::NoFencing);
        if frame.generation != info.generation && !ahead && !unfenced {
            return self.fail_subtree(frame, "cast for another generation of the mesh");
        }
        // What validate_at checks does not change with the generation.
        match frame.validate_at(&info, hosted.proc_rank) {
            Ok(selected) => hosted.cast(Bound {
                frame: Box::new(frame),
                selected,
            }),
            Err(e) => {
                self.refused += 1;
                tracing::warn!(from = %sender, mesh = %info.name, error = %e, "an invalid cast refused");
                self.fail_subtree(frame, &format!("refused: an invalid cast ({e})"));
            }
        }
    }

    /// Answers for a whole subtree that this proc cannot serve: every
    /// selected member in it failed. Nothing is forwarded.
    fn fail_subtree(&self, frame: CastFrame, why: &str) {
        tracing::debug!(mesh = frame.mesh.0, why, "cast not served");
        let Some(reply) = frame.reply.clone() else {
            return;
        };
        let ranks = node::member_ranks(frame.per_proc, frame.procs.0..frame.procs.1);
        let failed = match frame.selection.bind(&frame.view, frame.seed) {
            Ok(selected) => match failed_in(&selected, ranks, why) {
                Some(failed) => failed,
                None => return,
            },
            Err(_) => Vec::new(),
        };
        // Each cast of a batch is answered.
        let results = members::each_failed(&frame, failed);
        let fabric = self.fabric.clone();
        tokio::spawn(async move { members::answer(fabric.as_ref(), &reply, results).await });
    }

    /// Stops every member.
    pub(crate) async fn shutdown(&mut self) {
        let stops: Vec<_> = std::mem::take(&mut self.hosted)
            .into_values()
            .map(|h| async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                h.submit(MeshOp::Shutdown(tx));
                let _ = rx.await;
            })
            .collect();
        futures::future::join_all(stops).await;
    }
}

/// The most ranks a proc walks when it answers for a subtree it cannot
/// serve. The frame's range is then not checked against a mesh (the proc
/// may not host it), and the limits allow 2^32 ranks: walking them all
/// stalled the command loop for minutes.
const MAX_WALKED_RANKS: usize = 1 << 16;

/// The selected ranks of `ranks`, failed for `why`; only those within the
/// view's span of ranks are walked. `None` when that span is wider than
/// [`MAX_WALKED_RANKS`]: the subtree is then not answered for (a part would
/// leave its other ranks unaccounted; without an answer the parent reports
/// them all as timed out — and so many failures would not fit a reply).
fn failed_in(
    selected: &Selected,
    ranks: std::ops::Range<u32>,
    why: &str,
) -> Option<Vec<(u32, MemberError)>> {
    let layout = selected.shape().layout();
    // Both fit a u32: a slice's ranks do (checked at construction).
    let first = u32::try_from(layout.offset()).unwrap_or(u32::MAX);
    let last = u32::try_from(layout.max_rank()).unwrap_or(u32::MAX);
    let start = ranks.start.max(first);
    let end = ranks.end.min(last.saturating_add(1)).max(start);
    if (end - start) as usize > MAX_WALKED_RANKS {
        tracing::warn!(
            ranks = end - start,
            max = MAX_WALKED_RANKS,
            "a subtree too wide to answer for is not answered"
        );
        return None;
    }
    Some(
        (start..end)
            .filter(|&r| selected.contains(Rank(r)))
            .map(|r| (r, MemberError::NotRunning(why.to_owned())))
            .collect(),
    )
}

/// The proc's well-known actor on `endpoint`.
fn proc_actor(endpoint: &Endpoint) -> Result<ActorId, ProcError> {
    Ok(ActorId {
        proc: endpoint.proc().clone(),
        name: regent_net::ActorName::new(names::PROC)?,
        index: 0,
    })
}

/// A proc's reports of its traffic to its owner ([`ProcStats`]).
struct StatsReport {
    buffers: Arc<BufferManager>,
    /// The owner's stats port.
    to: PortId,
    /// The totals last sent.
    last: ProcStats,
}

impl StatsReport {
    /// Sends the totals if they changed since the last report; never
    /// waits (a full send buffer skips this report: the next one carries
    /// the totals).
    fn send(&mut self, endpoint: &Endpoint, me: &ActorId) {
        let now = ProcStats {
            control: endpoint.traffic(),
            payload: self.buffers.traffic(),
        };
        if now == self.last {
            return;
        }
        match endpoint.try_send(me, &self.to, regent_net::Generation(0), now) {
            Ok(()) => self.last = now,
            Err(e) => tracing::debug!(error = %e.failure, "a stats report was not sent"),
        }
    }
}

/// Serves this proc until its owner tells it to exit, its owner's lease
/// lapses, its endpoint closes, or a member cannot be stopped. `ready` runs
/// once the proc's ports are open (it tells the host agent the proc is
/// ready).
pub async fn serve<R>(setup: ProcSetup, ready: R) -> Result<ProcExit, ProcError>
where
    R: Future<Output = Result<(), String>>,
{
    let ProcSetup {
        endpoint,
        owner,
        owner_lease,
        owner_key,
        buffers,
        member_threads,
        seed,
        lease_clock,
    } = setup;
    // A lease from the boot is bounded (the host agent caps it too): the
    // deadline arithmetic below never overflows.
    let owner_lease = owner_lease.min(MAX_OWNER_LEASE);
    let me = proc_actor(&endpoint)?;
    let mut commands = endpoint.open_port(me.port(names::COMMAND_PORT))?;
    let mut replies = endpoint.open_port(me.port(names::REPLY_PORT))?;
    let fabric = Arc::new(NetFabric::new(endpoint.clone(), me).member_threads(member_threads));
    let pending = Arc::new(Pending::default());
    let dispatcher = {
        let pending = pending.clone();
        tokio::spawn(async move {
            while let Some(delivery) = replies.recv().await {
                let sender = delivery.sender.proc.clone();
                match delivery.decode::<ProcReply>() {
                    Ok(r) => pending.resolve(r.call, r.body, &sender),
                    Err(e) => tracing::warn!(error = %e, "undecodable reply dropped"),
                }
            }
        })
    };
    // What this proc has moved, told to its owner at each renewal.
    let owner_stats = ActorId {
        proc: owner.clone(),
        name: regent_net::ActorName::new(names::CONTROLLER)?,
        index: 0,
    }
    .port(names::STATS_PORT);
    let mut stats = buffers.clone().map(|buffers| StatsReport {
        buffers,
        to: owner_stats,
        last: ProcStats::default(),
    });
    let mut rt = ProcRuntime::start(
        fabric.clone(),
        pending,
        Some(endpoint.clone()),
        buffers,
        crate::registry::actor_type,
        Entropy::from_seed(seed),
    );
    rt.trust(owner_key);
    ready.await.map_err(ProcError::Ready)?;
    tracing::info!(proc = %endpoint.proc(), "proc ready");
    // The owner's lease from now, published to the watchdog's clock.
    let renewed = || {
        let lease = tokio::time::Instant::now() + owner_lease;
        if let Some(clock) = &lease_clock {
            clock.set(lease.into_std());
        }
        lease
    };
    let mut lease = renewed();
    let exit = loop {
        let delivery = tokio::select! {
            // Commands before a stuck member's report; the lease is checked
            // below for each command as well.
            biased;
            d = commands.recv() => d,
            (mesh, rank) = rt.stuck() => break ProcExit::MemberStuck { mesh, rank },
            () = tokio::time::sleep_until(lease) => break ProcExit::LeaseLapsed,
        };
        let Some(delivery) = delivery else {
            break ProcExit::EndpointClosed;
        };
        // A lapsed lease is final: nothing is acted on after it, whoever
        // sent it. A proc resumed after a pause past its lease finds what
        // came meanwhile (a renewal its owner sent before giving up on it,
        // a cast of its own members to their old peers) ready together with
        // the lapse, in either order; and a stream of other procs' casts
        // keeps this branch ready and must not hide a lapse.
        if tokio::time::Instant::now() >= lease {
            break ProcExit::LeaseLapsed;
        }
        let sender = delivery.sender.proc.clone();
        // The owner is the controller named in the boot, with a controller's
        // certificate: a proc's certificate never commands a proc.
        let from_owner = sender == owner && delivery.sender_role == regent_net::Role::Controller;
        let cmd = match delivery.decode::<ProcCommand>() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(from = %sender, error = %e, "undecodable command dropped");
                continue;
            }
        };
        if from_owner {
            // Any command from the owner shows it is alive.
            lease = renewed();
            if matches!(cmd, ProcCommand::Renew | ProcCommand::Exit)
                && let Some(stats) = &mut stats
            {
                stats.send(&endpoint, &fabric.me);
            }
        }
        if let Some(exit) = rt.handle(cmd, from_owner, &sender) {
            break exit;
        }
        if let Some(renewal) = rt.take_owner_heard() {
            // A command the owner signed, relayed by another proc: the
            // owner is alive.
            lease = renewed();
            if renewal && let Some(stats) = &mut stats {
                stats.send(&endpoint, &fabric.me);
            }
        }
    };
    if let Some(clock) = &lease_clock {
        clock.disarm();
    }
    tracing::info!(proc = %endpoint.proc(), ?exit, "proc stops");
    if !matches!(exit, ProcExit::MemberStuck { .. }) {
        rt.shutdown().await;
    }
    dispatcher.abort();
    endpoint.close();
    Ok(exit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock is public: any lease makes a clock, a huge one never
    /// lapses (no `Instant` overflow), and a renewal moves the deadline.
    #[test]
    fn a_lease_clock_takes_any_lease_and_follows_renewals() {
        let before = std::time::Instant::now();
        let clock = LeaseClock::new(Duration::from_secs(3));
        let deadline = clock.deadline().expect("armed");
        assert!(deadline >= before + Duration::from_millis(2999));
        assert!(deadline <= std::time::Instant::now() + Duration::from_secs(3));
        let huge = LeaseClock::new(Duration::MAX);
        assert!(
            huge.deadline()
                .is_none_or(|d| d > before + Duration::from_secs(365 * 24 * 3600)),
            "a huge lease lapses"
        );
        clock.set(before + Duration::from_secs(60));
        let moved = clock.deadline().expect("armed");
        assert!(moved > deadline + Duration::from_secs(50), "{moved:?}");
        clock.disarm();
        assert_eq!(clock.deadline(), None);
    }
}
