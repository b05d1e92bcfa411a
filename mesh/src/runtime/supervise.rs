//! The supervisor of one mesh, in the controller: it turns every report
//! about the mesh — a member's exit from its proc, a proc's exit or host loss
//! from the allocator, a silent link from the control plane, an escalation
//! from a mesh this one owns — into one [`MeshFailure`], asks the owner's hook
//! and the [`MeshMachine`] what to do, and does it: respawn members (on fresh
//! procs when theirs are gone) or the whole mesh in a new generation, stop,
//! or escalate.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use bytes::Bytes;
use futures::future::join_all;
use regent_net::{Generation, ProcId};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use super::mesh::{FailureHook, MeshShared, MeshStatus, SpawnOptions};
use super::procs::{MeshSpec, spawn_mesh, spawn_on, spawned};
use super::{MeshError, Runtime};
use crate::alloc::{AllocatedProc, Allocator, ProcEvent};
use crate::policy::{FailureCause, MeshAction, MeshEvent, MeshFailure, MeshMachine};
use crate::protocol::{MemberExited, MeshId, MeshInfo, ProcCommand, ReplyBody, SpawnChild};
use crate::shape::Rank;

/// The bound on queued failure observations per mesh.
const FAILURES: usize = 256;

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
    pub(crate) allocator: Arc<dyn Allocator>,
    pub(crate) procs: Arc<Mutex<Vec<AllocatedProc>>>,
    pub(crate) options: SpawnOptions,
}

struct Supervisor {
    rt: Runtime,
    shared: Arc<MeshShared>,
    machine: MeshMachine,
    args: Bytes,
    allocator: Arc<dyn Allocator>,
    procs: Arc<Mutex<Vec<AllocatedProc>>>,
    hook: Option<FailureHook>,
    owner: Option<(MeshId, Rank)>,
    /// Procs of this mesh known to be gone (or unreachable).
    dead: HashSet<ProcId>,
    rx: mpsc::UnboundedReceiver<Signal>,
    /// Signals taken from `rx` during a restart that are not failures (stop
    /// requests, spawn requests): handled once the restart is over.
    backlog: std::collections::VecDeque<Signal>,
}

/// Starts a mesh's supervisor; returns what its references share.
pub(crate) fn start(setup: Setup) -> Arc<MeshShared> {
    let (tx, rx) = mpsc::unbounded_channel();
    let id = setup.info.id;
    let members = setup.info.shape.len();
    let machine = MeshMachine::new(setup.info.name.clone(), setup.options.policy, members);
    let shared = Arc::new(MeshShared {
        id,
        info: RwLock::new(Arc::new(setup.info)),
        status: watch::channel(MeshStatus::Running).0,
        failures: broadcast::channel(FAILURES).0,
        supervisor: tx,
    });
    setup.rt.register_mesh(shared.clone());
    if let Some((parent, rank)) = setup.options.owner {
        setup.rt.adopt(parent, rank.0, id);
    }
    let s = Supervisor {
        rt: setup.rt,
        shared: shared.clone(),
        machine,
        args: setup.args,
        allocator: setup.allocator,
        procs: setup.procs,
        hook: setup.options.hook,
        owner: setup.options.owner,
        dead: HashSet::new(),
        rx,
        backlog: std::collections::VecDeque::new(),
    };
    tokio::spawn(s.run());
    shared
}

impl Supervisor {
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
                    let Some(failure) = self.failure_of(other) else {
                        continue;
                    };
                    let actions = self.decide(failure);
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
    /// asked of the hook and counted, and the next restart replaces what was
    /// lost; other signals wait for the restart to be over.
    fn take_reports(&mut self) -> Vec<MeshAction> {
        let mut actions = Vec::new();
        while let Ok(signal) = self.rx.try_recv() {
            match signal {
                s @ (Signal::StopRequested(_) | Signal::Stop | Signal::SpawnChild(_)) => {
                    self.backlog.push_back(s)
                }
                other => {
                    if let Some(failure) = self.failure_of(other) {
                        actions.extend(self.decide(failure));
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
                    generation,
                    delay,
                    ..
                } => {
                    self.shared.status.send_replace(MeshStatus::Restarting);
                    // The meshes the failed members owned go with them.
                    let owners: Vec<u32> = ranks.iter().map(|r| r.0).collect();
                    self.rt.stop_owned(self.shared.id, Some(&owners)).await;
                    tokio::time::sleep(delay).await;
                    let r = self.restart_members(&ranks, generation).await;
                    self.after_restart(r, ranks, generation, &mut actions).await;
                    actions.extend(self.take_reports());
                }
                MeshAction::RestartMesh { generation, delay } => {
                    self.shared.status.send_replace(MeshStatus::Restarting);
                    self.rt.stop_owned(self.shared.id, None).await;
                    self.stop_members().await;
                    tokio::time::sleep(delay).await;
                    let r = self.restart_mesh(generation).await;
                    let all = (0..self.shared.info().shape.len() as u32)
                        .map(Rank)
                        .collect();
                    self.after_restart(r, all, generation, &mut actions).await;
                    actions.extend(self.take_reports());
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
                    self.escalate(failure);
                    return true;
                }
            }
        }
        false
    }

    /// Ends a restart; a failed one is reported (to observers, the hook and
    /// the machine) as a start failure of the restarted ranks in the new
    /// generation.
    async fn after_restart(
        &mut self,
        r: Result<(), MeshError>,
        ranks: Vec<Rank>,
        generation: Generation,
        actions: &mut Vec<MeshAction>,
    ) {
        let now = Instant::now();
        match r {
            Ok(()) => {
                self.shared.status.send_replace(MeshStatus::Running);
                self.tell_owner(false).await;
                actions.extend(self.machine.handle(now, MeshEvent::Restarted(Ok(()))));
            }
            Err(e) => {
                let message = e.to_string();
                actions.extend(
                    self.machine
                        .handle(now, MeshEvent::Restarted(Err(message.clone()))),
                );
                let failure = MeshFailure {
                    mesh: self.shared.info().name.clone(),
                    ranks,
                    cause: FailureCause::StartFailed(message),
                    generation,
                };
                actions.extend(self.decide(failure));
            }
        }
    }

    /// Publishes a failure, asks the hook, and asks the machine.
    fn decide(&mut self, failure: MeshFailure) -> Vec<MeshAction> {
        tracing::warn!(%failure, "mesh failure");
        let _ = self.shared.failures.send(failure.clone());
        let decision = self.hook.as_ref().and_then(|h| h(&failure));
        let event = MeshEvent::Failed { failure, decision };
        self.machine.handle(Instant::now(), event)
    }

    /// Ends the mesh: what it owns stops first, then its status is final
    /// and its owner member's proc learns it is gone.
    async fn finish(&self, status: MeshStatus) {
        self.rt.stop_owned(self.shared.id, None).await;
        self.shared.status.send_replace(status);
        self.rt.unregister_mesh(self.shared.id);
        self.tell_owner(true).await;
    }

    /// Tells the proc of the member that owns this mesh (if a member does)
    /// about its new generation, or that it is gone.
    async fn tell_owner(&self, gone: bool) {
        let Some((parent, rank)) = self.owner else {
            return;
        };
        let Some(parent) = self.rt.mesh_info(parent) else {
            return;
        };
        let Some(addr) = parent.procs.get((rank.0 / parent.per_proc) as usize) else {
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
        self.rt.tell(&addr.proc, cmd).await;
    }

    /// Spawns a mesh owned by one of this mesh's members, on this mesh's
    /// procs, and answers the member's proc.
    async fn spawn_child(&mut self, request: SpawnChild) {
        let info = self.shared.info();
        let result = if request.rank >= info.shape.len() as u32 {
            Err(format!(
                "no member of rank {} in {}",
                request.rank, info.name
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
                    owner: Some((info.id, Rank(request.rank))),
                },
            };
            match spawn_mesh(&self.rt, &self.allocator, &self.procs, &info.procs, spec).await {
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

    fn escalate(&self, failure: MeshFailure) {
        if let Some((parent, rank)) = self.owner
            && self.rt.signal_mesh(
                parent,
                Signal::Escalated {
                    rank,
                    failure: failure.clone(),
                },
            )
        {
            return;
        }
        self.rt.fail_job(failure);
    }

    /// The proc rank of `proc` in the current generation, if it is ours and
    /// not already known gone.
    fn proc_rank(&self, info: &MeshInfo, proc: &ProcId) -> Option<u32> {
        if self.dead.contains(proc) {
            return None;
        }
        info.procs
            .iter()
            .position(|a| &a.proc == proc)
            .map(|p| p as u32)
    }

    /// Marks a proc gone: no lease, in-flight calls through it fail now.
    fn lose(&mut self, info: &MeshInfo, proc: &ProcId, rank: u32, why: &str) {
        self.dead.insert(proc.clone());
        self.rt.abandon(proc);
        self.rt.pending().lose_proc(info.id, rank, why);
    }

    fn proc_failure(
        &mut self,
        info: &MeshInfo,
        proc: &ProcId,
        cause: FailureCause,
    ) -> Option<MeshFailure> {
        let rank = self.proc_rank(info, proc)?;
        self.lose(info, proc, rank, &cause.to_string());
        let first = rank * info.per_proc;
        Some(MeshFailure {
            mesh: info.name.clone(),
            ranks: (first..first + info.per_proc).map(Rank).collect(),
            cause,
            // The proc was alive in the current generation: every life on it
            // is current.
            generation: info.generation,
        })
    }

    fn failure_of(&mut self, signal: Signal) -> Option<MeshFailure> {
        let info = self.shared.info();
        match signal {
            Signal::Member(e) if e.mesh == info.id => Some(MeshFailure {
                mesh: info.name.clone(),
                ranks: vec![Rank(e.rank)],
                cause: e.cause,
                generation: e.generation,
            }),
            Signal::Member(_) => None,
            Signal::Proc(ProcEvent::Exited { proc, status }) => self.proc_failure(
                &info,
                &proc,
                FailureCause::ProcExited {
                    proc: proc.clone(),
                    status,
                },
            ),
            Signal::Proc(ProcEvent::HostLost { host, procs }) => {
                let mut failure: Option<MeshFailure> = None;
                for proc in procs {
                    let cause = FailureCause::HostLost {
                        host: host.clone(),
                        proc: proc.clone(),
                    };
                    if let Some(f) = self.proc_failure(&info, &proc, cause) {
                        match &mut failure {
                            Some(all) => all.ranks.extend(f.ranks),
                            None => failure = Some(f),
                        }
                    }
                }
                failure
            }
            Signal::Link { proc, detail } => {
                let cause = FailureCause::LinkFailed {
                    proc: proc.clone(),
                    detail,
                };
                self.proc_failure(&info, &proc, cause)
            }
            Signal::Escalated { rank, failure } => Some(MeshFailure {
                mesh: info.name.clone(),
                ranks: vec![rank],
                cause: FailureCause::Escalated(Box::new(failure)),
                generation: info.generation,
            }),
            Signal::Stop | Signal::StopRequested(_) | Signal::SpawnChild(_) => None,
        }
    }

    /// Starts fresh procs for the proc ranks whose procs are gone, and puts
    /// them into `info`; returns those proc ranks with their new procs.
    async fn replace_dead(
        &mut self,
        info: &mut MeshInfo,
    ) -> Result<Vec<(u32, AllocatedProc)>, MeshError> {
        // Only procs whose loss this supervisor has decided on: a loss it has
        // not seen yet makes this restart fail fast (requests to a lost proc
        // do), and is then decided on like any failure (`take_reports`).
        let gone: Vec<u32> = info
            .procs
            .iter()
            .enumerate()
            .filter(|(_, a)| self.dead.contains(&a.proc))
            .map(|(i, _)| i as u32)
            .collect();
        if gone.is_empty() {
            return Ok(Vec::new());
        }
        let fresh = self.rt.allocate(&self.allocator, gone.len()).await?;
        self.procs
            .lock()
            .expect("procs lock")
            .extend(fresh.iter().cloned());
        let mut replaced = Vec::with_capacity(gone.len());
        for (rank, proc) in gone.into_iter().zip(fresh) {
            tracing::info!(mesh = %info.name, proc_rank = rank, proc = %proc.proc, "fresh proc replaces a lost one");
            info.procs[rank as usize] = proc.addr.clone();
            replaced.push((rank, proc));
        }
        Ok(replaced)
    }

    /// Respawns `ranks` in `generation`, on fresh procs where theirs are
    /// gone, and enrolls every other member in the new generation.
    async fn restart_members(
        &mut self,
        ranks: &[Rank],
        generation: Generation,
    ) -> Result<(), MeshError> {
        let mut info = (*self.shared.info()).clone();
        info.generation = generation;
        let replaced = self.replace_dead(&mut info).await?;
        let mut by_proc: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for r in ranks {
            by_proc.entry(r.0 / info.per_proc).or_default().push(r.0);
        }
        let fresh: HashSet<u32> = replaced.iter().map(|(r, _)| *r).collect();
        let rt = &self.rt;
        let args = &self.args;
        let info_ref = &info;
        // New procs get all their members; live procs respawn their failed
        // ranks; every other proc enrolls in the new generation.
        let spawns = replaced
            .iter()
            .map(|(rank, proc)| spawn_on(rt, info_ref, *rank, &proc.proc, args));
        let mut updates = Vec::new();
        for (rank, addr) in info.procs.iter().enumerate() {
            let rank = rank as u32;
            if fresh.contains(&rank) {
                continue;
            }
            let proc = addr.proc.clone();
            let respawn = by_proc.get(&rank).cloned();
            updates.push(async move {
                let reply_to = rt.reply_port();
                let body = rt
                    .request(
                        &proc,
                        |call| match respawn {
                            Some(ranks) => ProcCommand::Respawn {
                                call,
                                reply_to,
                                info: info_ref.clone(),
                                ranks,
                                args: args.clone(),
                            },
                            None => ProcCommand::Update {
                                call,
                                reply_to,
                                info: info_ref.clone(),
                            },
                        },
                        &info_ref.name,
                    )
                    .await?;
                spawned(body, info_ref, &proc)
            });
        }
        let (a, b) = futures::join!(join_all(spawns), join_all(updates));
        *self.shared.info.write().expect("mesh info lock") = Arc::new(info);
        a.into_iter().chain(b).collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }

    /// Respawns every member in `generation` (they were stopped), on fresh
    /// procs where theirs are gone.
    async fn restart_mesh(&mut self, generation: Generation) -> Result<(), MeshError> {
        let mut info = (*self.shared.info()).clone();
        info.generation = generation;
        self.replace_dead(&mut info).await?;
        let rt = &self.rt;
        let args = &self.args;
        let spawns = info
            .procs
            .iter()
            .enumerate()
            .map(|(rank, a)| spawn_on(rt, &info, rank as u32, &a.proc, args));
        let results = join_all(spawns).await;
        *self.shared.info.write().expect("mesh info lock") = Arc::new(info);
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }

    /// Stops every member on every live proc, last proc first (each proc
    /// stops its members last rank first).
    async fn stop_members(&self) {
        let info = self.shared.info();
        for addr in info.procs.iter().rev() {
            if self.dead.contains(&addr.proc) || self.rt.is_lost(&addr.proc) {
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
