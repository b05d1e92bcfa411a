//! Mesh supervision over in-process procs (real proc runtimes, real QUIC):
//! every policy with an injected fault, generations, escalation through a
//! three-level tree of owned meshes, the owner's hook, and in-flight calls
//! failing fast when their proc dies. Faults that need real processes
//! (SIGKILL, SIGSTOP, orphans) are in the end-to-end suite.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use regent_mesh::alloc::{Allocator, ProcSignal};
use regent_mesh::inproc::InProcAllocator;
use regent_mesh::{
    ActorError, ActorMesh, Decision, FailureCause, Member, MeshActor, MeshError, MeshPolicy,
    MeshStatus, ProcMesh, Rank, Runtime, RuntimeConfig, Selection, Shape, SpawnOptions,
};
use serde::{Deserialize, Serialize};

const DEADLINE: Duration = Duration::from_secs(20);

/// When set, new members of meshes named `crashy` fail to start.
static CRASHY_START_FAILS: AtomicBool = AtomicBool::new(false);

struct Worker {
    rank: u32,
    generation: u64,
    count: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Op {
    /// Count one more; reply with the count (a fresh life starts at 0).
    Bump,
    /// Reply with (rank, generation) packed.
    Whoami,
    Fail,
    Sleep(u64),
}

impl MeshActor for Worker {
    const NAME: &'static str = "test/worker";
    type Args = ();
    type Msg = Op;
    type Reply = u64;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        if member.mesh() == "crashy" && CRASHY_START_FAILS.load(Ordering::SeqCst) {
            return Err("cannot open the dataset".into());
        }
        Ok(Self {
            rank: member.rank().0,
            generation: member.generation().0,
            count: 0,
        })
    }

    async fn handle(&mut self, _: &Member, op: Op) -> Result<u64, ActorError> {
        Ok(match op {
            Op::Bump => {
                self.count += 1;
                self.count
            }
            Op::Whoami => u64::from(self.rank) << 32 | self.generation,
            Op::Fail => return Err("injected failure".into()),
            Op::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                0
            }
        })
    }
}

regent_mesh::register_actor!(Worker);

struct Fixture {
    rt: Runtime,
    alloc: Arc<InProcAllocator>,
    procs: ProcMesh,
}

async fn fixture(procs: usize) -> Fixture {
    let rt = Runtime::start(RuntimeConfig::default().call_timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    let alloc = Arc::new(InProcAllocator::default());
    let pm = rt
        .spawn_procs(alloc.clone(), Shape::new([("procs", procs)]).unwrap())
        .await
        .unwrap();
    Fixture {
        rt,
        alloc,
        procs: pm,
    }
}

fn sel(text: &str) -> Selection {
    text.parse().unwrap()
}

async fn running_at(mesh: &ActorMesh<Worker>, generation: u64) {
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= generation
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_proc_is_replaced_and_only_its_members_restart() {
    let f = fixture(3).await;
    let mesh = f.procs.spawn::<Worker>("w", 2, &()).await.unwrap();
    let mut failures = mesh.failures();
    mesh.cast(&Selection::All, &Op::Bump)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let victim = mesh.procs()[1].proc.clone();
    let t = Instant::now();
    f.alloc.signal(&victim, ProcSignal::Kill).await.unwrap();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    println!("proc kill reached the owner after {:?}", t.elapsed());
    assert_eq!(failure.ranks, vec![Rank(2), Rank(3)]);
    assert!(matches!(failure.cause, FailureCause::ProcExited { ref proc, .. } if *proc == victim));
    running_at(&mesh, 1).await;
    assert_ne!(mesh.procs()[1].proc, victim, "a fresh proc took its place");
    // The others kept their state; the respawned ranks start over.
    let counts = mesh.call(&Selection::All, &Op::Bump).await.unwrap();
    let counts: Vec<u64> = counts
        .into_result()
        .unwrap()
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    assert_eq!(counts, vec![2, 2, 1, 1, 2, 2]);
    let who = mesh.call(&Selection::All, &Op::Whoami).await.unwrap();
    for (rank, packed) in who.values() {
        assert_eq!(packed >> 32, u64::from(rank.0));
        let generation = packed & 0xffff_ffff;
        let expected = if matches!(rank.0, 2 | 3) { 1 } else { 0 };
        assert_eq!(
            generation, expected,
            "rank {} lives in generation {generation}",
            rank.0
        );
    }
    assert!(f.procs.all_procs().len() == 4);
    drop(f.rt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mesh_respawns_every_member() {
    let f = fixture(2).await;
    let options = SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMesh));
    let mesh = f
        .procs
        .spawn_with::<Worker>("w", 2, &(), options)
        .await
        .unwrap();
    mesh.cast(&Selection::All, &Op::Bump)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let vm = mesh
        .call(&sel("procs=1,actors=1"), &Op::Fail)
        .await
        .unwrap();
    assert_eq!(vm.failed().len(), 1);
    running_at(&mesh, 1).await;
    let counts = mesh.call(&Selection::All, &Op::Bump).await.unwrap();
    assert!(
        counts.into_result().unwrap().iter().all(|(_, c)| *c == 1),
        "every member is a fresh life"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stop_policy_stops_the_mesh_and_says_why() {
    let f = fixture(2).await;
    let options = SpawnOptions::new().policy(MeshPolicy::new(Decision::Stop));
    let mesh = f
        .procs
        .spawn_with::<Worker>("w", 1, &(), options)
        .await
        .unwrap();
    let _ = mesh.call(&sel("procs=0"), &Op::Fail).await.unwrap();
    let status = mesh
        .wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
    let MeshStatus::Stopped(Some(failure)) = status else {
        panic!("{status:?}")
    };
    assert_eq!(failure.ranks, vec![Rank(0)]);
    assert!(matches!(
        mesh.cast(&Selection::All, &Op::Bump).await,
        Err(MeshError::Stopped(_))
    ));
    assert!(f.rt.job_failure().is_none(), "stopping is not escalating");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_at_start_exhausts_the_intensity_and_escalates_to_the_root() {
    let f = fixture(2).await;
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(2, Duration::from_secs(60));
    let mesh = f
        .procs
        .spawn_with::<Worker>("crashy", 1, &(), SpawnOptions::new().policy(policy))
        .await
        .unwrap();
    let mut failures = mesh.failures();
    CRASHY_START_FAILS.store(true, Ordering::SeqCst);
    let _ = mesh.call(&sel("procs=1"), &Op::Fail).await.unwrap();
    let report = tokio::time::timeout(DEADLINE, f.rt.wait_job_failure())
        .await
        .unwrap();
    CRASHY_START_FAILS.store(false, Ordering::SeqCst);
    println!("job failure:\n{report}");
    assert!(
        matches!(report.cause, FailureCause::StartFailed(ref m) if m.contains("cannot open the dataset"))
    );
    assert!(matches!(mesh.status(), MeshStatus::Escalated(_)));
    // The owner saw the original failure, then each failed restart.
    let first = failures.recv().await.unwrap();
    assert!(matches!(first.cause, FailureCause::Actor { .. }));
    let mut start_failures = 0;
    while let Ok(f) = failures.try_recv() {
        assert!(matches!(f.cause, FailureCause::StartFailed(_)));
        start_failures += 1;
    }
    assert_eq!(
        start_failures, 2,
        "two failed restarts, then the third restart exceeds 2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escalation_walks_a_three_level_tree_of_owned_meshes_to_the_root() {
    let f = fixture(2).await;
    let escalate = || SpawnOptions::new().policy(MeshPolicy::new(Decision::Escalate));
    let top = f
        .procs
        .spawn_with::<Worker>("top", 1, &(), escalate())
        .await
        .unwrap();
    let mid = f
        .procs
        .spawn_with::<Worker>("mid", 1, &(), escalate().owned_by(&top, Rank(1)))
        .await
        .unwrap();
    let leaf = f
        .procs
        .spawn_with::<Worker>("leaf", 1, &(), escalate().owned_by(&mid, Rank(0)))
        .await
        .unwrap();
    let _ = leaf.call(&sel("procs=1"), &Op::Fail).await.unwrap();
    let report = tokio::time::timeout(DEADLINE, f.rt.wait_job_failure())
        .await
        .unwrap();
    println!("job failure:\n{report}");
    assert_eq!(report.mesh, "top");
    assert_eq!(report.ranks, vec![Rank(1)]);
    let FailureCause::Escalated(mid_failure) = &report.cause else {
        panic!("{report}")
    };
    assert_eq!(mid_failure.mesh, "mid");
    assert_eq!(mid_failure.ranks, vec![Rank(0)]);
    let FailureCause::Escalated(leaf_failure) = &mid_failure.cause else {
        panic!("{report}")
    };
    assert_eq!(leaf_failure.mesh, "leaf");
    assert_eq!(leaf_failure.ranks, vec![Rank(1)]);
    assert!(matches!(leaf_failure.cause, FailureCause::Actor { .. }));
    for m in [&top, &mid, &leaf] {
        assert!(m.status().is_done(), "{:?}", m.status());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owners_hook_overrides_the_policy() {
    let f = fixture(2).await;
    // Policy: stop. Hook: actor errors are worth a restart of that member.
    let options = SpawnOptions::new()
        .policy(MeshPolicy::new(Decision::Stop))
        .on_failure(|failure| match failure.cause {
            FailureCause::Actor { .. } => Some(Decision::RestartMember),
            _ => None,
        });
    let mesh = f
        .procs
        .spawn_with::<Worker>("w", 1, &(), options)
        .await
        .unwrap();
    let _ = mesh.call(&sel("procs=0"), &Op::Fail).await.unwrap();
    running_at(&mesh, 1).await;
    assert_eq!(
        mesh.call(&Selection::All, &Op::Bump).await.unwrap().len(),
        2
    );
    // A proc loss is not an actor error: the policy applies and stops it.
    let victim = mesh.procs()[0].proc.clone();
    f.alloc.signal(&victim, ProcSignal::Kill).await.unwrap();
    mesh.wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_calls_fail_fast_when_their_proc_dies() {
    let f = fixture(3).await;
    let options = SpawnOptions::new().policy(MeshPolicy::new(Decision::Stop));
    let mesh = f
        .procs
        .spawn_with::<Worker>("w", 1, &(), options)
        .await
        .unwrap();
    let victim = mesh.procs()[2].proc.clone();
    let call = {
        let mesh = mesh.clone();
        tokio::spawn(async move { mesh.call(&Selection::All, &Op::Sleep(500)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    f.alloc.signal(&victim, ProcSignal::Kill).await.unwrap();
    let vm = call.await.unwrap().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the call waited {:?} (its timeout is 10 s)",
        t.elapsed()
    );
    assert_eq!(vm.len(), 2, "{:?}", vm.failed());
    assert_eq!(vm.failed().len(), 1);
    assert_eq!(vm.failed()[0].0, Rank(2));
}

/// A lead that spawns and drives a mesh of its own.
struct Lead {
    team: Option<regent_mesh::ActorMesh<Worker>>,
}

#[derive(Debug, Serialize, Deserialize)]
enum LeadOp {
    /// Spawn a team (one worker per proc) that escalates its failures.
    Hire,
    /// Spawn a team that restarts its failed members.
    HireResilient,
    /// Bump every team member; reply with how many answered.
    Poke,
    /// Make team member `n` fail.
    Break(u32),
}

impl MeshActor for Lead {
    const NAME: &'static str = "test/lead";
    type Args = ();
    type Msg = LeadOp;
    type Reply = u64;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self { team: None })
    }

    async fn handle(&mut self, member: &Member, op: LeadOp) -> Result<u64, ActorError> {
        match op {
            LeadOp::Hire | LeadOp::HireResilient => {
                let name = format!("team-{}", member.rank().0);
                let policy = MeshPolicy::new(if matches!(op, LeadOp::Hire) {
                    Decision::Escalate
                } else {
                    Decision::RestartMember
                });
                let team = member.spawn_mesh::<Worker>(&name, 1, &(), policy).await?;
                self.team = Some(team);
                Ok(0)
            }
            LeadOp::Poke => {
                let Some(team) = self.team.as_ref() else {
                    return Ok(0); // no team (yet)
                };
                let replies = team.call(&Selection::All, &Op::Bump).await?;
                Ok(replies.len() as u64)
            }
            LeadOp::Break(n) => {
                let team = self.team.as_ref().ok_or("no team")?;
                let _ = team.call(&sel(&format!("procs={n}")), &Op::Fail).await?;
                Ok(0)
            }
        }
    }
}

regent_mesh::register_actor!(Lead);

/// Meshes spawned by members form the tree: a team escalates into its lead,
/// whose mesh restarts that lead, and the orphaned team is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_spawned_by_a_member_escalates_into_it_and_dies_with_it() {
    let f = fixture(2).await;
    let leads: ActorMesh<Lead> = f
        .procs
        .spawn_with("leads", 1, &(), SpawnOptions::new())
        .await
        .unwrap();
    let mut failures = leads.failures();
    let one = sel("procs=1");
    leads
        .call(&one, &LeadOp::Hire)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let poked = leads
        .call(&one, &LeadOp::Poke)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(poked[0].1, 2, "the lead's team of two answers it");
    // Break a team member: the team escalates; the lead at rank 1 fails.
    let _ = leads.call(&one, &LeadOp::Break(0)).await.unwrap();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    println!("{failure}");
    assert_eq!(failure.ranks, vec![Rank(1)]);
    let FailureCause::Escalated(inner) = &failure.cause else {
        panic!("{failure}")
    };
    assert_eq!(inner.mesh, "team-1");
    assert!(matches!(inner.cause, FailureCause::Actor { .. }));
    // The lead is restarted (default policy) in a new generation, without a
    // team: the old one died with its owner's old life.
    leads
        .wait_status(DEADLINE, |s| {
            *s == MeshStatus::Running && leads.generation().0 == 1
        })
        .await
        .unwrap();
    let poked = leads
        .call(&one, &LeadOp::Poke)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(poked[0].1, 0, "the new life of the lead has no team");
    assert_eq!(
        f.rt.live_meshes(),
        vec!["leads"],
        "the old team died with its owner"
    );
    assert!(f.rt.job_failure().is_none());
    // A new team can be hired; stopping the leads stops it too.
    leads
        .call(&one, &LeadOp::Hire)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let poked = leads
        .call(&one, &LeadOp::Poke)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(poked[0].1, 2);
    assert_eq!(f.rt.live_meshes(), vec!["leads", "team-1"]);
    leads.stop().await.unwrap();
    assert!(f.rt.live_meshes().is_empty());
}

/// When a member's mesh restarts, its owner learns the new generation and
/// keeps reaching every member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_of_a_restarted_mesh_follows_its_generations() {
    let f = fixture(2).await;
    let leads: ActorMesh<Lead> = f.procs.spawn("leads", 1, &()).await.unwrap();
    let zero = sel("procs=0");
    leads
        .call(&zero, &LeadOp::HireResilient)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    for round in 0..3 {
        let _ = leads.call(&zero, &LeadOp::Break(round % 2)).await.unwrap();
        // Until the team is back and the lead knows its new generation,
        // fewer than two answer; then both do.
        let deadline = Instant::now() + DEADLINE;
        loop {
            let poked = leads
                .call(&zero, &LeadOp::Poke)
                .await
                .unwrap()
                .into_result()
                .unwrap();
            if poked[0].1 == 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the lead lost its team in round {round}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(leads.generation().0, 0, "the lead itself never failed");
}

/// Stopping procs on purpose stops their meshes first: no failure, no
/// escalation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_procs_on_purpose_is_not_a_failure() {
    let Fixture { rt, procs, .. } = fixture(2).await;
    let mesh: ActorMesh<Worker> = procs.spawn("w", 1, &()).await.unwrap();
    let mut failures = mesh.failures();
    procs.stop(Duration::from_secs(1)).await.unwrap();
    // Final: the supervisor has answered the stop and publishes no more.
    assert_eq!(mesh.status(), MeshStatus::Stopped(None));
    assert!(failures.try_recv().is_err(), "a failure was reported");
    assert!(rt.job_failure().is_none());
    assert!(rt.live_meshes().is_empty());
}

/// An in-process allocator that notes, at each `allocate`, the status of
/// the mesh it watches (once one is set).
struct StatusAtAllocate {
    inner: Arc<InProcAllocator>,
    mesh: std::sync::Mutex<Option<ActorMesh<Worker>>>,
    seen: std::sync::Mutex<Vec<MeshStatus>>,
}

impl Allocator for StatusAtAllocate {
    fn allocate(
        &self,
        boots: Vec<regent_mesh::alloc::ProcBoot>,
    ) -> regent_mesh::alloc::AllocFuture<'_, Vec<regent_mesh::alloc::AllocatedProc>> {
        if let Some(mesh) = self.mesh.lock().unwrap().as_ref() {
            self.seen.lock().unwrap().push(mesh.status());
        }
        self.inner.allocate(boots)
    }

    fn stop(
        &self,
        proc: &regent_net::ProcId,
        grace: Duration,
    ) -> regent_mesh::alloc::AllocFuture<'_, regent_mesh::alloc::ProcStatus> {
        self.inner.stop(proc, grace)
    }

    fn signal(
        &self,
        proc: &regent_net::ProcId,
        signal: ProcSignal,
    ) -> regent_mesh::alloc::AllocFuture<'_, ()> {
        self.inner.signal(proc, signal)
    }

    fn take_events(&self) -> Option<tokio::sync::mpsc::Receiver<regent_mesh::alloc::ProcEvent>> {
        self.inner.take_events()
    }
}

/// A warm spare taken by a restart is replaced once the restart is done,
/// not while it runs (a new proc's start would take CPU from it): every
/// proc started after the kill was asked for while the mesh was running
/// again, and the spare was refilled. (With the refill started when the
/// spare is taken, it is asked for while the mesh is `Restarting`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_taken_by_a_restart_is_replaced_after_the_restart() {
    let rt = Runtime::start(RuntimeConfig::default().call_timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    let alloc = Arc::new(StatusAtAllocate {
        inner: Arc::new(InProcAllocator::default()),
        mesh: std::sync::Mutex::new(None),
        seen: std::sync::Mutex::new(Vec::new()),
    });
    let pm = rt
        .spawn_procs(alloc.clone(), Shape::new([("procs", 2)]).unwrap())
        .await
        .unwrap();
    pm.keep_spares(1).await.unwrap();
    let spare = pm.spares();
    assert_eq!(spare.len(), 1, "{spare:?}");
    let mesh = pm
        .spawn_with::<Worker>(
            "w",
            1,
            &(),
            SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMember)),
        )
        .await
        .unwrap();
    *alloc.mesh.lock().unwrap() = Some(mesh.clone());
    let mut failures = mesh.failures();
    let victim = mesh.procs()[1].proc.clone();
    alloc.signal(&victim, ProcSignal::Kill).await.unwrap();
    tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    running_at(&mesh, 1).await;
    assert_eq!(mesh.procs()[1].proc, spare[0].proc, "the spare took rank 1");
    let until = Instant::now() + DEADLINE;
    while pm.spares().is_empty() {
        assert!(Instant::now() < until, "the spare was not refilled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = alloc.seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "no proc was started after the kill");
    assert!(
        seen.iter().all(|s| *s == MeshStatus::Running),
        "procs asked for while the mesh was {seen:?}"
    );
    mesh.call(&Selection::All, &Op::Bump)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    pm.stop(Duration::from_secs(2)).await.unwrap();
}
