//! The controller's side: a [`Runtime`] owns the cluster CA and the
//! controller's endpoint, starts procs through an [`Allocator`] as a
//! [`ProcMesh`], spawns [`ActorMesh`]es on them, and casts and calls through
//! cast trees whose root it is.

use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::join_all;
use regent_net::{
    ActorId, ActorName, ClusterCa, Endpoint, EndpointConfig, Generation, ProcAddr, ProcId,
};
use serde::de::DeserializeOwned;

use crate::actor::{MemberError, MeshActor, decode, encode};
use crate::alloc::{AllocError, AllocatedProc, Allocator, ProcBoot};
use crate::node::{self, Fabric, Pending};

use crate::proc::{NetFabric, proc_port};
use crate::protocol::{
    CastFrame, Collect, Contribution, MeshId, MeshInfo, ProcCommand, ProcReply, ReplyBody, names,
};
use crate::registry::{self, Reducer};
use crate::selection::{Selection, SelectionError};
use crate::shape::{Rank, Shape, ShapeError};
use crate::tree::DEFAULT_FANOUT;

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
    /// The control plane's settings.
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

struct Inner {
    config: RuntimeConfig,
    ca: ClusterCa,
    fabric: Arc<NetFabric>,
    pending: Arc<Pending>,
    next_mesh: AtomicU64,
    next_proc: AtomicU64,
    dispatcher: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.dispatcher.abort();
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
        let credentials = ca.issue(&me)?;
        let endpoint = Endpoint::bind(credentials, config.bind, config.endpoint.clone())?;
        let actor = ActorId {
            proc: me,
            name: ActorName::new(names::CONTROLLER)?,
            index: 0,
        };
        let mut replies = endpoint.open_port(actor.port(names::REPLY_PORT))?;
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
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                ca,
                fabric: Arc::new(NetFabric::new(endpoint, actor)),
                pending,
                next_mesh: AtomicU64::new(0),
                next_proc: AtomicU64::new(0),
                dispatcher,
            }),
        })
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

    /// How many cast frames the controller has sent itself (each is one
    /// message to one proc): the controller's share of the fan-out.
    pub fn frames_sent(&self) -> u64 {
        self.inner.fabric.commands_sent.load(Ordering::Relaxed)
    }

    /// Starts one proc per point of `shape` through `allocator`, and renews
    /// their lease while the returned [`ProcMesh`] lives.
    pub async fn spawn_procs(
        &self,
        allocator: Arc<dyn Allocator>,
        shape: Shape,
    ) -> Result<ProcMesh, MeshError> {
        let n = shape.len();
        let batch = self.inner.next_proc.fetch_add(1, Ordering::Relaxed);
        let mut boots = Vec::with_capacity(n);
        for i in 0..n {
            let proc = ProcId::new(&format!("p{batch}-{i}"))?;
            let (cert_pem, key_pem, ca_pem) = self.inner.ca.issue(&proc)?.to_pem();
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
        for p in &procs {
            self.endpoint().add_route(p.addr.clone());
        }
        let procs: Arc<[AllocatedProc]> = procs.into();
        let renew = tokio::spawn(renew_leases(self.clone(), procs.clone()));
        Ok(ProcMesh {
            rt: self.clone(),
            allocator,
            procs,
            shape,
            renew,
        })
    }

    async fn request(
        &self,
        proc: &ProcId,
        build: impl FnOnce(u64) -> ProcCommand,
        what: &str,
    ) -> Result<ReplyBody, MeshError> {
        let (call, answer) = self.inner.pending.request();
        let cmd = build(call);
        let fabric = &self.inner.fabric;
        if let Err(e) = fabric
            .endpoint
            .send(
                &fabric.me,
                &proc_port(proc, names::COMMAND_PORT),
                Generation(0),
                cmd,
            )
            .await
        {
            self.inner.pending.forget(call);
            return Err(MeshError::Spawn {
                mesh: what.to_owned(),
                proc: proc.clone(),
                message: e.failure.to_string(),
            });
        }
        let after = self.inner.config.call_timeout;
        match tokio::time::timeout(after, answer).await {
            Ok(Ok(body)) => Ok(body),
            Ok(Err(_)) | Err(_) => {
                self.inner.pending.forget(call);
                Err(MeshError::Timeout {
                    what: format!("{what} on {proc}"),
                    after,
                })
            }
        }
    }

    /// Casts `frame` from the controller, as the root of the tree.
    async fn root_cast(&self, info: &MeshInfo, frame: CastFrame) -> Contribution {
        let fabric = self.inner.fabric.as_ref();
        let d = node::dispatch(fabric, &self.inner.pending, info, &frame, None).await;
        node::collect(&self.inner.pending, d).await
    }
}

async fn renew_leases(rt: Runtime, procs: Arc<[AllocatedProc]>) {
    let period = rt.inner.config.owner_lease / 3;
    let fabric = rt.inner.fabric.clone();
    loop {
        tokio::time::sleep(period).await;
        for p in procs.iter() {
            // A full buffer or a dead proc is not the lease's problem.
            let _ = fabric.endpoint.try_send(
                &fabric.me,
                &proc_port(&p.proc, names::COMMAND_PORT),
                Generation(0),
                ProcCommand::Renew,
            );
        }
    }
}

/// Procs started by a [`Runtime`], with a shape.
pub struct ProcMesh {
    rt: Runtime,
    allocator: Arc<dyn Allocator>,
    procs: Arc<[AllocatedProc]>,
    shape: Shape,
    renew: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for ProcMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcMesh")
            .field("shape", &self.shape)
            .field("procs", &self.procs)
            .finish_non_exhaustive()
    }
}

impl Drop for ProcMesh {
    fn drop(&mut self) {
        self.renew.abort();
    }
}

/// The name of the dimension an [`ActorMesh`] adds to its proc mesh's shape
/// for the members of each proc.
pub const MEMBER_DIM: &str = "actors";

impl ProcMesh {
    /// The procs, by rank.
    pub fn procs(&self) -> &[AllocatedProc] {
        &self.procs
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The allocator that started the procs.
    pub fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.allocator
    }

    /// Spawns `per_proc` members of `A` on every proc, each created from
    /// `args`. The mesh's shape is this proc mesh's, plus a dimension
    /// [`MEMBER_DIM`] of size `per_proc`. Returns once every member has
    /// started; if one fails to start, the others are stopped.
    pub async fn spawn<A: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &A::Args,
    ) -> Result<ActorMesh<A>, MeshError> {
        let rt = &self.rt;
        ActorName::new(name)?;
        let mut dims: Vec<(String, usize)> = self
            .shape
            .dims()
            .map(|(n, s)| (n.as_str().to_owned(), s))
            .collect();
        dims.push((MEMBER_DIM.to_owned(), per_proc as usize));
        let shape = Shape::new(dims)?;
        let id = MeshId(rt.inner.next_mesh.fetch_add(1, Ordering::Relaxed));
        let info = MeshInfo {
            id,
            name: name.to_owned(),
            actor_type: A::NAME.to_owned(),
            shape: shape.clone(),
            per_proc,
            procs: self.procs.iter().map(|p| p.addr.clone()).collect(),
            fanout: rt.inner.config.fanout,
            owner: rt.inner.fabric.reply_port(),
            generation: Generation(0),
        };
        info.validate().map_err(MeshError::Encode)?;
        let args = encode(args).map_err(MeshError::Encode)?;
        let spawns = self.procs.iter().enumerate().map(|(rank, p)| {
            let info = info.clone();
            let args = args.clone();
            let reply_to = rt.inner.fabric.reply_port();
            async move {
                let body = rt
                    .request(
                        &p.proc,
                        |call| ProcCommand::Spawn {
                            call,
                            reply_to,
                            info,
                            proc_rank: rank as u32,
                            args,
                        },
                        name,
                    )
                    .await?;
                match body {
                    ReplyBody::Spawned(Ok(())) => Ok(()),
                    ReplyBody::Spawned(Err(message)) => Err(MeshError::Spawn {
                        mesh: name.to_owned(),
                        proc: p.proc.clone(),
                        message,
                    }),
                    other => Err(MeshError::Spawn {
                        mesh: name.to_owned(),
                        proc: p.proc.clone(),
                        message: format!("unexpected answer {other:?}"),
                    }),
                }
            }
        });
        let results = join_all(spawns).await;
        let mesh = ActorMesh {
            rt: rt.clone(),
            info: Arc::new(info),
            view: shape,
            _actor: PhantomData,
        };
        if let Some(err) = results.into_iter().find_map(Result::err) {
            mesh.stop().await;
            return Err(err);
        }
        Ok(mesh)
    }

    /// Stops every proc (SIGTERM, then SIGKILL after `grace`) and waits for
    /// their exits.
    pub async fn stop(self, grace: Duration) -> Result<(), MeshError> {
        self.renew.abort();
        let stops = self
            .procs
            .iter()
            .map(|p| self.allocator.stop(&p.proc, grace));
        for r in join_all(stops).await {
            r?;
        }
        Ok(())
    }
}

/// A mesh of actors of type `A`, or a slice of one: a cheap, cloneable
/// reference; slicing touches no member.
pub struct ActorMesh<A> {
    rt: Runtime,
    info: Arc<MeshInfo>,
    view: Shape,
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorMesh<A> {
    fn clone(&self) -> Self {
        Self {
            rt: self.rt.clone(),
            info: self.info.clone(),
            view: self.view.clone(),
            _actor: PhantomData,
        }
    }
}

impl<A> fmt::Debug for ActorMesh<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorMesh")
            .field("name", &self.info.name)
            .field("view", &self.view)
            .finish_non_exhaustive()
    }
}

/// Replies of a call, by rank.
#[derive(Debug, Clone)]
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

/// A reduced reply, and the members that did not contribute.
#[derive(Debug, Clone, PartialEq)]
pub struct Reduced<T> {
    /// The combined value, if any member replied.
    pub value: Option<T>,
    /// How many members contributed.
    pub contributors: u32,
    /// Members that did not reply, and why.
    pub failed: Vec<(Rank, MemberError)>,
}

fn failures(failed: Vec<(u32, MemberError)>) -> Vec<(Rank, MemberError)> {
    failed.into_iter().map(|(r, e)| (Rank(r), e)).collect()
}

impl<A: MeshActor> ActorMesh<A> {
    /// The mesh's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The shape of this view.
    pub fn shape(&self) -> &Shape {
        &self.view
    }

    /// The whole mesh's shape.
    pub fn mesh_shape(&self) -> &Shape {
        &self.info.shape
    }

    /// A view of this one restricted to `range` along `dim`; touches no
    /// member.
    pub fn slice(&self, dim: &str, range: impl RangeBounds<usize>) -> Result<Self, MeshError> {
        Ok(Self {
            view: self.view.slice(dim, range)?,
            ..self.clone()
        })
    }

    /// A view of this one at `index` along `dim`.
    pub fn at(&self, dim: &str, index: usize) -> Result<Self, MeshError> {
        Ok(Self {
            view: self.view.at(dim, index)?,
            ..self.clone()
        })
    }

    fn frame(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        collect: Collect,
        timeout: Duration,
    ) -> Result<CastFrame, MeshError> {
        // Check it here, so that the procs never see a selection that does
        // not bind.
        selection.bind(&self.view, 0)?;
        Ok(CastFrame {
            mesh: self.info.id,
            generation: self.info.generation,
            origin: self.rt.inner.fabric.me.clone(),
            view: self.view.clone(),
            selection: selection.clone(),
            seed: rand_seed(),
            procs: (0, self.info.proc_count()),
            per_proc: self.info.per_proc,
            payload: encode(msg).map_err(MeshError::Encode)?,
            reply: None,
            collect,
            budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        })
    }

    /// Delivers `msg` to every selected member, through the cast tree (the
    /// controller sends at most `fanout` messages). Returns once every
    /// selected member has it in its mailbox, or with the members that could
    /// not be reached.
    pub async fn cast(&self, selection: &Selection, msg: &A::Msg) -> Result<(), MeshError> {
        let timeout = self.rt.inner.config.call_timeout;
        let frame = self.frame(selection, msg, Collect::Ack, timeout)?;
        let c = self.rt.root_cast(&self.info, frame).await;
        if c.failed.is_empty() {
            Ok(())
        } else {
            Err(MembersFailed {
                failed: failures(c.failed),
            }
            .into())
        }
    }

    /// Sends `msg` to every selected member and gathers the replies by rank.
    /// Members that fail or do not answer within the call timeout are listed
    /// in [`ValueMesh::failed`].
    pub async fn call(
        &self,
        selection: &Selection,
        msg: &A::Msg,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        self.call_within(selection, msg, self.rt.inner.config.call_timeout)
            .await
    }

    /// [`ActorMesh::call`] with its own deadline.
    pub async fn call_within(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        timeout: Duration,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        let frame = self.frame(selection, msg, Collect::Gather, timeout)?;
        let c = self.rt.root_cast(&self.info, frame).await;
        let mut failed = failures(c.failed);
        let mut values = Vec::with_capacity(c.values.len());
        for (rank, bytes) in c.values {
            match decode::<A::Reply>(&bytes) {
                Ok(v) => values.push((Rank(rank), v)),
                Err(e) => failed.push((Rank(rank), MemberError::BadReply(e))),
            }
        }
        Ok(ValueMesh {
            shape: self.view.clone(),
            values,
            failed,
        })
    }

    /// Sends `msg` to the member at `rank` (of the whole mesh) and returns
    /// its reply.
    pub async fn call_one(&self, rank: Rank, msg: &A::Msg) -> Result<A::Reply, MeshError> {
        let point = self
            .info
            .shape
            .point_of(rank)
            .ok_or(MeshError::NoSuchRank(rank))?;
        let selection = Selection::dims(
            point
                .names()
                .iter()
                .zip(point.coords())
                .map(|(n, c)| (n.as_str().to_owned(), crate::selection::DimSpec::Index(*c))),
        )?;
        let whole = Self {
            view: self.info.shape.clone(),
            ..self.clone()
        };
        let vm = whole.call(&selection, msg).await?;
        let mut values = vm.into_result()?;
        values
            .pop()
            .map(|(_, v)| v)
            .ok_or_else(|| MeshError::Encode("no reply".into()))
    }

    /// Sends `msg` to every selected member and combines the replies with
    /// the reducer `R` inside the cast tree, so that the controller receives
    /// one value per subtree.
    pub async fn reduce<R>(
        &self,
        selection: &Selection,
        msg: &A::Msg,
    ) -> Result<Reduced<A::Reply>, MeshError>
    where
        R: Reducer<Value = A::Reply>,
        A::Reply: DeserializeOwned,
    {
        if registry::reducer(R::NAME).is_none() {
            return Err(MeshError::NoSuchReducer(R::NAME));
        }
        let timeout = self.rt.inner.config.call_timeout;
        let frame = self.frame(selection, msg, Collect::Reduce(R::NAME.to_owned()), timeout)?;
        let c = self.rt.root_cast(&self.info, frame).await;
        let value = match c.reduced {
            Some(bytes) => Some(decode::<A::Reply>(&bytes).map_err(MeshError::Encode)?),
            None => None,
        };
        Ok(Reduced {
            value,
            contributors: c.ok,
            failed: failures(c.failed),
        })
    }

    /// Stops every member (each proc stops its members in reverse rank
    /// order). Procs stay up.
    pub async fn stop(&self) {
        let stops = self.info.procs.iter().map(|p| {
            let mesh = self.info.id;
            let reply_to = self.rt.inner.fabric.reply_port();
            self.rt.request(
                &p.proc,
                move |call| ProcCommand::Stop {
                    call,
                    reply_to,
                    mesh,
                },
                &self.info.name,
            )
        });
        for r in join_all(stops).await {
            if let Err(e) = r {
                tracing::warn!(mesh = %self.info.name, error = %e, "stopping members");
            }
        }
    }
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}
