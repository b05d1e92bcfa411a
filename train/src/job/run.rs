//! The controller of a training job: it starts a mesh of trainers (one per
//! proc), resumes from the run directory's newest checkpoint, and drives
//! the steps. Each step is computed and all-reduced by every rank, then
//! committed only if every rank computed it; otherwise nothing is applied,
//! the mesh's supervision replaces what failed, the laggards heal from a
//! live peer (or, after a gang restart, everyone restores the checkpoint),
//! and the step is redone. Faults can be injected on a seeded schedule.
//!
//! Because the data of a step is a pure function of (seed, step, rank) and
//! the all-reduce sums in rank order, a run with faults ends with the same
//! weights as one without, bit for bit (`docs/semantics.md` §9).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use regent_mesh::alloc::{Allocator, ProcSignal};
use regent_mesh::{
    ActorMesh, Decision, MeshPolicy, MeshStatus, ProcMesh, Rank, Runtime, RuntimeConfig, Selection,
    Shape, SpawnOptions,
};

use super::spec::JobSpec;
use super::store;
use super::trainer::{Trainer, TrainerArgs, TrainerMsg, TrainerReply};
use crate::{Error, TrainState};

/// A fault the job injects into itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL a proc.
    Kill,
    /// SIGSTOP a proc, SIGCONT it after a while.
    Pause,
    /// Cut a proc off from everyone for a while (the cluster must be able
    /// to: [`JobCluster::isolate`]).
    Partition,
}

impl FaultKind {
    /// Its name in `--chaos` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Pause => "pause",
            Self::Partition => "partition",
        }
    }
}

/// Cuts a proc off from everyone (`true`) or heals it (`false`).
pub type Isolate = Arc<dyn Fn(&regent_net::ProcId, bool) + Send + Sync>;

/// Where a job runs: a controller, the allocator of its procs, and (for
/// partitions) a way to cut procs off.
#[derive(Clone)]
pub struct JobCluster {
    /// The controller.
    pub runtime: Runtime,
    /// Starts and signals the procs.
    pub allocator: Arc<dyn Allocator>,
    /// Cuts a proc off or heals it, where the cluster can (chaos proxies).
    pub isolate: Option<Isolate>,
}

impl JobCluster {
    /// A controller with `config` and procs of this binary on this machine.
    pub async fn local(config: RuntimeConfig) -> Result<Self, Error> {
        let runtime = Runtime::start(config).await?;
        let allocator = runtime.local_allocator()?;
        Ok(Self {
            runtime,
            allocator,
            isolate: None,
        })
    }
}

/// Faults on a seeded schedule: one of `kinds` every `every`, on a proc
/// drawn from the seed.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    /// Time between faults.
    pub every: Duration,
    /// The kinds, taken in turn.
    pub kinds: Vec<FaultKind>,
    /// How long a pause lasts.
    pub pause: Duration,
    /// Draws the procs.
    pub seed: u64,
    /// No fault after this many committed steps (so that a run ends).
    pub until_step: u64,
}

/// How a job runs.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// The job.
    pub spec: JobSpec,
    /// Steps to reach.
    pub steps: u64,
    /// A checkpoint every this many steps (0: never).
    pub checkpoint_every: u64,
    /// Where checkpoints live; a job started again with the same one
    /// resumes from its newest checkpoint.
    pub run_dir: PathBuf,
    /// What a failure does: restart the failed member (heal from a live
    /// peer) or the whole mesh (resume from the checkpoint).
    pub on_failure: Decision,
    /// A step that takes longer fails; its hung ranks are killed and
    /// replaced.
    pub step_timeout: Duration,
    /// libtorch intra-op threads per member.
    pub threads: i32,
    /// Faults to inject.
    pub faults: Option<FaultPlan>,
}

impl JobConfig {
    /// A job of `steps` steps of `spec` with defaults: no checkpoints, restart
    /// the failed member, a 30 s step deadline, one thread per member.
    pub fn new(spec: JobSpec, steps: u64, run_dir: PathBuf) -> Self {
        Self {
            spec,
            steps,
            checkpoint_every: 0,
            run_dir,
            on_failure: Decision::RestartMember,
            step_timeout: Duration::from_secs(30),
            threads: 1,
            faults: None,
        }
    }
}

/// What a job reports while it runs.
#[derive(Debug, Clone)]
pub enum JobEvent {
    /// The mesh is up at this step (resumed from a checkpoint if above 0).
    Started {
        /// The step.
        step: u64,
        /// Parameters of the model.
        parameters: usize,
    },
    /// A step was committed.
    Step {
        /// The step count now.
        step: u64,
        /// The global mean loss of the step.
        loss: f64,
        /// Its duration.
        time: Duration,
        /// The mesh's generation.
        generation: u64,
    },
    /// The mesh's supervision saw a failure.
    Failure(String),
    /// A step failed and was recovered from.
    Recovered {
        /// The step the job continues at.
        step: u64,
        /// How (healed ranks, or restored from a checkpoint).
        how: String,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Its step.
        step: u64,
        /// Its size.
        bytes: u64,
    },
}

/// What a finished job reports.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Steps committed in all (the last is the job's final step).
    pub steps: u64,
    /// The step the job started at (a resume starts above 0).
    pub start_step: u64,
    /// Faults injected, by kind.
    pub faults: Vec<(FaultKind, u32)>,
    /// Failures the supervision saw.
    pub failures: u32,
    /// From each injected fault to the first failure seen after it.
    pub detection: Vec<Duration>,
    /// From each injected fault to the next committed step.
    pub recovery: Vec<Duration>,
    /// Steps done again (after a restore from a checkpoint).
    pub replayed: u64,
    /// Steps that failed and were redone.
    pub failed_steps: u64,
    /// Heals: bytes and durations.
    pub heals: Vec<(u64, Duration)>,
    /// Checkpoints: bytes and durations.
    pub checkpoints: Vec<(u64, Duration)>,
    /// Restores from a checkpoint.
    pub restores: u32,
    /// Time in committed steps (first-time ones).
    pub useful: Duration,
    /// The whole run.
    pub wall: Duration,
    /// The loss of the last step.
    pub final_loss: f64,
    /// Losses of every committed step, by step.
    pub losses: Vec<(u64, f64)>,
    /// Where rank 0 wrote the final state.
    pub final_state: PathBuf,
    /// The mesh's final generation.
    pub generation: u64,
}

impl Report {
    /// Useful step time over wall time.
    pub fn goodput(&self) -> f64 {
        if self.wall.is_zero() {
            return 0.0;
        }
        self.useful.as_secs_f64() / self.wall.as_secs_f64()
    }

    /// The final state (read from the run directory).
    pub fn state(&self) -> Result<TrainState, Error> {
        store::load(&self.final_state)
    }
}

/// Percentile `p` (0..=100) of `samples`, nearest-rank.
pub fn percentile(samples: &[Duration], p: f64) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort();
    let i = ((p / 100.0) * (s.len() as f64 - 1.0)).round() as usize;
    Some(s[i.min(s.len() - 1)])
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Option<Duration>| {
            d.map_or("-".into(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
        };
        let stats = |v: &[Duration]| {
            format!(
                "p50 {}, p99 {}, max {} (n={})",
                ms(percentile(v, 50.0)),
                ms(percentile(v, 99.0)),
                ms(v.iter().max().copied()),
                v.len()
            )
        };
        writeln!(f, "training report")?;
        writeln!(
            f,
            "  steps: {} committed (from step {} to {}), {} failed and redone, {} replayed after restores",
            self.steps - self.start_step,
            self.start_step,
            self.steps,
            self.failed_steps,
            self.replayed
        )?;
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{} {n}", k.name()))
            .collect();
        writeln!(
            f,
            "  faults: {} injected ({}), {} failures seen by the supervision, final generation {}",
            self.faults.iter().map(|(_, n)| n).sum::<u32>(),
            if faults.is_empty() {
                "none".into()
            } else {
                faults.join(", ")
            },
            self.failures,
            self.generation
        )?;
        writeln!(
            f,
            "  detection (fault to failure seen):   {}",
            stats(&self.detection)
        )?;
        writeln!(
            f,
            "  recovery (fault to next committed step): {}",
            stats(&self.recovery)
        )?;
        let sum = |v: &[(u64, Duration)]| {
            let bytes: u64 = v.iter().map(|(b, _)| b).sum();
            let time: Duration = v.iter().map(|(_, d)| *d).sum();
            (v.len(), bytes, time)
        };
        let (n, b, t) = sum(&self.heals);
        writeln!(
            f,
            "  heals: {n} ({:.1} MB in {:.0} ms); restores from a checkpoint: {}",
            b as f64 / 1e6,
            t.as_secs_f64() * 1e3,
            self.restores
        )?;
        let (n, b, t) = sum(&self.checkpoints);
        writeln!(
            f,
            "  checkpoints: {n} ({:.1} MB each, {:.0} ms in all)",
            if n == 0 {
                0.0
            } else {
                b as f64 / n as f64 / 1e6
            },
            t.as_secs_f64() * 1e3
        )?;
        writeln!(
            f,
            "  goodput: {:.3} (useful step time {:.1} s of {:.1} s)",
            self.goodput(),
            self.useful.as_secs_f64(),
            self.wall.as_secs_f64()
        )?;
        write!(f, "  final loss: {:.4}", self.final_loss)
    }
}

/// Shared records of the fault injector and the failure watcher.
#[derive(Default)]
struct Log {
    faults: Vec<(Instant, FaultKind)>,
    failures: Vec<Instant>,
}

fn answers(vm: &regent_mesh::ValueMesh<TrainerReply>) -> Vec<&TrainerReply> {
    vm.values().iter().map(|(_, r)| r).collect()
}

/// Runs a job on `cluster` to its last step; `events` hears of its
/// progress.
pub async fn run_job(
    config: JobConfig,
    cluster: JobCluster,
    mut events: impl FnMut(JobEvent),
) -> Result<Report, Error> {
    let t0 = Instant::now();
    let world = config.spec.world;
    let alloc = cluster.allocator.clone();
    let procs = cluster
        .runtime
        .spawn_procs(
            alloc,
            Shape::new([("procs", world as usize)]).map_err(regent_mesh::MeshError::from)?,
        )
        .await?;
    let args = TrainerArgs {
        spec: config.spec.clone(),
        run_dir: config.run_dir.clone(),
        threads: config.threads,
        collective_timeout_ms: u64::try_from(config.step_timeout.as_millis()).unwrap_or(u64::MAX),
    };
    let policy = MeshPolicy::new(config.on_failure).intensity(1000, Duration::from_secs(60));
    let mesh: ActorMesh<Trainer> = procs
        .spawn_with("trainers", 1, &args, SpawnOptions::new().policy(policy))
        .await?;
    let log = Arc::new(Mutex::new(Log::default()));
    let mut report = Report::default();
    let result = drive(
        &config,
        &cluster,
        &mesh,
        &procs,
        &log,
        &mut report,
        &mut events,
    )
    .await;
    report.wall = t0.elapsed();
    report.generation = mesh.generation().0;
    let _ = mesh.stop().await;
    let _ = procs.stop(Duration::from_secs(2)).await;
    result.map(|()| report)
}

async fn drive(
    config: &JobConfig,
    cluster: &JobCluster,
    mesh: &ActorMesh<Trainer>,
    procs: &ProcMesh,
    log: &Arc<Mutex<Log>>,
    report: &mut Report,
    events: &mut impl FnMut(JobEvent),
) -> Result<(), Error> {
    let all = Selection::All;
    // Resume from the newest checkpoint, or start at the initial state.
    let mut committed = restore(mesh).await?;
    report.start_step = committed;
    let parameters = config.spec.build()?.parameters();
    events(JobEvent::Started {
        step: committed,
        parameters,
    });
    // The failures the supervision sees.
    let watcher = {
        let log = log.clone();
        let mut failures = mesh.failures();
        tokio::spawn(async move {
            while let Ok(f) = failures.recv().await {
                let _ = &f;
                log.lock().expect("log lock").failures.push(Instant::now());
            }
        })
    };
    let committed_now = Arc::new(std::sync::atomic::AtomicU64::new(committed));
    let injector = config.faults.clone().map(|plan| {
        if plan.kinds.contains(&FaultKind::Partition) && cluster.isolate.is_none() {
            tracing::warn!("this cluster cannot cut procs off: partitions are left out");
        }
        tokio::spawn(inject(
            plan,
            procs.allocator().clone(),
            cluster.isolate.clone(),
            mesh.clone(),
            log.clone(),
            committed_now.clone(),
        ))
    });
    let mut failures_seen = 0;
    let mut best = committed;
    let mut pending_faults: Vec<Instant> = Vec::new();
    let mut seen_faults = 0;
    let mut checkpoint_due = false;
    while committed < config.steps {
        // Faults injected since the last look wait for the next commit.
        {
            let l = log.lock().expect("log lock");
            pending_faults.extend(l.faults[seen_faults..].iter().map(|(t, _)| *t));
            seen_faults = l.faults.len();
            for f in &l.failures[failures_seen..] {
                events(JobEvent::Failure(format!(
                    "failure at +{:.2}s",
                    f.duration_since(l.failures[0]).as_secs_f64()
                )));
            }
            failures_seen = l.failures.len();
        }
        let g = mesh.generation();
        let t = Instant::now();
        let vm = mesh
            .call_within(
                &all,
                &TrainerMsg::Compute { step: committed },
                config.step_timeout,
            )
            .await?;
        let computed = vm.is_complete()
            && answers(&vm)
                .iter()
                .all(|r| matches!(r, TrainerReply::Computed { step, .. } if *step == committed));
        let loss: f64 = answers(&vm)
            .iter()
            .map(|r| match r {
                TrainerReply::Computed { loss, .. } => *loss,
                _ => 0.0,
            })
            .sum();
        if computed && loss.is_finite() {
            // Every rank has the same mean: every rank applies it.
            let delivered = mesh
                .cast(&all, &TrainerMsg::Commit { step: committed })
                .await?;
            committed += 1;
            committed_now.store(committed, std::sync::atomic::Ordering::Relaxed);
            let time = t.elapsed();
            if committed > best {
                report.useful += time;
                best = committed;
            }
            report.losses.push((committed, loss));
            report.final_loss = loss;
            events(JobEvent::Step {
                step: committed,
                loss,
                time,
                generation: g.0,
            });
            let now = Instant::now();
            report
                .recovery
                .extend(pending_faults.drain(..).map(|f| now.duration_since(f)));
            if !delivered.is_complete() {
                recover(config, mesh, procs, g, committed, report, events).await?;
                continue;
            }
            if config.checkpoint_every > 0 && committed % config.checkpoint_every == 0 {
                checkpoint_due = true;
            }
            if checkpoint_due {
                match mesh.call_one(Rank(0), &TrainerMsg::Checkpoint).await {
                    Ok(TrainerReply::Checkpointed { step, bytes, ms }) => {
                        checkpoint_due = false;
                        report
                            .checkpoints
                            .push((bytes, Duration::from_secs_f64(ms / 1e3)));
                        events(JobEvent::Checkpoint { step, bytes });
                    }
                    Ok(other) => {
                        return Err(Error::Job(format!(
                            "unexpected answer to a checkpoint: {other:?}"
                        )));
                    }
                    // Rank 0 failed meanwhile: recover, and write it after.
                    Err(regent_mesh::MeshError::Members(_)) => {
                        committed =
                            recover(config, mesh, procs, g, committed, report, events).await?;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        } else {
            report.failed_steps += 1;
            // Ranks that did not answer in time while their procs still run
            // are hung: kill them, and the supervision replaces them.
            if mesh.generation() == g && matches!(mesh.status(), MeshStatus::Running) {
                let hung: Vec<Rank> = vm
                    .failed()
                    .iter()
                    .filter(|(_, e)| matches!(e, regent_mesh::MemberError::Timeout))
                    .map(|(r, _)| *r)
                    .collect();
                for r in hung {
                    if let Some(p) = mesh.procs().get(r.0 as usize) {
                        tracing::warn!(rank = r.0, proc = %p.proc, "a hung rank is killed");
                        let _ = procs.allocator().signal(&p.proc, ProcSignal::Kill).await;
                    }
                }
            }
            let before = committed;
            committed = recover(config, mesh, procs, g, committed, report, events).await?;
            if committed < before {
                report.replayed += before - committed;
            }
            committed_now.store(committed, std::sync::atomic::Ordering::Relaxed);
        }
    }
    if let Some(i) = injector {
        i.abort();
    }
    watcher.abort();
    report.steps = committed;
    {
        let l = log.lock().expect("log lock");
        let mut counts: std::collections::BTreeMap<FaultKind, u32> = Default::default();
        for (t, k) in &l.faults {
            *counts.entry(*k).or_default() += 1;
            if let Some(seen) = l.failures.iter().find(|f| *f >= t) {
                report.detection.push(seen.duration_since(*t));
            }
        }
        report.faults = counts.into_iter().collect();
        report.failures = l.failures.len() as u32;
    }
    match mesh.call_one(Rank(0), &TrainerMsg::Final).await? {
        TrainerReply::Final { path, .. } => report.final_state = path,
        other => {
            return Err(Error::Job(format!(
                "unexpected answer to a state request: {other:?}"
            )));
        }
    }
    Ok(())
}

/// Every member takes the newest checkpoint (or the initial state); the
/// step they are at.
async fn restore(mesh: &ActorMesh<Trainer>) -> Result<u64, Error> {
    let vm = mesh.call(&Selection::All, &TrainerMsg::Restore).await?;
    let steps: Vec<u64> = vm
        .into_result()
        .map_err(regent_mesh::MeshError::from)?
        .into_iter()
        .map(|(_, r)| match r {
            TrainerReply::Step(s) => Ok(s),
            other => Err(Error::Job(format!(
                "unexpected answer to a restore: {other:?}"
            ))),
        })
        .collect::<Result<_, _>>()?;
    match steps.first() {
        Some(&s) if steps.iter().all(|&x| x == s) => Ok(s),
        _ => Err(Error::Job(format!(
            "members restored different steps: {steps:?}"
        ))),
    }
}

/// After a failed step: waits for the mesh to run again (in a newer
/// generation when members were lost), brings every member to the
/// committed step — from a live peer that has it, or from the newest
/// checkpoint when none has — and returns the step to go on from.
async fn recover(
    config: &JobConfig,
    mesh: &ActorMesh<Trainer>,
    _procs: &ProcMesh,
    g: regent_net::Generation,
    committed: u64,
    report: &mut Report,
    events: &mut impl FnMut(JobEvent),
) -> Result<u64, Error> {
    let deadline = Instant::now() + config.step_timeout.max(Duration::from_secs(60)) * 2;
    loop {
        if Instant::now() > deadline {
            return Err(Error::Job("the mesh did not recover in time".into()));
        }
        let status = mesh
            .wait_status(Duration::from_secs(30), |s| {
                matches!(s, MeshStatus::Running) || s.is_done()
            })
            .await?;
        if status.is_done() {
            return Err(Error::Job(format!("the mesh stopped: {status:?}")));
        }
        // A step may fail without any member lost (a collective's own
        // timeout): then the generation stays; give a restart a moment to
        // begin before taking stock.
        if mesh.generation() == g {
            let _ = mesh
                .wait_status(Duration::from_millis(1500), |s| {
                    !matches!(s, MeshStatus::Running)
                })
                .await;
            if !matches!(mesh.status(), MeshStatus::Running) {
                continue;
            }
        }
        let vm = match mesh.call(&Selection::All, &TrainerMsg::Status).await {
            Ok(vm) => vm,
            Err(regent_mesh::MeshError::Stopped(m)) => {
                return Err(Error::Job(format!("mesh {m} stopped")));
            }
            Err(e) => return Err(e.into()),
        };
        if !vm.is_complete() {
            // Someone else failed meanwhile: take stock once it is replaced.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let mut at = Vec::new();
        let mut behind = Vec::new();
        for (rank, reply) in vm.values() {
            match reply {
                TrainerReply::Status {
                    step, fresh: false, ..
                } if *step == committed => at.push(*rank),
                _ => behind.push(*rank),
            }
        }
        let how;
        let step;
        if at.is_empty() {
            // Nobody holds the committed state: the newest checkpoint.
            step = match restore(mesh).await {
                Ok(step) => step,
                Err(Error::Mesh(regent_mesh::MeshError::Members(_))) => continue,
                Err(e) => return Err(e),
            };
            report.restores += 1;
            how = format!("restored from the checkpoint at step {step}");
        } else {
            if !behind.is_empty() {
                let source = at[0];
                let (buffer, len) = match mesh.call_one(source, &TrainerMsg::Expose).await {
                    Ok(TrainerReply::Exposed { buffer, len, .. }) => (buffer, len),
                    Ok(other) => {
                        return Err(Error::Job(format!(
                            "unexpected answer to expose: {other:?}"
                        )));
                    }
                    Err(regent_mesh::MeshError::Members(_)) => continue, // the source failed
                    Err(e) => return Err(e.into()),
                };
                let t = Instant::now();
                let heal = TrainerMsg::Heal {
                    from: buffer.clone(),
                    len,
                };
                let heals = behind.iter().map(|r| mesh.call_one(*r, &heal));
                let results = futures::future::join_all(heals).await;
                if results.iter().any(Result::is_err) {
                    continue; // a healer or the source failed: take stock again
                }
                report.heals.push((len * behind.len() as u64, t.elapsed()));
            }
            let d = mesh.cast(&Selection::All, &TrainerMsg::Abort).await?;
            // (An incomplete abort: someone failed meanwhile; take stock again.)
            if !d.is_complete() {
                continue;
            }
            step = committed;
            how = format!(
                "ranks {:?} healed from rank {}",
                behind.iter().map(|r| r.0).collect::<Vec<_>>(),
                at[0].0
            );
        }
        events(JobEvent::Recovered { step, how });
        return Ok(step);
    }
}

/// Injects the plan's faults until its last step.
async fn inject(
    plan: FaultPlan,
    allocator: Arc<dyn Allocator>,
    isolate: Option<Isolate>,
    mesh: ActorMesh<Trainer>,
    log: Arc<Mutex<Log>>,
    committed: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut rng = plan.seed | 1;
    let mut next = || {
        // xorshift64*
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut i = 0usize;
    loop {
        tokio::time::sleep(plan.every).await;
        if committed.load(std::sync::atomic::Ordering::Relaxed) >= plan.until_step {
            return;
        }
        let kind = plan.kinds[i % plan.kinds.len().max(1)];
        i += 1;
        if kind == FaultKind::Partition && isolate.is_none() {
            continue;
        }
        let procs = mesh.procs();
        if procs.is_empty() || !matches!(mesh.status(), MeshStatus::Running) {
            continue;
        }
        let p = (next() % procs.len() as u64) as usize;
        let proc = procs[p].proc.clone();
        log.lock()
            .expect("log lock")
            .faults
            .push((Instant::now(), kind));
        match kind {
            FaultKind::Kill => {
                let _ = allocator.signal(&proc, ProcSignal::Kill).await;
            }
            FaultKind::Pause => {
                let _ = allocator.signal(&proc, ProcSignal::Stop).await;
                tokio::time::sleep(plan.pause).await;
                let _ = allocator.signal(&proc, ProcSignal::Cont).await;
            }
            FaultKind::Partition => {
                if let Some(isolate) = &isolate {
                    isolate(&proc, true);
                    tokio::time::sleep(plan.pause).await;
                    isolate(&proc, false);
                }
            }
        }
    }
}

/// The fault-free single-process reference of a job: `steps` steps of the
/// same replicas and world, summed in rank order; its final state.
pub fn reference(spec: &JobSpec, steps: u64, threads: i32) -> Result<TrainState, Error> {
    tch::set_num_threads(threads.max(1));
    let mut replica = spec.build()?;
    let mut reference = crate::Reference::new();
    for _ in 0..steps {
        replica.reference_step(&mut reference, spec.world as usize)?;
    }
    replica.state()
}
