//! The controller of a training job: it starts a mesh of trainers (one per
//! proc), resumes from the run directory's newest checkpoint, and drives
//! the steps. Each step is computed and all-reduced by every rank, then
//! committed only if every rank computed it; otherwise nothing is applied,
//! the mesh's supervision replaces what failed, the laggards heal from a
//! live peer (or, after a gang restart, everyone restores the checkpoint),
//! and the step is redone. A step whose loss or mean gradient is not finite
//! is skipped by every rank or undone by restoring the last checkpoint
//! ([`NanPolicy`]). Faults can be injected on a seeded schedule.
//!
//! Because the data of a step is a pure function of (seed, step, rank) and
//! the all-reduce sums in rank order, a run with faults ends with the same
//! weights as one without, bit for bit (`docs/semantics.md` §9).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use regent_mesh::alloc::{Allocator, ProcSignal};
use regent_mesh::{
    ActorMesh, Decision, FailureCause, MeshPolicy, MeshStatus, ProcMesh, Rank, Runtime,
    RuntimeConfig, Selection, Shape, SpawnOptions,
};
use regent_net::ProcId;

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
    /// Put a NaN into one rank's gradient of the next step (a step never
    /// poisoned before: a transient fault hits a step once).
    Nan,
}

impl FaultKind {
    /// Its name in `--chaos` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Pause => "pause",
            Self::Partition => "partition",
            Self::Nan => "nan",
        }
    }
}

/// What the job does with a step whose loss or mean gradient is not finite
/// (every rank sees the same mean, so every rank agrees on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NanPolicy {
    /// Every rank drops the step's update; the step counter (and with it
    /// the data, a function of the step) moves past the batch. The report
    /// lists the skipped steps; the reference skips them too.
    Skip,
    /// Every rank restores the last checkpoint (the last good state) and
    /// the steps since are replayed. The same step non-finite again after
    /// that is deterministic: the job fails ([`Error::NonFinite`]).
    Restore,
}

impl NanPolicy {
    /// Its name in `--on-nan` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::Restore => "restore",
        }
    }
}

/// Most steps [`JobConfig::nan_at`] may name.
pub const MAX_NAN_AT: usize = 1024;

/// The longest [`JobConfig::step_timeout`] and [`FaultPlan::pause`]: a
/// day, as the control plane's durations (deadlines are instants after
/// them, which must not overflow).
pub const MAX_JOB_DURATION: Duration = Duration::from_secs(24 * 3600);

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

/// The longest silence a job's control links allow (and the only one,
/// with the adaptive detector off).
pub const JOB_FAILURE_TIMEOUT: Duration = Duration::from_secs(3);

/// The shortest silence a job's control links allow with the adaptive
/// detector: about how long a paused or cut-off proc on a quiet link takes
/// to be found.
pub const JOB_FAILURE_TIMEOUT_MIN: Duration = Duration::from_millis(200);

/// How often a job's control links send heartbeats: often enough for the
/// adaptive detector to learn a link's jitter within a second, and to hold
/// a quiet link to [`JOB_FAILURE_TIMEOUT_MIN`].
pub const JOB_HEARTBEAT: Duration = Duration::from_millis(50);

impl JobCluster {
    /// The controller settings a job's cluster should use: the defaults
    /// with an owner lease of 5 s (the procs of a controller that died stop
    /// within it, so a controller started again on the same run directory
    /// has no leftover to race with; a shorter one ends procs that were
    /// only paused for a couple of seconds) and the adaptive failure
    /// detector ([`JOB_FAILURE_TIMEOUT_MIN`]; heartbeats every
    /// [`JOB_HEARTBEAT`]), up to a failure timeout of
    /// [`JOB_FAILURE_TIMEOUT`]: a paused or cut-off proc on a quiet link is
    /// found after about 200 ms, one whose heartbeats come late because
    /// the cores are loaded is given up to 3 s (a fixed 1 s is reached by
    /// healthy procs on loaded cores, each a false failure and a needless
    /// restart). Kills are seen at once by the allocator, and hung ranks
    /// whose procs still answer by the step deadline.
    pub fn runtime_config() -> RuntimeConfig {
        Self::runtime_config_detecting(Some(JOB_FAILURE_TIMEOUT_MIN))
    }

    /// [`JobCluster::runtime_config`] with the adaptive detector's
    /// minimum `min`, or without it (`None`: a fixed
    /// [`JOB_FAILURE_TIMEOUT`]).
    pub fn runtime_config_detecting(min: Option<Duration>) -> RuntimeConfig {
        let mut config = RuntimeConfig::default().owner_lease(Duration::from_secs(5));
        config.endpoint.failure_timeout = JOB_FAILURE_TIMEOUT;
        config.endpoint.heartbeat_interval = JOB_HEARTBEAT;
        config.endpoint.failure_timeout_min = min;
        config
    }

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

/// How far apart a plan's faults come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultSpacing {
    /// One fault every this long, wall-clock: how faults come in a real
    /// cluster, so how many land in a run depends on its speed.
    Time(Duration),
    /// One fault as the committed steps reach each multiple of this (at
    /// least 1) below the plan's `until_step`: the count of faults in a run
    /// is the same on any machine, which tests that count them want.
    Steps(u64),
}

/// Faults on a seeded schedule: one of `kinds` every `every`, on a proc
/// drawn from the seed.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    /// How far apart faults come.
    pub every: FaultSpacing,
    /// The kinds, taken in turn.
    pub kinds: Vec<FaultKind>,
    /// How long a pause (or a partition) lasts. At most
    /// [`MAX_JOB_DURATION`].
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
    /// replaced. At most [`MAX_JOB_DURATION`].
    pub step_timeout: Duration,
    /// libtorch intra-op threads per member.
    pub threads: i32,
    /// Faults to inject.
    pub faults: Option<FaultPlan>,
    /// What a step with a non-finite loss or mean gradient does.
    pub on_nan: NanPolicy,
    /// Most non-finite steps in a row the skip policy drops before the job
    /// fails (a diverged model would skip forever).
    pub max_consecutive_skips: u32,
    /// Fault injection: steps whose gradient on rank `step % world` is
    /// poisoned with a NaN every time they are computed (a bad batch: the
    /// same step fails again when it is replayed). At most [`MAX_NAN_AT`].
    pub nan_at: Vec<u64>,
    /// Warm spare procs kept for replacements (`ProcMesh::keep_spares`):
    /// a killed rank restarts in a waiting process instead of a new one.
    /// At most [`regent_mesh::MAX_SPARES`].
    pub spares: usize,
}

impl JobConfig {
    /// A job of `steps` steps of `spec` with defaults: no checkpoints, restart
    /// the failed member, a 30 s step deadline, one thread per member, skip
    /// non-finite steps (at most 16 in a row).
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
            on_nan: NanPolicy::Skip,
            max_consecutive_skips: 16,
            nan_at: Vec::new(),
            spares: 0,
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
    /// The mesh's supervision saw a failure (when, and the failure's text:
    /// a dead proc's last lines among it).
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
    /// A step's loss or mean gradient was not finite; the policy says what
    /// happened to it.
    NonFinite {
        /// The step.
        step: u64,
        /// The policy applied.
        policy: NanPolicy,
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
    /// From each injected fault to the first failure seen after it (by the
    /// supervision, the step deadline or the finiteness check) and before
    /// the next fault.
    pub detection: Vec<Duration>,
    /// Injected faults after which no failure was seen before the next
    /// one (a pause that ended before any deadline passed).
    pub undetected: u32,
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
    /// Restores from a checkpoint because no live member held the committed
    /// state (a gang restart).
    pub restores: u32,
    /// Steps found non-finite, one entry per time (a replayed step may
    /// appear again).
    pub nonfinite: Vec<u64>,
    /// Steps skipped by the skip policy (the reference skips them too).
    pub skipped: Vec<u64>,
    /// Restores from a checkpoint after a non-finite step (the restore
    /// policy).
    pub nan_restores: u32,
    /// Ranks the step deadline found hung (their procs were killed).
    pub hung: u32,
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
    /// Lost procs a warm spare replaced.
    pub spares_taken: u64,
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

/// Percentile `p` (0..=100) of `samples`, nearest-rank (see
/// [`nearest_rank`]).
pub fn percentile(samples: &[Duration], p: f64) -> Option<Duration> {
    let mut s = samples.to_vec();
    s.sort();
    nearest_rank(&s, p)
}

/// Percentile `p` (0..=100) of `sorted` (ascending), nearest-rank: the
/// smallest sample with at least `p`% of the samples at or below it (of an
/// even count, the median is the lower of the middle two); `None` when
/// empty. The training report and `regent bench` compute theirs with it.
pub fn nearest_rank<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
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
            "  detection (fault to failure seen):   {}; {} unseen",
            stats(&self.detection),
            self.undetected
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
            "  heals: {n} ({:.1} MB in {:.0} ms); restores from a checkpoint: {}; procs replaced by warm spares: {}",
            b as f64 / 1e6,
            t.as_secs_f64() * 1e3,
            self.restores,
            self.spares_taken
        )?;
        writeln!(
            f,
            "  hung ranks killed at the step deadline: {}; non-finite steps: {} (skipped {:?}, restores {})",
            self.hung,
            self.nonfinite.len(),
            self.skipped,
            self.nan_restores
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

/// Shared records of the fault injector, the failure watcher and the
/// controller's loop. Every time in it is taken under its lock, so the
/// records are in the order of their times.
#[derive(Default)]
struct Log {
    faults: Vec<(Instant, FaultKind)>,
    /// The faults not detected yet, in the order injected.
    undetected: Vec<Undetected>,
    /// Failures the supervision saw.
    failures: Vec<Instant>,
    /// What each of them was (`MeshFailure`'s text: a dead proc's last
    /// lines among it), in the same order.
    causes: Vec<String>,
    /// From each fault detected to the first failure seen after it that
    /// it explains (`Log::seen`), in the order of the detections.
    detections: Vec<Duration>,
    /// A rank to poison at the next step not poisoned before (a `nan`
    /// fault waiting for its step).
    poison: Option<u32>,
    /// Where each detection is observed as it happens
    /// (`regent_detection_seconds`).
    runtime: Option<regent_mesh::Runtime>,
}

/// A fault not detected yet.
#[derive(Clone, Debug)]
struct Undetected {
    /// Its index in [`Log::faults`].
    fault: usize,
    /// The proc it struck (none for a `nan` fault, which strikes a step's
    /// gradient).
    proc: Option<ProcId>,
    /// When it ends, if it does (a pause or a partition): nothing can
    /// detect it after that, and it stays unseen.
    ends: Option<Instant>,
}

/// A failure the controller sees, as [`Log::seen`] matches it with the
/// faults that explain it.
#[derive(Clone, Copy, Debug)]
enum Seen<'a> {
    /// A failure of this proc (it exited, its host or its link was lost,
    /// or the step deadline found its rank hung).
    Proc(&'a ProcId),
    /// A failure that names no proc (a member that failed to start, an
    /// escalation, reports the watcher missed).
    Unnamed,
    /// A non-finite step.
    NonFinite,
}

impl<'a> Seen<'a> {
    /// The proc a supervision failure names, if any.
    fn of(cause: &'a FailureCause) -> Self {
        match cause {
            FailureCause::ProcExited { proc, .. }
            | FailureCause::HostLost { proc, .. }
            | FailureCause::LinkFailed { proc, .. } => Seen::Proc(proc),
            FailureCause::Escalated(inner) => Seen::of(&inner.cause),
            _ => Seen::Unnamed,
        }
    }
}

impl Log {
    /// A fault of `kind` is injected now, on `proc` (none for `nan`),
    /// lasting `lasts` if it ends by itself (a pause, a partition).
    fn fault(&mut self, kind: FaultKind, proc: Option<ProcId>, lasts: Option<Duration>) {
        let now = Instant::now();
        self.undetected.push(Undetected {
            fault: self.faults.len(),
            proc,
            ends: lasts.map(|d| now + d),
        });
        self.faults.push((now, kind));
    }

    /// A failure is seen now: the detection of the faults still in effect
    /// and not yet detected that explain it: every one on the proc it
    /// names (a kill and a pause of one proc at once: its death explains
    /// both), the newest on any proc when it names none, the newest `nan`
    /// fault for a non-finite step. A pause or partition that ended before
    /// any failure explained it stays unseen (a later kill of its proc
    /// does not detect it). Faults injected together (a pause holds the
    /// injector, so the marks it passes fire at once when it ends) are
    /// each matched with their own failure, so none is counted unseen for
    /// another's.
    fn seen(&mut self, what: Seen<'_>) {
        let now = Instant::now();
        let explains = |u: &Undetected| {
            u.ends.is_none_or(|end| now <= end)
                && match (what, &u.proc) {
                    (Seen::Proc(p), Some(q)) => p == q,
                    (Seen::Unnamed, Some(_)) | (Seen::NonFinite, None) => true,
                    _ => false,
                }
        };
        let matched: Vec<usize> = match what {
            Seen::Proc(_) => (0..self.undetected.len())
                .filter(|&i| explains(&self.undetected[i]))
                .collect(),
            Seen::Unnamed | Seen::NonFinite => self
                .undetected
                .iter()
                .rposition(explains)
                .into_iter()
                .collect(),
        };
        for i in matched.into_iter().rev() {
            let u = self.undetected.remove(i);
            self.detected(u, what, now);
        }
    }

    fn detected(&mut self, u: Undetected, what: Seen<'_>, now: Instant) {
        let (at, kind) = self.faults[u.fault];
        let after = now.duration_since(at);
        tracing::info!(
            kind = kind.name(),
            proc = u.proc.as_ref().map(ProcId::as_str),
            ?what,
            after_ms = after.as_millis() as u64,
            "a fault is detected"
        );
        self.detections.push(after);
        if let Some(rt) = &self.runtime {
            rt.observe_detection(after);
        }
    }
}

fn answers(vm: &regent_mesh::ValueMesh<TrainerReply>) -> Vec<&TrainerReply> {
    vm.values().iter().map(|(_, r)| r).collect()
}

/// Holds a run directory's lock (`lock`, an advisory exclusive lock the
/// kernel drops when the process dies): two live controllers never drive
/// one run directory, and one started after a controller died gets it.
fn lock_run_dir(dir: &std::path::Path) -> Result<std::fs::File, Error> {
    let err = |message: String| Error::RunDir {
        path: dir.to_owned(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .map_err(|e| err(format!("cannot open its lock: {e}")))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(err(
            "another controller runs a job in this run directory".into(),
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(err(format!("cannot lock it: {e}"))),
    }
}

/// Runs a job on `cluster` to its last step; `events` hears of its
/// progress.
pub async fn run_job(
    config: JobConfig,
    cluster: JobCluster,
    mut events: impl FnMut(JobEvent),
) -> Result<Report, Error> {
    let t0 = Instant::now();
    check(&config)?;
    let _lock = lock_run_dir(&config.run_dir)?;
    let world = config.spec.world;
    let alloc = cluster.allocator.clone();
    let procs = cluster
        .runtime
        .spawn_procs(
            alloc,
            Shape::new([("procs", world as usize)]).map_err(regent_mesh::MeshError::from)?,
        )
        .await?;
    if config.spares > 0
        && let Err(e) = procs.keep_spares(config.spares).await
    {
        let _ = procs.stop(Duration::from_secs(2)).await;
        return Err(e.into());
    }
    // A collective gives up a quarter before the step deadline, so the
    // ranks waiting for a hung peer answer (a broken collective) and only
    // the hung rank is left without an answer when the deadline passes.
    let collective = config.step_timeout.saturating_sub(config.step_timeout / 4);
    let args = TrainerArgs {
        spec: config.spec.clone(),
        run_dir: config.run_dir.clone(),
        threads: config.threads,
        collective_timeout_ms: u64::try_from(collective.as_millis())
            .unwrap_or(u64::MAX)
            .max(1),
    };
    let policy = MeshPolicy::new(config.on_failure).intensity(1000, Duration::from_secs(60));
    let mesh: ActorMesh<Trainer> = match procs
        .spawn_with("trainers", 1, &args, SpawnOptions::new().policy(policy))
        .await
    {
        Ok(mesh) => mesh,
        Err(e) => {
            let _ = procs.stop(Duration::from_secs(2)).await;
            return Err(e.into());
        }
    };
    let log = Arc::new(Mutex::new(Log {
        runtime: Some(cluster.runtime.clone()),
        ..Log::default()
    }));
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
    report.spares_taken = procs.spares_taken();
    let _ = mesh.stop().await;
    let _ = procs.stop(Duration::from_secs(2)).await;
    result.map(|()| report)
}

/// Refuses a configuration the job cannot run: too many steps to poison
/// or spares, or a duration whose deadlines would overflow.
fn check(config: &JobConfig) -> Result<(), Error> {
    if config.nan_at.len() > MAX_NAN_AT {
        return Err(Error::Config(format!(
            "{} steps to poison: at most {MAX_NAN_AT}",
            config.nan_at.len()
        )));
    }
    if config.spares > regent_mesh::MAX_SPARES {
        return Err(Error::Config(format!(
            "{} warm spares: at most {}",
            config.spares,
            regent_mesh::MAX_SPARES
        )));
    }
    let pause = config.faults.as_ref().map(|f| ("fault pause", f.pause));
    for (what, d) in [("step timeout", config.step_timeout)]
        .into_iter()
        .chain(pause)
    {
        if d > MAX_JOB_DURATION {
            return Err(Error::Config(format!(
                "a {what} of {d:?}: at most {MAX_JOB_DURATION:?}"
            )));
        }
    }
    Ok(())
}

/// The rank a step's poison goes to, if any: a `nan_at` step every time,
/// else a waiting `nan` fault once, on a step never poisoned before.
fn poison_for(
    config: &JobConfig,
    log: &Mutex<Log>,
    poisoned: &mut std::collections::BTreeSet<u64>,
    step: u64,
) -> Option<u32> {
    let world = u64::from(config.spec.world.max(1));
    if config.nan_at.contains(&step) {
        // Invariant: the remainder of a division by a `u32` fits one.
        return Some(u32::try_from(step % world).expect("a remainder below a u32"));
    }
    if poisoned.contains(&step) {
        return None;
    }
    let rank = log.lock().expect("log lock").poison.take()?;
    poisoned.insert(step);
    Some(rank)
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
    // Resume from the newest checkpoint, or start at the initial state.
    let start = restore(mesh).await?;
    let mut committed = start.step;
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
            loop {
                match failures.recv().await {
                    Ok(failure) => {
                        let mut l = log.lock().expect("log lock");
                        let now = Instant::now();
                        l.failures.push(now);
                        l.causes.push(failure.to_string());
                        l.seen(Seen::of(&failure.cause));
                    }
                    // Missed ones still count (as one, seen now).
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        let mut l = log.lock().expect("log lock");
                        let now = Instant::now();
                        l.failures.push(now);
                        l.causes.push("failures missed (the watcher lagged)".into());
                        l.seen(Seen::Unnamed);
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        })
    };
    // The committed step count, watched by the fault injector.
    let committed_now = tokio::sync::watch::Sender::new(committed);
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
            committed_now.subscribe(),
        ))
    });
    let result = steps(
        config,
        mesh,
        procs,
        log,
        report,
        events,
        &mut committed,
        start.generation,
        &committed_now,
    )
    .await;
    if let Some(i) = injector {
        i.abort();
    }
    watcher.abort();
    report.steps = committed;
    {
        let l = log.lock().expect("log lock");
        let mut counts: std::collections::BTreeMap<FaultKind, u32> = Default::default();
        for (_, k) in &l.faults {
            *counts.entry(*k).or_default() += 1;
        }
        // Each fault's detection was recorded (and observed) when it
        // happened; a fault nothing saw (a pause that ended before any
        // deadline) is counted apart.
        report.detection = l.detections.clone();
        report.undetected = u32::try_from(l.faults.len() - l.detections.len()).unwrap_or(u32::MAX);
        report.faults = counts.into_iter().collect();
        report.failures = l.failures.len() as u32;
    }
    report.final_state = result?;
    Ok(())
}

/// The controller's loop: steps from `committed` to the job's last, whose
/// state rank 0 then saves (the path it answers). `synced` is the
/// generation in which every member last held the committed state: a
/// restart since brought in a new life that holds none yet, so no step,
/// checkpoint or final state is asked for before a recovery brings it to
/// the committed step (`docs/semantics.md` §9.9).
#[allow(clippy::too_many_arguments)]
async fn steps(
    config: &JobConfig,
    mesh: &ActorMesh<Trainer>,
    procs: &ProcMesh,
    log: &Arc<Mutex<Log>>,
    report: &mut Report,
    events: &mut impl FnMut(JobEvent),
    committed: &mut u64,
    mut synced: regent_net::Generation,
    committed_now: &tokio::sync::watch::Sender<u64>,
) -> Result<PathBuf, Error> {
    let all = Selection::All;
    let mut failures_seen = 0;
    let mut best = *committed;
    let mut pending_faults: Vec<Instant> = Vec::new();
    let mut seen_faults = 0;
    let mut checkpoint_due = false;
    let mut poisoned = std::collections::BTreeSet::new();
    let mut consecutive_skips = 0u32;
    // The non-finite step the restore policy last restored for, and the
    // checkpoint's step: the same step non-finite again is deterministic.
    let mut nan_restored: Option<(u64, u64)> = None;
    // The members' communicator: a new one (on channels of its own) after
    // every failed step.
    let mut epoch = 0u32;
    // Set when something asked of the members failed: a recovery (every
    // member brought to the committed step, or the newest checkpoint)
    // comes before anything more.
    let mut resync = false;
    // A checkpoint due at the last step is written too (after a recovery
    // when rank 0 failed while writing it), then the final state.
    loop {
        // A recovery comes first too after a restart since every member
        // last held the committed state (between two steps: while rank 0
        // wrote a checkpoint, say): its new lives hold none yet, and a step
        // cast to them would leave the others waiting out the collective's
        // timeout.
        if resync || mesh.generation() != synced {
            resync = false;
            let before = *committed;
            recover(config, mesh, &mut synced, committed, report, events).await?;
            // Whoever computed has dropped its communicator.
            epoch = epoch.wrapping_add(1);
            if *committed < before {
                // Restored from a checkpoint: its step needs none.
                checkpoint_due = false;
            }
            committed_now.send_replace(*committed);
            continue;
        }
        if *committed < config.steps {
            // Faults injected since the last look wait for the next commit.
            {
                let l = log.lock().expect("log lock");
                pending_faults.extend(l.faults[seen_faults..].iter().map(|(t, _)| *t));
                seen_faults = l.faults.len();
                for (f, cause) in l.failures[failures_seen..]
                    .iter()
                    .zip(&l.causes[failures_seen..])
                {
                    events(JobEvent::Failure(format!(
                        "failure at +{:.2}s: {cause}",
                        f.duration_since(l.failures[0]).as_secs_f64()
                    )));
                }
                failures_seen = l.failures.len();
            }
            let step = *committed;
            let g = synced;
            let t = Instant::now();
            let poison = poison_for(config, log, &mut poisoned, step);
            let vm = mesh
                .call_within(
                    &all,
                    &TrainerMsg::Compute {
                        step,
                        epoch,
                        generation: g,
                        poison,
                    },
                    config.step_timeout,
                )
                .await?;
            let computed = vm.is_complete()
                && answers(&vm)
                    .iter()
                    .all(|r| matches!(r, TrainerReply::Computed { step: s, .. } if *s == step));
            let loss: f64 = answers(&vm)
                .iter()
                .map(|r| match r {
                    TrainerReply::Computed { loss, .. } => *loss,
                    _ => 0.0,
                })
                .sum();
            let finite = loss.is_finite()
                && answers(&vm)
                    .iter()
                    .all(|r| matches!(r, TrainerReply::Computed { finite: true, .. }));
            if computed && !finite {
                report.nonfinite.push(step);
                log.lock().expect("log lock").seen(Seen::NonFinite);
                events(JobEvent::NonFinite {
                    step,
                    policy: config.on_nan,
                });
                match config.on_nan {
                    NanPolicy::Skip => {
                        consecutive_skips += 1;
                        if consecutive_skips > config.max_consecutive_skips {
                            return Err(Error::Job(format!(
                                "steps {}..={step} were all non-finite: more than {} skips in a row \
                                 (the model diverged)",
                                step + 1 - u64::from(consecutive_skips),
                                config.max_consecutive_skips
                            )));
                        }
                        let delivered = mesh.cast(&all, &TrainerMsg::Skip { step }).await?;
                        *committed += 1;
                        committed_now.send_replace(*committed);
                        report.skipped.push(step);
                        if *committed > best {
                            best = *committed;
                        }
                        if !delivered.is_complete() {
                            resync = true;
                            continue;
                        }
                        if config.checkpoint_every > 0
                            && committed.is_multiple_of(config.checkpoint_every)
                        {
                            checkpoint_due = true;
                        }
                    }
                    NanPolicy::Restore => {
                        if let Some((s, from)) = nan_restored
                            && s == step
                        {
                            return Err(Error::NonFinite {
                                step,
                                restored_from: from,
                            });
                        }
                        let at = restore_everyone(config, mesh).await?;
                        let restored = at.step;
                        synced = at.generation;
                        report.nan_restores += 1;
                        report.replayed += step.saturating_sub(restored);
                        nan_restored = Some((step, restored));
                        *committed = restored;
                        committed_now.send_replace(*committed);
                        events(JobEvent::Recovered {
                            step: restored,
                            how: format!(
                                "step {step} was not finite: restored the checkpoint at step {restored}"
                            ),
                        });
                        continue;
                    }
                }
            } else if computed {
                // Every rank has the same mean: every rank applies it. The
                // commit is not waited for: the next step's `Compute` (or a
                // checkpoint, or the final state) is ordered after it at
                // every member, and a rank that did not get it fails that
                // next request, which recovers as a failed step does.
                mesh.cast_nowait(&all, &TrainerMsg::Commit { step }).await?;
                *committed += 1;
                consecutive_skips = 0;
                if nan_restored.is_some_and(|(s, _)| s < *committed) {
                    nan_restored = None;
                }
                committed_now.send_replace(*committed);
                let time = t.elapsed();
                if *committed > best {
                    report.useful += time;
                    best = *committed;
                }
                report.losses.push((*committed, loss));
                report.final_loss = loss;
                events(JobEvent::Step {
                    step: *committed,
                    loss,
                    time,
                    generation: g.0,
                });
                let now = Instant::now();
                report
                    .recovery
                    .extend(pending_faults.drain(..).map(|f| now.duration_since(f)));
                if config.checkpoint_every > 0 && committed.is_multiple_of(config.checkpoint_every)
                {
                    checkpoint_due = true;
                }
            } else {
                report.failed_steps += 1;
                tracing::info!(
                    step,
                    failed = ?vm.failed(),
                    broken = ?answers(&vm)
                        .iter()
                        .filter_map(|r| match r {
                            TrainerReply::Broken(why) => Some(why.as_str()),
                            _ => None,
                        })
                        .collect::<Vec<_>>(),
                    took_ms = t.elapsed().as_millis() as u64,
                    "a step failed"
                );
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
                            report.hung += 1;
                            log.lock().expect("log lock").seen(Seen::Proc(&p.proc));
                            let _ = procs.allocator().signal(&p.proc, ProcSignal::Kill).await;
                        }
                    }
                }
                resync = true;
                continue;
            }
        }
        if checkpoint_due {
            let step = *committed;
            match ask_rank_0(mesh, synced, &TrainerMsg::Checkpoint { step }).await? {
                Some(TrainerReply::Checkpointed { step, bytes, ms }) => {
                    checkpoint_due = false;
                    report
                        .checkpoints
                        .push((bytes, Duration::from_secs_f64(ms / 1e3)));
                    events(JobEvent::Checkpoint { step, bytes });
                }
                Some(other) => {
                    return Err(Error::Job(format!(
                        "unexpected answer to a checkpoint: {other:?}"
                    )));
                }
                // Rank 0 failed meanwhile: recover, and write it after.
                None => {
                    resync = true;
                    continue;
                }
            }
        }
        if *committed >= config.steps && !checkpoint_due {
            let step = *committed;
            match ask_rank_0(mesh, synced, &TrainerMsg::Final { step }).await? {
                Some(TrainerReply::Final { path, .. }) => return Ok(path),
                Some(other) => {
                    return Err(Error::Job(format!(
                        "unexpected answer to a state request: {other:?}"
                    )));
                }
                None => resync = true,
            }
        }
    }
}

/// Asks rank 0 to write the committed state (a checkpoint, the final
/// state) while every member holds it: its answer, or `None` when a
/// recovery must come first: a restart since `synced`, rank 0 failed, or
/// it does not hold the committed step (a new life, which holds no state
/// yet, refuses and writes nothing).
async fn ask_rank_0(
    mesh: &ActorMesh<Trainer>,
    synced: regent_net::Generation,
    msg: &TrainerMsg,
) -> Result<Option<TrainerReply>, Error> {
    if mesh.generation() != synced {
        return Ok(None);
    }
    match mesh.call_one(Rank(0), msg).await {
        Ok(TrainerReply::Broken(why)) => {
            tracing::info!(%why, "rank 0 cannot write the committed state");
            Ok(None)
        }
        Ok(reply) => Ok(Some(reply)),
        Err(regent_mesh::MeshError::Members(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Waits (30 s at most) for the mesh to run; an error if it stopped.
async fn wait_running(mesh: &ActorMesh<Trainer>) -> Result<(), Error> {
    let status = mesh
        .wait_status(Duration::from_secs(30), |s| {
            matches!(s, MeshStatus::Running) || s.is_done()
        })
        .await?;
    if status.is_done() {
        return Err(Error::Job(format!("the mesh stopped: {status:?}")));
    }
    Ok(())
}

/// Every member takes the newest checkpoint, again after any member fails
/// meanwhile (a restore is idempotent); the step they are at.
async fn restore_everyone(config: &JobConfig, mesh: &ActorMesh<Trainer>) -> Result<Synced, Error> {
    let deadline = Instant::now() + config.step_timeout.max(Duration::from_secs(60)) * 2;
    loop {
        wait_running(mesh).await?;
        match restore(mesh).await {
            Err(Error::Mesh(regent_mesh::MeshError::Members(_))) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// Where every member stands after taking the same state: its step, and
/// the generation they took it in (read before they were asked, so that a
/// restart meanwhile, whose new life may have missed the request, shows
/// as a newer generation).
#[derive(Clone, Copy, Debug)]
struct Synced {
    step: u64,
    generation: regent_net::Generation,
}

async fn restore(mesh: &ActorMesh<Trainer>) -> Result<Synced, Error> {
    let generation = mesh.generation();
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
        Some(&step) if steps.iter().all(|&x| x == step) => Ok(Synced { step, generation }),
        _ => Err(Error::Job(format!(
            "members restored different steps: {steps:?}"
        ))),
    }
}

/// After a failed step or request, or a restart since every member last
/// held the committed state in generation `synced`: waits for the mesh to
/// run again (in a newer generation when members were lost), brings every
/// member to the `committed` step — from a live peer that has it, or from
/// the newest checkpoint when none has — and sets both to where they all
/// stand now.
async fn recover(
    config: &JobConfig,
    mesh: &ActorMesh<Trainer>,
    synced: &mut regent_net::Generation,
    committed: &mut u64,
    report: &mut Report,
    events: &mut impl FnMut(JobEvent),
) -> Result<(), Error> {
    let g = *synced;
    let started = Instant::now();
    let deadline = started + config.step_timeout.max(Duration::from_secs(60)) * 2;
    loop {
        if Instant::now() > deadline {
            return Err(Error::Job("the mesh did not recover in time".into()));
        }
        wait_running(mesh).await?;
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
        // Read before the members are asked: a restart after it (whose new
        // life this recovery may miss) shows as a newer generation, and the
        // controller recovers again before its next request.
        let generation = mesh.generation();
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
                } if *step == *committed => at.push(*rank),
                _ => behind.push(*rank),
            }
        }
        let how;
        let now;
        if at.is_empty() {
            // Nobody holds the committed state: the newest checkpoint.
            now = match restore(mesh).await {
                Ok(now) => now,
                Err(Error::Mesh(regent_mesh::MeshError::Members(_))) => continue,
                Err(e) => return Err(e),
            };
            report.restores += 1;
            how = format!("restored from the checkpoint at step {}", now.step);
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
            now = Synced {
                step: *committed,
                generation,
            };
            how = format!(
                "ranks {:?} healed from rank {}",
                behind.iter().map(|r| r.0).collect::<Vec<_>>(),
                at[0].0
            );
        }
        // Restored from a checkpoint: the steps since come again.
        report.replayed += committed.saturating_sub(now.step);
        tracing::info!(
            step = now.step,
            %how,
            took_ms = started.elapsed().as_millis() as u64,
            generation = now.generation.0,
            "recovered"
        );
        events(JobEvent::Recovered {
            step: now.step,
            how,
        });
        (*committed, *synced) = (now.step, now.generation);
        return Ok(());
    }
}

/// Injects the plan's faults until its last step.
async fn inject(
    plan: FaultPlan,
    allocator: Arc<dyn Allocator>,
    isolate: Option<Isolate>,
    mesh: ActorMesh<Trainer>,
    log: Arc<Mutex<Log>>,
    mut committed: tokio::sync::watch::Receiver<u64>,
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
    let mut next_step = 0u64;
    loop {
        match plan.every {
            FaultSpacing::Time(every) => tokio::time::sleep(every).await,
            FaultSpacing::Steps(every) => {
                next_step = next_step.saturating_add(every.max(1));
                // Woken at the commit that reaches the mark (the job's end
                // drops the sender: no more faults).
                let mark = next_step.min(plan.until_step);
                if committed.wait_for(|&c| c >= mark).await.is_err() {
                    return;
                }
            }
        }
        if *committed.borrow() >= plan.until_step {
            return;
        }
        let kind = plan.kinds[i % plan.kinds.len().max(1)];
        i += 1;
        if kind == FaultKind::Partition && isolate.is_none() {
            continue;
        }
        if kind == FaultKind::Nan {
            let world = mesh.mesh_shape().len().max(1) as u64;
            let rank = u32::try_from(next() % world).unwrap_or(0);
            let mut l = log.lock().expect("log lock");
            if l.poison.is_none() {
                l.poison = Some(rank);
                l.fault(kind, None, None);
            }
            continue;
        }
        let procs = mesh.procs();
        if procs.is_empty() || !matches!(mesh.status(), MeshStatus::Running) {
            continue;
        }
        let p = (next() % procs.len() as u64) as usize;
        let proc = procs[p].proc.clone();
        tracing::info!(kind = kind.name(), %proc, "a fault is injected");
        let lasts = matches!(kind, FaultKind::Pause | FaultKind::Partition).then_some(plan.pause);
        log.lock()
            .expect("log lock")
            .fault(kind, Some(proc.clone()), lasts);
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
            FaultKind::Nan => {} // handled above
        }
    }
}

/// The fault-free single-process reference of a job: `steps` steps of the
/// same replicas and world, summed in rank order; its final state.
pub fn reference(spec: &JobSpec, steps: u64, threads: i32) -> Result<TrainState, Error> {
    reference_with_skips(spec, steps, threads, &[])
}

/// [`reference()`] of a job whose skip policy dropped the steps `skipped`
/// ([`Report::skipped`]): those steps advance the counter and apply
/// nothing, as on every rank of the job.
pub fn reference_with_skips(
    spec: &JobSpec,
    steps: u64,
    threads: i32,
    skipped: &[u64],
) -> Result<TrainState, Error> {
    tch::set_num_threads(threads.max(1));
    let mut replica = spec.build()?;
    let mut reference = crate::Reference::new();
    for step in 0..steps {
        if skipped.contains(&step) {
            replica.skip_step()?;
        } else {
            replica.reference_step(&mut reference, spec.world as usize)?;
        }
    }
    replica.state()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(name: &str) -> ProcId {
        ProcId::new(name).expect("a proc name")
    }

    /// Which faults (by index) the log has detected.
    fn detected(l: &Log) -> Vec<usize> {
        let undetected: Vec<usize> = l.undetected.iter().map(|u| u.fault).collect();
        (0..l.faults.len())
            .filter(|i| !undetected.contains(i))
            .collect()
    }

    const PAUSE: Option<Duration> = Some(Duration::from_secs(60));

    #[test]
    fn faults_injected_together_are_each_detected_by_their_own_failure() {
        let (a, b) = (proc("p0-0"), proc("p2-0"));
        let mut l = Log::default();
        // A kill and a pause at once (the marks a pause held back).
        l.fault(FaultKind::Kill, Some(a.clone()), None);
        l.fault(FaultKind::Pause, Some(b.clone()), PAUSE);
        l.seen(Seen::Proc(&a));
        assert_eq!(detected(&l), [0], "the kill, by its proc's exit");
        l.seen(Seen::Proc(&a)); // a second report of the same death
        assert_eq!(l.detections.len(), 1);
        l.seen(Seen::Proc(&b));
        assert_eq!(detected(&l), [0, 1]);
        assert!(l.undetected.is_empty());
        // A failure no fault explains detects nothing.
        l.seen(Seen::Proc(&proc("p9-0")));
        l.seen(Seen::Unnamed);
        assert_eq!(l.detections.len(), 2);
    }

    #[test]
    fn one_death_detects_every_fault_on_its_proc() {
        let a = proc("p9-0");
        let mut l = Log::default();
        l.fault(FaultKind::Kill, Some(a.clone()), None);
        l.fault(FaultKind::Pause, Some(a.clone()), PAUSE);
        l.seen(Seen::Proc(&a));
        assert_eq!(detected(&l), [0, 1]);
        assert_eq!(l.detections.len(), 2);
    }

    #[test]
    fn a_fault_that_ended_unseen_stays_unseen() {
        let (a, b) = (proc("p0-0"), proc("p1-0"));
        let mut l = Log::default();
        // A pause nothing saw (it ended first), later a kill of that proc.
        l.fault(FaultKind::Pause, Some(a.clone()), Some(Duration::ZERO));
        std::thread::sleep(Duration::from_millis(2));
        l.fault(FaultKind::Nan, None, None);
        l.fault(FaultKind::Kill, Some(a.clone()), None);
        l.fault(FaultKind::Kill, Some(b.clone()), None);
        l.seen(Seen::Proc(&a));
        assert_eq!(detected(&l), [2], "the kill, not the pause that ended");
        // A failure that names no proc: the newest fault on any proc.
        l.seen(Seen::Unnamed);
        assert_eq!(detected(&l), [2, 3]);
        // Nor does one that names none detect the pause.
        l.seen(Seen::Unnamed);
        assert_eq!(detected(&l), [2, 3]);
        // A non-finite step: the nan fault only.
        l.seen(Seen::NonFinite);
        assert_eq!(detected(&l), [1, 2, 3]);
        l.seen(Seen::NonFinite);
        assert_eq!(l.undetected.len(), 1, "the pause stays unseen");
        assert_eq!(l.detections.len(), 3);
    }

    #[test]
    fn a_config_whose_deadlines_would_overflow_is_refused() {
        let spec = JobSpec {
            model: crate::job::ModelSpec::mlp_small(),
            optimizer: crate::job::OptimSpec::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
            seed: 3,
            world: 2,
        };
        let mut config = JobConfig::new(spec, 10, PathBuf::from("unused"));
        config.step_timeout = MAX_JOB_DURATION;
        config.faults = Some(FaultPlan {
            every: FaultSpacing::Steps(5),
            kinds: vec![FaultKind::Pause],
            pause: MAX_JOB_DURATION,
            seed: 1,
            until_step: 9,
        });
        check(&config).expect("a day is allowed");
        let mut long = config.clone();
        long.step_timeout = Duration::MAX;
        let e = check(&long).expect_err("an endless step timeout");
        assert!(e.to_string().contains("step timeout"), "{e}");
        let mut long = config;
        if let Some(f) = long.faults.as_mut() {
            f.pause = MAX_JOB_DURATION + Duration::from_millis(1);
        }
        let e = check(&long).expect_err("a pause past a day");
        assert!(e.to_string().contains("fault pause"), "{e}");
    }

    #[test]
    fn a_failure_names_the_proc_of_its_cause_through_escalations() {
        let p = proc("p3-0");
        let exited = FailureCause::LinkFailed {
            proc: p.clone(),
            detail: "no heartbeat".into(),
        };
        assert!(matches!(Seen::of(&exited), Seen::Proc(q) if *q == p));
        let escalated = FailureCause::Escalated(Box::new(regent_mesh::MeshFailure {
            mesh: "inner".into(),
            ranks: vec![Rank(0)],
            cause: exited.clone(),
            generation: regent_net::Generation(2),
        }));
        assert!(matches!(Seen::of(&escalated), Seen::Proc(q) if *q == p));
        assert!(matches!(
            Seen::of(&FailureCause::StartFailed("x".into())),
            Seen::Unnamed
        ));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let at = |v: &[u64], p| percentile(&ms(v), p).map(|d| d.as_millis());
        assert_eq!(at(&[], 50.0), None);
        assert_eq!(at(&[7], 50.0), Some(7));
        assert_eq!(at(&[7], 99.0), Some(7));
        // Unsorted input; the median of an even count is the lower middle.
        assert_eq!(at(&[1034, 15], 50.0), Some(15));
        assert_eq!(at(&[40, 10, 30, 20], 50.0), Some(20));
        assert_eq!(at(&[40, 10, 30, 20], 75.0), Some(30));
        assert_eq!(at(&[40, 10, 30, 20], 99.0), Some(40));
        assert_eq!(at(&[40, 10, 30, 20], 0.0), Some(10));
        assert_eq!(at(&[5, 1, 4, 2, 3], 50.0), Some(3));
    }
}
