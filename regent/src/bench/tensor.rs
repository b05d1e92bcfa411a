//! `regent bench tensor`: collectives over meshes of real proc processes
//! (this binary, started by the local allocator, one member per proc, all
//! on this host: the payload moves through shared memory, the control
//! messages over the mesh transport's QUIC data channels).
//!
//! - `all_reduce_<S>_<P>procs`: the bus bandwidth of an all-reduce (sum)
//!   of S of f32 over P procs, as nccl-tests defines it (`size / time ×
//!   2(P−1)/P`; time = the slowest member's, median over iterations, each
//!   after a barrier), against the bandwidth of a single-thread memcpy of
//!   S measured in the same run (best of 5; 4 MiB copies from the cache,
//!   larger sizes from memory).
//! - `broadcast_<S>_<P>procs`: the same for a broadcast from rank 0 (bus
//!   bandwidth = size / time).
//! - `reshard_<S>_<P>procs`: a row-sharded 4096-column f32 matrix of S
//!   resharded into column shards over the same P procs: S / time, against
//!   memcpy.
//! - `all_reduce_4B_<P>procs`: the latency of an all-reduce (sum) of one
//!   f32 over P procs (the inline algorithm: the data rides the control
//!   messages), the slowest member's time, median over iterations, each
//!   after a barrier, against `control_round_trip`: the median round trip
//!   of one small message between ranks 0 and 1 on a mesh transport of
//!   their own (the same kind of data channel), in the same mesh.
//! - `kill_to_error_<P>procs`: a proc killed (SIGKILL) while every member
//!   runs all-reduces of 64 MiB in a loop: from the kill to each
//!   survivor's error (which names the rank), against the time the owner
//!   took to learn of the failure (its failure report); median over the
//!   survivors of every round, and `_max` their slowest.
//!
//! Members run libtorch on one thread (`tch::set_num_threads(1)`, which
//! sets OpenMP's and MKL's counts too): P procs share this host's cores,
//! and the folds run on the members' own threads.

use std::time::{Duration, Instant, SystemTime};

use regent_mesh::alloc::ProcSignal;
use regent_mesh::{
    ActorError, ActorMesh, Decision, Member, MeshActor, MeshPolicy, MeshStatus, ProcMesh, Rank,
    RuntimeConfig, Selection, Shape, SpawnOptions,
};
use regent_tensor::transport::mesh::MeshTransport;
use regent_tensor::{
    CollectiveConfig, Communicator, DType, Error, ReduceOp, ReshardPlan, Sharding, TensorBuffer,
    Transport, plan_tensor,
};
use serde::{Deserialize, Serialize};

use super::{BenchOptions, Figure, Report};

const SUITE: &str = "tensor";
/// Columns of the resharded matrix.
const RESHARD_COLS: u64 = 4096;
/// The all-reduce the kill interrupts.
const KILL_BYTES: u64 = 64 << 20;

/// What a bench member runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum BenchOp {
    /// All-reduce (sum) in place.
    AllReduce,
    /// Broadcast from rank 0.
    Broadcast,
}

/// What a bench member is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum BenchMsg {
    /// `iterations` timed runs (each after a barrier) after one untimed.
    Run {
        /// The operation.
        op: BenchOp,
        /// Bytes of f32.
        bytes: u64,
        /// Timed runs.
        iterations: u32,
    },
    /// `iterations` timed round trips of a small message between ranks 0
    /// and 1 (on a transport of their own), then `iterations` timed
    /// all-reduces of one f32 (each after a barrier) at every member.
    Latency {
        /// Timed runs of each.
        iterations: u32,
    },
    /// `iterations` timed runs of a reshard plan whose tensor is
    /// `[rows, RESHARD_COLS]` f32 (sources and destinations: every rank).
    Reshard {
        /// The plan.
        plan: Box<ReshardPlan>,
        /// Timed runs.
        iterations: u32,
    },
    /// All-reduces of `bytes` until one fails; each completed one is noted
    /// in the file `progress` (the controller waits for a few).
    UntilFailure {
        /// Bytes of f32.
        bytes: u64,
        /// Where the member writes its count (one file per rank:
        /// `<progress>-<rank>`).
        progress: String,
    },
}

/// A bench member's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum BenchReply {
    /// Seconds of every timed run.
    Times(Vec<f64>),
    /// Seconds of every timed run of [`BenchMsg::Latency`].
    Latency {
        /// The round trips (measured at rank 0; empty elsewhere).
        round_trips: Vec<f64>,
        /// The all-reduces of one f32.
        all_reduces: Vec<f64>,
    },
    /// The operation failed.
    Failed {
        /// The error, as displayed.
        error: String,
        /// The rank it blames.
        culprit: Option<u32>,
        /// When, in nanoseconds since the Unix epoch.
        at_unix_ns: u64,
    },
}

/// The bench's mesh actor: one communicator with all members per
/// generation, and for [`BenchMsg::Latency`] a bare transport between
/// ranks 0 and 1.
pub(crate) struct TensorBench {
    comm: Option<(u64, Communicator<MeshTransport>)>,
    pair: Option<(u64, MeshTransport)>,
}

/// The channel tag of the communicators of `generation` (members agree
/// on it without talking; consecutive generations never share a port).
fn comm_tag(generation: u64) -> u16 {
    1 + (generation % 30_000) as u16
}

/// The channel tag of the bare transport of `generation` (never a
/// communicator's).
fn pair_tag(generation: u64) -> u16 {
    30_001 + (generation % 30_000) as u16
}

/// The bytes of a round trip's message.
const PING: &[u8] = &[0; 8];

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The most timed runs one message may ask for.
const MAX_ITERATIONS: u32 = 100_000;

fn checked_iterations(iterations: u32) -> Result<usize, ActorError> {
    if iterations > MAX_ITERATIONS {
        return Err(format!("{iterations} iterations (at most {MAX_ITERATIONS})").into());
    }
    Ok(iterations as usize)
}

fn f32_len(bytes: u64) -> Result<u64, ActorError> {
    if bytes == 0 || !bytes.is_multiple_of(4) || bytes > 16 << 30 {
        return Err(format!("{bytes} bytes is not a bench size").into());
    }
    Ok(bytes / 4)
}

impl TensorBench {
    async fn comm(&mut self, member: &Member) -> Result<&mut Communicator<MeshTransport>, Error> {
        let generation = member.generation().0;
        if self.comm.as_ref().is_none_or(|(g, _)| *g != generation) {
            self.comm = None;
            tokio::task::yield_now().await;
            let group = (0..member.size()).map(Rank).collect();
            let transport = MeshTransport::new(member, group, comm_tag(generation))?;
            let config = CollectiveConfig::default().timeout(Duration::from_secs(600));
            self.comm = Some((generation, Communicator::new(transport, config).await?));
        }
        // Set just above.
        Ok(&mut self.comm.as_mut().expect("a communicator").1)
    }

    /// Round trips between ranks 0 and 1 on their bare transport (rank 0
    /// times them; the others do nothing).
    async fn round_trips(
        &mut self,
        member: &Member,
        iterations: u32,
    ) -> Result<Vec<f64>, ActorError> {
        let rank = member.rank().0;
        if rank > 1 {
            return Ok(Vec::new());
        }
        let generation = member.generation().0;
        if self.pair.as_ref().is_none_or(|(g, _)| *g != generation) {
            self.pair = None;
            tokio::task::yield_now().await;
            let transport =
                MeshTransport::new(member, vec![Rank(0), Rank(1)], pair_tag(generation))?;
            self.pair = Some((generation, transport));
        }
        // Set just above.
        let t = &self.pair.as_ref().expect("a transport").1;
        let other = 1 - rank as usize;
        let within = Duration::from_secs(60);
        let mut times = Vec::with_capacity(checked_iterations(iterations)?);
        // One untimed (the first send waits for the hello).
        for i in 0..=iterations {
            let start = Instant::now();
            if rank == 0 {
                t.send(other, PING.into()).await?;
                t.recv(other, tokio::time::Instant::now() + within).await?;
                if i > 0 {
                    times.push(start.elapsed().as_secs_f64());
                }
            } else {
                let m = t.recv(other, tokio::time::Instant::now() + within).await?;
                t.send(other, m).await?;
            }
        }
        Ok(times)
    }

    async fn run(&mut self, member: &Member, msg: BenchMsg) -> Result<BenchReply, ActorError> {
        let manager = member.buffers()?.clone();
        let rank = member.rank().0;
        match msg {
            BenchMsg::Run {
                op,
                bytes,
                iterations,
            } => {
                let mut data = TensorBuffer::zeros(&manager, DType::F32, &[f32_len(bytes)?])?;
                let comm = self.comm(member).await?;
                let mut times = Vec::with_capacity(checked_iterations(iterations)?);
                for i in 0..=iterations {
                    comm.barrier().await?;
                    let t = Instant::now();
                    match op {
                        BenchOp::AllReduce => comm.all_reduce(&mut data, ReduceOp::Sum).await?,
                        BenchOp::Broadcast => comm.broadcast(&mut data, 0).await?,
                    }
                    if i > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok(BenchReply::Times(times))
            }
            BenchMsg::Latency { iterations } => {
                let round_trips = self.round_trips(member, iterations).await?;
                let mut data = TensorBuffer::zeros(&manager, DType::F32, &[1])?;
                let comm = self.comm(member).await?;
                let mut all_reduces = Vec::with_capacity(checked_iterations(iterations)?);
                for i in 0..=iterations {
                    comm.barrier().await?;
                    let t = Instant::now();
                    comm.all_reduce(&mut data, ReduceOp::Sum).await?;
                    if i > 0 {
                        all_reduces.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok(BenchReply::Latency {
                    round_trips,
                    all_reduces,
                })
            }
            BenchMsg::Reshard { plan, iterations } => {
                let r = rank as usize;
                let t = plan.tensors.first().ok_or("an empty plan")?;
                let src = TensorBuffer::zeros(&manager, DType::F32, &t.src_shape(r)?)?;
                let mut dst = vec![TensorBuffer::zeros(&manager, DType::F32, &t.dst_shape(r)?)?];
                let comm = self.comm(member).await?;
                let mut times = Vec::with_capacity(checked_iterations(iterations)?);
                for i in 0..=iterations {
                    comm.barrier().await?;
                    let t = Instant::now();
                    // The slice of sources ends with this statement: held
                    // across the await, it would make the handler's future
                    // not `Send` (a `TensorBuffer` is not `Sync`); the
                    // future does not hold it.
                    let reshard = comm.reshard(&plan, &[&src], &mut dst);
                    reshard.await?;
                    if i > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok(BenchReply::Times(times))
            }
            BenchMsg::UntilFailure { bytes, progress } => {
                let mut data = TensorBuffer::zeros(&manager, DType::F32, &[f32_len(bytes)?])?;
                let comm = self.comm(member).await?;
                let path = format!("{progress}-{rank}");
                for i in 1u64.. {
                    comm.all_reduce(&mut data, ReduceOp::Sum).await?;
                    std::fs::write(&path, i.to_string())?;
                }
                Err("unreachable: the loop ends by an error".into())
            }
        }
    }
}

impl MeshActor for TensorBench {
    const NAME: &'static str = "regent-bench/tensor";
    type Args = ();
    type Msg = BenchMsg;
    type Reply = BenchReply;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        regent_tensor::tch::set_num_threads(1);
        Ok(Self {
            comm: None,
            pair: None,
        })
    }

    async fn handle(&mut self, member: &Member, msg: BenchMsg) -> Result<BenchReply, ActorError> {
        match self.run(member, msg).await {
            Ok(r) => Ok(r),
            Err(e) => Ok(BenchReply::Failed {
                at_unix_ns: unix_ns(SystemTime::now()),
                culprit: e
                    .downcast_ref::<Error>()
                    .and_then(Error::culprit)
                    .map(|r| r as u32),
                error: e.to_string(),
            }),
        }
    }
}

regent_mesh::register_actor!(TensorBench);

/// Bytes per second of a single-thread copy of `bytes` (best of 5).
fn memcpy(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

fn size_name(bytes: u64) -> String {
    format!("{}MiB", bytes >> 20)
}

/// The times of every member's answer.
fn times(vm: Vec<(Rank, BenchReply)>) -> anyhow::Result<Vec<Vec<f64>>> {
    vm.into_iter()
        .map(|(r, reply)| match reply {
            BenchReply::Times(t) => Ok(t),
            BenchReply::Failed { error, .. } => anyhow::bail!("rank {}: {error}", r.0),
            BenchReply::Latency { .. } => anyhow::bail!("rank {}: a latency answer", r.0),
        })
        .collect()
}

/// The median of samples (sorts them; `NaN` for none).
fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Per timed run, the slowest member's time; their median.
fn slowest_median(per_rank: &[Vec<f64>]) -> anyhow::Result<(f64, usize)> {
    let n = per_rank.first().map_or(0, Vec::len);
    anyhow::ensure!(
        per_rank.iter().all(|t| t.len() == n),
        "members timed different numbers of runs"
    );
    anyhow::ensure!(n > 0, "no timed runs");
    let mut slowest: Vec<f64> = (0..n)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    Ok((median_of(&mut slowest), n))
}

fn iterations_for(bytes: u64, quick: bool) -> u32 {
    let n = ((2u64 << 30) / bytes).clamp(5, 30) as u32;
    if quick { (n / 3).max(3) } else { n }
}

async fn spawn(pm: &ProcMesh, name: &str) -> anyhow::Result<ActorMesh<TensorBench>> {
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(100, Duration::from_secs(60));
    Ok(pm
        .spawn_with::<TensorBench>(name, 1, &(), SpawnOptions::new().policy(policy))
        .await?)
}

/// A small all-reduce against a bare round trip, in the same mesh.
async fn latency(
    report: &mut Report,
    mesh: &ActorMesh<TensorBench>,
    p: usize,
    quick: bool,
) -> anyhow::Result<()> {
    let iterations = if quick { 50 } else { 500 };
    let msg = BenchMsg::Latency { iterations };
    let vm = mesh
        .call_within(&Selection::All, &msg, Duration::from_secs(600))
        .await?
        .into_result()?;
    let mut round_trips = Vec::new();
    let mut all_reduces = Vec::new();
    for (r, reply) in vm {
        match reply {
            BenchReply::Latency {
                round_trips: rt,
                all_reduces: ar,
            } => {
                if r == Rank(0) {
                    round_trips = rt;
                }
                all_reduces.push(ar);
            }
            BenchReply::Failed { error, .. } => anyhow::bail!("rank {}: {error}", r.0),
            BenchReply::Times(_) => anyhow::bail!("rank {}: a times answer", r.0),
        }
    }
    anyhow::ensure!(
        round_trips.len() == iterations as usize,
        "rank 0 timed {} round trips",
        round_trips.len()
    );
    let round_trip = median_of(&mut round_trips) * 1e6;
    let (t, n) = slowest_median(&all_reduces)?;
    report.push(
        Figure::new(SUITE, &format!("all_reduce_4B_{p}procs"), t * 1e6, "us")
            .samples(n)
            .against("control_round_trip", round_trip, "us"),
    );
    Ok(())
}

async fn bandwidth(
    report: &mut Report,
    mesh: &ActorMesh<TensorBench>,
    p: usize,
    sizes: &[u64],
    quick: bool,
) -> anyhow::Result<()> {
    let within = Duration::from_secs(600);
    for &bytes in sizes {
        // Off the runtime: allocating, populating and copying hundreds of
        // MiB would hold a worker (and the link tasks queued on it) for
        // most of a second.
        let mc = tokio::task::spawn_blocking(move || memcpy(bytes as usize)).await? / 1e9;
        let iterations = iterations_for(bytes, quick);
        for op in [BenchOp::AllReduce, BenchOp::Broadcast] {
            let msg = BenchMsg::Run {
                op,
                bytes,
                iterations,
            };
            let vm = mesh.call_within(&Selection::All, &msg, within).await?;
            let (t, n) = slowest_median(&times(vm.into_result()?)?)?;
            let algbw = bytes as f64 / t / 1e9;
            let (name, busbw) = match op {
                BenchOp::AllReduce => ("all_reduce", algbw * 2.0 * (p - 1) as f64 / p as f64),
                BenchOp::Broadcast => ("broadcast", algbw),
            };
            report.push(
                Figure::new(
                    SUITE,
                    &format!("{name}_{}_{p}procs", size_name(bytes)),
                    busbw,
                    "GB/s",
                )
                .samples(n)
                .against("memcpy", mc, "GB/s"),
            );
        }
        // The reshard of a matrix of the same size: rows to columns.
        let rows = bytes / 4 / RESHARD_COLS;
        let tensor = plan_tensor(
            "m",
            DType::F32,
            &[rows, RESHARD_COLS],
            &Sharding::split(p, 0)?,
            &Sharding::split(p, 1)?,
        )?;
        let ranks: Vec<usize> = (0..p).collect();
        let plan = ReshardPlan::new(vec![tensor], ranks.clone(), ranks)?;
        let msg = BenchMsg::Reshard {
            plan: Box::new(plan),
            iterations,
        };
        let vm = mesh.call_within(&Selection::All, &msg, within).await?;
        let (t, n) = slowest_median(&times(vm.into_result()?)?)?;
        report.push(
            Figure::new(
                SUITE,
                &format!("reshard_{}_{p}procs", size_name(bytes)),
                bytes as f64 / t / 1e9,
                "GB/s",
            )
            .samples(n)
            .against("memcpy", mc, "GB/s"),
        );
    }
    Ok(())
}

/// Rounds of: every member all-reduces in a loop, a proc is killed, the
/// survivors' errors are timed; then the mesh restarts.
async fn kill_to_error(
    report: &mut Report,
    pm: &ProcMesh,
    p: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    let mesh = spawn(pm, "tensor-kill").await?;
    let dir = std::env::temp_dir().join(format!("regent-bench-tensor-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut errors = Vec::new();
    let mut owner = Vec::new();
    for round in 0..rounds {
        // Round `round` runs in generation `round` (every kill restarts).
        mesh.wait_status(Duration::from_secs(60), |s| {
            *s == MeshStatus::Running && mesh.generation().0 >= round as u64
        })
        .await?;
        let progress = dir.join(format!("round-{round}")).display().to_string();
        let run = {
            let mesh = mesh.clone();
            let msg = BenchMsg::UntilFailure {
                bytes: KILL_BYTES,
                progress: progress.clone(),
            };
            tokio::spawn(async move {
                mesh.call_within(&Selection::All, &msg, Duration::from_secs(120))
                    .await
            })
        };
        // Two completed all-reduces at every member: they are in the loop.
        let started = Instant::now();
        while !(0..p).all(|r| {
            std::fs::read_to_string(format!("{progress}-{r}"))
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|n| n >= 2)
        }) {
            if run.is_finished() {
                let vm = run.await??;
                anyhow::bail!("the all-reduces ended before the kill: {:?}", vm.values());
            }
            if started.elapsed() > Duration::from_secs(20) {
                let done: Vec<_> = (0..p)
                    .map(|r| std::fs::read_to_string(format!("{progress}-{r}")).ok())
                    .collect();
                anyhow::bail!(
                    "round {round}: the all-reduces made no progress (completed, by rank: {done:?})"
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let victim = (round % (p - 1)) + 1;
        let proc = mesh.procs()[victim].proc.clone();
        let mut failures = mesh.failures();
        let t0 = SystemTime::now();
        let k = Instant::now();
        pm.allocator().signal(&proc, ProcSignal::Kill).await?;
        let failure = tokio::time::timeout(Duration::from_secs(30), failures.recv()).await??;
        owner.push(k.elapsed().as_secs_f64());
        anyhow::ensure!(
            failure.ranks == vec![Rank(victim as u32)],
            "the owner saw {failure}"
        );
        let vm = run.await??;
        let lost: Vec<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
        anyhow::ensure!(
            lost == vec![victim as u32],
            "members other than the victim were lost: {:?}",
            vm.failed()
        );
        let survivors = errors.len();
        for (r, reply) in vm.values() {
            match reply {
                BenchReply::Failed {
                    culprit,
                    at_unix_ns,
                    error,
                } => {
                    anyhow::ensure!(
                        *culprit == Some(victim as u32),
                        "rank {} blamed {culprit:?}: {error}",
                        r.0
                    );
                    errors.push(at_unix_ns.saturating_sub(unix_ns(t0)) as f64 / 1e9);
                }
                BenchReply::Times(_) | BenchReply::Latency { .. } => {
                    anyhow::bail!("rank {} completed", r.0)
                }
            }
        }
        anyhow::ensure!(
            errors.len() - survivors == p - 1,
            "{} survivors answered, not {}",
            errors.len() - survivors,
            p - 1
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    mesh.stop().await?;
    let n = errors.len();
    let max = errors.iter().copied().fold(0.0, f64::max);
    let owner_median = median_of(&mut owner);
    report.push(
        Figure::new(
            SUITE,
            &format!("kill_to_error_{p}procs"),
            median_of(&mut errors) * 1e3,
            "ms",
        )
        .samples(n)
        .against("owner_detects", owner_median * 1e3, "ms"),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("kill_to_error_{p}procs_max"),
            max * 1e3,
            "ms",
        )
        .samples(n)
        .against("owner_detects", owner_median * 1e3, "ms"),
    );
    Ok(())
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    regent_tensor::tch::set_num_threads(1);
    let sizes: &[u64] = if opts.quick {
        &[4 << 20, 64 << 20]
    } else {
        &[4 << 20, 64 << 20, 256 << 20]
    };
    let (rt, alloc) = super::mesh::cluster(RuntimeConfig::default()).await?;
    for p in [2usize, 4] {
        let pm = rt
            .spawn_procs(alloc.clone(), Shape::new([("procs", p)])?)
            .await?;
        let mesh = spawn(&pm, "tensor").await?;
        latency(report, &mesh, p, opts.quick).await?;
        bandwidth(report, &mesh, p, sizes, opts.quick).await?;
        mesh.stop().await?;
        if p == 4 {
            // A mesh of its own on the same procs.
            kill_to_error(report, &pm, p, if opts.quick { 2 } else { 5 }).await?;
        }
        pm.stop(Duration::from_secs(2)).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_takes_its_slowest_member_and_the_figure_their_median() {
        // Run i's time is the slowest member's: [3, 5, 4]; the median is 4.
        let per_rank = vec![vec![1.0, 5.0, 4.0], vec![3.0, 2.0, 0.5]];
        assert_eq!(slowest_median(&per_rank).unwrap(), (4.0, 3));
        assert!(slowest_median(&[vec![1.0], vec![1.0, 2.0]]).is_err());
        assert!(slowest_median(&[Vec::new()]).is_err());
    }

    #[test]
    fn sizes_and_iterations_from_the_wire_are_bounded() {
        assert_eq!(f32_len(4 << 20).unwrap(), 1 << 20);
        assert!(f32_len(0).is_err() && f32_len(6).is_err() && f32_len(32 << 30).is_err());
        assert!(checked_iterations(MAX_ITERATIONS).is_ok());
        assert!(checked_iterations(u32::MAX).is_err());
    }
}
