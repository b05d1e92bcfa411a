//! The proc runtime: what runs in every proc process after boot. It hosts
//! the members of meshes under an OTP supervisor, forwards and delivers
//! casts as a node of each cast tree, and follows its owner's commands; it
//! stops itself when its owner's lease lapses.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::ActorRef;
use regent_net::{ActorId, Endpoint, PortId, ProcId};
use regent_supervisor::{
    ChildPolicy, ChildSpec, ExitReason, Observation, Observed, Restart, Shutdown, StartError,
    Strategy, SupervisorFlags, SupervisorRef, SupervisorSpec,
};

use crate::actor::{Member, MemberError, MemberMsg, MemberStart};
use crate::node::{self, Fabric, LocalMembers, Pending};
use crate::policy::FailureCause;
use crate::protocol::{
    CastFrame, Contribution, MemberExited, MeshId, MeshInfo, ProcCommand, ProcReply, ReplyBody,
    SpawnChild, names,
};
use crate::registry;
use crate::shape::Rank;

/// How long a member may take to stop before it is killed.
const MEMBER_SHUTDOWN: Duration = Duration::from_secs(5);

/// Why the proc runtime ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcExit {
    /// The owner told it to exit.
    Requested,
    /// The owner was not heard from within its lease.
    LeaseLapsed,
    /// The endpoint closed.
    EndpointClosed,
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
    /// The members' supervisor did not start.
    #[error(transparent)]
    Supervisor(#[from] regent_supervisor::SupervisorError),
    /// Reporting ready failed.
    #[error("could not report ready: {0}")]
    Ready(String),
}

/// The control plane as a cast-tree node of a proc (or controller) uses it.
pub(crate) struct NetFabric {
    pub(crate) endpoint: Endpoint,
    pub(crate) me: ActorId,
    /// Cast-tree commands this node has sent (its share of the fan-out).
    pub(crate) commands_sent: std::sync::atomic::AtomicU64,
}

impl NetFabric {
    pub(crate) fn new(endpoint: Endpoint, me: ActorId) -> Self {
        Self {
            endpoint,
            me,
            commands_sent: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

pub(crate) fn proc_port(proc: &ProcId, port: u32) -> PortId {
    ActorId {
        proc: proc.clone(),
        name: regent_net::ActorName::new(names::PROC).expect("a valid constant name"),
        index: 0,
    }
    .port(port)
}

impl Fabric for NetFabric {
    fn command(
        &self,
        info: &MeshInfo,
        proc: u32,
        cmd: ProcCommand,
    ) -> BoxFuture<'_, Result<(), String>> {
        let target = info.procs.get(proc as usize).map(|a| a.proc.clone());
        self.commands_sent
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let generation = info.generation;
        async move {
            let proc = target.ok_or_else(|| format!("no proc {proc} in the mesh"))?;
            self.endpoint
                .send(
                    &self.me,
                    &proc_port(&proc, names::COMMAND_PORT),
                    generation,
                    cmd,
                )
                .await
                .map_err(|e| e.failure.to_string())
        }
        .boxed()
    }

    fn reply_port(&self) -> PortId {
        self.me.port(names::REPLY_PORT)
    }

    fn reply(&self, port: PortId, reply: ProcReply) -> BoxFuture<'_, ()> {
        async move {
            if let Err(e) = self
                .endpoint
                .send(&self.me, &port, regent_net::Generation(0), reply)
                .await
            {
                tracing::warn!(to = %port, error = %e.failure, "could not send a reply");
            }
        }
        .boxed()
    }

    fn proc(&self) -> &ProcId {
        self.endpoint.proc()
    }

    fn learn(&self, info: &MeshInfo) {
        for addr in &info.procs {
            self.endpoint.add_route(addr.clone());
        }
    }

    fn spawn_child(&self, port: PortId, request: SpawnChild) -> BoxFuture<'_, Result<(), String>> {
        async move {
            self.endpoint
                .send(&self.me, &port, regent_net::Generation(0), request)
                .await
                .map_err(|e| e.failure.to_string())
        }
        .boxed()
    }

    fn notify(&self, port: PortId, report: MemberExited) -> BoxFuture<'_, ()> {
        async move {
            if let Err(e) = self
                .endpoint
                .send(&self.me, &port, report.generation, report)
                .await
            {
                tracing::warn!(to = %port, error = %e.failure, "could not report a member exit");
            }
        }
        .boxed()
    }
}

struct HostedMesh {
    info: Arc<MeshInfo>,
    proc_rank: u32,
    /// By local index: the member's actor (`None` once it exited), and its
    /// child id in the members' supervisor.
    members: LocalMembers,
    child_ids: Vec<String>,
}

/// Who to tell when a member exits on its own: by child id.
type Lives = Arc<std::sync::Mutex<HashMap<String, Life>>>;

#[derive(Clone)]
struct Life {
    mesh: MeshId,
    rank: u32,
    generation: regent_net::Generation,
    owner: PortId,
}

/// The proc runtime's state and command handling, independent of how
/// commands arrive (the control plane, or memory in a simulation).
pub(crate) struct ProcRuntime {
    fabric: Arc<dyn Fabric>,
    pending: Arc<Pending>,
    members: SupervisorRef,
    meshes: HashMap<MeshId, HostedMesh>,
    lives: Lives,
    watcher: tokio::task::JoinHandle<()>,
    /// Meshes owned by this proc's members.
    children: crate::child::Children,
}

/// How long a member's own requests and casts to the meshes it owns wait.
const MEMBER_CALL_TIMEOUT: Duration = Duration::from_secs(30);

fn child_id(mesh: MeshId, rank: u32, generation: regent_net::Generation) -> String {
    format!("m{}-r{rank}-g{}", mesh.0, generation.0)
}

impl ProcRuntime {
    fn actor_type(&self, info: &MeshInfo) -> Result<&'static registry::ActorType, String> {
        self.fabric.actor_type(&info.actor_type).ok_or_else(|| {
            format!(
                "no actor type {:?} is registered in this proc (registered: {:?})",
                info.actor_type,
                registry::actor_types()
            )
        })
    }

    /// Starts the member of `rank` in `info.generation` under the members'
    /// supervisor.
    async fn spawn_member(
        &self,
        info: &MeshInfo,
        rank: u32,
        args: &Bytes,
    ) -> Result<(String, ActorRef<MemberMsg>), String> {
        let actor_type = self.actor_type(info)?;
        let point = info
            .shape
            .point_of(Rank(rank))
            .ok_or_else(|| format!("rank {rank} outside the shape"))?;
        let start = MemberStart {
            member: Member {
                mesh: info.name.clone(),
                rank: Rank(rank),
                point,
                generation: info.generation,
                proc: self.fabric.proc().clone(),
                link: Some(crate::child::MemberLink {
                    fabric: self.fabric.clone(),
                    pending: self.pending.clone(),
                    controller: PortId {
                        actor: info.owner.actor.clone(),
                        port: names::SPAWN_PORT,
                    },
                    me: ActorId {
                        proc: self.fabric.proc().clone(),
                        name: regent_net::ActorName::new(names::PROC)
                            .expect("a valid constant name"),
                        index: 0,
                    },
                    mesh: info.id,
                    rank,
                    children: self.children.clone(),
                    timeout: MEMBER_CALL_TIMEOUT,
                }),
            },
            args: args.clone(),
        };
        let id = child_id(info.id, rank, info.generation);
        // Registered before the start, so that an exit right after it is
        // reported.
        self.lives.lock().expect("lives lock").insert(
            id.clone(),
            Life {
                mesh: info.id,
                rank,
                generation: info.generation,
                owner: info.owner.clone(),
            },
        );
        // The start function runs once: members are temporary children,
        // restarted (if at all) by the mesh's owner, not by this proc.
        let start = std::sync::Mutex::new(Some(start));
        let spec = ChildSpec::new(
            ChildPolicy::worker(id.clone())
                .restart(Restart::Temporary)
                .shutdown(Shutdown::Timeout(MEMBER_SHUTDOWN)),
            move |ctx| {
                let start = start.lock().expect("start lock").take();
                async move {
                    let start = start
                        .ok_or_else(|| StartError::Failed("a member starts only once".into()))?;
                    actor_type
                        .spawn(start, ctx.supervisor())
                        .await
                        .map(|a| a.get_cell())
                        .map_err(StartError::Failed)
                }
                .boxed()
            },
        );
        match self.members.start_child(spec).await {
            Ok(cell) => Ok((id, ActorRef::from(cell))),
            Err(e) => {
                self.lives.lock().expect("lives lock").remove(&id);
                Err(e.to_string())
            }
        }
    }

    async fn terminate_member(&self, id: &str) {
        self.lives.lock().expect("lives lock").remove(id);
        let _ = self.members.terminate_child(id).await;
    }

    async fn spawn(&mut self, info: MeshInfo, proc_rank: u32, args: Bytes) -> Result<(), String> {
        info.validate()?;
        if proc_rank >= info.proc_count() {
            return Err(format!("proc rank {proc_rank} outside the mesh"));
        }
        if self.meshes.contains_key(&info.id) {
            return Err(format!("mesh {} already has members here", info.name));
        }
        self.actor_type(&info)?;
        self.fabric.learn(&info);
        let mut members: LocalMembers = Vec::with_capacity(info.per_proc as usize);
        let mut child_ids = Vec::with_capacity(info.per_proc as usize);
        for i in 0..info.per_proc {
            let rank = proc_rank * info.per_proc + i;
            match self.spawn_member(&info, rank, &args).await {
                Ok((id, member)) => {
                    members.push(Some(member));
                    child_ids.push(id);
                }
                Err(e) => {
                    for id in child_ids.iter().rev() {
                        self.terminate_member(id).await;
                    }
                    return Err(e);
                }
            }
        }
        self.meshes.insert(
            info.id,
            HostedMesh {
                info: Arc::new(info),
                proc_rank,
                members,
                child_ids,
            },
        );
        Ok(())
    }

    /// Replaces the lives of `ranks` with new ones in `info.generation`, and
    /// enrolls the others in it.
    async fn respawn(
        &mut self,
        info: MeshInfo,
        ranks: Vec<u32>,
        args: Bytes,
    ) -> Result<(), String> {
        info.validate()?;
        let Some(mut hosted) = self.meshes.remove(&info.id) else {
            return Err(format!("mesh {} has no members here", info.name));
        };
        self.fabric.learn(&info);
        let first = hosted.proc_rank * info.per_proc;
        let mut result = Ok(());
        for rank in ranks {
            let Some(i) = rank.checked_sub(first).filter(|i| *i < info.per_proc) else {
                result = Err(format!("rank {rank} is not hosted here"));
                break;
            };
            let i = i as usize;
            self.terminate_member(&hosted.child_ids[i]).await;
            hosted.members[i] = None;
            match self.spawn_member(&info, rank, &args).await {
                Ok((id, member)) => {
                    hosted.members[i] = Some(member);
                    hosted.child_ids[i] = id;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        hosted.info = Arc::new(info);
        self.meshes.insert(hosted.info.id, hosted);
        result
    }

    /// Enrolls this proc's members in the mesh's new generation.
    fn update(&mut self, info: MeshInfo) -> Result<(), String> {
        info.validate()?;
        let hosted = self
            .meshes
            .get_mut(&info.id)
            .ok_or_else(|| format!("mesh {} has no members here", info.name))?;
        if info.generation < hosted.info.generation {
            return Err("an update to an older generation".into());
        }
        self.fabric.learn(&info);
        hosted.info = Arc::new(info);
        Ok(())
    }

    async fn stop(&mut self, mesh: MeshId) {
        if let Some(m) = self.meshes.remove(&mesh) {
            for id in m.child_ids.iter().rev() {
                self.terminate_member(id).await;
            }
        }
    }

    async fn cast(&self, frame: CastFrame) {
        let hosted = match self.meshes.get(&frame.mesh) {
            Some(h) if h.info.generation == frame.generation => h,
            Some(_) => return self.fail_subtree(frame, "cast for another generation of the mesh"),
            None => return self.fail_subtree(frame, "proc does not host the mesh"),
        };
        let d = node::dispatch(
            self.fabric.as_ref(),
            &self.pending,
            &hosted.info,
            &frame,
            Some(&hosted.members),
        )
        .await;
        if let Some(reply) = frame.reply {
            let pending = self.pending.clone();
            let fabric = self.fabric.clone();
            tokio::spawn(async move {
                let contribution = node::collect(&pending, d).await;
                let reply_msg = ProcReply {
                    call: reply.call,
                    body: ReplyBody::Cast(contribution),
                };
                fabric.reply(reply.port, reply_msg).await;
            });
        }
    }

    /// Answers for a whole subtree that this proc cannot serve: every
    /// selected member in it failed. Nothing is forwarded.
    fn fail_subtree(&self, frame: CastFrame, why: &str) {
        tracing::warn!(mesh = frame.mesh.0, why, "cast not served");
        let Some(reply) = frame.reply else { return };
        let ranks = frame.procs.0.saturating_mul(frame.per_proc)
            ..frame.procs.1.saturating_mul(frame.per_proc);
        let failed = match frame.selection.bind(&frame.view, frame.seed) {
            Ok(selected) => ranks
                .filter(|&r| selected.contains(Rank(r)))
                .map(|r| (r, MemberError::NotRunning(why.to_owned())))
                .collect(),
            Err(_) => Vec::new(),
        };
        self.send_reply(
            &reply.port,
            reply.call,
            Contribution {
                failed,
                ..Contribution::default()
            },
        );
    }

    fn send_reply(&self, port: &PortId, call: u64, contribution: Contribution) {
        let fabric = self.fabric.clone();
        let port = port.clone();
        tokio::spawn(async move {
            let reply = ProcReply {
                call,
                body: ReplyBody::Cast(contribution),
            };
            fabric.reply(port, reply).await;
        });
    }

    /// Starts a proc runtime whose members run under a fresh supervisor.
    pub(crate) async fn start(
        fabric: Arc<dyn Fabric>,
        pending: Arc<Pending>,
    ) -> Result<Self, ProcError> {
        let (observer, observations) = tokio::sync::broadcast::channel(OBSERVATIONS);
        let members = SupervisorSpec::new(
            format!("{}-members", fabric.proc()),
            SupervisorFlags::new(Strategy::OneForOne).intensity(u32::MAX, Duration::from_secs(1)),
        )
        .observer(observer);
        let (members, _) = SupervisorRef::start(members).await?;
        let lives: Lives = Arc::default();
        let watcher = tokio::spawn(report_exits(fabric.clone(), lives.clone(), observations));
        Ok(Self {
            fabric,
            pending,
            members,
            meshes: HashMap::new(),
            lives,
            watcher,
            children: crate::child::Children::default(),
        })
    }

    /// Handles one command; returns `Some` when the proc must exit.
    pub(crate) async fn handle(&mut self, cmd: ProcCommand) -> Option<ProcExit> {
        match cmd {
            ProcCommand::Spawn {
                call,
                reply_to,
                info,
                proc_rank,
                args,
            } => {
                let r = self.spawn(info, proc_rank, args).await;
                let body = ReplyBody::Spawned(r);
                self.fabric.reply(reply_to, ProcReply { call, body }).await;
            }
            ProcCommand::Stop {
                call,
                reply_to,
                mesh,
            } => {
                self.stop(mesh).await;
                let body = ReplyBody::Stopped;
                self.fabric.reply(reply_to, ProcReply { call, body }).await;
            }
            ProcCommand::Respawn {
                call,
                reply_to,
                info,
                ranks,
                args,
            } => {
                let r = self.respawn(info, ranks, args).await;
                let body = ReplyBody::Spawned(r);
                self.fabric.reply(reply_to, ProcReply { call, body }).await;
            }
            ProcCommand::Update {
                call,
                reply_to,
                info,
            } => {
                let body = match self.update(info) {
                    Ok(()) => ReplyBody::Updated,
                    Err(e) => ReplyBody::Spawned(Err(e)),
                };
                self.fabric.reply(reply_to, ProcReply { call, body }).await;
            }
            ProcCommand::Cast(frame) => self.cast(frame).await,
            ProcCommand::ChildInfo { info } => {
                self.fabric.learn(&info);
                self.children
                    .lock()
                    .expect("children lock")
                    .insert(info.id, Arc::new(info));
            }
            ProcCommand::ChildGone { mesh } => {
                self.children.lock().expect("children lock").remove(&mesh);
            }
            ProcCommand::Renew => {}
            ProcCommand::Exit => return Some(ProcExit::Requested),
        }
        None
    }

    /// Stops every member.
    pub(crate) async fn shutdown(self) {
        self.lives.lock().expect("lives lock").clear();
        self.members.stop().await;
        self.watcher.abort();
    }
}

fn delivery_from_owner(sender: &ProcId, owner: &ProcId) -> bool {
    sender == owner
}

/// The bound on queued supervisor observations; a watcher that falls behind
/// this far logs what it missed.
const OBSERVATIONS: usize = 4096;

/// Tells each mesh's owner when one of its members exits on its own.
async fn report_exits(
    fabric: Arc<dyn Fabric>,
    lives: Lives,
    mut observations: tokio::sync::broadcast::Receiver<Observation>,
) {
    loop {
        let o = match observations.recv().await {
            Ok(o) => o,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::error!(missed = n, "member exit reports were lost");
                continue;
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        let (key, cause) = match o.event {
            Observed::Exited { key, reason, .. } => (key, cause_of(reason)),
            Observed::StartFailed { key, error } => {
                (key, FailureCause::StartFailed(error.to_string()))
            }
            _ => continue,
        };
        let Some(life) = lives.lock().expect("lives lock").remove(&key.to_string()) else {
            continue; // stopped on purpose, or not a member
        };
        let report = MemberExited {
            mesh: life.mesh,
            rank: life.rank,
            generation: life.generation,
            cause,
        };
        fabric.notify(life.owner, report).await;
    }
}

fn cause_of(reason: ExitReason) -> FailureCause {
    match reason {
        ExitReason::Failed(message) => FailureCause::Actor {
            message,
            panicked: false,
        },
        ExitReason::Panicked(message) => FailureCause::Actor {
            message,
            panicked: true,
        },
        ExitReason::Killed => FailureCause::Actor {
            message: "killed".into(),
            panicked: false,
        },
        ExitReason::Normal | ExitReason::Shutdown => FailureCause::Stopped,
    }
}

/// Serves this proc until its owner tells it to exit, its owner's lease
/// lapses, or its endpoint closes. `ready` runs once the proc's ports are
/// open (it tells the host agent the proc is ready).
///
/// Only `owner` (authenticated by the control plane) renews the lease and
/// controls the proc; other procs of the cluster may only forward casts.
pub async fn serve<R>(
    endpoint: Endpoint,
    owner: ProcId,
    owner_lease: Duration,
    ready: R,
) -> Result<ProcExit, ProcError>
where
    R: Future<Output = Result<(), String>>,
{
    let me = ActorId {
        proc: endpoint.proc().clone(),
        name: regent_net::ActorName::new(names::PROC)?,
        index: 0,
    };
    let mut commands = endpoint.open_port(me.port(names::COMMAND_PORT))?;
    let mut replies = endpoint.open_port(me.port(names::REPLY_PORT))?;
    let fabric = Arc::new(NetFabric::new(endpoint, me));
    let pending = Arc::new(Pending::default());
    let dispatcher = {
        let pending = pending.clone();
        tokio::spawn(async move {
            while let Some(delivery) = replies.recv().await {
                match delivery.decode::<ProcReply>() {
                    Ok(r) => pending.resolve(r.call, r.body),
                    Err(e) => tracing::warn!(error = %e, "undecodable reply dropped"),
                }
            }
        })
    };
    let mut rt = ProcRuntime::start(fabric.clone(), pending).await?;
    ready.await.map_err(ProcError::Ready)?;
    tracing::info!(proc = %fabric.endpoint.proc(), "proc ready");
    let mut lease = tokio::time::Instant::now() + owner_lease;
    let exit = loop {
        let delivery = tokio::select! {
            d = commands.recv() => d,
            () = tokio::time::sleep_until(lease) => break ProcExit::LeaseLapsed,
        };
        let Some(delivery) = delivery else {
            break ProcExit::EndpointClosed;
        };
        let delivery_sender = delivery.sender.proc.clone();
        let cmd = match delivery.decode::<ProcCommand>() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable command dropped");
                continue;
            }
        };
        if delivery_from_owner(&delivery_sender, &owner) {
            // Any command from the owner shows it is alive.
            lease = tokio::time::Instant::now() + owner_lease;
        } else if !matches!(cmd, ProcCommand::Cast(_)) {
            tracing::warn!(from = %delivery_sender, "a command from another than the owner refused");
            continue;
        }
        if let Some(exit) = rt.handle(cmd).await {
            break exit;
        }
    };
    tracing::info!(proc = %fabric.endpoint.proc(), ?exit, "proc stops");
    rt.shutdown().await;
    dispatcher.abort();
    fabric.endpoint.close();
    Ok(exit)
}
