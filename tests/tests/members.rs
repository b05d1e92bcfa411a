//! Members that can carry a training job, across real proc processes
//! (`members_proc`, started by the `LocalAllocator`'s host agent), with
//! faults from the allocator's `signal` (SIGKILL, SIGSTOP): a member that
//! blocks its core for 5 s delays nothing of its proc's control plane;
//! members' calls to a peer whose proc dies or stops fail at once; a
//! restarted member knows why and whom to heal from, and survivors are
//! told; calls retry in the next generation; every mesh on a lost proc
//! moves to one fresh proc, which later spawns use; per-rank placement
//! survives replacement; members read peers' buffers across procs. Every
//! test checks that no proc it started outlives it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use regent_mesh::alloc::{Allocator, LocalAllocator, Placement, ProcSignal, ProcStatus};
use regent_mesh::protocol::StartKind;
use regent_mesh::{
    ActorMesh, FailureCause, MemberError, MeshStatus, ProcMesh, Rank, Retry, Runtime,
    RuntimeConfig, Selection, Shape, SpawnOptions,
};
use regent_net::{Generation, ProcId};
use regent_tests::members_actors::{
    Loader, Me, Place, RestartSeen, SLOT_ENV, Trainer, TrainerOp, TrainerReply, checksum, pattern,
};
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
    async fn start(procs: usize) -> Self {
        Self::with(procs, RuntimeConfig::default(), |_| Placement::default()).await
    }

    async fn with(
        procs: usize,
        config: RuntimeConfig,
        placement: impl Fn(u32) -> Placement,
    ) -> Self {
        let config = config
            .owner_lease(LEASE)
            .call_timeout(Duration::from_secs(20));
        let rt = Runtime::start(config).await.unwrap();
        let alloc = Arc::new(
            LocalAllocator::new(rt.endpoint().clone())
                .unwrap()
                .program(env!("CARGO_BIN_EXE_members_proc")),
        );
        let guard = KillOnDrop::default();
        let pm = rt
            .spawn_procs_placed(
                alloc.clone(),
                Shape::new([("procs", procs)]).unwrap(),
                placement,
            )
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

    async fn trainers(&self, name: &str, per_proc: u32) -> ActorMesh<Trainer> {
        self.procs
            .spawn_with::<Trainer>(name, per_proc, &(), SpawnOptions::new())
            .await
            .unwrap()
    }

    /// The proc that hosts proc rank `proc_rank` of `mesh` now.
    fn proc_of<A>(&self, mesh: &ActorMesh<A>, proc_rank: usize) -> ProcId {
        mesh.procs()[proc_rank].proc.clone()
    }

    async fn signal(&self, proc: &ProcId, signal: ProcSignal) {
        self.alloc.signal(proc, signal).await.unwrap();
    }

    /// Stops every proc and checks that none outlives the test.
    async fn finish(self) {
        let pids: Vec<u32> = self.procs.all_procs().iter().map(|p| p.pid).collect();
        self.guard.watch(pids.iter().copied());
        self.procs.stop(Duration::from_secs(2)).await.unwrap();
        let left = wait_gone(&self.guard.pids(), DEADLINE);
        assert!(left.is_empty(), "procs outlived the test: {left:?}");
        drop(self.rt);
    }
}

async fn whoami(mesh: &ActorMesh<Trainer>) -> Vec<Me> {
    mesh.call(&Selection::All, &TrainerOp::Whoami)
        .await
        .unwrap()
        .into_result()
        .unwrap()
        .into_iter()
        .map(|(r, reply)| match reply {
            TrainerReply::Me(me) => {
                assert_eq!(me.rank, r.0, "each member answers for its own rank");
                *me
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

async fn places(mesh: &ActorMesh<Loader>) -> Vec<Place> {
    mesh.call(&Selection::All, &())
        .await
        .unwrap()
        .into_result()
        .unwrap()
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

async fn running_at<A>(mesh: &ActorMesh<A>, generation: u64) {
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= generation
    })
    .await
    .unwrap();
}

fn ask(to: u32, msg: TrainerOp, timeout: Duration, retry: bool) -> TrainerOp {
    TrainerOp::Ask {
        to,
        msg: Box::new(msg),
        timeout_ms: timeout.as_millis() as u64,
        retry,
    }
}

/// Members' handlers spin for 5 s (never yielding), one per core of the
/// machine, all in proc 0: its heartbeats, lease renewals, deliveries to
/// their idle neighbour, the casts it forwards for another proc, and
/// another mesh on it all go on. No failure is reported (no `LinkFailed`,
/// no lease lost), and every proc is the one it was. (Were members run on
/// the proc's own runtime, as many spinning members as it has worker
/// threads would stall it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_blocking_its_core_for_5s_delays_no_control_plane() {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    // With a fan-out of 2 over three procs, proc 0 forwards the casts for
    // proc 1.
    let fanout = std::num::NonZeroU32::new(2).unwrap();
    let c = Cluster::with(3, RuntimeConfig::default().fanout(fanout), |_| {
        Placement::default()
    })
    .await;
    // Ranks 0..cores spin; rank `cores`, on the same proc, does not.
    let per_proc = cores + 1;
    let neighbour = Rank(cores);
    let mesh = c.trainers("t", per_proc).await;
    let loaders = c.procs.spawn::<Loader>("loaders", 1, &()).await.unwrap();
    let mut failures = mesh.failures();
    let mut loader_failures = loaders.failures();
    let before = whoami(&mesh).await;
    let mut idle = Vec::new();
    for i in 0..20 {
        let t = Instant::now();
        mesh.call_one(neighbour, &TrainerOp::Echo(i)).await.unwrap();
        idle.push(t.elapsed());
    }
    idle.sort();
    let spinners: Selection = format!("procs=0, actors=0..{cores}").parse().unwrap();
    let spin = {
        let mesh = mesh.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let vm = mesh.call(&spinners, &TrainerOp::Spin(5000)).await;
            (vm, t.elapsed())
        })
    };
    let second: Selection = "procs=1".parse().unwrap();
    let mut slowest = Duration::ZERO;
    let mut rounds = 0u64;
    let t = Instant::now();
    while !spin.is_finished() {
        assert!(t.elapsed() < DEADLINE, "the spin never ended");
        let r = Instant::now();
        // The neighbour shares the spinners' proc.
        assert_eq!(
            mesh.call_one(neighbour, &TrainerOp::Echo(rounds))
                .await
                .unwrap(),
            TrainerReply::Count(rounds)
        );
        // Proc 0 forwards this cast to proc 1.
        let d = mesh.cast(&second, &TrainerOp::Echo(rounds)).await.unwrap();
        assert_eq!(d.into_result().unwrap(), per_proc);
        // Another mesh on the same procs.
        assert_eq!(places(&loaders).await.len(), 3);
        slowest = slowest.max(r.elapsed());
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (spun, took) = spin.await.unwrap();
    let spun = spun.unwrap().into_result().unwrap();
    assert_eq!(spun.len(), cores as usize);
    for (rank, reply) in spun {
        match reply {
            TrainerReply::Spun(ms) => assert!(ms >= 5000, "rank {} spun {ms} ms", rank.0),
            other => panic!("{other:?}"),
        }
    }
    println!(
        "while {cores} members spun for {took:?}: {rounds} rounds, the slowest {slowest:?} (idle round trip {:?})",
        idle[idle.len() / 2]
    );
    assert!(rounds >= 10, "only {rounds} rounds in 5 s");
    assert!(
        slowest < Duration::from_secs(2),
        "a round took {slowest:?} while members blocked their cores"
    );
    assert!(
        failures.try_recv().is_err(),
        "a failure was reported while members blocked their cores"
    );
    assert!(loader_failures.try_recv().is_err());
    assert_eq!(mesh.status(), MeshStatus::Running);
    assert_eq!(mesh.generation(), Generation(0));
    let after = whoami(&mesh).await;
    for (b, a) in before.iter().zip(&after) {
        assert_eq!((b.pid, &b.proc), (a.pid, &a.proc), "rank {}", a.rank);
        assert!(alive(a.pid));
    }
    c.finish().await;
}

/// A member's call to a peer whose proc is SIGKILLed, or SIGSTOPped past
/// the failure timeout, ends as soon as the owner declares that proc
/// failed, not at the call's deadline; so does a data channel's wait. After
/// the restart, the member's own mesh reference reaches the peer on its
/// fresh proc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_calls_to_a_lost_peer_fail_at_once() {
    let c = Cluster::start(4).await;
    let mesh = c.trainers("t", 1).await;
    mesh.call(&Selection::All, &TrainerOp::ChannelOpen(3))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    for (victim, signal) in [(1u32, ProcSignal::Kill), (2, ProcSignal::Stop)] {
        let generation = mesh.generation().0;
        let proc = c.proc_of(&mesh, victim as usize);
        let long = Duration::from_secs(25);
        let asking = {
            let mesh = mesh.clone();
            tokio::spawn(async move {
                mesh.call_one(Rank(0), &ask(victim, TrainerOp::Sleep(25_000), long, false))
                    .await
            })
        };
        let waiting = {
            let mesh = mesh.clone();
            tokio::spawn(async move {
                let recv = TrainerOp::ChannelRecv {
                    tag: 3,
                    from: victim,
                    timeout_ms: 25_000,
                };
                mesh.call_one(Rank(3), &recv).await
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = Instant::now();
        c.signal(&proc, signal).await;
        let asked = asking.await.unwrap().unwrap();
        let took = t.elapsed();
        println!("{signal:?}: rank 0's call to rank {victim} ended after {took:?}");
        match asked {
            TrainerReply::Asked(Err(failed)) => {
                assert_eq!(failed.len(), 1);
                assert_eq!(failed[0].0, victim);
                assert!(
                    matches!(failed[0].1, MemberError::NotRunning(_)),
                    "{failed:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            took < Duration::from_secs(10),
            "the call ran {took:?}, towards its 25 s deadline"
        );
        match waiting.await.unwrap().unwrap() {
            TrainerReply::Error(e) => assert!(
                e == format!("peer-failed {victim}") || e == "restarted",
                "{e}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10));
        running_at(&mesh, generation + 1).await;
        if signal == ProcSignal::Stop {
            // The zombie is told to exit once it runs again.
            c.signal(&proc, ProcSignal::Cont).await;
        }
        // The new life of the peer, on a fresh proc, answers rank 0.
        let again = mesh
            .call_one(Rank(0), &ask(victim, TrainerOp::Echo(7), long, false))
            .await
            .unwrap();
        assert_eq!(
            again,
            TrainerReply::Asked(Ok(Box::new(TrainerReply::Count(7))))
        );
        // A fresh channel with the new life: rank 3 reopens nothing (its
        // channel is kept); the restarted rank opens its own.
        mesh.call_one(Rank(victim), &TrainerOp::ChannelOpen(3))
            .await
            .unwrap();
    }
    c.finish().await;
}

/// SIGKILL of a proc with two members: both restart on a fresh proc and
/// start knowing why, in which generation, and which live rank serves each
/// (round robin over the survivors); every survivor is told, and sees the
/// new generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_member_knows_why_and_whom_to_heal_from() {
    let c = Cluster::start(3).await;
    let mesh = c.trainers("t", 2).await;
    let before = whoami(&mesh).await;
    for me in &before {
        assert_eq!(me.start.kind, StartKind::First);
        assert_eq!((me.start.generation, me.generation_now), (0, 0));
        assert_eq!(me.start.source, None);
    }
    let victim = c.proc_of(&mesh, 1);
    c.signal(&victim, ProcSignal::Kill).await;
    running_at(&mesh, 1).await;
    let after = whoami(&mesh).await;
    for me in &after {
        assert_eq!(me.generation_now, 1, "rank {} sees generation 1", me.rank);
        match me.rank {
            2 | 3 => {
                match &me.start.kind {
                    StartKind::Restart { cause, previous } => {
                        assert_eq!(*previous, Generation(0));
                        match cause {
                            FailureCause::ProcExited { proc, status, .. } => {
                                assert_eq!(proc, &victim);
                                assert_eq!(*status, ProcStatus::Signal(9));
                            }
                            other => panic!("rank {} restarted after {other:?}", me.rank),
                        }
                    }
                    other => panic!("rank {} started as {other:?}", me.rank),
                }
                assert_eq!(me.start.generation, 1);
                assert_eq!(me.start.restarted, vec![2, 3]);
                // The survivors 0, 1, 4, 5 in order, round robin.
                let source = if me.rank == 2 { 0 } else { 1 };
                assert_eq!(me.start.source, Some(source), "rank {}", me.rank);
                assert_ne!(me.pid, before[me.rank as usize].pid, "a fresh proc");
                assert!(me.restarts.is_empty());
            }
            _ => {
                assert_eq!(me.start.kind, StartKind::First, "rank {}", me.rank);
                assert_eq!(me.pid, before[me.rank as usize].pid);
                assert_eq!(
                    me.restarts,
                    vec![RestartSeen {
                        generation: 1,
                        ranks: vec![2, 3],
                        sources: vec![(2, 0), (3, 1)],
                        member_generation: 1,
                    }],
                    "rank {} was told",
                    me.rank
                );
            }
        }
    }
    c.finish().await;
}

/// A call with a retry, in flight when a proc is SIGKILLed, completes in
/// the next generation; a training loop built on `retry_in_next_generation`
/// redoes the step a kill interrupted and finishes every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_retry_in_the_next_generation_across_a_sigkill() {
    let c = Cluster::start(3).await;
    let mesh = c.trainers("t", 1).await;
    let retry = Retry::new(3, Duration::from_secs(60));
    let victim = c.proc_of(&mesh, 2);
    let call = {
        let mesh = mesh.with_retry(retry);
        tokio::spawn(async move {
            mesh.call(&Selection::All, &TrainerOp::Sleep(1500))
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.signal(&victim, ProcSignal::Kill).await;
    let vm = call.await.unwrap();
    let values = vm.into_result().expect("the retry completed the call");
    assert_eq!(values.len(), 3);
    assert!(mesh.generation() >= Generation(1));
    // A loop of steps; the third is cut by a SIGKILL of proc 1.
    let mut tries = 0;
    for step in 0..5u64 {
        let killer = (step == 2).then(|| {
            let proc = c.proc_of(&mesh, 1);
            let alloc = c.alloc.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                alloc.signal(&proc, ProcSignal::Kill).await.unwrap();
            })
        });
        let values = mesh
            .retry_in_next_generation(retry, || {
                tries += 1;
                let mesh = mesh.clone();
                async move {
                    mesh.call(&Selection::All, &TrainerOp::Sleep(800))
                        .await?
                        .into_result()?;
                    let echoed = mesh
                        .call(&Selection::All, &TrainerOp::Echo(step))
                        .await?
                        .into_result()?;
                    Ok(echoed)
                }
            })
            .await
            .unwrap_or_else(|e| panic!("step {step} did not complete: {e}"));
        assert!(values.iter().all(|(_, r)| *r == TrainerReply::Count(step)));
        if let Some(k) = killer {
            k.await.unwrap();
        }
    }
    assert_eq!(tries, 6, "five steps, one of them twice");
    c.finish().await;
}

/// When a proc dies, every mesh on it moves to the same fresh proc (a
/// trainer and its data loader stay together), and a mesh spawned later
/// goes to the procs as they are now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mesh_on_a_lost_proc_moves_to_one_fresh_proc() {
    let c = Cluster::start(2).await;
    let trainers = c.trainers("trainers", 2).await;
    let loaders = c.procs.spawn::<Loader>("loaders", 1, &()).await.unwrap();
    let dead = c.proc_of(&trainers, 1);
    let old_pid = c.procs.procs()[1].pid;
    c.signal(&dead, ProcSignal::Kill).await;
    running_at(&trainers, 1).await;
    running_at(&loaders, 1).await;
    let now = c.procs.procs();
    assert_ne!(now[1].proc, dead, "the proc mesh has the fresh proc");
    assert_eq!(
        c.procs.all_procs().len(),
        3,
        "one fresh proc, not one per mesh"
    );
    c.guard.watch([now[1].pid]);
    let t = whoami(&trainers).await;
    let l = places(&loaders).await;
    assert_eq!(t[2].pid, now[1].pid);
    assert_eq!(t[3].pid, now[1].pid);
    assert_eq!(l[1].pid, now[1].pid, "the loader moved with its trainers");
    assert_ne!(now[1].pid, old_pid);
    assert_eq!(trainers.procs()[1].proc, loaders.procs()[1].proc);
    // A mesh spawned now uses the fresh proc.
    let later = c.procs.spawn::<Loader>("later", 1, &()).await.unwrap();
    let p = places(&later).await;
    assert_eq!(
        p.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![now[0].pid, now[1].pid]
    );
    c.finish().await;
}

/// Each proc rank gets its own environment and arguments, and a
/// replacement of that rank gets the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_rank_placement_is_kept_across_replacement() {
    let c = Cluster::with(3, RuntimeConfig::default(), |rank| {
        Placement::default()
            .env(SLOT_ENV, format!("slot-{rank}"))
            .arg(format!("--slot={rank}"))
    })
    .await;
    let mesh = c.trainers("t", 1).await;
    let seen = |who: &[Me]| -> Vec<(Option<String>, Vec<String>)> {
        who.iter()
            .map(|m| (m.slot.clone(), m.args.clone()))
            .collect()
    };
    let want: Vec<(Option<String>, Vec<String>)> = (0..3)
        .map(|r| (Some(format!("slot-{r}")), vec![format!("--slot={r}")]))
        .collect();
    let before = whoami(&mesh).await;
    assert_eq!(seen(&before), want);
    c.signal(&c.proc_of(&mesh, 1), ProcSignal::Kill).await;
    running_at(&mesh, 1).await;
    let after = whoami(&mesh).await;
    c.guard.watch(after.iter().map(|m| m.pid));
    assert_ne!(after[1].pid, before[1].pid, "rank 1 runs in a fresh proc");
    assert_eq!(seen(&after), want, "the fresh proc has rank 1's placement");
    c.finish().await;
}

/// A member reads a peer's buffer in another proc one-sidedly, through shm
/// (the same host) and through tcp; once the owner's proc is killed, a
/// read of its buffer fails rather than hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_read_peers_buffers_across_procs() {
    let c = Cluster::start(2).await;
    let mesh = c.trainers("t", 1).await;
    let len = 8 << 20;
    let TrainerReply::Handle(handle) = mesh
        .call_one(Rank(0), &TrainerOp::Share { len, seed: 3 })
        .await
        .unwrap()
    else {
        panic!("no handle")
    };
    let want = checksum(&pattern(len, 3));
    let mut backends = BTreeSet::new();
    for backend in [None, Some("shm"), Some("tcp")] {
        let read = TrainerOp::Read {
            handle: handle.clone(),
            backend: backend.map(str::to_owned),
        };
        match mesh.call_one(Rank(1), &read).await.unwrap() {
            TrainerReply::Read {
                checksum,
                backend: used,
            } => {
                assert_eq!(checksum, want, "read through {used}");
                if backend.is_none() {
                    assert_eq!(used, "shm", "one host: shm by default");
                }
                backends.insert(used);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(backends, BTreeSet::from(["shm".into(), "tcp".into()]));
    // A SIGKILLed process takes a while to end; the owner's failure (its
    // host agent's waitpid) says it has.
    let mut failures = mesh.failures();
    c.signal(&c.proc_of(&mesh, 0), ProcSignal::Kill).await;
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .expect("the kill is reported in time")
        .expect("a failure");
    assert!(failure.cause.proc_lost(), "{failure}");
    let read = TrainerOp::Read {
        handle,
        backend: None,
    };
    let t = Instant::now();
    match mesh.call_one(Rank(1), &read).await.unwrap() {
        TrainerReply::Error(e) => println!("a read of a dead owner's buffer: {e}"),
        other => panic!("a dead owner's buffer was read: {other:?}"),
    }
    assert!(t.elapsed() < DEADLINE);
    running_at(&mesh, 1).await;
    c.finish().await;
}
