//! Invariant checkers: pure functions from what a run recorded to a verdict
//! per invariant. Each invariant's exact definition is in
//! `docs/semantics.md` §7; the doc of each checker repeats it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use regent_mesh::{Decision, MeshPolicy, MeshStatus};

use crate::workload::{Life, LifeReport, Sender};

/// Violations kept per invariant (more are counted, not kept).
const MAX_KEPT: usize = 20;

/// The invariants, by name.
pub mod names {
    /// No acknowledged message lost.
    pub const NO_ACKED_LOSS: &str = "no acknowledged message lost";
    /// Each cast delivered exactly once to every live member.
    pub const EXACTLY_ONCE: &str = "each cast delivered exactly once to every live member";
    /// Messages from one sender reach each member life in the order sent.
    pub const FIFO: &str = "messages from one sender reach each member in the order sent";
    /// No process outlives its owner.
    pub const NO_ORPHANS: &str = "no process outlives its owner";
    /// Restarts within the mesh policy.
    pub const RESTARTS: &str = "restarts within the mesh policy";
    /// Calls to dead members fail within their deadline.
    pub const CALL_DEADLINES: &str = "calls to dead members fail within their deadline";
    /// Generations never go backwards; one live member per rank and
    /// generation.
    pub const GENERATIONS: &str =
        "generations never go backwards; one live member per rank and generation";
    /// Every name, in report order.
    pub const ALL: [&str; 7] = [
        NO_ACKED_LOSS,
        EXACTLY_ONCE,
        FIFO,
        NO_ORPHANS,
        RESTARTS,
        CALL_DEADLINES,
        GENERATIONS,
    ];
}

/// The verdict on one invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvariantResult {
    /// Which invariant.
    pub name: &'static str,
    /// How many individual facts were checked.
    pub checked: u64,
    /// How many violated it.
    pub violations: u64,
    /// The first violations, described.
    pub examples: Vec<String>,
    /// Facts that could not be checked (e.g. a truncated log), described.
    pub unchecked: Vec<String>,
}

impl InvariantResult {
    /// A verdict with nothing checked yet.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            checked: 0,
            violations: 0,
            examples: Vec::new(),
            unchecked: Vec::new(),
        }
    }

    /// Counts one fact checked.
    pub fn check(&mut self, holds: bool, describe: impl FnOnce() -> String) {
        self.checked += 1;
        if !holds {
            self.violate(describe());
        }
    }

    /// Records a violation.
    pub fn violate(&mut self, what: String) {
        self.violations += 1;
        if self.examples.len() < MAX_KEPT {
            self.examples.push(what);
        }
    }

    /// Records a fact that could not be checked, and why.
    pub fn not_checked(&mut self, what: String) {
        if self.unchecked.len() < MAX_KEPT {
            self.unchecked.push(what);
        }
    }

    /// Whether it held.
    pub fn ok(&self) -> bool {
        self.violations == 0
    }

    /// Adds another verdict on the same invariant.
    pub fn merge(&mut self, other: &Self) {
        self.checked += other.checked;
        self.violations += other.violations;
        for e in &other.examples {
            if self.examples.len() < MAX_KEPT {
                self.examples.push(e.clone());
            }
        }
        for u in &other.unchecked {
            if self.unchecked.len() < MAX_KEPT {
                self.unchecked.push(u.clone());
            }
        }
    }
}

impl fmt::Display for InvariantResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.ok() { "ok" } else { "VIOLATED" };
        write!(
            f,
            "{:<74} {verdict} ({} checked, {} violations)",
            self.name, self.checked, self.violations
        )?;
        for e in &self.examples {
            write!(f, "\n    - {e}")?;
        }
        for u in &self.unchecked {
            write!(f, "\n    (not checked: {u})")?;
        }
        Ok(())
    }
}

/// Which members acknowledged a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acked {
    /// Every member (the cast or call succeeded for all).
    All,
    /// Every member but these.
    AllBut(Vec<u32>),
    /// Only these (a call's replies).
    Only(Vec<u32>),
    /// None (the operation failed as a whole).
    None,
}

impl Acked {
    /// Whether `rank` acknowledged.
    pub fn contains(&self, rank: u32) -> bool {
        match self {
            Self::All => true,
            Self::AllBut(r) => !r.contains(&rank),
            Self::Only(r) => r.contains(&rank),
            Self::None => false,
        }
    }
}

/// One message of the workload, as the controller saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRecord {
    /// Its number.
    pub seq: u64,
    /// The mesh's generation read just before it was sent...
    pub gen_lo: u64,
    /// ...and just after it returned: the cast addressed one generation in
    /// `gen_lo..=gen_hi`.
    pub gen_hi: u64,
    /// Whether it was a call (else a cast).
    pub call: bool,
    /// Who acknowledged it: a cast's member has it in its mailbox, a call's
    /// member handled it and replied.
    pub acked: Acked,
}

/// A range lookup over one life's report.
struct Received<'a> {
    report: &'a LifeReport,
    duplicates: HashSet<u64>,
}

impl<'a> Received<'a> {
    fn new(report: &'a LifeReport) -> Self {
        Self {
            report,
            duplicates: report.duplicates.iter().copied().collect(),
        }
    }

    /// How many times (0, 1, or 2 meaning "more than once").
    fn count(&self, seq: u64) -> u32 {
        let r = &self.report.ranges;
        let i = r.partition_point(|(s, _)| *s <= seq);
        let once = i > 0 && r[i - 1].1 >= seq;
        match (once, self.duplicates.contains(&seq)) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 2,
        }
    }
}

/// Checks delivery of the messages numbered `from..to` against the final
/// lives' reports: **no acknowledged message lost** and **exactly once**.
///
/// For a message `s` addressed to generation `g` in `gen_lo..=gen_hi`, and a
/// final life `L` of rank `r` born in generation `b`:
/// - if `b <= gen_lo` (so `L` was already the live member of rank `r` when
///   `s` was sent) and `r` acknowledged `s`, `L` received `s` exactly once
///   (else: *acknowledged message lost*, or a duplicate);
/// - if `b > gen_hi`, `L` never received `s` (a message of an older
///   generation reached a newer life: fencing failed);
/// - `L` received no message more than once, and nothing outside `from..to`.
pub fn check_delivery(
    sends: &[SendRecord],
    reports: &[LifeReport],
    from: u64,
    to: u64,
) -> (InvariantResult, InvariantResult) {
    let mut lost = InvariantResult::new(names::NO_ACKED_LOSS);
    let mut once = InvariantResult::new(names::EXACTLY_ONCE);
    let lives: Vec<Received<'_>> = reports.iter().map(Received::new).collect();
    for l in &lives {
        let life = l.report.life;
        if l.report.truncated {
            lost.unchecked.push(format!(
                "rank {} (born {}): its log was truncated; absences not checked",
                life.rank, life.born
            ));
        }
        for d in &l.report.duplicates {
            once.violate(format!(
                "rank {} (life born in generation {}, pid {}) received message {d} more than once",
                life.rank, life.born, life.pid
            ));
        }
        for (s, e) in &l.report.ranges {
            once.check(*s >= from && *e < to, || {
                format!(
                    "rank {} received messages {s}..={e}, outside those sent ({from}..{to})",
                    life.rank
                )
            });
        }
    }
    for s in sends.iter().filter(|s| s.seq >= from && s.seq < to) {
        for l in &lives {
            let life = l.report.life;
            let c = l.count(s.seq);
            let what = if s.call { "call" } else { "cast" };
            if life.born <= s.gen_lo && s.acked.contains(life.rank) {
                if !l.report.truncated {
                    lost.check(c >= 1, || {
                        format!(
                            "{what} {} (generation {}) was acknowledged by rank {} but its live member (born in generation {}, pid {}) never received it",
                            s.seq, s.gen_lo, life.rank, life.born, life.pid
                        )
                    });
                }
                once.check(c <= 1, || {
                    format!("{what} {} reached rank {} more than once", s.seq, life.rank)
                });
            } else if life.born > s.gen_hi {
                once.check(c == 0, || {
                    format!(
                        "{what} {} of generation {} reached rank {}'s life born in the later generation {}",
                        s.seq, s.gen_hi, life.rank, life.born
                    )
                });
            } else {
                once.check(c <= 1, || {
                    format!("{what} {} reached rank {} more than once", s.seq, life.rank)
                });
            }
        }
    }
    (lost, once)
}

/// How many of each (life, sender)'s arrivals an earlier round checked
/// already, keyed by the life's nonce: so that a life that lives through
/// many rounds has each arrival checked once.
pub type OrderProgress = BTreeMap<(u64, Sender), u64>;

/// **Messages from one sender reach each member in the order sent**
/// (FIFO per sender and member): for every life and sender, the numbers of
/// that sender's messages, in the order the life received them, strictly
/// increase. Every sender numbers its messages in the order it sends them,
/// so a decrease is a message overtaken by a later one (or received
/// twice); a gap is a loss, which [`check_delivery`] judges.
///
/// Each arrival past the first is one fact: compared with the arrival
/// before it. Arrivals inside a [`Run`](crate::workload::Run) increased
/// (the recorder extends a run only with a greater number); at each run's
/// start the checker compares its first number with the previous run's
/// last. Only arrivals past `before` (what an earlier round checked of that
/// life) are counted; the returned progress is where the next round starts
/// (for the lives in `reports` only). Arrivals whose order the log did not
/// keep (past its bounds) are listed as not checked.
pub fn check_order(
    reports: &[LifeReport],
    before: &OrderProgress,
) -> (InvariantResult, OrderProgress) {
    let mut r = InvariantResult::new(names::FIFO);
    let mut progress = OrderProgress::new();
    for rep in reports {
        let life = rep.life;
        if rep.order_dropped > 0 {
            r.not_checked(format!(
                "rank {} (born {}): the order of {} records from senders past the log's bound was not kept",
                life.rank, life.born, rep.order_dropped
            ));
        }
        for (sender, log) in &rep.order {
            let start = before.get(&(life.nonce, *sender)).copied().unwrap_or(0);
            progress.insert((life.nonce, *sender), log.covered.max(start));
            let well_formed = log.covered <= log.arrivals
                && log.runs.first().is_none_or(|f| f.at == 0)
                && log.runs.windows(2).all(|w| w[0].at < w[1].at)
                && log
                    .runs
                    .iter()
                    .all(|run| run.first <= run.last && run.at < log.covered)
                && (log.runs.is_empty() == (log.covered == 0));
            if !well_formed {
                r.violate(format!(
                    "rank {} (born {}): the order log of {sender} is malformed: {log:?}",
                    life.rank, life.born
                ));
                continue;
            }
            for (i, run) in log.runs.iter().enumerate() {
                let end = log.runs.get(i + 1).map_or(log.covered, |n| n.at);
                // Arrivals run.at+1..end follow one of the same run.
                let inner_from = (run.at + 1).max(start);
                r.checked += end.saturating_sub(inner_from);
                if i == 0 || run.at < start {
                    continue;
                }
                let prev = &log.runs[i - 1];
                r.check(run.first > prev.last, || {
                    format!(
                        "rank {} (life born in generation {}, pid {}) received message {} from {sender} after message {} (arrival {} of {sender}): out of the order sent",
                        life.rank, life.born, life.pid, run.first, prev.last, run.at
                    )
                });
            }
            if log.arrivals > log.covered {
                r.not_checked(format!(
                    "rank {} (born {}): the order of {} of {sender}'s last arrivals was not kept (the log's bound)",
                    life.rank,
                    life.born,
                    log.arrivals - log.covered
                ));
            }
        }
    }
    (r, progress)
}

/// One call of the workload, timed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRecord {
    /// The deadline it was given.
    pub deadline: Duration,
    /// How long it took to return.
    pub elapsed: Duration,
    /// Ranks selected.
    pub selected: u32,
    /// Ranks that replied.
    pub replied: Vec<u32>,
    /// Ranks reported failed.
    pub failed: Vec<u32>,
    /// Whether the call failed as a whole (mesh stopped, bad selection).
    pub error: Option<String>,
}

/// **Calls to dead members fail within their deadline**: every call
/// returned within its deadline plus `slack` (scheduling on a loaded
/// machine), and accounted for every selected rank exactly once — as a reply
/// or as a failure — so no member's silence went unreported.
pub fn check_calls(calls: &[CallRecord], slack: Duration) -> InvariantResult {
    let mut r = InvariantResult::new(names::CALL_DEADLINES);
    for c in calls {
        r.check(c.elapsed <= c.deadline + slack, || {
            format!(
                "a call with deadline {:?} returned after {:?} ({} failed ranks)",
                c.deadline,
                c.elapsed,
                c.failed.len()
            )
        });
        if c.error.is_some() {
            continue;
        }
        let mut seen = BTreeSet::new();
        let dup = c
            .replied
            .iter()
            .chain(&c.failed)
            .any(|rank| !seen.insert(*rank));
        r.check(!dup && seen.len() as u32 == c.selected, || {
            format!(
                "a call selected {} ranks but accounted for {:?} replies and {:?} failures",
                c.selected, c.replied, c.failed
            )
        });
    }
    r
}

/// A reply seen by the workload: which life answered for which rank, in
/// which generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplySeen {
    /// The rank the reply was for.
    pub rank: u32,
    /// The generation the call addressed (known exactly: read before and
    /// after the call, and equal).
    pub generation: u64,
    /// The life that answered.
    pub life: Life,
}

/// **Generations never go backwards; one live member per rank and
/// generation**: the mesh's generation, sampled throughout, never
/// decreased; every reply came from a life of the rank it was for, born no
/// later than the generation addressed; and no two lives answered for one
/// rank in one generation.
pub fn check_generations(samples: &[(Instant, u64)], replies: &[ReplySeen]) -> InvariantResult {
    let mut r = InvariantResult::new(names::GENERATIONS);
    for w in samples.windows(2) {
        r.check(w[1].1 >= w[0].1, || {
            format!("the generation went back from {} to {}", w[0].1, w[1].1)
        });
    }
    let mut lives: HashMap<(u32, u64), Life> = HashMap::new();
    for rep in replies {
        r.check(rep.life.rank == rep.rank, || {
            format!(
                "a reply for rank {} came from rank {}'s life",
                rep.rank, rep.life.rank
            )
        });
        r.check(rep.life.born <= rep.generation, || {
            format!(
                "rank {} answered generation {} with a life born in generation {}",
                rep.rank, rep.generation, rep.life.born
            )
        });
        match lives.get(&(rep.rank, rep.generation)) {
            Some(l) => r.check(l.nonce == rep.life.nonce, || {
                format!(
                    "two lives of rank {} answered in generation {}: pid {} (born {}) and pid {} (born {})",
                    rep.rank, rep.generation, l.pid, l.born, rep.life.pid, rep.life.born
                )
            }),
            None => {
                r.checked += 1;
                lives.insert((rep.rank, rep.generation), rep.life);
            }
        }
    }
    r
}

/// What the supervision of a mesh did during a run.
#[derive(Debug, Clone)]
pub struct SupervisionLog {
    /// The policy.
    pub policy: MeshPolicy,
    /// The first life of each rank (before any fault).
    pub initial: BTreeMap<u32, Life>,
    /// The final life of each rank (empty if the mesh stopped).
    pub finals: BTreeMap<u32, Life>,
    /// Every failure observed, when, and the ranks it named.
    pub failures: Vec<(Instant, Vec<u32>)>,
    /// Whether failure observations were missed (lagged).
    pub failures_missed: bool,
    /// Generation changes seen: when, and to which generation.
    pub generations: Vec<(Instant, u64)>,
    /// The final status.
    pub status: MeshStatus,
    /// The final generation.
    pub generation: u64,
    /// Tolerance for comparing observation times with the policy's window
    /// (restarts are seen when they complete, not when decided).
    pub tolerance: Duration,
}

/// **Restarts within the mesh policy**:
/// - every restart followed an observed failure (restarts ≤ failures);
/// - no window of the policy's period (less the tolerance) saw more
///   restarts than its `max_restarts`;
/// - a mesh that escalated or stopped under a restart policy had seen more
///   than `max_restarts` failures within its period (plus the tolerance);
/// - the lives that changed match the decision: under `RestartMember`, only
///   ranks named in failures have a new life; under `RestartMesh`, every
///   final life was born in the final generation; under `Stop` and
///   `Escalate`, the mesh stopped at its first failure without a restart.
pub fn check_restarts(log: &SupervisionLog) -> InvariantResult {
    let mut r = InvariantResult::new(names::RESTARTS);
    let mut restarts: Vec<Instant> = Vec::new();
    let mut prev = 0;
    for (t, g) in &log.generations {
        for _ in prev..*g {
            restarts.push(*t);
        }
        prev = prev.max(*g);
    }
    r.check(restarts.len() <= log.failures.len(), || {
        format!(
            "{} restarts but only {} failures observed",
            restarts.len(),
            log.failures.len()
        )
    });
    let max = log.policy.intensity.max_restarts as usize;
    let window = log.policy.intensity.period.saturating_sub(log.tolerance);
    for (i, t) in restarts.iter().enumerate() {
        let within = restarts[i..]
            .iter()
            .take_while(|u| u.duration_since(*t) <= window)
            .count();
        r.check(within <= max, || {
            format!(
                "{within} restarts within {window:?}, over the policy's {max} in {:?}",
                log.policy.intensity.period
            )
        });
    }
    let restarting = matches!(
        log.policy.on_failure,
        Decision::RestartMember | Decision::RestartMesh
    );
    match &log.status {
        MeshStatus::Escalated(_) | MeshStatus::Stopped(Some(_)) if restarting => {
            let end = log.failures.last().map(|(t, _)| *t);
            let span = log.policy.intensity.period + log.tolerance;
            let recent = end.map_or(0, |end| {
                log.failures
                    .iter()
                    .filter(|(t, _)| end.duration_since(*t) <= span)
                    .count()
            });
            r.check(recent > max, || {
                format!(
                    "the mesh gave up ({:?}) after only {recent} failures within {span:?} (policy: {max})",
                    log.status
                )
            });
        }
        _ => {}
    }
    match log.policy.on_failure {
        Decision::RestartMember if !log.failures_missed => {
            let named: HashSet<u32> = log
                .failures
                .iter()
                .flat_map(|(_, ranks)| ranks.iter().copied())
                .collect();
            for (rank, life) in &log.finals {
                let Some(first) = log.initial.get(rank) else {
                    continue;
                };
                r.check(life.nonce == first.nonce || named.contains(rank), || {
                    format!(
                        "rank {rank} has a new life (born in generation {}) but no failure named it",
                        life.born
                    )
                });
            }
        }
        Decision::RestartMember => r
            .unchecked
            .push("failure observations were missed; restarted set not checked".into()),
        Decision::RestartMesh => {
            if log.generation > 0 {
                for (rank, life) in &log.finals {
                    r.check(life.born == log.generation, || {
                        format!(
                            "after a whole-mesh restart to generation {}, rank {rank}'s life was born in generation {}",
                            log.generation, life.born
                        )
                    });
                }
            }
        }
        Decision::Stop | Decision::Escalate => {
            r.check(log.generation == 0, || {
                format!(
                    "a {:?} mesh restarted (generation {})",
                    log.policy.on_failure, log.generation
                )
            });
            if !log.failures.is_empty() {
                r.check(log.status.is_done(), || {
                    format!(
                        "a {:?} mesh saw a failure but is {:?}",
                        log.policy.on_failure, log.status
                    )
                });
            }
        }
    }
    r
}

/// **No process outlives its owner**, from the process table: `survivors`
/// are the pids still alive past their deadline (`what` says which
/// deadline: zombies after healing, or every proc after the cluster
/// stopped).
pub fn check_processes(all: &[u32], survivors: &[u32], what: &str) -> InvariantResult {
    let mut r = InvariantResult::new(names::NO_ORPHANS);
    for pid in all {
        r.check(!survivors.contains(pid), || {
            format!("pid {pid} still runs {what}")
        });
    }
    r
}

#[cfg(test)]
mod tests;
