//! Meshes of real proc processes (`mesh_proc`, started by the
//! `LocalAllocator`'s host agent): casts and calls, and supervision under
//! real faults — SIGKILL under each policy, SIGSTOP past the failure timeout
//! then SIGCONT (the zombie is fenced and told to exit), a panic inside an
//! actor, a crash loop at start that exhausts the intensity, escalation
//! through a three-level tree, a member stuck in blocking code (its proc is
//! replaced), calls during a restart (they fail at once), the controller's
//! frame limit on its procs, and `bootstrap()` under `#[tokio::main]`.
//! Every test checks that no proc it started outlives it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use regent_mesh::alloc::LocalAllocator;
use regent_mesh::alloc::{Allocator, ProcSignal};
use regent_mesh::logs::{LogConfig, LogMode, LogRecord, LogStream};
use regent_mesh::{
    ActorMesh, Decision, FailureCause, MeshError, MeshPolicy, MeshStatus, ProcMesh, Rank, Runtime,
    RuntimeConfig, Selection, Shape, SpawnOptions,
};
use regent_net::EndpointConfig;
use regent_tests::mesh_actors::{Op, ProcThreadWorker, Reply, Worker, WorkerArgs};
use regent_tests::process::{KillOnDrop, alive, wait_gone};

/// Generous: CI has two shared cores.
const DEADLINE: Duration = Duration::from_secs(30);
const LEASE: Duration = Duration::from_secs(3);

struct Cluster {
    rt: Runtime,
    alloc: Arc<LocalAllocator>,
    procs: ProcMesh,
    guard: KillOnDrop,
}

impl Cluster {
    fn config() -> RuntimeConfig {
        RuntimeConfig::default()
            .owner_lease(LEASE)
            .call_timeout(Duration::from_secs(10))
            .endpoint(EndpointConfig::default())
    }

    async fn start(procs: usize) -> Self {
        Self::start_with(procs, Self::config()).await
    }

    async fn start_with(procs: usize, config: RuntimeConfig) -> Self {
        Self::start_env(procs, config, &[]).await
    }

    async fn start_env(procs: usize, config: RuntimeConfig, env: &[(&str, &str)]) -> Self {
        let rt = Runtime::start(config).await.unwrap();
        let mut local = LocalAllocator::new(rt.endpoint().clone())
            .unwrap()
            .program(env!("CARGO_BIN_EXE_mesh_proc"));
        for (k, v) in env {
            local = local.env(*k, *v);
        }
        let alloc = Arc::new(local);
        let guard = KillOnDrop::default();
        let pm = rt
            .spawn_procs(alloc.clone(), Shape::new([("procs", procs)]).unwrap())
            .await
            .unwrap();
        guard.watch(pm.procs().iter().map(|p| p.pid));
        Self {
            rt,
            alloc,
            procs: pm,
            guard,
        }
    }

    async fn spawn(&self, name: &str, per_proc: u32, options: SpawnOptions) -> ActorMesh<Worker> {
        self.spawn_args(name, per_proc, &WorkerArgs::default(), options)
            .await
    }

    async fn spawn_args(
        &self,
        name: &str,
        per_proc: u32,
        args: &WorkerArgs,
        options: SpawnOptions,
    ) -> ActorMesh<Worker> {
        self.procs
            .spawn_with::<Worker>(name, per_proc, args, options)
            .await
            .unwrap()
    }

    fn pid_of(&self, mesh: &ActorMesh<Worker>, proc_rank: usize) -> u32 {
        let proc = &mesh.procs()[proc_rank].proc;
        self.procs
            .all_procs()
            .iter()
            .find(|p| &p.proc == proc)
            .map(|p| p.pid)
            .unwrap()
    }

    /// Stops every proc and checks that none outlives the test.
    async fn finish(self) {
        let pids: Vec<u32> = self.procs.all_procs().iter().map(|p| p.pid).collect();
        self.guard.watch(pids.iter().copied());
        self.procs.stop(Duration::from_secs(2)).await.unwrap();
        let left = wait_gone(&self.guard.pids(), DEADLINE);
        assert!(left.is_empty(), "procs outlived the test: {left:?}");
    }
}

async fn whoami(mesh: &ActorMesh<Worker>) -> Vec<(u32, u64, u32)> {
    let vm = mesh.call(&Selection::All, &Op::Whoami).await.unwrap();
    let values = vm.into_result().unwrap();
    values
        .into_iter()
        .map(|(r, reply)| match reply {
            Reply::Me {
                rank,
                generation,
                pid,
            } => {
                assert_eq!(rank, r.0);
                (rank, generation, pid)
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

async fn running_at(mesh: &ActorMesh<Worker>, generation: u64) {
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= generation
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_of_real_procs_casts_calls_and_reduces() {
    let c = Cluster::start(2).await;
    let mesh = c.spawn("w", 4, SpawnOptions::new()).await;
    mesh.cast(&Selection::All, &Op::Bump)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let who = whoami(&mesh).await;
    assert_eq!(who.len(), 8);
    let pids: std::collections::BTreeSet<u32> = who.iter().map(|(_, _, p)| *p).collect();
    assert_eq!(pids.len(), 2, "two proc processes");
    assert!(
        !pids.contains(&std::process::id()),
        "members are not in the test process"
    );
    c.finish().await;
}

/// SIGKILL of one member's proc under each policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_proc_under_each_policy() {
    for decision in [
        Decision::RestartMember,
        Decision::RestartMesh,
        Decision::Stop,
        Decision::Escalate,
    ] {
        let c = Cluster::start(3).await;
        let mesh = c
            .spawn(
                "w",
                2,
                SpawnOptions::new().policy(MeshPolicy::new(decision)),
            )
            .await;
        let mut failures = mesh.failures();
        let before = whoami(&mesh).await;
        let victim = c.pid_of(&mesh, 1);
        let t = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let failure = tokio::time::timeout(DEADLINE, failures.recv())
            .await
            .unwrap()
            .unwrap();
        println!(
            "{decision:?}: SIGKILL reached the owner after {:?}",
            t.elapsed()
        );
        assert_eq!(failure.ranks, vec![Rank(2), Rank(3)]);
        assert!(
            matches!(
                failure.cause,
                FailureCause::ProcExited {
                    status: regent_mesh::alloc::ProcStatus::Signal(9),
                    ..
                }
            ),
            "{failure}"
        );
        match decision {
            Decision::RestartMember => {
                running_at(&mesh, 1).await;
                let after = whoami(&mesh).await;
                for ((r, g0, p0), (_, g1, p1)) in before.iter().zip(&after) {
                    if *r == 2 || *r == 3 {
                        assert_eq!(*g1, 1, "rank {r} respawned in generation 1");
                        assert_ne!(p0, p1, "rank {r} lives in a fresh proc");
                    } else {
                        assert_eq!((g0, p0), (g1, p1), "rank {r} untouched");
                    }
                }
            }
            Decision::RestartMesh => {
                running_at(&mesh, 1).await;
                let after = whoami(&mesh).await;
                assert!(
                    after.iter().all(|(_, g, _)| *g == 1),
                    "every life is new: {after:?}"
                );
            }
            Decision::Stop => {
                let s = mesh
                    .wait_status(DEADLINE, MeshStatus::is_done)
                    .await
                    .unwrap();
                assert!(matches!(s, MeshStatus::Stopped(Some(_))), "{s:?}");
            }
            Decision::Escalate => {
                let report = tokio::time::timeout(DEADLINE, c.rt.wait_job_failure())
                    .await
                    .unwrap();
                assert_eq!(report.ranks, vec![Rank(2), Rank(3)]);
                assert!(matches!(mesh.status(), MeshStatus::Escalated(_)));
            }
        }
        c.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_inside_an_actor_restarts_that_member() {
    let c = Cluster::start(2).await;
    let mesh = c.spawn("w", 2, SpawnOptions::new()).await;
    let mut failures = mesh.failures();
    let vm = mesh
        .call(&"procs=1,actors=0".parse().unwrap(), &Op::Panic)
        .await
        .unwrap();
    assert_eq!(vm.failed().len(), 1);
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&failure.cause, FailureCause::Actor { panicked: true, message } if message.contains("injected panic in rank 2")),
        "{failure}"
    );
    running_at(&mesh, 1).await;
    let who = whoami(&mesh).await;
    assert_eq!(who[2].1, 1);
    assert_eq!(who[2].2, who[3].2, "same proc: only the actor died");
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_at_start_exhausts_the_intensity_and_escalates() {
    let c = Cluster::start(2).await;
    let flag = std::env::temp_dir().join(format!("regent-crashloop-{}", std::process::id()));
    let args = WorkerArgs {
        fail_start_if: Some(flag.display().to_string()),
        ..WorkerArgs::default()
    };
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(2, Duration::from_secs(60));
    let mesh = c
        .procs
        .spawn_with::<Worker>("w", 1, &args, SpawnOptions::new().policy(policy))
        .await
        .unwrap();
    std::fs::write(&flag, b"").unwrap();
    let _ = mesh.call(&"procs=0".parse().unwrap(), &Op::Fail).await;
    let report = tokio::time::timeout(DEADLINE, c.rt.wait_job_failure())
        .await
        .unwrap();
    let _ = std::fs::remove_file(&flag);
    println!("{report}");
    assert!(matches!(&report.cause, FailureCause::StartFailed(m) if m.contains("exists")));
    assert!(matches!(mesh.status(), MeshStatus::Escalated(_)));
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escalation_through_a_three_level_tree_reaches_the_root() {
    let c = Cluster::start(2).await;
    let escalate = || SpawnOptions::new().policy(MeshPolicy::new(Decision::Escalate));
    let top = c.spawn("top", 1, escalate()).await;
    let mid = c.spawn("mid", 1, escalate().owned_by(&top, Rank(0))).await;
    let leaf = c.spawn("leaf", 1, escalate().owned_by(&mid, Rank(1))).await;
    // The three meshes share procs, so a proc kill would reach each of them
    // directly; a panic in one leaf member reaches only the leaf.
    let _ = leaf.call(&"procs=1".parse().unwrap(), &Op::Panic).await;
    let report = tokio::time::timeout(DEADLINE, c.rt.wait_job_failure())
        .await
        .unwrap();
    println!("{report}");
    let text = report.to_string();
    assert!(
        text.contains("mesh top") && text.contains("mesh mid") && text.contains("mesh leaf"),
        "{text}"
    );
    assert!(
        text.contains("injected panic in rank 1"),
        "the chain names the cause: {text}"
    );
    for m in [&top, &mid, &leaf] {
        assert!(m.status().is_done());
    }
    c.finish().await;
}

/// The lines of a worker journal (see `WorkerArgs::journal`), parsed:
/// (event, rank, generation, pid, the rest).
fn journal(path: &std::path::Path) -> Vec<(String, u32, u64, u32, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut f = l.splitn(5, ' ');
            let mut next = || f.next().unwrap_or_default().to_owned();
            let event = next();
            let rank = next().parse().unwrap();
            let generation = next().parse().unwrap();
            let pid = next().parse().unwrap();
            (event, rank, generation, pid, next())
        })
        .collect()
}

/// A temporary directory with a journal in it, and worker arguments that
/// make every life write to that journal.
fn journaled(
    name: &str,
) -> (
    regent_tests::tempdir::TempDir,
    std::path::PathBuf,
    WorkerArgs,
) {
    let dir = regent_tests::tempdir::TempDir::new("mesh", name);
    let path = dir.path().join("journal");
    let args = WorkerArgs {
        journal: Some(path.display().to_string()),
        ..WorkerArgs::default()
    };
    (dir, path, args)
}

/// Waits until `rank` journals a heartbeat of a blocked thread (`Op::Block`).
async fn blocked(journal_path: &std::path::Path, rank: u32) {
    let end = Instant::now() + DEADLINE;
    while !journal(journal_path)
        .iter()
        .any(|(e, r, _, _, _)| e == "beat" && *r == rank)
    {
        assert!(Instant::now() < end, "rank {rank} never blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `path` holds something (or the deadline passes).
fn wait_for_file(path: &std::path::Path, deadline: Duration) -> Option<String> {
    let end = Instant::now() + deadline;
    loop {
        match std::fs::read_to_string(path) {
            Ok(s) if !s.is_empty() => return Some(s),
            _ if Instant::now() >= end => return None,
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// SIGSTOP a proc past the failure timeout: it is declared failed (link),
/// its members are respawned on a fresh proc in a new generation; after
/// SIGCONT (two leases after the stop) the zombie is fenced: its members
/// got nothing of the new generation, what its member casts to its old
/// peers reaches no one (live procs refuse it, and the zombie, its lease
/// lapsed, acts on nothing), it exits, its exit causes no restart, and no
/// two live members ever share a rank in one generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_proc_is_replaced_and_the_zombie_fenced() {
    const ZOMBIE_MARK: u64 = 999;
    let c = Cluster::start(3).await;
    let (dir, journal_path, args) = journaled("zombie");
    let out = dir.path().join("zombie-cast");
    let mesh = c.spawn_args("w", 2, &args, SpawnOptions::new()).await;
    let mut failures = mesh.failures();
    let zombie = c.pid_of(&mesh, 1);
    let zombie_proc = mesh.procs()[1].proc.clone();
    // Rank 2 (on the doomed proc) will cast to its peers once it wakes,
    // long after its mesh has moved on.
    mesh.cast(
        &"procs=1,actors=0".parse().unwrap(),
        &Op::CastPeersLater {
            after_ms: 3000,
            mark: ZOMBIE_MARK,
            out: out.display().to_string(),
        },
    )
    .await
    .unwrap()
    .into_result()
    .unwrap();
    c.alloc
        .signal(&zombie_proc, ProcSignal::Stop)
        .await
        .unwrap();
    let t = Instant::now();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    println!("SIGSTOP detected after {:?}: {failure}", t.elapsed());
    assert!(
        matches!(failure.cause, FailureCause::LinkFailed { .. }),
        "{failure}"
    );
    assert_eq!(failure.ranks, vec![Rank(2), Rank(3)]);
    running_at(&mesh, 1).await;
    let who = whoami(&mesh).await;
    assert!(
        who.iter().all(|(_, _, pid)| *pid != zombie),
        "no answer from the zombie"
    );
    assert_eq!(who[2].1, 1);
    // The new generation's casts, while the zombie sleeps.
    for m in 1000..1010 {
        mesh.cast(&Selection::All, &Op::Mark(m))
            .await
            .unwrap()
            .into_result()
            .unwrap();
    }
    // Wake the zombie, paused past its lease and the lease watchdog's grace
    // (half the lease): the watchdog counts only time it saw pass, so the
    // zombie's loop ends it (its members stop gracefully), not the
    // watchdog. Its lease lapsed: it acts on nothing that waited for it,
    // its member's cast to itself included, in whichever order its threads
    // wake.
    tokio::time::sleep_until((t + 2 * LEASE).into()).await;
    c.alloc
        .signal(&zombie_proc, ProcSignal::Cont)
        .await
        .unwrap();
    let zombie_cast = wait_for_file(&out, DEADLINE).expect("the zombie's member never cast");
    println!("the zombie's cast to its peers: {zombie_cast}");
    let left = wait_gone(&[zombie], DEADLINE);
    assert!(left.is_empty(), "the zombie is still running");
    // What it sent was refused by every live proc of the mesh (they do not
    // even answer it: it is lost to them), and no member took it.
    assert!(
        zombie_cast.starts_with("Ok(Delivered { delivered: 0,"),
        "{zombie_cast}"
    );
    let lines = journal(&journal_path);
    assert!(
        !lines
            .iter()
            .any(|(e, _, _, _, m)| e == "mark" && m == "999"),
        "a member took the zombie's cast: {lines:?}"
    );
    // The new generation's marks reached every live member, none of the
    // zombie's.
    for (e, rank, _, pid, m) in &lines {
        if e == "mark" && *pid == zombie {
            panic!("the zombie's rank {rank} got mark {m} of the new generation");
        }
    }
    let marked: std::collections::BTreeSet<u32> = lines
        .iter()
        .filter(|(e, _, _, _, m)| e == "mark" && m == "1009")
        .map(|(_, r, _, _, _)| *r)
        .collect();
    assert_eq!(marked, (0..6).collect());
    // Its exit is a report about a replaced life: stale, no restart. A
    // failure after it (the supervisor takes reports in order) shows that
    // only that failure restarts anything.
    let _ = mesh
        .call(&"procs=0,actors=0".parse().unwrap(), &Op::Fail)
        .await;
    running_at(&mesh, 2).await;
    let failure = failures.recv().await.unwrap();
    assert_eq!(failure.ranks, vec![Rank(0)], "{failure}");
    assert!(
        matches!(failure.cause, FailureCause::Actor { .. }),
        "{failure}"
    );
    assert!(failures.try_recv().is_err(), "another failure was reported");
    assert_eq!(
        mesh.generation().0,
        2,
        "the zombie's exit caused no restart"
    );
    let again = whoami(&mesh).await;
    assert_eq!(again[1..], who[1..]);
    let mut seen = std::collections::HashSet::new();
    for (rank, generation, _) in &again {
        assert!(
            seen.insert((rank, generation)),
            "two lives of rank {rank} in generation {generation}"
        );
    }
    assert!(alive(c.pid_of(&mesh, 1)));
    c.finish().await;
}

/// A member stuck in blocking code (a thread that never yields, as tensor
/// code) when its mesh restarts: it cannot be stopped or killed, so its proc
/// exits with `EXIT_MEMBER_STUCK`, and the member is restarted on a fresh
/// proc — never beside its stuck life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_stuck_in_blocking_code_has_its_proc_replaced() {
    let c = Cluster::start(2).await;
    let (_dir, journal_path, args) = journaled("stuck");
    let options = SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMesh));
    let mesh = c.spawn_args("w", 1, &args, options).await;
    let mut failures = mesh.failures();
    let stuck_pid = c.pid_of(&mesh, 1);
    mesh.cast(&"procs=1".parse().unwrap(), &Op::Block(120_000))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    blocked(&journal_path, 1).await;
    // Another member fails: the whole mesh restarts, and rank 1 must stop.
    let t = Instant::now();
    let _ = mesh.call(&"procs=0".parse().unwrap(), &Op::Fail).await;
    running_at(&mesh, 1).await;
    println!("the mesh runs again {:?} after the failure", t.elapsed());
    let who = whoami(&mesh).await;
    assert!(who.iter().all(|(_, g, _)| *g >= 1), "{who:?}");
    assert_ne!(who[1].2, stuck_pid, "rank 1 lives in a fresh proc");
    assert!(
        wait_gone(&[stuck_pid], DEADLINE).is_empty(),
        "the stuck proc still runs"
    );
    // Its proc exited because of the stuck member.
    let mut causes = Vec::new();
    while let Ok(f) = failures.try_recv() {
        causes.push(f.cause);
    }
    println!("failures: {causes:?}");
    assert!(
        causes.iter().any(|cause| matches!(
            cause,
            FailureCause::ProcExited {
                status: regent_mesh::alloc::ProcStatus::Code(code),
                ..
            } if *code == regent_mesh::EXIT_MEMBER_STUCK
        )),
        "no proc exit with EXIT_MEMBER_STUCK among {causes:?}"
    );
    // The proc's loss was known when the first restart failed on it: the
    // next one replaces it (no restart is spent on a proc known lost).
    assert!(
        mesh.generation().0 <= 2,
        "{} restarts: {causes:?}",
        mesh.generation().0
    );
    // Never two lives of rank 1 at once: the stuck life's last heartbeat
    // comes before the next life starts.
    let lines = journal(&journal_path);
    let last_beat = lines
        .iter()
        .rposition(|(e, r, _, p, _)| e == "beat" && *r == 1 && *p == stuck_pid)
        .unwrap();
    let next_start = lines
        .iter()
        .position(|(e, r, g, _, _)| e == "start" && *r == 1 && *g >= 1)
        .expect("rank 1 never restarted");
    assert!(
        last_beat < next_start,
        "the stuck life of rank 1 still ran when the next one started: {lines:?}"
    );
    c.finish().await;
}

/// A call made after a proc's SIGKILL is known and before the new
/// generation runs (the restarted members take 4 s to start) fails at once
/// for the lost members, with an error that says why, far below its
/// timeout; once the mesh runs again, every member answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_during_a_restart_fails_at_once_with_a_clear_error() {
    const TIMEOUT: Duration = Duration::from_secs(20);
    let c = Cluster::start_with(3, Cluster::config().call_timeout(TIMEOUT)).await;
    let args = WorkerArgs {
        restart_new_ms: 4000,
        ..WorkerArgs::default()
    };
    let mesh = c.spawn_args("w", 2, &args, SpawnOptions::new()).await;
    let mut failures = mesh.failures();
    let victim = c.pid_of(&mesh, 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(failure.ranks, vec![Rank(2), Rank(3)], "{failure}");
    mesh.wait_status(DEADLINE, |s| *s == MeshStatus::Restarting)
        .await
        .unwrap();
    let t = Instant::now();
    let vm = mesh.call(&Selection::All, &Op::Whoami).await.unwrap();
    let took = t.elapsed();
    println!(
        "a call during the restart returned in {took:?}: {:?}",
        vm.failed()
    );
    assert_eq!(
        mesh.status(),
        MeshStatus::Restarting,
        "the call returned within the restart"
    );
    assert!(
        took < Duration::from_secs(2),
        "the call took {took:?} (its timeout is {TIMEOUT:?})"
    );
    let failed: Vec<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
    assert!(
        failed.contains(&2) && failed.contains(&3),
        "the lost members failed: {:?}",
        vm.failed()
    );
    for (rank, e) in vm.failed() {
        assert!(
            matches!(e, regent_mesh::MemberError::NotRunning(m) if !m.is_empty()),
            "rank {}: {e:?}",
            rank.0
        );
    }
    assert_eq!(vm.len() + vm.failed().len(), 6);
    running_at(&mesh, 1).await;
    assert_eq!(whoami(&mesh).await.len(), 6);
    c.finish().await;
}

fn sigkill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Waits until the proc mesh keeps `n` live spares; returns them.
async fn spares_ready(pm: &ProcMesh, n: usize) -> Vec<regent_mesh::alloc::AllocatedProc> {
    let until = Instant::now() + DEADLINE;
    loop {
        let spares = pm.spares();
        if spares.len() == n {
            return spares;
        }
        assert!(Instant::now() < until, "spares {spares:?}, not {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Warm spares (`ProcMesh::keep_spares`): a spare killed while it waits is
/// dropped and replaced in the background; a member's proc killed under
/// restart-member is replaced by a waiting spare (the member's new life
/// runs in that spare's process), and another spare is started in its
/// place; stopping the proc mesh stops its spares too. More than
/// `MAX_SPARES` is refused and starts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_proc_is_replaced_by_a_warm_spare_and_the_spare_refilled() {
    let c = Cluster::start(2).await;
    let refused = c.procs.keep_spares(regent_mesh::MAX_SPARES + 1).await;
    assert!(
        matches!(refused, Err(MeshError::Unavailable(_))),
        "{refused:?}"
    );
    assert!(c.procs.spares().is_empty(), "{:?}", c.procs.spares());
    c.procs.keep_spares(2).await.unwrap();
    let first = spares_ready(&c.procs, 2).await;
    c.guard.watch(first.iter().map(|p| p.pid));
    let mesh = c
        .spawn(
            "w",
            1,
            SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMember)),
        )
        .await;
    // A spare dies while it waits: it is never taken, and another is
    // started in its place.
    sigkill(first[0].pid);
    let until = Instant::now() + DEADLINE;
    let spares = loop {
        let spares = spares_ready(&c.procs, 2).await;
        if !spares.iter().any(|p| p.proc == first[0].proc) {
            break spares;
        }
        assert!(Instant::now() < until, "the dead spare is still kept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    c.guard.watch(spares.iter().map(|p| p.pid));
    assert!(spares.iter().any(|p| p.proc == first[1].proc), "{spares:?}");
    // A member's proc dies: a waiting spare takes its place.
    let mut failures = mesh.failures();
    let before = whoami(&mesh).await;
    sigkill(c.pid_of(&mesh, 1));
    tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    running_at(&mesh, 1).await;
    let after = whoami(&mesh).await;
    assert_eq!(after[0], before[0], "rank 0 untouched");
    let replacement = &mesh.procs()[1];
    let taken = spares
        .iter()
        .find(|p| p.proc == replacement.proc)
        .unwrap_or_else(|| {
            panic!(
                "rank 1 runs on {}, not a spare of {spares:?}",
                replacement.proc
            )
        });
    assert_eq!(
        after[1],
        (1, 1, taken.pid),
        "rank 1 lives in the spare's process"
    );
    // The taken spare is replaced in the background.
    let refilled = spares_ready(&c.procs, 2).await;
    c.guard.watch(refilled.iter().map(|p| p.pid));
    assert!(
        !refilled.iter().any(|p| p.proc == taken.proc),
        "{refilled:?}"
    );
    // finish() stops the proc mesh and checks that no proc, spares
    // included, outlives it.
    c.finish().await;
}

/// The controller's endpoint settings reach its procs through their boot:
/// with a frame limit of 4 MiB, a 2 MiB message goes down a cast tree of
/// real procs (proc to proc too) and 2 MiB replies come back (split into
/// parts); a message over the limit is refused at once, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_frame_limit_reaches_its_procs() {
    const MAX: usize = 4 << 20;
    const BIG: usize = 2 << 20;
    let config = Cluster::config()
        .endpoint(EndpointConfig {
            max_frame_bytes: MAX,
            ..EndpointConfig::default()
        })
        .fanout(std::num::NonZeroU32::new(2).unwrap());
    assert!(BIG > EndpointConfig::default().max_frame_bytes);
    let c = Cluster::start_with(3, config).await;
    let mesh = c.spawn("w", 2, SpawnOptions::new()).await;
    let vm = mesh
        .call(&Selection::All, &Op::Echo(vec![7; BIG]))
        .await
        .unwrap();
    let values = vm.into_result().unwrap();
    assert_eq!(values.len(), 6);
    assert!(values.iter().all(|(_, r)| *r == Reply::Count(BIG as u64)));
    let vm = mesh
        .call(&Selection::All, &Op::Blob(BIG as u32))
        .await
        .unwrap();
    let values = vm.into_result().unwrap();
    assert_eq!(values.len(), 6);
    for (rank, reply) in &values {
        assert_eq!(
            *reply,
            Reply::Bytes(vec![rank.0 as u8; BIG]),
            "rank {}",
            rank.0
        );
    }
    let t = Instant::now();
    let err = mesh
        .cast(&Selection::All, &Op::Echo(vec![7; MAX + 1]))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(
        matches!(err, regent_mesh::MeshError::TooLarge { max_frame_bytes, .. } if max_frame_bytes == MAX),
        "{err}"
    );
    assert!(err.to_string().contains("max_frame_bytes"), "{err}");
    // The mesh is unharmed.
    assert_eq!(whoami(&mesh).await.len(), 6);
    c.finish().await;
}

/// `bootstrap()` under `#[tokio::main]`: the binary is its own proc (the
/// local allocator starts it again as one, inside its async runtime), and
/// its mesh works end to end.
#[test]
fn bootstrap_works_under_tokio_main() {
    let guard = KillOnDrop::default();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_mesh_tokio_main"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let controller = child.id();
    guard.watch([controller]);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("OK "))
        .unwrap_or_else(|| panic!("no OK line: {stdout}\n{stderr}"));
    let (replies, pids) = line.split_once(' ').unwrap();
    assert_eq!(replies, "4", "{line}");
    let pids: Vec<u32> = pids.split(',').map(|p| p.parse().unwrap()).collect();
    assert_eq!(pids.len(), 2, "two proc processes: {line}");
    assert!(!pids.contains(&controller), "members ran in procs: {line}");
    guard.watch(pids.iter().copied());
    assert!(wait_gone(&pids, DEADLINE).is_empty(), "procs outlived it");
}

/// Starts `mesh_controller` and reads the pids of the procs it started.
fn start_controller(guard: &KillOnDrop) -> (std::process::Child, Vec<u32>) {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mesh_controller"))
        .arg(env!("CARGO_BIN_EXE_mesh_proc"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    guard.watch([child.id()]);
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap();
    let pids: Vec<u32> = line
        .trim()
        .strip_prefix("PIDS ")
        .unwrap_or_else(|| panic!("unexpected controller output {line:?}"))
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    guard.watch(pids.iter().copied());
    assert_eq!(pids.len(), 3);
    assert!(pids.iter().all(|p| alive(*p)));
    (child, pids)
}

/// The owner dies: its procs (children of its in-process host agent) die
/// with it at once, by their parent-death signal.
#[test]
fn procs_do_not_outlive_a_killed_owner() {
    let guard = KillOnDrop::default();
    let (mut controller, pids) = start_controller(&guard);
    let t = Instant::now();
    controller.kill().unwrap();
    controller.wait().unwrap();
    let left = wait_gone(&pids, DEADLINE);
    assert!(left.is_empty(), "orphans: {left:?}");
    println!("procs gone {:?} after their owner's SIGKILL", t.elapsed());
}

/// The owner is alive but silent (paused): it no longer renews its lease, so
/// its procs stop themselves once the lease (2 s) lapses.
#[test]
fn procs_stop_themselves_when_their_owners_lease_lapses() {
    let guard = KillOnDrop::default();
    let (mut controller, pids) = start_controller(&guard);
    let pid = nix::unistd::Pid::from_raw(controller.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let t = Instant::now();
    let left = wait_gone(&pids, DEADLINE);
    let waited = t.elapsed();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    controller.kill().unwrap();
    controller.wait().unwrap();
    assert!(
        left.is_empty(),
        "procs outlived their owner's lease: {left:?}"
    );
    assert!(
        waited >= Duration::from_millis(1000),
        "procs stopped before the lease could lapse ({waited:?})"
    );
    println!("procs stopped themselves {waited:?} after their owner fell silent (lease 2 s)");
}

/// Lease renewals go down a tree of the procs, relayed by procs and signed
/// by the owner (`docs/semantics.md` §4.1). A relaying proc that is silent
/// must not cut its subtree off: with fan-out 2 over 7 procs, proc 0 relays
/// the renewals of procs 1..4. It is paused (SIGSTOP) for two leases, with
/// a failure timeout past that, so the controller still counts it alive;
/// its subtree's procs keep their leases (the relay reports them missed
/// and the controller renews them directly), and their members answer in
/// their first life. (Proc 0 itself finds its lease lapsed when it
/// resumes and ends: its fate is not checked.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_relaying_proc_does_not_cut_its_subtree_off_renewals() {
    let endpoint = EndpointConfig {
        failure_timeout: Duration::from_secs(20),
        ..EndpointConfig::default()
    };
    let config = Cluster::config()
        .fanout(std::num::NonZeroU32::new(2).unwrap())
        .endpoint(endpoint);
    let c = Cluster::start_with(7, config).await;
    let mesh = c.spawn("subtree", 1, SpawnOptions::default()).await;
    let first = whoami(&mesh).await;
    assert!(first.iter().all(|(_, generation, _)| *generation == 0));
    let pids: Vec<u32> = (0..7).map(|p| c.pid_of(&mesh, p)).collect();
    let relayer = nix::unistd::Pid::from_raw(pids[0] as i32);
    nix::sys::signal::kill(relayer, nix::sys::signal::Signal::SIGSTOP).unwrap();
    tokio::time::sleep(2 * LEASE).await;
    let lapsed: Vec<usize> = (1..7).filter(|&p| !alive(pids[p])).collect();
    nix::sys::signal::kill(relayer, nix::sys::signal::Signal::SIGCONT).unwrap();
    assert!(
        lapsed.is_empty(),
        "procs {lapsed:?} stopped while their relaying proc was paused"
    );
    // A cast to procs 1..7 passes through proc 0 (the head of 0..4): if
    // proc 0 ends as it resumes, a cast in flight then fails there, and the
    // next goes around it.
    let deadline = Instant::now() + DEADLINE;
    let replies = loop {
        match mesh
            .call(&"procs=1..7".parse().unwrap(), &Op::Whoami)
            .await
            .unwrap()
            .into_result()
        {
            Ok(replies) => break replies,
            Err(e) if Instant::now() < deadline => {
                println!("retrying the call: {e:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the subtree's members did not answer: {e:?}"),
        }
    };
    let after: Vec<(u32, u64, u32)> = replies
        .into_iter()
        .map(|(_, reply)| match reply {
            Reply::Me {
                rank,
                generation,
                pid,
            } => (rank, generation, pid),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        after,
        first[1..],
        "the subtree's members in their first life"
    );
    c.finish().await;
}

/// A cluster of `procs` procs whose members log (`RUST_LOG` for the test
/// actors) and whose controller prints their lines in `mode`.
/// The controller's tasks run on a thread of their own
/// (`docs/semantics.md` §4.1): a user's runtime that blocks its only
/// thread for longer than the procs' lease (as a controller doing compute
/// on it would) holds up neither the controller's lease renewals nor its
/// heartbeats, so its proc runs on in the same generation. With the
/// controller's tasks on the user's runtime (`control_thread(false)`), the
/// same block lapses the lease and fails the proc: the guarantee is the
/// thread's.
#[test]
fn a_blocked_user_runtime_holds_up_neither_renewals_nor_heartbeats() {
    for own_thread in [true, false] {
        let user = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let failed = user.block_on(async {
            let c = Cluster::start_with(1, Cluster::config().control_thread(own_thread)).await;
            let mesh = c.spawn("blocked", 1, SpawnOptions::default()).await;
            assert_eq!(whoami(&mesh).await[0].1, 0);
            let mut failures = mesh.failures();
            // The user's only thread, blocked past the lease (3 s).
            std::thread::sleep(LEASE + Duration::from_secs(1));
            let failed = tokio::time::timeout(Duration::from_secs(5), failures.recv())
                .await
                .is_ok();
            if !failed {
                assert_eq!(mesh.generation().0, 0);
                assert_eq!(
                    whoami(&mesh).await[0].1,
                    0,
                    "the proc still runs its first life"
                );
            }
            c.finish().await;
            failed
        });
        assert_eq!(
            failed,
            !own_thread,
            "with the control thread {}: a failure {}",
            if own_thread { "on" } else { "off" },
            if failed { "was seen" } else { "was not seen" }
        );
    }
}

async fn logging_cluster(procs: usize, mode: LogMode) -> Cluster {
    // Wide: the four lines of a cast reach the sink well within it, even on
    // two loaded cores.
    let logs = LogConfig::default()
        .mode(mode)
        .fold_window(Duration::from_secs(2));
    Cluster::start_env(
        procs,
        Cluster::config().logs(logs),
        &[("RUST_LOG", "regent_tests=info")],
    )
    .await
}

/// The records the sink emits until `done` holds for them (or the
/// deadline: then it panics with what came).
async fn records_until(
    rx: &mut tokio::sync::broadcast::Receiver<LogRecord>,
    done: impl Fn(&[LogRecord]) -> bool,
) -> Vec<LogRecord> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    while !done(&seen) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Ok(r)) => seen.push(r),
            Ok(Err(e)) => panic!("log records: {e}; seen {seen:?}"),
            Err(_) => panic!("not all records in time; seen {seen:#?}"),
        }
    }
    seen
}

fn print(text: &str) -> Op {
    Op::Print {
        text: text.into(),
        stderr: false,
        partial: false,
    }
}

/// Members' raw stdout and their `tracing` events reach the controller,
/// prefixed with the proc (raw) or the member (traced); the same line from
/// four ranks is folded into one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_output_reaches_the_controller_prefixed_and_folded() {
    let c = logging_cluster(4, LogMode::Fold).await;
    let mut rx = c.rt.logs().subscribe();
    let mesh = c.spawn("talk", 1, SpawnOptions::new()).await;
    mesh.call(&Selection::All, &print("hello from a member"))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    mesh.call(&Selection::All, &Op::Trace("traced line".into()))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let seen = records_until(&mut rx, |seen| {
        seen.iter().any(|r| r.text == "hello from a member")
            && seen.iter().any(|r| r.text.ends_with("traced line"))
    })
    .await;
    let hello: Vec<&LogRecord> = seen
        .iter()
        .filter(|r| r.text == "hello from a member")
        .collect();
    assert_eq!(hello.len(), 1, "folded into one: {hello:#?}");
    let batch = c.procs.procs()[0]
        .proc
        .as_str()
        .split('-')
        .next()
        .unwrap()
        .to_owned();
    assert_eq!(
        hello[0].render(LogMode::Fold).unwrap(),
        format!("[{batch} r0-3] hello from a member")
    );
    let traced: Vec<&LogRecord> = seen
        .iter()
        .filter(|r| r.text.ends_with("traced line"))
        .collect();
    assert_eq!(traced.len(), 1, "folded into one: {traced:#?}");
    let line = traced[0].render(LogMode::Fold).unwrap();
    assert!(line.starts_with("[talk r0-3 g0] "), "{line}");
    assert!(line.contains("INFO"), "{line}");
    assert_eq!(traced[0].stream, LogStream::Stderr);
    c.finish().await;
}

/// The thread each member of a mesh ran `Op::Thread` on: (name, id, pid)
/// by rank.
async fn threads_of<A>(mesh: &ActorMesh<A>) -> Vec<(Option<String>, String, u32)>
where
    A: regent_mesh::MeshActor<Msg = Op, Reply = Reply>,
{
    let values = mesh
        .call(&Selection::All, &Op::Thread)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    values
        .into_iter()
        .map(|(_, reply)| match reply {
            Reply::Thread { name, id, pid } => (name, id, pid),
            other => panic!("not a thread: {other:?}"),
        })
        .collect()
}

async fn bump(mesh: &ActorMesh<ProcThreadWorker>, rank: u32) -> u64 {
    match mesh.call_one(Rank(rank), &Op::Bump).await.unwrap() {
        Reply::Count(n) => n,
        other => panic!("not a count: {other:?}"),
    }
}

/// Members of an actor that runs on its proc's thread
/// (`MemberThread::Proc`) run there: both members of the proc on one
/// thread, which is not the thread of its own a default member gets. Each
/// one's traced lines carry its own tag though they share the thread, and
/// a panic fails that member alone: it restarts fresh while the proc and
/// its other member live on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_on_the_proc_thread_run_there_log_as_themselves_and_fail_alone() {
    let c = logging_cluster(1, LogMode::All).await;
    let own = c.spawn("own", 1, SpawnOptions::new()).await;
    let shared: ActorMesh<ProcThreadWorker> = c
        .procs
        .spawn_with("shared", 2, &WorkerArgs::default(), SpawnOptions::new())
        .await
        .unwrap();
    let own_thread = threads_of(&own).await;
    let shared_threads = threads_of(&shared).await;
    assert_eq!(own_thread[0].2, shared_threads[0].2, "one proc");
    assert_eq!(
        shared_threads[0].1, shared_threads[1].1,
        "both on the proc's thread: {shared_threads:?}"
    );
    assert_ne!(
        own_thread[0].1, shared_threads[0].1,
        "a default member has a thread of its own"
    );
    assert!(
        own_thread[0]
            .0
            .as_deref()
            .is_some_and(|n| n.ends_with("-r0")),
        "{own_thread:?}"
    );

    let mut rx = c.rt.logs().subscribe();
    shared
        .call(&Selection::All, &Op::Trace("from the proc thread".into()))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let line_of = |rank: u32| {
        move |r: &LogRecord| {
            r.render(LogMode::All).is_some_and(|line| {
                line.starts_with(&format!("[shared r{rank} g0] "))
                    && line.ends_with("from the proc thread")
            })
        }
    };
    records_until(&mut rx, |seen| {
        seen.iter().any(line_of(0)) && seen.iter().any(line_of(1))
    })
    .await;

    assert_eq!(bump(&shared, 1).await, 1);
    let panicked = shared.call_one(Rank(0), &Op::Panic).await;
    assert!(panicked.is_err(), "{panicked:?}");
    shared
        .wait_status(DEADLINE, |s| {
            *s == MeshStatus::Running && shared.generation().0 >= 1
        })
        .await
        .unwrap();
    assert_eq!(bump(&shared, 0).await, 1, "rank 0 restarted fresh");
    assert_eq!(bump(&shared, 1).await, 2, "rank 1 lived on");
    let after = threads_of(&shared).await;
    assert_eq!(after[0].2, shared_threads[0].2, "the same proc");
    assert_eq!(after[0].1, shared_threads[0].1, "on the same thread");
    assert_eq!(
        threads_of(&own).await,
        own_thread,
        "the other mesh lived on"
    );
    c.finish().await;
}

/// A member on its proc's thread that blocks it (code that never yields,
/// which `MemberThread::Proc` forbids) holds up the whole proc: its
/// heartbeats stop, so the owner declares it failed and respawns its
/// members on a fresh proc, while the other proc's member lives on. The
/// held proc cannot run its own lease check, so its lease watchdog (a
/// thread of its own) ends it once the lease lapsed: the zombie is gone
/// within a lease, not when its member lets go two minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_holding_its_procs_thread_gets_the_proc_replaced_and_ended() {
    let c = Cluster::start(2).await;
    let (_dir, journal_path, args) = journaled("held");
    let mesh: ActorMesh<ProcThreadWorker> = c
        .procs
        .spawn_with("held", 1, &args, SpawnOptions::new())
        .await
        .unwrap();
    let mut failures = mesh.failures();
    let before = threads_of(&mesh).await;
    let held = before[1].2;
    mesh.cast_nowait(&"procs=1".parse().unwrap(), &Op::Block(120_000))
        .await
        .unwrap();
    blocked(&journal_path, 1).await;
    let t = Instant::now();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    println!(
        "the held proc was declared failed after {:?}: {failure}",
        t.elapsed()
    );
    assert!(
        matches!(failure.cause, FailureCause::LinkFailed { .. }),
        "{failure}"
    );
    assert_eq!(failure.ranks, vec![Rank(1)]);
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= 1
    })
    .await
    .unwrap();
    let after = threads_of(&mesh).await;
    assert_eq!(after[0].2, before[0].2, "rank 0's proc lived on");
    assert_ne!(after[1].2, held, "rank 1 lives in a fresh proc");
    let left = wait_gone(&[held], LEASE * 4);
    println!("the held proc ended {:?} after its failure", t.elapsed());
    assert!(left.is_empty(), "the held proc still runs");
    c.finish().await;
}

/// With folding off every rank's line comes on its own; JSON lines parse
/// and name the mesh, rank, generation and stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_folding_every_line_comes_and_json_parses() {
    for mode in [LogMode::All, LogMode::Json] {
        let c = logging_cluster(4, mode).await;
        let mut rx = c.rt.logs().subscribe();
        let mesh = c.spawn("talk", 1, SpawnOptions::new()).await;
        mesh.call(&Selection::All, &Op::Trace("same text".into()))
            .await
            .unwrap()
            .into_result()
            .unwrap();
        let seen = records_until(&mut rx, |seen| {
            seen.iter()
                .filter(|r| r.text.ends_with("same text"))
                .count()
                >= 4
        })
        .await;
        let mut ranks: Vec<u32> = seen
            .iter()
            .filter(|r| r.text.ends_with("same text"))
            .map(|r| {
                let json: serde_json::Value =
                    serde_json::from_str(&r.render(LogMode::Json).unwrap()).unwrap();
                assert_eq!(json["mesh"], "talk", "{json}");
                assert_eq!(json["gen"], 0, "{json}");
                assert_eq!(json["stream"], "stderr", "{json}");
                assert_eq!(json["proc"], r.proc.as_str(), "{json}");
                assert!(json["line"].as_str().unwrap().ends_with("same text"));
                r.render(mode).unwrap();
                u32::try_from(json["rank"].as_u64().unwrap()).unwrap()
            })
            .collect();
        ranks.sort_unstable();
        assert_eq!(ranks, vec![0, 1, 2, 3], "{mode}: one record per rank");
        c.finish().await;
    }
}

/// A proc that wrote a partial line and then got SIGKILL: its last lines,
/// the partial one included, come with its failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_procs_last_lines_come_with_its_failure() {
    let c = logging_cluster(2, LogMode::Off).await;
    let mesh = c
        .spawn(
            "dying",
            1,
            SpawnOptions::new().policy(MeshPolicy::new(Decision::Stop)),
        )
        .await;
    let mut failures = mesh.failures();
    for op in [
        print("step 41 done"),
        Op::Print {
            text: "warning on stderr".into(),
            stderr: true,
            partial: false,
        },
        Op::Print {
            text: "step 42 half wri".into(),
            stderr: false,
            partial: true,
        },
    ] {
        mesh.call_one(Rank(1), &op).await.unwrap();
    }
    let victim = c.pid_of(&mesh, 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    let FailureCause::ProcExited {
        status, last_lines, ..
    } = &failure.cause
    else {
        panic!("{failure}");
    };
    assert_eq!(*status, regent_mesh::alloc::ProcStatus::Signal(9));
    let stdout: Vec<&str> = last_lines
        .iter()
        .filter(|l| l.stream == LogStream::Stdout)
        .map(|l| l.text.as_str())
        .collect();
    assert_eq!(
        stdout,
        vec!["step 41 done", "step 42 half wri"],
        "{last_lines:?}"
    );
    assert!(
        last_lines
            .iter()
            .any(|l| l.stream == LogStream::Stderr && l.text == "warning on stderr"),
        "{last_lines:?}"
    );
    let report = failure.to_string();
    assert!(report.contains("| step 42 half wri"), "{report}");
    c.finish().await;
}
