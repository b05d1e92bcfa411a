//! The supervisor actor: runs a [`Machine`] over ractor actors, performing
//! its actions (start, stop with timeout then kill, timers, replies) and
//! feeding back what happens (exits, start outcomes).
//!
//! # One mailbox
//!
//! ractor gives an actor four ports and always takes the stop port before
//! supervision events, and supervision events before ordinary messages. An
//! OTP supervisor has one mailbox. So that requests, timers and exits keep
//! their arrival order, everything the machine reacts to arrives as an
//! ordinary message:
//!
//! - children are linked not to the supervisor but to its **exit inbox**, a
//!   small actor linked to the supervisor that never blocks: it turns each
//!   child's supervision event into a [`SupervisorMsg::ChildExit`] message at
//!   once, so an exit takes its place in the queue when it happens, not when
//!   the supervisor is next free;
//! - timers are messages the supervisor sends itself;
//! - [`SupervisorRef::stop`], and a parent supervisor stopping a child
//!   supervisor, send [`SupervisorMsg::Stop`] behind what already waits.
//!
//! The exit inbox is one long-lived actor per supervisor (one extra message
//! per exit, no task per message). Killing the supervisor kills the inbox and,
//! through ractor's links, the children.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use ractor::concurrency::JoinHandle;
use ractor::rpc::CallResult;
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use tokio::sync::broadcast;

use crate::child::{ChildSpec, ChildTemplate, DynArgs, DynStartFn, Panic, StartContext, StartFn};
use crate::error::{ChildError, StartError};
use crate::machine::{
    Action, ChildStatus, Event, ExitCause, Machine, Reply, Report, Request, RequestId, TimerId,
};
use crate::reason::ExitReason;
use crate::spec::SpecError;
use crate::spec::{
    ChildCounts, ChildId, ChildKey, ChildKind, ChildPolicy, Incarnation, InstanceId, Shutdown,
    SupervisorFlags,
};

/// The stop reason a supervisor gives children it stops, and gives itself when
/// it shuts down; classified as [`ExitReason::Shutdown`].
pub const SHUTDOWN_REASON: &str = "shutdown";

/// How long a killed child may take to finish before the supervisor reports
/// it stuck ([`Observed::ChildStuck`]), by default; see
/// [`SupervisorSpec::kill_wait`].
pub const KILL_WAIT: Duration = Duration::from_secs(10);

/// The bounds [`SupervisorSpec::kill_wait`] clamps to: a shorter wait would
/// report a child that is merely being scheduled, a longer one would hide a
/// stuck child from its owner.
const KILL_WAIT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(10), Duration::from_secs(3600));

/// What a supervisor was configured with: flags, a name for logs, the child
/// specifications (or the template of a `simple_one_for_one` supervisor) and an
/// optional observer.
#[derive(Clone)]
pub struct SupervisorSpec {
    name: String,
    flags: SupervisorFlags,
    children: Vec<ChildSpec>,
    template: Option<ChildTemplate>,
    observer: Option<broadcast::Sender<Observation>>,
    kill_wait: Duration,
}

impl fmt::Debug for SupervisorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SupervisorSpec")
            .field("name", &self.name)
            .field("flags", &self.flags)
            .field("children", &self.children)
            .field("template", &self.template)
            .field("kill_wait", &self.kill_wait)
            .finish_non_exhaustive()
    }
}

impl SupervisorSpec {
    /// A supervisor with these flags and no children yet. The name appears in
    /// logs and observations; it is not registered anywhere.
    pub fn new(name: impl Into<String>, flags: SupervisorFlags) -> Self {
        Self {
            name: name.into(),
            flags,
            children: Vec::new(),
            template: None,
            observer: None,
            kill_wait: KILL_WAIT,
        }
    }

    /// Adds a child; children start in the order they are added.
    pub fn child(mut self, child: ChildSpec) -> Self {
        self.children.push(child);
        self
    }

    /// Sets the template of a `simple_one_for_one` supervisor.
    pub fn template(mut self, template: ChildTemplate) -> Self {
        self.template = Some(template);
        self
    }

    /// Sends an [`Observation`] of every start, exit, stop and restart
    /// decision to `observer`. A slow receiver misses old observations (the
    /// channel is bounded) but never slows the supervisor down.
    pub fn observer(mut self, observer: broadcast::Sender<Observation>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// How long a child that was killed (its shutdown timeout ran out, or
    /// `BrutalKill`) may take to finish before the supervisor reports it
    /// stuck with [`Observed::ChildStuck`], and how often it repeats the
    /// report while the child still runs. Default [`KILL_WAIT`] (10 s);
    /// clamped to 10 ms ..= 1 h. The supervisor waits for the child's end
    /// however long it takes: it never starts the child's next incarnation,
    /// nor does anything else, while the old one still runs.
    pub fn kill_wait(mut self, wait: Duration) -> Self {
        self.kill_wait = wait.clamp(KILL_WAIT_BOUNDS.0, KILL_WAIT_BOUNDS.1);
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn policies(&self) -> Vec<ChildPolicy> {
        let mut p: Vec<_> = self.children.iter().map(|c| c.policy.clone()).collect();
        p.extend(self.template.iter().map(|t| t.policy.clone()));
        p
    }
}

/// Why a supervisor did not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SupervisorError {
    /// The specification breaks OTP's rules.
    #[error("supervisor {name}: {error}")]
    Spec {
        /// The supervisor.
        name: String,
        /// What is wrong.
        error: SpecError,
    },
    /// A child failed to start; the children started before it were stopped.
    #[error("supervisor {name}: child {key} failed to start: {error}")]
    ChildStart {
        /// The supervisor.
        name: String,
        /// The child.
        key: ChildKey,
        /// Why.
        error: StartError,
    },
    /// The actor runtime refused the spawn.
    #[error("supervisor {name}: spawn failed: {message}")]
    Spawn {
        /// The supervisor.
        name: String,
        /// The runtime's message.
        message: String,
    },
}

/// Something a supervisor did or saw, for observers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The supervisor's name.
    pub supervisor: String,
    /// What happened.
    pub event: Observed,
}

/// The events of an [`Observation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// A child started.
    Started {
        /// The child.
        key: ChildKey,
        /// Its new incarnation.
        incarnation: Incarnation,
    },
    /// A child failed to start.
    StartFailed {
        /// The child.
        key: ChildKey,
        /// Why.
        error: StartError,
    },
    /// A child exited on its own.
    Exited {
        /// The child.
        key: ChildKey,
        /// Why.
        reason: ExitReason,
        /// Whether it will be restarted.
        restart: bool,
    },
    /// The supervisor stopped a child; its actor has finished.
    Stopped {
        /// The child.
        key: ChildKey,
        /// Whether it had to be killed (it did not stop in time).
        killed: bool,
    },
    /// A child the supervisor killed has not finished `waited` after the
    /// kill: one of its callbacks blocks its thread (a blocking loop, a long
    /// synchronous call) and never reaches an `.await`, where a kill takes
    /// effect. Nothing inside the process can end it.
    ///
    /// The supervisor does nothing else until that actor finishes — it never
    /// starts the child's next incarnation while the old one runs, and
    /// handles no other request or exit meanwhile. It sends this report
    /// [`SupervisorSpec::kill_wait`] after the kill and again every
    /// `kill_wait` while the actor runs, then [`Observed::Stopped`] (`killed:
    /// true`) if it ever finishes. The owner of the process should act on the
    /// first report: end the process and replace it.
    ChildStuck {
        /// The child.
        key: ChildKey,
        /// The incarnation that does not finish.
        incarnation: Incarnation,
        /// Time since the kill.
        waited: Duration,
    },
    /// A restart waits for backoff.
    RestartDelayed {
        /// The child.
        key: ChildKey,
        /// The delay.
        delay: Duration,
    },
    /// The supervisor exited.
    SupervisorExit {
        /// Why.
        cause: ExitCause,
    },
}

/// A child as [`SupervisorRef::which_children`] reports it.
#[derive(Debug, Clone)]
pub struct Child {
    /// The child.
    pub key: ChildKey,
    /// Its actor, when running.
    pub actor: Option<ActorCell>,
    /// Its state.
    pub status: ChildStatus,
    /// Worker or supervisor.
    pub kind: ChildKind,
}

/// The messages of the supervisor actor, handled one at a time in arrival
/// order; use [`SupervisorRef`] rather than sending them directly.
pub enum SupervisorMsg {
    /// A user request.
    Request(UserRequest, RpcReplyPort<Result<Answer, ChildError>>),
    /// A timer the machine set.
    Timer(TimerId),
    /// `which_children`.
    WhichChildren(RpcReplyPort<Vec<Child>>),
    /// `count_children`.
    CountChildren(RpcReplyPort<ChildCounts>),
    /// A child's actor ended; sent by the supervisor's exit inbox only.
    ChildExit(ChildExit),
    /// Stop the children in reverse start order, then exit (OTP's shutdown
    /// by the parent), after the messages already waiting.
    Stop,
}

/// The end of a child's actor, as the exit inbox forwards it. Only this crate
/// makes them: a forged exit of a running child would have it started twice.
#[derive(Debug)]
pub struct ChildExit {
    actor: ActorId,
    reason: ExitReason,
}

impl fmt::Debug for SupervisorMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Request(r, _) => f.debug_tuple("Request").field(r).finish(),
            Self::Timer(t) => f.debug_tuple("Timer").field(t).finish(),
            Self::WhichChildren(_) => f.write_str("WhichChildren"),
            Self::CountChildren(_) => f.write_str("CountChildren"),
            Self::ChildExit(e) => f.debug_tuple("ChildExit").field(e).finish(),
            Self::Stop => f.write_str("Stop"),
        }
    }
}

/// The successful answer to a [`UserRequest`].
#[derive(Debug, Clone)]
pub enum Answer {
    /// The child started as this actor.
    Started(ChildKey, ActorCell),
    /// Done.
    Done,
}

/// A request carried by [`SupervisorMsg::Request`].
pub enum UserRequest {
    /// Add and start a child.
    StartChild(ChildSpec),
    /// Start a dynamic child with these arguments.
    StartDynamic(DynArgs, &'static str),
    /// Stop a child.
    TerminateChild(ChildKey),
    /// Start a stopped child.
    RestartChild(ChildId),
    /// Remove a stopped child's specification.
    DeleteChild(ChildId),
}

impl fmt::Debug for UserRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::StartChild(s) => f.debug_tuple("StartChild").field(s).finish(),
            Self::StartDynamic(_, ty) => f.debug_tuple("StartDynamic").field(ty).finish(),
            Self::TerminateChild(k) => f.debug_tuple("TerminateChild").field(k).finish(),
            Self::RestartChild(id) => f.debug_tuple("RestartChild").field(id).finish(),
            Self::DeleteChild(id) => f.debug_tuple("DeleteChild").field(id).finish(),
        }
    }
}

/// The supervisor actor. Start it with [`SupervisorRef::start`] or as a child
/// with [`ChildSpec::supervisor`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Supervisor;

/// The supervisor actor's state.
pub struct SupervisorState {
    name: String,
    machine: Machine,
    /// The exit inbox: children are linked to it (see the module docs).
    inbox: ActorCell,
    kill_wait: Duration,
    starts: HashMap<ChildId, StartFn>,
    template: Option<DynStartFn>,
    dyn_args: HashMap<InstanceId, DynArgs>,
    /// The running children by actor, to recognise their exits.
    by_actor: HashMap<ActorId, (ChildKey, Incarnation)>,
    /// The running children's actors.
    actors: HashMap<ChildKey, ActorCell>,
    /// Arguments for the next new dynamic instance.
    staged_args: Option<DynArgs>,
    observer: Option<broadcast::Sender<Observation>>,
    next_request: u64,
}

impl fmt::Debug for SupervisorState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SupervisorState")
            .field("name", &self.name)
            .field("machine", &self.machine)
            .finish_non_exhaustive()
    }
}

/// What one drive of the machine produced.
#[derive(Default)]
struct Drive {
    replies: Vec<(RequestId, Reply)>,
    exit: Option<ExitCause>,
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

impl SupervisorState {
    fn observe(&self, event: Observed) {
        if let Some(o) = &self.observer {
            // No receiver is fine: nobody is watching.
            let _ = o.send(Observation {
                supervisor: self.name.clone(),
                event,
            });
        }
    }

    /// Feeds `event` to the machine and performs the resulting actions until
    /// the machine needs nothing more.
    async fn drive(&mut self, myself: &ActorCell, event: Event) -> Drive {
        let mut drive = Drive::default();
        // Only requests add children; anything may remove some.
        let prune_after = matches!(event, Event::Request(..));
        let known = self.machine.len();
        let mut queue: VecDeque<Action> = self.machine.handle(now(), event).into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Start { key, incarnation } => {
                    let outcome = self.start(key, incarnation).await;
                    queue.extend(self.machine.handle(now(), Event::Started(outcome)));
                }
                Action::Stop { targets, shutdown } => {
                    self.stop(targets, shutdown).await;
                    queue.extend(self.machine.handle(now(), Event::Stopped));
                }
                Action::SetTimer { timer, after } => {
                    let me: ActorRef<SupervisorMsg> = myself.clone().into();
                    if after.is_zero() {
                        // Like OTP's cast to self: after what already waits.
                        let _ = me.send_message(SupervisorMsg::Timer(timer));
                    } else {
                        me.send_after(after, move || SupervisorMsg::Timer(timer));
                    }
                }
                Action::Reply { request, reply } => drive.replies.push((request, reply)),
                Action::Report(report) => self.report(report),
                Action::Exit(cause) => {
                    tracing::info!(supervisor = %self.name, ?cause, "supervisor exits");
                    self.observe(Observed::SupervisorExit {
                        cause: cause.clone(),
                    });
                    drive.exit = Some(cause);
                }
            }
        }
        if prune_after || self.machine.len() < known {
            self.forget_unknown();
        }
        drive
    }

    fn report(&self, report: Report) {
        match report {
            Report::ChildExited {
                key,
                reason,
                restart,
            } => {
                if reason.is_normal() {
                    tracing::debug!(supervisor = %self.name, child = %key, %reason, restart, "child exited");
                } else {
                    tracing::warn!(supervisor = %self.name, child = %key, %reason, restart, "child exited");
                }
                self.observe(Observed::Exited {
                    key,
                    reason,
                    restart,
                });
            }
            Report::RestartDelayed { key, delay } => {
                tracing::info!(supervisor = %self.name, child = %key, ?delay, "restart delayed by backoff");
                self.observe(Observed::RestartDelayed { key, delay });
            }
            Report::RestartFailed { key, error } => {
                tracing::warn!(supervisor = %self.name, child = %key, %error, "restart failed; trying again");
            }
        }
    }

    async fn start(&mut self, key: ChildKey, incarnation: Incarnation) -> Result<(), StartError> {
        let ctx = StartContext {
            supervisor: self.inbox.clone(),
            key: key.clone(),
            incarnation,
        };
        let future = match &key {
            ChildKey::Static(id) => {
                let start = self
                    .starts
                    .get(id)
                    .expect("every static child the machine knows has a start function");
                std::panic::catch_unwind(AssertUnwindSafe(|| start(ctx)))
            }
            ChildKey::Dynamic(n) => {
                let args = match self.dyn_args.get(n) {
                    Some(a) => a.clone(),
                    None => {
                        let a = self
                            .staged_args
                            .take()
                            .expect("a new dynamic child comes with staged arguments");
                        self.dyn_args.insert(*n, a.clone());
                        a
                    }
                };
                let start = self
                    .template
                    .as_ref()
                    .expect("dynamic children exist only with a template");
                std::panic::catch_unwind(AssertUnwindSafe(|| start(ctx, args)))
            }
        };
        let outcome = match future {
            Ok(future) => match AssertUnwindSafe(future).catch_unwind().await {
                Ok(r) => r,
                Err(payload) => Err(StartError::Panicked(Panic::from_payload(payload).0)),
            },
            Err(payload) => Err(StartError::Panicked(Panic::from_payload(payload).0)),
        };
        match outcome {
            Ok(cell) => {
                if cell.try_get_supervisor().map(|s| s.get_id()) != Some(self.inbox.get_id()) {
                    // The start function did not link it; link it now so its
                    // exit reaches us.
                    cell.link(self.inbox.clone());
                }
                tracing::debug!(supervisor = %self.name, child = %key, ?incarnation, actor = %cell.get_id(), "child started");
                self.by_actor
                    .insert(cell.get_id(), (key.clone(), incarnation));
                self.actors.insert(key.clone(), cell);
                self.observe(Observed::Started { key, incarnation });
                Ok(())
            }
            Err(error) => {
                tracing::warn!(supervisor = %self.name, child = %key, %error, "child failed to start");
                self.observe(Observed::StartFailed {
                    key,
                    error: error.clone(),
                });
                Err(error)
            }
        }
    }

    /// Stops the targets at once, each according to `shutdown`, and returns
    /// when every one's actor has finished (however long a stuck one takes;
    /// see [`Observed::ChildStuck`]).
    async fn stop(&mut self, targets: Vec<(ChildKey, Incarnation)>, shutdown: Shutdown) {
        let mut stops = Vec::with_capacity(targets.len());
        for (key, incarnation) in targets {
            if let Some(cell) = self.actors.remove(&key) {
                self.by_actor.remove(&cell.get_id());
                let (supervisor, observer) = (&self.name, self.observer.as_ref());
                let kill_wait = self.kill_wait;
                stops.push(async move {
                    let stuck = StuckReport {
                        supervisor,
                        observer,
                        key: &key,
                        incarnation,
                    };
                    let killed = stop_actor(&cell, shutdown, kill_wait, stuck).await;
                    (key, killed)
                });
            }
        }
        for (key, killed) in futures::future::join_all(stops).await {
            if killed {
                tracing::warn!(supervisor = %self.name, child = %key, "child did not stop in time; killed");
            }
            self.observe(Observed::Stopped { key, killed });
        }
    }

    /// Drops start functions, arguments and actors of children the machine no
    /// longer knows (deleted, temporary, failed to start).
    fn forget_unknown(&mut self) {
        let machine = &self.machine;
        self.starts
            .retain(|id, _| machine.policy(&ChildKey::Static(id.clone())).is_some());
        self.dyn_args
            .retain(|n, _| machine.policy(&ChildKey::Dynamic(*n)).is_some());
        self.staged_args = None;
    }

    fn child_cell(&self, key: &ChildKey) -> Option<ActorCell> {
        self.actors.get(key).cloned()
    }
}

/// Who to tell that a killed child does not finish.
struct StuckReport<'a> {
    supervisor: &'a str,
    observer: Option<&'a broadcast::Sender<Observation>>,
    key: &'a ChildKey,
    incarnation: Incarnation,
}

impl StuckReport<'_> {
    fn report(&self, waited: Duration) {
        tracing::error!(
            supervisor = %self.supervisor,
            child = %self.key,
            incarnation = self.incarnation.0,
            ?waited,
            "killed child has not finished: a callback blocks its thread; \
             the supervisor waits for it and starts nothing meanwhile"
        );
        if let Some(o) = self.observer {
            // No receiver is fine: nobody is watching.
            let _ = o.send(Observation {
                supervisor: self.supervisor.to_owned(),
                event: Observed::ChildStuck {
                    key: self.key.clone(),
                    incarnation: self.incarnation,
                    waited,
                },
            });
        }
    }
}

/// Asks an actor to stop: a supervisor by an ordinary message, so that it
/// first handles what already waits in its mailbox (as OTP's shutdown exit
/// signal, which a supervisor receives as a message); any other actor through
/// ractor's stop port, which it sees between messages.
fn ask_to_stop(cell: &ActorCell) {
    if cell.is_message_type_of::<SupervisorMsg>() == Some(true)
        && cell.send_message(SupervisorMsg::Stop).is_ok()
    {
        return;
    }
    cell.stop(Some(SHUTDOWN_REASON.to_owned()));
}

/// Stops one actor according to `shutdown` and returns once it has finished;
/// returns whether it had to be killed. A killed actor that does not finish
/// within `kill_wait` is reported stuck, and again every `kill_wait`, and
/// still waited for: its next incarnation must not start while it runs.
async fn stop_actor(
    cell: &ActorCell,
    shutdown: Shutdown,
    kill_wait: Duration,
    stuck: StuckReport<'_>,
) -> bool {
    let killed = match shutdown {
        Shutdown::BrutalKill => true,
        Shutdown::Infinity => {
            ask_to_stop(cell);
            // Without limit, as OTP: a supervisor child stops its subtree
            // first, which takes what it takes.
            let _ = cell.wait(None).await;
            false
        }
        Shutdown::Timeout(t) => {
            ask_to_stop(cell);
            cell.wait(Some(t)).await.is_err()
        }
    };
    if killed {
        cell.kill();
        let since = tokio::time::Instant::now();
        while cell.wait(Some(kill_wait)).await.is_err() {
            stuck.report(since.elapsed());
        }
    }
    killed
}

/// Classifies a child's supervision event as an exit, if it is one.
pub fn exit_of(event: &SupervisionEvent) -> Option<(ActorId, ExitReason)> {
    match event {
        SupervisionEvent::ActorTerminated(cell, _, reason) => {
            let reason = match reason.as_deref() {
                Some("killed") | Some("actor_task_cancelled") => ExitReason::Killed,
                Some(r) if r == SHUTDOWN_REASON || r.starts_with("shutdown:") => {
                    ExitReason::Shutdown
                }
                // Any other stop, with or without a reason, is the actor
                // finishing of its own accord.
                _ => ExitReason::Normal,
            };
            Some((cell.get_id(), reason))
        }
        SupervisionEvent::ActorFailed(cell, err) => {
            let reason = match err.downcast_ref::<Panic>() {
                Some(p) => ExitReason::Panicked(p.0.clone()),
                None => ExitReason::Failed(err.to_string()),
            };
            Some((cell.get_id(), reason))
        }
        _ => None,
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorSpec;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        spec: SupervisorSpec,
    ) -> Result<Self::State, ActorProcessingErr> {
        let machine =
            Machine::new(spec.flags, spec.policies()).map_err(|error| SupervisorError::Spec {
                name: spec.name.clone(),
                error,
            })?;
        let (inbox, _) = Actor::spawn_linked(None, ExitInbox, myself.clone(), myself.get_cell())
            .await
            .map_err(|e| SupervisorError::Spawn {
                name: spec.name.clone(),
                message: format!("exit inbox: {e}"),
            })?;
        let mut state = SupervisorState {
            name: spec.name,
            machine,
            inbox: inbox.get_cell(),
            kill_wait: spec.kill_wait,
            starts: spec
                .children
                .into_iter()
                .map(|c| (c.policy.id, c.start))
                .collect(),
            template: spec.template.map(|t| t.start),
            dyn_args: HashMap::new(),
            by_actor: HashMap::new(),
            actors: HashMap::new(),
            staged_args: None,
            observer: spec.observer,
            next_request: 0,
        };
        let drive = state.drive(&myself.get_cell(), Event::Init).await;
        if drive.exit.is_some() {
            // ractor would kill it with the supervisor; say so explicitly.
            state.inbox.kill();
        }
        match drive.exit {
            None => Ok(state),
            Some(ExitCause::StartFailed { key, error }) => {
                Err(Box::new(SupervisorError::ChildStart {
                    name: state.name,
                    key,
                    error,
                }))
            }
            Some(other) => Err(format!("supervisor exited while starting: {other:?}").into()),
        }
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Stops the children in reverse start order; a no-op when the
        // supervisor shut itself down (the machine has exited already).
        state.drive(&myself.get_cell(), Event::Shutdown).await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let cell = myself.get_cell();
        let drive = match message {
            SupervisorMsg::ChildExit(ChildExit { actor, reason }) => {
                match state.exit_event(&actor, reason) {
                    Some(event) => state.drive(&cell, event).await,
                    None => return Ok(()),
                }
            }
            SupervisorMsg::Stop => state.drive(&cell, Event::Shutdown).await,
            SupervisorMsg::Timer(timer) => state.drive(&cell, Event::Timer(timer)).await,
            SupervisorMsg::WhichChildren(port) => {
                let children = state
                    .machine
                    .children()
                    .into_iter()
                    .map(|c| Child {
                        actor: state.child_cell(&c.key),
                        key: c.key,
                        status: c.status,
                        kind: c.kind,
                    })
                    .collect();
                let _ = port.send(children);
                return Ok(());
            }
            SupervisorMsg::CountChildren(port) => {
                let _ = port.send(state.machine.counts());
                return Ok(());
            }
            SupervisorMsg::Request(request, port) => {
                let id = RequestId(state.next_request);
                state.next_request += 1;
                let request = match request {
                    UserRequest::StartChild(spec) => {
                        // Keep an existing child's start function; the machine
                        // refuses the duplicate.
                        state
                            .starts
                            .entry(spec.policy.id.clone())
                            .or_insert(spec.start);
                        Request::StartChild(spec.policy)
                    }
                    UserRequest::StartDynamic(args, _) => {
                        state.staged_args = Some(args);
                        Request::StartDynamic
                    }
                    UserRequest::TerminateChild(key) => Request::TerminateChild(key),
                    UserRequest::RestartChild(id) => Request::RestartChild(id),
                    UserRequest::DeleteChild(id) => Request::DeleteChild(id),
                };
                let drive = state.drive(&cell, Event::Request(id, request)).await;
                let answer = drive
                    .replies
                    .iter()
                    .find(|(r, _)| *r == id)
                    .map(|(_, reply)| match reply {
                        Reply::Started(Ok((key, _))) => state
                            .child_cell(key)
                            .map(|cell| Answer::Started(key.clone(), cell))
                            .ok_or(ChildError::SupervisorDown),
                        Reply::Started(Err(e)) | Reply::Done(Err(e)) => Err(e.clone()),
                        Reply::Done(Ok(())) => Ok(Answer::Done),
                    })
                    .unwrap_or(Err(ChildError::SupervisorDown));
                let _ = port.send(answer);
                drive
            }
        };
        if drive.exit.is_some() {
            myself.stop(Some(SHUTDOWN_REASON.to_owned()));
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let Some((actor, reason)) = exit_of(&event) else {
            return Ok(());
        };
        if actor == state.inbox.get_id() {
            // Only a kill from outside ends it; without it no exit of a child
            // would reach the machine.
            return Err(
                format!("supervisor {}: its exit inbox ended ({reason})", state.name).into(),
            );
        }
        // Children are linked to the inbox; one linked here directly (by its
        // own code, after its start) is still ours, if out of mailbox order.
        let Some(event) = state.exit_event(&actor, reason) else {
            return Ok(());
        };
        let drive = state.drive(&myself.get_cell(), event).await;
        if drive.exit.is_some() {
            myself.stop(Some(SHUTDOWN_REASON.to_owned()));
        }
        Ok(())
    }
}

impl SupervisorState {
    /// The machine event for the end of `actor`, if it is a running child
    /// (not one the supervisor stopped itself, nor a stranger).
    fn exit_event(&mut self, actor: &ActorId, reason: ExitReason) -> Option<Event> {
        let (key, incarnation) = self.by_actor.remove(actor)?;
        self.actors.remove(&key);
        Some(Event::Exited {
            key,
            incarnation,
            reason,
        })
    }
}

/// The exit inbox of a supervisor: children are linked to it, and it forwards
/// each end of a child's actor to the supervisor as an ordinary message, at
/// once (it never blocks), so that exits keep their place among requests and
/// timers. See the module docs.
struct ExitInbox;

impl Actor for ExitInbox {
    type Msg = ();
    type State = ActorRef<SupervisorMsg>;
    type Arguments = ActorRef<SupervisorMsg>;

    async fn pre_start(
        &self,
        _: ActorRef<()>,
        supervisor: ActorRef<SupervisorMsg>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(supervisor)
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        supervisor: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some((actor, reason)) = exit_of(&event) {
            // Fails only once the supervisor has gone, and its children with it.
            let _ = supervisor.send_message(SupervisorMsg::ChildExit(ChildExit { actor, reason }));
        }
        Ok(())
    }
}

/// A handle on a running supervisor.
#[derive(Debug, Clone)]
pub struct SupervisorRef {
    actor: ActorRef<SupervisorMsg>,
}

/// How long a request to a supervisor may wait for its answer; starts and stops
/// of children happen inside it, so it is generous.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);

impl SupervisorRef {
    /// Starts a supervisor with no parent; returns once every initial child
    /// has started (or one failed, and those before it were stopped).
    pub async fn start(spec: SupervisorSpec) -> Result<(Self, JoinHandle<()>), SupervisorError> {
        let name = spec.name.clone();
        let r = Actor::spawn(None, Supervisor, spec).await;
        Self::started(name, r)
    }

    /// Starts a supervisor linked to `parent`, which receives its exit.
    pub async fn start_linked(
        spec: SupervisorSpec,
        parent: ActorCell,
    ) -> Result<(Self, JoinHandle<()>), SupervisorError> {
        let name = spec.name.clone();
        let r = Actor::spawn_linked(None, Supervisor, spec, parent).await;
        Self::started(name, r)
    }

    fn started(
        name: String,
        r: Result<(ActorRef<SupervisorMsg>, JoinHandle<()>), ractor::SpawnErr>,
    ) -> Result<(Self, JoinHandle<()>), SupervisorError> {
        match r {
            Ok((actor, handle)) => Ok((Self { actor }, handle)),
            Err(ractor::SpawnErr::StartupFailed(err)) => match err.downcast::<SupervisorError>() {
                Ok(e) => Err(*e),
                Err(err) => Err(SupervisorError::Spawn {
                    name,
                    message: err.to_string(),
                }),
            },
            Err(e) => Err(SupervisorError::Spawn {
                name,
                message: e.to_string(),
            }),
        }
    }

    /// A handle on the supervisor running as `cell` (for example a child
    /// supervisor listed by [`SupervisorRef::which_children`]). If `cell` is
    /// not a supervisor, every request fails with
    /// [`ChildError::SupervisorDown`].
    pub fn from_cell(cell: ActorCell) -> Self {
        Self { actor: cell.into() }
    }

    /// The supervisor's actor.
    pub fn cell(&self) -> ActorCell {
        self.actor.get_cell()
    }

    /// The supervisor's typed actor reference.
    pub fn actor(&self) -> &ActorRef<SupervisorMsg> {
        &self.actor
    }

    async fn request(&self, request: UserRequest) -> Result<Answer, ChildError> {
        match self
            .actor
            .call(
                |port| SupervisorMsg::Request(request, port),
                Some(REQUEST_TIMEOUT),
            )
            .await
        {
            Ok(CallResult::Success(r)) => r,
            _ => Err(ChildError::SupervisorDown),
        }
    }

    /// Adds a child specification and starts the child (OTP's `start_child`).
    /// A child that fails to start is not kept.
    pub async fn start_child(&self, spec: ChildSpec) -> Result<ActorCell, ChildError> {
        match self.request(UserRequest::StartChild(spec)).await? {
            Answer::Started(_, cell) => Ok(cell),
            Answer::Done => Err(ChildError::SupervisorDown),
        }
    }

    /// Starts a new instance of a `simple_one_for_one` supervisor's template
    /// with `args`, which are kept for its restarts.
    pub async fn start_dynamic_child<T: std::any::Any + Send + Sync>(
        &self,
        args: T,
    ) -> Result<(InstanceId, ActorCell), ChildError> {
        let request =
            UserRequest::StartDynamic(std::sync::Arc::new(args), std::any::type_name::<T>());
        match self.request(request).await? {
            Answer::Started(ChildKey::Dynamic(n), cell) => Ok((n, cell)),
            _ => Err(ChildError::SupervisorDown),
        }
    }

    /// Stops a child (OTP's `terminate_child`); its specification stays
    /// unless it is temporary or dynamic.
    pub async fn terminate_child(&self, key: impl Into<ChildKey>) -> Result<(), ChildError> {
        self.request(UserRequest::TerminateChild(key.into()))
            .await
            .map(drop)
    }

    /// Starts a stopped child again (OTP's `restart_child`).
    pub async fn restart_child(&self, id: impl Into<ChildId>) -> Result<ActorCell, ChildError> {
        match self.request(UserRequest::RestartChild(id.into())).await? {
            Answer::Started(_, cell) => Ok(cell),
            Answer::Done => Err(ChildError::SupervisorDown),
        }
    }

    /// Removes a stopped child's specification (OTP's `delete_child`).
    pub async fn delete_child(&self, id: impl Into<ChildId>) -> Result<(), ChildError> {
        self.request(UserRequest::DeleteChild(id.into()))
            .await
            .map(drop)
    }

    /// The children in start order (OTP's `which_children`).
    pub async fn which_children(&self) -> Result<Vec<Child>, ChildError> {
        match self
            .actor
            .call(SupervisorMsg::WhichChildren, Some(REQUEST_TIMEOUT))
            .await
        {
            Ok(CallResult::Success(r)) => Ok(r),
            _ => Err(ChildError::SupervisorDown),
        }
    }

    /// Counts of children (OTP's `count_children`).
    pub async fn count_children(&self) -> Result<ChildCounts, ChildError> {
        match self
            .actor
            .call(SupervisorMsg::CountChildren, Some(REQUEST_TIMEOUT))
            .await
        {
            Ok(CallResult::Success(r)) => Ok(r),
            _ => Err(ChildError::SupervisorDown),
        }
    }

    /// Stops the supervisor after the messages already in its mailbox: its
    /// children stop in reverse start order, then it exits. Returns once it
    /// has — with a stuck child ([`Observed::ChildStuck`]), not before that
    /// child's actor has finished, which may be never. A caller that must go
    /// on regardless bounds the wait with a timeout (dropping this future
    /// does not cancel the stop) and then ends the process, which alone ends
    /// the stuck thread.
    pub async fn stop(&self) {
        let cell = self.actor.get_cell();
        // Through ractor's stop port when the cell is not a supervisor
        // (`from_cell`) or has gone already.
        ask_to_stop(&cell);
        let _ = cell.wait(None).await;
    }
}

impl From<ChildId> for ChildKey {
    fn from(id: ChildId) -> Self {
        ChildKey::Static(id)
    }
}

impl From<&str> for ChildKey {
    fn from(id: &str) -> Self {
        ChildKey::Static(ChildId::new(id))
    }
}

impl From<InstanceId> for ChildKey {
    fn from(n: InstanceId) -> Self {
        ChildKey::Dynamic(n)
    }
}

/// A supervisor as another supervisor's child (here, beside what it starts,
/// so that `child` does not depend on this module).
impl ChildSpec {
    /// A supervisor child: each start spawns a supervisor with `spec` linked
    /// to this one. Its shutdown is infinite, as OTP's default.
    pub fn supervisor(id: impl Into<ChildId>, spec: SupervisorSpec) -> Self {
        Self::new(ChildPolicy::supervisor(id), move |ctx| {
            let spec = spec.clone();
            async move {
                let (sup, _) = SupervisorRef::start_linked(spec, ctx.supervisor)
                    .await
                    .map_err(|e| StartError::Failed(e.to_string()))?;
                Ok(sup.cell())
            }
            .boxed()
        })
    }
}
