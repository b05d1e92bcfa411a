//! Supervision of real ractor actors: panics in `pre_start`, handlers and
//! `post_stop` under each strategy, escalation through nested supervisors,
//! shutdown timeouts that end in a kill, a child stuck in a blocking loop,
//! dynamic children, automatic shutdown, and intensity and backoff under
//! tokio's paused time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use regent_supervisor::{
    AutoShutdown, Backoff, ChildCounts, ChildError, ChildSpec, ChildStatus, ChildTemplate,
    ExitCause, ExitReason, Observation, Observed, Restart, Shutdown, StartError, Strategy,
    SupervisorError, SupervisorFlags, SupervisorRef, SupervisorSpec,
};
use tokio::sync::{broadcast, mpsc};
use tokio::time::timeout;

/// Generous: the CI machine is shared and has two cores.
const DEADLINE: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ok,
    PanicInPreStart,
    FailInPreStart,
}

/// How each named probe behaves when it starts; tests change it on the fly.
#[derive(Clone, Default)]
struct Modes(Arc<Mutex<HashMap<String, Mode>>>);

impl Modes {
    fn set(&self, name: &str, mode: Mode) {
        self.0.lock().unwrap().insert(name.to_owned(), mode);
    }
    fn get(&self, name: &str) -> Mode {
        *self.0.lock().unwrap().get(name).unwrap_or(&Mode::Ok)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Life {
    Started(String),
    Stopped(String),
}

#[derive(Clone)]
struct Probe {
    name: String,
    modes: Modes,
    log: mpsc::UnboundedSender<Life>,
}

enum Cmd {
    Panic,
    Fail,
    StopNormally,
    StopThenPanicInPostStop,
    /// Blocks its handler forever, so a stop request is never seen.
    Hang,
    Ping(RpcReplyPort<String>),
}

struct ProbeState {
    panic_in_post_stop: bool,
}

impl Actor for Probe {
    type Msg = Cmd;
    type State = ProbeState;
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<Cmd>, _: ()) -> Result<ProbeState, ActorProcessingErr> {
        match self.modes.get(&self.name) {
            Mode::Ok => {}
            Mode::PanicInPreStart => panic!("{} cannot start", self.name),
            Mode::FailInPreStart => return Err(format!("{} refuses", self.name).into()),
        }
        let _ = self.log.send(Life::Started(self.name.clone()));
        Ok(ProbeState {
            panic_in_post_stop: false,
        })
    }

    async fn post_stop(
        &self,
        _: ActorRef<Cmd>,
        state: &mut ProbeState,
    ) -> Result<(), ActorProcessingErr> {
        let _ = self.log.send(Life::Stopped(self.name.clone()));
        if state.panic_in_post_stop {
            panic!("{} panics in post_stop", self.name);
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Cmd>,
        cmd: Cmd,
        state: &mut ProbeState,
    ) -> Result<(), ActorProcessingErr> {
        match cmd {
            Cmd::Panic => panic!("{} panics in handle", self.name),
            Cmd::Fail => return Err(format!("{} fails", self.name).into()),
            Cmd::StopNormally => myself.stop(None),
            Cmd::StopThenPanicInPostStop => {
                state.panic_in_post_stop = true;
                myself.stop(None);
            }
            Cmd::Hang => std::future::pending::<()>().await,
            Cmd::Ping(port) => {
                let _ = port.send(self.name.clone());
            }
        }
        Ok(())
    }
}

/// A test bench: probe lifecycle log, start modes, supervisor observations.
struct Bench {
    modes: Modes,
    log_tx: mpsc::UnboundedSender<Life>,
    log: mpsc::UnboundedReceiver<Life>,
    observer: broadcast::Sender<Observation>,
    observed: broadcast::Receiver<Observation>,
}

impl Bench {
    fn new() -> Self {
        let (log_tx, log) = mpsc::unbounded_channel();
        let (observer, observed) = broadcast::channel(4096);
        Self {
            modes: Modes::default(),
            log_tx,
            log,
            observer,
            observed,
        }
    }

    fn probe(&self, name: &str) -> ChildSpec {
        let probe = Probe {
            name: name.to_owned(),
            modes: self.modes.clone(),
            log: self.log_tx.clone(),
        };
        ChildSpec::worker(name, move || (probe.clone(), ()))
    }

    fn spec(&self, name: &str, flags: SupervisorFlags) -> SupervisorSpec {
        SupervisorSpec::new(name, flags).observer(self.observer.clone())
    }

    /// The next `n` lifecycle events.
    async fn lives(&mut self, n: usize) -> Vec<Life> {
        let mut out = Vec::new();
        while out.len() < n {
            let next = timeout(DEADLINE, self.log.recv())
                .await
                .unwrap_or_else(|_| panic!("waited for {n} lifecycle events, got {out:?}"));
            out.push(next.expect("log open"));
        }
        out
    }

    /// Asserts no lifecycle event arrives for a short while.
    async fn quiet(&mut self) {
        if let Ok(Some(e)) = timeout(Duration::from_millis(200), self.log.recv()).await {
            panic!("unexpected lifecycle event {e:?}");
        }
    }

    /// Waits for an observation matching `pred`, returning it.
    async fn observe(&mut self, what: &str, pred: impl Fn(&Observation) -> bool) -> Observation {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match timeout(left, self.observed.recv()).await {
                Ok(Ok(o)) if pred(&o) => return o,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("observer failed while waiting for {what}: {e}"),
                Err(_) => panic!("timed out waiting for {what}"),
            }
        }
    }
}

fn started(names: &[&str]) -> Vec<Life> {
    names.iter().map(|n| Life::Started((*n).into())).collect()
}

fn stopped(names: &[&str]) -> Vec<Life> {
    names.iter().map(|n| Life::Stopped((*n).into())).collect()
}

async fn child(sup: &SupervisorRef, id: &str) -> ActorRef<Cmd> {
    let c = sup
        .which_children()
        .await
        .unwrap()
        .into_iter()
        .find(|c| c.key.to_string() == id)
        .unwrap_or_else(|| panic!("no child {id}"));
    c.actor.unwrap_or_else(|| panic!("{id} not running")).into()
}

fn flags(strategy: Strategy) -> SupervisorFlags {
    SupervisorFlags::new(strategy).intensity(10, Duration::from_secs(60))
}

fn is_exit(o: &Observation, sup: &str, id: &str, pred: impl Fn(&ExitReason) -> bool) -> bool {
    o.supervisor == sup
        && matches!(&o.event, Observed::Exited { key, reason, .. } if key.to_string() == id && pred(reason))
}

/// A panic in a handler, under each static strategy, restarts the set the
/// strategy names, stopping in reverse order and starting in order.
#[tokio::test]
async fn panic_in_handle_restarts_what_each_strategy_names() {
    let cases: [(Strategy, &[&str], &[&str]); 3] = [
        (Strategy::OneForOne, &[], &["c1"]),
        (Strategy::OneForAll, &["c2", "c0"], &["c0", "c1", "c2"]),
        (Strategy::RestForOne, &["c2"], &["c1", "c2"]),
    ];
    for (strategy, stops, starts) in cases {
        let mut b = Bench::new();
        let spec = b
            .spec("sup", flags(strategy))
            .child(b.probe("c0"))
            .child(b.probe("c1"))
            .child(b.probe("c2"));
        let (sup, _) = SupervisorRef::start(spec).await.unwrap();
        assert_eq!(b.lives(3).await, started(&["c0", "c1", "c2"]));
        child(&sup, "c1").await.cast(Cmd::Panic).unwrap();
        b.observe("c1 panicked", |o| {
            is_exit(
                o,
                "sup",
                "c1",
                |r| matches!(r, ExitReason::Panicked(m) if m.contains("c1 panics in handle")),
            )
        })
        .await;
        let mut expected = stopped(stops);
        expected.extend(started(starts));
        assert_eq!(b.lives(expected.len()).await, expected, "{strategy}");
        b.quiet().await;
        // Every child answers again.
        for id in ["c0", "c1", "c2"] {
            let r = ractor::call!(child(&sup, id).await, Cmd::Ping).unwrap();
            assert_eq!(r, id);
        }
        sup.stop().await;
        assert_eq!(b.lives(3).await, stopped(&["c2", "c1", "c0"]));
    }
}

/// The same under simple_one_for_one: only the instance restarts, with its
/// arguments.
#[tokio::test]
async fn panic_in_handle_of_a_dynamic_child_restarts_that_instance() {
    let mut b = Bench::new();
    let (modes, log) = (b.modes.clone(), b.log_tx.clone());
    let template = ChildTemplate::worker("worker", move |name: &String| {
        let p = Probe {
            name: name.clone(),
            modes: modes.clone(),
            log: log.clone(),
        };
        (p, ())
    });
    let spec = b
        .spec("pool", flags(Strategy::SimpleOneForOne))
        .template(template);
    let (sup, _) = SupervisorRef::start(spec).await.unwrap();
    let mut ids = Vec::new();
    for name in ["d0", "d1", "d2"] {
        let (n, _) = sup.start_dynamic_child(name.to_owned()).await.unwrap();
        ids.push(n);
    }
    assert_eq!(b.lives(3).await, started(&["d0", "d1", "d2"]));
    let d1: ActorRef<Cmd> = child(&sup, &ids[1].to_string()).await;
    d1.cast(Cmd::Fail).unwrap();
    assert_eq!(b.lives(1).await, started(&["d1"]));
    b.quiet().await;
    assert_eq!(
        sup.count_children().await.unwrap(),
        ChildCounts {
            specs: 1,
            active: 3,
            supervisors: 0,
            workers: 3
        }
    );
    // Wrong argument type: a clear start error, nothing kept.
    let err = sup.start_dynamic_child(42u32).await.unwrap_err();
    assert!(
        matches!(&err, ChildError::Start { error: StartError::WrongArguments { expected }, .. } if expected.contains("String")),
        "{err}"
    );
    sup.terminate_child(ids[0]).await.unwrap();
    assert_eq!(b.lives(1).await, stopped(&["d0"]));
    assert_eq!(sup.which_children().await.unwrap().len(), 2);
    assert!(matches!(
        sup.delete_child("worker").await,
        Err(ChildError::WrongStrategy(_))
    ));
    sup.stop().await;
    let mut rest = b.lives(2).await;
    rest.sort_by_key(|l| format!("{l:?}"));
    assert_eq!(rest, stopped(&["d1", "d2"]));
}

/// A panic in pre_start at init is a start error returned to the caller; the
/// children started before it are stopped.
#[tokio::test]
async fn panic_in_pre_start_at_init_is_a_start_error() {
    for strategy in [
        Strategy::OneForOne,
        Strategy::OneForAll,
        Strategy::RestForOne,
    ] {
        let mut b = Bench::new();
        b.modes.set("c1", Mode::PanicInPreStart);
        let spec = b
            .spec("sup", flags(strategy))
            .child(b.probe("c0"))
            .child(b.probe("c1"))
            .child(b.probe("c2"));
        let err = SupervisorRef::start(spec).await.unwrap_err();
        match &err {
            SupervisorError::ChildStart { key, error, .. } => {
                assert_eq!(key.to_string(), "c1");
                assert!(
                    matches!(error, StartError::Panicked(m) if m.contains("c1 cannot start")),
                    "{error}"
                );
            }
            other => panic!("expected a child start error, got {other}"),
        }
        assert_eq!(
            b.lives(2).await,
            vec![Life::Started("c0".into()), Life::Stopped("c0".into())]
        );
        b.quiet().await;
    }
}

/// A panic in pre_start during a restart is tried again, counts toward the
/// intensity, and ends in escalation rather than a crash loop.
#[tokio::test]
async fn panic_in_pre_start_during_restart_escalates() {
    for strategy in [
        Strategy::OneForOne,
        Strategy::OneForAll,
        Strategy::RestForOne,
    ] {
        let mut b = Bench::new();
        let inner = b
            .spec(
                "inner",
                SupervisorFlags::new(strategy).intensity(3, Duration::from_secs(60)),
            )
            .child(b.probe("c0"))
            .child(b.probe("c1"));
        let outer = b
            .spec(
                "outer",
                SupervisorFlags::new(Strategy::OneForOne).intensity(0, Duration::from_secs(60)),
            )
            .child(ChildSpec::supervisor("inner", inner));
        let (outer, handle) = SupervisorRef::start(outer).await.unwrap();
        assert_eq!(b.lives(2).await, started(&["c0", "c1"]));
        let inner = SupervisorRef::from_cell(
            outer.which_children().await.unwrap()[0]
                .actor
                .clone()
                .unwrap(),
        );
        b.modes.set("c1", Mode::PanicInPreStart);
        child(&inner, "c1").await.cast(Cmd::Panic).unwrap();
        let o = b
            .observe("inner gives up", |o| {
                o.supervisor == "inner" && matches!(o.event, Observed::SupervisorExit { .. })
            })
            .await;
        assert!(matches!(
            o.event,
            Observed::SupervisorExit {
                cause: ExitCause::IntensityExceeded { .. }
            }
        ));
        b.observe("outer sees inner shut down", |o| {
            is_exit(o, "outer", "inner", |r| *r == ExitReason::Shutdown)
        })
        .await;
        // Outer has intensity 0: it gives up too, and its task ends.
        timeout(DEADLINE, handle).await.unwrap().unwrap();
    }
}

/// A panic in post_stop, when a child stops itself, is an abnormal exit.
#[tokio::test]
async fn panic_in_post_stop_is_an_abnormal_exit() {
    for strategy in [
        Strategy::OneForOne,
        Strategy::OneForAll,
        Strategy::RestForOne,
    ] {
        let mut b = Bench::new();
        let spec = b
            .spec("sup", flags(strategy))
            .child(b.probe("c0").restart(Restart::Transient));
        let (sup, _) = SupervisorRef::start(spec).await.unwrap();
        b.lives(1).await;
        child(&sup, "c0")
            .await
            .cast(Cmd::StopThenPanicInPostStop)
            .unwrap();
        b.observe("post_stop panic", |o| {
            is_exit(
                o,
                "sup",
                "c0",
                |r| matches!(r, ExitReason::Panicked(m) if m.contains("post_stop")),
            )
        })
        .await;
        // Transient + abnormal: restarted.
        assert_eq!(
            b.lives(2).await,
            vec![Life::Stopped("c0".into()), Life::Started("c0".into())]
        );
        // A plain normal stop of a transient child is not restarted.
        child(&sup, "c0").await.cast(Cmd::StopNormally).unwrap();
        assert_eq!(b.lives(1).await, stopped(&["c0"]));
        b.quiet().await;
        assert_eq!(
            sup.which_children().await.unwrap()[0].status,
            ChildStatus::Terminated
        );
        sup.stop().await;
    }
}

/// A worker crash loop escalates through three levels of supervisors until the
/// root gives up; each level restarts its child within its intensity first.
#[tokio::test]
async fn escalation_through_three_nested_levels() {
    let mut b = Bench::new();
    let level =
        |n: u32| SupervisorFlags::new(Strategy::OneForOne).intensity(n, Duration::from_secs(60));
    let leaf = b.spec("leaf", level(0)).child(b.probe("w"));
    let mid = b
        .spec("mid", level(1))
        .child(ChildSpec::supervisor("leaf", leaf));
    let root = b
        .spec("root", level(1))
        .child(ChildSpec::supervisor("mid", mid))
        .child(b.probe("bystander"));
    let (root, handle) = SupervisorRef::start(root).await.unwrap();
    assert_eq!(b.lives(2).await, started(&["w", "bystander"]));
    // Each worker crash makes leaf give up (intensity 0). mid restarts leaf
    // once, then gives up; root restarts mid once, then gives up.
    let mut exits = Vec::new();
    for round in 0..4 {
        let mid = SupervisorRef::from_cell(
            root.which_children().await.unwrap()[0]
                .actor
                .clone()
                .unwrap(),
        );
        let leaf = SupervisorRef::from_cell(
            mid.which_children().await.unwrap()[0]
                .actor
                .clone()
                .unwrap(),
        );
        child(&leaf, "w").await.cast(Cmd::Fail).unwrap();
        let o = b
            .observe("a supervisor exits", |o| {
                matches!(o.event, Observed::SupervisorExit { .. })
            })
            .await;
        exits.push(o.supervisor.clone());
        if round % 2 == 1 {
            let o = b
                .observe("mid exits", |o| {
                    matches!(o.event, Observed::SupervisorExit { .. })
                })
                .await;
            exits.push(o.supervisor);
        }
        if round == 3 {
            let o = b
                .observe("root exits", |o| {
                    o.supervisor == "root" && matches!(o.event, Observed::SupervisorExit { .. })
                })
                .await;
            exits.push(o.supervisor);
            break;
        }
        // Wait until the tree is whole again.
        b.observe(
            "w back",
            |o| matches!(&o.event, Observed::Started { key, .. } if key.to_string() == "w"),
        )
        .await;
    }
    assert_eq!(
        exits,
        ["leaf", "leaf", "mid", "leaf", "leaf", "mid", "root"],
        "each level escalates after its own intensity"
    );
    timeout(DEADLINE, handle).await.unwrap().unwrap();
    // Everything is down: the bystander was stopped by root's shutdown.
    let mut lives = Vec::new();
    while let Ok(l) = b.log.try_recv() {
        lives.push(l);
    }
    assert_eq!(lives.last(), Some(&Life::Stopped("bystander".into())));
}

/// A child that ignores the stop request is killed once its shutdown timeout
/// has passed; its post_stop never runs.
#[tokio::test]
async fn a_child_that_ignores_stop_is_killed_after_its_timeout() {
    let mut b = Bench::new();
    let spec = b
        .spec("sup", flags(Strategy::OneForOne))
        .child(
            b.probe("stubborn")
                .shutdown(Shutdown::Timeout(Duration::from_millis(300))),
        )
        .child(b.probe("polite"));
    let (sup, _) = SupervisorRef::start(spec).await.unwrap();
    b.lives(2).await;
    child(&sup, "stubborn").await.cast(Cmd::Hang).unwrap();
    let t = tokio::time::Instant::now();
    sup.terminate_child("stubborn").await.unwrap();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "killed before its timeout: {took:?}"
    );
    b.observe("stubborn killed", |o| {
        matches!(&o.event, Observed::Stopped { key, killed: true } if key.to_string() == "stubborn")
    })
    .await;
    b.quiet().await; // no post_stop: it was killed
    sup.stop().await;
    assert_eq!(b.lives(1).await, stopped(&["polite"]));
}

/// Intensity over a sliding window, with tokio's paused clock: restarts that
/// age out of the period no longer count.
#[tokio::test(start_paused = true)]
async fn intensity_counts_restarts_in_a_sliding_window() {
    let mut b = Bench::new();
    let spec = b
        .spec(
            "sup",
            SupervisorFlags::new(Strategy::OneForOne).intensity(2, Duration::from_secs(10)),
        )
        .child(b.probe("c0"));
    let (sup, handle) = SupervisorRef::start(spec).await.unwrap();
    b.lives(1).await;
    let crash = |sup: SupervisorRef| async move {
        child(&sup, "c0").await.cast(Cmd::Fail).unwrap();
    };
    for _ in 0..2 {
        crash(sup.clone()).await;
        assert_eq!(b.lives(1).await, started(&["c0"]));
    }
    tokio::time::advance(Duration::from_secs(11)).await;
    for _ in 0..2 {
        crash(sup.clone()).await;
        assert_eq!(b.lives(1).await, started(&["c0"]));
    }
    tokio::time::advance(Duration::from_secs(9)).await;
    crash(sup.clone()).await; // third within 10 s
    b.observe("gives up", |o| {
        matches!(
            o.event,
            Observed::SupervisorExit {
                cause: ExitCause::IntensityExceeded { .. }
            }
        )
    })
    .await;
    timeout(DEADLINE, handle).await.unwrap().unwrap();
}

/// Backoff delays the restart by the configured amount, on the paused clock.
#[tokio::test(start_paused = true)]
async fn backoff_delays_restarts() {
    let mut b = Bench::new();
    let backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
        reset_after: Duration::from_secs(30),
    };
    let spec = b
        .spec(
            "sup",
            SupervisorFlags::new(Strategy::OneForOne)
                .intensity(10, Duration::from_secs(60))
                .backoff(backoff),
        )
        .child(b.probe("c0"));
    let (sup, _) = SupervisorRef::start(spec).await.unwrap();
    b.lives(1).await;
    for expected in [100u64, 200, 400] {
        let t = tokio::time::Instant::now();
        child(&sup, "c0").await.cast(Cmd::Fail).unwrap();
        assert_eq!(b.lives(1).await, started(&["c0"]));
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(expected),
            "restarted after {waited:?}, backoff {expected} ms"
        );
    }
    sup.stop().await;
}

/// A significant transient child that finishes shuts its supervisor down
/// (any_significant), and the parent sees a Shutdown exit.
#[tokio::test]
async fn significant_child_exit_shuts_the_supervisor_down() {
    let mut b = Bench::new();
    let job = b
        .spec(
            "job",
            flags(Strategy::OneForOne).auto_shutdown(AutoShutdown::AnySignificant),
        )
        .child(b.probe("helper"))
        .child(
            b.probe("main")
                .restart(Restart::Transient)
                .significant(true),
        );
    let root = b
        .spec("root", flags(Strategy::OneForOne))
        .child(ChildSpec::supervisor("job", job).restart(Restart::Transient));
    let (root, _) = SupervisorRef::start(root).await.unwrap();
    b.lives(2).await;
    let job = SupervisorRef::from_cell(
        root.which_children().await.unwrap()[0]
            .actor
            .clone()
            .unwrap(),
    );
    child(&job, "main").await.cast(Cmd::StopNormally).unwrap();
    b.observe("job auto shutdown", |o| {
        matches!(
            o.event,
            Observed::SupervisorExit {
                cause: ExitCause::AutoShutdown { .. }
            }
        )
    })
    .await;
    b.observe("root sees job's shutdown", |o| {
        is_exit(o, "root", "job", |r| *r == ExitReason::Shutdown)
    })
    .await;
    assert_eq!(b.lives(2).await, stopped(&["main", "helper"]));
    // Transient + shutdown: root does not restart it.
    b.quiet().await;
    assert_eq!(
        root.which_children().await.unwrap()[0].status,
        ChildStatus::Terminated
    );
    root.stop().await;
}

/// A significant permanent child is refused with a clear error.
#[tokio::test]
async fn significant_permanent_child_is_refused() {
    let b = Bench::new();
    let spec = b
        .spec(
            "sup",
            flags(Strategy::OneForOne).auto_shutdown(AutoShutdown::AllSignificant),
        )
        .child(b.probe("c0").significant(true));
    let err = SupervisorRef::start(spec).await.unwrap_err();
    assert!(
        err.to_string().contains("must be transient or temporary"),
        "{err}"
    );
}

/// start_child, terminate_child, restart_child, delete_child and the child
/// listings on a live supervisor.
#[tokio::test]
async fn dynamic_operations_on_static_children() {
    let mut b = Bench::new();
    let (sup, _) = SupervisorRef::start(
        b.spec("sup", flags(Strategy::OneForOne))
            .child(b.probe("c0")),
    )
    .await
    .unwrap();
    b.lives(1).await;
    let cell: ActorCell = sup.start_child(b.probe("c1")).await.unwrap();
    assert_eq!(b.lives(1).await, started(&["c1"]));
    assert!(matches!(
        sup.start_child(b.probe("c1")).await,
        Err(ChildError::AlreadyStarted(_))
    ));
    sup.terminate_child("c1").await.unwrap();
    assert_eq!(b.lives(1).await, stopped(&["c1"]));
    assert_eq!(cell.get_status(), ractor::ActorStatus::Stopped);
    assert!(matches!(
        sup.start_child(b.probe("c1")).await,
        Err(ChildError::AlreadyPresent(_))
    ));
    sup.restart_child("c1").await.unwrap();
    assert_eq!(b.lives(1).await, started(&["c1"]));
    assert!(matches!(
        sup.delete_child("c1").await,
        Err(ChildError::Running(_))
    ));
    sup.terminate_child("c1").await.unwrap();
    b.lives(1).await;
    sup.delete_child("c1").await.unwrap();
    assert!(matches!(
        sup.restart_child("c1").await,
        Err(ChildError::NotFound(_))
    ));
    b.modes.set("c2", Mode::FailInPreStart);
    let err = sup.start_child(b.probe("c2")).await.unwrap_err();
    assert!(err.to_string().contains("c2 refuses"), "{err}");
    let children = sup.which_children().await.unwrap();
    assert_eq!(
        children.len(),
        1,
        "a child that failed to start is not kept"
    );
    sup.stop().await;
    assert!(matches!(
        sup.count_children().await,
        Err(ChildError::SupervisorDown)
    ));
}

/// What the lives of a [`Blocker`] did.
#[derive(Clone, Default)]
struct Lives {
    /// A life is in its blocking loop.
    blocking: Arc<AtomicBool>,
    /// Lives that started while another was still in its blocking loop.
    overlaps: Arc<AtomicUsize>,
    release: Arc<AtomicBool>,
}

/// Releases the blockers when dropped, so that a failing test ends.
struct Release(Arc<AtomicBool>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An actor whose handler blocks its thread in a loop, as tensor code does,
/// until released: a kill cannot end it meanwhile.
#[derive(Clone)]
struct Blocker(Lives);

struct Block;

impl Actor for Blocker {
    type Msg = Block;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<Block>, _: ()) -> Result<(), ActorProcessingErr> {
        if self.0.blocking.load(Ordering::SeqCst) {
            self.0.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<Block>,
        _: Block,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        self.0.blocking.store(true, Ordering::SeqCst);
        let since = std::time::Instant::now();
        // Bounded, so that a failing test still ends.
        while !self.0.release.load(Ordering::SeqCst) && since.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.0.blocking.store(false, Ordering::SeqCst);
        Ok(())
    }
}

/// A child stuck in a blocking loop cannot be killed. When a sibling's crash
/// makes the supervisor (one_for_all) stop it, the supervisor kills it at its
/// shutdown timeout, reports it stuck every `kill_wait`, and starts nothing —
/// above all not the child's next incarnation — until the old one has
/// finished. Two lives of one child never run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_child_stuck_in_a_blocking_loop_is_reported_and_never_runs_twice() {
    let mut b = Bench::new();
    let lives = Lives::default();
    let _release = Release(lives.release.clone());
    let blocker = Blocker(lives.clone());
    let spec = b
        .spec("sup", flags(Strategy::OneForAll))
        .kill_wait(Duration::from_millis(200))
        .child(
            ChildSpec::worker("stuck", move || (blocker.clone(), ()))
                .shutdown(Shutdown::Timeout(Duration::from_millis(100))),
        )
        .child(b.probe("trigger"));
    let (sup, _) = SupervisorRef::start(spec).await.unwrap();
    assert_eq!(b.lives(1).await, started(&["trigger"]));
    let first = match sup.which_children().await.unwrap()[0].status {
        ChildStatus::Running(i) => i,
        other => panic!("stuck is {other:?}"),
    };
    ActorRef::<Block>::from(
        sup.which_children().await.unwrap()[0]
            .actor
            .clone()
            .unwrap(),
    )
    .cast(Block)
    .unwrap();
    let deadline = std::time::Instant::now() + DEADLINE;
    while !lives.blocking.load(Ordering::SeqCst) {
        assert!(std::time::Instant::now() < deadline, "stuck never blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    child(&sup, "trigger").await.cast(Cmd::Fail).unwrap();
    b.observe("trigger exits", |o| is_exit(o, "sup", "trigger", |_| true))
        .await;

    // Reported, then reported again: still waiting, nothing started.
    let mut waits = Vec::new();
    let mut seen = Vec::new();
    while waits.len() < 2 {
        let o = b.observe("stuck reported", |o| o.supervisor == "sup").await;
        if let Observed::ChildStuck {
            key,
            incarnation,
            waited,
        } = &o.event
        {
            assert_eq!(key.to_string(), "stuck");
            assert_eq!(*incarnation, first, "the old incarnation is reported");
            waits.push(*waited);
        }
        seen.push(o.event);
    }
    assert!(waits[0] >= Duration::from_millis(200), "{waits:?}");
    assert!(waits[1] > waits[0], "{waits:?}");
    assert!(
        !seen.iter().any(|o| matches!(o, Observed::Started { .. })),
        "nothing starts while the killed child runs: {seen:?}"
    );
    assert!(
        lives.blocking.load(Ordering::SeqCst),
        "the old life still runs"
    );

    // Once it returns, the kill takes effect and the restart goes on.
    lives.release.store(true, Ordering::SeqCst);
    let stopped = b
        .observe(
            "stuck finally stopped",
            |o| matches!(&o.event, Observed::Stopped { key, .. } if key.to_string() == "stuck"),
        )
        .await;
    assert!(matches!(
        stopped.event,
        Observed::Stopped { killed: true, .. }
    ));
    b.observe(
        "stuck restarted",
        |o| matches!(&o.event, Observed::Started { key, incarnation } if key.to_string() == "stuck" && *incarnation > first),
    )
    .await;
    assert_eq!(b.lives(1).await, started(&["trigger"]));
    assert_eq!(
        lives.overlaps.load(Ordering::SeqCst),
        0,
        "a life started while the old one still ran"
    );
    sup.stop().await;
}

/// `stop` on a handle of an actor that is not a supervisor stops that actor
/// (through ractor's stop port) rather than waiting for an exit that never
/// comes.
#[tokio::test]
async fn stop_through_a_handle_on_another_actor_stops_it() {
    let b = Bench::new();
    let probe = Probe {
        name: "plain".into(),
        modes: b.modes.clone(),
        log: b.log_tx.clone(),
    };
    let (actor, handle) = Actor::spawn(None, probe, ()).await.unwrap();
    timeout(DEADLINE, SupervisorRef::from_cell(actor.get_cell()).stop())
        .await
        .expect("stop returns");
    timeout(DEADLINE, handle).await.unwrap().unwrap();
}
