//! Actor meshes as the controller sees them: cheap references that cast,
//! call and reduce through the cast tree, slice without touching members,
//! and watch their mesh's supervision.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::{broadcast, mpsc, watch};

use super::supervise::Signal;
use super::{MembersFailed, MeshError, Runtime};
use crate::actor::{MemberError, MeshActor, decode, encode};
use crate::policy::{Decision, MeshFailure, MeshPolicy};
use crate::protocol::{CastFrame, Collect, Contribution, MeshId, MeshInfo};
use crate::registry::{self, Reducer};
use crate::selection::{DimSpec, Selection};
use crate::shape::{Rank, Shape};

/// Decides, for one failure, what to do instead of the policy (`None`
/// keeps the policy's decision). Runs in the owner's supervisor task: keep it
/// quick.
pub type FailureHook = Arc<dyn Fn(&MeshFailure) -> Option<Decision> + Send + Sync>;

/// How a mesh is supervised, given at spawn.
#[derive(Clone, Default)]
pub struct SpawnOptions {
    pub(crate) policy: MeshPolicy,
    pub(crate) hook: Option<FailureHook>,
    pub(crate) owner: Option<(MeshId, Rank)>,
}

impl fmt::Debug for SpawnOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpawnOptions")
            .field("policy", &self.policy)
            .field("hook", &self.hook.is_some())
            .field("owner", &self.owner)
            .finish()
    }
}

impl SpawnOptions {
    /// The default policy, owned by the controller.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the policy.
    pub fn policy(mut self, policy: MeshPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the owner's hook, which may override the policy per failure.
    pub fn on_failure(
        mut self,
        hook: impl Fn(&MeshFailure) -> Option<Decision> + Send + Sync + 'static,
    ) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Makes the member at `rank` of `parent` this mesh's owner: when this
    /// mesh escalates, that member fails (cause
    /// [`FailureCause::Escalated`](crate::policy::FailureCause::Escalated))
    /// and `parent`'s policy applies. Without an owner mesh, escalation
    /// reaches the root, which stops the job.
    pub fn owned_by<P>(mut self, parent: &ActorMesh<P>, rank: Rank) -> Self {
        self.owner = Some((parent.shared.id, rank));
        self
    }
}

/// Where a mesh's supervision stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshStatus {
    /// All members run (as far as the owner knows).
    Running,
    /// A restart is in progress.
    Restarting,
    /// Stopped: on request (`None`) or by the policy.
    Stopped(Option<MeshFailure>),
    /// Stopped and escalated to the owner's owner.
    Escalated(MeshFailure),
}

impl MeshStatus {
    /// Whether the mesh has stopped for good.
    pub fn is_done(&self) -> bool {
        matches!(self, Self::Stopped(_) | Self::Escalated(_))
    }
}

/// What a mesh's references share with its supervisor.
pub(crate) struct MeshShared {
    pub(crate) id: MeshId,
    /// The current generation's mesh: procs and generation change on
    /// restarts.
    pub(crate) info: RwLock<Arc<MeshInfo>>,
    pub(crate) status: watch::Sender<MeshStatus>,
    pub(crate) failures: broadcast::Sender<MeshFailure>,
    pub(crate) supervisor: mpsc::UnboundedSender<Signal>,
}

impl MeshShared {
    pub(crate) fn info(&self) -> Arc<MeshInfo> {
        self.info.read().expect("mesh info lock").clone()
    }

    /// Asks the supervisor to stop the mesh, and waits until it has (at
    /// once if it already has).
    pub(crate) async fn stop(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.supervisor.send(Signal::StopRequested(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

/// A mesh of actors of type `A`, or a slice of one: a cheap, cloneable
/// reference; slicing touches no member.
pub struct ActorMesh<A> {
    rt: Runtime,
    pub(crate) shared: Arc<MeshShared>,
    /// The view: `None` for the whole mesh.
    view: Option<Shape>,
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorMesh<A> {
    fn clone(&self) -> Self {
        Self {
            rt: self.rt.clone(),
            shared: self.shared.clone(),
            view: self.view.clone(),
            _actor: PhantomData,
        }
    }
}

impl<A> fmt::Debug for ActorMesh<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let info = self.shared.info();
        f.debug_struct("ActorMesh")
            .field("name", &info.name)
            .field("generation", &info.generation)
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

/// The frame that casts `msg` to `selection` of `view`, sent as `origin`
/// with `timeout` to spend. The selection is checked here, so that procs
/// never see one that does not bind.
pub(crate) fn cast_frame<M: serde::Serialize>(
    info: &MeshInfo,
    view: Shape,
    origin: regent_net::ActorId,
    selection: &Selection,
    msg: &M,
    collect: Collect,
    timeout: Duration,
) -> Result<CastFrame, MeshError> {
    selection.bind(&view, 0)?;
    Ok(CastFrame {
        mesh: info.id,
        generation: info.generation,
        origin,
        view,
        selection: selection.clone(),
        seed: rand_seed(),
        procs: (0, info.proc_count()),
        per_proc: info.per_proc,
        payload: encode(msg).map_err(MeshError::Encode)?,
        reply: None,
        collect,
        budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
    })
}

/// What a cast returns: `Ok` once every selected member has the message,
/// else the members that could not be reached.
pub(crate) fn acked(c: Contribution) -> Result<(), MeshError> {
    if c.failed.is_empty() {
        Ok(())
    } else {
        Err(MembersFailed {
            failed: failures(c.failed),
        }
        .into())
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
    ValueMesh {
        shape,
        values,
        failed,
    }
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}

impl<A> ActorMesh<A> {
    pub(crate) fn new(rt: Runtime, shared: Arc<MeshShared>) -> Self {
        Self {
            rt,
            shared,
            view: None,
            _actor: PhantomData,
        }
    }

    /// The mesh's name.
    pub fn name(&self) -> String {
        self.shared.info().name.clone()
    }

    /// The current generation: it grows with every restart.
    pub fn generation(&self) -> regent_net::Generation {
        self.shared.info().generation
    }

    /// The whole mesh's shape.
    pub fn mesh_shape(&self) -> Shape {
        self.shared.info().shape.clone()
    }

    /// The shape of this view.
    pub fn shape(&self) -> Shape {
        match &self.view {
            Some(v) => v.clone(),
            None => self.mesh_shape(),
        }
    }

    /// The procs of the current generation, by proc rank.
    pub fn procs(&self) -> Vec<regent_net::ProcAddr> {
        self.shared.info().procs.clone()
    }

    /// Where the mesh's supervision stands.
    pub fn status(&self) -> MeshStatus {
        self.shared.status.borrow().clone()
    }

    /// Waits until the status satisfies `pred` (or `timeout` passes) and
    /// returns it.
    pub async fn wait_status(
        &self,
        timeout: Duration,
        pred: impl Fn(&MeshStatus) -> bool,
    ) -> Result<MeshStatus, MeshError> {
        let mut rx = self.shared.status.subscribe();
        let wait = async {
            loop {
                let s = rx.borrow_and_update().clone();
                if pred(&s) {
                    return s;
                }
                if rx.changed().await.is_err() {
                    return rx.borrow().clone();
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| MeshError::Timeout {
                what: "waiting for the mesh's status".into(),
                after: timeout,
            })
    }

    /// Every failure the mesh's supervisor receives, as it receives it
    /// (before deciding). A slow reader misses old ones.
    pub fn failures(&self) -> broadcast::Receiver<MeshFailure> {
        self.shared.failures.subscribe()
    }

    /// A view of this one restricted to `range` along `dim`; touches no
    /// member.
    pub fn slice(&self, dim: &str, range: impl RangeBounds<usize>) -> Result<Self, MeshError> {
        Ok(Self {
            view: Some(self.shape().slice(dim, range)?),
            ..self.clone()
        })
    }

    /// A view of this one at `index` along `dim`.
    pub fn at(&self, dim: &str, index: usize) -> Result<Self, MeshError> {
        Ok(Self {
            view: Some(self.shape().at(dim, index)?),
            ..self.clone()
        })
    }

    /// Stops every member (each proc stops its members in reverse rank
    /// order) and ends the mesh's supervision. Procs stay up.
    pub async fn stop(&self) {
        self.shared.stop().await;
    }
}

impl<A: MeshActor> ActorMesh<A> {
    fn frame(
        &self,
        info: &MeshInfo,
        selection: &Selection,
        msg: &A::Msg,
        collect: Collect,
        timeout: Duration,
    ) -> Result<CastFrame, MeshError> {
        if self.status().is_done() {
            return Err(MeshError::Stopped(info.name.clone()));
        }
        let view = self.view.clone().unwrap_or_else(|| info.shape.clone());
        let origin = self.rt.me().clone();
        cast_frame(info, view, origin, selection, msg, collect, timeout)
    }

    /// Delivers `msg` to every selected member, through the cast tree (the
    /// controller sends at most `fanout` messages). Returns once every
    /// selected member has it in its mailbox, or with the members that could
    /// not be reached.
    pub async fn cast(&self, selection: &Selection, msg: &A::Msg) -> Result<(), MeshError> {
        let info = self.shared.info();
        let timeout = self.rt.config().call_timeout;
        let frame = self.frame(&info, selection, msg, Collect::Ack, timeout)?;
        acked(self.rt.root_cast(&info, frame).await)
    }

    /// Sends `msg` to every selected member and gathers the replies by rank.
    /// Members that fail or do not answer within the call timeout are listed
    /// in [`ValueMesh::failed`].
    pub async fn call(
        &self,
        selection: &Selection,
        msg: &A::Msg,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        self.call_within(selection, msg, self.rt.config().call_timeout)
            .await
    }

    /// [`ActorMesh::call`] with its own deadline.
    pub async fn call_within(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        timeout: Duration,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        let info = self.shared.info();
        let frame = self.frame(&info, selection, msg, Collect::Gather, timeout)?;
        let shape = frame.view.clone();
        Ok(gathered(shape, self.rt.root_cast(&info, frame).await))
    }

    /// Sends `msg` to the member at `rank` (of the whole mesh) and returns
    /// its reply.
    pub async fn call_one(&self, rank: Rank, msg: &A::Msg) -> Result<A::Reply, MeshError> {
        let shape = self.mesh_shape();
        let point = shape.point_of(rank).ok_or(MeshError::NoSuchRank(rank))?;
        let selection = Selection::dims(
            point
                .names()
                .iter()
                .zip(point.coords())
                .map(|(n, c)| (n.as_str().to_owned(), DimSpec::Index(*c))),
        )?;
        let whole = Self {
            view: None,
            ..self.clone()
        };
        let vm = whole.call(&selection, msg).await?;
        let mut values = vm.into_result()?;
        values
            .pop()
            .map(|(_, v)| v)
            .ok_or(MeshError::NoSuchRank(rank))
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
        let info = self.shared.info();
        let timeout = self.rt.config().call_timeout;
        let collect = Collect::Reduce(R::NAME.to_owned());
        let frame = self.frame(&info, selection, msg, collect, timeout)?;
        let c = self.rt.root_cast(&info, frame).await;
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
}
