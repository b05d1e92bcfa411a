//! The scenario runner: a mesh of [`Tally`] members on procs behind chaos
//! proxies, a workload that counts and checks its messages, and rounds of
//! seeded faults, each followed by healing, settling and checking every
//! invariant. The chaos suite runs one round per scenario; the soak runs
//! rounds until its time is up.
//!
//! A round: generate the round's timeline from the seed; start the
//! workload; play the timeline; heal everything; stop the workload; wait
//! until the mesh runs and answers, with no restart for a quiet period;
//! wait for abandoned procs (zombies) to exit; ask every live member what
//! it received; check.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use regent_mesh::{
    ActorMesh, FailureCause, MeshError, MeshFailure, MeshPolicy, MeshStatus, Selection,
    SpawnOptions,
};
use regent_net::ProcId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::ChaosError;
use crate::cluster::{ChaosCluster, ClusterConfig};
use crate::injector::{Injection, Injector};
use crate::invariant::{
    self, Acked, CallRecord, InvariantResult, OrderProgress, ReplySeen, SendRecord, SupervisionLog,
    names,
};
use crate::process;
use crate::proxy::ProxyCounts;
use crate::rng::Seed;
use crate::schedule::{FaultKind, Schedule, ScheduleConfig, ScheduledFault};
use crate::workload::{Life, LifeReport, Sender, Tally, TallyArgs, TallyMsg, TallyReply};

/// How the workload runs, with documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// Pause between the starts of two casts. Default 10 ms.
    pub cast_interval: Duration,
    /// Casts the caster keeps in flight at once: it starts the next one
    /// (after `cast_interval`) while earlier ones still wait for their
    /// acknowledgements, each started before the next is made. Default 16.
    pub casts_in_flight: NonZeroU32,
    /// Pause between two calls. Default 100 ms.
    pub call_interval: Duration,
    /// Each call's deadline. Default 4 s.
    pub call_deadline: Duration,
    /// Fire-and-forget casts the caster hands over right before each
    /// acknowledged one: queued together, they travel as one frame (a
    /// batch), in the same sender's order as the acknowledged casts, and
    /// face every fault as they do. Default 3.
    pub fire_and_forget: u32,
    /// Acknowledged casts the caster hands over together each time (at
    /// least one): queued together, they travel as one frame whose casts
    /// are each acknowledged on their own. Default 2.
    pub acknowledged_together: u32,
}

impl WorkloadConfig {
    /// Sets how many casts the caster keeps in flight.
    pub fn casts_in_flight(mut self, n: NonZeroU32) -> Self {
        self.casts_in_flight = n;
        self
    }
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            cast_interval: Duration::from_millis(10),
            // Many in flight: FIFO per sender is checked with real
            // concurrency (the mesh orders one sender's casts at hand-over).
            casts_in_flight: NonZeroU32::new(16).unwrap_or(NonZeroU32::MIN),
            call_interval: Duration::from_millis(100),
            call_deadline: Duration::from_secs(4),
            fire_and_forget: 3,
            acknowledged_together: 2,
        }
    }
}

/// One chaos scenario, with documented defaults.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Its name.
    pub name: String,
    /// Its seed: decides every round's timeline and the proxies' packet
    /// fates.
    pub seed: Seed,
    /// Procs. Default 4.
    pub procs: u32,
    /// Members per proc. Default 2.
    pub per_proc: u32,
    /// The mesh's policy. Default: restart members, 100 in 60 s.
    pub policy: MeshPolicy,
    /// The cast trees' fan-out. Default 16 (flat for up to 16 procs).
    pub fanout: NonZeroU32,
    /// How timelines are generated (its mesh size follows `procs` and
    /// `per_proc`).
    pub schedule: ScheduleConfig,
    /// A fixed timeline instead of generated ones (every round plays it).
    pub timeline: Option<Vec<ScheduledFault>>,
    /// The workload.
    pub workload: WorkloadConfig,
    /// How long the mesh may take to run and answer again after healing.
    /// Default 40 s (a healthy recovery takes a few seconds).
    pub settle_timeout: Duration,
    /// A quiet period with no restart that counts as settled. Default
    /// 2.5 s (over the 1 s failure timeout of procs).
    pub quiet: Duration,
    /// Allowance over a call's deadline, for a loaded machine. Default 3 s.
    pub call_slack: Duration,
    /// How long abandoned procs may run after healing, past the owner
    /// lease. Default 5 s.
    pub zombie_slack: Duration,
    /// Namespace hosts for kernel-level host faults in the timeline.
    /// Default none.
    pub hosts: Option<Arc<crate::netns::Hosts>>,
}

impl Scenario {
    /// A scenario with the defaults.
    pub fn new(name: impl Into<String>, seed: Seed) -> Self {
        Self {
            name: name.into(),
            seed,
            procs: 4,
            per_proc: 2,
            policy: MeshPolicy::default().intensity(100, Duration::from_secs(60)),
            fanout: regent_mesh::tree::DEFAULT_FANOUT,
            schedule: ScheduleConfig::default(),
            timeline: None,
            workload: WorkloadConfig::default(),
            settle_timeout: Duration::from_secs(40),
            quiet: Duration::from_millis(2500),
            call_slack: Duration::from_secs(3),
            zombie_slack: Duration::from_secs(5),
            hosts: None,
        }
    }

    /// Lets the timeline cut these namespace hosts.
    pub fn hosts(mut self, hosts: Arc<crate::netns::Hosts>) -> Self {
        self.hosts = Some(hosts);
        self
    }

    /// Sets the mesh's size.
    pub fn mesh(mut self, procs: u32, per_proc: u32) -> Self {
        self.procs = procs;
        self.per_proc = per_proc;
        self
    }

    /// Sets the policy.
    pub fn policy(mut self, policy: MeshPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the fan-out.
    pub fn fanout(mut self, fanout: NonZeroU32) -> Self {
        self.fanout = fanout;
        self
    }

    /// Sets how timelines are generated.
    pub fn schedule(mut self, schedule: ScheduleConfig) -> Self {
        self.schedule = schedule;
        self
    }

    /// Plays this timeline (every round) instead of generated ones.
    pub fn timeline(mut self, faults: Vec<ScheduledFault>) -> Self {
        self.timeline = Some(faults);
        self
    }

    /// Sets the workload.
    pub fn workload(mut self, workload: WorkloadConfig) -> Self {
        self.workload = workload;
        self
    }

    /// The timeline of round `round`: the same for the same seed, always.
    pub fn round_schedule(&self, round: u64) -> Schedule {
        let seed = self.seed.derive_n("round", round);
        match &self.timeline {
            Some(faults) => Schedule {
                seed,
                faults: faults.clone(),
            },
            None => {
                let config = self.schedule.clone().mesh(self.procs, self.per_proc);
                Schedule::generate(seed, &config)
            }
        }
    }
}

/// How long a run goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// This many rounds.
    Rounds(u32),
    /// Rounds until this much time has passed (the last round completes).
    Duration(Duration),
}

/// Where a run stands, after each round.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Rounds done.
    pub rounds: u64,
    /// Time since the run started.
    pub elapsed: Duration,
    /// Faults injected so far.
    pub faults: u64,
    /// Violations so far.
    pub violations: u64,
    /// The mesh's generation.
    pub generation: u64,
    /// The round's timeline (printed, so that a failing round replays).
    pub schedule: Schedule,
    /// The controller the run drives (its snapshot, journal and metrics:
    /// `regent chaos soak --report-html` draws from them).
    pub runtime: regent_mesh::Runtime,
}

/// Latency figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyStats {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest.
    pub max: Duration,
}

impl LatencyStats {
    /// The figures of these samples.
    pub fn of(samples: &[Duration]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut s = samples.to_vec();
        s.sort_unstable();
        let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
        Self {
            count: s.len(),
            p50: at(0.50),
            p99: at(0.99),
            max: s[s.len() - 1],
        }
    }
}

impl fmt::Display for LatencyStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return f.write_str("no samples");
        }
        write!(
            f,
            "p50 {:.3}s, p99 {:.3}s, max {:.3}s (n={})",
            self.p50.as_secs_f64(),
            self.p99.as_secs_f64(),
            self.max.as_secs_f64(),
            self.count
        )
    }
}

/// What a run did and whether every invariant held.
#[derive(Debug, Clone)]
pub struct Report {
    /// The scenario's name.
    pub name: String,
    /// Its seed.
    pub seed: Seed,
    /// Procs and members per proc.
    pub mesh: (u32, u32),
    /// The policy.
    pub policy: MeshPolicy,
    /// Rounds played.
    pub rounds: u64,
    /// How long it ran.
    pub wall: Duration,
    /// Faults injected, by kind (those that applied: a target may be gone).
    pub faults: BTreeMap<FaultKind, u64>,
    /// Faults whose failure the owner observed (a failure naming a proc
    /// the fault hit, or for a panic its rank, while the fault lasted or
    /// within 3 s after), by kind. Faults that hit no proc (degraded links)
    /// are never detected: their effect is in [`Report::proxy`].
    pub detected: BTreeMap<FaultKind, u64>,
    /// Detected faults after which the mesh ran again in a newer generation
    /// (a restart repaired them), by kind.
    pub recovered: BTreeMap<FaultKind, u64>,
    /// Failures the owner observed (`ActorMesh::failures`), whatever caused
    /// them.
    pub failures_seen: u64,
    /// Restarts completed (generation changes).
    pub recoveries: u64,
    /// From a fault to its failure's observation by the owner.
    pub detection: LatencyStats,
    /// From a fault to the mesh running again in a newer generation.
    pub recovery: LatencyStats,
    /// Casts sent (and fully acknowledged).
    pub casts: (u64, u64),
    /// Calls made (and fully answered).
    pub calls: (u64, u64),
    /// (message, live member) pairs checked for delivery.
    pub deliveries_checked: u64,
    /// What the proxies did.
    pub proxy: ProxyCounts,
    /// Packets the kernel dropped because of host faults, by kind
    /// ([`Injector::host_dropped`]).
    pub host_dropped: BTreeMap<FaultKind, u64>,
    /// The final generation and status.
    pub generation: u64,
    /// The final status.
    pub status: MeshStatus,
    /// Every invariant's verdict.
    pub invariants: Vec<InvariantResult>,
    /// Problems outside the invariants (e.g. the mesh did not recover).
    pub problems: Vec<String>,
}

fn count_of(m: &BTreeMap<FaultKind, u64>, kind: FaultKind) -> u64 {
    m.get(&kind).copied().unwrap_or(0)
}

impl Report {
    /// Violations of all invariants, plus problems.
    pub fn violations(&self) -> u64 {
        self.invariants.iter().map(|i| i.violations).sum::<u64>() + self.problems.len() as u64
    }

    /// Faults of this kind injected.
    pub fn injected(&self, kind: FaultKind) -> u64 {
        count_of(&self.faults, kind)
    }

    /// Faults of this kind whose failure the owner observed.
    pub fn detected(&self, kind: FaultKind) -> u64 {
        count_of(&self.detected, kind)
    }

    /// Faults of this kind repaired by a restart.
    pub fn recovered(&self, kind: FaultKind) -> u64 {
        count_of(&self.recovered, kind)
    }

    /// What the run left unproven: an invariant that was not run, one that
    /// checked nothing, and facts an invariant could not check (§7.6: never
    /// counted as holding silently). The invariants named in `may_skip` may
    /// check nothing or leave facts unchecked, but only if they say why
    /// (e.g. delivery, when the policy stopped the mesh and its members'
    /// logs are gone).
    pub fn gaps(&self, may_skip: &[&str]) -> Vec<String> {
        let mut gaps = Vec::new();
        for name in names::ALL {
            let Some(i) = self.invariants.iter().find(|i| i.name == name) else {
                gaps.push(format!("{name}: not run"));
                continue;
            };
            if may_skip.contains(&name) {
                if i.checked == 0 && i.unchecked.is_empty() {
                    gaps.push(format!("{name}: checked nothing and says not why"));
                }
                continue;
            }
            if i.checked == 0 {
                gaps.push(format!("{name}: checked nothing"));
            }
            for u in &i.unchecked {
                gaps.push(format!("{name}: not checked: {u}"));
            }
        }
        gaps
    }

    /// Panics with the whole report if anything was violated or left
    /// unproven ([`Report::gaps`]).
    pub fn assert_clean(&self) {
        self.assert_clean_except(&[]);
    }

    /// [`Report::assert_clean`], but the invariants in `may_skip` may check
    /// nothing if they say why.
    pub fn assert_clean_except(&self, may_skip: &[&str]) {
        let gaps = self.gaps(may_skip);
        assert!(
            self.violations() == 0 && gaps.is_empty(),
            "chaos run failed:\n{self}\n  unproven: {gaps:#?}"
        );
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos report: {} (seed {}; replay with the same seed)",
            self.name, self.seed
        )?;
        writeln!(
            f,
            "  mesh: {} procs x {} members, policy {} (at most {} restarts in {:?}), {} round(s) in {:.1}s",
            self.mesh.0,
            self.mesh.1,
            self.policy.on_failure,
            self.policy.intensity.max_restarts,
            self.policy.intensity.period,
            self.rounds,
            self.wall.as_secs_f64()
        )?;
        let total: u64 = self.faults.values().sum();
        writeln!(
            f,
            "  faults injected: {total} (each kind: injected, failures detected, repaired by a restart)"
        )?;
        for (k, n) in &self.faults {
            writeln!(
                f,
                "    {:<20} {n} injected, {} detected, {} recovered",
                k.name(),
                self.detected(*k),
                self.recovered(*k)
            )?;
        }
        writeln!(
            f,
            "  failures observed: {}; recoveries: {} (final generation {}, status {:?})",
            self.failures_seen, self.recoveries, self.generation, self.status
        )?;
        writeln!(f, "  detection latency: {}", self.detection)?;
        writeln!(f, "  recovery latency:  {}", self.recovery)?;
        writeln!(
            f,
            "  workload: {} casts ({} fully acknowledged), {} calls ({} fully answered), {} deliveries checked",
            self.casts.0, self.casts.1, self.calls.0, self.calls.1, self.deliveries_checked
        )?;
        let p = &self.proxy;
        writeln!(
            f,
            "  proxies: {} datagrams forwarded, {} cut, {} lost, {} duplicated, {} reordered, {} delayed ({} by latency, {} by a bandwidth cap), {} overflowed",
            p.forwarded,
            p.cut,
            p.lost,
            p.duplicated,
            p.reordered,
            p.delayed,
            p.slowed,
            p.throttled,
            p.overflowed
        )?;
        for (k, n) in &self.host_dropped {
            writeln!(f, "  kernel: {n} packets dropped by {k} faults")?;
        }
        writeln!(f, "  invariants:")?;
        for i in &self.invariants {
            writeln!(f, "    {i}")?;
        }
        for p in &self.problems {
            writeln!(f, "  PROBLEM: {p}")?;
        }
        for g in self.gaps(&[]) {
            writeln!(f, "  unproven: {g}")?;
        }
        write!(f, "  result: {} violation(s)", self.violations())
    }
}

/// What the observers saw, shared with their tasks.
#[derive(Default)]
pub(crate) struct Observed {
    pub(crate) failures: Vec<(Instant, Vec<u32>)>,
    pub(crate) failures_missed: bool,
    pub(crate) generations: Vec<(Instant, u64)>,
    pub(crate) expected: Vec<Expected>,
    pub(crate) detection: Vec<Duration>,
    /// Detected faults waiting for the mesh to run in a generation newer
    /// than their failure's: when, the failure's generation, the kind.
    pub(crate) awaiting: Vec<(Instant, u64, FaultKind)>,
    pub(crate) recovery: Vec<Duration>,
    pub(crate) detected: BTreeMap<FaultKind, u64>,
    pub(crate) recovered: BTreeMap<FaultKind, u64>,
    /// Failures no expected fault matched yet: a kill's exit report can
    /// arrive before the injector has recorded the kill.
    pub(crate) unmatched: Vec<SeenFailure>,
    /// Where each detection is observed as it is made
    /// (`regent_detection_seconds`, for the soak's live dashboard).
    pub(crate) runtime: Option<regent_mesh::Runtime>,
}

/// A failure the watcher saw.
pub(crate) struct SeenFailure {
    at: Instant,
    proc: Option<ProcId>,
    ranks: Vec<u32>,
    generation: u64,
}

impl Expected {
    /// Whether `f` is this fault's failure.
    fn matches(&self, f: &SeenFailure) -> bool {
        self.at <= f.at
            && self.until.is_none_or(|u| f.at <= u)
            && (f.proc.as_ref().is_some_and(|p| self.procs.contains(p))
                || (f.proc.is_none() && self.ranks.iter().any(|r| f.ranks.contains(r))))
    }
}

impl Observed {
    /// Counts `e` detected by `f`.
    fn detect(&mut self, e: &Expected, f: &SeenFailure) {
        let after = f.at.duration_since(e.at);
        self.detection.push(after);
        if let Some(rt) = &self.runtime {
            rt.observe_detection(after);
        }
        *self.detected.entry(e.kind).or_insert(0) += 1;
        self.awaiting.push((e.at, f.generation, e.kind));
    }

    /// Records an injected fault: matched at once to a failure seen before
    /// the injector recorded it, or kept for the failures to come.
    pub(crate) fn expect(&mut self, e: Expected) {
        match self.unmatched.iter().position(|f| e.matches(f)) {
            Some(i) => {
                let f = self.unmatched.remove(i);
                self.detect(&e, &f);
            }
            None => self.expected.push(e),
        }
    }

    /// Records a failure: it detects the first expected fault it matches.
    fn saw(&mut self, f: SeenFailure) {
        self.failures.push((f.at, f.ranks.clone()));
        match self.expected.iter().position(|e| e.matches(&f)) {
            Some(i) => {
                let e = self.expected.remove(i);
                self.detect(&e, &f);
            }
            None => {
                // Bounded: a round's failures; cleared with `expected`.
                if self.unmatched.len() < 4096 {
                    self.unmatched.push(f);
                }
            }
        }
    }
}

/// A fault whose failure the owner should detect.
pub(crate) struct Expected {
    pub(crate) kind: FaultKind,
    pub(crate) at: Instant,
    pub(crate) procs: Vec<ProcId>,
    pub(crate) ranks: Vec<u32>,
    pub(crate) until: Option<Instant>,
}

/// Notes a fault that started as one whose failure the owner should
/// detect: applied, and aimed at procs or ranks (degraded links are not).
pub(crate) fn expect_effect(obs: &Mutex<Observed>, sf: &ScheduledFault, inj: &Injection) {
    if !inj.applied || (inj.procs.is_empty() && inj.ranks.is_empty()) {
        return;
    }
    lock(obs).expect(Expected {
        kind: sf.fault.kind(),
        at: inj.at,
        procs: inj.procs.clone(),
        ranks: inj.ranks.clone(),
        until: sf.lasts.map(|d| inj.at + d + Duration::from_secs(3)),
    });
}

/// What the workload recorded this round.
#[derive(Default)]
pub(crate) struct Ledger {
    pub(crate) sends: Vec<SendRecord>,
    pub(crate) calls: Vec<CallRecord>,
    pub(crate) replies: Vec<ReplySeen>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Invariant: no code panics while holding these locks.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn failure_proc(f: &MeshFailure) -> Option<&ProcId> {
    match &f.cause {
        FailureCause::ProcExited { proc, .. }
        | FailureCause::HostLost { proc, .. }
        | FailureCause::LinkFailed { proc, .. } => Some(proc),
        _ => None,
    }
}

/// Watches the mesh's failures: records them and matches them to faults.
pub(crate) async fn watch_failures(mesh: ActorMesh<Tally>, obs: Arc<Mutex<Observed>>) {
    let mut rx = mesh.failures();
    loop {
        match rx.recv().await {
            Ok(f) => {
                let seen = SeenFailure {
                    at: Instant::now(),
                    proc: failure_proc(&f).cloned(),
                    ranks: f.ranks.iter().map(|r| r.0).collect(),
                    generation: f.generation.0,
                };
                lock(&obs).saw(seen);
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                lock(&obs).failures_missed = true;
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Samples the generation every 10 ms: for monotonicity and recoveries.
pub(crate) async fn sample_generations(mesh: ActorMesh<Tally>, obs: Arc<Mutex<Observed>>) {
    loop {
        let g = mesh.generation().0;
        let running = mesh.status() == MeshStatus::Running;
        let now = Instant::now();
        {
            let mut o = lock(&obs);
            if o.generations.last().is_none_or(|(_, last)| *last != g) {
                o.generations.push((now, g));
            }
            if running {
                let mut done = Vec::new();
                o.awaiting.retain(|(at, failed_in, kind)| {
                    let recovered = g > *failed_in;
                    if recovered {
                        done.push((now.duration_since(*at), *kind));
                    }
                    !recovered
                });
                for (d, kind) in done {
                    o.recovery.push(d);
                    *o.recovered.entry(kind).or_insert(0) += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn acked_of(r: &Result<regent_mesh::Delivered, MeshError>) -> Acked {
    match r {
        Ok(d) if d.is_complete() => Acked::All,
        Ok(d) => Acked::AllBut(d.failed().iter().map(|(r, _)| r.0).collect()),
        Err(MeshError::Members(m)) => Acked::AllBut(m.failed.iter().map(|(r, _)| r.0).collect()),
        Err(_) => Acked::None,
    }
}

/// A cast in flight: its number, the generation read before it started,
/// and how it returned.
type CastInFlight =
    Pin<Box<dyn Future<Output = (u64, u64, Result<regent_mesh::Delivered, MeshError>)> + Send>>;

/// Notes a returned cast in the ledger; returns whether the mesh is done.
fn cast_returned(
    mesh: &ActorMesh<Tally>,
    ledger: &Mutex<Ledger>,
    (n, g0, r): (u64, u64, Result<regent_mesh::Delivered, MeshError>),
) -> bool {
    // A cast that returned says the generation it was sent in: fencing
    // keeps it from every later life. Otherwise the latest the sender saw.
    let g1 = match &r {
        Ok(d) => d.generation().0,
        Err(_) => mesh.generation().0,
    };
    lock(ledger).sends.push(SendRecord {
        seq: n,
        gen_lo: g0.min(g1),
        gen_hi: g1,
        call: false,
        acked: acked_of(&r),
    });
    matches!(r, Err(MeshError::Stopped(_)))
}

/// Casts numbered records to every member until told to stop, starting
/// `acknowledged_together` at once every `cast_interval` while fewer than
/// `casts_in_flight` wait for their acknowledgements, right after
/// `fire_and_forget` casts that wait for nothing (see [`WorkloadConfig`]);
/// when stopped, waits for those in flight.
///
/// Each cast is polled once as soon as it is made, so that it has started
/// (and taken its place in the sender's order) before the next is made:
/// casts leave in the order of their numbers.
pub(crate) async fn caster(
    mesh: ActorMesh<Tally>,
    seq: Arc<AtomicU64>,
    ledger: Arc<Mutex<Ledger>>,
    workload: WorkloadConfig,
    mut stop: watch::Receiver<bool>,
) {
    let WorkloadConfig {
        cast_interval: interval,
        casts_in_flight,
        fire_and_forget,
        acknowledged_together: together,
        ..
    } = workload;
    let room = casts_in_flight.get() as usize;
    let mut window: FuturesUnordered<CastInFlight> = FuturesUnordered::new();
    let mut next = tokio::time::Instant::now();
    let mut stopping = false;
    loop {
        stopping |= *stop.borrow();
        if stopping && window.is_empty() {
            return;
        }
        let may_start = !stopping && window.len() < room;
        // Biased (a fixed order), so a simulated run replays.
        tokio::select! {
            biased;
            () = tokio::time::sleep_until(next), if may_start => {
                for _ in 0..fire_and_forget {
                    stopping |= cast_nowait(&mesh, &seq, &ledger).await;
                }
                for _ in 0..together.max(1) {
                    let n = seq.fetch_add(1, Ordering::Relaxed);
                    let g0 = mesh.generation().0;
                    let m = mesh.clone();
                    let mut cast: CastInFlight = Box::pin(async move {
                        let msg = TallyMsg::Record { seq: n, sender: Sender::CASTER };
                        let r = m.cast(&Selection::All, &msg).await;
                        (n, g0, r)
                    });
                    match futures::poll!(&mut cast) {
                        Poll::Ready(out) => stopping |= cast_returned(&mesh, &ledger, out),
                        Poll::Pending => window.push(cast),
                    }
                }
                next = tokio::time::Instant::now() + interval;
            }
            Some(out) = window.next(), if !window.is_empty() => {
                stopping |= cast_returned(&mesh, &ledger, out);
            }
            _ = stop.changed(), if !stopping => stopping = true,
        }
    }
}

/// Hands a numbered record to the tree for every member without waiting for
/// any (acknowledged by none, so checked for order, duplicates and fencing
/// only); returns whether the mesh is done.
async fn cast_nowait(mesh: &ActorMesh<Tally>, seq: &AtomicU64, ledger: &Mutex<Ledger>) -> bool {
    let n = seq.fetch_add(1, Ordering::Relaxed);
    let gen_lo = mesh.generation().0;
    let msg = TallyMsg::Record {
        seq: n,
        sender: Sender::CASTER,
    };
    let r = mesh.cast_nowait(&Selection::All, &msg).await;
    // The frame addressed the generation read when it was handed over.
    lock(ledger).sends.push(SendRecord {
        seq: n,
        gen_lo,
        gen_hi: mesh.generation().0,
        call: false,
        acked: Acked::None,
    });
    matches!(r, Err(MeshError::Stopped(_)))
}

/// Calls every member with numbered records until told to stop, timing
/// each call.
pub(crate) async fn caller(
    mesh: ActorMesh<Tally>,
    seq: Arc<AtomicU64>,
    ledger: Arc<Mutex<Ledger>>,
    config: WorkloadConfig,
    members: u32,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let n = seq.fetch_add(1, Ordering::Relaxed);
        let g0 = mesh.generation().0;
        let t = Instant::now();
        let r = mesh
            .call_within(
                &Selection::All,
                &TallyMsg::Record {
                    seq: n,
                    sender: Sender::CALLER,
                },
                config.call_deadline,
            )
            .await;
        let elapsed = t.elapsed();
        let g1 = mesh.generation().0;
        let done = matches!(r, Err(MeshError::Stopped(_)));
        {
            let mut l = lock(&ledger);
            match r {
                Ok(vm) => {
                    let replied: Vec<u32> = vm.values().iter().map(|(r, _)| r.0).collect();
                    let failed: Vec<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
                    if g0 == g1 {
                        for (rank, reply) in vm.values() {
                            if let TallyReply::Life(life) = reply {
                                l.replies.push(ReplySeen {
                                    rank: rank.0,
                                    generation: g0,
                                    life: *life,
                                });
                            }
                        }
                    }
                    l.sends.push(SendRecord {
                        seq: n,
                        gen_lo: g0,
                        gen_hi: g1,
                        call: true,
                        acked: Acked::Only(replied.clone()),
                    });
                    l.calls.push(CallRecord {
                        deadline: config.call_deadline,
                        elapsed,
                        selected: members,
                        replied,
                        failed,
                        error: None,
                    });
                }
                Err(e) => {
                    l.sends.push(SendRecord {
                        seq: n,
                        gen_lo: g0,
                        gen_hi: g1,
                        call: true,
                        acked: Acked::None,
                    });
                    l.calls.push(CallRecord {
                        deadline: config.call_deadline,
                        elapsed,
                        selected: members,
                        replied: Vec::new(),
                        failed: Vec::new(),
                        error: Some(e.to_string()),
                    });
                }
            }
        }
        if done {
            return;
        }
        tokio::select! {
            biased;
            () = tokio::time::sleep(config.call_interval) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Waits until the mesh runs, every member answers, and no restart happens
/// for `quiet`; or until it is done (stopped by its policy).
pub(crate) async fn settle(
    mesh: &ActorMesh<Tally>,
    timeout: Duration,
    quiet: Duration,
) -> Result<(), String> {
    let end = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < end {
        let status = mesh.status();
        if status.is_done() {
            return Ok(());
        }
        if status != MeshStatus::Running {
            last = format!("status {status:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let g = mesh.generation();
        match mesh
            .call_within(&Selection::All, &TallyMsg::Probe, Duration::from_secs(5))
            .await
        {
            Ok(vm) if vm.failed().is_empty() && mesh.generation() == g => {
                tokio::time::sleep(quiet).await;
                if mesh.generation() == g && mesh.status() == MeshStatus::Running {
                    return Ok(());
                }
                last = "a restart during the quiet period".into();
            }
            Ok(vm) => {
                last = format!("{} members did not answer a probe", vm.failed().len());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                last = format!("probe failed: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Err(format!(
        "the mesh did not run and answer within {timeout:?} after healing ({last})"
    ))
}

/// Asks every live member what it received since `from`.
pub(crate) async fn reports(mesh: &ActorMesh<Tally>, from: u64) -> Result<Vec<LifeReport>, String> {
    let mut last = String::new();
    for _ in 0..5 {
        match mesh
            .call_within(
                &Selection::All,
                &TallyMsg::Report { from },
                Duration::from_secs(10),
            )
            .await
        {
            Ok(vm) if vm.failed().is_empty() => {
                return Ok(vm
                    .values()
                    .iter()
                    .filter_map(|(_, r)| match r {
                        TallyReply::Report(rep) => Some(rep.clone()),
                        _ => None,
                    })
                    .collect());
            }
            Ok(vm) => last = format!("{:?}", vm.failed()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("members did not report what they received: {last}"))
}

pub(crate) async fn census(mesh: &ActorMesh<Tally>) -> Result<BTreeMap<u32, Life>, ChaosError> {
    let vm = mesh
        .call_within(&Selection::All, &TallyMsg::Probe, Duration::from_secs(30))
        .await?;
    let values = vm.into_result().map_err(MeshError::from)?;
    Ok(values
        .into_iter()
        .filter_map(|(r, reply)| match reply {
            TallyReply::Life(l) => Some((r.0, l)),
            _ => None,
        })
        .collect())
}

/// Notes on the invariants that read the members' logs (delivery and
/// order) that a round's logs were not read, and why.
pub(crate) fn not_checked(all: &mut [InvariantResult], why: &str) {
    for i in all.iter_mut() {
        if [names::NO_ACKED_LOSS, names::EXACTLY_ONCE, names::FIFO].contains(&i.name) {
            i.not_checked(why.to_owned());
        }
    }
}

pub(crate) fn merge_into(all: &mut Vec<InvariantResult>, r: &InvariantResult) {
    match all.iter_mut().find(|i| i.name == r.name) {
        Some(i) => i.merge(r),
        None => all.push(r.clone()),
    }
}

/// Runs a scenario: see the module documentation. `progress` sees every
/// round as it ends. Errors are for a run that could not start; what goes
/// wrong under faults is in the report.
pub async fn run(
    scenario: &Scenario,
    cluster: ClusterConfig,
    length: Length,
    progress: impl FnMut(&Progress),
) -> Result<Report, ChaosError> {
    run_with(scenario, cluster, length, |_| {}, progress).await
}

/// [`run`], with `started` told of the controller as soon as it runs
/// (before any proc: e.g. to serve its admin endpoint for the whole run).
pub async fn run_with(
    scenario: &Scenario,
    cluster: ClusterConfig,
    length: Length,
    started: impl FnOnce(&regent_mesh::Runtime),
    mut progress: impl FnMut(&Progress),
) -> Result<Report, ChaosError> {
    let t0 = Instant::now();
    let mut runtime = cluster.runtime.clone();
    runtime.fanout = scenario.fanout;
    let lease = runtime.owner_lease;
    let cluster = ChaosCluster::start(cluster.runtime(runtime), scenario.seed).await?;
    started(cluster.runtime());
    let started = t0;
    tracing::info!(scenario = %scenario.name, seed = %scenario.seed, "chaos scenario starts");
    let procs = cluster.spawn_procs(scenario.procs as usize).await?;
    let mesh = procs
        .spawn_with::<Tally>(
            "tally",
            scenario.per_proc,
            &TallyArgs::default(),
            SpawnOptions::new().policy(scenario.policy),
        )
        .await?;
    let members = scenario.procs * scenario.per_proc;
    let initial = census(&mesh).await?;
    let obs = Arc::new(Mutex::new(Observed {
        runtime: Some(cluster.runtime().clone()),
        ..Observed::default()
    }));
    let observers: Vec<JoinHandle<()>> = vec![
        tokio::spawn(watch_failures(mesh.clone(), obs.clone())),
        tokio::spawn(sample_generations(mesh.clone(), obs.clone())),
    ];
    let mut injector =
        Injector::new(cluster.allocator().clone(), mesh.clone()).with_hosts(scenario.hosts.clone());
    let seq = Arc::new(AtomicU64::new(1));
    let mut invariants: Vec<InvariantResult> = invariant::names::ALL
        .iter()
        .map(|n| InvariantResult::new(n))
        .collect();
    let mut problems = Vec::new();
    let (mut casts, mut calls, mut checked) = ((0, 0), (0, 0), 0);
    let mut finals = initial.clone();
    let mut round = 0u64;
    let mut gen_checked_upto = 0usize;
    let mut order_progress = OrderProgress::new();
    loop {
        let schedule = scenario.round_schedule(round);
        tracing::info!(round, "{schedule}");
        let from = seq.load(Ordering::Relaxed);
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let workers = [
            tokio::spawn(caster(
                mesh.clone(),
                seq.clone(),
                ledger.clone(),
                scenario.workload.clone(),
                stop_rx.clone(),
            )),
            tokio::spawn(caller(
                mesh.clone(),
                seq.clone(),
                ledger.clone(),
                scenario.workload.clone(),
                members,
                stop_rx,
            )),
        ];
        let t0 = tokio::time::Instant::now();
        injector
            .play(&schedule.faults, |sf, inj| expect_effect(&obs, sf, inj))
            .await;
        tokio::time::sleep_until(t0 + scenario.schedule.duration.max(schedule.end())).await;
        injector.heal_all().await;
        let _ = stop_tx.send(true);
        for w in workers {
            let _ = w.await;
        }
        let settled = settle(&mesh, scenario.settle_timeout, scenario.quiet).await;
        if let Err(e) = &settled {
            problems.push(format!(
                "round {round}: {e}; generation {}, status {:?}",
                mesh.generation().0,
                mesh.status()
            ));
        }
        {
            let mut o = lock(&obs);
            o.expected.clear();
            o.unmatched.clear();
        }
        // Zombies: procs abandoned by the mesh must exit once healed.
        let current: Vec<ProcId> = mesh.procs().into_iter().map(|a| a.proc).collect();
        let zombies: Vec<u32> = cluster
            .allocator()
            .history()
            .into_iter()
            .filter(|r| r.exited.is_none() && !current.contains(&r.proc) && r.pid != 0)
            .map(|r| r.pid)
            .collect();
        let survivors = process::wait_gone(&zombies, lease + scenario.zombie_slack).await;
        merge_into(
            &mut invariants,
            &invariant::check_processes(
                &zombies,
                &survivors,
                "long after its owner abandoned it and the network healed",
            ),
        );
        let to = seq.load(Ordering::Relaxed);
        let ledger = std::mem::take(&mut *lock(&ledger));
        if settled.is_ok() && !mesh.status().is_done() {
            match reports(&mesh, from).await {
                Ok(reps) => {
                    finals = reps.iter().map(|r| (r.life.rank, r.life)).collect();
                    let (lost, once) = invariant::check_delivery(&ledger.sends, &reps, from, to);
                    checked += lost.checked;
                    merge_into(&mut invariants, &lost);
                    merge_into(&mut invariants, &once);
                    let (fifo, progress) = invariant::check_order(&reps, &order_progress);
                    order_progress = progress;
                    merge_into(&mut invariants, &fifo);
                }
                Err(e) => {
                    // Who lives now is unknown: the restarted set is not
                    // checked against stale lives.
                    finals.clear();
                    not_checked(
                        &mut invariants,
                        &format!("round {round}: the members' logs could not be read ({e})"),
                    );
                    problems.push(format!("round {round}: {e}"));
                }
            }
        } else {
            finals.clear();
            let why = match &settled {
                Err(_) => "the mesh did not recover".to_owned(),
                Ok(()) => format!("the mesh is {:?} (its policy stopped it)", mesh.status()),
            };
            not_checked(
                &mut invariants,
                &format!("round {round}: {why}: its members' logs are gone"),
            );
        }
        merge_into(
            &mut invariants,
            &invariant::check_calls(&ledger.calls, scenario.call_slack),
        );
        let samples = {
            let o = lock(&obs);
            let s = o.generations[gen_checked_upto.saturating_sub(1)..].to_vec();
            gen_checked_upto = o.generations.len();
            s
        };
        merge_into(
            &mut invariants,
            &invariant::check_generations(&samples, &ledger.replies),
        );
        for s in &ledger.sends {
            if s.call {
                calls.0 += 1;
                calls.1 +=
                    u64::from(matches!(&s.acked, Acked::Only(r) if r.len() as u32 == members));
            } else {
                casts.0 += 1;
                casts.1 += u64::from(s.acked == Acked::All);
            }
        }
        round += 1;
        let violations =
            invariants.iter().map(|i| i.violations).sum::<u64>() + problems.len() as u64;
        progress(&Progress {
            rounds: round,
            elapsed: started.elapsed(),
            faults: injector.counts().values().sum(),
            violations,
            generation: mesh.generation().0,
            schedule,
            runtime: cluster.runtime().clone(),
        });
        let more = match length {
            Length::Rounds(n) => round < u64::from(n),
            Length::Duration(d) => started.elapsed() < d,
        };
        if settled.is_err() {
            problems.push(format!(
                "the run stops after round {round}: its mesh did not recover"
            ));
            break;
        }
        if !more || mesh.status().is_done() {
            break;
        }
    }
    let status = mesh.status();
    let generation = mesh.generation().0;
    for o in &observers {
        o.abort();
    }
    let (sup, detection, recovery, detected, recovered) = {
        let o = lock(&obs);
        let sup = SupervisionLog {
            policy: scenario.policy,
            initial,
            finals,
            failures: o.failures.clone(),
            failures_missed: o.failures_missed,
            generations: o.generations.clone(),
            status: status.clone(),
            generation,
            tolerance: Duration::from_secs(5),
        };
        (
            sup,
            LatencyStats::of(&o.detection),
            LatencyStats::of(&o.recovery),
            o.detected.clone(),
            o.recovered.clone(),
        )
    };
    let failures_seen = sup.failures.len() as u64;
    merge_into(&mut invariants, &invariant::check_restarts(&sup));
    // End supervision first, so that stopping procs restarts nothing. A
    // supervisor stuck in a restart never takes the request: bounded.
    if tokio::time::timeout(Duration::from_secs(10), mesh.stop())
        .await
        .is_err()
    {
        problems.push(
            "the mesh's supervisor did not stop within 10s of being asked (busy in a restart)"
                .into(),
        );
    }
    let proxy = cluster.proxy_counts();
    let all: Vec<u32> = cluster
        .allocator()
        .history()
        .iter()
        .map(|r| r.pid)
        .filter(|p| *p != 0)
        .collect();
    drop(procs);
    let survivors = cluster.shutdown(Duration::from_secs(20)).await;
    merge_into(
        &mut invariants,
        &invariant::check_processes(&all, &survivors, "after the cluster stopped"),
    );
    let report = Report {
        name: scenario.name.clone(),
        seed: scenario.seed,
        mesh: (scenario.procs, scenario.per_proc),
        policy: scenario.policy,
        rounds: round,
        wall: started.elapsed(),
        faults: injector.counts().clone(),
        detected,
        recovered,
        failures_seen,
        recoveries: generation,
        detection,
        recovery,
        casts,
        calls,
        deliveries_checked: checked,
        proxy,
        host_dropped: injector.host_dropped().clone(),
        generation,
        status,
        invariants,
        problems,
    };
    tracing::info!(scenario = %scenario.name, violations = report.violations(), "chaos scenario ends");
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_reported_before_its_kill_was_recorded_still_detects_it() {
        let proc = ProcId::new("p-1").unwrap();
        let at = Instant::now();
        let kill = || Expected {
            kind: FaultKind::Kill,
            at,
            procs: vec![proc.clone()],
            ranks: vec![],
            until: None,
        };
        let exit = || SeenFailure {
            at: at + Duration::from_millis(3),
            proc: Some(proc.clone()),
            ranks: vec![2],
            generation: 0,
        };
        // The exit report first (pushed from waitpid within milliseconds),
        // then the injector's record of the kill.
        let mut o = Observed::default();
        o.saw(exit());
        o.expect(kill());
        assert_eq!(o.detected.get(&FaultKind::Kill), Some(&1));
        assert!(o.expected.is_empty() && o.unmatched.is_empty());
        // And in the usual order.
        let mut o = Observed::default();
        o.expect(kill());
        o.saw(exit());
        assert_eq!(o.detected.get(&FaultKind::Kill), Some(&1));
        // A failure before the fault began is not its detection.
        let mut o = Observed::default();
        o.saw(SeenFailure {
            at: at - Duration::from_millis(1),
            ..exit()
        });
        o.expect(kill());
        assert_eq!(o.detected.get(&FaultKind::Kill), None);
    }

    fn report(invariants: Vec<InvariantResult>) -> Report {
        Report {
            name: "t".into(),
            seed: Seed(1),
            mesh: (1, 1),
            policy: MeshPolicy::default(),
            rounds: 1,
            wall: Duration::ZERO,
            faults: BTreeMap::new(),
            detected: BTreeMap::new(),
            recovered: BTreeMap::new(),
            failures_seen: 0,
            recoveries: 0,
            detection: LatencyStats::default(),
            recovery: LatencyStats::default(),
            casts: (0, 0),
            calls: (0, 0),
            deliveries_checked: 0,
            proxy: ProxyCounts::default(),
            host_dropped: BTreeMap::new(),
            generation: 0,
            status: MeshStatus::Running,
            invariants,
            problems: Vec::new(),
        }
    }

    fn all_checked() -> Vec<InvariantResult> {
        names::ALL
            .iter()
            .map(|n| {
                let mut i = InvariantResult::new(n);
                i.check(true, String::new);
                i
            })
            .collect()
    }

    #[test]
    fn a_run_that_checked_every_invariant_has_no_gaps() {
        let r = report(all_checked());
        assert!(r.gaps(&[]).is_empty(), "{:?}", r.gaps(&[]));
        r.assert_clean();
    }

    #[test]
    fn an_invariant_not_run_or_that_checked_nothing_is_a_gap() {
        let mut inv = all_checked();
        inv.retain(|i| i.name != names::FIFO);
        assert_eq!(
            report(inv).gaps(&[]),
            vec![format!("{}: not run", names::FIFO)]
        );
        let mut inv = all_checked();
        inv[0] = InvariantResult::new(inv[0].name);
        let gaps = report(inv).gaps(&[]);
        assert_eq!(gaps.len(), 1);
        assert!(gaps[0].ends_with("checked nothing"), "{gaps:?}");
    }

    #[test]
    fn facts_left_unchecked_are_gaps() {
        let mut inv = all_checked();
        inv[1].not_checked("a truncated log".into());
        let gaps = report(inv).gaps(&[]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(gaps[0].contains("a truncated log"));
    }

    #[test]
    #[should_panic(expected = "checked nothing")]
    fn assert_clean_fails_on_an_invariant_that_checked_nothing() {
        let mut inv = all_checked();
        inv[2] = InvariantResult::new(inv[2].name);
        report(inv).assert_clean();
    }

    #[test]
    fn an_invariant_allowed_to_skip_must_say_why() {
        let mut inv = all_checked();
        inv[0] = InvariantResult::new(inv[0].name);
        let name = inv[0].name;
        assert_eq!(report(inv.clone()).gaps(&[name]).len(), 1);
        inv[0].not_checked("the mesh stopped".into());
        assert!(report(inv).gaps(&[name]).is_empty());
    }
}
