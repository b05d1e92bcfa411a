//! The chaos suite: seeded scenarios mixing kills, pauses, graceful stops,
//! actor panics, partitions, blackholes, loss, delay, duplication,
//! reordering and bandwidth caps on meshes of 4–8 real procs
//! (`chaos_proc`) behind UDP chaos proxies, running a workload that counts
//! and checks its messages; every invariant of `docs/semantics.md` §7 is
//! checked after each, and must have checked something. Every scenario
//! prints its seed and timeline; the same seed replays the same timeline.
//! Every scenario also asserts that the faults it schedules were injected
//! and had their effect (`assert_effects`): a kill, stop or panic was
//! detected and repaired by a restart, a long enough pause or cut was
//! detected, a degraded link lost, delayed, duplicated, reordered or paced
//! datagrams — so no scenario passes with no fault.
//!
//! Also here: the partitioned-proc test of the mesh supervision issue
//! (`a_partitioned_proc_is_replaced_and_fenced_after_healing`), regression
//! tests of two mesh bugs the scenarios found, the ordering checker against
//! real members, and kernel-level cuts between network namespaces (root
//! only; skipped otherwise, and failing instead when `REGENT_REQUIRE_NETNS`
//! or, for the nftables faults, `REGENT_REQUIRE_NFT` is set).

use std::collections::{BTreeMap, HashSet};
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use regent_chaos::invariant::{self, OrderProgress, names};
use regent_chaos::scenario::run;
use regent_chaos::workload::{Life, Sender, Tally, TallyArgs, TallyMsg, TallyReply};
use regent_chaos::{
    ChaosCluster, ClusterConfig, FaultKind, FaultMix, Length, Report, Scenario, ScheduleConfig,
    Seed, process,
};
use regent_mesh::alloc::ProcStatus;
use regent_mesh::{
    ActorMesh, Decision, FailureCause, MeshPolicy, MeshStatus, Rank, RuntimeConfig, Selection,
    SpawnOptions,
};

/// Generous: CI has two shared cores.
const DEADLINE: Duration = Duration::from_secs(30);

fn cluster() -> ClusterConfig {
    ClusterConfig::default().program(env!("CARGO_BIN_EXE_chaos_proc"))
}

/// Logs to stderr when `RUST_LOG` is set (e.g. `RUST_LOG=regent_chaos=info`).
fn logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A pause or cut this long outlasts the procs' 1 s failure timeout with
/// room to spare: the owner must detect its failure.
const DETECTABLE: Duration = Duration::from_millis(1500);

/// The invariants that read the members' logs: not checkable in a round
/// whose mesh its policy stopped (its members are gone).
const FROM_LOGS: [&str; 3] = [names::NO_ACKED_LOSS, names::EXACTLY_ONCE, names::FIFO];

/// Runs one round of a scenario and prints its report.
async fn run_one(s: &Scenario) -> Report {
    logs();
    println!("scenario {} seed {}", s.name, s.seed);
    let r = run(s, cluster(), Length::Rounds(1), |p| {
        println!("{}", p.schedule)
    })
    .await
    .expect("the scenario could not start");
    println!("{r}");
    r
}

/// Plays one round: every invariant held and checked something, and every
/// fault of the timeline was injected and had its effect.
async fn play(s: Scenario) -> Report {
    let r = run_one(&s).await;
    r.assert_clean();
    assert_effects(&s, &r);
    r
}

/// Plays one round of a scenario whose policy stops the mesh: every
/// invariant held; those that read the members' logs may not have checked
/// anything, but say why.
async fn play_until_stopped(s: Scenario) -> Report {
    let r = run_one(&s).await;
    r.assert_clean_except(&FROM_LOGS);
    assert!(r.status.is_done(), "the mesh did not stop: {r}");
    r
}

/// Every fault kind in the scenario's (one-round) timeline was injected
/// and had its effect:
/// - a kill, graceful stop or panic: its failure was detected and, under a
///   restart policy, repaired by a restart;
/// - a pause, blackhole or partition: a blackhole or partition cut
///   datagrams; one lasting at least [`DETECTABLE`] was detected and
///   repaired;
/// - loss, delay, duplication, reordering, a bandwidth cap: the proxies
///   lost, slowed, duplicated, reordered or paced datagrams;
/// - host faults: the kernel dropped packets.
fn assert_effects(s: &Scenario, r: &Report) {
    use FaultKind::*;
    let timeline = s.round_schedule(0);
    assert!(
        !timeline.faults.is_empty(),
        "the scenario schedules no fault"
    );
    let restarts = matches!(
        s.policy.on_failure,
        Decision::RestartMember | Decision::RestartMesh
    );
    let p = &r.proxy;
    for (kind, scheduled) in timeline.counts() {
        assert!(
            r.injected(kind) > 0,
            "{kind}: {scheduled} scheduled, none injected\n{r}"
        );
        let long = timeline
            .faults
            .iter()
            .any(|f| f.fault.kind() == kind && f.lasts.is_some_and(|d| d >= DETECTABLE));
        let must_fail = match kind {
            Kill | Stop | Panic => true,
            Pause => long,
            Blackhole | Partition | OneWayPartition => {
                assert!(p.cut > 0, "{kind}: no datagram was cut\n{r}");
                long
            }
            Loss => {
                assert!(p.lost > 0, "{kind}: no datagram was lost\n{r}");
                false
            }
            Delay => {
                assert!(p.slowed > 0, "{kind}: no datagram was delayed\n{r}");
                false
            }
            Duplicate => {
                assert!(p.duplicated > 0, "{kind}: no datagram was duplicated\n{r}");
                false
            }
            Reorder => {
                assert!(p.reordered > 0, "{kind}: no datagram was reordered\n{r}");
                false
            }
            Bandwidth => {
                assert!(p.throttled > 0, "{kind}: no datagram was paced\n{r}");
                false
            }
            HostLoss | ClockJump => panic!("{kind}: simulated only, yet in a real timeline"),
            HostCut | HostFirewall | HostBlock => {
                let dropped = r.host_dropped.get(&kind).copied().unwrap_or(0);
                assert!(dropped > 0, "{kind}: the kernel dropped nothing\n{r}");
                false
            }
        };
        if must_fail {
            assert!(r.detected(kind) > 0, "{kind}: no failure was detected\n{r}");
            if restarts {
                assert!(
                    r.recovered(kind) > 0,
                    "{kind}: its failure was not repaired by a restart\n{r}"
                );
            }
        }
    }
}

fn mix(kinds: &[FaultKind]) -> ScheduleConfig {
    ScheduleConfig::default().mix(FaultMix::only(kinds))
}

fn fanout(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("a fan-out is positive")
}

#[test]
fn the_same_seed_replays_the_same_timeline() {
    for seed in [1, 2, 3] {
        let a = Scenario::new("replay", Seed(seed));
        let b = Scenario::new("replay", Seed(seed));
        assert_eq!(a.round_schedule(0), b.round_schedule(0));
        assert_eq!(
            a.round_schedule(0).to_string(),
            b.round_schedule(0).to_string()
        );
    }
    let a = Scenario::new("replay", Seed(1)).round_schedule(0);
    let b = Scenario::new("replay", Seed(2)).round_schedule(0);
    assert_ne!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s01_kills() {
    let r = play(Scenario::new("s01-kills", Seed(101)).schedule(mix(&[FaultKind::Kill]))).await;
    assert_eq!(r.injected(FaultKind::Kill), 4, "{r}");
    assert!(r.recoveries > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s02_pauses() {
    let r = play(Scenario::new("s02-pauses", Seed(102)).schedule(
        mix(&[FaultKind::Pause]).lasting(Duration::from_millis(200), Duration::from_secs(3)),
    ))
    .await;
    // Two of its pauses (1.7 s, 1.6 s) outlast the failure timeout.
    assert!(r.detected(FaultKind::Pause) > 0 && r.recoveries > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s03_graceful_stops() {
    let r = play(Scenario::new("s03-graceful-stops", Seed(103)).schedule(mix(&[FaultKind::Stop])))
        .await;
    assert!(r.recoveries > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s04_actor_panics() {
    let r =
        play(Scenario::new("s04-actor-panics", Seed(104)).schedule(mix(&[FaultKind::Panic]))).await;
    assert!(r.recoveries > 0, "every panic restarts its member");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s05_partitions() {
    let r = play(Scenario::new("s05-partitions", Seed(105)).schedule(mix(&[FaultKind::Partition])))
        .await;
    assert!(r.detected(FaultKind::Partition) > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s06_one_way_partitions() {
    let r = play(
        Scenario::new("s06-one-way-partitions", Seed(106))
            .schedule(mix(&[FaultKind::OneWayPartition])),
    )
    .await;
    assert!(r.detected(FaultKind::OneWayPartition) > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s07_blackholes() {
    let r = play(Scenario::new("s07-blackholes", Seed(107)).schedule(mix(&[FaultKind::Blackhole])))
        .await;
    assert!(r.detected(FaultKind::Blackhole) > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08_loss() {
    let r =
        play(Scenario::new("s08-loss", Seed(108)).schedule(
            mix(&[FaultKind::Loss]).lasting(Duration::from_secs(1), Duration::from_secs(4)),
        ))
        .await;
    assert!(r.proxy.lost > 0, "datagrams were lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s09_delay_with_jitter() {
    let r = play(Scenario::new("s09-delay", Seed(109)).schedule(
        mix(&[FaultKind::Delay]).lasting(Duration::from_secs(1), Duration::from_secs(4)),
    ))
    .await;
    assert!(r.proxy.slowed > 0, "datagrams were delayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_duplication_and_reordering() {
    let r = play(
        Scenario::new("s10-duplicate-reorder", Seed(110)).schedule(
            mix(&[FaultKind::Duplicate, FaultKind::Reorder])
                .lasting(Duration::from_secs(1), Duration::from_secs(4)),
        ),
    )
    .await;
    assert!(r.proxy.duplicated > 0 && r.proxy.reordered > 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_bandwidth_caps() {
    let r = play(Scenario::new("s11-bandwidth", Seed(111)).schedule(
        mix(&[FaultKind::Bandwidth]).lasting(Duration::from_secs(1), Duration::from_secs(4)),
    ))
    .await;
    assert!(r.proxy.throttled > 0, "datagrams were paced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_everything_on_four_procs() {
    play(Scenario::new("s12-mixed-4x2", Seed(112))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s13_everything_on_eight_procs() {
    play(Scenario::new("s13-mixed-8x1", Seed(113)).mesh(8, 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_a_deep_cast_tree_under_partitions() {
    // Fan-out 2: procs forward casts to procs, so partitions between procs
    // (not only from the controller) cut the tree. Seed 1150's timeline: a
    // one-way and a two-way partition (each over 2 s, the second with
    // procs on the controller's side), a delay, a kill.
    play(
        Scenario::new("s14-deep-tree", Seed(1150))
            .mesh(6, 1)
            .fanout(fanout(2))
            .schedule(mix(&[
                FaultKind::Partition,
                FaultKind::OneWayPartition,
                FaultKind::Kill,
                FaultKind::Delay,
            ])),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_kills_and_partitions_under_gang_restarts() {
    play(
        Scenario::new("s15-restart-mesh", Seed(115))
            .policy(MeshPolicy::new(Decision::RestartMesh).intensity(100, Duration::from_secs(60)))
            .schedule(mix(&[
                FaultKind::Kill,
                FaultKind::Partition,
                FaultKind::Panic,
            ])),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s16_pauses_and_loss_under_gang_restarts() {
    // Seed 1118's timeline: a 2 s pause (a gang restart), loss, a short
    // pause, reordering.
    play(
        Scenario::new("s16-restart-mesh-pauses", Seed(1118))
            .policy(MeshPolicy::new(Decision::RestartMesh).intensity(100, Duration::from_secs(60)))
            .schedule(mix(&[
                FaultKind::Pause,
                FaultKind::Loss,
                FaultKind::Reorder,
            ])),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s17_a_dense_mix_on_six_procs() {
    play(
        Scenario::new("s17-dense-6x2", Seed(117))
            .mesh(6, 2)
            .schedule(
                ScheduleConfig::default()
                    .mean_gap(Duration::from_secs(1))
                    .max_concurrent(3),
            ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_process_faults_on_a_degraded_network() {
    // Seed 1143's timeline has each of the five kinds.
    play(
        Scenario::new("s18-degraded", Seed(1143)).schedule(
            mix(&[
                FaultKind::Kill,
                FaultKind::Pause,
                FaultKind::Loss,
                FaultKind::Delay,
                FaultKind::Bandwidth,
            ])
            .max_concurrent(3),
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s19_the_stop_policy_stops_at_the_first_failure() {
    let r = play_until_stopped(
        Scenario::new("s19-stop-policy", Seed(119))
            .policy(MeshPolicy::new(Decision::Stop))
            .schedule(mix(&[FaultKind::Kill, FaultKind::Blackhole])),
    )
    .await;
    // Its first fault is a kill: detected, and the mesh stopped.
    assert!(r.injected(FaultKind::Kill) > 0, "{r}");
    assert!(r.detected(FaultKind::Kill) > 0, "{r}");
    assert!(
        matches!(r.status, MeshStatus::Stopped(Some(_))),
        "{:?}",
        r.status
    );
    assert_eq!(r.generation, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s20_exhausted_intensity_escalates() {
    let r = play_until_stopped(
        Scenario::new("s20-intensity", Seed(120))
            .policy(MeshPolicy::new(Decision::RestartMember).intensity(2, Duration::from_secs(60)))
            .schedule(
                mix(&[FaultKind::Kill, FaultKind::Panic]).mean_gap(Duration::from_millis(1500)),
            ),
    )
    .await;
    assert!(
        matches!(r.status, MeshStatus::Escalated(_)),
        "{:?}",
        r.status
    );
    assert!(r.generation <= 2, "at most 2 restarts: {}", r.generation);
    // Kills and panics were detected, and restarts happened before the
    // policy gave up.
    assert!(r.detected(FaultKind::Kill) > 0, "{r}");
    assert!(r.detected(FaultKind::Panic) > 0, "{r}");
    assert!(r.recoveries > 0, "{r}");
    assert!(r.failures_seen > 2, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_everything_on_eight_procs_with_a_tree() {
    play(
        Scenario::new("s21-mixed-8x2-tree", Seed(121))
            .mesh(8, 2)
            .fanout(fanout(4)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_everything_under_gang_restarts() {
    play(
        Scenario::new("s22-mixed-restart-mesh", Seed(122))
            .mesh(5, 2)
            .policy(MeshPolicy::new(Decision::RestartMesh).intensity(100, Duration::from_secs(60))),
    )
    .await;
}

async fn lives(mesh: &ActorMesh<Tally>) -> BTreeMap<u32, Life> {
    let vm = mesh
        .call_within(&Selection::All, &TallyMsg::Probe, Duration::from_secs(10))
        .await
        .unwrap();
    vm.into_result()
        .unwrap()
        .into_iter()
        .map(|(r, reply)| match reply {
            TallyReply::Life(l) => (r.0, l),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// What every member received, as reported.
async fn member_reports(mesh: &ActorMesh<Tally>) -> Vec<regent_chaos::workload::LifeReport> {
    let vm = mesh
        .call_within(
            &Selection::All,
            &TallyMsg::Report { from: 0 },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    vm.into_result()
        .unwrap()
        .into_iter()
        .map(|(_, reply)| match reply {
            TallyReply::Report(rep) => rep,
            other => panic!("{other:?}"),
        })
        .collect()
}

/// The ordering invariant on what real members recorded: casts from one
/// sender numbered out of the order they are sent (3 before 2) are
/// reported at every member; the same numbers from two senders, each in
/// its own order, are not; and each arrival is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_checker_catches_a_sender_out_of_order_at_real_members() {
    let cluster = ChaosCluster::start(cluster(), Seed(10)).await.unwrap();
    let procs = cluster.spawn_procs(2).await.unwrap();
    let mesh = procs
        .spawn::<Tally>("tally", 2, &TallyArgs::default())
        .await
        .unwrap();
    let record = |seq, sender| TallyMsg::Record { seq, sender };
    // In order per sender, interleaved across senders.
    for (seq, sender) in [
        (1, Sender::CASTER),
        (2, Sender::CALLER),
        (3, Sender::CASTER),
        (4, Sender::CASTER),
        (5, Sender::CALLER),
    ] {
        mesh.cast(&Selection::All, &record(seq, sender))
            .await
            .unwrap()
            .into_result()
            .unwrap();
    }
    let (fifo, progress) =
        invariant::check_order(&member_reports(&mesh).await, &OrderProgress::new());
    assert!(fifo.ok(), "{fifo}");
    // Per member: 2 of the caster's 3 arrivals and 1 of the caller's 2 follow another.
    assert_eq!(fifo.checked, 4 * 3, "{fifo}");
    // The caster's 7 overtakes its 6.
    for seq in [7, 6] {
        mesh.cast(&Selection::All, &record(seq, Sender::CASTER))
            .await
            .unwrap()
            .into_result()
            .unwrap();
    }
    let (fifo, _) = invariant::check_order(&member_reports(&mesh).await, &progress);
    assert_eq!(fifo.violations, 4, "one per member: {fifo}");
    assert_eq!(fifo.checked, 4 * 2, "only the new arrivals: {fifo}");
    mesh.stop().await.unwrap();
    drop(procs);
    let survivors = cluster.shutdown(DEADLINE).await;
    assert!(
        survivors.is_empty(),
        "procs outlived the test: {survivors:?}"
    );
}

/// The partitioned proc of the mesh supervision issue, with real processes
/// and a real cut: proc 1 is blackholed (two-way, through its proxy); it is
/// declared failed within the failure timeout, its members are respawned on
/// a fresh proc in a new generation, calls meanwhile fail within their
/// deadline; once the partition heals, the zombie is fenced and told to
/// exit (its lease is long, so only the command can end it), and no
/// process outlives the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_proc_is_replaced_and_fenced_after_healing() {
    let config = cluster().runtime(
        RuntimeConfig::default()
            .owner_lease(Duration::from_secs(60))
            .call_timeout(Duration::from_secs(8)),
    );
    let cluster = ChaosCluster::start(config, Seed(7)).await.unwrap();
    let procs = cluster.spawn_procs(3).await.unwrap();
    let policy = MeshPolicy::new(Decision::RestartMember);
    let mesh = procs
        .spawn_with::<Tally>(
            "tally",
            2,
            &TallyArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .unwrap();
    let before = lives(&mesh).await;
    let mut failures = mesh.failures();
    let victim = mesh.procs()[1].proc.clone();
    let record = cluster.allocator().record(&victim).unwrap();
    let zombie = record.pid;

    let cut = Instant::now();
    cluster.network().isolate(record.node);
    // A call during the partition returns within its deadline, naming the
    // cut members.
    let t = Instant::now();
    let vm = mesh
        .call_within(&Selection::All, &TallyMsg::Probe, Duration::from_secs(3))
        .await
        .unwrap();
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3) + Duration::from_secs(2),
        "call took {took:?}"
    );
    let failed: HashSet<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
    assert_eq!(failed, HashSet::from([2, 3]), "{:?}", vm.failed());

    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    let detected = cut.elapsed();
    println!("partition detected after {detected:?}: {failure}");
    assert!(
        matches!(&failure.cause, FailureCause::LinkFailed { proc, .. } if *proc == victim),
        "{failure}"
    );
    assert_eq!(failure.ranks, vec![Rank(2), Rank(3)]);
    // The failure timeout is 1 s; allow the loaded CI machine 2 s more.
    assert!(detected < Duration::from_secs(3), "{detected:?}");

    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= 1
    })
    .await
    .unwrap();
    let after = lives(&mesh).await;
    for (rank, life) in &after {
        if *rank == 2 || *rank == 3 {
            assert_eq!(life.born, 1, "rank {rank} respawned in generation 1");
            assert_ne!(life.pid, zombie, "rank {rank} lives in a fresh proc");
        } else {
            assert_eq!(life, &before[rank], "rank {rank} untouched");
        }
    }
    assert!(
        process::alive(zombie),
        "the zombie runs until the partition heals"
    );

    // Heal: the zombie's link comes back, the runtime fences it and tells it
    // to exit.
    cluster.network().heal();
    let left = process::wait_gone(&[zombie], DEADLINE).await;
    assert!(left.is_empty(), "the zombie still runs after healing");
    // The allocator notes the exit once it has reaped the process, a moment
    // after it is gone from the process table.
    let reaped = Instant::now() + DEADLINE;
    let exited = loop {
        let exited = cluster.allocator().record(&victim).unwrap().exited;
        if exited.is_some() || Instant::now() >= reaped {
            break exited;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        matches!(
            exited,
            Some((ProcStatus::Code(regent_mesh::EXIT_REQUESTED), _))
        ),
        "the zombie was told to exit: {exited:?}"
    );
    // Its exit is about a replaced life: no new restart.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mesh.generation().0, 1);
    let again = lives(&mesh).await;
    assert_eq!(again, after);
    let mut seen = HashSet::new();
    for life in again.values() {
        assert!(seen.insert((life.rank, mesh.generation().0)));
        assert_ne!(life.pid, zombie);
    }

    mesh.stop().await.unwrap();
    drop(procs);
    let survivors = cluster.shutdown(DEADLINE).await;
    assert!(
        survivors.is_empty(),
        "procs outlived the test: {survivors:?}"
    );
}

/// A proc that dies while its mesh is restarting *another* proc's members
/// is replaced too. Regression test of a bug in `mesh/` found by the chaos
/// scenarios s03 (SIGTERM during a restart) and s05 (a proc whose lease
/// lapsed in a partition during a restart), fixed in 27d2d22: the restart
/// kept sending `Update` to the dead proc, failed after the call timeout,
/// and the next restart, decided at once without taking the queued exit,
/// did the same — a crash loop that never replaced the proc and kept the
/// owner from stopping the mesh.
///
/// Reproduced without timing luck: kill proc 0, wait until the mesh is
/// restarting (its fresh proc is being started), kill proc 1. Proc 1's
/// members must be respawned on a fresh proc too and the mesh must run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proc_lost_during_a_restart_is_replaced_too() {
    use regent_mesh::alloc::{Allocator, ProcSignal};
    let cluster = ChaosCluster::start(cluster(), Seed(8)).await.unwrap();
    let procs = cluster.spawn_procs(3).await.unwrap();
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(100, Duration::from_secs(60));
    let mesh = procs
        .spawn_with::<Tally>(
            "tally",
            1,
            &TallyArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .unwrap();
    let first = mesh.procs()[0].proc.clone();
    let second = mesh.procs()[1].proc.clone();
    let alloc = cluster.allocator().clone();
    alloc.signal(&first, ProcSignal::Kill).await.unwrap();
    mesh.wait_status(DEADLINE, |s| *s == MeshStatus::Restarting)
        .await
        .unwrap();
    alloc.signal(&second, ProcSignal::Kill).await.unwrap();
    let recovered = mesh
        .wait_status(DEADLINE, |s| {
            *s == MeshStatus::Running && !mesh.procs().iter().any(|a| a.proc == second)
        })
        .await;
    let generation = mesh.generation().0;
    let status = mesh.status();
    // Clean up whatever happened (the supervisor may be stuck: bounded).
    let _ = tokio::time::timeout(Duration::from_secs(5), mesh.stop()).await;
    drop(procs);
    let survivors = cluster.shutdown(DEADLINE).await;
    assert!(
        survivors.is_empty(),
        "procs outlived the test: {survivors:?}"
    );
    assert!(
        recovered.is_ok(),
        "the mesh did not replace the proc lost during a restart within {DEADLINE:?}: \
         generation {generation}, status {status:?} (see this test's doc)"
    );
}

/// Link faults with root: the procs run in a network namespace ("host 1",
/// `10.77.0.1`), the controller in the root namespace on the same bridge
/// (`10.77.0.254`); the timeline takes the host's switch port down, blocks
/// it one way at the bridge, drops all its traffic in its firewall
/// (nftables), and adds delay through the proxies (no netem in this kernel).
/// Each cut is shorter than the failure timeout: nothing may fail, and the
/// workload's every message arrives exactly once. Each fault must have had
/// its effect: the kernel dropped packets (the firewall's and the block's
/// counters; for the link cut, packets sent toward the host while it
/// received none), the proxies delayed datagrams. Skipped (and says so)
/// without root, or fails where `REGENT_REQUIRE_NETNS` asks for it; the
/// nftables faults likewise without `nft` (`REGENT_REQUIRE_NFT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n01_kernel_cuts_between_namespaces_heal_without_loss() {
    use regent_chaos::netns::{self, Hosts};
    use regent_chaos::{Fault, LinkFaults, ScheduledFault};
    use std::net::IpAddr;
    use std::sync::Arc;
    logs();
    if let Some(why) = netns::unavailable() {
        netns::skip_unless_required(netns::REQUIRE_NETNS, "the namespace test", &why);
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/netns-chaos.sh");
    let hosts = Arc::new(Hosts::up(std::path::Path::new(script), "cxa", 1).unwrap());
    let root = IpAddr::V4(netns::ROOT_IP);
    let config = ClusterConfig::default()
        .program("ip")
        .proc_args([
            "netns".to_owned(),
            "exec".to_owned(),
            hosts.namespace(1),
            env!("CARGO_BIN_EXE_chaos_proc").to_owned(),
        ])
        .proc_bind_ip(hosts.ip(1))
        .runtime(
            RuntimeConfig {
                bind: std::net::SocketAddr::new(root, 0),
                ..RuntimeConfig::default()
            }
            .owner_lease(Duration::from_secs(3))
            .call_timeout(Duration::from_secs(8)),
        )
        .proxy(regent_chaos::ProxyConfig::default().bind_ip(root));
    let half = Duration::from_millis(500);
    let at = |s: u64| Duration::from_secs(s);
    let mut timeline = vec![
        ScheduledFault {
            at: at(1),
            fault: Fault::HostCut { host: 1 },
            lasts: Some(half),
        },
        ScheduledFault {
            at: at(3),
            fault: Fault::HostBlock { from: 1, to: 0 },
            lasts: Some(half),
        },
        ScheduledFault {
            at: at(7),
            fault: Fault::Degrade {
                proc: None,
                faults: LinkFaults::new()
                    .delay(Duration::from_millis(40), Duration::from_millis(20)),
                kind: FaultKind::Delay,
            },
            lasts: Some(at(2)),
        },
    ];
    let nft = netns::have("nft");
    if nft {
        timeline.push(ScheduledFault {
            at: at(5),
            fault: Fault::HostFirewall { host: 1 },
            lasts: Some(half),
        });
        timeline.sort_by_key(|f| f.at);
    } else {
        netns::skip_unless_required(
            netns::REQUIRE_NFT,
            "the one-way block and firewall faults",
            "no `nft` (nftables)",
        );
        timeline.retain(|f| !matches!(f.fault, Fault::HostBlock { .. }));
    }
    let s = Scenario::new("n01-netns", Seed(201))
        .mesh(4, 1)
        .hosts(hosts.clone())
        .timeline(timeline);
    println!("scenario {} seed {}", s.name, s.seed);
    let r = run(&s, config, Length::Rounds(1), |p| {
        println!("{}", p.schedule)
    })
    .await
    .expect("the scenario could not start");
    println!("{r}");
    r.assert_clean();
    assert_effects(&s, &r);
    assert_eq!(r.injected(FaultKind::HostCut), 1, "{r}");
    assert_eq!(r.injected(FaultKind::Delay), 1, "{r}");
    if nft {
        assert_eq!(r.injected(FaultKind::HostBlock), 1, "{r}");
        assert_eq!(r.injected(FaultKind::HostFirewall), 1, "{r}");
    }
    // Cuts under the failure timeout usually fail nothing; on a loaded
    // machine a late heartbeat may still fail a link, and the invariants
    // above must hold either way.
    println!("restarts: {}", r.generation);
}

/// A proc lost during a restart and replaced by the next one is reported
/// as a failure of its ranks. Regression test of a bug in `mesh/` found by
/// the chaos invariant "restarts within the mesh policy" (only ranks named
/// by a failure may get a new life) in scenarios s03, s05, s07 and n01,
/// fixed in 865d0d5: after 27d2d22 such a proc was replaced without a
/// `MeshFailure` naming its members — observers never saw it, the owner's
/// hook was never asked, the restart intensity did not count it — because
/// its loss, reaching the supervisor after the replacement, no longer
/// matched a proc of the mesh and was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proc_replaced_during_a_restart_is_reported_as_failed() {
    use regent_mesh::alloc::{Allocator, ProcSignal};
    let cluster = ChaosCluster::start(cluster(), Seed(9)).await.unwrap();
    let procs = cluster.spawn_procs(3).await.unwrap();
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(100, Duration::from_secs(60));
    let mesh = procs
        .spawn_with::<Tally>(
            "tally",
            1,
            &TallyArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .unwrap();
    let mut failures = mesh.failures();
    let first = mesh.procs()[0].proc.clone();
    let second = mesh.procs()[1].proc.clone();
    let alloc = cluster.allocator().clone();
    alloc.signal(&first, ProcSignal::Kill).await.unwrap();
    mesh.wait_status(DEADLINE, |s| *s == MeshStatus::Restarting)
        .await
        .unwrap();
    alloc.signal(&second, ProcSignal::Kill).await.unwrap();
    let recovered = mesh
        .wait_status(DEADLINE, |s| {
            *s == MeshStatus::Running && !mesh.procs().iter().any(|a| a.proc == second)
        })
        .await;
    // What the supervisor published, until a failure names rank 1 (it
    // should have been published before the recovery; a little more time
    // for a loaded machine).
    let mut named = HashSet::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match failures.recv().await {
                Ok(f) => {
                    println!("observed: {f}");
                    named.extend(f.ranks.iter().map(|r| r.0));
                    if named.contains(&1) {
                        break;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(5), mesh.stop()).await;
    drop(procs);
    let survivors = cluster.shutdown(DEADLINE).await;
    assert!(
        survivors.is_empty(),
        "procs outlived the test: {survivors:?}"
    );
    assert!(recovered.is_ok(), "the mesh did not recover: {recovered:?}");
    assert!(
        named.contains(&1),
        "rank 1's proc was killed and replaced, but no failure named rank 1 (named: {named:?})"
    );
}
