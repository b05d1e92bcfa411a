//! The supervisor's mailbox: requests, timers and child exits are handled in
//! the order they arrive, as in an OTP supervisor's mailbox, even while the
//! supervisor is busy stopping a child that hangs on stop.
//!
//! The first tests replay, with real ractor actors and real time, scenarios
//! checked against a real OTP 25 supervisor. The proptest at the end drives a
//! real supervisor under tokio's paused clock with random interleavings of
//! requests, child exits, restart retries and an ordered stop, and checks what
//! it did against the OTP-shaped reference model of `tests/otp/mod.rs`, fed
//! the same messages in their arrival order.

mod otp;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use otp::{Model, Msg, Trace, World};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::Strategy as PropStrategy;
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, concurrency::oneshot};
use regent_supervisor::machine::{Request, RequestId};
use regent_supervisor::{
    Answer, AutoShutdown, ChildError, ChildId, ChildKey, ChildPolicy, ChildSpec, ChildStatus,
    ExitCause, ExitReason, Incarnation, Observation, Observed, Restart, Shutdown, Strategy,
    SupervisorFlags, SupervisorMsg, SupervisorRef, SupervisorSpec, UserRequest, spawn_guarded,
};
use tokio::sync::broadcast;
use tokio::time::timeout;

/// Generous: the CI machine is shared and has two cores.
const DEADLINE: Duration = Duration::from_secs(20);

/// The shutdown timeout of a child that hangs on stop.
const HANG: Duration = Duration::from_millis(300);

/// The probes that ran, by actor: child, incarnation, actor.
#[derive(Clone, Default)]
struct Registry(Arc<Mutex<Registered>>);

#[derive(Default)]
struct Registered {
    /// The latest actor of each child.
    latest: HashMap<String, (Incarnation, ActorCell)>,
    by_actor: HashMap<ActorId, Incarnation>,
}

impl Registry {
    fn register(&self, name: &str, incarnation: Incarnation, cell: ActorCell) {
        let mut r = self.0.lock().unwrap();
        r.by_actor.insert(cell.get_id(), incarnation);
        r.latest.insert(name.to_owned(), (incarnation, cell));
    }

    /// The running actor of `name`, if its latest incarnation is alive and
    /// in its message loop (one that hangs never gets there).
    fn alive(&self, name: &str) -> Option<(Incarnation, ActorCell)> {
        let r = self.0.lock().unwrap();
        let (inc, cell) = r.latest.get(name)?;
        (cell.get_status() == ractor::ActorStatus::Running).then(|| (*inc, cell.clone()))
    }

    fn incarnation_of(&self, cell: &ActorCell) -> Option<Incarnation> {
        self.0.lock().unwrap().by_actor.get(&cell.get_id()).copied()
    }
}

enum Cmd {
    Fail,
    StopNormally,
}

#[derive(Clone)]
struct Probe {
    name: String,
    incarnation: Incarnation,
    hangs: bool,
    /// Starts of these incarnations fail in `pre_start`.
    failing: Arc<HashSet<u64>>,
    registry: Registry,
}

impl Actor for Probe {
    type Msg = Cmd;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, myself: ActorRef<Cmd>, _: ()) -> Result<(), ActorProcessingErr> {
        if self.failing.contains(&self.incarnation.0) {
            return Err(format!("{} {} refuses", self.name, self.incarnation.0).into());
        }
        self.registry
            .register(&self.name, self.incarnation, myself.get_cell());
        Ok(())
    }

    async fn post_start(&self, _: ActorRef<Cmd>, _: &mut ()) -> Result<(), ActorProcessingErr> {
        if self.hangs {
            // Never reaches its message loop, so never sees a stop request
            // (asynchronously, so a kill still ends it): every stop of it
            // takes its shutdown timeout and ends in a kill.
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Cmd>,
        cmd: Cmd,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match cmd {
            Cmd::Fail => return Err(format!("{} fails", self.name).into()),
            Cmd::StopNormally => myself.stop(None),
        }
        Ok(())
    }
}

/// A child specification whose start spawns a [`Probe`] told its incarnation.
fn probe(
    policy: ChildPolicy,
    hangs: bool,
    failing: Arc<HashSet<u64>>,
    registry: Registry,
) -> ChildSpec {
    let name = policy.id.to_string();
    ChildSpec::new(policy, move |ctx| {
        let p = Probe {
            name: name.clone(),
            incarnation: ctx.incarnation(),
            hangs,
            failing: failing.clone(),
            registry: registry.clone(),
        };
        spawn_guarded(ctx, p, ())
    })
}

/// A bench for the fixed scenarios: probes a, b, c, ... and the observations.
struct Bench {
    registry: Registry,
    observer: broadcast::Sender<Observation>,
    observed: broadcast::Receiver<Observation>,
}

impl Bench {
    fn new() -> Self {
        let (observer, observed) = broadcast::channel(4096);
        Self {
            registry: Registry::default(),
            observer,
            observed,
        }
    }

    fn probe(&self, id: &str, hangs: bool) -> ChildSpec {
        let shutdown = if hangs {
            Shutdown::Timeout(HANG)
        } else {
            Shutdown::Timeout(Duration::from_secs(5))
        };
        probe(
            ChildPolicy::worker(id).shutdown(shutdown),
            hangs,
            Arc::default(),
            self.registry.clone(),
        )
    }

    fn spec(&self, strategy: Strategy) -> SupervisorSpec {
        SupervisorSpec::new(
            "sup",
            SupervisorFlags::new(strategy).intensity(10, Duration::from_secs(60)),
        )
        .observer(self.observer.clone())
    }

    /// The observations up to and including the first that matches `pred`.
    async fn until(&mut self, what: &str, pred: impl Fn(&Observed) -> bool) -> Vec<Observed> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match timeout(left, self.observed.recv()).await {
                Ok(Ok(o)) => {
                    let done = pred(&o.event);
                    seen.push(o.event);
                    if done {
                        return seen;
                    }
                }
                Ok(Err(e)) => panic!("observer failed while waiting for {what}: {e}"),
                Err(_) => panic!("timed out waiting for {what}; saw {seen:?}"),
            }
        }
    }

    fn cmd(&self, id: &str, cmd: Cmd) {
        let (_, cell) = self
            .registry
            .alive(id)
            .unwrap_or_else(|| panic!("{id} not running"));
        ActorRef::<Cmd>::from(cell).send_message(cmd).unwrap();
    }
}

fn started(o: &Observed, id: &str) -> bool {
    matches!(o, Observed::Started { key, .. } if key.to_string() == id)
}

fn stopped(o: &Observed, id: &str) -> bool {
    matches!(o, Observed::Stopped { key, .. } if key.to_string() == id)
}

fn running(children: &[regent_supervisor::Child]) -> Vec<String> {
    children
        .iter()
        .filter(|c| matches!(c.status, ChildStatus::Running(_)))
        .map(|c| c.key.to_string())
        .collect()
}

/// The scenario checked against OTP 25: one_for_all with a, b, c, where a
/// hangs on stop (shutdown 300 ms). `terminate_child a`, `terminate_child b`
/// and a crash of c, 30 ms apart, are handled in arrival order: b stops, then
/// c's crash restarts all three, so a, b and c run.
#[tokio::test]
async fn a_busy_supervisor_handles_requests_and_exits_in_arrival_order() {
    let mut b = Bench::new();
    let spec = b
        .spec(Strategy::OneForAll)
        .child(b.probe("a", true))
        .child(b.probe("b", false))
        .child(b.probe("c", false));
    let (sup, _) = SupervisorRef::start(spec).await.unwrap();
    b.until("c started", |o| started(o, "c")).await;

    let s = sup.clone();
    let terminate_a = tokio::spawn(async move { s.terminate_child("a").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = sup.clone();
    let terminate_b = tokio::spawn(async move { s.terminate_child("b").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    b.cmd("c", Cmd::Fail);

    timeout(DEADLINE, terminate_a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    timeout(DEADLINE, terminate_b)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let seen = b.until("c restarted", |o| started(o, "c")).await;
    let order: Vec<String> = seen
        .iter()
        .filter_map(|o| match o {
            Observed::Stopped { key, killed } => Some(format!("stopped {key} killed={killed}")),
            Observed::Exited { key, restart, .. } => {
                Some(format!("exited {key} restart={restart}"))
            }
            Observed::Started { key, .. } => Some(format!("started {key}")),
            _ => None,
        })
        .collect();
    assert_eq!(
        order,
        [
            "stopped a killed=true",
            "stopped b killed=false",
            "exited c restart=true",
            "started a",
            "started b",
            "started c"
        ]
    );
    assert_eq!(
        running(&sup.which_children().await.unwrap()),
        ["a", "b", "c"]
    );
    sup.stop().await;
}

/// A `restart_child` sent before `stop` is answered: the stop waits behind it
/// in the mailbox.
#[tokio::test]
async fn a_restart_child_sent_before_stop_is_answered() {
    let mut b = Bench::new();
    let spec = b
        .spec(Strategy::OneForOne)
        .child(b.probe("a", true))
        .child(b.probe("b", false));
    let (sup, handle) = SupervisorRef::start(spec).await.unwrap();
    b.until("b started", |o| started(o, "b")).await;
    sup.terminate_child("b").await.unwrap();

    let s = sup.clone();
    let terminate_a = tokio::spawn(async move { s.terminate_child("a").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = sup.clone();
    let restart_b = tokio::spawn(async move { s.restart_child("b").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = sup.clone();
    let stop = tokio::spawn(async move { s.stop().await });

    timeout(DEADLINE, terminate_a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let restarted = timeout(DEADLINE, restart_b).await.unwrap().unwrap();
    assert!(restarted.is_ok(), "restart_child: {restarted:?}");
    timeout(DEADLINE, stop).await.unwrap().unwrap();
    timeout(DEADLINE, handle).await.unwrap().unwrap();
    let seen = b
        .until("the supervisor exits", |o| {
            matches!(o, Observed::SupervisorExit { .. })
        })
        .await;
    assert!(seen.iter().any(|o| started(o, "b")), "{seen:?}");
    assert!(seen.iter().any(|o| stopped(o, "b")), "{seen:?}");
}

/// A crash that arrives before `stop` is restarted before the supervisor
/// stops.
#[tokio::test]
async fn a_crash_that_arrives_before_stop_is_restarted_first() {
    let mut b = Bench::new();
    let spec = b
        .spec(Strategy::OneForOne)
        .child(b.probe("a", true))
        .child(b.probe("c", false));
    let (sup, handle) = SupervisorRef::start(spec).await.unwrap();
    b.until("c started", |o| started(o, "c")).await;

    let s = sup.clone();
    let terminate_a = tokio::spawn(async move { s.terminate_child("a").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    b.cmd("c", Cmd::Fail);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = sup.clone();
    let stop = tokio::spawn(async move { s.stop().await });

    timeout(DEADLINE, terminate_a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    timeout(DEADLINE, stop).await.unwrap().unwrap();
    timeout(DEADLINE, handle).await.unwrap().unwrap();
    let seen = b
        .until("the supervisor exits", |o| {
            matches!(o, Observed::SupervisorExit { .. })
        })
        .await;
    let restarted = seen.iter().position(|o| started(o, "c"));
    let exit = seen.iter().position(|o| {
        matches!(
            o,
            Observed::SupervisorExit {
                cause: ExitCause::Requested
            }
        )
    });
    assert!(
        matches!((restarted, exit), (Some(r), Some(e)) if r < e),
        "c is restarted before the supervisor stops: {seen:?}"
    );
}

/// A parent stopping a child supervisor does so through the child's mailbox,
/// as OTP's shutdown exit signal: a `restart_child` already waiting there is
/// answered first.
#[tokio::test]
async fn a_parent_stops_a_child_supervisor_behind_its_waiting_requests() {
    let mut b = Bench::new();
    let inner = b
        .spec(Strategy::OneForOne)
        .child(b.probe("a", true))
        .child(b.probe("b", false));
    let outer = SupervisorSpec::new(
        "outer",
        SupervisorFlags::new(Strategy::OneForOne).intensity(10, Duration::from_secs(60)),
    )
    .child(ChildSpec::supervisor("inner", inner));
    let (outer, _) = SupervisorRef::start(outer).await.unwrap();
    b.until("b started", |o| started(o, "b")).await;
    let inner = SupervisorRef::from_cell(
        outer.which_children().await.unwrap()[0]
            .actor
            .clone()
            .unwrap(),
    );
    inner.terminate_child("b").await.unwrap();

    let s = inner.clone();
    let terminate_a = tokio::spawn(async move { s.terminate_child("a").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = inner.clone();
    let restart_b = tokio::spawn(async move { s.restart_child("b").await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let s = outer.clone();
    let stop_inner = tokio::spawn(async move { s.terminate_child("inner").await });

    timeout(DEADLINE, terminate_a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let restarted = timeout(DEADLINE, restart_b).await.unwrap().unwrap();
    assert!(restarted.is_ok(), "restart_child: {restarted:?}");
    timeout(DEADLINE, stop_inner)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        inner.cell().get_status(),
        ractor::ActorStatus::Stopped,
        "inner stopped"
    );
    outer.stop().await;
}

// ---------------------------------------------------------------------------
// Random interleavings against the OTP model.
// ---------------------------------------------------------------------------

/// Milliseconds a child that hangs on stop takes to stop (its shutdown
/// timeout, then a kill that takes no time).
const HANG_MS: u64 = 300;

/// How a child that does not hang ends on its own.
#[derive(Debug, Clone, Copy)]
enum End {
    Kill,
    Fail,
    Normal,
}

#[derive(Debug, Clone)]
enum Op {
    /// Ends a running child that does not hang (chosen among those running
    /// at that moment).
    End(Index, End),
    Terminate(Index),
    RestartChild(Index),
    Delete(Index),
    StartChild(u8, Restart),
    Stop,
}

#[derive(Debug, Clone)]
struct Case {
    flags: SupervisorFlags,
    /// The children, and whether each hangs on stop.
    children: Vec<(ChildPolicy, bool)>,
    /// Starts of these incarnations fail.
    failing: HashSet<u64>,
    /// Each op and the milliseconds before it (never zero: no two arrive at
    /// once).
    ops: Vec<(Op, u64)>,
}

/// The ids requests name: the static children c0..c4 (some absent) and the
/// children x0..x3 that `start_child` adds.
fn id_of(i: &Index) -> ChildId {
    let n = i.index(9);
    ChildId::new(if n < 5 {
        format!("c{n}")
    } else {
        format!("x{}", n - 5)
    })
}

fn restart_type() -> impl PropStrategy<Value = Restart> {
    prop_oneof![
        Just(Restart::Permanent),
        Just(Restart::Transient),
        Just(Restart::Temporary)
    ]
}

fn op() -> impl PropStrategy<Value = Op> {
    let end = prop_oneof![Just(End::Kill), Just(End::Fail), Just(End::Normal)];
    prop_oneof![
        6 => (any::<Index>(), end).prop_map(|(i, e)| Op::End(i, e)),
        3 => any::<Index>().prop_map(Op::Terminate),
        2 => any::<Index>().prop_map(Op::RestartChild),
        1 => any::<Index>().prop_map(Op::Delete),
        1 => (0..4u8, restart_type()).prop_map(|(n, r)| Op::StartChild(n, r)),
        1 => Just(Op::Stop),
    ]
}

fn case(strategy: Strategy) -> impl PropStrategy<Value = Case> {
    let auto = prop_oneof![
        3 => Just(AutoShutdown::Never),
        1 => Just(AutoShutdown::AnySignificant),
        1 => Just(AutoShutdown::AllSignificant),
    ];
    // Gaps shorter than, around and longer than a hanging stop.
    let gap = prop_oneof![1..60u64, 60..400u64, 400..1200u64];
    (
        auto,
        0..5u32,
        1..6u64,
        proptest::collection::vec(
            (
                restart_type(),
                prop::bool::weighted(0.4),
                0..3u8,
                any::<bool>(),
            ),
            1..=4usize,
        ),
        proptest::collection::vec(prop::bool::weighted(0.15), 40),
        proptest::collection::vec((op(), gap), 1..24),
    )
        .prop_map(move |(auto, max_r, period_s, children, failing, ops)| {
            let n = children.len();
            let flags = SupervisorFlags::new(strategy)
                .intensity(max_r, Duration::from_secs(period_s))
                .auto_shutdown(auto);
            let children = children
                .into_iter()
                .enumerate()
                .map(|(i, (restart, hangs, shutdown, significant))| {
                    let shutdown = if hangs {
                        Shutdown::Timeout(Duration::from_millis(HANG_MS))
                    } else {
                        match shutdown {
                            0 => Shutdown::BrutalKill,
                            1 => Shutdown::Timeout(Duration::from_millis(100)),
                            _ => Shutdown::Infinity,
                        }
                    };
                    let significant =
                        significant && auto != AutoShutdown::Never && restart != Restart::Permanent;
                    let policy = ChildPolicy::worker(format!("c{i}"))
                        .restart(restart)
                        .shutdown(shutdown)
                        .significant(significant);
                    (policy, hangs)
                })
                .collect();
            // The initial starts (incarnations 0..n) succeed.
            let failing = failing
                .into_iter()
                .enumerate()
                .filter(|(_, f)| *f)
                .map(|(i, _)| (n + i) as u64)
                .collect();
            Case {
                flags,
                children,
                failing,
                ops,
            }
        })
}

/// What the supervisor did, as its observer saw it, or the model did.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Did {
    /// A start, with its incarnation when it succeeded.
    Start(ChildKey, Option<Incarnation>),
    Stop(ChildKey),
    Exit(String, Option<ChildKey>),
}

type Answered = Result<Option<(ChildKey, Incarnation)>, String>;

/// One run, of the real supervisor or of the model.
#[derive(Debug, Default, PartialEq, Eq)]
struct Run {
    did: Vec<Did>,
    /// The answer to each request.
    answers: BTreeMap<u64, Answered>,
    /// The children at the end, unless the supervisor exited.
    children: Option<Vec<(ChildKey, ChildStatus)>>,
}

/// Runs `case` on a real supervisor under tokio's paused clock. Returns what
/// it did and the messages it was sent, with their arrival times (ms).
async fn run_real(case: &Case) -> (Run, Vec<(u64, Msg)>) {
    let registry = Registry::default();
    let failing = Arc::new(case.failing.clone());
    let (observer, mut observed) = broadcast::channel(1 << 16);
    let mut spec = SupervisorSpec::new("sup", case.flags).observer(observer);
    for (policy, hangs) in &case.children {
        spec = spec.child(probe(
            policy.clone(),
            *hangs,
            failing.clone(),
            registry.clone(),
        ));
    }
    let (sup, handle) = SupervisorRef::start(spec)
        .await
        .expect("initial starts succeed");
    let base = tokio::time::Instant::now();
    let hanging: HashSet<String> = case
        .children
        .iter()
        .filter(|(_, h)| *h)
        .map(|(p, _)| p.id.to_string())
        .collect();
    let mut sent = Vec::new();
    let mut pending = Vec::new();
    let mut t = 0;
    for (id, (op, gap)) in case.ops.iter().enumerate() {
        t += gap;
        tokio::time::sleep_until(base + Duration::from_millis(t)).await;
        let id = id as u64;
        let mut request = |user: UserRequest, model: Request| {
            let (tx, rx) = oneshot();
            let msg = SupervisorMsg::Request(user, tx.into());
            // A supervisor that has gone drops the port: the answer is "down".
            let _ = sup.actor().send_message(msg);
            pending.push((id, rx));
            (t, Msg::Request(RequestId(id), model))
        };
        let msg = match op {
            Op::End(i, end) => {
                let mut ends: Vec<String> = case
                    .children
                    .iter()
                    .map(|(p, _)| p.id.to_string())
                    .chain((0..4).map(|n| format!("x{n}")))
                    .filter(|name| !hanging.contains(name))
                    .filter(|name| registry.alive(name).is_some())
                    .collect();
                ends.sort();
                if ends.is_empty() {
                    continue;
                }
                let name = &ends[i.index(ends.len())];
                let (inc, cell) = registry.alive(name).expect("alive");
                let reason = match end {
                    End::Kill => {
                        cell.kill();
                        ExitReason::Killed
                    }
                    End::Fail => {
                        ActorRef::<Cmd>::from(cell).send_message(Cmd::Fail).unwrap();
                        ExitReason::Failed(String::new())
                    }
                    End::Normal => {
                        ActorRef::<Cmd>::from(cell)
                            .send_message(Cmd::StopNormally)
                            .unwrap();
                        ExitReason::Normal
                    }
                };
                (
                    t,
                    Msg::Exit(ChildKey::Static(ChildId::new(name)), inc, reason),
                )
            }
            Op::Terminate(i) => {
                let key = ChildKey::Static(id_of(i));
                request(
                    UserRequest::TerminateChild(key.clone()),
                    Request::TerminateChild(key),
                )
            }
            Op::RestartChild(i) => request(
                UserRequest::RestartChild(id_of(i)),
                Request::RestartChild(id_of(i)),
            ),
            Op::Delete(i) => request(
                UserRequest::DeleteChild(id_of(i)),
                Request::DeleteChild(id_of(i)),
            ),
            Op::StartChild(n, restart) => {
                let policy = ChildPolicy::worker(format!("x{n}"))
                    .restart(*restart)
                    .shutdown(Shutdown::BrutalKill);
                let spec = probe(policy.clone(), false, failing.clone(), registry.clone());
                request(UserRequest::StartChild(spec), Request::StartChild(policy))
            }
            Op::Stop => {
                let _ = sup.actor().send_message(SupervisorMsg::Stop);
                (t, Msg::Shutdown)
            }
        };
        sent.push(msg);
    }
    // Everything settles: the longest plan is a few hanging stops.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let mut run = Run::default();
    let alive = sup.cell().get_status() == ractor::ActorStatus::Running;
    if alive {
        let children = sup.which_children().await.expect("alive");
        run.children = Some(children.into_iter().map(|c| (c.key, c.status)).collect());
    }
    while let Ok(o) = observed.try_recv() {
        match o.event {
            Observed::Started { key, incarnation } => {
                run.did.push(Did::Start(key, Some(incarnation)))
            }
            Observed::StartFailed { key, .. } => run.did.push(Did::Start(key, None)),
            Observed::Stopped { key, .. } => run.did.push(Did::Stop(key)),
            Observed::SupervisorExit { cause } => run.did.push(did(otp::cause_trace(&cause))),
            _ => {}
        }
    }
    for (id, rx) in pending {
        let answer = match rx.await {
            Ok(Ok(Answer::Started(key, cell))) => {
                let inc = registry.incarnation_of(&cell).expect("a started probe");
                Ok(Some((key, inc)))
            }
            Ok(Ok(Answer::Done)) => Ok(None),
            Ok(Err(e)) => Err(otp::error_kind(&e)),
            Err(_) => Err(otp::error_kind(&ChildError::SupervisorDown)),
        };
        run.answers.insert(id, answer);
    }
    sup.stop().await;
    timeout(DEADLINE, handle).await.unwrap().unwrap();
    (run, sent)
}

fn did(t: Trace) -> Did {
    match t {
        Trace::Exit(cause, key) => Did::Exit(cause, key),
        other => unreachable!("not an exit: {other:?}"),
    }
}

/// Runs the model over the messages in arrival order, with the retries it
/// sends itself arriving when it sends them. `None` when a retry would
/// arrive at the very millisecond of another message: their order is then
/// the scheduler's, not the mailbox's.
fn run_model(case: &Case, sent: &[(u64, Msg)]) -> Option<Run> {
    let specs: Vec<ChildPolicy> = case.children.iter().map(|(p, _)| p.clone()).collect();
    let world = World {
        failing_incarnations: case.failing.clone(),
        ..World::default()
    };
    let mut model = Model::new(case.flags, &specs);
    model.hangs = case
        .children
        .iter()
        .filter(|(_, h)| *h)
        .map(|(p, _)| p.id.clone())
        .collect();
    model.hang_ms = HANG_MS;
    model.init(&world);
    let times: HashSet<u64> = sent.iter().map(|(t, _)| *t).collect();
    let mut sent = sent.iter().cloned().peekable();
    let mut retries: std::collections::VecDeque<(u64, Msg)> = Default::default();
    let mut answers = BTreeMap::new();
    loop {
        let next = match (sent.peek(), retries.front()) {
            (None, None) => break,
            (Some(_), None) => sent.next(),
            (None, Some(_)) => retries.pop_front(),
            (Some((a, _)), Some((b, _))) => {
                if a <= b {
                    sent.next()
                } else {
                    retries.pop_front()
                }
            }
        };
        let (arrival, msg) = next.expect("one of the two");
        let request = match &msg {
            Msg::Request(id, _) => Some(id.0),
            _ => None,
        };
        if model.exited {
            if let Some(id) = request {
                answers.insert(id, Err(otp::error_kind(&ChildError::SupervisorDown)));
            }
            continue;
        }
        model.clock_ms = model.clock_ms.max(arrival);
        let now = model.clock_ms;
        let before = model.trace.len();
        model.handle(msg, now, &world);
        if let Some(id) = request {
            let answer = model.trace[before..]
                .iter()
                .find_map(|t| match t {
                    Trace::Reply(r) => Some(r.clone()),
                    _ => None,
                })
                .expect("every request is answered");
            answers.insert(id, answer);
        }
        for m in model.mailbox.drain(..) {
            if times.contains(&model.clock_ms) {
                return None;
            }
            retries.push_back((model.clock_ms, m));
        }
    }
    let mut did = Vec::new();
    for t in &model.trace {
        match t {
            Trace::Start(k, inc, ok) => did.push(Did::Start(k.clone(), ok.then_some(*inc))),
            Trace::Stop(keys) => did.extend(keys.iter().cloned().map(Did::Stop)),
            Trace::Reply(_) => {}
            Trace::Exit(cause, key) => did.push(Did::Exit(cause.clone(), key.clone())),
        }
    }
    Some(Run {
        did,
        answers,
        children: (!model.exited).then(|| model.children()),
    })
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let (real, sent) = rt.block_on(run_real(case));
    let Some(model) = run_model(case, &sent) else {
        return Err(TestCaseError::reject("a retry ties with an arrival"));
    };
    prop_assert_eq!(&real.did, &model.did, "what they did; sent {:?}", sent);
    prop_assert_eq!(&real.answers, &model.answers, "answers; sent {:?}", sent);
    prop_assert_eq!(&real.children, &model.children, "children; sent {:?}", sent);
    Ok(())
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(150),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn one_for_one_handles_its_mailbox_as_otp(c in case(Strategy::OneForOne)) {
        check(&c)?;
    }

    #[test]
    fn one_for_all_handles_its_mailbox_as_otp(c in case(Strategy::OneForAll)) {
        check(&c)?;
    }

    #[test]
    fn rest_for_one_handles_its_mailbox_as_otp(c in case(Strategy::RestForOne)) {
        check(&c)?;
    }
}
