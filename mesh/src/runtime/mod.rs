//! The controller's side: a [`Runtime`] owns the cluster CA and the
//! controller's endpoint, starts procs through an [`Allocator`] as a
//! [`ProcMesh`], spawns [`ActorMesh`](crate::ActorMesh)es on them, roots the
//! cast trees of its casts, and supervises every mesh it owns: failures of
//! members, procs, hosts and links reach each mesh's supervisor at once and
//! are handled by the mesh's policy (see `docs/semantics.md` §5).
//!
//! - `config`: [`RuntimeConfig`].
//! - `leases`: the procs the controller keeps alive, and the zombies it
//!   tells to exit.
//! - `routing`: the tasks that route replies, member exits, spawn
//!   requests, proc events and link events to pending calls and to the
//!   meshes' supervisors.
//! - `mesh`: the controller's side of a mesh ([`SpawnOptions`], what its
//!   references share with its supervisor).
//! - `procs`: [`ProcMesh`] and its proc slots (replacement per proc).
//! - `supervise`: the supervisor of one mesh.
//! - `observe`: what the controller shows of itself (snapshots, the
//!   journal of failures and recoveries, metrics).

mod config;
mod control;
mod leases;
pub(crate) mod mesh;
mod observe;
mod procs;
mod routing;
mod supervise;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use regent_net::{ActorId, ActorName, ClusterCa, Endpoint, Generation, ProcAddr, ProcId};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::alloc::{AllocatedProc, Allocator, Placement, ProcBoot};
use crate::cast::Caster;
use crate::entropy::Entropy;
use crate::error::MeshError;
use crate::fabric::{Fabric, NetFabric, Pending, proc_port};
use crate::logs::LogSink;
use crate::policy::MeshFailure;
use crate::protocol::{MeshId, MeshInfo, ProcCommand, ProcReply, ReplyBody, names};

pub use config::RuntimeConfig;
pub use mesh::{FailureHook, SpawnOptions, SuperviseHook};
pub use observe::{
    FailureRecord, MAX_EVENTS, MAX_LAST_FAILURES, MeshSnapshot, RankSnapshot, RuntimeEvent,
    RuntimeSnapshot, cause_kind,
};
pub use procs::{MAX_SPARES, MEMBER_DIM, ProcMesh};
/// The metrics registry a runtime owns (see [`Runtime::with_registry`]).
pub use prometheus_client::registry::Registry as MetricsRegistry;

use supervise::Signal;

struct Inner {
    config: RuntimeConfig,
    ca: ClusterCa,
    fabric: Arc<NetFabric>,
    pending: Arc<Pending>,
    /// The root of the controller's casts.
    caster: Arc<Caster>,
    next_mesh: AtomicU64,
    next_proc: AtomicU64,
    /// Where cast tokens and the seeds of the controller's casts come from.
    entropy: Arc<Entropy>,
    /// Signs the commands relayed down trees of procs.
    signer: crate::relay::RelaySigner,
    /// What the references of each live mesh share (its supervisor's
    /// signals among them). Ordered, as are the other maps here: signals to
    /// every mesh go out in a fixed order.
    meshes: Mutex<BTreeMap<MeshId, Arc<mesh::MeshShared>>>,
    /// Meshes owned by members of other meshes: by owner mesh, (owner rank,
    /// owned mesh).
    owned: Mutex<BTreeMap<MeshId, Vec<(u32, MeshId)>>>,
    leases: leases::Leases,
    /// Allocators whose events are already being routed (by address), which
    /// also see every transport event, in the order they were hooked.
    hooked: Mutex<Vec<(usize, Arc<dyn Allocator>)>>,
    /// A failure that escalated past every owner: the job has stopped.
    job: watch::Sender<Option<MeshFailure>>,
    /// Where procs' output lines go.
    logs: Arc<LogSink>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Snapshots' records, the journal and the metrics.
    observer: Arc<observe::Observer>,
    /// When the runtime started (tokio's clock): the journal's zero.
    started: tokio::time::Instant,
    /// Where the controller's tasks run, when on a thread of their own
    /// (dropped last: it ends the thread and the tasks still on it).
    control: Option<Arc<control::ControlThread>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.lock().expect("tasks lock").drain(..) {
            t.abort();
        }
    }
}

/// The controller: the root of its casts' trees, and the owner of the procs
/// it starts and the meshes it spawns. Cheap to clone.
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
        let bound = |config: RuntimeConfig, control| {
            let credentials = Self::credentials(&config, &ca)?;
            let endpoint = Endpoint::bind(credentials, config.bind, config.endpoint.clone())?;
            Self::on_endpoint(config, ca, endpoint, Entropy::os(), control)
        };
        if !config.control_thread {
            return bound(config, None);
        }
        let control = Arc::new(control::ControlThread::start()?);
        let spin = config.endpoint.control_spin;
        // Binding starts the endpoint's tasks, and `on_endpoint` the
        // controller's: all on the control thread's runtime.
        let runtime = control.enter(|| bound(config, Some(control.clone())))?;
        // The endpoint took its settings (`control_spin` bounded among them).
        control.keep_awake(spin);
        Ok(runtime)
    }

    /// Starts a controller whose endpoint is bound at `config.bind` on a
    /// simulated network (feature `sim`), with every random choice of its
    /// own (cast tokens and seeds) drawn from the network's seed. Give it
    /// an Ed25519 CA, so that datagram sizes replay (see `regent_net::sim`).
    #[cfg(feature = "sim")]
    pub fn start_sim(
        config: RuntimeConfig,
        ca: ClusterCa,
        net: &regent_net::sim::SimNet,
    ) -> Result<Self, MeshError> {
        let credentials = Self::credentials(&config, &ca)?;
        let endpoint = Endpoint::bind_sim(credentials, net, config.bind, config.endpoint.clone())?;
        let entropy = Entropy::seeded(net.random_u64());
        // Every task of a simulation runs on its one runtime.
        Self::on_endpoint(config, ca, endpoint, entropy, None)
    }

    /// The controller's credentials, issued by `ca` for `config.name`.
    fn credentials(
        config: &RuntimeConfig,
        ca: &ClusterCa,
    ) -> Result<regent_net::ProcCredentials, MeshError> {
        let me = ProcId::new(&config.name)?;
        Ok(ca.issue(
            &me,
            regent_net::Role::Controller,
            regent_net::Validity::job(),
        )?)
    }

    /// What every controller does once its endpoint is bound: open its
    /// ports, start its caster and its routing and lease tasks.
    fn on_endpoint(
        config: RuntimeConfig,
        ca: ClusterCa,
        endpoint: Endpoint,
        entropy: Entropy,
        control: Option<Arc<control::ControlThread>>,
    ) -> Result<Self, MeshError> {
        let me = endpoint.proc().clone();
        let actor = ActorId {
            proc: me,
            name: ActorName::new(names::CONTROLLER)?,
            index: 0,
        };
        let replies = endpoint.open_port(actor.port(names::REPLY_PORT))?;
        let events = endpoint.open_port(actor.port(names::EVENT_PORT))?;
        let spawns = endpoint.open_port(actor.port(names::SPAWN_PORT))?;
        let stats = endpoint.open_port(actor.port(names::STATS_PORT))?;
        let transport = endpoint.take_events();
        let (job, _) = watch::channel(None);
        let fabric = Arc::new(NetFabric::new(endpoint, actor.clone()));
        let pending = Arc::new(Pending::default());
        let entropy = Arc::new(entropy);
        let caster = Arc::new(Caster::start(
            fabric.clone(),
            pending.clone(),
            actor,
            entropy.clone(),
        ));
        let logs = LogSink::start(&config.logs);
        let rt = Self {
            inner: Arc::new(Inner {
                logs,
                config,
                ca,
                fabric,
                pending,
                caster,
                next_mesh: AtomicU64::new(0),
                next_proc: AtomicU64::new(0),
                signer: crate::relay::RelaySigner::new(&entropy),
                entropy,
                meshes: Mutex::new(BTreeMap::new()),
                owned: Mutex::new(BTreeMap::new()),
                leases: leases::Leases::default(),
                hooked: Mutex::new(Vec::new()),
                job,
                tasks: Mutex::new(Vec::new()),
                observer: Arc::new(observe::Observer::new()),
                started: tokio::time::Instant::now(),
                control,
            }),
        };
        let weak = Arc::downgrade(&rt.inner);
        let mut tasks = vec![
            tokio::spawn(routing::dispatch_replies(rt.inner.pending.clone(), replies)),
            tokio::spawn(routing::route_member_exits(weak.clone(), events)),
            tokio::spawn(routing::route_spawn_requests(weak.clone(), spawns)),
            tokio::spawn(routing::route_proc_stats(weak.clone(), stats)),
            tokio::spawn(leases::renew(weak.clone())),
        ];
        if let Some(transport) = transport {
            tasks.push(tokio::spawn(routing::route_transport_events(
                weak, transport,
            )));
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

    /// A [`LocalAllocator`](crate::alloc::LocalAllocator) for this
    /// controller: procs as child processes of this one (the same binary,
    /// started by [`crate::bootstrap`]).
    pub fn local_allocator(&self) -> Result<Arc<dyn Allocator>, MeshError> {
        let endpoint = self.endpoint().clone();
        let make = || crate::alloc::LocalAllocator::new(endpoint);
        // Its tasks (the procs' exit watchers) run with the controller's.
        let local = match &self.inner.control {
            Some(c) => c.enter(make),
            None => make(),
        };
        Ok(Arc::new(local?))
    }

    /// Runs `f` where the controller's tasks run: on its control thread
    /// when it has one (see [`RuntimeConfig::control_thread`]), else here.
    /// The operations that start tasks go through here, so that the tasks
    /// they start run with the others.
    pub(crate) async fn on_control<F, T>(&self, f: F) -> Result<T, MeshError>
    where
        F: std::future::Future<Output = Result<T, MeshError>> + Send + 'static,
        T: Send + 'static,
    {
        match &self.inner.control {
            Some(c) => c.run(f).await?,
            None => f.await,
        }
    }

    /// Where procs' output lines go: printed as
    /// [`RuntimeConfig::logs`] says, and handed to
    /// [`LogSink::subscribe`]rs.
    pub fn logs(&self) -> &LogSink {
        &self.inner.logs
    }

    /// How many cast-tree frames the controller has sent itself (each is one
    /// message to one proc): the controller's share of the fan-out.
    pub fn frames_sent(&self) -> u64 {
        self.inner.fabric.commands_sent.load(Ordering::Relaxed)
    }

    /// The live meshes now: owner, policy, generation, state per rank,
    /// restarts, last failures (see `docs/semantics.md`, the admin
    /// endpoint).
    pub fn snapshot(&self) -> RuntimeSnapshot {
        let meshes = self.all_meshes();
        RuntimeSnapshot {
            controller: self.addr().to_string(),
            uptime_ms: self.elapsed_ms(),
            meshes: meshes.iter().map(|m| m.snapshot()).collect(),
            job_failure: self.job_failure().map(|f| f.to_string()),
        }
    }

    /// The journal's events numbered `seq` or later (the journal keeps the
    /// last [`MAX_EVENTS`]).
    pub fn events_since(&self, seq: u64) -> Vec<RuntimeEvent> {
        self.inner.observer.events_since(seq)
    }

    /// Every metric of this runtime in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        self.inner
            .observer
            .render(self.frames_sent(), self.endpoint().traffic())
    }

    /// Runs `f` on this runtime's metrics registry (to register more
    /// metrics, e.g. a training job's; names get the `regent_` prefix).
    pub fn with_registry<T>(&self, f: impl FnOnce(&mut MetricsRegistry) -> T) -> T {
        self.inner.observer.with_registry(f)
    }

    /// Records how long the supervision took to see an injected fault (the
    /// injector knows when it struck): `regent_detection_seconds`.
    pub fn observe_detection(&self, after: std::time::Duration) {
        self.inner.observer.detection(after);
    }

    /// Milliseconds since the runtime started (tokio's clock): the time
    /// axis of snapshots and of the journal.
    pub fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn observer(&self) -> &Arc<observe::Observer> {
        &self.inner.observer
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
        self.spawn_procs_placed(allocator, shape, |_| Placement::default())
            .await
    }

    /// [`Runtime::spawn_procs`] with a placement per proc rank (its own
    /// environment and arguments, e.g. the device it owns), kept when the
    /// proc is replaced.
    pub async fn spawn_procs_placed(
        &self,
        allocator: Arc<dyn Allocator>,
        shape: crate::shape::Shape,
        placement: impl Fn(u32) -> Placement,
    ) -> Result<ProcMesh, MeshError> {
        let placements: Vec<Placement> = (0..shape.len() as u32).map(placement).collect();
        let rt = self.clone();
        self.on_control(async move {
            let procs = rt.allocate(&allocator, placements.clone()).await?;
            Ok(ProcMesh::new(rt, allocator, procs, placements, shape))
        })
        .await
    }

    /// Starts one proc per placement through `allocator` and routes their
    /// events.
    pub(crate) async fn allocate(
        &self,
        allocator: &Arc<dyn Allocator>,
        placements: Vec<Placement>,
    ) -> Result<Vec<AllocatedProc>, MeshError> {
        self.hook_allocator(allocator);
        let batch = self.inner.next_proc.fetch_add(1, Ordering::Relaxed);
        let mut boots = Vec::with_capacity(placements.len());
        for (i, placement) in placements.into_iter().enumerate() {
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
                endpoint: self.inner.config.proc_endpoint(),
                placement,
                owner_key: Some(self.inner.signer.public()),
            });
        }
        let procs = allocator.allocate(boots).await?;
        for p in &procs {
            self.endpoint().add_route(p.addr.clone());
            self.inner.leases.lease(&p.addr);
        }
        Ok(procs)
    }

    /// Routes an allocator's proc events to the meshes, once per allocator.
    fn hook_allocator(&self, allocator: &Arc<dyn Allocator>) {
        let key = Arc::as_ptr(allocator) as *const () as usize;
        {
            let mut hooked = self.inner.hooked.lock().expect("hooked lock");
            if hooked.iter().any(|(k, _)| *k == key) {
                return;
            }
            hooked.push((key, allocator.clone()));
        }
        if let Some(events) = allocator.take_events() {
            let task = tokio::spawn(routing::route_proc_events(
                Arc::downgrade(&self.inner),
                events,
            ));
            self.inner.tasks.lock().expect("tasks lock").push(task);
        }
        if let Some(lines) = allocator.take_logs() {
            let task = self.inner.logs.feed(lines);
            self.inner.tasks.lock().expect("tasks lock").push(task);
        }
    }

    /// Gives up on a proc: no more lease renewals; if it comes back, it is
    /// told to exit.
    pub(crate) fn abandon(&self, proc: &ProcId) {
        self.mark_lost(proc);
        self.inner.leases.abandon(proc);
    }

    /// Records that a proc is dead or unreachable: requests and casts to it
    /// fail at once, and casts route around it.
    pub(crate) fn mark_lost(&self, proc: &ProcId) {
        self.inner.fabric.lost.insert(proc);
    }

    /// Whether a proc is known to be dead or unreachable.
    pub(crate) fn is_lost(&self, proc: &ProcId) -> bool {
        self.inner.fabric.lost.contains(proc)
    }

    /// Renews `proc`'s lease now, which also opens the link and command
    /// stream to it ahead of the first command (warm spares).
    pub(crate) fn warm_up(&self, proc: &ProcId) {
        leases::renew_one(&self.inner, proc);
    }

    /// Stops renewing a proc's lease (it is being stopped).
    pub(crate) fn release(&self, proc: &ProcId) {
        self.inner.leases.release(proc);
        self.endpoint().remove_route(proc);
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
    pub(crate) async fn stop_meshes_on(&self, procs: &std::collections::HashSet<ProcId>) {
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
    pub(crate) async fn stop_owned(&self, parent: MeshId, ranks: Option<&[crate::shape::Rank]>) {
        let children: Vec<MeshId> = {
            let mut owned = self.inner.owned.lock().expect("owned lock");
            let Some(list) = owned.get_mut(&parent) else {
                return;
            };
            let (stop, keep): (Vec<_>, Vec<_>) = list
                .drain(..)
                .partition(|(r, _)| ranks.is_none_or(|ranks| ranks.iter().any(|x| x.0 == *r)));
            *list = keep;
            stop.into_iter().map(|(_, c)| c).collect()
        };
        for child in children {
            self.stop_mesh(child).await;
        }
    }

    /// Sends a command to a proc's runtime, giving up at `deadline`.
    async fn send_command(
        &self,
        proc: &ProcId,
        cmd: ProcCommand,
        deadline: tokio::time::Instant,
    ) -> Result<(), String> {
        let port = proc_port(proc, names::COMMAND_PORT);
        self.inner
            .fabric
            .send_by(&port, Generation(0), &cmd, deadline)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends a command to a proc without waiting for an answer.
    pub(crate) async fn tell(&self, proc: &ProcId, cmd: ProcCommand) {
        let deadline = tokio::time::Instant::now() + self.inner.config.call_timeout;
        if let Err(error) = self.send_command(proc, cmd, deadline).await {
            tracing::warn!(%proc, %error, "could not tell a proc");
        }
    }

    /// Answers a proc's request.
    pub(crate) async fn answer(&self, to: regent_net::PortId, call: u64, body: ReplyBody) {
        self.inner.fabric.reply(to, ProcReply { call, body }).await;
    }

    pub(crate) fn unregister_mesh(&self, id: MeshId) {
        self.inner.meshes.lock().expect("meshes lock").remove(&id);
        self.inner.owned.lock().expect("owned lock").remove(&id);
    }

    /// Hands a signal to a live mesh's supervisor; returns whether the mesh
    /// is live. A supervisor whose queue is full (which its bound makes a
    /// bug) stops the job rather than lose the signal.
    pub(crate) fn signal_mesh(&self, id: MeshId, signal: Signal) -> bool {
        let shared = self
            .inner
            .meshes
            .lock()
            .expect("meshes lock")
            .get(&id)
            .cloned();
        match shared {
            Some(shared) => {
                self.deliver(&shared, signal);
                true
            }
            None => false,
        }
    }

    fn deliver(&self, shared: &mesh::MeshShared, signal: Signal) {
        use tokio::sync::mpsc::error::TrySendError;
        match shared.supervisor.try_send(signal) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(signal)) => {
                let name = shared.info().name.clone();
                tracing::error!(mesh = %name, ?signal, "a mesh supervisor's queue is full; stopping the job rather than losing a signal");
                self.fail_job(MeshFailure {
                    mesh: name,
                    ranks: Vec::new(),
                    cause: crate::policy::FailureCause::Supervisor(
                        "its signal queue overflowed".into(),
                    ),
                    generation: shared.info().generation,
                });
            }
        }
    }

    /// The live meshes' shared states, taken out of the lock.
    fn all_meshes(&self) -> Vec<Arc<mesh::MeshShared>> {
        self.inner
            .meshes
            .lock()
            .expect("meshes lock")
            .values()
            .cloned()
            .collect()
    }

    fn signal_all(&self, signal: impl Fn() -> Signal) {
        let all = self.all_meshes();
        for shared in all {
            self.deliver(&shared, signal());
        }
    }

    /// A failure escalated past every owner: record it and stop every mesh.
    pub(crate) fn fail_job(&self, failure: MeshFailure) {
        if self.inner.job.borrow().is_some() {
            return;
        }
        tracing::error!(%failure, "a failure escalated to the root; stopping the job");
        self.inner.job.send_replace(Some(failure));
        let all = self.all_meshes();
        for shared in all {
            // A full queue cannot take the stop: the mesh stops when its
            // supervisor gets to it (its status says the job failed).
            let _ = shared.supervisor.try_send(Signal::Stop);
        }
    }

    pub(crate) fn pending(&self) -> &Pending {
        &self.inner.pending
    }

    pub(crate) fn caster(&self) -> &Arc<Caster> {
        &self.inner.caster
    }

    pub(crate) fn next_mesh_id(&self) -> MeshId {
        MeshId(self.inner.next_mesh.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh capability for a mesh.
    pub(crate) fn cast_token(&self) -> crate::protocol::CastToken {
        crate::protocol::CastToken::drawn(&self.inner.entropy)
    }

    pub(crate) fn reply_port(&self) -> regent_net::PortId {
        self.inner.fabric.reply_port()
    }

    pub(crate) fn event_port(&self) -> regent_net::PortId {
        self.inner.fabric.me.port(names::EVENT_PORT)
    }

    /// Sends a request to a proc's command port and waits for its answer,
    /// at most the call timeout; a proc known (or found) lost fails at once.
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
        let after = self.inner.config.call_timeout;
        let deadline = tokio::time::Instant::now() + after;
        let (call, answer) = self.inner.pending.request(proc);
        let cmd = build(call);
        if let Err(message) = self.send_command(proc, cmd, deadline).await {
            self.inner.pending.forget(call);
            return Err(MeshError::Spawn {
                mesh: what.to_owned(),
                proc: proc.clone(),
                message,
            });
        }
        let answer = tokio::time::timeout_at(deadline, answer);
        tokio::pin!(answer);
        let lost_procs = &self.inner.fabric.lost;
        loop {
            // Registered before the check, so no loss is missed in between.
            let changed = lost_procs.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_lost(proc) {
                self.inner.pending.forget(call);
                return Err(lost());
            }
            tokio::select! {
                // The answer first: one that came with news of a loss counts.
                biased;
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

    /// Signs `body` and relays it down the tree over `route` (at most the
    /// fan-out's frames from here); with `replies`, waits up to `budget`
    /// for every proc's outcome.
    pub(crate) async fn relay(
        &self,
        route: Vec<crate::relay::Hop>,
        body: crate::relay::RelayBody,
        budget: std::time::Duration,
        replies: bool,
    ) -> Result<crate::relay::RelayOutcome, MeshError> {
        let frame = self
            .inner
            .signer
            .frame(body, route, self.inner.config.fanout, budget)
            .map_err(MeshError::Encode)?;
        let fabric = &*self.inner.fabric;
        Ok(crate::relay::spread(fabric, &self.inner.pending, &frame, replies, None).await)
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
}
