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
use regent_mesh::{ActorMesh, MeshPolicy, RuntimeConfig, SpawnOptions};
use regent_net::ProcId;
use regent_net::sim::{LinkFaults as SimLinkFaults, SimNet};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::injector::{FaultPlane, Injection, cut_off_procs, panic_member, play, proc_at};
use crate::invariant::{self, InvariantResult, OrderProgress, SupervisionLog, names};
use crate::network::LinkFaults;
use crate::rng::{Seed, SimRng};
use crate::scenario::{
    Ledger, Observed, WorkloadConfig, caller, caster, census, expect_effect, lock, merge_into,
    not_checked, reports, sample_generations, settle, watch_failures,
};
use crate::schedule::{Fault, FaultKind, FaultMix, Schedule, ScheduleConfig, Target};
use crate::workload::{Tally, TallyArgs};

/// The simulated scenario, with documented defaults.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Procs. Default 3.
    pub procs: u32,
    /// Members per proc. Default 2.
    pub per_proc: u32,
    /// The mesh's policy. Default: restart members, 100 in 60 s.
    pub policy: MeshPolicy,
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
            policy: MeshPolicy::default().intensity(100, Duration::from_secs(60)),
            schedule: ScheduleConfig::default()
                .duration(Duration::from_secs(6))
                .mean_gap(Duration::from_millis(1500))
                .lasting(Duration::from_millis(300), Duration::from_secs(2))
                .mix(FaultMix::default().with(FaultKind::Bandwidth, 0)),
            workload: WorkloadConfig {
                cast_interval: Duration::from_millis(20),
                casts_in_flight: NonZeroU32::new(8).unwrap_or(NonZeroU32::MIN),
                call_interval: Duration::from_millis(100),
                call_deadline: Duration::from_secs(4),
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
    if let Err(e) = play_round(seed, config, &cluster, &mut history, &mut outcome).await {
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
            SpawnOptions::new().policy(config.policy),
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
            config.workload.cast_interval,
            config.workload.casts_in_flight,
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
            policy: config.policy,
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
    // Processes are tasks here: nothing can outlive the run.
    if let Some(i) = invariants.iter_mut().find(|i| i.name == names::NO_ORPHANS) {
        i.not_checked("procs are tasks of one process in simulation".into());
    }
    outcome.faults = plane.counts;
    outcome.generation = generation;
    let _ = tokio::time::timeout(Duration::from_secs(10), mesh.stop()).await;
    Ok(())
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

#[cfg(test)]
mod tests;
