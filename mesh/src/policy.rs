//! Mesh-granular supervision decisions, as a pure state machine: `(now,
//! event) -> actions`, no clock, no I/O.
//!
//! Every mesh has one owner and a [`MeshPolicy`]. A failure of any member
//! (an actor's panic or error, its proc's exit, its host's loss, a link that
//! went silent) arrives as one [`MeshFailure`]; the machine decides, per the
//! policy or an owner's override, to restart the failed members, restart the
//! whole mesh, stop it, or escalate to the owner's owner — counting restarts
//! with the same sliding window as OTP supervisors, and escalating when the
//! intensity is exceeded. Every restart opens a new [`Generation`]; a failure
//! report from a member life that a restart already replaced is stale and
//! ignored.

use std::fmt;
use std::time::{Duration, Instant};

use regent_net::{Generation, ProcId};
use regent_supervisor::{Backoff, Intensity, RestartWindow};
use serde::{Deserialize, Serialize};

use crate::shape::Rank;

/// How a proc process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcStatus {
    /// It exited with this code.
    Code(i32),
    /// It was terminated by this signal.
    Signal(i32),
}

impl fmt::Display for ProcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(c) => write!(f, "exit code {c}"),
            Self::Signal(s) => write!(f, "signal {s}"),
        }
    }
}

/// What to do when members of a mesh fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Decision {
    /// Respawn the failed ranks (on a fresh proc if theirs died); the others
    /// keep running.
    RestartMember,
    /// Stop every member and respawn the whole mesh (gang restart).
    RestartMesh,
    /// Stop the mesh; the owner is told.
    Stop,
    /// Stop the mesh and pass the failure to the owner's owner.
    Escalate,
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RestartMember => "restart the failed members",
            Self::RestartMesh => "restart the whole mesh",
            Self::Stop => "stop the mesh",
            Self::Escalate => "escalate",
        })
    }
}

/// A mesh's supervision policy, given at spawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshPolicy {
    /// What to do on a failure.
    pub on_failure: Decision,
    /// Restarts allowed (more than `max_restarts` in `period` escalates).
    pub intensity: Intensity,
    /// Optional delay before restarts, growing with consecutive restarts.
    pub backoff: Option<Backoff>,
}

impl Default for MeshPolicy {
    /// Restart the failed members, at most 3 times in 60 s, then escalate.
    fn default() -> Self {
        Self {
            on_failure: Decision::RestartMember,
            intensity: Intensity {
                max_restarts: 3,
                period: Duration::from_secs(60),
            },
            backoff: None,
        }
    }
}

impl MeshPolicy {
    /// A policy with this decision and the default intensity.
    pub fn new(on_failure: Decision) -> Self {
        Self {
            on_failure,
            ..Self::default()
        }
    }

    /// Sets the intensity.
    pub fn intensity(mut self, max_restarts: u32, period: Duration) -> Self {
        self.intensity = Intensity {
            max_restarts,
            period,
        };
        self
    }

    /// Turns backoff on.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }
}

/// A [`MeshPolicy`] as it travels (a member asking for a mesh gives its
/// policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyWire {
    on_failure: Decision,
    max_restarts: u32,
    period_ms: u64,
    backoff_ms: Option<(u64, u64, u64)>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl From<MeshPolicy> for PolicyWire {
    fn from(p: MeshPolicy) -> Self {
        Self {
            on_failure: p.on_failure,
            max_restarts: p.intensity.max_restarts,
            period_ms: ms(p.intensity.period),
            backoff_ms: p
                .backoff
                .map(|b| (ms(b.initial), ms(b.max), ms(b.reset_after))),
        }
    }
}

impl From<PolicyWire> for MeshPolicy {
    fn from(w: PolicyWire) -> Self {
        Self {
            on_failure: w.on_failure,
            intensity: Intensity {
                max_restarts: w.max_restarts,
                // A zero period would make the window meaningless.
                period: Duration::from_millis(w.period_ms.max(1)),
            },
            backoff: w.backoff_ms.map(|(initial, max, reset)| Backoff {
                initial: Duration::from_millis(initial.min(max)),
                max: Duration::from_millis(max),
                reset_after: Duration::from_millis(reset),
            }),
        }
    }
}

/// The deepest chain of escalations a message may carry: a deeper one does
/// not decode (decoding recurses once per level; an unbounded chain would
/// overflow the decoder's stack).
pub const MAX_ESCALATION_DEPTH: u32 = 64;

thread_local! {
    static ESCALATION_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Decodes one level of an escalation chain, refusing to go deeper than
/// [`MAX_ESCALATION_DEPTH`].
fn bounded_escalation<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Box<MeshFailure>, D::Error> {
    struct Level;
    impl Drop for Level {
        fn drop(&mut self) {
            ESCALATION_DEPTH.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    let depth = ESCALATION_DEPTH.with(|c| {
        let d = c.get() + 1;
        c.set(d);
        d
    });
    let _level = Level;
    if depth > MAX_ESCALATION_DEPTH {
        return Err(serde::de::Error::custom(format!(
            "an escalation chain deeper than {MAX_ESCALATION_DEPTH}"
        )));
    }
    MeshFailure::deserialize(d).map(Box::new)
}

/// Why members failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureCause {
    /// The actor returned an error or panicked.
    Actor {
        /// The error or panic message.
        message: String,
        /// Whether it panicked.
        panicked: bool,
    },
    /// The actor stopped on its own (members are expected to run until
    /// stopped).
    Stopped,
    /// The member could not be started.
    StartFailed(String),
    /// The proc process ended (reported by its host agent).
    ProcExited {
        /// The proc.
        proc: ProcId,
        /// Its exit code or signal.
        status: ProcStatus,
        /// Its last lines of output, both streams, the partial last line
        /// included (at most [`crate::logs::MAX_TAIL_LINES`] at decode).
        #[serde(deserialize_with = "crate::logs::bounded_tail")]
        last_lines: Vec<crate::logs::LogLine>,
    },
    /// The host agent of the proc is gone.
    HostLost {
        /// The host.
        host: String,
        /// The proc.
        proc: ProcId,
    },
    /// The proc's link went silent past the failure timeout.
    LinkFailed {
        /// The proc.
        proc: ProcId,
        /// What the control plane saw.
        detail: String,
    },
    /// A mesh this mesh's member owns escalated (at most
    /// [`MAX_ESCALATION_DEPTH`] levels deep on the wire).
    Escalated(#[serde(deserialize_with = "bounded_escalation")] Box<MeshFailure>),
    /// The mesh's supervisor itself failed (it panicked, or its queue
    /// overflowed): the mesh is stopped.
    Supervisor(String),
}

impl FailureCause {
    /// Whether the member's proc is gone (so it must be respawned elsewhere).
    pub fn proc_lost(&self) -> bool {
        matches!(
            self,
            Self::ProcExited { .. } | Self::HostLost { .. } | Self::LinkFailed { .. }
        )
    }
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Actor { message, panicked } => {
                if *panicked {
                    write!(f, "actor panicked: {message}")
                } else {
                    write!(f, "actor failed: {message}")
                }
            }
            Self::Stopped => f.write_str("actor stopped on its own"),
            Self::StartFailed(m) => write!(f, "member failed to start: {m}"),
            Self::ProcExited {
                proc,
                status,
                last_lines,
            } => {
                write!(f, "proc {proc} exited ({status})")?;
                if !last_lines.is_empty() {
                    f.write_str("; its last lines:")?;
                    for line in last_lines {
                        // A member's line shows its tag, not the mark.
                        let text = line.text.strip_prefix(crate::logs::TAG_MARK);
                        write!(f, "\n    | {}", text.unwrap_or(&line.text))?;
                    }
                }
                Ok(())
            }
            Self::HostLost { host, proc } => write!(f, "host {host} of proc {proc} lost"),
            Self::LinkFailed { proc, detail } => write!(f, "link to proc {proc} failed: {detail}"),
            Self::Escalated(inner) => write!(f, "owned mesh {} escalated", inner.mesh),
            Self::Supervisor(why) => write!(f, "the mesh's supervisor failed: {why}"),
        }
    }
}

/// One failure of a mesh: which ranks, why, in which generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshFailure {
    /// The mesh's name.
    pub mesh: String,
    /// The failed ranks.
    pub ranks: Vec<Rank>,
    /// Why.
    pub cause: FailureCause,
    /// The generation of the failed members' lives.
    pub generation: Generation,
}

impl fmt::Display for MeshFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "mesh {} (generation {}), ranks {:?}: {}",
            self.mesh,
            self.generation.0,
            self.ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
            self.cause
        )?;
        if let FailureCause::Escalated(inner) = &self.cause {
            write!(f, "\n  caused by {inner}")?;
        }
        Ok(())
    }
}

/// Where a mesh's supervision stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshStatus {
    /// All members run (as far as the owner knows).
    Running,
    /// A restart is in progress.
    Restarting,
    /// Stopped: on request (`None`) or by the policy.
    Stopped(Option<MeshFailure>),
    /// Stopped and escalated to the owner's owner.
    Escalated(MeshFailure),
}

impl MeshStatus {
    /// Whether the mesh has stopped for good.
    pub fn is_done(&self) -> bool {
        matches!(self, Self::Stopped(_) | Self::Escalated(_))
    }
}

/// What the owner of a mesh must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshAction {
    /// Respawn these ranks as `generation`, after `delay`, on fresh procs for
    /// the proc ranks in `replace`; tell every other member's proc about the
    /// new generation and what changed.
    RestartMembers {
        /// The ranks.
        ranks: Vec<Rank>,
        /// Proc ranks whose procs are gone: replace them with fresh ones.
        replace: Vec<u32>,
        /// The new generation.
        generation: Generation,
        /// Backoff delay.
        delay: Duration,
        /// For each restarted rank, a surviving rank that can serve its
        /// state (round robin over the survivors, in rank order).
        sources: Vec<(Rank, Rank)>,
        /// Why.
        cause: FailureCause,
    },
    /// Stop every member, then respawn all as `generation` after `delay`,
    /// on fresh procs for the proc ranks in `replace`.
    RestartMesh {
        /// Proc ranks whose procs are gone.
        replace: Vec<u32>,
        /// The new generation.
        generation: Generation,
        /// Backoff delay.
        delay: Duration,
        /// Why.
        cause: FailureCause,
    },
    /// Stop every member; the mesh is done.
    Stop {
        /// The failure that stopped it.
        failure: MeshFailure,
    },
    /// Stop every member and report the failure to the owner's owner.
    Escalate {
        /// The failure, for the owner's owner.
        failure: MeshFailure,
        /// Why it escalates (the policy, or exhausted intensity).
        exhausted: bool,
    },
}

/// An input of the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshEvent {
    /// Members failed; `decision` overrides the policy (from the owner's
    /// hook) when given.
    Failed {
        /// The failure.
        failure: MeshFailure,
        /// The procs that are gone (by proc rank), when the failure is their
        /// loss (its ranks are all of those procs' members). A loss counts
        /// only for the proc the mesh has at that rank now: a second report
        /// of the same loss (its exit, then its link) and a late report about
        /// a proc already replaced are ignored.
        lost: Vec<(u32, ProcId)>,
        /// The owner's override.
        decision: Option<Decision>,
    },
    /// The restart of the last [`MeshAction`] completed, or could not (the
    /// owner then reports a [`FailureCause::StartFailed`] failure of the new
    /// generation, which counts toward the intensity like any other). `procs`
    /// are the mesh's procs now (lost ones replaced by fresh ones, where
    /// that happened): a lost proc not replaced stays lost.
    Restarted {
        /// Whether the restart completed.
        result: Result<(), String>,
        /// The procs now, by proc rank.
        procs: Vec<ProcId>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Running,
    /// A restart is in progress; failures wait for it.
    Restarting,
    Done,
}

/// The supervision state of one mesh.
#[derive(Debug, Clone)]
pub struct MeshMachine {
    policy: MeshPolicy,
    window: RestartWindow,
    generation: Generation,
    per_proc: u32,
    /// The generation each rank's current member was spawned in.
    ranks: Vec<Generation>,
    /// The procs now, by proc rank.
    procs: Vec<ProcId>,
    /// Procs that are gone and not yet replaced, by proc rank.
    lost: std::collections::BTreeMap<u32, ProcId>,
    /// Consecutive restarts, for backoff.
    streak: u32,
    last_restart: Option<Instant>,
    phase: Phase,
    deferred: Vec<MeshEvent>,
    /// Restart reports without a restart (a bug of the owner), counted.
    unexpected: u64,
}

impl MeshMachine {
    /// A running mesh on `procs` with `per_proc` members each, in
    /// generation 0.
    pub fn new(policy: MeshPolicy, procs: Vec<ProcId>, per_proc: u32) -> Self {
        let members = procs.len() * per_proc as usize;
        Self {
            policy,
            window: RestartWindow::new(policy.intensity),
            generation: Generation(0),
            per_proc,
            ranks: vec![Generation(0); members],
            procs,
            lost: std::collections::BTreeMap::new(),
            streak: 0,
            last_restart: None,
            phase: Phase::Running,
            deferred: Vec::new(),
            unexpected: 0,
        }
    }

    /// The current generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The generation rank `rank`'s current member was spawned in.
    pub fn rank_generation(&self, rank: Rank) -> Option<Generation> {
        self.ranks.get(rank.index()).copied()
    }

    /// Whether the mesh has stopped or escalated.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Whether a restart is in progress.
    pub fn is_restarting(&self) -> bool {
        self.phase == Phase::Restarting
    }

    /// The procs now, by proc rank.
    pub fn procs(&self) -> &[ProcId] {
        &self.procs
    }

    /// The proc ranks known lost and not yet replaced.
    pub fn lost_procs(&self) -> Vec<u32> {
        self.lost.keys().copied().collect()
    }

    /// Restart reports that came without a restart.
    pub fn unexpected_reports(&self) -> u64 {
        self.unexpected
    }

    /// The policy.
    pub fn policy(&self) -> &MeshPolicy {
        &self.policy
    }

    /// Handles an event at `now`.
    pub fn handle(&mut self, now: Instant, event: MeshEvent) -> Vec<MeshAction> {
        let mut out = Vec::new();
        match (&self.phase, event) {
            (Phase::Done, _) => {}
            (Phase::Restarting, MeshEvent::Restarted { result: _, procs }) => {
                self.phase = Phase::Running;
                // A lost proc that was replaced is lost no more.
                self.lost
                    .retain(|&p, proc| procs.get(p as usize) == Some(proc));
                if procs.len() == self.procs.len() {
                    self.procs = procs;
                }
                // A failed restart is reported by the owner as a failure of
                // the new generation (so its hook sees it); the deferred
                // failures come after it.
                let deferred = std::mem::take(&mut self.deferred);
                for e in deferred {
                    match (&self.phase, e) {
                        (
                            Phase::Running,
                            MeshEvent::Failed {
                                failure,
                                lost,
                                decision,
                            },
                        ) => self.on_failure(now, failure, lost, decision, &mut out),
                        (Phase::Restarting, e) => self.deferred.push(e),
                        _ => {}
                    }
                }
            }
            (Phase::Restarting, e @ MeshEvent::Failed { .. }) => self.deferred.push(e),
            (
                Phase::Running,
                MeshEvent::Failed {
                    failure,
                    lost,
                    decision,
                },
            ) => self.on_failure(now, failure, lost, decision, &mut out),
            (Phase::Running, MeshEvent::Restarted { .. }) => self.unexpected += 1,
        }
        out
    }

    fn on_failure(
        &mut self,
        now: Instant,
        mut failure: MeshFailure,
        mut lost: Vec<(u32, ProcId)>,
        decision: Option<Decision>,
        out: &mut Vec<MeshAction>,
    ) {
        if !lost.is_empty() {
            // Only the procs the mesh has now, not yet known lost.
            lost.retain(|(p, proc)| {
                self.procs.get(*p as usize) == Some(proc) && !self.lost.contains_key(p)
            });
            if lost.is_empty() {
                return; // the same loss again, or a proc already replaced
            }
            // Every life on a current proc is current, whatever generation
            // the report was made in (it may have waited out a restart).
            failure.generation = self.generation;
            self.lost.extend(lost);
        }
        // A rank counts unless it was respawned after the failed life began
        // (a report about a life that a restart already replaced is stale).
        failure.ranks.retain(|r| {
            self.ranks
                .get(r.index())
                .is_some_and(|g| *g <= failure.generation)
        });
        failure.ranks.sort_unstable();
        failure.ranks.dedup();
        if failure.ranks.is_empty() {
            return; // stale: those lives were already replaced
        }
        let decision = decision.unwrap_or(self.policy.on_failure);
        match decision {
            Decision::Stop => {
                self.phase = Phase::Done;
                out.push(MeshAction::Stop { failure });
            }
            Decision::Escalate => {
                self.phase = Phase::Done;
                out.push(MeshAction::Escalate {
                    failure,
                    exhausted: false,
                });
            }
            Decision::RestartMember | Decision::RestartMesh => {
                if !self.window.record(now) {
                    self.phase = Phase::Done;
                    out.push(MeshAction::Escalate {
                        failure,
                        exhausted: true,
                    });
                    return;
                }
                let delay = self.backoff_delay(now);
                self.generation = Generation(self.generation.0 + 1);
                self.phase = Phase::Restarting;
                let replace = self.lost_procs();
                if decision == Decision::RestartMesh {
                    self.ranks.iter_mut().for_each(|g| *g = self.generation);
                    out.push(MeshAction::RestartMesh {
                        replace,
                        generation: self.generation,
                        delay,
                        cause: failure.cause,
                    });
                } else {
                    // Every member of a lost proc restarts, reported or not.
                    let mut ranks = failure.ranks;
                    for &p in self.lost.keys() {
                        let first = p * self.per_proc;
                        ranks.extend((first..first + self.per_proc).map(Rank));
                    }
                    ranks.sort_unstable();
                    ranks.dedup();
                    for r in &ranks {
                        self.ranks[r.index()] = self.generation;
                    }
                    let sources = heal_sources(&ranks, self.ranks.len());
                    out.push(MeshAction::RestartMembers {
                        ranks,
                        replace,
                        generation: self.generation,
                        delay,
                        sources,
                        cause: failure.cause,
                    });
                }
            }
        }
    }

    fn backoff_delay(&mut self, now: Instant) -> Duration {
        let Some(backoff) = self.policy.backoff else {
            return Duration::ZERO;
        };
        if let Some(last) = self.last_restart
            && now.saturating_duration_since(last) >= backoff.reset_after
        {
            self.streak = 0;
        }
        self.last_restart = Some(now);
        self.streak = self.streak.saturating_add(1);
        backoff.delay(self.streak)
    }
}

/// For each restarted rank (sorted), a surviving rank to heal from: the
/// survivors in rank order, taken round robin (as torchft spreads its
/// healing). Empty when no rank survives.
pub fn heal_sources(restarted: &[Rank], members: usize) -> Vec<(Rank, Rank)> {
    let failed: std::collections::BTreeSet<Rank> = restarted.iter().copied().collect();
    let live: Vec<Rank> = (0..members as u32)
        .map(Rank)
        .filter(|r| !failed.contains(r))
        .collect();
    if live.is_empty() {
        return Vec::new();
    }
    restarted
        .iter()
        .enumerate()
        .map(|(i, &r)| (r, live[i % live.len()]))
        .collect()
}

#[cfg(test)]
mod tests;
