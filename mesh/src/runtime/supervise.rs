//! The supervisor of one mesh, in the controller: it turns every report
//! about the mesh — a member's exit from its proc, a proc's exit or host loss
//! from the allocator, a silent link from the control plane, an escalation
//! from a mesh this one owns — into one [`MeshFailure`], tells the
//! survivors' procs at once, asks the owner (its hooks, or the owning
//! member) and the [`MeshMachine`] what to do, and does it: respawn members
//! (on the proc mesh's replacement procs where theirs are gone) or the whole
//! mesh in a new generation, stop, or escalate.
//!
//! The supervisor is itself supervised: if its task panics, the mesh is
//! stopped and the failure escalates like any other.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;
use regent_net::{Generation, ProcId};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use super::mesh::{FailureHook, MeshShared, SpawnOptions, SuperviseHook};
use super::procs::{MeshSpec, ProcSlots, relay_to, spawn_mesh, spawn_on, spawned};
use super::{MeshError, Runtime};
use crate::alloc::ProcEvent;
use crate::policy::{FailureCause, MeshAction, MeshEvent, MeshFailure, MeshMachine, MeshStatus};
use crate::protocol::{
    MemberExited, MeshChange, MeshId, MeshInfo, ProcCommand, ReplyBody, Restart, SpawnChild,
};
use crate::relay::RelayBody;
use crate::shape::Rank;

/// The bound on queued failure observations per mesh.
const FAILURES: usize = 256;
/// How long the owning member may take to decide about a failure.
const SUPERVISE_WAIT: Duration = Duration::from_secs(10);

/// What reaches a mesh's supervisor.
#[derive(Debug)]
pub(crate) enum Signal {
    /// A member exited on its own (from its proc).
    Member(MemberExited),
    /// A proc exited or a host was lost (from an allocator).
    Proc(ProcEvent),
    /// A proc's link went silent (from the control plane).
    Link {
        /// The proc.
        proc: ProcId,
        /// What the control plane saw.
        detail: String,
    },
    /// A mesh owned by member `rank` of this one escalated.
    Escalated {
        /// The owning member.
        rank: Rank,
        /// The owned mesh's failure.
        failure: MeshFailure,
    },
    /// A member of this mesh asks for a mesh it will own.
    SpawnChild(SpawnChild),
    /// The job is stopping: stop.
    Stop,
    /// The owner asked to stop; answer when done.
    StopRequested(oneshot::Sender<()>),
}

pub(crate) struct Setup {
    pub(crate) rt: Runtime,
    pub(crate) info: MeshInfo,
    pub(crate) args: Bytes,
    pub(crate) slots: Arc<ProcSlots>,
    pub(crate) options: SpawnOptions,
}

struct Supervisor {
    rt: Runtime,
    shared: Arc<MeshShared>,
    machine: MeshMachine,
    args: Bytes,
    slots: Arc<ProcSlots>,
    hook: Option<FailureHook>,
    supervise: Option<SuperviseHook>,
    owner: Option<(MeshId, Rank)>,
    rx: mpsc::Receiver<Signal>,
    /// Signals taken from `rx` during a restart that are not failures (stop
    /// requests, spawn requests): handled once the restart is over.
    backlog: std::collections::VecDeque<Signal>,
    /// What each proc knows of the mesh.
    views: Views,
}

/// What each proc of a mesh is known to hold of it, so that a restart
/// sends each only what changed since it last learned the mesh (a
/// [`MeshChange`]); a proc that missed a change (its command failed) is
/// sent the moves it missed with the next one.
struct Views {
    /// By proc rank: the generation whose procs the proc is known to hold
    /// (it answered a command of that generation).
    known: Vec<Generation>,
    /// By proc rank: the generation its proc last changed in.
    moved_at: Vec<Generation>,
}

impl Views {
    fn new(procs: u32, generation: Generation) -> Self {
        Self {
            known: vec![generation; procs as usize],
            moved_at: vec![generation; procs as usize],
        }
    }

    /// Proc rank `rank` got a new proc in `generation`.
    fn moved(&mut self, rank: u32, generation: Generation) {
        if let Some(g) = self.moved_at.get_mut(rank as usize) {
            *g = generation;
        }
    }

    /// What proc rank `rank` needs to hold `info`: the procs moved since
    /// the generation it knows.
    fn change_for(&self, rank: u32, info: &MeshInfo) -> MeshChange {
        let from = self.known_by(rank);
        let moved = self
            .moved_at
            .iter()
            .enumerate()
            .filter(|(_, g)| **g > from)
            .map(|(r, _)| (r as u32, info.procs[r].clone()))
            .collect();
        MeshChange {
            from,
            generation: info.generation,
            moved,
        }
    }

    /// The generation whose procs proc rank `rank` is known to hold: its
    /// change starts there.
    fn known_by(&self, rank: u32) -> Generation {
        self.known.get(rank as usize).copied().unwrap_or_default()
    }

    /// Takes the procs' answers to the commands of a restart into
    /// `generation`: those that succeeded know it. The first error, if any.
    fn answered(
        &mut self,
        answers: impl IntoIterator<Item = (u32, Result<(), MeshError>)>,
        generation: Generation,
    ) -> Result<(), MeshError> {
        let mut first = None;
        for (rank, r) in answers {
            match r {
                Ok(()) => {
                    if let Some(g) = self.known.get_mut(rank as usize) {
                        *g = generation;
                    }
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// The bound of a mesh supervisor's queue: every signal is a report about
/// a member life, a proc, a link or an owned mesh, or a request, so at any
/// time fewer are pending than a few per member and proc.
fn queue_bound(info: &MeshInfo) -> usize {
    4 * (info.members() as usize + info.proc_count() as usize) + 64
}

/// Starts a mesh's supervisor; returns what its references share.
pub(crate) fn start(setup: Setup) -> Arc<MeshShared> {
    let (tx, rx) = mpsc::channel(queue_bound(&setup.info));
    let id = setup.info.id;
    let machine = MeshMachine::new(
        setup.options.policy,
        setup.info.procs.iter().map(|a| a.proc.clone()).collect(),
        setup.info.per_proc,
    );
    let record = super::observe::MeshRecord {
        owner: setup.options.owner.map(|(m, r)| (m.0, r.0)),
        policy: format!("{:?}", setup.options.policy),
        states: vec!["running"; setup.info.members() as usize],
        ..Default::default()
    };
    let shared = Arc::new(MeshShared {
        id,
        record: std::sync::Mutex::new(record),
        observer: setup.rt.observer().clone(),
        info: RwLock::new(Arc::new(setup.info)),
        status: watch::channel(MeshStatus::Running).0,
        failures: broadcast::channel(FAILURES).0,
        supervisor: tx,
        caster: setup.rt.caster().clone(),
        timeout: setup.rt.config().call_timeout,
    });
    setup.rt.register_mesh(shared.clone());
    if let Some((parent, rank)) = setup.options.owner {
        setup.rt.adopt(parent, rank.0, id);
    }
    let s = Supervisor {
        rt: setup.rt.clone(),
        shared: shared.clone(),
        machine,
        args: setup.args,
        slots: setup.slots,
        hook: setup.options.hook,
        supervise: setup.options.supervise,
        owner: setup.options.owner,
        rx,
        backlog: std::collections::VecDeque::new(),
        views: Views::new(shared.info().proc_count(), shared.info().generation),
    };
    let task = tokio::spawn(s.run());
    tokio::spawn(watch_supervisor(
        setup.rt,
        shared.clone(),
        setup.options.owner,
        task,
    ));
    shared
}

/// If a mesh's supervisor task dies (a panic in it or in a hook it runs),
/// the mesh is not left unsupervised: its members are stopped, its status
/// becomes final, and the failure escalates to its owner.
async fn watch_supervisor(
    rt: Runtime,
    shared: Arc<MeshShared>,
    owner: Option<(MeshId, Rank)>,
    task: tokio::task::JoinHandle<()>,
) {
    let Err(e) = task.await else { return };
    let why = if e.is_panic() {
        let payload = e.into_panic();
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a panic without a message".into());
        format!("its supervisor panicked: {message}")
    } else {
        "its supervisor task was cancelled".to_owned()
    };
    let info = shared.info();
    let failure = MeshFailure {
        mesh: info.name.clone(),
        ranks: (0..info.members()).map(Rank).collect(),
        cause: FailureCause::Supervisor(why),
        generation: info.generation,
    };
    tracing::error!(%failure, "mesh supervisor died; stopping the mesh and escalating");
    shared
        .status
        .send_replace(MeshStatus::Escalated(failure.clone()));
    rt.stop_owned(info.id, None).await;
    rt.unregister_mesh(info.id);
    if let Some((parent, rank)) = owner
        && let Some(parent) = rt.mesh_info(parent)
        && let Some(addr) = parent.procs.get((rank.0 / parent.per_proc) as usize)
    {
        rt.tell(&addr.proc, ProcCommand::ChildGone { mesh: info.id })
            .await;
    }
    for addr in info.procs.iter().rev() {
        if rt.is_lost(&addr.proc) {
            continue;
        }
        let reply_to = rt.reply_port();
        let mesh = info.id;
        let _ = rt
            .request(
                &addr.proc,
                |call| ProcCommand::Stop {
                    call,
                    reply_to,
                    mesh,
                },
                &info.name,
            )
            .await;
    }
    escalate(&rt, owner, failure);
}

/// The time the policy machine counts restarts and backoff in: tokio's
/// clock (simulated under a paused runtime), as a std `Instant`.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Passes a failure to the owner's mesh (as a failure of the owning
/// member), or stops the job at the root.
fn escalate(rt: &Runtime, owner: Option<(MeshId, Rank)>, failure: MeshFailure) {
    if let Some((parent, rank)) = owner
        && rt.signal_mesh(
            parent,
            Signal::Escalated {
                rank,
                failure: failure.clone(),
            },
        )
    {
        return;
    }
    rt.fail_job(failure);
}

impl Supervisor {
    /// Updates what snapshots show of the mesh.
    fn record<T>(&self, f: impl FnOnce(&mut super::observe::MeshRecord) -> T) -> T {
        f(&mut self.shared.record.lock().expect("mesh record lock"))
    }

    async fn run(mut self) {
        loop {
            let signal = match self.backlog.pop_front() {
                Some(s) => s,
                None => match self.rx.recv().await {
                    Some(s) => s,
                    None => return,
                },
            };
            match signal {
                Signal::StopRequested(done) => {
                    self.stop_members().await;
                    self.finish(MeshStatus::Stopped(None)).await;
                    let _ = done.send(());
                    return;
                }
                Signal::Stop => {
                    self.stop_members().await;
                    self.finish(MeshStatus::Stopped(self.rt.job_failure()))
                        .await;
                    return;
                }
                Signal::SpawnChild(request) => self.spawn_child(request).await,
                other => {
                    let Some((failure, lost)) = self.failure_of(other) else {
                        continue;
                    };
                    let actions = self.decide(failure, lost).await;
                    if self.perform(actions).await {
                        return;
                    }
                }
            }
        }
    }

    /// Decides on every failure reported while a restart was going on (a
    /// proc may have been lost meanwhile: its report is queued before the
    /// runtime marks it lost, so it is here), so that each is published,
    /// asked of the owner and counted, and the next restart replaces what
    /// was lost; other signals wait for the restart to be over.
    async fn take_reports(&mut self) -> Vec<MeshAction> {
        let mut actions = Vec::new();
        while let Ok(signal) = self.rx.try_recv() {
            match signal {
                s @ (Signal::StopRequested(_) | Signal::Stop | Signal::SpawnChild(_)) => {
                    self.backlog.push_back(s)
                }
                other => {
                    if let Some((failure, lost)) = self.failure_of(other) {
                        actions.extend(self.decide(failure, lost).await);
                    }
                }
            }
        }
        actions
    }

    /// Performs actions (and those their outcomes lead to); returns whether
    /// the mesh is done.
    async fn perform(&mut self, mut actions: Vec<MeshAction>) -> bool {
        while !actions.is_empty() {
            let action = actions.remove(0);
            match action {
                MeshAction::RestartMembers {
                    ranks,
                    replace,
                    generation,
                    delay,
                    sources,
                    cause,
                } => {
                    self.shared.status.send_replace(MeshStatus::Restarting);
                    self.record(|r| r.restarting(&ranks.iter().map(|r| r.0).collect::<Vec<_>>()));
                    // The meshes the failed members owned go with them.
                    self.rt.stop_owned(self.shared.id, Some(&ranks)).await;
                    back_off(delay).await;
                    let restart = Restart {
                        generation,
                        ranks: ranks.iter().map(|r| r.0).collect(),
                        cause,
                        sources: sources.iter().map(|(a, b)| (a.0, b.0)).collect(),
                    };
                    let r = self.restart_members(&replace, restart).await;
                    // Reports first: a restart that failed because a proc
                    // was lost meanwhile is followed by one that replaces it.
                    actions.extend(self.take_reports().await);
                    self.after_restart(r, ranks, generation, &mut actions).await;
                }
                MeshAction::RestartMesh {
                    replace,
                    generation,
                    delay,
                    cause,
                } => {
                    self.shared.status.send_replace(MeshStatus::Restarting);
                    let all: Vec<u32> = (0..self.shared.info().members()).collect();
                    self.record(|r| r.restarting(&all));
                    self.rt.stop_owned(self.shared.id, None).await;
                    self.stop_members().await;
                    back_off(delay).await;
                    let all: Vec<Rank> = (0..self.shared.info().members()).map(Rank).collect();
                    let restart = Restart {
                        generation,
                        ranks: all.iter().map(|r| r.0).collect(),
                        cause,
                        sources: Vec::new(),
                    };
                    let r = self.restart_mesh(&replace, restart).await;
                    actions.extend(self.take_reports().await);
                    self.after_restart(r, all, generation, &mut actions).await;
                }
                MeshAction::Stop { failure } => {
                    self.stop_members().await;
                    self.finish(MeshStatus::Stopped(Some(failure))).await;
                    return true;
                }
                MeshAction::Escalate { failure, exhausted } => {
                    tracing::error!(%failure, exhausted, "mesh escalates");
                    self.stop_members().await;
                    self.finish(MeshStatus::Escalated(failure.clone())).await;
                    escalate(&self.rt, self.owner, failure);
                    return true;
                }
            }
        }
        false
    }

    /// Ends a restart, and starts replacing the warm spares it took; a
    /// failed one is reported (to observers, the owner and the machine) as
    /// a start failure of the restarted ranks in the new generation.
    async fn after_restart(
        &mut self,
        r: Result<(), MeshError>,
        ranks: Vec<Rank>,
        generation: Generation,
        actions: &mut Vec<MeshAction>,
    ) {
        let now = now();
        let procs: Vec<ProcId> = self
            .shared
            .info()
            .procs
            .iter()
            .map(|a| a.proc.clone())
            .collect();
        match r {
            Ok(()) => {
                self.shared.status.send_replace(MeshStatus::Running);
                self.slots.restart_ended();
                let at = self.rt.elapsed_ms();
                let ranks: Vec<u32> = ranks.iter().map(|r| r.0).collect();
                let after = self.record(|r| r.recovered(&ranks, at));
                let name = self.shared.info().name.clone();
                self.shared
                    .observer
                    .recovered(&name, ranks, generation.0, after, at);
                self.tell_owner(false).await;
                let event = MeshEvent::Restarted {
                    result: Ok(()),
                    procs,
                };
                actions.extend(self.machine.handle(now, event));
            }
            Err(e) => {
                self.slots.restart_ended();
                let message = e.to_string();
                tracing::warn!(mesh = %self.shared.info().name, error = %message, "restart failed");
                let event = MeshEvent::Restarted {
                    result: Err(message.clone()),
                    procs,
                };
                actions.extend(self.machine.handle(now, event));
                let failure = MeshFailure {
                    mesh: self.shared.info().name.clone(),
                    ranks,
                    cause: FailureCause::StartFailed(message),
                    generation,
                };
                actions.extend(self.decide(failure, Vec::new()).await);
            }
        }
    }

    /// Publishes a failure, tells the survivors' procs, asks the owner, and
    /// asks the machine.
    async fn decide(&mut self, failure: MeshFailure, lost: Vec<(u32, ProcId)>) -> Vec<MeshAction> {
        tracing::warn!(%failure, "mesh failure");
        let at = self.rt.elapsed_ms();
        self.record(|r| r.failed(&failure, at));
        self.shared.observer.failure(&failure, at);
        let _ = self.shared.failures.send(failure.clone());
        self.tell_failed(&failure, &lost);
        let mut decision = self.hook.as_ref().and_then(|h| h(&failure));
        if decision.is_none()
            && let Some(supervise) = &self.supervise
        {
            // Bounded like the owning member's answer: a hook that does not
            // decide in time leaves the policy's decision.
            match tokio::time::timeout(SUPERVISE_WAIT, supervise(failure.clone())).await {
                Ok(d) => decision = d,
                Err(_) => {
                    tracing::warn!(mesh = %failure.mesh, "the supervise hook did not decide within {SUPERVISE_WAIT:?}; the policy decides")
                }
            }
        }
        if decision.is_none() {
            decision = self.ask_owner(&failure).await;
        }
        let event = MeshEvent::Failed {
            failure,
            lost,
            decision,
        };
        self.machine.handle(now(), event)
    }

    /// Tells every live proc of the mesh (and the owning member's proc)
    /// about a failure at once, so that work with the failed ranks ends and
    /// casts route around a lost proc. Not awaited.
    fn tell_failed(&self, failure: &MeshFailure, lost: &[(u32, ProcId)]) {
        let info = self.shared.info();
        let lost_procs: Vec<ProcId> = lost.iter().map(|(_, p)| p.clone()).collect();
        let mut to: Vec<ProcId> = info
            .procs
            .iter()
            .map(|a| a.proc.clone())
            .filter(|p| !self.rt.is_lost(p) && !lost_procs.contains(p))
            .collect();
        if let Some(owner) = self.owner_proc() {
            to.push(owner);
        }
        to.sort();
        to.dedup();
        let rt = self.rt.clone();
        let cmd = ProcCommand::Failed {
            mesh: info.id,
            failure: failure.clone(),
            lost: lost_procs,
        };
        tokio::spawn(async move {
            join_all(to.iter().map(|p| rt.tell(p, cmd.clone()))).await;
        });
    }

    /// The proc of the member that owns this mesh, if a member does.
    fn owner_proc(&self) -> Option<ProcId> {
        let (parent, rank) = self.owner?;
        let parent = self.rt.mesh_info(parent)?;
        parent
            .procs
            .get((rank.0 / parent.per_proc) as usize)
            .map(|a| a.proc.clone())
    }

    /// Asks the member that owns this mesh (if one does) what to do.
    async fn ask_owner(&self, failure: &MeshFailure) -> Option<Decision> {
        let (parent, rank) = self.owner?;
        let proc = self.owner_proc()?;
        let reply_to = self.rt.reply_port();
        let ask = self.rt.request(
            &proc,
            |call| ProcCommand::Supervise {
                call,
                reply_to,
                owner: parent,
                rank: rank.0,
                failure: failure.clone(),
            },
            "asking the owning member",
        );
        match tokio::time::timeout(SUPERVISE_WAIT, ask).await {
            Ok(Ok(ReplyBody::Decided(d))) => d,
            _ => None,
        }
    }

    /// Ends the mesh: what it owns stops first, then its status is final
    /// and its owner member's proc learns it is gone.
    async fn finish(&self, status: MeshStatus) {
        let detail = match &status {
            MeshStatus::Stopped(None) => "stopped".to_owned(),
            MeshStatus::Stopped(Some(f)) => format!("stopped after {f}"),
            MeshStatus::Escalated(f) => format!("escalated {f}"),
            MeshStatus::Running | MeshStatus::Restarting => String::new(),
        };
        let info = self.shared.info();
        self.shared
            .observer
            .stopped(&info.name, detail, info.generation.0, self.rt.elapsed_ms());
        self.rt.stop_owned(self.shared.id, None).await;
        self.shared.status.send_replace(status);
        self.rt.unregister_mesh(self.shared.id);
        self.tell_owner(true).await;
    }

    /// Tells the proc of the member that owns this mesh (if a member does)
    /// about its new generation, or that it is gone.
    async fn tell_owner(&self, gone: bool) {
        let Some(proc) = self.owner_proc() else {
            return;
        };
        let info = self.shared.info();
        let cmd = if gone {
            ProcCommand::ChildGone { mesh: info.id }
        } else {
            ProcCommand::ChildInfo {
                info: (*info).clone(),
            }
        };
        self.rt.tell(&proc, cmd).await;
    }

    /// Spawns a mesh owned by one of this mesh's members, on this mesh's
    /// procs, and answers the member's proc.
    async fn spawn_child(&mut self, request: SpawnChild) {
        let info = self.shared.info();
        let current = self.machine.rank_generation(Rank(request.rank));
        let result = if request.rank >= info.members() {
            Err(format!(
                "no member of rank {} in {}",
                request.rank, info.name
            ))
        } else if current != Some(request.born) {
            // Its life was replaced (or a zombie asks): the restart that
            // replaced it stopped what it owned, and nothing would stop
            // this one.
            Err(format!(
                "rank {} of {} asked in a life of generation {} that a restart replaced (its life now began in {})",
                request.rank,
                info.name,
                request.born.0,
                current.map_or(0, |g| g.0)
            ))
        } else {
            let dims: Vec<(String, usize)> = info
                .shape
                .dims()
                .take(info.shape.ndim().saturating_sub(1))
                .map(|(n, s)| (n.as_str().to_owned(), s))
                .collect();
            let spec = MeshSpec {
                name: &request.name,
                actor_type: &request.actor_type,
                per_proc: request.per_proc,
                args: request.args.clone(),
                dims,
                options: SpawnOptions {
                    policy: request.policy.into(),
                    hook: None,
                    supervise: None,
                    owner: Some((info.id, Rank(request.rank))),
                },
            };
            match spawn_mesh(&self.rt, &self.slots, &info.procs, spec).await {
                Ok(child) => Ok((*child.info()).clone()),
                Err(e) => Err(e.to_string()),
            }
        };
        if let Err(e) = &result {
            tracing::warn!(mesh = %info.name, rank = request.rank, error = %e, "a member's mesh did not spawn");
        }
        self.rt
            .answer(
                request.reply_to,
                request.call,
                ReplyBody::ChildSpawned(result),
            )
            .await;
    }

    /// The proc rank of `proc` in the current generation, if it is ours.
    fn proc_rank(&self, info: &MeshInfo, proc: &ProcId) -> Option<u32> {
        info.proc_rank(proc)
    }

    /// A proc of this mesh is gone: no lease, in-flight calls through it
    /// fail now; the failure of all its members.
    fn proc_failure(
        &mut self,
        info: &MeshInfo,
        proc: &ProcId,
        cause: FailureCause,
    ) -> Option<(MeshFailure, Vec<(u32, ProcId)>)> {
        let rank = self.proc_rank(info, proc)?;
        self.rt.abandon(proc);
        self.rt
            .pending()
            .lose_proc(info.id, rank, &cause.to_string());
        let first = rank * info.per_proc;
        let failure = MeshFailure {
            mesh: info.name.clone(),
            ranks: (first..first + info.per_proc).map(Rank).collect(),
            cause,
            // The proc was alive in the current generation: every life on it
            // is current.
            generation: info.generation,
        };
        Some((failure, vec![(rank, proc.clone())]))
    }

    fn failure_of(&mut self, signal: Signal) -> Option<(MeshFailure, Vec<(u32, ProcId)>)> {
        let info = self.shared.info();
        match signal {
            Signal::Member(e)
                if e.mesh == info.id
                    && crate::bugs::planted(crate::bugs::PlantedBug::DropMemberExit) =>
            {
                let _ = e;
                None
            }
            Signal::Member(e) if e.mesh == info.id => Some((
                MeshFailure {
                    mesh: info.name.clone(),
                    ranks: vec![Rank(e.rank)],
                    cause: e.cause,
                    generation: e.generation,
                },
                Vec::new(),
            )),
            Signal::Member(_) => None,
            Signal::Proc(ProcEvent::Exited {
                proc,
                status,
                last_lines,
            }) => self.proc_failure(
                &info,
                &proc,
                FailureCause::ProcExited {
                    proc: proc.clone(),
                    status,
                    last_lines,
                },
            ),
            Signal::Proc(ProcEvent::HostLost { host, procs }) => {
                // One failure for all the host's procs: one restart replaces
                // them all.
                let mut all: Option<(MeshFailure, Vec<(u32, ProcId)>)> = None;
                for proc in procs {
                    let cause = FailureCause::HostLost {
                        host: host.clone(),
                        proc: proc.clone(),
                    };
                    if let Some((f, lost)) = self.proc_failure(&info, &proc, cause) {
                        match &mut all {
                            Some((first, all_lost)) => {
                                first.ranks.extend(f.ranks);
                                all_lost.extend(lost);
                            }
                            None => all = Some((f, lost)),
                        }
                    }
                }
                all
            }
            Signal::Link { proc, detail } => {
                let cause = FailureCause::LinkFailed {
                    proc: proc.clone(),
                    detail,
                };
                self.proc_failure(&info, &proc, cause)
            }
            Signal::Escalated { rank, failure } => Some((
                MeshFailure {
                    mesh: info.name.clone(),
                    ranks: vec![rank],
                    cause: FailureCause::Escalated(Box::new(failure)),
                    generation: info.generation,
                },
                Vec::new(),
            )),
            Signal::Stop | Signal::StopRequested(_) | Signal::SpawnChild(_) => None,
        }
    }

    /// Puts fresh procs (from the proc mesh's slots) in `info` for the proc
    /// ranks in `replace`; returns those ranks.
    async fn replace(
        &self,
        info: &mut MeshInfo,
        replace: &[u32],
    ) -> Result<BTreeSet<u32>, MeshError> {
        // Ordered: the fresh procs' spawns go out in rank order.
        let mut fresh = BTreeSet::new();
        for &p in replace {
            let Some(dead) = info.procs.get(p as usize).map(|a| a.proc.clone()) else {
                continue;
            };
            let proc = self.slots.replace(p, &dead).await?;
            info.procs[p as usize] = proc.addr.clone();
            fresh.insert(p);
        }
        Ok(fresh)
    }

    /// Respawns the restarted ranks in the new generation, on fresh procs
    /// where theirs are gone, and enrolls every other member in it (telling
    /// the survivors what changed).
    async fn restart_members(
        &mut self,
        replace: &[u32],
        restart: Restart,
    ) -> Result<(), MeshError> {
        let mut info = (*self.shared.info()).clone();
        info.generation = restart.generation;
        let fresh = self.replace(&mut info, replace).await?;
        for &rank in &fresh {
            self.views.moved(rank, info.generation);
        }
        // Procs that host the mesh learn what changed since they last
        // learned it (`Views::change_for`), not every proc again.
        let views = &self.views;
        let mut by_proc: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for &r in &restart.ranks {
            by_proc.entry(r / info.per_proc).or_default().push(r);
        }
        let rt = &self.rt;
        let args = &self.args;
        let info_ref = &info;
        let restart_ref = &restart;
        // New procs get all their members; live procs respawn their failed
        // ranks; every other proc enrolls in the new generation — first, so
        // that a restarted member that reaches its heal source from `new`
        // finds it in the new generation (sources are survivors: on procs
        // that only enroll, or on the respawning proc itself, which is in
        // the new generation from its command on), and survivors are told
        // before the restarted members start.
        let spawns = fresh.iter().map(|&rank| {
            let proc = info_ref.procs[rank as usize].proc.clone();
            async move {
                let r = spawn_on(rt, info_ref, rank, &proc, args, Some(restart_ref)).await;
                (rank, r)
            }
        });
        // Procs that only enroll get the change down a tree, one relay per
        // distinct change. A proc's change follows from the generation it
        // knows: all share one unless some missed a change before.
        let mut enrolls: BTreeMap<Generation, Vec<u32>> = BTreeMap::new();
        let mut respawns = Vec::new();
        for (rank, addr) in info.procs.iter().enumerate() {
            let rank = rank as u32;
            if fresh.contains(&rank) {
                continue;
            }
            let Some(ranks) = by_proc.get(&rank).cloned() else {
                enrolls.entry(views.known_by(rank)).or_default().push(rank);
                continue;
            };
            let change = views.change_for(rank, info_ref);
            let proc = addr.proc.clone();
            respawns.push(async move {
                let reply_to = rt.reply_port();
                let body = rt
                    .request(
                        &proc,
                        |call| ProcCommand::Respawn {
                            call,
                            reply_to,
                            mesh: info_ref.id,
                            change,
                            ranks,
                            args: args.clone(),
                            restart: restart_ref.clone(),
                        },
                        &info_ref.name,
                    )
                    .await;
                (rank, body.and_then(|body| spawned(body, info_ref, &proc)))
            });
        }
        let enrolls = enrolls.into_values().map(|ranks| {
            let body = RelayBody::Update {
                mesh: info_ref.id,
                change: views.change_for(ranks[0], info_ref),
                restart: Some(restart_ref.clone()),
            };
            async move { relay_to(rt, info_ref, &ranks, body).await }
        });
        let enrolled: Vec<_> = join_all(enrolls).await.into_iter().flatten().collect();
        let (a, b) = futures::join!(join_all(spawns), join_all(respawns));
        let generation = info.generation;
        *self.shared.info.write().expect("mesh info lock") = Arc::new(info);
        self.views
            .answered(enrolled.into_iter().chain(a).chain(b), generation)
    }

    /// Respawns every member in the new generation (they were stopped), on
    /// fresh procs where theirs are gone.
    async fn restart_mesh(&mut self, replace: &[u32], restart: Restart) -> Result<(), MeshError> {
        let mut info = (*self.shared.info()).clone();
        info.generation = restart.generation;
        self.replace(&mut info, replace).await?;
        let every: Vec<u32> = (0..info.proc_count()).collect();
        let body = RelayBody::Spawn {
            info: Box::new(info.clone()),
            args: self.args.clone(),
            start: Some(restart),
        };
        let results = relay_to(&self.rt, &info, &every, body).await;
        let generation = info.generation;
        for rank in 0..info.proc_count() {
            self.views.moved(rank, generation);
        }
        *self.shared.info.write().expect("mesh info lock") = Arc::new(info);
        self.views.answered(results, generation)
    }

    /// Stops every member on every live proc, last proc first (each proc
    /// stops its members last rank first).
    async fn stop_members(&self) {
        let info = self.shared.info();
        for addr in info.procs.iter().rev() {
            if self.rt.is_lost(&addr.proc) {
                continue;
            }
            let reply_to = self.rt.reply_port();
            let mesh = info.id;
            if let Err(e) = self
                .rt
                .request(
                    &addr.proc,
                    |call| ProcCommand::Stop {
                        call,
                        reply_to,
                        mesh,
                    },
                    &info.name,
                )
                .await
            {
                tracing::warn!(mesh = %info.name, proc = %addr.proc, error = %e, "stopping members");
            }
        }
    }
}

use crate::policy::Decision;

/// Waits out a restart's backoff; none without one (a zero sleep still
/// waits for the timer's next tick, up to a millisecond).
async fn back_off(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod views_tests {
    use std::net::SocketAddr;

    use proptest::prelude::*;
    use regent_net::{ProcAddr, ProcId};

    use super::*;
    use crate::protocol::CastToken;

    fn addr(rank: usize, generation: u64) -> ProcAddr {
        ProcAddr {
            socket: SocketAddr::from(([127, 0, 0, 1], 1000 + rank as u16)),
            proc: ProcId::new(&format!("p{rank}-{generation}")).unwrap(),
        }
    }

    fn info(procs: usize) -> MeshInfo {
        MeshInfo {
            id: MeshId(1),
            name: "m".into(),
            actor_type: "t".into(),
            shape: crate::shape::Shape::new([("procs", procs), ("actors", 1)]).unwrap(),
            per_proc: 1,
            procs: (0..procs).map(|r| addr(r, 0)).collect(),
            fanout: crate::tree::DEFAULT_FANOUT,
            owner: regent_net::PortId {
                actor: regent_net::ActorId {
                    proc: ProcId::new("ctl").unwrap(),
                    name: regent_net::ActorName::new("c").unwrap(),
                    index: 0,
                },
                port: 0,
            },
            generation: Generation(0),
            token: CastToken(1),
        }
    }

    proptest! {
        /// Restarts replace random procs, and random commands to the
        /// others fail: every proc that takes its change ends up with
        /// exactly the controller's mesh, whatever it missed before.
        #[test]
        fn every_proc_that_takes_its_change_holds_the_controllers_mesh(
            procs in 1usize..8,
            rounds in proptest::collection::vec((any::<u8>(), any::<u8>()), 1..12),
        ) {
            let mut now = info(procs);
            let mut held: Vec<MeshInfo> = vec![now.clone(); procs];
            let mut views = Views::new(procs as u32, Generation(0));
            for (round, (replaced, failing)) in rounds.into_iter().enumerate() {
                let g = round as u64 + 1;
                let mut next = now.clone();
                next.generation = Generation(g);
                for r in (0..procs).filter(|r| replaced & (1 << r) != 0) {
                    next.procs[r] = addr(r, g);
                    views.moved(r as u32, next.generation);
                }
                let mut answers = Vec::new();
                for (r, held) in held.iter_mut().enumerate() {
                    if replaced & (1 << r) != 0 {
                        // A fresh proc is spawned with the whole mesh.
                        *held = next.clone();
                        answers.push((r as u32, Ok(())));
                    } else if failing & (1 << r) != 0 {
                        answers.push((r as u32, Err(MeshError::Encode("lost".into()))));
                    } else {
                        let change = views.change_for(r as u32, &next);
                        let applied = change.apply(held);
                        prop_assert!(applied.is_ok(), "rank {r}: {applied:?}");
                        *held = applied.unwrap();
                        prop_assert_eq!(&held.procs, &next.procs, "rank {}", r);
                        prop_assert_eq!(held.generation, next.generation);
                        answers.push((r as u32, Ok(())));
                    }
                }
                let _ = views.answered(answers, next.generation);
                now = next;
            }
        }
    }

    #[test]
    fn a_change_is_sent_only_with_what_moved_and_refused_by_a_proc_that_lacks_its_start() {
        let mut views = Views::new(3, Generation(0));
        let mut next = info(3);
        next.generation = Generation(1);
        next.procs[2] = addr(2, 1);
        views.moved(2, Generation(1));
        let change = views.change_for(0, &next);
        assert_eq!(change.moved, vec![(2, addr(2, 1))]);
        assert_eq!(change.from, Generation(0));
        // Rank 1 missed generation 1; rank 0 took it.
        let _ = views.answered(
            [(0, Ok(())), (1, Err(MeshError::Encode("lost".into())))],
            Generation(1),
        );
        let mut later = next.clone();
        later.generation = Generation(2);
        assert!(views.change_for(0, &later).moved.is_empty());
        let missed = views.change_for(1, &later);
        assert_eq!(missed.moved, vec![(2, addr(2, 1))]);
        // A change that starts after what a proc knows is refused, as is
        // one older than it.
        let behind = info(3);
        let ahead = MeshChange {
            from: Generation(1),
            generation: Generation(2),
            moved: Vec::new(),
        };
        assert!(ahead.apply(&behind).is_err());
        let older = MeshChange {
            from: Generation(0),
            generation: Generation(1),
            moved: Vec::new(),
        };
        assert!(older.apply(&later).is_err());
        let outside = MeshChange {
            from: Generation(0),
            generation: Generation(1),
            moved: vec![(3, addr(3, 1))],
        };
        assert!(outside.apply(&behind).is_err());
    }
}
