//! The chaos scenario under deterministic simulation (feature `sim`): the
//! real controller runtime and in-process procs on one seeded simulated
//! network ([`regent_mesh::simnet`]), on one thread under a paused clock;
//! the chaos crate's workload ([`Tally`] members, a caster keeping casts in
//! flight, a caller), a fault timeline generated from the seed
//! ([`Schedule::generate`]: kills, stops, pauses and resumes, member
//! panics, blackholes, one- and two-way partitions, loss, delay,
//! duplication, reordering), then healing, settling and every checker of
//! [`crate::invariant`] on what the run recorded.
//!
//! A seed decides everything: the timeline, every datagram's fate, quinn's
//! and the procs' randomness. [`run_seed`] returns the run's history (the
//! timeline, the failures the owner saw, the generations, the verdicts, with
//! simulated times) and a hash of it together with the network's trace: the
//! same seed gives the same hash (`regent sim --seed S --trace` replays
//! one).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regent_mesh::bugs::{PlantedBug, plant};
use regent_mesh::simnet::{SimAllocator, SimCluster, simulate};
use regent_mesh::{ActorMesh, Decision, MeshPolicy, RuntimeConfig, SpawnOptions};
use regent_net::ProcId;
use regent_net::sim::{LinkFaults as SimLinkFaults, SimNet};
use regent_supervisor::Backoff;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::injector::{
    FaultPlane, Injection, cut_off_procs, panic_member, play, proc_at, rank_selection,
};
use crate::invariant::CallRecord;
use crate::invariant::{self, InvariantResult, OrderProgress, SupervisionLog, names};
use crate::network::LinkFaults;
use crate::rng::{Seed, SimRng};
use crate::scenario::{
    Ledger, Observed, WorkloadConfig, caller, caster, census, expect_effect, lock, merge_into,
    not_checked, reports, sample_generations, settle, watch_failures,
};
use crate::schedule::{Fault, FaultKind, FaultMix, Schedule, ScheduleConfig, Target};
use crate::workload::{Tally, TallyArgs, TallyMsg, TallyReply};

/// The simulated scenario, with documented defaults.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Procs. Default 3.
    pub procs: u32,
    /// Members per proc. Default 2.
    pub per_proc: u32,
    /// The mesh's policy. Default `None`: drawn from the seed (see
    /// [`draw_policy`]), so that seeds restart under every policy.
    pub policy: Option<MeshPolicy>,
    /// How timelines are generated (its mesh size follows `procs` and
    /// `per_proc`). Default: 6 s of faults of every kind but bandwidth
    /// caps, 1.5 s apart on average, lasting 0.3–2 s.
    pub schedule: ScheduleConfig,
    /// The workload. Default: a cast every 20 ms, 8 in flight; a call every
    /// 100 ms with a 4 s deadline.
    pub workload: WorkloadConfig,
    /// The cast trees' fan-out. Default `None`: drawn from the seed among
    /// 1 (a chain through every proc), 2 and 16 (the controller casts to
    /// each proc), so that most seeds forward casts proc to proc and a
    /// restart's update can overtake a cast on its way down.
    pub fanout: Option<NonZeroU32>,
    /// The control plane's failure timeout. Default 1 s.
    pub failure_timeout: Duration,
    /// How long the mesh may take to run and answer again after healing.
    /// Default 40 s (simulated).
    pub settle_timeout: Duration,
    /// A quiet period with no restart that counts as settled. Default 2.5 s.
    pub quiet: Duration,
    /// Allowance over a call's deadline. Default 0.5 s: simulated time has
    /// no scheduling noise, only what the timers and the network add.
    pub call_slack: Duration,
    /// Known bugs planted in the runtime for the run (to check the
    /// checkers). Default none.
    pub bugs: Vec<PlantedBug>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            procs: 3,
            per_proc: 2,
            policy: None,
            schedule: ScheduleConfig::default()
                .duration(Duration::from_secs(6))
                .mean_gap(Duration::from_millis(1500))
                .lasting(Duration::from_millis(300), Duration::from_secs(2))
                .mix(
                    FaultMix::default()
                        .with(FaultKind::Bandwidth, 0)
                        .with(FaultKind::HostLoss, 1)
                        .with(FaultKind::ClockJump, 1),
                ),
            workload: WorkloadConfig {
                cast_interval: Duration::from_millis(20),
                casts_in_flight: NonZeroU32::new(8).unwrap_or(NonZeroU32::MIN),
                call_interval: Duration::from_millis(100),
                call_deadline: Duration::from_secs(4),
                fire_and_forget: 2,
                acknowledged_together: 2,
            },
            fanout: None,
            failure_timeout: Duration::from_secs(1),
            settle_timeout: Duration::from_secs(40),
            quiet: Duration::from_millis(2500),
            call_slack: Duration::from_millis(500),
            bugs: Vec::new(),
        }
    }
}

/// What one seed's run came to.
#[derive(Debug, Clone)]
pub struct SimOutcome {
    /// The seed.
    pub seed: u64,
    /// The history and the network's trace, hashed together (FNV-1a).
    pub hash: u64,
    /// The history: timeline, failures, generations, verdicts, with
    /// simulated times.
    pub history: Vec<String>,
    /// Every invariant's verdict.
    pub invariants: Vec<InvariantResult>,
    /// Problems outside the invariants (the run could not start, the mesh
    /// did not recover).
    pub problems: Vec<String>,
    /// Faults that applied, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// The final generation.
    pub generation: u64,
    /// Simulated time of the run.
    pub simulated: Duration,
    /// Datagrams' events in the network's trace.
    pub trace_events: u64,
}

impl SimOutcome {
    /// Violations of invariants plus problems.
    pub fn violations(&self) -> u64 {
        self.invariants.iter().map(|i| i.violations).sum::<u64>() + self.problems.len() as u64
    }

    /// What went wrong, a line each (empty when the run was clean).
    pub fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self.problems.clone();
        for i in &self.invariants {
            for e in &i.examples {
                out.push(format!("{}: {e}", i.name));
            }
            if i.violations > i.examples.len() as u64 {
                out.push(format!(
                    "{}: and {} more",
                    i.name,
                    i.violations - i.examples.len() as u64
                ));
            }
        }
        out
    }
}

/// Runs the scenario for `seed` on a fresh simulated runtime: see the
/// module documentation.
pub fn run_seed(seed: u64, config: &SimConfig) -> SimOutcome {
    // Every task of the run runs on this thread.
    let _planted = plant(&config.bugs);
    simulate(|| run(seed, config))
}

/// The mesh's policy for a seed: restart the failed members (half the
/// seeds), restart the whole mesh (a third), stop or escalate (the rest);
/// a restarting policy allows 100 restarts in 60 s, or in a fifth of the
/// seeds only 2 in 10 s, so that a timeline exhausts it and the mesh gives
/// up; a third of them back off (10 ms doubling to 200 ms).
pub fn draw_policy(seed: u64) -> MeshPolicy {
    let mut rng = SimRng::new(Seed(seed).derive("policy"));
    let decisions = [
        Decision::RestartMember,
        Decision::RestartMesh,
        Decision::Stop,
        Decision::Escalate,
    ];
    let on_failure = decisions[rng.weighted(&[6, 4, 1, 1]).unwrap_or(0)];
    let mut policy = MeshPolicy::new(on_failure);
    policy = if rng.chance(0.2) {
        policy.intensity(2, Duration::from_secs(10))
    } else {
        policy.intensity(100, Duration::from_secs(60))
    };
    if rng.chance(1.0 / 3.0) {
        policy = policy.backoff(Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(200),
            reset_after: Duration::from_secs(1),
        });
    }
    policy
}

/// FNV-1a, 64 bits: stable across runs, builds and platforms.
fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The history of a run, each line with its simulated time.
struct History {
    start: Instant,
    lines: Vec<String>,
}

impl History {
    fn record(&mut self, what: impl std::fmt::Display) {
        let at = self.start.elapsed().as_secs_f64();
        self.lines.push(format!("{at:>11.6}s {what}"));
    }
}

async fn run(seed: u64, config: &SimConfig) -> SimOutcome {
    let mut history = History {
        start: Instant::now(),
        lines: Vec::new(),
    };
    let mut outcome = SimOutcome {
        seed,
        hash: 0,
        history: Vec::new(),
        invariants: names::ALL.iter().map(|n| InvariantResult::new(n)).collect(),
        problems: Vec::new(),
        faults: BTreeMap::new(),
        generation: 0,
        simulated: Duration::ZERO,
        trace_events: 0,
    };
    let fanout = config.fanout.unwrap_or_else(|| {
        let mut rng = SimRng::new(Seed(seed).derive("fanout"));
        let choices = [1, 2, 16];
        NonZeroU32::new(choices[rng.below(choices.len() as u64) as usize])
            .unwrap_or(NonZeroU32::MIN)
    });
    history.record(format_args!("cast fan-out {fanout}"));
    let policy = config.policy.unwrap_or_else(|| draw_policy(seed));
    history.record(format_args!(
        "policy: {}, {} restarts in {:?}, backoff {:?}",
        policy.on_failure, policy.intensity.max_restarts, policy.intensity.period, policy.backoff
    ));
    let runtime = RuntimeConfig::default()
        .fanout(fanout)
        .endpoint(regent_net::EndpointConfig::default().failure_timeout(config.failure_timeout));
    let cluster = match SimCluster::start(seed, config.procs as usize, runtime).await {
        Ok(c) => c,
        Err(e) => {
            outcome
                .problems
                .push(format!("the cluster did not start: {e}"));
            return finish(outcome, history, None);
        }
    };
    if let Err(e) = play_round(seed, config, policy, &cluster, &mut history, &mut outcome).await {
        outcome.problems.push(e);
    }
    let net = cluster.net().clone();
    drop(cluster);
    finish(outcome, history, Some(&net))
}

fn finish(mut outcome: SimOutcome, mut history: History, net: Option<&SimNet>) -> SimOutcome {
    for i in &outcome.invariants {
        history.record(format_args!(
            "{}: {} checked, {} violated",
            i.name, i.checked, i.violations
        ));
    }
    for p in &outcome.problems {
        history.record(format_args!("problem: {p}"));
    }
    outcome.simulated = history.start.elapsed();
    let mut hash = 0xcbf2_9ce4_8422_2325;
    for line in &history.lines {
        hash = fnv(hash, line.as_bytes());
        hash = fnv(hash, b"\n");
    }
    if let Some(net) = net {
        hash = fnv(hash, &net.trace_hash().to_le_bytes());
        outcome.trace_events = net.trace_events();
    }
    outcome.hash = hash;
    outcome.history = history.lines;
    outcome
}

/// One round of the chaos scenario (see `crate::scenario::run`): the
/// workload under the seed's timeline, healing, settling, checking.
async fn play_round(
    seed: u64,
    config: &SimConfig,
    policy: MeshPolicy,
    cluster: &SimCluster,
    history: &mut History,
    outcome: &mut SimOutcome,
) -> Result<(), String> {
    let mesh = cluster
        .procs()
        .spawn_with::<Tally>(
            "tally",
            config.per_proc,
            &TallyArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .map_err(|e| format!("the mesh did not spawn: {e}"))?;
    let members = config.procs * config.per_proc;
    let initial = census(&mesh).await.map_err(|e| e.to_string())?;
    let schedule = Schedule::generate(
        Seed(seed).derive("sim"),
        &config.schedule.clone().mesh(config.procs, config.per_proc),
    );
    for f in &schedule.faults {
        history.record(format_args!("planned {f}"));
    }
    let obs = Arc::new(Mutex::new(Observed::default()));
    let observers = [
        tokio::spawn(watch_failures(mesh.clone(), obs.clone())),
        tokio::spawn(sample_generations(mesh.clone(), obs.clone())),
    ];
    let seq = Arc::new(AtomicU64::new(1));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let workers = [
        tokio::spawn(caster(
            mesh.clone(),
            seq.clone(),
            ledger.clone(),
            config.workload.clone(),
            stop_rx.clone(),
        )),
        tokio::spawn(caller(
            mesh.clone(),
            seq.clone(),
            ledger.clone(),
            config.workload.clone(),
            members,
            stop_rx,
        )),
    ];
    let t0 = Instant::now();
    let nests = Arc::new(Mutex::new(Vec::new()));
    let nester = tokio::spawn(nester(
        mesh.clone(),
        ledger.clone(),
        plan_nests(seed, config, members),
        config.workload.call_deadline,
        t0,
        nests.clone(),
    ));
    let mut plane = SimPlane::new(cluster, mesh.clone());
    play(&mut plane, &schedule.faults, |sf, inj| {
        expect_effect(&obs, sf, inj);
    })
    .await;
    tokio::time::sleep_until(t0 + config.schedule.duration.max(schedule.end())).await;
    plane.heal_all().await;
    history.record("healed");
    let _ = stop_tx.send(true);
    for w in workers {
        let _ = w.await;
    }
    let _ = nester.await;
    for line in std::mem::take(&mut *lock(&nests)) {
        history.lines.push(line);
    }
    let settled = settle(&mesh, config.settle_timeout, config.quiet).await;
    history.record(format_args!(
        "settled: {settled:?}, status {:?}, generation {}",
        mesh.status(),
        mesh.generation().0
    ));
    let to = seq.load(std::sync::atomic::Ordering::Relaxed);
    let ledger = std::mem::take(&mut *lock(&ledger));
    let invariants = &mut outcome.invariants;
    let mut finals = BTreeMap::new();
    match &settled {
        Ok(()) if !mesh.status().is_done() => match reports(&mesh, 1).await {
            Ok(reps) => {
                finals = reps.iter().map(|r| (r.life.rank, r.life)).collect();
                let (lost, once) = invariant::check_delivery(&ledger.sends, &reps, 1, to);
                merge_into(invariants, &lost);
                merge_into(invariants, &once);
                let (fifo, _) = invariant::check_order(&reps, &OrderProgress::new());
                merge_into(invariants, &fifo);
            }
            Err(e) => {
                not_checked(
                    invariants,
                    &format!("the members' logs could not be read ({e})"),
                );
                outcome.problems.push(e);
            }
        },
        Ok(()) => not_checked(invariants, "the policy stopped the mesh: its logs are gone"),
        Err(e) => {
            not_checked(invariants, "the mesh did not recover");
            outcome.problems.push(e.clone());
        }
    }
    merge_into(
        invariants,
        &invariant::check_calls(&ledger.calls, config.call_slack),
    );
    let status = mesh.status();
    let generation = mesh.generation().0;
    for o in &observers {
        o.abort();
    }
    let sup = {
        let o = lock(&obs);
        for (at, ranks) in &o.failures {
            history.lines.push(format!(
                "{:>11.6}s failure seen: ranks {ranks:?}",
                at.duration_since(history.start).as_secs_f64()
            ));
        }
        for (at, g) in &o.generations {
            history.lines.push(format!(
                "{:>11.6}s generation {g}",
                at.duration_since(history.start).as_secs_f64()
            ));
        }
        merge_into(
            invariants,
            &invariant::check_generations(&o.generations, &ledger.replies),
        );
        SupervisionLog {
            policy,
            initial,
            finals,
            failures: o.failures.clone(),
            failures_missed: o.failures_missed,
            generations: o.generations.clone(),
            status,
            generation,
            tolerance: Duration::from_secs(5),
        }
    };
    merge_into(invariants, &invariant::check_restarts(&sup));
    // Processes are tasks here: what can outlive its owner is a mesh.
    let orphans = check_nested_owners(cluster, &mesh, config.quiet * 2).await;
    if orphans.checked == 0 && orphans.violations == 0 {
        if let Some(i) = invariants.iter_mut().find(|i| i.name == names::NO_ORPHANS) {
            i.not_checked("no nested mesh lived in this run (procs are tasks here)".into());
        }
    } else {
        merge_into(invariants, &orphans);
    }
    outcome.faults = plane.counts;
    outcome.generation = generation;
    let _ = tokio::time::timeout(Duration::from_secs(10), mesh.stop()).await;
    Ok(())
}

/// When the workload asks which member to spawn a nested mesh
/// ([`TallyMsg::Nest`]): none, one or two times in the fault phase, each at
/// a member drawn from the seed.
fn plan_nests(seed: u64, config: &SimConfig, members: u32) -> Vec<(Duration, u32)> {
    let mut rng = SimRng::new(Seed(seed).derive("nest"));
    let n = rng.below(3);
    let mut plan: Vec<(Duration, u32)> = (0..n)
        .map(|_| {
            let at = rng.duration(Duration::ZERO, config.schedule.duration);
            (at, rng.below(u64::from(members.max(1))) as u32)
        })
        .collect();
    plan.sort();
    plan
}

/// Asks members to spawn nested meshes as `plan` says (times from `t0`):
/// each a call with `deadline`, recorded for the deadline checker, its
/// outcome a line of the history.
async fn nester(
    mesh: ActorMesh<Tally>,
    ledger: Arc<Mutex<Ledger>>,
    plan: Vec<(Duration, u32)>,
    deadline: Duration,
    t0: Instant,
    lines: Arc<Mutex<Vec<String>>>,
) {
    for (at, rank) in plan {
        tokio::time::sleep_until(t0 + at).await;
        let Some(selection) = rank_selection(&mesh, rank) else {
            continue;
        };
        let started = Instant::now();
        let r = mesh
            .call_within(&selection, &TallyMsg::Nest, deadline)
            .await;
        let elapsed = started.elapsed();
        let at = started.duration_since(t0).as_secs_f64();
        let (record, line) = match r {
            Ok(vm) => {
                let replied: Vec<u32> = vm.values().iter().map(|(r, _)| r.0).collect();
                let failed: Vec<u32> = vm.failed().iter().map(|(r, _)| r.0).collect();
                let what = match vm.values().first().map(|(_, v)| v) {
                    Some(TallyReply::Nested { life, mesh }) => {
                        format!("rank {rank} (born {}): {mesh:?}", life.born)
                    }
                    _ => format!("rank {rank} failed"),
                };
                let record = CallRecord {
                    deadline,
                    elapsed,
                    selected: 1,
                    replied,
                    failed,
                    error: None,
                };
                (record, what)
            }
            Err(e) => {
                let record = CallRecord {
                    deadline,
                    elapsed,
                    selected: 1,
                    replied: Vec::new(),
                    failed: Vec::new(),
                    error: Some(e.to_string()),
                };
                (record, format!("rank {rank}: {e}"))
            }
        };
        lock(&ledger).calls.push(record);
        lock(&lines).push(format!("{:>11.6}s (fault phase) nest at {line}", at));
    }
}

/// **No mesh outlives its owner** (the simulation's orphans: its procs are
/// tasks): once the mesh has settled, every nested mesh still running or
/// restarting is owned by a current life of its owner's rank (one that
/// says it spawned it); when the mesh is done, none is. A nested mesh of a
/// replaced or stopped life has `grace` to stop.
async fn check_nested_owners(
    cluster: &SimCluster,
    mesh: &ActorMesh<Tally>,
    grace: Duration,
) -> InvariantResult {
    let mut r = InvariantResult::new(names::NO_ORPHANS);
    let top = mesh.id().0;
    let done = mesh.status().is_done();
    let mut owned: BTreeMap<u32, (u64, Vec<u64>)> = BTreeMap::new();
    if !done {
        match mesh
            .call_within(
                &regent_mesh::Selection::All,
                &TallyMsg::Owned,
                Duration::from_secs(10),
            )
            .await
        {
            Ok(vm) => {
                for (rank, reply) in vm.values() {
                    if let TallyReply::Owned { life, meshes } = reply {
                        owned.insert(rank.0, (life.born, meshes.clone()));
                    }
                }
            }
            Err(e) => {
                r.not_checked(format!("the members did not say what they own ({e})"));
                return r;
            }
        }
    }
    let end = Instant::now() + grace;
    loop {
        let snapshot = cluster.runtime().snapshot();
        let nested: Vec<_> = snapshot
            .meshes
            .iter()
            .filter(|m| m.owner.is_some_and(|(id, _)| id == top))
            .collect();
        let orphans: Vec<String> = nested
            .iter()
            .filter(|m| m.status == "running" || m.status == "restarting")
            .filter_map(|m| {
                let (_, rank) = m.owner?;
                let kept = owned.get(&rank).is_some_and(|(_, ids)| ids.contains(&m.id));
                (!kept).then(|| {
                    let owner = match owned.get(&rank) {
                        Some((born, _)) => format!("rank {rank}'s life born in generation {born}"),
                        None => format!("rank {rank}, whose mesh is {:?}", mesh.status()),
                    };
                    format!(
                        "nested mesh {} ({}, generation {}) outlived its owner: {owner} does not own it",
                        m.id, m.status, m.generation
                    )
                })
            })
            .collect();
        if orphans.is_empty() || Instant::now() >= end {
            for m in &nested {
                let orphan = orphans
                    .iter()
                    .find(|o| o.starts_with(&format!("nested mesh {} ", m.id)));
                r.check(orphan.is_none(), || orphan.cloned().unwrap_or_default());
            }
            return r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Faults on a simulated cluster: process faults through its allocator,
/// link faults on its network.
struct SimPlane {
    alloc: Arc<SimAllocator>,
    net: SimNet,
    controller: SocketAddr,
    mesh: ActorMesh<Tally>,
    next: u64,
    paused: BTreeMap<u64, ProcId>,
    /// Link faults in force: cuts (from, to) and degradations.
    cuts: BTreeMap<u64, Vec<(SocketAddr, SocketAddr)>>,
    degraded: BTreeMap<u64, (Option<SocketAddr>, LinkFaults)>,
    /// Every directed pair cut or degraded so far, to reset.
    touched: std::collections::BTreeSet<(SocketAddr, SocketAddr)>,
    counts: BTreeMap<FaultKind, u64>,
}

impl SimPlane {
    fn new(cluster: &SimCluster, mesh: ActorMesh<Tally>) -> Self {
        Self {
            alloc: cluster.allocator().clone(),
            net: cluster.net().clone(),
            controller: cluster.controller_addr(),
            mesh,
            next: 0,
            paused: BTreeMap::new(),
            cuts: BTreeMap::new(),
            degraded: BTreeMap::new(),
            touched: Default::default(),
            counts: BTreeMap::new(),
        }
    }

    fn proc_at(&self, rank: u32) -> Option<ProcId> {
        proc_at(&self.mesh, rank)
    }

    fn addr(&self, target: Target) -> Option<SocketAddr> {
        match target {
            Target::Controller => Some(self.controller),
            Target::Proc(r) => self.proc_at(r).and_then(|p| self.alloc.addr_of(&p)),
        }
    }

    /// The controller and every current proc.
    fn nodes(&self) -> Vec<SocketAddr> {
        let mut all = vec![self.controller];
        all.extend(
            self.mesh
                .procs()
                .iter()
                .filter_map(|a| self.alloc.addr_of(&a.proc)),
        );
        all
    }

    /// Puts the link faults in force on the network, from a clean slate.
    fn apply(&mut self) {
        let clean = SimLinkFaults::default();
        for &(a, b) in &self.touched {
            self.net.repair(a, b);
            let _ = self.net.set_faults(a, b, clean.clone());
        }
        let mut global = LinkFaults::default();
        let mut per_node: BTreeMap<SocketAddr, LinkFaults> = BTreeMap::new();
        for (node, f) in self.degraded.values() {
            match node {
                None => global = global.compose(*f),
                Some(n) => {
                    let e = per_node.entry(*n).or_default();
                    *e = e.compose(*f);
                }
            }
        }
        let _ = self.net.set_default_faults(sim_faults(&global));
        let nodes = self.nodes();
        for (n, f) in &per_node {
            let f = sim_faults(&global.compose(*f));
            for &m in nodes.iter().filter(|m| *m != n) {
                let _ = self.net.set_faults(*n, m, f.clone());
                let _ = self.net.set_faults(m, *n, f.clone());
                self.touched.insert((*n, m));
                self.touched.insert((m, *n));
            }
        }
        for pairs in self.cuts.values() {
            for &(from, to) in pairs {
                self.net.partition_oneway(from, to);
                self.touched.insert((from, to));
            }
        }
    }
}

/// A proxy-style degradation as the simulated network's: loss,
/// duplication, delay with jitter (which reorders), and reordering by a
/// hold of up to 20 ms. Bandwidth caps are not simulated.
fn sim_faults(f: &LinkFaults) -> SimLinkFaults {
    let base = SimLinkFaults::default();
    let lo = (base.latency_min + f.delay).saturating_sub(f.jitter);
    let hi = base.latency_max + f.delay + f.jitter;
    let mut s = base
        .latency(lo, hi.max(lo))
        .loss(f.drop_probability)
        .duplicate(f.duplicate_probability);
    if f.reorder_probability > 0.0 {
        s = s.reorder(f.reorder_probability, Duration::from_millis(20));
    }
    s
}

impl FaultPlane for SimPlane {
    async fn start(&mut self, fault: &Fault) -> Injection {
        let id = self.next;
        self.next += 1;
        let mut inj = Injection {
            id,
            fault: fault.clone(),
            at: Instant::now(),
            procs: Vec::new(),
            ranks: Vec::new(),
            applied: false,
        };
        match fault {
            Fault::Kill { proc } | Fault::Stop { proc } | Fault::Pause { proc } => {
                let Some(p) = self.proc_at(*proc) else {
                    return inj;
                };
                let r = match fault {
                    Fault::Pause { .. } => self.alloc.pause(&p),
                    _ => self.alloc.kill(&p),
                };
                if r.is_err() {
                    return inj;
                }
                if matches!(fault, Fault::Pause { .. }) {
                    self.paused.insert(id, p.clone());
                }
                inj.procs.push(p);
            }
            Fault::Panic { rank } => {
                if !panic_member(&self.mesh, *rank) {
                    return inj;
                }
                inj.ranks.push(*rank);
            }
            Fault::Blackhole { proc } => {
                let Some(p) = self.proc_at(*proc) else {
                    return inj;
                };
                let Some(a) = self.alloc.addr_of(&p) else {
                    return inj;
                };
                let pairs = self
                    .nodes()
                    .into_iter()
                    .filter(|n| *n != a)
                    .flat_map(|n| [(a, n), (n, a)])
                    .collect();
                self.cuts.insert(id, pairs);
                inj.procs.push(p);
            }
            Fault::Partition { a, b, one_way } => {
                let na: Vec<SocketAddr> = a.iter().filter_map(|t| self.addr(*t)).collect();
                let nb: Vec<SocketAddr> = b.iter().filter_map(|t| self.addr(*t)).collect();
                if na.is_empty() || nb.is_empty() {
                    return inj;
                }
                inj.procs = cut_off_procs(a, b, |r| self.proc_at(r));
                let mut pairs = Vec::new();
                for &x in &na {
                    for &y in &nb {
                        pairs.push((x, y));
                        if !one_way {
                            pairs.push((y, x));
                        }
                    }
                }
                self.cuts.insert(id, pairs);
            }
            Fault::Degrade { proc, faults, .. } => {
                let node = match proc {
                    None => None,
                    Some(r) => match self.proc_at(*r).and_then(|p| self.alloc.addr_of(&p)) {
                        Some(a) => Some(a),
                        None => return inj,
                    },
                };
                self.degraded.insert(id, (node, *faults));
            }
            Fault::HostLoss { proc } => {
                let Some(p) = self.proc_at(*proc) else {
                    return inj;
                };
                if self.alloc.lose_host(&p).is_err() {
                    return inj;
                }
                inj.procs.push(p);
            }
            // Every node reads tokio's one clock: the jump is everyone's,
            // as after a stall of the whole machine (timers due within it
            // fire together, datagrams in flight land at once).
            Fault::ClockJump { by } => tokio::time::advance(*by).await,
            // Kernel-level faults of namespace hosts: not simulated.
            Fault::HostCut { .. } | Fault::HostFirewall { .. } | Fault::HostBlock { .. } => {
                return inj;
            }
        }
        if fault.kind().is_link_fault() {
            self.apply();
        }
        inj.applied = true;
        *self.counts.entry(fault.kind()).or_insert(0) += 1;
        inj
    }

    async fn end(&mut self, id: u64) {
        if let Some(p) = self.paused.remove(&id) {
            let _ = self.alloc.resume(&p);
        }
        if self.cuts.remove(&id).is_some() || self.degraded.remove(&id).is_some() {
            self.apply();
        }
    }

    async fn heal_all(&mut self) {
        let ids: Vec<u64> = self.paused.keys().copied().collect();
        for id in ids {
            self.end(id).await;
        }
        self.cuts.clear();
        self.degraded.clear();
        self.apply();
    }
}

pub mod runner;

#[cfg(test)]
mod tests;
