//! `regent bench train`: the data-parallel job of `regent train` (trainers
//! on real procs of this binary, the local allocator, restart-member) for
//! each built-in model, against baselines measured in the same run.
//!
//! - `dp_step_<model>`: the fault-free step rate of the 4-proc job (one
//!   libtorch thread per proc), against the same model and global batch
//!   stepped in this process (`local_step`). The machine's cores are all
//!   the job's 4 procs get, so the baseline may use them too: it is timed
//!   with 1 thread and with as many threads as the machine has cores, in
//!   turn, before and after the job, and the faster is the baseline (its
//!   name says which). Both are medians of per-step wall times (for the
//!   job: the intervals between committed steps, which include the
//!   optimizer update), after warm-up steps. The MLP's global batch is 256
//!   (4 × 64), as in the torch DDP measurement this is compared with.
//! - `heal_<model>`: a rank taking a live peer's whole training state
//!   (weights, optimizer state, step and data cursor): the peer exposes it
//!   in registered memory, the rank reads it over the payload plane and
//!   loads it — the two calls the controller makes when it heals a
//!   replaced rank, timed from the controller, median over samples;
//!   against a memcpy of the same bytes between two populated buffers in
//!   this process.
//! - under a SIGKILL of a random proc every 15 s (3 s in `--quick`), on a
//!   run sized to take a given number of kills (12; 3 in `--quick`, on
//!   the MLP only), twice: the killed proc respawned (`kill<T>`), and
//!   taken by a warm spare (`kill<T>_spare`, one spare kept, as the
//!   README's job does):
//!   - `goodput_kill<T>_<model>`: the job's useful step time (first-time
//!     committed steps) over the wall time from the mesh being up to the
//!     last committed step; against the same figure of the fault-free run.
//!   - `kill<T>_to_commit_p50_<model>` / `_p99_`: from each kill to the
//!     next committed step; against the fault-free step time (the ratio is
//!     how many steps a kill costs).
//!   - `kill<T>_detect_p50_<model>`: from each kill to the supervision's
//!     failure report at the controller.
//!
//! Lines beside the figures say where the time goes: the CPU a step costs
//! in one process and over the job's procs (this process's CPU includes
//! OpenMP's idle threads, which spin a while after parallel work), a
//! rank's own work (its gradients and the update every replica makes,
//! timed here on one thread) and the least a step of the job can take on
//! this machine's cores with it, the heal's two halves, and the medians of
//! a recovery's parts (detection, the heal calls, the retried step; the
//! rest is the respawn of the proc, or a spare's start of the member, and
//! taking stock).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use regent_mesh::{ActorMesh, Rank, Selection, Shape, SpawnOptions};
use regent_train::job::run::{FaultKind, FaultPlan, FaultSpacing};
use regent_train::job::{
    JobCluster, JobConfig, JobEvent, JobSpec, ModelSpec, OptimSpec, Trainer, TrainerArgs,
    TrainerMsg, TrainerReply, run_job,
};

use super::{BenchOptions, Figure, Report, median, percentile};

const SUITE: &str = "train";
/// Data-parallel ranks (procs) of the job.
const WORLD: u32 = 4;
/// Steps a run takes before its step times count (first allocations,
/// communicator set-up).
const WARMUP_STEPS: usize = 3;

/// How long each part runs.
struct Sizes {
    /// Fault-free steps of the job (timed after the warm-up).
    dp_steps: u64,
    /// Steps of the one-process baseline per thread count and round.
    local_steps: usize,
    /// Heals timed.
    heals: usize,
    /// Time between kills.
    kill_every: Duration,
    /// Kills a fault run is sized to take.
    kills: u32,
    /// Faults stop this long (in fault-free steps) before a fault run's
    /// end, so that the last one is recovered from.
    tail: Duration,
    /// Models whose fault run is measured.
    fault_models: &'static [&'static str],
}

impl Sizes {
    fn of(opts: BenchOptions) -> Self {
        if opts.quick {
            Self {
                dp_steps: 24,
                local_steps: 6,
                heals: 5,
                kill_every: Duration::from_secs(3),
                kills: 3,
                tail: Duration::from_secs(3),
                fault_models: &["mlp"],
            }
        } else {
            Self {
                dp_steps: 200,
                local_steps: 30,
                heals: 20,
                kill_every: Duration::from_secs(15),
                kills: 12,
                tail: Duration::from_secs(5),
                fault_models: &["mlp", "gpt"],
            }
        }
    }
}

/// The built-in models as `regent train` runs them (the MLP with the
/// global batch of the torch comparison).
fn specs() -> Vec<JobSpec> {
    let mlp = match ModelSpec::mlp() {
        ModelSpec::Mlp {
            input,
            hidden,
            classes,
            ..
        } => ModelSpec::Mlp {
            input,
            hidden,
            classes,
            global_batch: 256,
        },
        other => other,
    };
    vec![
        JobSpec {
            model: mlp,
            optimizer: OptimSpec::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
            seed: 1,
            world: WORLD,
        },
        JobSpec {
            model: ModelSpec::gpt(None),
            optimizer: OptimSpec::AdamW {
                lr: 3e-3,
                weight_decay: 0.01,
            },
            seed: 1,
            world: WORLD,
        },
    ]
}

/// A scratch run directory, removed on drop.
struct RunDir(PathBuf);

impl RunDir {
    fn new(name: &str) -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("regent-bench-train-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// CPU seconds (user and system) and parent pid in a `/proc/<pid>/stat`
/// line (in the kernel's fixed USER_HZ of 100).
fn stat_cpu(stat: &str) -> Option<(u32, f64)> {
    // The fields after the command name (in parentheses): state, ppid, ...,
    // utime (the 12th) and stime (the 13th).
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ppid = f.get(1)?.parse().ok()?;
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some((ppid, ticks / 100.0))
}

/// CPU seconds this process has used.
fn self_cpu() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_cpu(&s))
        .map_or(0.0, |(_, c)| c)
}

/// CPU seconds the running children of this process (the job's procs)
/// have used.
fn children_cpu() -> f64 {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| stat_cpu(&s))
        .filter(|(ppid, _)| *ppid == me)
        .map(|(_, c)| c)
        .sum()
}

/// What a job run reported, with the controller's times of its events.
struct Run {
    report: regent_train::job::Report,
    /// The mesh was up.
    started: Instant,
    /// Each committed step.
    steps: Vec<Instant>,
    /// Each recovery's end (the mesh runs again, every rank at the
    /// committed step).
    recovered: Vec<Instant>,
    /// CPU seconds of the procs from the warm-up's end to the last step,
    /// and the steps between (fault-free runs).
    cpu: (f64, usize),
}

impl Run {
    /// Intervals between committed steps after the warm-up.
    fn intervals(&self) -> Vec<Duration> {
        self.steps
            .windows(2)
            .skip(WARMUP_STEPS)
            .map(|w| w[1] - w[0])
            .collect()
    }

    /// Useful step time over the wall time from the mesh being up to the
    /// last committed step.
    fn goodput(&self) -> f64 {
        let wall = self
            .steps
            .last()
            .map_or(Duration::ZERO, |t| *t - self.started);
        if wall.is_zero() {
            return 0.0;
        }
        self.report.useful.as_secs_f64() / wall.as_secs_f64()
    }

    /// From each recovery's end to the next committed step: the retried
    /// step.
    fn retries(&self) -> Vec<Duration> {
        self.recovered
            .iter()
            .filter_map(|r| self.steps.iter().find(|s| *s > r).map(|s| *s - *r))
            .collect()
    }
}

async fn job_run(
    cluster: &JobCluster,
    spec: &JobSpec,
    steps: u64,
    faults: Option<FaultPlan>,
    spares: usize,
) -> anyhow::Result<Run> {
    let dir = RunDir::new(spec.model.name())?;
    let mut config = JobConfig::new(spec.clone(), steps, dir.path().to_owned());
    config.threads = 1;
    config.faults = faults;
    config.spares = spares;
    let mut started = None;
    let mut step_times = Vec::with_capacity(steps as usize);
    let mut recovered = Vec::new();
    let mut cpu = (0.0, 0);
    let report = run_job(config, cluster.clone(), |e| match e {
        JobEvent::Started { .. } => started = Some(Instant::now()),
        JobEvent::Step { step, .. } => {
            step_times.push(Instant::now());
            if step_times.len() == WARMUP_STEPS + 1 {
                cpu = (-children_cpu(), step_times.len());
            } else if step == steps {
                cpu = (cpu.0 + children_cpu(), step_times.len() - cpu.1);
            }
        }
        JobEvent::Recovered { .. } => recovered.push(Instant::now()),
        JobEvent::Failure(_) | JobEvent::Checkpoint { .. } | JobEvent::NonFinite { .. } => {}
    })
    .await?;
    Ok(Run {
        report,
        started: started.ok_or_else(|| anyhow::anyhow!("the job never started"))?,
        steps: step_times,
        recovered,
        cpu,
    })
}

/// Per-step wall times of `local_step` in this process with each thread
/// count of `threads`, taken in turn, `steps` each (after warm-up steps).
fn local_steps(spec: &JobSpec, threads: &[i32], steps: usize) -> anyhow::Result<Vec<Local>> {
    let mut replica = spec.build()?;
    let mut out: Vec<Local> = threads.iter().map(|t| Local::new(*t)).collect();
    for Local {
        threads: t,
        times: samples,
        cpu,
    } in &mut out
    {
        // libtorch's intra-op threads are the calling thread's setting
        // (OpenMP): set here, where the steps run.
        tch::set_num_threads(*t);
        for _ in 0..WARMUP_STEPS {
            replica.local_step()?;
        }
        let before = self_cpu();
        for _ in 0..steps {
            let start = Instant::now();
            replica.local_step()?;
            samples.push(start.elapsed());
        }
        *cpu += self_cpu() - before;
    }
    Ok(out)
}

/// One rank's own work in a step of the job, timed in this process on one
/// thread (medians of `samples`): its gradients, and the optimizer update
/// every replica makes — from a flat tensor, without a copy, as a trainer
/// applies its reduced buffer.
fn rank_work(spec: &JobSpec, samples: usize) -> anyhow::Result<(Duration, Duration)> {
    tch::set_num_threads(1);
    let mut replica = spec.build()?;
    let world = spec.world as usize;
    let mut grads = vec![0.0f32; replica.gradient_len()];
    let (mut g, mut a) = (Vec::new(), Vec::new());
    for i in 0..samples + WARMUP_STEPS {
        let t = Instant::now();
        replica.rank_gradients(0, world, &mut grads)?;
        let took = t.elapsed();
        let flat = tch::Tensor::f_from_slice(&grads)?;
        let t = Instant::now();
        replica.apply_mean_tensor(&flat)?;
        if i >= WARMUP_STEPS {
            g.push(took);
            a.push(t.elapsed());
        }
    }
    Ok((median(&mut g), median(&mut a)))
}

/// The one-process baseline with one thread count.
struct Local {
    threads: i32,
    /// Per-step wall times.
    times: Vec<Duration>,
    /// CPU seconds of this process over those steps.
    cpu: f64,
}

impl Local {
    fn new(threads: i32) -> Self {
        Self {
            threads,
            times: Vec::new(),
            cpu: 0.0,
        }
    }
}

async fn local_round(
    spec: &JobSpec,
    threads: &[i32],
    steps: usize,
    into: &mut [Local],
) -> anyhow::Result<()> {
    let (spec, threads) = (spec.clone(), threads.to_vec());
    let got = tokio::task::spawn_blocking(move || local_steps(&spec, &threads, steps)).await??;
    for (all, new) in into.iter_mut().zip(got) {
        all.times.extend(new.times);
        all.cpu += new.cpu;
    }
    Ok(())
}

/// Heal timings: (expose + read and load, expose alone, state bytes).
struct Heals {
    total: Vec<Duration>,
    expose: Vec<Duration>,
    bytes: u64,
}

async fn heals(cluster: &JobCluster, spec: &JobSpec, samples: usize) -> anyhow::Result<Heals> {
    let dir = RunDir::new(&format!("heal-{}", spec.model.name()))?;
    // Two ranks: the state's size does not depend on the world.
    let spec = JobSpec {
        world: 2,
        ..spec.clone()
    };
    let procs = cluster
        .runtime
        .spawn_procs(cluster.allocator.clone(), Shape::new([("procs", 2)])?)
        .await?;
    let args = TrainerArgs {
        spec,
        run_dir: dir.path().to_owned(),
        threads: 1,
        collective_timeout_ms: 30_000,
    };
    let result = match procs
        .spawn_with::<Trainer>("heal", 1, &args, SpawnOptions::new())
        .await
    {
        Ok(mesh) => {
            let r = time_heals(&mesh, samples).await;
            let _ = mesh.stop().await;
            r
        }
        Err(e) => Err(e.into()),
    };
    let _ = procs.stop(Duration::from_secs(2)).await;
    result
}

async fn time_heals(mesh: &ActorMesh<Trainer>, samples: usize) -> anyhow::Result<Heals> {
    // A few steps first, so that the optimizer state is a trained one.
    for step in 0..2 {
        let vm = mesh
            .call(
                &Selection::All,
                &TrainerMsg::Compute {
                    step,
                    epoch: 0,
                    generation: mesh.generation(),
                    poison: None,
                },
            )
            .await?
            .into_result()?;
        anyhow::ensure!(
            vm.iter()
                .all(|(_, r)| matches!(r, TrainerReply::Computed { .. })),
            "step {step} was not computed: {vm:?}"
        );
        mesh.cast(&Selection::All, &TrainerMsg::Commit { step })
            .await?
            .into_result()?;
    }
    let mut out = Heals {
        total: Vec::with_capacity(samples),
        expose: Vec::with_capacity(samples),
        bytes: 0,
    };
    // One untimed round (first registration, first reads).
    for i in 0..=samples {
        let t = Instant::now();
        let (from, len) = match mesh.call_one(Rank(0), &TrainerMsg::Expose).await? {
            TrainerReply::Exposed { buffer, len, .. } => (buffer, len),
            other => anyhow::bail!("unexpected answer to expose: {other:?}"),
        };
        let exposed = t.elapsed();
        match mesh
            .call_one(Rank(1), &TrainerMsg::Heal { from, len })
            .await?
        {
            TrainerReply::Step(2) => {}
            other => anyhow::bail!("unexpected answer to heal: {other:?}"),
        }
        if i > 0 {
            out.total.push(t.elapsed());
            out.expose.push(exposed);
        }
        out.bytes = len;
    }
    Ok(out)
}

/// The median time of a memcpy of `len` bytes between two populated
/// buffers.
fn memcpy(len: usize, samples: usize) -> Duration {
    let src = vec![0x5au8; len];
    let mut dst = vec![0u8; len];
    let mut times: Vec<Duration> = (0..=samples)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t.elapsed()
        })
        .skip(1)
        .collect();
    median(&mut times)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let sizes = Sizes::of(opts);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<i32> = if cores > 1 {
        vec![1, i32::try_from(cores)?]
    } else {
        vec![1]
    };
    if opts.quick {
        println!(
            "{SUITE}: --quick: {} fault-free steps, kills every {:?} for about {} kills, faults on {:?} only",
            sizes.dp_steps, sizes.kill_every, sizes.kills, sizes.fault_models
        );
    }
    let cluster = JobCluster::local(JobCluster::runtime_config()).await?;
    for spec in specs() {
        model(&cluster, &spec, &sizes, &threads, report).await?;
    }
    Ok(())
}

async fn model(
    cluster: &JobCluster,
    spec: &JobSpec,
    sizes: &Sizes,
    threads: &[i32],
    report: &mut Report,
) -> anyhow::Result<()> {
    let cores = threads.iter().copied().max().unwrap_or(1);
    let name = spec.model.name();
    // Fault-free: the one-process baseline before and after the job.
    let mut local: Vec<Local> = threads.iter().map(|t| Local::new(*t)).collect();
    local_round(spec, threads, sizes.local_steps, &mut local).await?;
    let free = job_run(
        cluster,
        spec,
        sizes.dp_steps + WARMUP_STEPS as u64 + 1,
        None,
        0,
    )
    .await?;
    local_round(spec, threads, sizes.local_steps, &mut local).await?;
    let mut intervals = free.intervals();
    let step = median(&mut intervals);
    let (best_threads, best) = local
        .iter_mut()
        .map(|l| (l.threads, median(&mut l.times)))
        .min_by_key(|(_, d)| *d)
        .ok_or_else(|| anyhow::anyhow!("no baseline"))?;
    for l in &mut local {
        println!(
            "{SUITE}: {name}: one process with {} thread(s): {:.1} ms a step, {:.1} ms of CPU (n={})",
            l.threads,
            ms(median(&mut l.times)),
            l.cpu * 1e3 / l.times.len().max(1) as f64,
            l.times.len()
        );
    }
    println!(
        "{SUITE}: {name}: the {WORLD}-proc job: {:.1} ms a step, {:.1} ms of CPU over its procs (n={})",
        ms(step),
        free.cpu.0 * 1e3 / free.cpu.1.max(1) as f64,
        free.cpu.1
    );
    let work_spec = spec.clone();
    let samples = sizes.local_steps;
    let (grads, update) =
        tokio::task::spawn_blocking(move || rank_work(&work_spec, samples)).await??;
    println!(
        "{SUITE}: {name}: a rank's own work: gradients {:.1} ms + update {:.1} ms; {WORLD} ranks on {cores} cores take at least {:.1} ms a step",
        ms(grads),
        ms(update),
        ms((grads + update) * WORLD) / cores as f64
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("dp_step_{name}"),
            1.0 / step.as_secs_f64(),
            "steps/s",
        )
        .samples(intervals.len())
        .against(
            &format!("one_proc_{best_threads}_threads"),
            1.0 / best.as_secs_f64(),
            "steps/s",
        ),
    );

    let h = heals(cluster, spec, sizes.heals).await?;
    let (len, samples) = (usize::try_from(h.bytes)?, sizes.heals.max(5));
    // Off the runtime, as the tensor bench's baseline.
    let copy = tokio::task::spawn_blocking(move || memcpy(len, samples)).await?;
    let (mut total, mut expose) = (h.total, h.expose);
    let heal = median(&mut total);
    report.push(
        Figure::new(SUITE, &format!("heal_{name}"), ms(heal), "ms")
            .samples(total.len())
            .against(
                &format!("memcpy_{:.1}MB", h.bytes as f64 / 1e6),
                ms(copy),
                "ms",
            ),
    );
    println!(
        "{SUITE}: heal_{name}: {:.1} MB; expose {:.1} ms, read and load {:.1} ms (medians)",
        h.bytes as f64 / 1e6,
        ms(median(&mut expose)),
        ms(heal.saturating_sub(median(&mut expose)))
    );

    if !sizes.fault_models.contains(&name) {
        return Ok(());
    }
    // A run sized for `kills` kills at the fault-free rate, faults ending
    // `tail` before its end; killed procs respawned, then taken by a warm
    // spare.
    let every = sizes.kill_every;
    let per_step = step.max(Duration::from_millis(1)).as_secs_f64();
    let tail = (sizes.tail.as_secs_f64() / per_step).ceil() as u64;
    let steps =
        ((f64::from(sizes.kills) * every.as_secs_f64()) / per_step).ceil() as u64 + 2 * tail;
    for spares in [0, 1] {
        let plan = FaultPlan {
            every: FaultSpacing::Time(every),
            kinds: vec![FaultKind::Kill],
            pause: Duration::ZERO,
            seed: 7,
            until_step: steps - tail,
        };
        let faulty = job_run(cluster, spec, steps, Some(plan), spares).await?;
        let tag = match spares {
            0 => format!("kill{}s", every.as_secs()),
            _ => format!("kill{}s_spare", every.as_secs()),
        };
        kill_figures(report, &faulty, &free, step, &tag, name);
    }
    Ok(())
}

/// The figures of a run under kills (`faulty`) against the fault-free
/// run's, and a line on where a recovery's time goes.
fn kill_figures(
    report: &mut Report,
    faulty: &Run,
    free: &Run,
    step: Duration,
    tag: &str,
    name: &str,
) {
    let r = &faulty.report;
    let kills: u32 = r
        .faults
        .iter()
        .filter(|(k, _)| *k == FaultKind::Kill)
        .map(|(_, n)| n)
        .sum();
    report.push(
        Figure::new(
            SUITE,
            &format!("goodput_{tag}_{name}"),
            faulty.goodput(),
            "useful/wall",
        )
        .samples(kills as usize)
        .against("fault_free", free.goodput(), "useful/wall"),
    );
    let mut recovery = r.recovery.clone();
    recovery.sort_unstable();
    for p in [50.0, 99.0] {
        report.push(
            Figure::new(
                SUITE,
                &format!("{tag}_to_commit_p{p}_{name}"),
                ms(percentile(&recovery, p)),
                "ms",
            )
            .samples(recovery.len())
            .against("fault_free_step", ms(step), "ms"),
        );
    }
    let mut detection = r.detection.clone();
    detection.sort_unstable();
    report.push(
        Figure::new(
            SUITE,
            &format!("{tag}_detect_p50_{name}"),
            ms(percentile(&detection, 50.0)),
            "ms",
        )
        .samples(detection.len()),
    );
    let mut retries = faulty.retries();
    let mut heal_calls: Vec<Duration> = r.heals.iter().map(|(_, d)| *d).collect();
    println!(
        "{SUITE}: {tag}_{name}: {} steps, {} failed and redone, {} recoveries, {} by warm spares; medians: kill to commit {:.0} ms, detection {:.0} ms, heal calls {:.0} ms, retried step (recovered to commit) {:.0} ms",
        r.steps,
        r.failed_steps,
        faulty.recovered.len(),
        r.spares_taken,
        ms(percentile(&recovery, 50.0)),
        ms(percentile(&detection, 50.0)),
        ms(median(&mut heal_calls)),
        ms(median(&mut retries)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_the_parent_and_the_cpu_seconds() {
        // The command name may hold spaces and parentheses.
        let line = "4242 (regent (x) y) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 5 0";
        assert_eq!(stat_cpu(line), Some((17, 3.25)));
        assert_eq!(stat_cpu("4242 (regent) S"), None);
        assert_eq!(stat_cpu("no parentheses"), None);
        let me = std::fs::read_to_string("/proc/self/stat").unwrap();
        let (ppid, cpu) = stat_cpu(&me).unwrap();
        assert_eq!(ppid, std::os::unix::process::parent_id());
        assert!(cpu >= 0.0);
    }
}
