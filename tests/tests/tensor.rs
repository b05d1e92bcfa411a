//! Collectives across real proc processes (`tensor_proc`, started by the
//! `LocalAllocator`'s host agent; behind chaos proxies for the partition),
//! over the mesh transport (`regent_tensor::transport::mesh`): control
//! messages on a member data channel, payload through the procs' buffer
//! managers (shm on one host).
//!
//! - Happy path over 2 and 4 procs: all-reduce (inline, direct and ring),
//!   broadcast, all-gather, reduce-scatter, send/recv, and a tensor read
//!   one-sidedly by its handle — every member's result bit-equal to a
//!   serial reference computed here from the same inputs (rank order for
//!   the exact algorithms, `ring_fold_order` for the ring).
//! - A proc killed (SIGKILL), paused (SIGSTOP) or cut off (every datagram
//!   to and from it dropped) in the middle of a long run of all-reduces:
//!   every survivor's all-reduce returns an error naming the rank within
//!   the failure-detection time (measured from the fault, printed), none
//!   returns a result, and after the restart (restart-member) the next
//!   all-reduce, in the new generation, is bit-identical to the reference
//!   again — with the paused or cut-off zombie awake and fenced.
//!
//! Every test checks that no proc it started outlives it.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use regent_chaos::{ChaosCluster, ClusterConfig, Seed};
use regent_mesh::alloc::{LocalAllocator, ProcSignal};
use regent_mesh::{
    ActorMesh, Decision, MeshPolicy, MeshStatus, ProcMesh, Rank, Runtime, RuntimeConfig, Selection,
    Shape, SpawnOptions,
};
use regent_net::{EndpointConfig, ProcId};
use regent_tensor::collective::{chunk_ranges, ring_fold_order};
use regent_tensor::{Algorithm, DType, ReduceOp, serial_fold};
use regent_tests::process::{KillOnDrop, wait_gone};
use regent_tests::tempdir::TempDir;
use regent_tests::tensor_actors::{Collectives, TensorOp, TensorReply, digest, f32_bytes, input};

/// Generous: CI has two shared cores, and these are debug builds.
const DEADLINE: Duration = Duration::from_secs(60);
/// The control plane's failure timeout (the default): a silent proc is
/// declared failed after it.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);
/// What a loaded CI machine may add to the failure detection (as the chaos
/// suite allows).
const SLACK: Duration = Duration::from_secs(2);

/// Procs of a test, started by a local allocator or behind chaos proxies.
struct Harness {
    procs: Option<ProcMesh>,
    guard: KillOnDrop,
    chaos: Option<ChaosCluster>,
    _rt: Option<Runtime>,
}

fn runtime_config(lease: Duration) -> RuntimeConfig {
    RuntimeConfig::default()
        .owner_lease(lease)
        .call_timeout(Duration::from_secs(30))
        .endpoint(EndpointConfig::default().failure_timeout(FAILURE_TIMEOUT))
}

impl Harness {
    async fn local(procs: usize) -> Self {
        let rt = Runtime::start(runtime_config(Duration::from_secs(10)))
            .await
            .unwrap();
        let alloc = Arc::new(
            LocalAllocator::new(rt.endpoint().clone())
                .unwrap()
                .program(env!("CARGO_BIN_EXE_tensor_proc")),
        );
        let guard = KillOnDrop::default();
        let pm = rt
            .spawn_procs(alloc, Shape::new([("procs", procs)]).unwrap())
            .await
            .unwrap();
        guard.watch(pm.procs().iter().map(|p| p.pid));
        Self {
            procs: Some(pm),
            guard,
            chaos: None,
            _rt: Some(rt),
        }
    }

    /// Behind chaos proxies; the zombie of a partition lives until it heals
    /// (a long lease).
    async fn chaos(procs: usize) -> Self {
        let config = ClusterConfig::default()
            .program(env!("CARGO_BIN_EXE_tensor_proc"))
            .runtime(runtime_config(Duration::from_secs(60)));
        let cluster = ChaosCluster::start(config, Seed(11)).await.unwrap();
        let pm = cluster.spawn_procs(procs).await.unwrap();
        let guard = KillOnDrop::default();
        guard.watch(pm.procs().iter().map(|p| p.pid));
        Self {
            procs: Some(pm),
            guard,
            chaos: Some(cluster),
            _rt: None,
        }
    }

    fn procs(&self) -> &ProcMesh {
        self.procs.as_ref().unwrap()
    }

    async fn spawn(&self) -> ActorMesh<Collectives> {
        let policy = MeshPolicy::new(Decision::RestartMember);
        self.procs()
            .spawn_with::<Collectives>("collectives", 1, &(), SpawnOptions::new().policy(policy))
            .await
            .unwrap()
    }

    fn pid_of(&self, proc: &ProcId) -> u32 {
        self.procs()
            .all_procs()
            .iter()
            .find(|p| &p.proc == proc)
            .map(|p| p.pid)
            .unwrap()
    }

    /// Stops every proc and checks that none outlives the test.
    async fn finish(mut self) {
        let pm = self.procs.take().unwrap();
        self.guard.watch(pm.all_procs().iter().map(|p| p.pid));
        if let Some(c) = &self.chaos {
            c.network().heal();
        }
        pm.stop(Duration::from_secs(2)).await.unwrap();
        if let Some(c) = self.chaos.take() {
            let left = c.shutdown(DEADLINE).await;
            assert!(left.is_empty(), "procs outlived the test: {left:?}");
        }
        let left = wait_gone(&self.guard.pids(), DEADLINE);
        assert!(left.is_empty(), "procs outlived the test: {left:?}");
    }
}

/// The inputs of `p` members.
fn inputs(seed: u64, p: usize, len: usize) -> Vec<Vec<u8>> {
    (0..p)
        .map(|r| f32_bytes(&input(seed, r as u32, len)))
        .collect()
}

/// What every member of an all-reduce of `inputs` must hold: the serial
/// left fold in rank order (exact algorithms), or for the ring, chunk `c`
/// folded in `ring_fold_order(c, p)`.
fn all_reduce_reference(op: ReduceOp, inputs: &[Vec<u8>], algorithm: Algorithm) -> Vec<u8> {
    let p = inputs.len();
    if algorithm != Algorithm::Ring {
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        return serial_fold(op, DType::F32, &refs).unwrap();
    }
    let numel = inputs[0].len() / 4;
    let mut out = Vec::with_capacity(inputs[0].len());
    for (c, range) in chunk_ranges(numel, p).into_iter().enumerate() {
        let bytes = range.start * 4..range.end * 4;
        let parts: Vec<&[u8]> = ring_fold_order(c, p)
            .into_iter()
            .map(|q| &inputs[q][bytes.clone()])
            .collect();
        out.extend(serial_fold(op, DType::F32, &parts).unwrap());
    }
    out
}

/// Every member's digest and generation; panics naming any member that
/// failed or answered otherwise.
async fn digests(mesh: &ActorMesh<Collectives>, op: &TensorOp) -> Vec<(u64, u64)> {
    let vm = mesh
        .call_within(&Selection::All, op, DEADLINE)
        .await
        .unwrap();
    let values = vm.into_result().unwrap();
    values
        .into_iter()
        .map(|(r, reply)| match reply {
            TensorReply::Digest {
                digest, generation, ..
            } => (digest, generation),
            other => panic!("rank {}: {other:?} for {op:?}", r.0),
        })
        .collect()
}

async fn check_all_reduce(
    mesh: &ActorMesh<Collectives>,
    p: usize,
    len: usize,
    op: ReduceOp,
    algorithm: Algorithm,
    iterations: u64,
) {
    let seed = len as u64 ^ 0x5eed;
    let inputs = inputs(seed, p, len);
    let want = digest(&all_reduce_reference(op, &inputs, algorithm));
    let got = digests(
        mesh,
        &TensorOp::AllReduce {
            len: len as u64,
            seed,
            iterations,
            op,
            algorithm,
            progress: None,
        },
    )
    .await;
    for (r, (d, _)) in got.iter().enumerate() {
        assert_eq!(
            *d, want,
            "rank {r}: all-reduce {op:?} of {len} f32 ({algorithm:?}, {p} procs) differs from the reference"
        );
    }
}

async fn happy_path(p: usize) {
    let h = Harness::local(p).await;
    let mesh = h.spawn().await;
    // The data is sensitive to the order of a sum (with 4 members, where
    // it is not commutativity alone): a wrong order would show.
    if p == 4 {
        let x = inputs(1, p, 1000);
        let mut rev: Vec<Vec<u8>> = x.clone();
        rev.reverse();
        assert_ne!(
            all_reduce_reference(ReduceOp::Sum, &x, Algorithm::Direct),
            all_reduce_reference(ReduceOp::Sum, &rev, Algorithm::Direct)
        );
        assert_ne!(
            all_reduce_reference(ReduceOp::Sum, &x, Algorithm::Direct),
            all_reduce_reference(ReduceOp::Sum, &x, Algorithm::Ring)
        );
    }
    // Inline (64 KiB and less under Auto), direct (several pieces per
    // chunk; an odd length splits unevenly), ring.
    check_all_reduce(&mesh, p, 1000, ReduceOp::Sum, Algorithm::Auto, 2).await;
    check_all_reduce(&mesh, p, 300_001, ReduceOp::Sum, Algorithm::Auto, 2).await;
    check_all_reduce(&mesh, p, 300_001, ReduceOp::Mean, Algorithm::Direct, 1).await;
    check_all_reduce(&mesh, p, 300_001, ReduceOp::Max, Algorithm::Auto, 1).await;
    check_all_reduce(&mesh, p, 300_001, ReduceOp::Sum, Algorithm::Ring, 2).await;

    for (len, algorithm) in [
        (1000, Algorithm::Auto),
        (300_001, Algorithm::Auto),
        (300_001, Algorithm::Ring),
    ] {
        let seed = 7;
        let root = (p - 1) as u32;
        let want = digest(&f32_bytes(&input(seed, root, len)));
        let got = digests(
            &mesh,
            &TensorOp::Broadcast {
                len: len as u64,
                seed,
                root,
                algorithm,
            },
        )
        .await;
        for (r, (d, _)) in got.iter().enumerate() {
            assert_eq!(*d, want, "rank {r}: broadcast of {len} ({algorithm:?})");
        }

        let want = digest(&inputs(seed, p, len).concat());
        let got = digests(
            &mesh,
            &TensorOp::AllGather {
                len: len as u64,
                seed,
                algorithm,
            },
        )
        .await;
        for (r, (d, _)) in got.iter().enumerate() {
            assert_eq!(*d, want, "rank {r}: all-gather of {len} ({algorithm:?})");
        }
    }

    for len in [1000 * p, 75_001 * p] {
        let seed = 9;
        let x = inputs(seed, p, len);
        let reduced = all_reduce_reference(ReduceOp::Sum, &x, Algorithm::Direct);
        let got = digests(
            &mesh,
            &TensorOp::ReduceScatter {
                len: len as u64,
                seed,
                op: ReduceOp::Sum,
                algorithm: Algorithm::Auto,
            },
        )
        .await;
        let chunk = len / p * 4;
        for (r, (d, _)) in got.iter().enumerate() {
            assert_eq!(
                *d,
                digest(&reduced[r * chunk..(r + 1) * chunk]),
                "rank {r}: reduce-scatter of {len}"
            );
        }
    }

    // Send/recv between the first and the last member: inline, and by
    // handle (the receiver reads the sender's memory).
    for len in [1000usize, 300_001] {
        let seed = 13;
        let (from, to) = (0u32, (p - 1) as u32);
        let want = digest(&f32_bytes(&input(seed, from, len)));
        let vm = mesh
            .call_within(
                &Selection::All,
                &TensorOp::SendRecv {
                    len: len as u64,
                    seed,
                    from,
                    to,
                },
                DEADLINE,
            )
            .await
            .unwrap();
        for (r, reply) in vm.into_result().unwrap() {
            if r.0 == from || r.0 == to {
                assert!(
                    matches!(reply, TensorReply::Digest { digest, .. } if digest == want),
                    "rank {}: send/recv of {len}: {reply:?}",
                    r.0
                );
            } else {
                assert_eq!(reply, TensorReply::Idle);
            }
        }
    }

    // A tensor's handle, through the controller, read one-sidedly.
    let (len, seed) = (300_001u64, 17);
    let TensorReply::Handle(handle) = mesh
        .call_one(Rank(0), &TensorOp::Publish { len, seed })
        .await
        .unwrap()
    else {
        panic!("no handle");
    };
    let reply = mesh
        .call_one(Rank((p - 1) as u32), &TensorOp::Fetch(handle.clone()))
        .await
        .unwrap();
    let want = digest(&f32_bytes(&input(seed, 0, len as usize)));
    assert!(
        matches!(reply, TensorReply::Digest { digest, .. } if digest == want),
        "{reply:?}"
    );
    mesh.call_one(Rank(0), &TensorOp::Release).await.unwrap();
    // Released: the handle reads nothing any more.
    let reply = mesh
        .call_one(Rank((p - 1) as u32), &TensorOp::Fetch(handle))
        .await
        .unwrap();
    assert!(
        matches!(reply, TensorReply::Failed { .. }),
        "a released tensor was read: {reply:?}"
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_two_procs_equal_the_serial_reference() {
    happy_path(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_four_procs_equal_the_serial_reference() {
    happy_path(4).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Stop,
    Partition,
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// Waits until every member noted at least `n` completed iterations.
async fn wait_progress(dir: &std::path::Path, p: usize, n: u64) {
    let end = Instant::now() + DEADLINE;
    loop {
        let done = (0..p).all(|r| {
            std::fs::read_to_string(dir.join(format!("rank-{r}")))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .is_some_and(|i| i >= n)
        });
        if done {
            return;
        }
        assert!(
            Instant::now() < end,
            "the all-reduces did not make progress"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fault on one of four procs while every member runs all-reduces in a
/// loop: every survivor's all-reduce fails naming the victim within the
/// detection time, none returns a result, and after the restart the next
/// all-reduce is bit-identical to the reference.
async fn fault_mid_all_reduce(fault: Fault) {
    let p = 4;
    let h = match fault {
        Fault::Partition => Harness::chaos(p).await,
        Fault::Kill | Fault::Stop => Harness::local(p).await,
    };
    let mesh = h.spawn().await;
    let (len, seed) = (1usize << 20, 0xfa11);
    let reference = digest(&all_reduce_reference(
        ReduceOp::Sum,
        &inputs(seed, p, len),
        Algorithm::Direct,
    ));
    let all_reduce = |iterations, progress: Option<String>| TensorOp::AllReduce {
        len: len as u64,
        seed,
        iterations,
        op: ReduceOp::Sum,
        algorithm: Algorithm::Auto,
        progress,
    };
    let before = digests(&mesh, &all_reduce(1, None)).await;
    assert!(
        before.iter().all(|&(d, g)| d == reference && g == 0),
        "{before:?}"
    );

    let progress = TempDir::new("tensor", "progress");
    let run = {
        let mesh = mesh.clone();
        let op = all_reduce(u64::MAX, Some(progress.path().display().to_string()));
        tokio::spawn(async move { mesh.call_within(&Selection::All, &op, DEADLINE).await })
    };
    wait_progress(progress.path(), p, 3).await;

    let victim = Rank(2);
    let proc = mesh.procs()[victim.0 as usize].proc.clone();
    let zombie = h.pid_of(&proc);
    let t0 = SystemTime::now();
    match fault {
        Fault::Kill => h
            .procs()
            .allocator()
            .signal(&proc, ProcSignal::Kill)
            .await
            .unwrap(),
        Fault::Stop => h
            .procs()
            .allocator()
            .signal(&proc, ProcSignal::Stop)
            .await
            .unwrap(),
        Fault::Partition => {
            let c = h.chaos.as_ref().unwrap();
            let node = c.allocator().record(&proc).unwrap().node;
            c.network().isolate(node);
        }
    }
    let vm = run.await.unwrap().unwrap();
    let bound = match fault {
        // An exit is reported by the allocator at once.
        Fault::Kill => SLACK,
        Fault::Stop | Fault::Partition => FAILURE_TIMEOUT + SLACK,
    };
    let failed: Vec<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
    assert_eq!(failed, vec![victim.0], "{:?}", vm.failed());
    let mut detections = Vec::new();
    for (r, reply) in vm.values() {
        match reply {
            TensorReply::Failed {
                error,
                culprit,
                at_unix_ns,
                completed,
                generation,
            } => {
                assert_eq!(
                    *culprit,
                    Some(victim.0),
                    "rank {} blames another rank: {error}",
                    r.0
                );
                assert!(
                    error.contains(&format!("rank {}", victim.0)),
                    "rank {}'s error does not name the rank: {error}",
                    r.0
                );
                assert!(*completed >= 3, "rank {}: {completed} iterations", r.0);
                assert_eq!(*generation, 0, "rank {}", r.0);
                let detected = Duration::from_nanos(at_unix_ns.saturating_sub(unix_ns(t0)));
                println!(
                    "{fault:?}: rank {} failed {detected:?} after the fault, after {completed} all-reduces: {error}",
                    r.0
                );
                assert!(
                    detected < bound,
                    "rank {} took {detected:?} (bound {bound:?})",
                    r.0
                );
                detections.push(detected);
            }
            other => panic!(
                "rank {} returned {other:?} from an all-reduce whose member {} was lost",
                r.0, victim.0
            ),
        }
    }
    assert_eq!(detections.len(), p - 1);
    println!(
        "{fault:?}: detection at the survivors: max {:?}",
        detections.iter().max().unwrap()
    );

    // The restart: the victim respawned in generation 1 on a fresh proc.
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= 1
    })
    .await
    .unwrap();
    // Wake the zombie (its old generation is fenced out; it is told to
    // exit), then the next all-reduce in the new generation.
    match fault {
        Fault::Kill => {}
        Fault::Stop => h
            .procs()
            .allocator()
            .signal(&proc, ProcSignal::Cont)
            .await
            .unwrap(),
        Fault::Partition => h.chaos.as_ref().unwrap().network().heal(),
    }
    let after = digests(&mesh, &all_reduce(3, None)).await;
    for (r, &(d, g)) in after.iter().enumerate() {
        assert_eq!(
            d, reference,
            "rank {r}: the all-reduce after the restart differs"
        );
        assert_eq!(g, mesh.generation().0, "rank {r} ran in generation {g}");
    }
    assert!(mesh.generation().0 >= 1);
    let left = wait_gone(&[zombie], DEADLINE);
    assert!(left.is_empty(), "the zombie {zombie} still runs");
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_proc_fails_the_all_reduce_at_every_survivor_naming_it() {
    fault_mid_all_reduce(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_proc_fails_the_all_reduce_at_every_survivor_naming_it() {
    fault_mid_all_reduce(Fault::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_proc_fails_the_all_reduce_at_every_survivor_naming_it() {
    fault_mid_all_reduce(Fault::Partition).await;
}
