//! Seeded fault schedules: a pure function from `(seed, config)` to a
//! timeline of faults over a running mesh. Nothing here reads a clock or
//! touches a process; the [`Injector`](crate::Injector) plays a schedule
//! against real procs. The same seed and config always give the same
//! timeline, so a failing run replays from the seed it printed.
//!
//! Targets are positions, not processes: `proc 2` means the proc at proc
//! rank 2 of the mesh *when the fault starts* (a replacement proc takes its
//! predecessor's rank), so a timeline means the same in every replay.

use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use crate::network::LinkFaults;
use crate::rng::{Seed, SimRng};

/// One side of a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// The controller.
    Controller,
    /// The proc at this proc rank of the mesh.
    Proc(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Controller => f.write_str("controller"),
            Self::Proc(p) => write!(f, "proc {p}"),
        }
    }
}

/// The kinds of fault, for mixes and counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL of a proc.
    Kill,
    /// Graceful stop of a proc (SIGTERM, then SIGKILL after a grace).
    Stop,
    /// SIGSTOP of a proc, SIGCONT when the fault ends.
    Pause,
    /// A panic inside one member (the test-only hook).
    Panic,
    /// A proc cut from every node, both ways (blackhole).
    Blackhole,
    /// Two sets of nodes cut from each other, both ways.
    Partition,
    /// Two sets of nodes cut one way.
    OneWayPartition,
    /// Datagram loss.
    Loss,
    /// Delay with jitter.
    Delay,
    /// Duplicated datagrams.
    Duplicate,
    /// Reordered datagrams.
    Reorder,
    /// A bandwidth cap.
    Bandwidth,
    /// A proc's host lost: the proc is cut off and dies, and nothing
    /// reports it (only failure detectors see it). Simulation only.
    HostLoss,
    /// The clock jumps forward: every node's timers due within the jump
    /// fire at once, as after a stall of the whole machine. Simulation
    /// only.
    ClockJump,
    /// A namespace host's switch port down (root; never generated).
    HostCut,
    /// A namespace host's firewall dropping all its traffic (root, nftables;
    /// never generated).
    HostFirewall,
    /// Traffic from one namespace host to another dropped at the bridge
    /// (root, nftables; never generated).
    HostBlock,
}

impl FaultKind {
    /// Every kind a schedule generates, in a fixed order (the kernel-level
    /// host faults need namespaces and come only in given timelines; the
    /// last two are simulated only, with weight 0 in the default mix).
    pub const ALL: [Self; 14] = [
        Self::Kill,
        Self::Stop,
        Self::Pause,
        Self::Panic,
        Self::Blackhole,
        Self::Partition,
        Self::OneWayPartition,
        Self::Loss,
        Self::Delay,
        Self::Duplicate,
        Self::Reorder,
        Self::Bandwidth,
        Self::HostLoss,
        Self::ClockJump,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Stop => "graceful-stop",
            Self::Pause => "pause",
            Self::Panic => "actor-panic",
            Self::Blackhole => "blackhole",
            Self::Partition => "partition",
            Self::OneWayPartition => "one-way-partition",
            Self::Loss => "loss",
            Self::Delay => "delay",
            Self::Duplicate => "duplicate",
            Self::Reorder => "reorder",
            Self::Bandwidth => "bandwidth",
            Self::HostLoss => "host-loss",
            Self::ClockJump => "clock-jump",
            Self::HostCut => "host-link-down",
            Self::HostFirewall => "host-firewall-drop",
            Self::HostBlock => "host-one-way-block",
        }
    }

    /// Whether it changes the network (rather than a process).
    pub fn is_link_fault(self) -> bool {
        !matches!(
            self,
            Self::Kill | Self::Stop | Self::Pause | Self::Panic | Self::HostLoss | Self::ClockJump
        )
    }

    /// Whether only the simulation (`regent sim`) can inject it: real
    /// processes share the machine's clock, and a real proc's exit is
    /// always reported by its allocator.
    pub fn is_simulated_only(self) -> bool {
        matches!(self, Self::HostLoss | Self::ClockJump)
    }
}

/// Parses a comma-separated list of fault kinds (`kill,pause,loss`; the
/// names of [`FaultKind::name`]).
pub fn parse_fault_kinds(text: &str) -> Result<Vec<FaultKind>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            FaultKind::ALL
                .into_iter()
                .find(|k| k.name() == t)
                .ok_or_else(|| {
                    let known: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                    format!("unknown fault kind {t:?} (known: {})", known.join(", "))
                })
        })
        .collect()
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL the proc at this proc rank.
    Kill {
        /// The proc rank.
        proc: u32,
    },
    /// Stop it gracefully (SIGTERM, SIGKILL after the grace).
    Stop {
        /// The proc rank.
        proc: u32,
    },
    /// SIGSTOP it; SIGCONT when the fault ends.
    Pause {
        /// The proc rank.
        proc: u32,
    },
    /// Make the member at this rank panic.
    Panic {
        /// The member rank.
        rank: u32,
    },
    /// Cut the proc from every node, both ways.
    Blackhole {
        /// The proc rank.
        proc: u32,
    },
    /// Cut two sets of nodes from each other.
    Partition {
        /// One side.
        a: Vec<Target>,
        /// The other side.
        b: Vec<Target>,
        /// Only from `a` to `b`.
        one_way: bool,
    },
    /// Degrade links: those of one proc, or every link.
    Degrade {
        /// The proc whose links (both ways, to everyone) degrade; `None`
        /// for every link.
        proc: Option<u32>,
        /// The faults.
        faults: LinkFaults,
        /// Which kind of degradation this is (for counts).
        kind: FaultKind,
    },
    /// Take a namespace host's switch port down (both ways).
    HostCut {
        /// The host (1-based).
        host: u32,
    },
    /// Make a namespace host's firewall drop all its traffic (nftables).
    HostFirewall {
        /// The host (1-based).
        host: u32,
    },
    /// Drop traffic from one namespace host to another at the bridge (host
    /// 0 is the root namespace, where the controller runs).
    HostBlock {
        /// From this host.
        from: u32,
        /// To this one.
        to: u32,
    },
    /// Lose the host of the proc at this proc rank: cut off and killed,
    /// with no exit report (simulation only).
    HostLoss {
        /// The proc rank.
        proc: u32,
    },
    /// Move the clock forward by this much at once (simulation only).
    ClockJump {
        /// How far.
        by: Duration,
    },
}

impl Fault {
    /// Its kind.
    pub fn kind(&self) -> FaultKind {
        match self {
            Self::Kill { .. } => FaultKind::Kill,
            Self::Stop { .. } => FaultKind::Stop,
            Self::Pause { .. } => FaultKind::Pause,
            Self::Panic { .. } => FaultKind::Panic,
            Self::Blackhole { .. } => FaultKind::Blackhole,
            Self::Partition { one_way: false, .. } => FaultKind::Partition,
            Self::Partition { one_way: true, .. } => FaultKind::OneWayPartition,
            Self::Degrade { kind, .. } => *kind,
            Self::HostCut { .. } => FaultKind::HostCut,
            Self::HostFirewall { .. } => FaultKind::HostFirewall,
            Self::HostBlock { .. } => FaultKind::HostBlock,
            Self::HostLoss { .. } => FaultKind::HostLoss,
            Self::ClockJump { .. } => FaultKind::ClockJump,
        }
    }
}

fn list(targets: &[Target]) -> String {
    let t: Vec<String> = targets.iter().map(ToString::to_string).collect();
    format!("{{{}}}", t.join(", "))
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kill { proc } => write!(f, "kill proc {proc} (SIGKILL)"),
            Self::Stop { proc } => write!(f, "stop proc {proc} (SIGTERM)"),
            Self::Pause { proc } => write!(f, "pause proc {proc} (SIGSTOP)"),
            Self::Panic { rank } => write!(f, "panic member {rank}"),
            Self::Blackhole { proc } => write!(f, "blackhole proc {proc}"),
            Self::Partition { a, b, one_way } => write!(
                f,
                "partition {} {} {}",
                list(a),
                if *one_way { "->" } else { "<->" },
                list(b)
            ),
            Self::Degrade { proc, faults, .. } => match proc {
                Some(p) => write!(f, "links of proc {p}: {}", crate::proxy::describe(faults)),
                None => write!(f, "all links: {}", crate::proxy::describe(faults)),
            },
            Self::HostCut { host } => write!(f, "host {host}: link down"),
            Self::HostFirewall { host } => write!(f, "host {host}: firewall drops all"),
            Self::HostBlock { from, to } => {
                write!(f, "hosts {from} -> {to}: blocked at the bridge")
            }
            Self::HostLoss { proc } => write!(f, "lose the host of proc {proc}"),
            Self::ClockJump { by } => {
                write!(f, "clock jumps {:.3}s forward", by.as_secs_f64())
            }
        }
    }
}

/// The bounds of a clock jump: from below the heartbeat period to beyond
/// the default failure timeout (1 s), so that some jumps make every failure
/// detector fire at once.
pub const MIN_CLOCK_JUMP: Duration = Duration::from_millis(50);
/// See [`MIN_CLOCK_JUMP`].
pub const MAX_CLOCK_JUMP: Duration = Duration::from_millis(1500);

/// A fault at a time of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledFault {
    /// When it starts, from the start of the fault phase.
    pub at: Duration,
    /// What.
    pub fault: Fault,
    /// How long it lasts (`None`: instantaneous, as a kill).
    pub lasts: Option<Duration>,
}

impl fmt::Display for ScheduledFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{:>8.3}s {}", self.at.as_secs_f64(), self.fault)?;
        if let Some(d) = self.lasts {
            write!(f, " for {:.3}s", d.as_secs_f64())?;
        }
        Ok(())
    }
}

/// Weights of each kind in a schedule (0 leaves a kind out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultMix {
    /// Weight of each kind of [`FaultKind::ALL`], in that order.
    pub weights: [u32; 14],
}

impl Default for FaultMix {
    /// Every kind but the simulated-only ones, process faults and
    /// partitions twice as likely as link degradations.
    fn default() -> Self {
        Self {
            weights: [2, 1, 2, 1, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0],
        }
    }
}

impl FaultMix {
    /// No fault at all.
    pub fn none() -> Self {
        Self { weights: [0; 14] }
    }

    /// Sets the weight of one kind.
    pub fn with(mut self, kind: FaultKind, weight: u32) -> Self {
        if let Some(i) = FaultKind::ALL.iter().position(|k| *k == kind) {
            self.weights[i] = weight;
        }
        self
    }

    /// Only these kinds, with weight 1 each.
    pub fn only(kinds: &[FaultKind]) -> Self {
        kinds.iter().fold(Self::none(), |m, k| m.with(*k, 1))
    }
}

/// What a schedule is generated from, with documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleConfig {
    /// Faults start within this long. Default 10 s.
    pub duration: Duration,
    /// Procs in the mesh. Default 4.
    pub procs: u32,
    /// Members per proc. Default 2.
    pub per_proc: u32,
    /// Mean time between two fault starts (each gap is uniform in half to
    /// one and a half of it). Default 2 s.
    pub mean_gap: Duration,
    /// How long lasting faults (pauses, partitions, degradations) last:
    /// uniform in this range. Default 0.3–3 s.
    pub lasting: (Duration, Duration),
    /// The mix of kinds. Default [`FaultMix::default`].
    pub mix: FaultMix,
    /// At most this many lasting faults at once (a new one waits for one
    /// to end). Default 2.
    pub max_concurrent: u32,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(10),
            procs: 4,
            per_proc: 2,
            mean_gap: Duration::from_secs(2),
            lasting: (Duration::from_millis(300), Duration::from_secs(3)),
            mix: FaultMix::default(),
            max_concurrent: 2,
        }
    }
}

impl ScheduleConfig {
    /// Sets the duration.
    pub fn duration(mut self, d: Duration) -> Self {
        self.duration = d;
        self
    }

    /// Sets the mesh's size.
    pub fn mesh(mut self, procs: u32, per_proc: u32) -> Self {
        self.procs = procs;
        self.per_proc = per_proc;
        self
    }

    /// Sets the mean gap.
    pub fn mean_gap(mut self, d: Duration) -> Self {
        self.mean_gap = d;
        self
    }

    /// Sets the range of lasting faults' durations.
    pub fn lasting(mut self, lo: Duration, hi: Duration) -> Self {
        self.lasting = (lo, hi.max(lo));
        self
    }

    /// Sets the mix.
    pub fn mix(mut self, mix: FaultMix) -> Self {
        self.mix = mix;
        self
    }

    /// Sets the limit of concurrent lasting faults.
    pub fn max_concurrent(mut self, n: u32) -> Self {
        self.max_concurrent = n.max(1);
        self
    }
}

/// A fault timeline, generated from a seed.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// The seed it came from.
    pub seed: Seed,
    /// The faults, by start time.
    pub faults: Vec<ScheduledFault>,
}

impl Schedule {
    /// The timeline of `config` for `seed`: the same for the same inputs,
    /// always.
    pub fn generate(seed: Seed, config: &ScheduleConfig) -> Self {
        let mut rng = SimRng::new(seed.derive("schedule"));
        let mut faults = Vec::new();
        let procs = config.procs.max(1);
        let members = procs * config.per_proc.max(1);
        let mut t = Duration::ZERO;
        // End times of the lasting faults in force.
        let mut lasting_ends: Vec<Duration> = Vec::new();
        let half = config.mean_gap / 2;
        loop {
            t += rng.duration(half, config.mean_gap + half);
            if t >= config.duration {
                break;
            }
            let Some(i) = rng.weighted(&config.mix.weights) else {
                break;
            };
            let kind = FaultKind::ALL[i];
            let lasts = match kind {
                FaultKind::Kill
                | FaultKind::Stop
                | FaultKind::Panic
                | FaultKind::HostLoss
                | FaultKind::ClockJump => None,
                _ => Some(rng.duration(config.lasting.0, config.lasting.1)),
            };
            if lasts.is_some() {
                lasting_ends.retain(|end| *end > t);
                if lasting_ends.len() >= config.max_concurrent as usize {
                    // Wait for the first to end.
                    let first = lasting_ends.iter().min().copied().unwrap_or(t);
                    t = first + Duration::from_millis(1);
                    if t >= config.duration {
                        break;
                    }
                    lasting_ends.retain(|end| *end > t);
                }
            }
            let proc = rng.below(u64::from(procs)) as u32;
            let fault = match kind {
                FaultKind::Kill => Fault::Kill { proc },
                FaultKind::Stop => Fault::Stop { proc },
                FaultKind::Pause => Fault::Pause { proc },
                FaultKind::Panic => Fault::Panic {
                    rank: rng.below(u64::from(members)) as u32,
                },
                FaultKind::Blackhole => Fault::Blackhole { proc },
                FaultKind::HostLoss => Fault::HostLoss { proc },
                FaultKind::ClockJump => Fault::ClockJump {
                    by: rng.duration(MIN_CLOCK_JUMP, MAX_CLOCK_JUMP),
                },
                FaultKind::Partition | FaultKind::OneWayPartition => {
                    partition(&mut rng, procs, kind == FaultKind::OneWayPartition)
                }
                FaultKind::Loss
                | FaultKind::Delay
                | FaultKind::Duplicate
                | FaultKind::Reorder
                | FaultKind::Bandwidth => {
                    let faults = degradation(&mut rng, kind);
                    // Half of them hit one proc's links, half every link.
                    let proc = if rng.chance(0.5) { Some(proc) } else { None };
                    Fault::Degrade { proc, faults, kind }
                }
                // Not in ALL: never drawn.
                FaultKind::HostCut | FaultKind::HostFirewall | FaultKind::HostBlock => continue,
            };
            if let Some(d) = lasts {
                lasting_ends.push(t + d);
            }
            faults.push(ScheduledFault {
                at: t,
                fault,
                lasts,
            });
        }
        Self { seed, faults }
    }

    /// How many faults of each kind.
    pub fn counts(&self) -> std::collections::BTreeMap<FaultKind, u64> {
        let mut m = std::collections::BTreeMap::new();
        for f in &self.faults {
            *m.entry(f.fault.kind()).or_insert(0) += 1;
        }
        m
    }

    /// When the last fault ends.
    pub fn end(&self) -> Duration {
        self.faults
            .iter()
            .map(|f| f.at + f.lasts.unwrap_or_default())
            .max()
            .unwrap_or_default()
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule of seed {} ({} faults):",
            self.seed,
            self.faults.len()
        )?;
        for s in &self.faults {
            writeln!(f, "  {s}")?;
        }
        Ok(())
    }
}

/// A partition of the controller and the procs into two non-empty sides
/// (one proc with the controller or a group of procs against the rest).
fn partition(rng: &mut SimRng, procs: u32, one_way: bool) -> Fault {
    let mut nodes: Vec<Target> = vec![Target::Controller];
    nodes.extend((0..procs).map(Target::Proc));
    // Side a: 1 to half of the procs; the controller on either side.
    let k = 1 + rng.below(u64::from((procs / 2).max(1))) as u32;
    let picked = rng.subset(procs, k);
    let a: Vec<Target> = picked.iter().map(|p| Target::Proc(*p)).collect();
    let b: Vec<Target> = nodes.into_iter().filter(|t| !a.contains(t)).collect();
    // The controller may also sit on a's side (cutting procs from procs).
    let (a, b) = if procs > 2 && rng.chance(0.25) {
        let mut a2 = a;
        a2.push(Target::Controller);
        let b2: Vec<Target> = b.into_iter().filter(|t| *t != Target::Controller).collect();
        (a2, b2)
    } else {
        (a, b)
    };
    if one_way && rng.chance(0.5) {
        Fault::Partition {
            a: b,
            b: a,
            one_way,
        }
    } else {
        Fault::Partition { a, b, one_way }
    }
}

fn degradation(rng: &mut SimRng, kind: FaultKind) -> LinkFaults {
    let ms = Duration::from_millis;
    match kind {
        FaultKind::Loss => LinkFaults::new().drop_probability(rng.between(5, 40) as f64 / 100.0),
        FaultKind::Delay => {
            let d = ms(rng.between(20, 300));
            let j = ms(rng.between(0, d.as_millis() as u64 / 2));
            LinkFaults::new().delay(d, j)
        }
        FaultKind::Duplicate => {
            LinkFaults::new().duplicate_probability(rng.between(5, 50) as f64 / 100.0)
        }
        FaultKind::Reorder => {
            LinkFaults::new().reorder_probability(rng.between(5, 40) as f64 / 100.0)
        }
        FaultKind::Bandwidth => {
            LinkFaults::new().bandwidth_bytes_per_sec(NonZeroU64::new(rng.between(32, 256) * 1024))
        }
        _ => LinkFaults::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_lists_parse() {
        assert_eq!(
            parse_fault_kinds("kill, loss").unwrap(),
            vec![FaultKind::Kill, FaultKind::Loss]
        );
        assert!(parse_fault_kinds("kill,meteor").is_err());
        assert_eq!(
            parse_fault_kinds("host-loss,clock-jump").unwrap(),
            vec![FaultKind::HostLoss, FaultKind::ClockJump]
        );
    }

    #[test]
    fn the_same_seed_replays_the_same_timeline() {
        let config = ScheduleConfig::default().duration(Duration::from_secs(60));
        let a = Schedule::generate(Seed(11), &config);
        let b = Schedule::generate(Seed(11), &config);
        assert_eq!(a, b);
        assert_eq!(a.to_string(), b.to_string());
        assert!(!a.faults.is_empty());
        let c = Schedule::generate(Seed(12), &config);
        assert_ne!(a, c);
    }

    #[test]
    fn schedules_respect_their_config() {
        for seed in 0..200 {
            let config = ScheduleConfig::default()
                .duration(Duration::from_secs(30))
                .mesh(5, 2)
                .max_concurrent(2);
            let s = Schedule::generate(Seed(seed), &config);
            let mut last = Duration::ZERO;
            for (i, f) in s.faults.iter().enumerate() {
                assert!(f.at >= last && f.at < config.duration, "{s}");
                last = f.at;
                match &f.fault {
                    Fault::Kill { proc } | Fault::Stop { proc } | Fault::Pause { proc } => {
                        assert!(*proc < 5)
                    }
                    Fault::Panic { rank } => assert!(*rank < 10),
                    Fault::Partition { a, b, .. } => {
                        assert!(!a.is_empty() && !b.is_empty());
                        assert!(a.iter().all(|t| !b.contains(t)), "{s}");
                    }
                    _ => {}
                }
                // Never more than max_concurrent lasting faults at once.
                let overlapping = s.faults[..=i]
                    .iter()
                    .filter(|g| g.lasts.is_some_and(|d| g.at + d > f.at))
                    .count();
                assert!(overlapping <= 2, "seed {seed}: {s}");
            }
        }
    }

    #[test]
    fn simulated_only_kinds_come_only_when_asked_and_within_bounds() {
        let long = ScheduleConfig::default().duration(Duration::from_secs(120));
        for seed in 0..50 {
            let s = Schedule::generate(Seed(seed), &long);
            assert!(
                s.faults.iter().all(|f| !f.fault.kind().is_simulated_only()),
                "{s}"
            );
        }
        let only = long.mix(FaultMix::only(&[FaultKind::HostLoss, FaultKind::ClockJump]));
        let s = Schedule::generate(Seed(1), &only);
        let counts = s.counts();
        assert!(counts[&FaultKind::HostLoss] > 0 && counts[&FaultKind::ClockJump] > 0);
        for f in &s.faults {
            assert_eq!(f.lasts, None, "{s}");
            match &f.fault {
                Fault::HostLoss { proc } => assert!(*proc < 4),
                Fault::ClockJump { by } => {
                    assert!((MIN_CLOCK_JUMP..=MAX_CLOCK_JUMP).contains(by), "{s}")
                }
                other => panic!("{other} in {s}"),
            }
        }
    }

    #[test]
    fn a_mix_leaves_kinds_out() {
        let config = ScheduleConfig::default()
            .duration(Duration::from_secs(60))
            .mix(FaultMix::only(&[FaultKind::Kill]));
        let s = Schedule::generate(Seed(3), &config);
        assert!(s.faults.iter().all(|f| f.fault.kind() == FaultKind::Kill));
        let none = ScheduleConfig::default().mix(FaultMix::none());
        assert!(Schedule::generate(Seed(3), &none).faults.is_empty());
    }
}
