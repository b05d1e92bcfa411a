//! The supervision decision logic as a pure state machine: `(now, event) ->
//! actions`. No I/O, no clock, no actors; the adapter, [`crate::Supervisor`],
//! performs the actions and feeds their outcomes back as events.
//!
//! # Protocol
//!
//! [`Machine::handle`] takes an [`Event`] and returns [`Action`]s to perform
//! in order. A [`Action::Start`] or [`Action::Stop`] is always the last action
//! of a batch: the driver performs it and reports the outcome with
//! [`Event::Started`] or [`Event::Stopped`], which yields the next batch. Any
//! other event that arrives while an outcome is awaited is deferred and handled
//! once the procedure in progress has finished — as a mailbox would hold it in
//! OTP, where the supervisor starts and stops children synchronously.
//!
//! The rules follow OTP's `supervisor` module; `docs/semantics.md` states them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use indexmap::IndexMap;

use crate::error::{ChildError, StartError};
use crate::reason::ExitReason;
use crate::spec::SpecError;
use crate::spec::{
    AutoShutdown, ChildCounts, ChildId, ChildKey, ChildKind, ChildPolicy, Incarnation, InstanceId,
    MAX_CHILDREN, Restart, Shutdown, Strategy, SupervisorFlags,
};
use crate::window::RestartWindow;

/// Names a timer the machine asked for with [`Action::SetTimer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimerId(pub u64);

/// Correlates a [`Request`] with its [`Action::Reply`]; chosen by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A request from the supervisor's users (OTP's `start_child`,
/// `terminate_child`, `restart_child`, `delete_child`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Add a child specification and start it (not for `simple_one_for_one`).
    StartChild(ChildPolicy),
    /// Start a new instance of the template (`simple_one_for_one` only).
    StartDynamic,
    /// Stop a child; its specification stays unless it is temporary or
    /// dynamic.
    TerminateChild(ChildKey),
    /// Start a stopped child again (not for `simple_one_for_one`).
    RestartChild(ChildId),
    /// Remove the specification of a stopped child (not for
    /// `simple_one_for_one`).
    DeleteChild(ChildId),
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The child started (for `StartChild`, `StartDynamic`, `RestartChild`).
    Started(Result<(ChildKey, Incarnation), ChildError>),
    /// The outcome of `TerminateChild` or `DeleteChild`.
    Done(Result<(), ChildError>),
}

/// Something that happened, fed to [`Machine::handle`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Start the initial children (once, first).
    Init,
    /// A child exited on its own. Reports for an earlier incarnation, or for
    /// a child the supervisor stopped itself, are stale and ignored.
    Exited {
        /// The child.
        key: ChildKey,
        /// The life that ended.
        incarnation: Incarnation,
        /// Why.
        reason: ExitReason,
    },
    /// The outcome of the last [`Action::Start`].
    Started(Result<(), StartError>),
    /// The children of the last [`Action::Stop`] are all down.
    Stopped,
    /// A timer set with [`Action::SetTimer`] fired.
    Timer(TimerId),
    /// A user request.
    Request(RequestId, Request),
    /// The supervisor is asked to stop (by its parent or owner).
    Shutdown,
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start this child as this incarnation; answer with [`Event::Started`].
    Start {
        /// The child.
        key: ChildKey,
        /// The incarnation the new life gets.
        incarnation: Incarnation,
    },
    /// Stop these children, all at once, each according to `shutdown` (ask,
    /// wait up to the timeout, then kill); answer with [`Event::Stopped`]
    /// once all are down. Ordered strategies stop one child per action.
    Stop {
        /// The children to stop.
        targets: Vec<(ChildKey, Incarnation)>,
        /// How.
        shutdown: Shutdown,
    },
    /// Deliver [`Event::Timer`] after this delay. A zero delay means "after
    /// the events already waiting", like a message to self.
    SetTimer {
        /// The timer.
        timer: TimerId,
        /// The delay.
        after: Duration,
    },
    /// Answer a request.
    Reply {
        /// The request.
        request: RequestId,
        /// The answer.
        reply: Reply,
    },
    /// Something worth telling (for logs and observers); needs no answer.
    Report(Report),
    /// The supervisor has stopped all its children and must now exit.
    Exit(ExitCause),
}

/// Notable decisions, for logs and observers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// A child exited on its own.
    ChildExited {
        /// The child.
        key: ChildKey,
        /// Why.
        reason: ExitReason,
        /// Whether the machine decided to restart it.
        restart: bool,
    },
    /// A restart start is delayed by backoff.
    RestartDelayed {
        /// The child.
        key: ChildKey,
        /// The delay.
        delay: Duration,
    },
    /// A child failed to start during a restart; it will be tried again.
    RestartFailed {
        /// The child.
        key: ChildKey,
        /// Why.
        error: StartError,
    },
}

/// Why the supervisor exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitCause {
    /// More restarts than the intensity allows; the child whose exit tipped
    /// it over.
    IntensityExceeded {
        /// The child.
        key: ChildKey,
    },
    /// A significant child's exit triggered automatic shutdown.
    AutoShutdown {
        /// The child.
        key: ChildKey,
    },
    /// Asked to stop.
    Requested,
    /// An initial child failed to start, so the supervisor did not start.
    StartFailed {
        /// The child.
        key: ChildKey,
        /// Why.
        error: StartError,
    },
}

impl ExitCause {
    /// The exit reason the supervisor reports to its own parent: `Shutdown`,
    /// as OTP, except for a failed start.
    pub fn reason(&self) -> ExitReason {
        match self {
            Self::StartFailed { key, error } => {
                ExitReason::Failed(format!("child {key} failed to start: {error}"))
            }
            _ => ExitReason::Shutdown,
        }
    }
}

/// The state of one child, as [`Machine::children`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildStatus {
    /// Running as this incarnation.
    Running(Incarnation),
    /// Waiting to be restarted (after a failed restart start, or during
    /// backoff).
    Restarting,
    /// Not running; the specification is kept.
    Terminated,
}

/// One line of [`Machine::children`] (OTP's `which_children`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildInfo {
    /// The child.
    pub key: ChildKey,
    /// Its state.
    pub status: ChildStatus,
    /// Worker or supervisor.
    pub kind: ChildKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running(Incarnation),
    Restarting(TimerId),
    Terminated,
}

#[derive(Debug, Clone)]
struct Life {
    state: State,
    /// Consecutive restarts, for backoff.
    streak: u32,
    started_at: Option<Instant>,
}

impl Life {
    fn new() -> Self {
        Self {
            state: State::Terminated,
            streak: 0,
            started_at: None,
        }
    }
}

#[derive(Debug, Clone)]
struct StaticChild {
    policy: ChildPolicy,
    life: Life,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    New,
    Init,
    Running,
    Exited,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Init,
    Restart,
    Request(RequestId, RequestKind),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestKind {
    StartChild,
    StartDynamic,
    RestartChild,
}

#[derive(Debug, Clone)]
enum Step {
    Stop {
        targets: Vec<(ChildKey, Incarnation)>,
        shutdown: Shutdown,
    },
    Start {
        key: ChildKey,
        purpose: Purpose,
    },
    Reply {
        request: RequestId,
        reply: Reply,
    },
    SetTimer {
        timer: TimerId,
        after: Duration,
    },
    Exit(ExitCause),
}

#[derive(Debug, Clone)]
enum Awaiting {
    Nothing,
    Stopped,
    Started {
        key: ChildKey,
        incarnation: Incarnation,
        purpose: Purpose,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimerPurpose {
    /// OTP's `try_again_restart`: decide the restart again (counted).
    TryAgain,
    /// The delayed start phase of a restart already decided (backoff).
    StartPhase,
}

/// The supervision state machine of one supervisor.
#[derive(Debug, Clone)]
pub struct Machine {
    flags: SupervisorFlags,
    phase: Phase,
    /// Static children in start order.
    children: IndexMap<ChildId, StaticChild>,
    /// The template of a `simple_one_for_one` supervisor.
    template: Option<ChildPolicy>,
    /// Dynamic children, keyed by instance number, which grows with start
    /// order.
    dynamic: BTreeMap<InstanceId, Life>,
    next_instance: u64,
    next_incarnation: u64,
    next_timer: u64,
    timers: HashMap<TimerId, (ChildKey, TimerPurpose)>,
    /// Restarts within the intensity period.
    restarts: RestartWindow,
    steps: VecDeque<Step>,
    awaiting: Awaiting,
    deferred: VecDeque<Event>,
}

impl Machine {
    /// A machine for these flags and child policies (in start order; for
    /// `simple_one_for_one`, exactly one: the template). Checks OTP's rules.
    pub fn new(flags: SupervisorFlags, children: Vec<ChildPolicy>) -> Result<Self, SpecError> {
        flags.validate()?;
        if children.len() > MAX_CHILDREN {
            return Err(SpecError::TooManyChildren);
        }
        for (i, c) in children.iter().enumerate() {
            c.validate(flags.auto_shutdown)?;
            if children[..i].iter().any(|o| o.id == c.id) {
                return Err(SpecError::DuplicateId { id: c.id.clone() });
            }
        }
        let (template, children) = if flags.strategy == Strategy::SimpleOneForOne {
            if children.len() != 1 {
                return Err(SpecError::SimpleNeedsOneTemplate {
                    count: children.len(),
                });
            }
            (children.into_iter().next(), IndexMap::new())
        } else {
            let children = children
                .into_iter()
                .map(|policy| {
                    let child = StaticChild {
                        policy,
                        life: Life::new(),
                    };
                    (child.policy.id.clone(), child)
                })
                .collect();
            (None, children)
        };
        Ok(Self {
            flags,
            phase: Phase::New,
            children,
            template,
            dynamic: BTreeMap::new(),
            next_instance: 0,
            next_incarnation: 0,
            next_timer: 0,
            timers: HashMap::new(),
            restarts: RestartWindow::new(flags.intensity),
            steps: VecDeque::new(),
            awaiting: Awaiting::Nothing,
            deferred: VecDeque::new(),
        })
    }

    /// The flags this machine runs with.
    pub fn flags(&self) -> &SupervisorFlags {
        &self.flags
    }

    /// Whether the machine has exited.
    pub fn has_exited(&self) -> bool {
        self.phase == Phase::Exited
    }

    /// Whether the initial children have all started.
    pub fn is_running(&self) -> bool {
        self.phase == Phase::Running
    }

    /// How many children (static specifications and dynamic instances) the
    /// machine knows.
    pub fn len(&self) -> usize {
        self.children.len() + self.dynamic.len()
    }

    /// Whether the machine knows no child.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The policy of a child, static or dynamic.
    pub fn policy(&self, key: &ChildKey) -> Option<&ChildPolicy> {
        match key {
            ChildKey::Static(id) => self.children.get(id).map(|c| &c.policy),
            ChildKey::Dynamic(n) => self
                .template
                .as_ref()
                .filter(|_| self.dynamic.contains_key(n)),
        }
    }

    /// The children and their states, in start order (OTP's
    /// `which_children`).
    pub fn children(&self) -> Vec<ChildInfo> {
        let status = |s: State| match s {
            State::Running(i) => ChildStatus::Running(i),
            State::Restarting(_) => ChildStatus::Restarting,
            State::Terminated => ChildStatus::Terminated,
        };
        if let Some(t) = &self.template {
            self.dynamic
                .iter()
                .map(|(n, life)| ChildInfo {
                    key: ChildKey::Dynamic(*n),
                    status: status(life.state),
                    kind: t.kind,
                })
                .collect()
        } else {
            self.children
                .values()
                .map(|c| ChildInfo {
                    key: ChildKey::Static(c.policy.id.clone()),
                    status: status(c.life.state),
                    kind: c.policy.kind,
                })
                .collect()
        }
    }

    /// Counts of children (OTP's `count_children`).
    pub fn counts(&self) -> ChildCounts {
        let mut counts = ChildCounts::default();
        let mut add = |kind: ChildKind, state: State| {
            if matches!(state, State::Running(_)) {
                counts.active += 1;
            }
            match kind {
                ChildKind::Worker => counts.workers += 1,
                ChildKind::Supervisor => counts.supervisors += 1,
            }
        };
        if let Some(t) = &self.template {
            for life in self.dynamic.values() {
                add(t.kind, life.state);
            }
            counts.specs = 1;
        } else {
            for c in self.children.values() {
                add(c.policy.kind, c.life.state);
            }
            counts.specs = self.children.len();
        }
        counts
    }

    /// Handles one event at time `now` and returns what to do.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        if self.phase == Phase::Exited {
            return out;
        }
        match event {
            Event::Started(result) => self.on_started(now, result, &mut out),
            Event::Stopped => {
                if matches!(self.awaiting, Awaiting::Stopped) {
                    self.awaiting = Awaiting::Nothing;
                } else {
                    debug_assert!(false, "Stopped without a Stop in progress");
                    tracing::error!("supervisor machine: Stopped without a Stop in progress");
                }
            }
            other if !matches!(self.awaiting, Awaiting::Nothing) => {
                self.deferred.push_back(other);
                return out;
            }
            other => self.dispatch(now, other, &mut out),
        }
        self.run(now, &mut out);
        out
    }

    /// Performs queued steps until one needs an outcome, then handles deferred
    /// events the same way.
    fn run(&mut self, now: Instant, out: &mut Vec<Action>) {
        loop {
            if !matches!(self.awaiting, Awaiting::Nothing) || self.phase == Phase::Exited {
                return;
            }
            if let Some(step) = self.steps.pop_front() {
                self.perform(step, out);
                continue;
            }
            if self.phase == Phase::Init {
                self.phase = Phase::Running;
            }
            match self.deferred.pop_front() {
                Some(event) => self.dispatch(now, event, out),
                None => return,
            }
        }
    }

    fn perform(&mut self, step: Step, out: &mut Vec<Action>) {
        match step {
            Step::Stop { targets, shutdown } => {
                out.push(Action::Stop { targets, shutdown });
                self.awaiting = Awaiting::Stopped;
            }
            Step::Start { key, purpose } => {
                // A child still in the plan may have been removed or started
                // meanwhile (a temporary child stopped by the same restart).
                let Some(state) = self.life(&key).map(|l| l.state) else {
                    return;
                };
                if matches!(state, State::Running(_)) {
                    return;
                }
                let incarnation = Incarnation(self.next_incarnation);
                self.next_incarnation += 1;
                out.push(Action::Start {
                    key: key.clone(),
                    incarnation,
                });
                self.awaiting = Awaiting::Started {
                    key,
                    incarnation,
                    purpose,
                };
            }
            Step::Reply { request, reply } => out.push(Action::Reply { request, reply }),
            Step::SetTimer { timer, after } => out.push(Action::SetTimer { timer, after }),
            Step::Exit(cause) => {
                self.phase = Phase::Exited;
                self.steps.clear();
                self.deferred.clear();
                self.timers.clear();
                out.push(Action::Exit(cause));
            }
        }
    }

    fn dispatch(&mut self, now: Instant, event: Event, out: &mut Vec<Action>) {
        match event {
            Event::Init => self.on_init(out),
            Event::Exited {
                key,
                incarnation,
                reason,
            } => self.on_exited(now, key, incarnation, reason, out),
            Event::Timer(timer) => self.on_timer(now, timer, out),
            Event::Request(id, request) => self.on_request(id, request, out),
            Event::Shutdown => {
                self.terminate_all();
                self.steps.push_back(Step::Exit(ExitCause::Requested));
            }
            Event::Started(_) | Event::Stopped => {
                debug_assert!(false, "outcome events are handled in handle()");
            }
        }
    }

    fn on_init(&mut self, out: &mut Vec<Action>) {
        if self.phase != Phase::New {
            debug_assert!(false, "Init twice");
            return;
        }
        let _ = out;
        self.phase = Phase::Init;
        for c in self.children.values() {
            self.steps.push_back(Step::Start {
                key: ChildKey::Static(c.policy.id.clone()),
                purpose: Purpose::Init,
            });
        }
    }

    fn on_started(&mut self, now: Instant, result: Result<(), StartError>, out: &mut Vec<Action>) {
        let Awaiting::Started {
            key,
            incarnation,
            purpose,
        } = std::mem::replace(&mut self.awaiting, Awaiting::Nothing)
        else {
            debug_assert!(false, "Started without a Start in progress");
            tracing::error!("supervisor machine: Started without a Start in progress");
            return;
        };
        match result {
            Ok(()) => {
                if let Some(life) = self.life_mut(&key) {
                    life.state = State::Running(incarnation);
                    life.started_at = Some(now);
                }
                if let Purpose::Request(request, _) = purpose {
                    out.push(Action::Reply {
                        request,
                        reply: Reply::Started(Ok((key, incarnation))),
                    });
                }
            }
            Err(error) => self.on_start_failed(key, purpose, error, out),
        }
    }

    fn on_start_failed(
        &mut self,
        key: ChildKey,
        purpose: Purpose,
        error: StartError,
        out: &mut Vec<Action>,
    ) {
        match purpose {
            Purpose::Init => {
                // OTP's init_children: stop what started, in reverse, and fail.
                self.steps.clear();
                self.terminate_all();
                self.steps
                    .push_back(Step::Exit(ExitCause::StartFailed { key, error }));
            }
            Purpose::Request(request, kind) => {
                match kind {
                    // The specification or instance is not kept.
                    RequestKind::StartChild | RequestKind::StartDynamic => self.remove(&key),
                    // The child stays terminated.
                    RequestKind::RestartChild => {}
                }
                out.push(Action::Reply {
                    request,
                    reply: Reply::Started(Err(ChildError::Start { key, error })),
                });
            }
            Purpose::Restart => {
                // OTP's try_again_restart: the rest of this start phase is
                // dropped; the failed child waits, and the restart is decided
                // again after the events already waiting.
                self.steps.retain(|s| !matches!(s, Step::Start { .. }));
                out.push(Action::Report(Report::RestartFailed {
                    key: key.clone(),
                    error,
                }));
                self.set_restarting(key, TimerPurpose::TryAgain, Duration::ZERO);
            }
        }
    }

    fn on_exited(
        &mut self,
        now: Instant,
        key: ChildKey,
        incarnation: Incarnation,
        reason: ExitReason,
        out: &mut Vec<Action>,
    ) {
        let Some(policy) = self.policy(&key).cloned() else {
            return;
        };
        let backoff = self.flags.backoff;
        let Some(life) = self.life_mut(&key) else {
            return;
        };
        if life.state != State::Running(incarnation) {
            return; // stale: an earlier life, or one we stopped ourselves
        }
        if let (Some(backoff), Some(started)) = (backoff, life.started_at)
            && now.saturating_duration_since(started) >= backoff.reset_after
        {
            life.streak = 0;
        }
        let restart = match policy.restart {
            Restart::Permanent => true,
            Restart::Transient => !reason.is_normal(),
            Restart::Temporary => false,
        };
        out.push(Action::Report(Report::ChildExited {
            key: key.clone(),
            reason,
            restart,
        }));
        if restart {
            self.restart(now, key, out);
        } else {
            self.del_child(&key);
            self.auto_shutdown(&key, &policy);
        }
    }

    fn on_timer(&mut self, now: Instant, timer: TimerId, out: &mut Vec<Action>) {
        let Some((key, purpose)) = self.timers.remove(&timer) else {
            return;
        };
        if self.life(&key).map(|l| l.state) != Some(State::Restarting(timer)) {
            return; // the child was started, terminated or deleted meanwhile
        }
        match purpose {
            TimerPurpose::TryAgain => self.restart(now, key, out),
            TimerPurpose::StartPhase => self.start_phase(&key),
        }
    }

    /// OTP's `restart/2`: count the restart, then apply the strategy.
    fn restart(&mut self, now: Instant, key: ChildKey, out: &mut Vec<Action>) {
        if !self.restarts.record(now) {
            self.del_child(&key);
            self.terminate_all();
            self.steps
                .push_back(Step::Exit(ExitCause::IntensityExceeded { key }));
            return;
        }
        self.set_terminated(&key);
        match self.flags.strategy {
            Strategy::OneForOne | Strategy::SimpleOneForOne => {}
            Strategy::RestForOne => {
                let from = self.static_position(&key);
                self.terminate_static(from + 1);
            }
            Strategy::OneForAll => self.terminate_static(0),
        }
        let delay = match self.flags.backoff {
            Some(backoff) => {
                let life = self.life_mut(&key).expect("restarted child exists");
                life.streak = life.streak.saturating_add(1);
                backoff.delay(life.streak)
            }
            None => Duration::ZERO,
        };
        if delay.is_zero() {
            self.start_phase(&key);
        } else {
            out.push(Action::Report(Report::RestartDelayed {
                key: key.clone(),
                delay,
            }));
            self.set_restarting(key, TimerPurpose::StartPhase, delay);
        }
    }

    /// Queues the starts of a restart: the child, and for `rest_for_one` the
    /// children after it, for `one_for_all` all children that are not running.
    fn start_phase(&mut self, key: &ChildKey) {
        let from = match self.flags.strategy {
            Strategy::OneForOne | Strategy::SimpleOneForOne => {
                self.steps.push_back(Step::Start {
                    key: key.clone(),
                    purpose: Purpose::Restart,
                });
                return;
            }
            Strategy::RestForOne => self.static_position(key),
            Strategy::OneForAll => 0,
        };
        for c in self.children.values().skip(from) {
            if !matches!(c.life.state, State::Running(_)) {
                self.steps.push_back(Step::Start {
                    key: ChildKey::Static(c.policy.id.clone()),
                    purpose: Purpose::Restart,
                });
            }
        }
    }

    /// Marks the child as waiting for a restart and queues the timer that
    /// resumes it (after the stops already queued).
    fn set_restarting(&mut self, key: ChildKey, purpose: TimerPurpose, after: Duration) {
        let timer = TimerId(self.next_timer);
        self.next_timer += 1;
        if let Some(life) = self.life_mut(&key) {
            life.state = State::Restarting(timer);
        }
        self.timers.insert(timer, (key, purpose));
        self.steps.push_back(Step::SetTimer { timer, after });
    }

    /// OTP's `do_auto_shutdown`, after a child exit that is not restarted.
    fn auto_shutdown(&mut self, key: &ChildKey, policy: &ChildPolicy) {
        if !policy.significant {
            return;
        }
        let shut = match self.flags.auto_shutdown {
            AutoShutdown::Never => false,
            AutoShutdown::AnySignificant => true,
            AutoShutdown::AllSignificant => {
                if self.template.is_some() {
                    self.dynamic.is_empty()
                } else {
                    !self
                        .children
                        .values()
                        .any(|c| c.policy.significant && c.life.state != State::Terminated)
                }
            }
        };
        if shut {
            self.terminate_all();
            self.steps
                .push_back(Step::Exit(ExitCause::AutoShutdown { key: key.clone() }));
        }
    }

    fn on_request(&mut self, request: RequestId, req: Request, out: &mut Vec<Action>) {
        let simple = self.template.is_some();
        let reply_done = |out: &mut Vec<Action>, r: Result<(), ChildError>| {
            out.push(Action::Reply {
                request,
                reply: Reply::Done(r),
            });
        };
        let refuse_started = |out: &mut Vec<Action>, e: ChildError| {
            out.push(Action::Reply {
                request,
                reply: Reply::Started(Err(e)),
            });
        };
        match req {
            Request::StartChild(policy) => {
                if simple {
                    return refuse_started(
                        out,
                        ChildError::WrongStrategy(
                            "start_child with a specification is not for simple_one_for_one; start a dynamic child",
                        ),
                    );
                }
                if let Err(e) = policy.validate(self.flags.auto_shutdown) {
                    return refuse_started(out, e.into());
                }
                if let Some(c) = self.children.get(&policy.id) {
                    let id = policy.id;
                    return refuse_started(
                        out,
                        match c.life.state {
                            State::Running(_) => ChildError::AlreadyStarted(id),
                            _ => ChildError::AlreadyPresent(id),
                        },
                    );
                }
                if self.children.len() >= MAX_CHILDREN {
                    return refuse_started(out, SpecError::TooManyChildren.into());
                }
                let key = ChildKey::Static(policy.id.clone());
                self.children.insert(
                    policy.id.clone(),
                    StaticChild {
                        policy,
                        life: Life::new(),
                    },
                );
                self.steps.push_back(Step::Start {
                    key,
                    purpose: Purpose::Request(request, RequestKind::StartChild),
                });
            }
            Request::StartDynamic => {
                if !simple {
                    return refuse_started(
                        out,
                        ChildError::WrongStrategy(
                            "dynamic children need a simple_one_for_one supervisor",
                        ),
                    );
                }
                if self.dynamic.len() >= MAX_CHILDREN {
                    return refuse_started(out, SpecError::TooManyChildren.into());
                }
                let n = InstanceId(self.next_instance);
                self.next_instance += 1;
                self.dynamic.insert(n, Life::new());
                self.steps.push_back(Step::Start {
                    key: ChildKey::Dynamic(n),
                    purpose: Purpose::Request(request, RequestKind::StartDynamic),
                });
            }
            Request::TerminateChild(key) => {
                if simple && matches!(key, ChildKey::Static(_)) {
                    return reply_done(
                        out,
                        Err(ChildError::WrongStrategy(
                            "terminate_child of a simple_one_for_one supervisor takes an instance",
                        )),
                    );
                }
                let Some(life) = self.life(&key) else {
                    return reply_done(out, Err(ChildError::NotFound(key)));
                };
                if let State::Running(incarnation) = life.state {
                    let shutdown = self.policy(&key).expect("child exists").shutdown;
                    self.steps.push_back(Step::Stop {
                        targets: vec![(key.clone(), incarnation)],
                        shutdown,
                    });
                }
                self.del_child(&key);
                self.steps.push_back(Step::Reply {
                    request,
                    reply: Reply::Done(Ok(())),
                });
            }
            Request::RestartChild(id) => {
                if simple {
                    return refuse_started(
                        out,
                        ChildError::WrongStrategy("restart_child is not for simple_one_for_one"),
                    );
                }
                let key = ChildKey::Static(id);
                match self.life(&key).map(|l| l.state) {
                    None => refuse_started(out, ChildError::NotFound(key)),
                    Some(State::Running(_)) => refuse_started(out, ChildError::Running(key)),
                    Some(State::Restarting(_)) => refuse_started(out, ChildError::Restarting(key)),
                    Some(State::Terminated) => self.steps.push_back(Step::Start {
                        key,
                        purpose: Purpose::Request(request, RequestKind::RestartChild),
                    }),
                }
            }
            Request::DeleteChild(id) => {
                if simple {
                    return reply_done(
                        out,
                        Err(ChildError::WrongStrategy(
                            "delete_child is not for simple_one_for_one",
                        )),
                    );
                }
                let key = ChildKey::Static(id);
                let r = match self.life(&key).map(|l| l.state) {
                    None => Err(ChildError::NotFound(key)),
                    Some(State::Running(_)) => Err(ChildError::Running(key)),
                    Some(State::Restarting(_)) => Err(ChildError::Restarting(key)),
                    Some(State::Terminated) => {
                        self.remove(&key);
                        Ok(())
                    }
                };
                reply_done(out, r);
            }
        }
    }

    /// Stops every running child, in reverse start order (dynamic children
    /// all at once), and forgets temporary ones.
    fn terminate_all(&mut self) {
        if let Some(template) = &self.template {
            let targets: Vec<_> = self
                .dynamic
                .iter()
                .rev()
                .filter_map(|(n, life)| match life.state {
                    State::Running(i) => Some((ChildKey::Dynamic(*n), i)),
                    _ => None,
                })
                .collect();
            let shutdown = template.shutdown;
            self.dynamic.clear();
            if !targets.is_empty() {
                self.steps.push_back(Step::Stop { targets, shutdown });
            }
        } else {
            self.terminate_static(0);
        }
    }

    /// OTP's `terminate_children` over the static children from position
    /// `from` on: each running one is stopped, last started first; temporary
    /// ones are forgotten, the others marked terminated.
    fn terminate_static(&mut self, from: usize) {
        let mut i = self.children.len();
        while i > from {
            i -= 1;
            let c = &mut self.children[i];
            if let State::Running(incarnation) = c.life.state {
                self.steps.push_back(Step::Stop {
                    targets: vec![(ChildKey::Static(c.policy.id.clone()), incarnation)],
                    shutdown: c.policy.shutdown,
                });
            }
            if c.policy.restart == Restart::Temporary {
                self.children.shift_remove_index(i);
            } else {
                c.life.state = State::Terminated;
            }
        }
    }

    /// OTP's `del_child`: temporary and dynamic children are forgotten, the
    /// others marked terminated.
    fn del_child(&mut self, key: &ChildKey) {
        match key {
            ChildKey::Dynamic(n) => {
                self.dynamic.remove(n);
            }
            ChildKey::Static(id) => {
                if let Some(c) = self.children.get_mut(id) {
                    if c.policy.restart == Restart::Temporary {
                        self.children.shift_remove(id);
                    } else {
                        c.life.state = State::Terminated;
                    }
                }
            }
        }
    }

    fn set_terminated(&mut self, key: &ChildKey) {
        if let Some(life) = self.life_mut(key) {
            life.state = State::Terminated;
        }
    }

    fn remove(&mut self, key: &ChildKey) {
        match key {
            ChildKey::Dynamic(n) => {
                self.dynamic.remove(n);
            }
            ChildKey::Static(id) => {
                self.children.shift_remove(id);
            }
        }
    }

    fn static_index(&self, id: &ChildId) -> Option<usize> {
        self.children.get_index_of(id)
    }

    fn static_position(&self, key: &ChildKey) -> usize {
        match key {
            ChildKey::Static(id) => self
                .static_index(id)
                .expect("a child being restarted is in the child list"),
            ChildKey::Dynamic(_) => unreachable!("dynamic children only under simple_one_for_one"),
        }
    }

    fn life(&self, key: &ChildKey) -> Option<&Life> {
        match key {
            ChildKey::Static(id) => self.children.get(id).map(|c| &c.life),
            ChildKey::Dynamic(n) => self.dynamic.get(n),
        }
    }

    fn life_mut(&mut self, key: &ChildKey) -> Option<&mut Life> {
        match key {
            ChildKey::Static(id) => self.children.get_mut(id).map(|c| &mut c.life),
            ChildKey::Dynamic(n) => self.dynamic.get_mut(n),
        }
    }
}

#[cfg(test)]
mod tests;
