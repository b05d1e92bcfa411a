//! Child specifications with start functions, and [`Guarded`], the wrapper
//! that turns panics of a worker's callbacks into [`ExitReason::Panicked`].
//!
//! [`ExitReason::Panicked`]: crate::ExitReason::Panicked

use std::any::{Any, type_name};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SpawnErr, SupervisionEvent};

use crate::error::StartError;
use crate::spec::{ChildId, ChildKey, ChildPolicy, Incarnation, Restart, Shutdown};

/// What a start function receives.
#[derive(Debug, Clone)]
pub struct StartContext {
    pub(crate) supervisor: ActorCell,
    pub(crate) key: ChildKey,
    pub(crate) incarnation: Incarnation,
}

impl StartContext {
    /// The actor to link the started actor to (spawn it with
    /// `spawn_linked(.., ctx.supervisor())`); if it is not, it is linked
    /// afterwards. This is the supervisor's exit inbox, which hands the
    /// child's exit to the supervisor in mailbox order, not the supervisor
    /// itself; [`crate::SupervisorRef::cell`] is the supervisor.
    pub fn supervisor(&self) -> ActorCell {
        self.supervisor.clone()
    }

    /// The child being started.
    pub fn key(&self) -> &ChildKey {
        &self.key
    }

    /// The incarnation being started (0, 1, 2, ... across restarts of the
    /// whole supervisor).
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }
}

/// The future a start function returns: the started actor, or why it did not
/// start.
pub type StartFuture = BoxFuture<'static, Result<ActorCell, StartError>>;

pub(crate) type StartFn = Arc<dyn Fn(StartContext) -> StartFuture + Send + Sync>;
pub(crate) type DynArgs = Arc<dyn Any + Send + Sync>;
pub(crate) type DynStartFn = Arc<dyn Fn(StartContext, DynArgs) -> StartFuture + Send + Sync>;

/// A child specification: a [`ChildPolicy`] and the function that starts the
/// child.
#[derive(Clone)]
pub struct ChildSpec {
    pub(crate) policy: ChildPolicy,
    pub(crate) start: StartFn,
}

impl fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildSpec")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl ChildSpec {
    /// A child from a policy and a start function, which must spawn an actor
    /// linked to [`StartContext::supervisor`].
    pub fn new(
        policy: ChildPolicy,
        start: impl Fn(StartContext) -> StartFuture + Send + Sync + 'static,
    ) -> Self {
        Self {
            policy,
            start: Arc::new(start),
        }
    }

    /// A permanent worker: each start calls `make` for a fresh actor and its
    /// arguments and spawns it (wrapped in [`Guarded`]) linked to the
    /// supervisor.
    pub fn worker<A, F>(id: impl Into<ChildId>, make: F) -> Self
    where
        A: Actor,
        F: Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    {
        Self::new(ChildPolicy::worker(id), move |ctx| {
            let (actor, args) = make();
            spawn_guarded(ctx, actor, args)
        })
    }

    /// Sets the restart type.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.policy.restart = restart;
        self
    }

    /// Sets the shutdown.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.policy.shutdown = shutdown;
        self
    }

    /// Sets the significant flag.
    pub fn significant(mut self, significant: bool) -> Self {
        self.policy.significant = significant;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &ChildPolicy {
        &self.policy
    }
}

/// The child template of a `simple_one_for_one` supervisor: a policy and a
/// start function that takes the arguments given to
/// [`crate::SupervisorRef::start_dynamic_child`].
#[derive(Clone)]
pub struct ChildTemplate {
    pub(crate) policy: ChildPolicy,
    pub(crate) start: DynStartFn,
}

impl fmt::Debug for ChildTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildTemplate")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl ChildTemplate {
    /// A template from a policy and a start function over arguments of type
    /// `T`. The arguments are kept for restarts.
    pub fn new<T, F>(policy: ChildPolicy, start: F) -> Self
    where
        T: Any + Send + Sync,
        F: Fn(StartContext, &T) -> StartFuture + Send + Sync + 'static,
    {
        Self {
            policy,
            start: Arc::new(move |ctx, args: DynArgs| match args.downcast_ref::<T>() {
                Some(args) => start(ctx, args),
                None => futures::future::ready(Err(StartError::WrongArguments {
                    expected: type_name::<T>(),
                }))
                .boxed(),
            }),
        }
    }

    /// A template of permanent workers: `make` turns the arguments into a
    /// fresh actor and its own arguments.
    pub fn worker<T, A, F>(id: impl Into<ChildId>, make: F) -> Self
    where
        T: Any + Send + Sync,
        A: Actor,
        F: Fn(&T) -> (A, A::Arguments) + Send + Sync + 'static,
    {
        Self::new(ChildPolicy::worker(id), move |ctx, args: &T| {
            let (actor, args) = make(args);
            spawn_guarded(ctx, actor, args)
        })
    }

    /// Sets the restart type.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.policy.restart = restart;
        self
    }

    /// Sets the shutdown.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.policy.shutdown = shutdown;
        self
    }

    /// Sets the significant flag.
    pub fn significant(mut self, significant: bool) -> Self {
        self.policy.significant = significant;
        self
    }
}

/// Spawns `actor` wrapped in [`Guarded`], linked to the supervisor of `ctx`.
pub fn spawn_guarded<A: Actor>(ctx: StartContext, actor: A, args: A::Arguments) -> StartFuture {
    async move {
        match Actor::spawn_linked(None, Guarded(actor), args, ctx.supervisor).await {
            Ok((actor, _)) => Ok(actor.get_cell()),
            Err(e) => Err(start_error(e)),
        }
    }
    .boxed()
}

/// Classifies a spawn failure.
pub(crate) fn start_error(e: SpawnErr) -> StartError {
    match e {
        SpawnErr::StartupFailed(err) => match err.downcast_ref::<Panic>() {
            Some(p) => StartError::Panicked(p.0.clone()),
            None => StartError::Failed(err.to_string()),
        },
        other => StartError::Failed(other.to_string()),
    }
}

/// A panic caught in an actor callback by [`Guarded`]; its message.
#[derive(Debug, Clone, thiserror::Error)]
#[error("panicked: {0}")]
pub struct Panic(pub String);

impl Panic {
    pub(crate) fn from_payload(payload: Box<dyn Any + Send>) -> Self {
        let msg = match payload.downcast::<String>() {
            Ok(s) => *s,
            Err(payload) => match payload.downcast::<&'static str>() {
                Ok(s) => (*s).to_owned(),
                Err(_) => "a panic with a payload that is not a string".to_owned(),
            },
        };
        Self(msg)
    }
}

async fn guard<T>(
    f: impl Future<Output = Result<T, ActorProcessingErr>>,
) -> Result<T, ActorProcessingErr> {
    match AssertUnwindSafe(f).catch_unwind().await {
        Ok(result) => result,
        Err(payload) => Err(Box::new(Panic::from_payload(payload))),
    }
}

/// Wraps an actor so that a panic in any of its callbacks (`pre_start`,
/// `post_start`, `handle`, `handle_supervisor_evt`, `post_stop`) becomes an
/// error of type [`Panic`], which the supervisor reports as
/// [`ExitReason::Panicked`] rather than `Failed`.
///
/// [`ExitReason::Panicked`]: crate::ExitReason::Panicked
#[derive(Debug, Clone)]
pub struct Guarded<A>(pub A);

impl<A: Actor> Actor for Guarded<A> {
    type Msg = A::Msg;
    type State = A::State;
    type Arguments = A::Arguments;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        guard(self.0.pre_start(myself, args)).await
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        guard(self.0.post_start(myself, state)).await
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        guard(self.0.post_stop(myself, state)).await
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        guard(self.0.handle(myself, message, state)).await
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        guard(self.0.handle_supervisor_evt(myself, message, state)).await
    }
}
