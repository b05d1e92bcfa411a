//! [`ActorMesh`]: a cheap, cloneable reference to a mesh of actors of type
//! `A` (or a slice of one) that casts, calls and reduces through the mesh's
//! cast tree, wherever it is held: by the controller that owns the mesh, by
//! a member for its own mesh ([`Member::peers`]), for a mesh it owns
//! ([`Member::spawn_mesh`]), or for one it was handed ([`MeshRef`],
//! [`Member::bind`]). The ordering, deadline and failure rules are the same
//! on every side (`docs/semantics.md` §4.3); only the controller's
//! references stop the mesh and see its owner's view of supervision.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

use crate::actor::MeshActor;
use crate::cast::{self, Caster, Delivered, Reduced, ValueMesh};
use crate::error::{MemberError, MeshError};
use crate::member::{KnownMesh, Member};
use crate::policy::{MeshFailure, MeshStatus};
use crate::protocol::{Collect, MeshId, MeshInfo, ReplyBody, SpawnChild, encode};
use crate::reducer::{self, Reducer};
use crate::selection::{Constraint, DimSpec, Selection};
use crate::shape::{Rank, Shape};

/// Where a mesh reference finds its mesh (see the module docs).
pub(crate) trait Target: Send + Sync + 'static {
    /// The current generation's info, as this side knows it.
    fn info(&self) -> Arc<MeshInfo>;
    /// The root of this side's casts.
    fn caster(&self) -> &Caster;
    /// The default deadline of casts and calls.
    fn timeout(&self) -> Duration;
    /// Where supervision stands, as this side knows it.
    fn status(&self) -> watch::Receiver<MeshStatus>;
    /// Failures as this side learns them.
    fn failures(&self) -> broadcast::Receiver<MeshFailure>;
    /// Stops the mesh, if this side may.
    fn stop(&self) -> BoxFuture<'_, Result<(), MeshError>>;
    /// Counts a cast (`gathers`: a call or reduction) rooted here, where
    /// this side keeps counts (the controller's metrics).
    fn count(&self, _gathers: bool) {}
}

/// How calls and casts retry when members are lost: wait until the mesh
/// runs again in a newer generation, then send again (to every selected
/// member: a retried cast reaches again the members that had it, so retry
/// only idempotent messages), at most `attempts` times and never past
/// `deadline` from the first try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Tries after the first.
    pub attempts: u32,
    /// The budget of all tries and waits together.
    pub deadline: Duration,
}

impl Retry {
    /// At most `attempts` retries within `deadline`.
    pub fn new(attempts: u32, deadline: Duration) -> Self {
        Self { attempts, deadline }
    }
}

/// A mesh of actors of type `A`, or a slice of one (see the module docs).
pub struct ActorMesh<A> {
    target: Arc<dyn Target>,
    /// The view: `None` for the whole mesh.
    view: Option<Shape>,
    timeout: Option<Duration>,
    retry: Option<Retry>,
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorMesh<A> {
    fn clone(&self) -> Self {
        Self {
            target: self.target.clone(),
            view: self.view.clone(),
            timeout: self.timeout,
            retry: self.retry,
            _actor: PhantomData,
        }
    }
}

impl<A> fmt::Debug for ActorMesh<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let info = self.target.info();
        f.debug_struct("ActorMesh")
            .field("name", &info.name)
            .field("generation", &info.generation)
            .field("view", &self.view)
            .finish_non_exhaustive()
    }
}

impl<A> ActorMesh<A> {
    pub(crate) fn new(target: Arc<dyn Target>) -> Self {
        Self {
            target,
            view: None,
            timeout: None,
            retry: None,
            _actor: PhantomData,
        }
    }

    /// The mesh's identity.
    pub fn id(&self) -> MeshId {
        self.target.info().id
    }

    /// The mesh's name.
    pub fn name(&self) -> String {
        self.target.info().name.clone()
    }

    /// The current generation: it grows with every restart.
    pub fn generation(&self) -> regent_net::Generation {
        self.target.info().generation
    }

    /// The whole mesh's shape.
    pub fn mesh_shape(&self) -> Shape {
        self.target.info().shape.clone()
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
        self.target.info().procs.clone()
    }

    /// Where the mesh's supervision stands.
    pub fn status(&self) -> MeshStatus {
        self.target.status().borrow().clone()
    }

    /// Waits until the status satisfies `pred` (or `timeout` passes) and
    /// returns it.
    pub async fn wait_status(
        &self,
        timeout: Duration,
        pred: impl Fn(&MeshStatus) -> bool,
    ) -> Result<MeshStatus, MeshError> {
        let mut rx = self.target.status();
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

    /// Every failure this side learns of, as it learns it (the owner: before
    /// deciding). The receiver is bounded: a reader that falls behind gets
    /// `RecvError::Lagged(n)` with the count it missed — never a silent
    /// loss. An owner that must see every failure decides in
    /// [`SpawnOptions::supervise`](crate::SpawnOptions::supervise) (or
    /// [`MeshActor::supervise`] for a mesh a member owns), which is awaited.
    pub fn failures(&self) -> broadcast::Receiver<MeshFailure> {
        self.target.failures()
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

    /// This reference with its own default deadline for casts and calls.
    pub fn within(&self, timeout: Duration) -> Self {
        Self {
            timeout: Some(timeout),
            ..self.clone()
        }
    }

    /// This reference, retrying its casts and calls in the next generation
    /// when members are lost (see [`Retry`]).
    pub fn with_retry(&self, retry: Retry) -> Self {
        Self {
            retry: Some(retry),
            ..self.clone()
        }
    }

    /// Stops every member (each proc stops its members in reverse rank
    /// order) and ends the mesh's supervision; procs stay up. Only the
    /// controller's references (and the owning member's, for a mesh it
    /// owns) may stop a mesh.
    pub async fn stop(&self) -> Result<(), MeshError> {
        self.target.stop().await
    }

    /// A serializable reference to this mesh, to hand to members (in their
    /// args or a message); they use it through [`Member::bind`].
    pub fn reference(&self) -> MeshRef<A> {
        MeshRef {
            info: (*self.target.info()).clone(),
            _actor: PhantomData,
        }
    }

    fn deadline(&self) -> Duration {
        self.timeout.unwrap_or_else(|| self.target.timeout())
    }

    /// Waits (within `until`) for the mesh to run in a generation newer than
    /// `after`; returns whether it does.
    async fn next_generation(
        &self,
        after: regent_net::Generation,
        until: tokio::time::Instant,
    ) -> bool {
        let mut rx = self.target.status();
        loop {
            let running = matches!(*rx.borrow_and_update(), MeshStatus::Running);
            if running && self.target.info().generation > after {
                return true;
            }
            if rx.borrow().is_done() {
                return false;
            }
            match tokio::time::timeout_at(until, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }
}

/// Whether a failure means the member's life is gone (retrying in the next
/// generation can help), rather than a bad message or reply.
fn lost(e: &MemberError) -> bool {
    matches!(
        e,
        MemberError::NotRunning(_)
            | MemberError::Timeout
            | MemberError::Failed(_)
            | MemberError::Panicked(_)
    )
}

impl<A: MeshActor> ActorMesh<A> {
    async fn root(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        collect: Collect,
        wait: bool,
        timeout: Duration,
    ) -> Result<(Shape, crate::protocol::Contribution, regent_net::Generation), MeshError> {
        let status = self.status();
        if status.is_done() {
            return Err(MeshError::Stopped(self.name()));
        }
        let info = self.target.info();
        let caster = self.target.caster();
        let collect_kind = collect.clone();
        let cast = cast::frame(
            &info,
            self.view.as_ref(),
            caster,
            selection,
            msg,
            collect,
            timeout,
        )?;
        let shape = cast.frame.view.clone();
        let generation = info.generation;
        self.target.count(!matches!(collect_kind, Collect::Ack));
        let c = caster.cast(info, cast, wait).await?.unwrap_or_default();
        Ok((shape, c, generation))
    }

    /// Runs `once` and, with a [`Retry`], runs it again in the next
    /// generation while members are lost.
    async fn retried<T, F>(
        &self,
        mut once: impl FnMut(Duration) -> F,
        failed: impl Fn(&T) -> bool,
    ) -> Result<T, MeshError>
    where
        F: std::future::Future<Output = Result<(T, regent_net::Generation), MeshError>>,
    {
        let Some(retry) = self.retry else {
            return once(self.deadline()).await.map(|(t, _)| t);
        };
        let until = tokio::time::Instant::now() + retry.deadline;
        let mut tries = 0;
        loop {
            // No try runs past the retry's deadline.
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let (t, generation) = once(self.deadline().min(left)).await?;
            if !failed(&t) || tries >= retry.attempts {
                return Ok(t);
            }
            tries += 1;
            if !self.next_generation(generation, until).await {
                return Ok(t);
            }
        }
    }

    /// Delivers `msg` to every selected member, through the cast tree (the
    /// sender sends at most `fanout` frames). Returns once every selected
    /// member has it in its mailbox, or with the members that could not be
    /// reached ([`Delivered::failed`]). Casts from one sender arrive in the
    /// order they were sent, however many are in flight.
    pub async fn cast(&self, selection: &Selection, msg: &A::Msg) -> Result<Delivered, MeshError> {
        self.retried(
            move |timeout| async move {
                let (_, c, g) = self
                    .root(selection, msg, Collect::Ack, true, timeout)
                    .await?;
                Ok((Delivered::from(c, g), g))
            },
            |d: &Delivered| d.failed().iter().any(|(_, e)| lost(e)),
        )
        .await
    }

    /// Hands `msg` to the cast tree for every selected member and returns
    /// without waiting for any member (fire and forget): once it returns,
    /// the cast is ordered after this sender's earlier casts. The sender
    /// learns nothing of members it could not reach (the deaths of members
    /// reach the owner's supervision as always).
    pub async fn cast_nowait(&self, selection: &Selection, msg: &A::Msg) -> Result<(), MeshError> {
        self.root(selection, msg, Collect::Ack, false, self.deadline())
            .await
            .map(|_| ())
    }

    /// [`ActorMesh::cast`] with its own deadline.
    pub async fn cast_within(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        timeout: Duration,
    ) -> Result<Delivered, MeshError> {
        self.within(timeout).cast(selection, msg).await
    }

    /// Sends `msg` to every selected member and gathers the replies by rank.
    /// Members that fail or do not answer within the deadline are listed in
    /// [`ValueMesh::failed`].
    pub async fn call(
        &self,
        selection: &Selection,
        msg: &A::Msg,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        self.retried(
            move |timeout| async move {
                let (shape, c, g) = self
                    .root(selection, msg, Collect::Gather, true, timeout)
                    .await?;
                Ok((cast::gathered(shape, c), g))
            },
            |v: &ValueMesh<A::Reply>| v.failed().iter().any(|(_, e)| lost(e)),
        )
        .await
    }

    /// [`ActorMesh::call`] with its own deadline.
    pub async fn call_within(
        &self,
        selection: &Selection,
        msg: &A::Msg,
        timeout: Duration,
    ) -> Result<ValueMesh<A::Reply>, MeshError> {
        self.within(timeout).call(selection, msg).await
    }

    /// Sends `msg` to the member at `rank` (of the whole mesh) and returns
    /// its reply.
    pub async fn call_one(&self, rank: Rank, msg: &A::Msg) -> Result<A::Reply, MeshError> {
        // The member's point as a constraint list over the mesh's own names
        // (shared, not made again from their text on every call).
        let selection = {
            let info = self.target.info();
            let coords = info
                .shape
                .layout()
                .coords_of(rank)
                .ok_or(MeshError::NoSuchRank(rank))?;
            Selection::Dims(
                info.shape
                    .names()
                    .iter()
                    .zip(coords)
                    .map(|(dim, c)| Constraint {
                        dim: dim.clone(),
                        spec: DimSpec::Index(c),
                    })
                    .collect(),
            )
        };
        let whole;
        let mesh = match self.view {
            None => self,
            Some(_) => {
                whole = Self {
                    view: None,
                    ..self.clone()
                };
                &whole
            }
        };
        let vm = mesh.call(&selection, msg).await?;
        let mut values = vm.into_result()?;
        values
            .pop()
            .map(|(_, v)| v)
            .ok_or(MeshError::NoSuchRank(rank))
    }

    /// Sends `msg` to every selected member and combines the replies with
    /// the reducer `R` inside the cast tree, so that the caller receives one
    /// value per subtree.
    pub async fn reduce<R>(
        &self,
        selection: &Selection,
        msg: &A::Msg,
    ) -> Result<Reduced<A::Reply>, MeshError>
    where
        R: Reducer<Value = A::Reply>,
        A::Reply: DeserializeOwned,
    {
        if reducer::reducer(R::NAME).is_none() {
            return Err(MeshError::NoSuchReducer(R::NAME));
        }
        self.retried(
            move |timeout| async move {
                let collect = Collect::Reduce(R::NAME.to_owned());
                let (_, c, g) = self.root(selection, msg, collect, true, timeout).await?;
                Ok((cast::reduced(c)?, g))
            },
            |r: &Reduced<A::Reply>| r.failed().iter().any(|(_, e)| lost(e)),
        )
        .await
    }

    /// Runs `step` and, while it fails because members were lost (an error
    /// of [`MeshError::Members`] or [`MeshError::Stopped`] is not retried),
    /// waits for the mesh to run in a newer generation and runs it again —
    /// at most `retry.attempts` times within `retry.deadline`. For training
    /// loops: a step that did not complete on every member is redone in the
    /// next generation.
    pub async fn retry_in_next_generation<T, F>(
        &self,
        retry: Retry,
        mut step: impl FnMut() -> F,
    ) -> Result<T, MeshError>
    where
        F: std::future::Future<Output = Result<T, MeshError>>,
    {
        let until = tokio::time::Instant::now() + retry.deadline;
        let mut tries = 0;
        loop {
            let generation = self.generation();
            match step().await {
                Err(MeshError::Members(f))
                    if tries < retry.attempts && f.failed.iter().any(|(_, e)| lost(e)) =>
                {
                    tries += 1;
                    if !self.next_generation(generation, until).await {
                        return Err(MeshError::Members(f));
                    }
                }
                other => return other,
            }
        }
    }
}

/// A serializable reference to a mesh: its identity, capability and where
/// its procs were when the reference was made. Inert until a member binds
/// it ([`Member::bind`]); the reference grants the right to cast to the
/// mesh, so hand it only to whom may.
#[derive(Serialize, Deserialize)]
pub struct MeshRef<A> {
    info: MeshInfo,
    #[serde(skip)]
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for MeshRef<A> {
    fn clone(&self) -> Self {
        Self {
            info: self.info.clone(),
            _actor: PhantomData,
        }
    }
}

impl<A> fmt::Debug for MeshRef<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeshRef")
            .field("name", &self.info.name)
            .field("generation", &self.info.generation)
            .finish_non_exhaustive()
    }
}

/// The most meshes one proc knows (hosted, owned and bound together).
pub const MAX_KNOWN_MESHES: usize = 4096;

/// A mesh as a member's proc knows it.
struct PeerTarget {
    known: Arc<KnownMesh>,
    caster: Arc<Caster>,
    timeout: Duration,
    /// The owner member may stop it (a mesh it owns).
    stop: Option<Member>,
}

impl Target for PeerTarget {
    fn info(&self) -> Arc<MeshInfo> {
        self.known.info()
    }

    fn caster(&self) -> &Caster {
        &self.caster
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn status(&self) -> watch::Receiver<MeshStatus> {
        self.known.status.subscribe()
    }

    fn failures(&self) -> broadcast::Receiver<MeshFailure> {
        self.known.failures.subscribe()
    }

    fn stop(&self) -> BoxFuture<'_, Result<(), MeshError>> {
        Box::pin(async move {
            match &self.stop {
                Some(_) => Err(MeshError::Unavailable(
                    "a member stops the meshes it owns by ending its own life (they stop with it)"
                        .into(),
                )),
                None => Err(MeshError::Unavailable(
                    "only the mesh's owner may stop it".into(),
                )),
            }
        })
    }
}

impl Member {
    fn peer_target(&self, known: Arc<KnownMesh>, owner: bool) -> Arc<dyn Target> {
        Arc::new(PeerTarget {
            known,
            caster: self.inner.services.caster.clone(),
            timeout: self.inner.services.timeout,
            stop: owner.then(|| self.clone()),
        })
    }

    /// This member's own mesh, to cast, call and send to its peers (a
    /// one-rank selection is a point-to-point send), with the controller's
    /// ordering, deadline and failure rules and without the controller in
    /// the data path. `A` must be the mesh's actor type.
    pub fn peers<A: MeshActor>(&self) -> Result<ActorMesh<A>, MeshError> {
        let known = self
            .known()
            .ok_or_else(|| MeshError::Stopped(self.mesh().to_owned()))?;
        let actor_type = known.info().actor_type.clone();
        if actor_type != A::NAME {
            return Err(MeshError::WrongType {
                mesh: self.mesh().to_owned(),
                expected: actor_type,
                found: A::NAME,
            });
        }
        Ok(ActorMesh::new(self.peer_target(known, false)))
    }

    /// A mesh this member was handed a reference to. Its procs and
    /// generation are those of the reference (or newer, if this proc knows
    /// the mesh); after a restart that moved the mesh, get a fresh
    /// reference.
    pub fn bind<A: MeshActor>(&self, mesh: &MeshRef<A>) -> Result<ActorMesh<A>, MeshError> {
        let id = mesh.info.id;
        mesh.info.validate().map_err(MeshError::Encode)?;
        let known = {
            let mut table = self.inner.services.known.lock().expect("known meshes lock");
            if !table.contains_key(&id) && table.len() >= MAX_KNOWN_MESHES {
                return Err(MeshError::Unavailable(format!(
                    "this proc already knows {MAX_KNOWN_MESHES} meshes"
                )));
            }
            table
                .entry(id)
                .or_insert_with(|| KnownMesh::new(mesh.info.clone()))
                .clone()
        };
        if known.info().generation < mesh.info.generation {
            known.update(mesh.info.clone());
        }
        Ok(ActorMesh::new(self.peer_target(known, false)))
    }

    /// Spawns a mesh of `B` that this member owns, on the procs of its own
    /// mesh (`per_proc` members on each), supervised by the controller with
    /// `policy` — and asking this member's [`MeshActor::supervise`] per
    /// failure. When that mesh escalates, this member fails; when this
    /// member exits or is restarted, that mesh stops.
    pub async fn spawn_mesh<B: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &B::Args,
        policy: crate::policy::MeshPolicy,
    ) -> Result<ActorMesh<B>, MeshError> {
        let services = &self.inner.services;
        let refused = |message: String| MeshError::SpawnChild {
            mesh: name.to_owned(),
            message,
        };
        let (call, answer) = services.pending.request(self.inner.controller.proc());
        let request = SpawnChild {
            call,
            reply_to: services.fabric.reply_port(),
            parent: self.inner.mesh,
            rank: self.rank().0,
            born: self.inner.start.generation,
            name: name.to_owned(),
            actor_type: B::NAME.to_owned(),
            per_proc,
            args: encode(args).map_err(MeshError::Encode)?,
            policy: policy.into(),
        };
        if let Err(e) = services
            .fabric
            .spawn_child(self.inner.controller.clone(), request)
            .await
        {
            services.pending.forget(call);
            return Err(refused(format!("could not reach the controller: {e}")));
        }
        let body = match tokio::time::timeout(services.timeout, answer).await {
            Ok(Ok(body)) => body,
            _ => {
                services.pending.forget(call);
                return Err(MeshError::Timeout {
                    what: format!("spawning {name}"),
                    after: services.timeout,
                });
            }
        };
        match body {
            ReplyBody::ChildSpawned(Ok(info)) => {
                let id = info.id;
                let known = {
                    let mut table = services.known.lock().expect("known meshes lock");
                    table
                        .entry(id)
                        .or_insert_with(|| KnownMesh::new(info))
                        .clone()
                };
                Ok(ActorMesh::new(self.peer_target(known, true)))
            }
            ReplyBody::ChildSpawned(Err(message)) => Err(refused(message)),
            other => Err(refused(format!("unexpected answer {other:?}"))),
        }
    }
}
