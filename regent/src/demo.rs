//! `regent demo`: a tree of supervisors recovering from injected failures.
//!
//! The tree:
//!
//! ```text
//! root (one_for_one)
//! ├── trainers (one_for_all): loader, trainer-0, trainer-1
//! ├── pipeline (rest_for_one): reader, parser, writer
//! ├── pool (simple_one_for_one): dynamic workers
//! └── jobs (one_for_one)
//!     └── flaky (one_for_one, gives up at the first restart): worker
//! ```
//!
//! Each step injects one fault, waits until the tree has recovered (a
//! condition, with a deadline), and prints what the supervisors did. The demo
//! fails (non-zero exit) if a recovery it claims does not happen.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};
use regent_supervisor::{
    Backoff, ChildKind, ChildSpec, ChildStatus, ChildTemplate, ExitCause, Observation, Observed,
    Shutdown, Strategy, SupervisorFlags, SupervisorRef, SupervisorSpec,
};
use tokio::sync::broadcast;

const DEADLINE: Duration = Duration::from_secs(20);

/// Faults a worker can be told to commit.
#[derive(Debug)]
enum Fault {
    Panic,
    Fail,
    /// Block the handler forever: the worker will not see a stop request.
    Hang,
}

/// A worker that does nothing but obey fault injections. Its `pre_start`
/// fails while `broken` is set.
#[derive(Clone)]
struct Worker {
    name: String,
    broken: Arc<AtomicBool>,
}

impl Actor for Worker {
    type Msg = Fault;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<Fault>, _: ()) -> Result<(), ActorProcessingErr> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(format!("{}: cannot open its dataset", self.name).into());
        }
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<Fault>,
        f: Fault,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match f {
            Fault::Panic => panic!("{}: index out of bounds in the loss", self.name),
            Fault::Fail => Err(format!("{}: NaN in the gradients", self.name).into()),
            Fault::Hang => std::future::pending().await,
        }
    }
}

fn worker(name: &str, broken: &Arc<AtomicBool>) -> ChildSpec {
    let w = Worker {
        name: name.to_owned(),
        broken: broken.clone(),
    };
    ChildSpec::worker(name, move || (w.clone(), ()))
}

/// Prints observations as they happen and counts them.
#[derive(Default)]
struct Tally {
    restarts: BTreeMap<String, usize>,
    exits: usize,
    kills: usize,
    gave_up: Vec<String>,
}

fn describe(o: &Observation) -> Option<String> {
    let s = &o.supervisor;
    Some(match &o.event {
        Observed::Started { key, incarnation } => {
            format!("{s:>9}: started {key} (incarnation {})", incarnation.0)
        }
        Observed::StartFailed { key, error } => format!("{s:>9}: {key} failed to start: {error}"),
        Observed::Exited {
            key,
            reason,
            restart,
        } => format!(
            "{s:>9}: {key} exited ({reason}){}",
            if *restart { " -> restart" } else { "" }
        ),
        Observed::Stopped { key, killed } => format!(
            "{s:>9}: stopped {key}{}",
            if *killed {
                " (killed: it ignored the stop request past its timeout)"
            } else {
                ""
            }
        ),
        Observed::RestartDelayed { key, delay } => {
            format!("{s:>9}: restart of {key} delayed {delay:?}")
        }
        Observed::ChildStuck {
            key,
            incarnation,
            waited,
        } => format!(
            "{s:>9}: {key} (incarnation {}) still runs {waited:?} after its kill: a callback blocks its thread",
            incarnation.0
        ),
        Observed::SupervisorExit { cause } => match cause {
            ExitCause::IntensityExceeded { key } => format!(
                "{s:>9}: too many restarts ({key} was the last straw); stopped its children, exits with reason shutdown"
            ),
            ExitCause::AutoShutdown { key } => {
                format!("{s:>9}: significant child {key} finished; shuts down")
            }
            ExitCause::Requested => format!("{s:>9}: stopped on request"),
            ExitCause::StartFailed { key, error } => {
                format!("{s:>9}: could not start: {key}: {error}")
            }
        },
    })
}

async fn printer(mut rx: broadcast::Receiver<Observation>, t0: Instant, tally: Arc<Mutex<Tally>>) {
    while let Ok(o) = rx.recv().await {
        {
            let mut t = tally.lock().expect("not poisoned");
            match &o.event {
                Observed::Exited { restart, .. } => {
                    t.exits += 1;
                    if *restart {
                        *t.restarts.entry(o.supervisor.clone()).or_default() += 1;
                    }
                }
                Observed::Stopped { killed: true, .. } => t.kills += 1,
                Observed::SupervisorExit {
                    cause: ExitCause::IntensityExceeded { .. },
                } => t.gave_up.push(o.supervisor.clone()),
                _ => {}
            }
        }
        if let Some(line) = describe(&o) {
            println!("  [{:>8.3} ms] {line}", t0.elapsed().as_secs_f64() * 1e3);
        }
    }
}

/// Every child of the tree by path, with its status.
type Snapshot = Vec<(String, ChildStatus)>;

/// The running tree and how to reach into it.
struct Tree {
    root: SupervisorRef,
}

impl Tree {
    async fn sup(&self, path: &[&str]) -> anyhow::Result<SupervisorRef> {
        let mut sup = self.root.clone();
        for id in path {
            sup = SupervisorRef::from_cell(self.child(&sup, id).await?);
        }
        Ok(sup)
    }

    async fn child(&self, sup: &SupervisorRef, id: &str) -> anyhow::Result<ActorCell> {
        sup.which_children()
            .await?
            .into_iter()
            .find(|c| c.key.to_string() == id)
            .and_then(|c| c.actor)
            .with_context(|| format!("{id} is not running"))
    }

    async fn worker(&self, path: &[&str], id: &str) -> anyhow::Result<ActorRef<Fault>> {
        let sup = self.sup(path).await?;
        Ok(self.child(&sup, id).await?.into())
    }

    /// Every child of every supervisor, recursively, with its status.
    async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        let mut out = Vec::new();
        let mut stack = vec![(String::from("root"), self.root.clone())];
        while let Some((path, sup)) = stack.pop() {
            for c in sup.which_children().await? {
                let p = format!("{path}/{}", c.key);
                if let (ChildKind::Supervisor, Some(cell)) = (c.kind, &c.actor) {
                    stack.push((p.clone(), SupervisorRef::from_cell(cell.clone())));
                }
                out.push((p, c.status));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Waits until every child in the tree runs and, when `before` is given,
    /// some child has a new incarnation since then; returns which.
    async fn await_whole(&self, before: Option<&Snapshot>) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let snap = self.snapshot().await;
            if let Ok(s) = &snap
                && s.iter()
                    .all(|(_, st)| matches!(st, ChildStatus::Running(_)))
            {
                let changed = before.map(|b| restarted(b, s)).unwrap_or_default();
                if before.is_none() || !changed.is_empty() {
                    return Ok(changed);
                }
            }
            if Instant::now() > deadline {
                bail!("the tree did not recover within {DEADLINE:?}: {snap:?}");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn print(&self) -> anyhow::Result<()> {
        for (path, status) in self.snapshot().await? {
            let depth = path.matches('/').count();
            let name = path.rsplit('/').next().unwrap_or(&path);
            let st = match status {
                ChildStatus::Running(i) => format!("running (incarnation {})", i.0),
                ChildStatus::Restarting => "restarting".into(),
                ChildStatus::Terminated => "terminated".into(),
            };
            println!("    {}{name}: {st}", "  ".repeat(depth - 1));
        }
        Ok(())
    }
}

fn incarnations(snap: &Snapshot) -> HashSet<(String, u64)> {
    snap.iter()
        .filter_map(|(p, s)| match s {
            ChildStatus::Running(i) => Some((p.clone(), i.0)),
            _ => None,
        })
        .collect()
}

/// Which children got a new incarnation between two snapshots.
fn restarted(before: &Snapshot, after: &Snapshot) -> Vec<String> {
    let old = incarnations(before);
    let mut v: Vec<String> = incarnations(after)
        .into_iter()
        .filter(|x| !old.contains(x))
        .map(|(p, _)| p)
        .collect();
    v.sort();
    v
}

fn step(n: u32, title: &str) {
    println!("\n== step {n}: {title}");
}

async fn wait_until(
    tally: &Mutex<Tally>,
    what: &str,
    cond: impl Fn(&Tally) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    while !cond(&tally.lock().expect("not poisoned")) {
        ensure!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Runs the demo and prints what happened.
pub(crate) async fn run() -> anyhow::Result<()> {
    // The panics below are injected and the supervisors report them; the
    // default hook's message and backtrace would only be noise.
    std::panic::set_hook(Box::new(|_| {}));
    let t0 = Instant::now();
    let (observer, rx) = broadcast::channel(4096);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let printing = tokio::spawn(printer(rx, t0, tally.clone()));
    let ok = Arc::new(AtomicBool::new(false));
    let broken = Arc::new(AtomicBool::new(false));
    let flags =
        |s: Strategy, max_r: u32| SupervisorFlags::new(s).intensity(max_r, Duration::from_secs(10));
    let sup =
        |name: &str, f: SupervisorFlags| SupervisorSpec::new(name, f).observer(observer.clone());

    let trainers = sup("trainers", flags(Strategy::OneForAll, 3))
        .child(worker("loader", &ok))
        .child(worker("trainer-0", &ok))
        .child(worker("trainer-1", &ok));
    let pipeline = sup("pipeline", flags(Strategy::RestForOne, 3))
        .child(worker("reader", &ok))
        .child(worker("parser", &ok))
        .child(worker("writer", &ok).shutdown(Shutdown::Timeout(Duration::from_millis(200))));
    let pool_ok = ok.clone();
    let pool = sup("pool", flags(Strategy::SimpleOneForOne, 3)).template(ChildTemplate::worker(
        "shard",
        move |shard: &u32| {
            let w = Worker {
                name: format!("shard-{shard}"),
                broken: pool_ok.clone(),
            };
            (w, ())
        },
    ));
    let flaky = sup("flaky", flags(Strategy::OneForOne, 0)).child(worker("worker", &broken));
    // jobs delays its restarts (backoff, beyond OTP): 50 ms, then 100 ms, ...
    let backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_secs(1),
        reset_after: Duration::from_secs(5),
    };
    let jobs = sup("jobs", flags(Strategy::OneForOne, 2).backoff(backoff))
        .child(ChildSpec::supervisor("flaky", flaky));
    let root = sup("root", flags(Strategy::OneForOne, 3))
        .child(ChildSpec::supervisor("trainers", trainers))
        .child(ChildSpec::supervisor("pipeline", pipeline))
        .child(ChildSpec::supervisor("pool", pool))
        .child(ChildSpec::supervisor("jobs", jobs));

    println!("regent supervision demo: a tree of OTP supervisors recovering from injected faults");
    step(0, "start the tree (children start in order)");
    let (root, root_task) = SupervisorRef::start(root).await?;
    let tree = Tree { root };
    let pool = tree.sup(&["pool"]).await?;
    for shard in 0..3u32 {
        pool.start_dynamic_child(shard).await?;
    }
    tree.await_whole(None).await?;
    tree.print().await?;

    step(
        1,
        "trainer-1 panics; trainers is one_for_all, so all three restart",
    );
    let before = tree.snapshot().await?;
    tree.worker(&["trainers"], "trainer-1")
        .await?
        .cast(Fault::Panic)?;
    let r = tree.await_whole(Some(&before)).await?;
    println!("  restarted: {r:?}");
    ensure!(
        r == [
            "root/trainers/loader",
            "root/trainers/trainer-0",
            "root/trainers/trainer-1"
        ],
        "one_for_all should restart all three trainers, restarted {r:?}"
    );

    step(
        2,
        "parser fails; pipeline is rest_for_one, so parser and writer restart, reader keeps running",
    );
    let before = tree.snapshot().await?;
    tree.worker(&["pipeline"], "parser")
        .await?
        .cast(Fault::Fail)?;
    let r = tree.await_whole(Some(&before)).await?;
    println!("  restarted: {r:?}");
    ensure!(
        r == ["root/pipeline/parser", "root/pipeline/writer"],
        "rest_for_one should restart parser and writer, restarted {r:?}"
    );

    step(
        3,
        "shard #1 of the pool is killed; only that instance restarts",
    );
    let before = tree.snapshot().await?;
    tree.worker(&["pool"], "#1").await?.get_cell().kill();
    let r = tree.await_whole(Some(&before)).await?;
    println!("  restarted: {r:?}");
    ensure!(
        r == ["root/pool/#1"],
        "simple_one_for_one should restart #1, restarted {r:?}"
    );

    step(
        4,
        "writer hangs and ignores stop; asking pipeline to terminate it ends in a kill after 200 ms",
    );
    tree.worker(&["pipeline"], "writer")
        .await?
        .cast(Fault::Hang)?;
    let pipeline = tree.sup(&["pipeline"]).await?;
    let t = Instant::now();
    pipeline.terminate_child("writer").await?;
    println!("  terminate_child returned after {:?}", t.elapsed());
    pipeline.restart_child("writer").await?;
    tree.await_whole(None).await?;

    step(
        5,
        "flaky's worker fails and then cannot start; flaky gives up and escalates to jobs, which restarts flaky after a backoff, by which time the fault is fixed",
    );
    broken.store(true, Ordering::SeqCst);
    tree.worker(&["jobs", "flaky"], "worker")
        .await?
        .cast(Fault::Fail)?;
    wait_until(&tally, "flaky gives up", |t| {
        t.gave_up.iter().any(|s| s == "flaky")
    })
    .await?;
    broken.store(false, Ordering::SeqCst);
    tree.await_whole(None).await?;
    println!("  the tree is whole again:");
    tree.print().await?;

    step(
        6,
        "the fault comes back for good: flaky gives up, jobs retries with backoff and gives up, root retries and gives up; each stops its children in reverse start order",
    );
    broken.store(true, Ordering::SeqCst);
    tree.worker(&["jobs", "flaky"], "worker")
        .await?
        .cast(Fault::Panic)?;
    tokio::time::timeout(DEADLINE, root_task)
        .await
        .context("root did not stop")??;
    // Every observer sender goes away with the tree; the printer drains the
    // rest and ends.
    drop(observer);
    tokio::time::timeout(DEADLINE, printing)
        .await
        .context("printer did not finish")??;

    let t = tally.lock().expect("not poisoned");
    println!("\n== summary");
    println!("  child exits seen: {}", t.exits);
    for (sup, n) in &t.restarts {
        println!("  restarts decided by {sup}: {n}");
    }
    println!(
        "  children killed after their shutdown timeout: {}",
        t.kills
    );
    println!("  supervisors that gave up and escalated: {:?}", t.gave_up);
    ensure!(t.kills >= 1, "the hanging writer should have been killed");
    ensure!(
        t.gave_up
            .ends_with(&["flaky".into(), "jobs".into(), "root".into()]),
        "the permanent fault should have escalated flaky, jobs, root; gave up: {:?}",
        t.gave_up
    );
    println!("  every recovery and escalation happened as the supervision rules say.");
    Ok(())
}
