//! The controller's runtime and in-process procs over one seeded simulated
//! network, on one thread under a paused clock (feature `sim`): a seeded
//! workload of casts and calls on a mesh supervised with restart-member, a
//! seeded fault (kill, partition, pause and resume, host loss), recovery in
//! a newer generation, more casts and calls. Every run records a history
//! (status changes, generations, failures and their causes, each call's
//! outcome, each cast's deliveries, with simulated times) and hashes it
//! together with the network's trace: the same seed gives the same hash.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regent_mesh::simnet::{SimCluster, simulate};
use regent_mesh::{
    ActorError, ActorMesh, Decision, Member, MeshActor, MeshPolicy, MeshStatus, RuntimeConfig,
    Selection, SpawnOptions,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Simulated time any one wait may take before the run fails.
const SIM_DEADLINE: Duration = Duration::from_secs(120);
/// Procs in the small scenario, and members per proc.
const PROCS: usize = 3;
const PER_PROC: u32 = 2;
/// The control plane declares a silent link failed after this.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers its rank and generation, and counts the casts it got.
struct Counter {
    rank: u32,
    generation: u64,
    casts: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Op {
    /// Counted.
    Cast(u64),
    /// Replies rank << 32 | generation.
    Whoami,
    /// Replies how many casts this life got.
    Count,
}

impl MeshActor for Counter {
    const NAME: &'static str = "simnet-test/counter";
    type Args = ();
    type Msg = Op;
    type Reply = u64;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            rank: member.rank().0,
            generation: member.generation().0,
            casts: 0,
        })
    }

    async fn handle(&mut self, _: &Member, op: Op) -> Result<u64, ActorError> {
        Ok(match op {
            Op::Cast(_) => {
                self.casts += 1;
                self.casts
            }
            Op::Whoami => u64::from(self.rank) << 32 | self.generation,
            Op::Count => self.casts,
        })
    }
}

regent_mesh::register_actor!(Counter);

/// The fault a seed injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    /// The proc and the controller cannot reach each other (both ways).
    Partition,
    /// The proc is paused until the mesh has recovered, then resumed.
    Pause,
    HostLoss,
}

impl Fault {
    fn of(seed: u64) -> Self {
        [Self::Kill, Self::Partition, Self::Pause, Self::HostLoss][(seed % 4) as usize]
    }
}

/// What a run recorded, with simulated times.
#[derive(Clone, Default)]
struct History {
    lines: Arc<Mutex<Vec<String>>>,
    start: Option<Instant>,
}

impl History {
    fn new() -> Self {
        Self {
            lines: Arc::default(),
            start: Some(Instant::now()),
        }
    }

    fn at(&self) -> Duration {
        self.start.map_or(Duration::ZERO, |s| s.elapsed())
    }

    fn record(&self, what: impl std::fmt::Display) {
        let line = format!("{:>12.6}s {what}", self.at().as_secs_f64());
        self.lines.lock().unwrap().push(line);
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

/// FNV-1a, 64 bits: stable across runs and builds.
fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What one run of the scenario came to.
struct Outcome {
    fault: Fault,
    /// The history and the network's trace, hashed together.
    hash: u64,
    history: Vec<String>,
    /// Simulated time from the fault until the mesh ran again in a newer
    /// generation.
    recovered_after: Duration,
    /// Simulated time of the whole run.
    took: Duration,
    generation: u64,
    /// The network's trace (its events, in order).
    trace: Vec<regent_net::sim::TraceEvent>,
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(SIM_DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {SIM_DEADLINE:?} of simulated time"))
}

/// One round: a cast to every member and a call of every member.
async fn round(mesh: &ActorMesh<Counter>, n: u64, history: &History) {
    match mesh.cast(&Selection::All, &Op::Cast(n)).await {
        Ok(d) => history.record(format_args!(
            "cast {n}: delivered {} failed {:?}",
            d.delivered(),
            d.failed()
        )),
        Err(e) => history.record(format_args!("cast {n}: error {e}")),
    }
    match mesh.call(&Selection::All, &Op::Whoami).await {
        Ok(v) => {
            let mut line = format!("call {n}:");
            for (rank, packed) in v.values() {
                let _ = write!(line, " {}@g{}", rank.0, packed & 0xffff_ffff);
                assert_eq!(
                    packed >> 32,
                    u64::from(rank.0),
                    "a member answered for another rank"
                );
            }
            history.record(format_args!("{line} failed {:?}", v.failed()));
        }
        Err(e) => history.record(format_args!("call {n}: error {e}")),
    }
}

/// Follows the mesh's status and failures into the history until the
/// returned tasks are aborted.
fn watch(mesh: &ActorMesh<Counter>, history: &History) -> Vec<tokio::task::JoinHandle<()>> {
    let (m, h) = (mesh.clone(), history.clone());
    let status = tokio::spawn(async move {
        let mut last = m.status();
        loop {
            let Ok(now) = m.wait_status(SIM_DEADLINE, |s| *s != last).await else {
                continue;
            };
            h.record(format_args!(
                "status {now:?} generation {}",
                m.generation().0
            ));
            if now.is_done() {
                return;
            }
            last = now;
        }
    });
    let mut failures = mesh.failures();
    let h = history.clone();
    let failures = tokio::spawn(async move {
        while let Ok(f) = failures.recv().await {
            h.record(format_args!(
                "failure of ranks {:?} in generation {}: {}",
                f.ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
                f.generation.0,
                f.cause
            ));
        }
    });
    vec![status, failures]
}

/// The small scenario: 3 procs of 2 members, restart-member, rounds of casts
/// and calls, the seed's fault during a burst of rounds, recovery, more
/// rounds.
fn scenario(seed: u64) -> Outcome {
    simulate(|| async move {
        let config = RuntimeConfig::default()
            .call_timeout(Duration::from_secs(5))
            .endpoint(regent_net::EndpointConfig::default().failure_timeout(FAILURE_TIMEOUT));
        let cluster = within("the cluster starts", SimCluster::start(seed, PROCS, config))
            .await
            .expect("the cluster starts");
        let history = History::new();
        let options = SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMember));
        let mesh = within(
            "the mesh spawns",
            cluster
                .procs()
                .spawn_with::<Counter>("counters", PER_PROC, &(), options),
        )
        .await
        .expect("the mesh spawns");
        history.record("spawned");
        let watchers = watch(&mesh, &history);
        for n in 0..3 {
            within("a round", round(&mesh, n, &history)).await;
        }

        // The fault, at a time and on a proc drawn from the seed, while a
        // burst of rounds is in flight.
        let fault = Fault::of(seed);
        let victim_rank = (cluster.net().random_u64() % PROCS as u64) as usize;
        let delay = Duration::from_micros(cluster.net().random_u64() % 20_000);
        let victim = cluster.procs().procs()[victim_rank].proc.clone();
        let burst = {
            let (mesh, history) = (mesh.clone(), history.clone());
            tokio::spawn(async move {
                for n in 3..6 {
                    round(&mesh, n, &history).await;
                }
            })
        };
        tokio::time::sleep(delay).await;
        history.record(format_args!("fault {fault:?} on {victim}"));
        let faulted_at = Instant::now();
        let allocator = cluster.allocator();
        match fault {
            Fault::Kill => allocator.kill(&victim).unwrap(),
            Fault::Partition => {
                let addr = allocator.addr_of(&victim).unwrap();
                cluster.net().partition(cluster.controller_addr(), addr);
            }
            Fault::Pause => allocator.pause(&victim).unwrap(),
            Fault::HostLoss => allocator.lose_host(&victim).unwrap(),
        }
        within("the burst ends", burst).await.unwrap();
        within(
            "the mesh runs again in a newer generation",
            mesh.wait_status(SIM_DEADLINE, |s| {
                *s == MeshStatus::Running && mesh.generation().0 >= 1
            }),
        )
        .await
        .expect("the mesh recovers");
        let recovered_after = faulted_at.elapsed();
        history.record(format_args!(
            "recovered in generation {}",
            mesh.generation().0
        ));
        assert!(
            !mesh.procs().iter().any(|a| a.proc == victim),
            "the victim's members run on a fresh proc"
        );
        if fault == Fault::Pause {
            allocator.resume(&victim).unwrap();
            history.record(format_args!("resumed {victim}"));
        }

        // After recovery every member answers, the restarted ones in the
        // new generation.
        for n in 6..9 {
            within("a round", round(&mesh, n, &history)).await;
        }
        let counts = within("counts", mesh.call(&Selection::All, &Op::Count))
            .await
            .unwrap()
            .into_result()
            .expect("every member answers after recovery");
        history.record(format_args!(
            "counts {:?}",
            counts.iter().map(|(r, c)| (r.0, *c)).collect::<Vec<_>>()
        ));
        let generation = mesh.generation().0;
        // Let whatever the fault left (a resumed zombie, lapsing leases)
        // play out into the trace.
        tokio::time::sleep(Duration::from_secs(15)).await;
        history.record(format_args!("end: {:?}", mesh.status()));
        for w in watchers {
            w.abort();
        }
        let took = history.at();
        let lines = history.lines();
        let mut hash = fnv(
            0xcbf2_9ce4_8422_2325,
            &cluster.net().trace_hash().to_le_bytes(),
        );
        for line in &lines {
            hash = fnv(hash, line.as_bytes());
            hash = fnv(hash, b"\n");
        }
        Outcome {
            fault,
            hash,
            history: lines,
            recovered_after,
            took,
            generation,
            trace: cluster.net().trace(),
        }
    })
}

/// Where two runs first differ, for the failure message.
fn first_difference(a: &Outcome, b: &Outcome) -> String {
    fn diff<T: PartialEq + std::fmt::Debug>(what: &str, a: &[T], b: &[T]) -> Option<String> {
        let at = a
            .iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .or((a.len() != b.len()).then(|| a.len().min(b.len())))?;
        Some(format!(
            "{what} differ from entry {at} of {}/{}:\n  {:?}\n  {:?}",
            a.len(),
            b.len(),
            a.get(at),
            b.get(at)
        ))
    }
    [
        diff("histories", &a.history, &b.history),
        diff("traces", &a.trace, &b.trace),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join("; ")
}

#[test]
fn the_same_seed_replays_the_same_history_and_trace_and_other_seeds_differ() {
    const SEEDS: u64 = 12;
    let wall = std::time::Instant::now();
    let mut hashes = BTreeSet::new();
    for seed in 0..SEEDS {
        let first = scenario(seed);
        let second = scenario(seed);
        assert_eq!(
            first.hash,
            second.hash,
            "seed {seed} ({:?}) did not replay; {}",
            first.fault,
            first_difference(&first, &second)
        );
        hashes.insert(first.hash);
    }
    let wall = wall.elapsed();
    let per_second = (2 * SEEDS) as f64 / wall.as_secs_f64();
    println!(
        "{} runs of the small scenario ({PROCS} procs x {PER_PROC} members, one fault each) in {wall:?}: {per_second:.2} seeds/s on this build",
        2 * SEEDS
    );
    assert_eq!(
        hashes.len() as u64,
        SEEDS,
        "different seeds gave the same hash"
    );
}

#[test]
fn after_each_fault_the_mesh_runs_again_in_a_newer_generation_within_a_bound_of_simulated_time() {
    // Detection (the failure timeout, or at once for a kill), a fresh
    // proc's start and the respawn: well within this.
    let bound = FAILURE_TIMEOUT + Duration::from_secs(10);
    for seed in 100..104 {
        let wall = std::time::Instant::now();
        let o = scenario(seed);
        let wall = wall.elapsed();
        println!(
            "seed {seed}: {:?} recovered after {:?} simulated, generation {}; {:?} simulated in {wall:?} of wall-clock time, {} trace events",
            o.fault,
            o.recovered_after,
            o.generation,
            o.took,
            o.trace.len()
        );
        for line in &o.history {
            println!("  {line}");
        }
        assert!(
            o.recovered_after < bound,
            "seed {seed} ({:?}): recovered only after {:?}",
            o.fault,
            o.recovered_after
        );
        assert!(o.generation >= 1, "seed {seed}: no newer generation");
        assert!(
            o.history.iter().any(|l| l.contains("failure of ranks")),
            "seed {seed} ({:?}): no failure recorded:\n{}",
            o.fault,
            o.history.join("\n")
        );
        // The clock jumped: far less wall-clock time than simulated.
        assert!(
            wall < o.took,
            "seed {seed}: {wall:?} of wall-clock time for {:?} simulated",
            o.took
        );
    }
}

/// A proc paused shorter than the failure timeout, while its controller
/// floods its mesh with fire-and-forget casts, makes none of them lost:
/// not its own, and not those of the proc that forwards to it in the cast
/// tree (fan-out 1: the controller casts to proc 0, which forwards to proc
/// 1), whose forwarding waits on the paused proc. The caster's credit
/// (docs/semantics.md §4.3) holds the flood until the procs took what they
/// were sent, instead of proc 0 refusing what its queue cannot hold.
#[test]
fn a_flood_of_fire_and_forget_casts_past_a_paused_proc_loses_none() {
    const CASTS: u64 = 20_000;
    simulate(|| async move {
        let config = RuntimeConfig::default()
            .fanout(std::num::NonZeroU32::MIN)
            .endpoint(regent_net::EndpointConfig::default().failure_timeout(FAILURE_TIMEOUT));
        let cluster = within("the cluster starts", SimCluster::start(11, 2, config))
            .await
            .expect("the cluster starts");
        let mesh = within(
            "the mesh spawns",
            cluster
                .procs()
                .spawn_with::<Counter>("flooded", 1, &(), SpawnOptions::new()),
        )
        .await
        .expect("the mesh spawns");
        let victim = cluster.procs().procs()[1].proc.clone();
        let allocator = cluster.allocator();
        allocator.pause(&victim).unwrap();
        let flood = {
            let mesh = mesh.clone();
            tokio::spawn(async move {
                for n in 0..CASTS {
                    mesh.cast_nowait(&Selection::All, &Op::Cast(n))
                        .await
                        .unwrap();
                }
            })
        };
        tokio::time::sleep(FAILURE_TIMEOUT / 2).await;
        allocator.resume(&victim).unwrap();
        within("the flood is handed over", flood).await.unwrap();
        let counts = within("counts", mesh.call(&Selection::All, &Op::Count))
            .await
            .unwrap()
            .into_result()
            .expect("the members answer");
        assert_eq!(
            mesh.generation().0,
            0,
            "the pause was not taken for a failure"
        );
        assert_eq!(
            counts.iter().map(|(_, c)| *c).collect::<Vec<_>>(),
            vec![CASTS, CASTS]
        );
    });
}
