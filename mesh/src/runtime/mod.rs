//! The controller's side: a [`Runtime`] owns the cluster CA and the
//! controller's endpoint, starts procs through an [`Allocator`] as a
//! [`ProcMesh`], spawns [`ActorMesh`]es on them, casts and calls through cast
//! trees whose root it is, and supervises every mesh it owns: failures of
//! members, procs, hosts and links reach each mesh's supervisor at once and
//! are handled by the mesh's policy (see `docs/semantics.md` §4).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regent_net::{
    ActorId, ActorName, ClusterCa, Endpoint, EndpointConfig, Generation, ProcAddr, ProcId,
    TransportEvent,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::actor::MemberError;
use crate::alloc::{AllocError, AllocatedProc, Allocator, ProcBoot, ProcEvent};
use crate::node::{self, Pending};
use crate::policy::MeshFailure;
use crate::proc::{NetFabric, proc_port};
use crate::protocol::{
    CastFrame, Contribution, MemberExited, MeshId, MeshInfo, ProcCommand, ProcReply, ReplyBody,
    names,
};
use crate::selection::SelectionError;
use crate::shape::{Rank, ShapeError};
use crate::tree::DEFAULT_FANOUT;

pub(crate) mod mesh;
mod procs;
mod supervise;

pub use mesh::{ActorMesh, FailureHook, MeshStatus, Reduced, SpawnOptions, ValueMesh};
pub use procs::{MEMBER_DIM, ProcMesh};

use supervise::Signal;

/// How a [`Runtime`] is set up.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The controller's proc name (its certificate's identity).
    pub name: String,
    /// Where the controller's endpoint listens (default `127.0.0.1:0`).
    pub bind: SocketAddr,
    /// Where procs bind their endpoints (default `127.0.0.1:0`).
    pub proc_bind: SocketAddr,
    /// How long procs keep running without hearing from the controller
    /// (default 10 s); the controller renews every third of it.
    pub owner_lease: Duration,
    /// How long spawns, stops and calls wait by default (default 30 s).
    pub call_timeout: Duration,
    /// The cast trees' fan-out (default 16).
    pub fanout: NonZeroU32,
    /// The control plane's settings (its `failure_timeout` bounds how fast a
    /// silent proc is declared failed).
    pub endpoint: EndpointConfig,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            name: "controller".into(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            proc_bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            owner_lease: Duration::from_secs(10),
            call_timeout: Duration::from_secs(30),
            fanout: DEFAULT_FANOUT,
            endpoint: EndpointConfig::default(),
        }
    }
}

impl RuntimeConfig {
    /// Sets the cast trees' fan-out.
    pub fn fanout(mut self, fanout: NonZeroU32) -> Self {
        self.fanout = fanout;
        self
    }

    /// Sets the default call timeout.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Sets the owner lease given to procs.
    pub fn owner_lease(mut self, lease: Duration) -> Self {
        self.owner_lease = lease;
        self
    }

    /// Sets the control plane's settings.
    pub fn endpoint(mut self, endpoint: EndpointConfig) -> Self {
        self.endpoint = endpoint;
        self
    }
}

/// What went wrong in a mesh operation.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// Procs could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The control plane failed.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
    /// A name was invalid.
    #[error(transparent)]
    Id(#[from] regent_net::IdError),
    /// A shape was invalid.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A selection did not fit the mesh.
    #[error(transparent)]
    Selection(#[from] SelectionError),
    /// Members could not be spawned on a proc.
    #[error("spawning {mesh} on proc {proc}: {message}")]
    Spawn {
        /// The mesh.
        mesh: String,
        /// The proc.
        proc: ProcId,
        /// Why.
        message: String,
    },
    /// A member's mesh could not be spawned: the controller refused it or
    /// could not be reached.
    #[error("spawning {mesh}: {message}")]
    SpawnChild {
        /// The mesh.
        mesh: String,
        /// Why.
        message: String,
    },
    /// A value could not be encoded.
    #[error("encoding: {0}")]
    Encode(String),
    /// No answer in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What.
        what: String,
        /// After how long.
        after: Duration,
    },
    /// The reducer is not registered in this binary.
    #[error("no reducer {0} is registered")]
    NoSuchReducer(&'static str),
    /// No member has this rank.
    #[error("no member has rank {}", .0.0)]
    NoSuchRank(Rank),
    /// The mesh has stopped (by its policy, by escalation, or on request).
    #[error("mesh {0} has stopped")]
    Stopped(String),
    /// Some members did not get or answer the message.
    #[error(transparent)]
    Members(#[from] MembersFailed),
}

/// The members that did not get (or answer) a cast or call, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} member(s) failed: {}", failed.len(), summary(failed))]
pub struct MembersFailed {
    /// By rank.
    pub failed: Vec<(Rank, MemberError)>,
}

fn summary(failed: &[(Rank, MemberError)]) -> String {
    let mut parts: Vec<String> = failed
        .iter()
        .take(4)
        .map(|(r, e)| format!("rank {}: {e}", r.0))
        .collect();
    if failed.len() > 4 {
        parts.push(format!("and {} more", failed.len() - 4));
    }
    parts.join("; ")
}

/// The bound on remembered lost procs; the oldest are forgotten first.
const MAX_LOST: usize = 1 << 16;

#[derive(Default)]
struct LostProcs {
    set: HashSet<ProcId>,
    order: std::collections::VecDeque<ProcId>,
}

impl LostProcs {
    /// Records a lost proc; returns whether it is new.
    fn insert(&mut self, proc: ProcId) -> bool {
        if !self.set.insert(proc.clone()) {
            return false;
        }
        self.order.push_back(proc);
        if self.order.len() > MAX_LOST
            && let Some(oldest) = self.order.pop_front()
        {
            self.set.remove(&oldest);
        }
        true
    }

    fn contains(&self, proc: &ProcId) -> bool {
        self.set.contains(proc)
    }
}

struct Inner {
    config: RuntimeConfig,
    ca: ClusterCa,
    fabric: Arc<NetFabric>,
    pending: Arc<Pending>,
    next_mesh: AtomicU64,
    next_proc: AtomicU64,
    /// What the references of each live mesh share (its supervisor's
    /// signals among them).
    meshes: Mutex<HashMap<MeshId, Arc<mesh::MeshShared>>>,
    /// Meshes owned by members of other meshes: by owner mesh, (owner rank,
    /// owned mesh).
    owned: Mutex<HashMap<MeshId, Vec<(u32, MeshId)>>>,
    /// Procs whose lease the controller renews.
    leased: Mutex<HashSet<ProcId>>,
    /// Procs given up on (dead, or unreachable: zombies if they come back).
    abandoned: Mutex<HashSet<ProcId>>,
    /// Procs known to be dead or unreachable, as soon as any report says so
    /// (before any mesh supervisor has handled it): requests to them fail at
    /// once, and restarts replace them.
    lost: Mutex<LostProcs>,
    lost_changed: tokio::sync::Notify,
    /// Allocators whose events are already being routed (by address), which
    /// also see every transport event.
    hooked: Mutex<HashMap<usize, Arc<dyn Allocator>>>,
    /// A failure that escalated past every owner: the job has stopped.
    job: watch::Sender<Option<MeshFailure>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.lock().expect("tasks lock").drain(..) {
            t.abort();
        }
    }
}

/// The controller: the root of every cast tree, and the owner of the procs it
/// starts and the meshes it spawns. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("addr", &self.addr())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Starts a controller with a fresh cluster CA.
    pub async fn start(config: RuntimeConfig) -> Result<Self, MeshError> {
        let ca = ClusterCa::generate("regent cluster")?;
        Self::with_ca(config, ca).await
    }

    /// Starts a controller with a given cluster CA (e.g. loaded from files,
    /// to talk to host agents provisioned with it).
    pub async fn with_ca(config: RuntimeConfig, ca: ClusterCa) -> Result<Self, MeshError> {
        let me = ProcId::new(&config.name)?;
        let credentials = ca.issue(
            &me,
            regent_net::Role::Controller,
            regent_net::Validity::job(),
        )?;
        let endpoint = Endpoint::bind(credentials, config.bind, config.endpoint.clone())?;
        let actor = ActorId {
            proc: me,
            name: ActorName::new(names::CONTROLLER)?,
            index: 0,
        };
        let replies = endpoint.open_port(actor.port(names::REPLY_PORT))?;
        let events = endpoint.open_port(actor.port(names::EVENT_PORT))?;
        let spawns = endpoint.open_port(actor.port(names::SPAWN_PORT))?;
        let transport = endpoint.take_events();
        let (job, _) = watch::channel(None);
        let rt = Self {
            inner: Arc::new(Inner {
                config,
                ca,
                fabric: Arc::new(NetFabric::new(endpoint, actor)),
                pending: Arc::new(Pending::default()),
                next_mesh: AtomicU64::new(0),
                next_proc: AtomicU64::new(0),
                meshes: Mutex::new(HashMap::new()),
                owned: Mutex::new(HashMap::new()),
                leased: Mutex::new(HashSet::new()),
                abandoned: Mutex::new(HashSet::new()),
                lost: Mutex::new(LostProcs::default()),
                lost_changed: tokio::sync::Notify::new(),
                hooked: Mutex::new(HashMap::new()),
                job,
                tasks: Mutex::new(Vec::new()),
            }),
        };
        let weak = Arc::downgrade(&rt.inner);
        let mut tasks = vec![
            tokio::spawn(dispatch_replies(rt.inner.pending.clone(), replies)),
            tokio::spawn(route_member_exits(weak.clone(), events)),
            tokio::spawn(route_spawn_requests(weak.clone(), spawns)),
            tokio::spawn(renew_leases(weak.clone())),
        ];
        if let Some(transport) = transport {
            tasks.push(tokio::spawn(route_transport_events(weak, transport)));
        }
        rt.inner.tasks.lock().expect("tasks lock").extend(tasks);
        Ok(rt)
    }

    /// The controller's endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.fabric.endpoint
    }

    /// The controller's address.
    pub fn addr(&self) -> ProcAddr {
        self.inner.fabric.endpoint.addr()
    }

    /// The cluster CA.
    pub fn ca(&self) -> &ClusterCa {
        &self.inner.ca
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.config
    }

    /// How many cast-tree frames the controller has sent itself (each is one
    /// message to one proc): the controller's share of the fan-out.
    pub fn frames_sent(&self) -> u64 {
        self.inner.fabric.commands_sent.load(Ordering::Relaxed)
    }

    /// The failure that escalated past every owner and stopped the job, if
    /// one did.
    pub fn job_failure(&self) -> Option<MeshFailure> {
        self.inner.job.borrow().clone()
    }

    /// Waits until a failure escalates past every owner (the root's default
    /// is to stop the job: every mesh is stopped) and returns it.
    pub async fn wait_job_failure(&self) -> MeshFailure {
        let mut rx = self.inner.job.subscribe();
        loop {
            if let Some(f) = rx.borrow_and_update().clone() {
                return f;
            }
            if rx.changed().await.is_err() {
                // The runtime is going away with it; wait forever.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Starts one proc per point of `shape` through `allocator`; the
    /// controller renews their lease while they are in use.
    pub async fn spawn_procs(
        &self,
        allocator: Arc<dyn Allocator>,
        shape: crate::shape::Shape,
    ) -> Result<ProcMesh, MeshError> {
        let procs = self.allocate(&allocator, shape.len()).await?;
        Ok(ProcMesh::new(self.clone(), allocator, procs, shape))
    }

    /// Starts `n` procs through `allocator` and routes their events.
    pub(crate) async fn allocate(
        &self,
        allocator: &Arc<dyn Allocator>,
        n: usize,
    ) -> Result<Vec<AllocatedProc>, MeshError> {
        self.hook_allocator(allocator);
        let batch = self.inner.next_proc.fetch_add(1, Ordering::Relaxed);
        let mut boots = Vec::with_capacity(n);
        for i in 0..n {
            let proc = ProcId::new(&format!("p{batch}-{i}"))?;
            let (cert_pem, key_pem, ca_pem) = self
                .inner
                .ca
                .issue(&proc, regent_net::Role::Proc, regent_net::Validity::job())?
                .to_pem();
            boots.push(ProcBoot {
                proc,
                ca_pem,
                cert_pem,
                key_pem,
                bind: self.inner.config.proc_bind,
                parent: self.addr(),
                owner: self.addr(),
                owner_lease: self.inner.config.owner_lease,
            });
        }
        let procs = allocator.allocate(boots).await?;
        let mut leased = self.inner.leased.lock().expect("leased lock");
        for p in &procs {
            self.endpoint().add_route(p.addr.clone());
            leased.insert(p.proc.clone());
        }
        Ok(procs)
    }

    /// Routes an allocator's proc events to the meshes, once per allocator.
    fn hook_allocator(&self, allocator: &Arc<dyn Allocator>) {
        let key = Arc::as_ptr(allocator) as *const () as usize;
        let first = self
            .inner
            .hooked
            .lock()
            .expect("hooked lock")
            .insert(key, allocator.clone())
            .is_none();
        if !first {
            return;
        }
        if let Some(events) = allocator.take_events() {
            let task = tokio::spawn(route_proc_events(Arc::downgrade(&self.inner), events));
            self.inner.tasks.lock().expect("tasks lock").push(task);
        }
    }

    /// Gives up on a proc: no more lease renewals; if it comes back, it is
    /// told to exit.
    pub(crate) fn abandon(&self, proc: &ProcId) {
        self.mark_lost(proc);
        self.inner.leased.lock().expect("leased lock").remove(proc);
        self.inner
            .abandoned
            .lock()
            .expect("abandoned lock")
            .insert(proc.clone());
    }

    /// Records that a proc is dead or unreachable, and wakes the requests
    /// waiting on it.
    pub(crate) fn mark_lost(&self, proc: &ProcId) {
        if self
            .inner
            .lost
            .lock()
            .expect("lost lock")
            .insert(proc.clone())
        {
            self.inner.lost_changed.notify_waiters();
        }
    }

    /// Whether a proc is known to be dead or unreachable.
    pub(crate) fn is_lost(&self, proc: &ProcId) -> bool {
        self.inner.lost.lock().expect("lost lock").contains(proc)
    }

    /// Stops renewing a proc's lease (it is being stopped).
    pub(crate) fn release(&self, proc: &ProcId) {
        self.inner.leased.lock().expect("leased lock").remove(proc);
    }

    pub(crate) fn register_mesh(&self, shared: Arc<mesh::MeshShared>) {
        self.inner
            .meshes
            .lock()
            .expect("meshes lock")
            .insert(shared.id, shared);
    }

    /// The names of the meshes this controller supervises now, sorted.
    pub fn live_meshes(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .meshes
            .lock()
            .expect("meshes lock")
            .values()
            .map(|shared| shared.info().name.clone())
            .collect();
        names.sort();
        names
    }

    /// The current generation's info of a live mesh.
    pub(crate) fn mesh_info(&self, id: MeshId) -> Option<Arc<MeshInfo>> {
        self.inner
            .meshes
            .lock()
            .expect("meshes lock")
            .get(&id)
            .map(|shared| shared.info())
    }

    /// Stops every mesh that has members on any of `procs` (they are about
    /// to be stopped on purpose), and waits until they have stopped.
    pub(crate) async fn stop_meshes_on(&self, procs: &HashSet<ProcId>) {
        let on: Vec<MeshId> = self
            .inner
            .meshes
            .lock()
            .expect("meshes lock")
            .iter()
            .filter(|(_, shared)| shared.info().procs.iter().any(|a| procs.contains(&a.proc)))
            .map(|(id, _)| *id)
            .collect();
        for id in on {
            self.stop_mesh(id).await;
        }
    }

    /// Asks a live mesh's supervisor to stop it, and waits until it has.
    async fn stop_mesh(&self, id: MeshId) {
        let shared = self
            .inner
            .meshes
            .lock()
            .expect("meshes lock")
            .get(&id)
            .cloned();
        if let Some(shared) = shared {
            shared.stop().await;
        }
    }

    /// Records that member `rank` of `parent` owns `child`.
    pub(crate) fn adopt(&self, parent: MeshId, rank: u32, child: MeshId) {
        self.inner
            .owned
            .lock()
            .expect("owned lock")
            .entry(parent)
            .or_default()
            .push((rank, child));
    }

    /// Stops the meshes owned by `ranks` of `parent` (all of its members
    /// when `None`), and waits until they have stopped.
    pub(crate) async fn stop_owned(&self, parent: MeshId, ranks: Option<&[u32]>) {
        let children: Vec<MeshId> = {
            let mut owned = self.inner.owned.lock().expect("owned lock");
            let Some(list) = owned.get_mut(&parent) else {
                return;
            };
            let (stop, keep): (Vec<_>, Vec<_>) = list
                .drain(..)
                .partition(|(r, _)| ranks.is_none_or(|ranks| ranks.contains(r)));
            *list = keep;
            stop.into_iter().map(|(_, c)| c).collect()
        };
        for child in children {
            self.stop_mesh(child).await;
        }
    }

    /// Sends a command to a proc's runtime.
    async fn send_command(&self, proc: &ProcId, cmd: ProcCommand) -> Result<(), String> {
        let fabric = &self.inner.fabric;
        let port = proc_port(proc, names::COMMAND_PORT);
        fabric
            .endpoint
            .send(&fabric.me, &port, Generation(0), cmd)
            .await
            .map_err(|e| e.failure.to_string())
    }

    /// Sends a command to a proc without waiting for an answer.
    pub(crate) async fn tell(&self, proc: &ProcId, cmd: ProcCommand) {
        if let Err(error) = self.send_command(proc, cmd).await {
            tracing::warn!(%proc, %error, "could not tell a proc");
        }
    }

    /// Answers a proc's request.
    pub(crate) async fn answer(&self, to: regent_net::PortId, call: u64, body: ReplyBody) {
        use crate::node::Fabric;
        self.inner.fabric.reply(to, ProcReply { call, body }).await;
    }

    pub(crate) fn unregister_mesh(&self, id: MeshId) {
        self.inner.meshes.lock().expect("meshes lock").remove(&id);
        self.inner.owned.lock().expect("owned lock").remove(&id);
    }

    pub(crate) fn signal_mesh(&self, id: MeshId, signal: Signal) -> bool {
        match self.inner.meshes.lock().expect("meshes lock").get(&id) {
            Some(shared) => shared.supervisor.send(signal).is_ok(),
            None => false,
        }
    }

    fn signal_all(&self, signal: impl Fn() -> Signal) {
        for shared in self.inner.meshes.lock().expect("meshes lock").values() {
            let _ = shared.supervisor.send(signal());
        }
    }

    /// A failure escalated past every owner: record it and stop every mesh.
    pub(crate) fn fail_job(&self, failure: MeshFailure) {
        tracing::error!(%failure, "a failure escalated to the root; stopping the job");
        self.inner.job.send_replace(Some(failure));
        self.signal_all(|| Signal::Stop);
    }

    pub(crate) fn pending(&self) -> &Pending {
        &self.inner.pending
    }

    pub(crate) fn next_mesh_id(&self) -> MeshId {
        MeshId(self.inner.next_mesh.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn reply_port(&self) -> regent_net::PortId {
        use crate::node::Fabric;
        self.inner.fabric.reply_port()
    }

    pub(crate) fn event_port(&self) -> regent_net::PortId {
        self.inner.fabric.me.port(names::EVENT_PORT)
    }

    pub(crate) fn me(&self) -> &ActorId {
        &self.inner.fabric.me
    }

    /// Sends a request to a proc's command port and waits for its answer.
    pub(crate) async fn request(
        &self,
        proc: &ProcId,
        build: impl FnOnce(u64) -> ProcCommand,
        what: &str,
    ) -> Result<ReplyBody, MeshError> {
        let lost = || MeshError::Spawn {
            mesh: what.to_owned(),
            proc: proc.clone(),
            message: "the proc is lost (it exited, or its host or link failed)".into(),
        };
        if self.is_lost(proc) {
            return Err(lost());
        }
        let (call, answer) = self.inner.pending.request();
        let cmd = build(call);
        if let Err(message) = self.send_command(proc, cmd).await {
            self.inner.pending.forget(call);
            return Err(MeshError::Spawn {
                mesh: what.to_owned(),
                proc: proc.clone(),
                message,
            });
        }
        let after = self.inner.config.call_timeout;
        let answer = tokio::time::timeout(after, answer);
        tokio::pin!(answer);
        loop {
            // Registered before the check, so no loss is missed in between.
            let changed = self.inner.lost_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_lost(proc) {
                self.inner.pending.forget(call);
                return Err(lost());
            }
            tokio::select! {
                r = &mut answer => {
                    return match r {
                        Ok(Ok(body)) => Ok(body),
                        Ok(Err(_)) | Err(_) => {
                            self.inner.pending.forget(call);
                            Err(MeshError::Timeout {
                                what: format!("{what} on {proc}"),
                                after,
                            })
                        }
                    };
                }
                () = &mut changed => {}
            }
        }
    }

    /// Tells a proc to exit, without waiting.
    pub(crate) fn tell_exit(&self, proc: &ProcId) {
        let fabric = &self.inner.fabric;
        let _ = fabric.endpoint.try_send(
            &fabric.me,
            &proc_port(proc, names::COMMAND_PORT),
            Generation(0),
            ProcCommand::Exit,
        );
    }

    /// Casts `frame` from the controller, as the root of the tree.
    pub(crate) async fn root_cast(&self, info: &MeshInfo, frame: CastFrame) -> Contribution {
        node::from_root(
            self.inner.fabric.as_ref(),
            &self.inner.pending,
            info,
            &frame,
        )
        .await
    }
}

async fn dispatch_replies(pending: Arc<Pending>, mut replies: regent_net::Inbox) {
    while let Some(delivery) = replies.recv().await {
        match delivery.decode::<ProcReply>() {
            Ok(r) => pending.resolve(r.call, r.body),
            Err(e) => tracing::warn!(error = %e, "undecodable reply dropped"),
        }
    }
}

async fn route_member_exits(inner: std::sync::Weak<Inner>, mut events: regent_net::Inbox) {
    while let Some(delivery) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        match delivery.decode::<MemberExited>() {
            Ok(e) => {
                let mesh = e.mesh;
                if !rt.signal_mesh(mesh, Signal::Member(e)) {
                    tracing::debug!(mesh = mesh.0, "member exit of a mesh no longer supervised");
                }
            }
            Err(e) => tracing::warn!(error = %e, "undecodable member exit dropped"),
        }
    }
}

async fn route_spawn_requests(inner: std::sync::Weak<Inner>, mut requests: regent_net::Inbox) {
    while let Some(delivery) = requests.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        let request = match delivery.decode::<crate::protocol::SpawnChild>() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable spawn request dropped");
                continue;
            }
        };
        let parent = request.parent;
        let (to, call) = (request.reply_to.clone(), request.call);
        if !rt.signal_mesh(parent, Signal::SpawnChild(request)) {
            let body = ReplyBody::ChildSpawned(Err(format!(
                "the requesting member's mesh {} is no longer supervised",
                parent.0
            )));
            rt.answer(to, call, body).await;
        }
    }
}

async fn route_proc_events(inner: std::sync::Weak<Inner>, mut events: mpsc::Receiver<ProcEvent>) {
    while let Some(event) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        let procs: Vec<ProcId> = match &event {
            ProcEvent::Exited { proc, .. } => vec![proc.clone()],
            ProcEvent::HostLost { procs, .. } => procs.clone(),
        };
        // Reported to the supervisors before it is marked lost: a request
        // that fails because the proc is lost finds the report queued.
        rt.signal_all(|| Signal::Proc(event.clone()));
        for p in &procs {
            rt.release(p);
            rt.mark_lost(p);
        }
    }
}

async fn route_transport_events(
    inner: std::sync::Weak<Inner>,
    mut events: mpsc::Receiver<TransportEvent>,
) {
    while let Some(event) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let allocators: Vec<Arc<dyn Allocator>> = inner
            .hooked
            .lock()
            .expect("hooked lock")
            .values()
            .cloned()
            .collect();
        for a in allocators {
            a.transport_event(&event);
        }
        let rt = Runtime { inner };
        match event {
            TransportEvent::LinkFailed { peer, cause, .. }
            | TransportEvent::LinkClosed { peer, cause } => {
                let detail = cause.to_string();
                rt.signal_all(|| Signal::Link {
                    proc: peer.clone(),
                    detail: detail.clone(),
                });
                rt.mark_lost(&peer);
            }
            TransportEvent::LinkUp { peer, .. } => {
                let zombie = rt
                    .inner
                    .abandoned
                    .lock()
                    .expect("abandoned lock")
                    .contains(&peer);
                if zombie {
                    tracing::warn!(proc = %peer, "an abandoned proc came back; telling it to exit");
                    rt.tell_exit(&peer);
                }
            }
            _ => {}
        }
    }
}

async fn renew_leases(inner: std::sync::Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(i) => i.config.owner_lease / 3,
        None => return,
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(inner) = inner.upgrade() else { return };
        let procs: Vec<ProcId> = inner
            .leased
            .lock()
            .expect("leased lock")
            .iter()
            .cloned()
            .collect();
        let fabric = &inner.fabric;
        for p in procs {
            // A full buffer or a dead proc is not the lease's problem.
            let _ = fabric.endpoint.try_send(
                &fabric.me,
                &proc_port(&p, names::COMMAND_PORT),
                Generation(0),
                ProcCommand::Renew,
            );
        }
    }
}
