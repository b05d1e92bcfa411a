//! What a controller shows of itself while it runs: a [`RuntimeSnapshot`]
//! of its live meshes (owner, policy, generation, state per rank, restarts,
//! last failures), a bounded journal of [`RuntimeEvent`]s (failures and
//! recoveries, in order), and its metrics in a `prometheus-client`
//! registry owned by the runtime (so that several runtimes in one process
//! keep theirs apart).
//!
//! Nothing here takes part in a decision: the records are written by the
//! supervisors after they decide, and the times are tokio's clock relative
//! to the runtime's start (simulated under a paused runtime).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::policy::{FailureCause, MeshFailure, ProcStatus};

/// How many events the journal keeps (the oldest go first).
pub const MAX_EVENTS: usize = 1024;
/// How many failures a mesh's record keeps.
pub const MAX_LAST_FAILURES: usize = 8;

/// The state of one live mesh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeshSnapshot {
    /// Its id, unique in this controller.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// The mesh and rank of the member that owns it; `None`: the
    /// controller does.
    pub owner: Option<(u64, u32)>,
    /// Its policy, as `Debug` prints it.
    pub policy: String,
    /// Its generation now.
    pub generation: u64,
    /// Its status: `running`, `restarting`, `stopped` or `escalated`.
    pub status: String,
    /// Restarts (of members or of the whole mesh) so far.
    pub restarts: u64,
    /// One entry per rank.
    pub ranks: Vec<RankSnapshot>,
    /// Its last failures, oldest first (at most [`MAX_LAST_FAILURES`]).
    pub last_failures: Vec<FailureRecord>,
}

/// One rank of a mesh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSnapshot {
    /// The rank.
    pub rank: u32,
    /// The proc it lives on now.
    pub proc: String,
    /// `running`, `failed` (a failure was seen, no restart yet) or
    /// `restarting`.
    pub state: String,
}

/// One failure as the records keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// Milliseconds since the runtime started.
    pub at_ms: u64,
    /// The failed ranks.
    pub ranks: Vec<u32>,
    /// The cause's kind (the label of `regent_failures_total`).
    pub kind: String,
    /// The cause in words.
    pub cause: String,
    /// The generation of the failed lives.
    pub generation: u64,
}

/// The whole controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuntimeSnapshot {
    /// The controller's address.
    pub controller: String,
    /// Milliseconds since it started.
    pub uptime_ms: u64,
    /// Its live meshes, by id.
    pub meshes: Vec<MeshSnapshot>,
    /// The failure that stopped the job, if one did.
    pub job_failure: Option<String>,
}

/// Something that happened to a mesh, for timelines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeEvent {
    /// Its number in the journal (from 0, never reused).
    pub seq: u64,
    /// Milliseconds since the runtime started.
    pub at_ms: u64,
    /// The mesh's name.
    pub mesh: String,
    /// `failure`, `recovered` (a restart finished: the ranks run again in
    /// `generation`) or `stopped`.
    pub kind: String,
    /// The ranks concerned.
    pub ranks: Vec<u32>,
    /// The generation (of the failed lives, or the new one).
    pub generation: u64,
    /// The cause, or how it recovered.
    pub detail: String,
}

/// The label of the failure counter: the cause's kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: String,
}

/// The kind of a failure cause, as labels and records name it: `killed`
/// (the proc ended by a signal), `exited`, `host_lost`, `link_failed`,
/// `panicked`, `actor_failed`, `stopped`, `start_failed`, `escalated`,
/// `supervisor`.
pub fn cause_kind(cause: &FailureCause) -> &'static str {
    match cause {
        FailureCause::Actor { panicked: true, .. } => "panicked",
        FailureCause::Actor { .. } => "actor_failed",
        FailureCause::Stopped => "stopped",
        FailureCause::StartFailed(_) => "start_failed",
        FailureCause::ProcExited {
            status: ProcStatus::Signal(_),
            ..
        } => "killed",
        FailureCause::ProcExited { .. } => "exited",
        FailureCause::HostLost { .. } => "host_lost",
        FailureCause::LinkFailed { .. } => "link_failed",
        FailureCause::Escalated(_) => "escalated",
        FailureCause::Supervisor(_) => "supervisor",
    }
}

/// The runtime's metrics and journal.
pub(crate) struct Observer {
    registry: Mutex<Registry>,
    pub(crate) casts: Counter,
    pub(crate) calls: Counter,
    failures: Family<CauseLabel, Counter>,
    pub(crate) restarts: Counter,
    recovery: Histogram,
    detection: Histogram,
    frames: Counter,
    journal: Mutex<Journal>,
}

#[derive(Default)]
struct Journal {
    next: u64,
    events: VecDeque<RuntimeEvent>,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 10 ms to about 80 s.
    exponential_buckets(0.01, 2.0, 14)
}

impl Observer {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("regent");
        let casts = Counter::default();
        let calls = Counter::default();
        let failures = Family::<CauseLabel, Counter>::default();
        let restarts = Counter::default();
        let recovery = Histogram::new(latency_buckets());
        let detection = Histogram::new(latency_buckets());
        let frames = Counter::default();
        registry.register(
            "casts",
            "Casts (deliveries without replies) the controller rooted",
            casts.clone(),
        );
        registry.register(
            "calls",
            "Calls and reductions (casts gathering replies) the controller rooted",
            calls.clone(),
        );
        registry.register(
            "failures",
            "Mesh failures the controller's supervisors handled, by cause",
            failures.clone(),
        );
        registry.register(
            "restarts",
            "Restarts (of members or whole meshes) that finished",
            restarts.clone(),
        );
        registry.register(
            "recovery_seconds",
            "From a failure to its mesh running again in a new generation",
            recovery.clone(),
        );
        registry.register(
            "detection_seconds",
            "From an injected fault to the failure the supervision saw",
            detection.clone(),
        );
        registry.register(
            "control_frames_sent",
            "Control-plane frames (cast-tree commands) the controller sent",
            frames.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            casts,
            calls,
            failures,
            restarts,
            recovery,
            detection,
            frames,
            journal: Mutex::new(Journal::default()),
        }
    }

    pub(crate) fn failure(&self, failure: &MeshFailure, at_ms: u64) {
        let kind = cause_kind(&failure.cause);
        self.failures
            .get_or_create(&CauseLabel {
                cause: kind.to_owned(),
            })
            .inc();
        self.push(RuntimeEvent {
            seq: 0,
            at_ms,
            mesh: failure.mesh.clone(),
            kind: "failure".into(),
            ranks: failure.ranks.iter().map(|r| r.0).collect(),
            generation: failure.generation.0,
            detail: format!("{kind}: {}", failure.cause),
        });
    }

    pub(crate) fn recovered(
        &self,
        mesh: &str,
        ranks: Vec<u32>,
        generation: u64,
        after: Option<Duration>,
        at_ms: u64,
    ) {
        self.restarts.inc();
        if let Some(after) = after {
            self.recovery.observe(after.as_secs_f64());
        }
        self.push(RuntimeEvent {
            seq: 0,
            at_ms,
            mesh: mesh.to_owned(),
            kind: "recovered".into(),
            ranks,
            generation,
            detail: match after {
                Some(d) => format!("running again after {:.3} s", d.as_secs_f64()),
                None => "running again".into(),
            },
        });
    }

    pub(crate) fn stopped(&self, mesh: &str, detail: String, generation: u64, at_ms: u64) {
        self.push(RuntimeEvent {
            seq: 0,
            at_ms,
            mesh: mesh.to_owned(),
            kind: "stopped".into(),
            ranks: Vec::new(),
            generation,
            detail,
        });
    }

    pub(crate) fn detection(&self, after: Duration) {
        self.detection.observe(after.as_secs_f64());
    }

    fn push(&self, mut event: RuntimeEvent) {
        let mut j = self.journal.lock().expect("journal lock");
        event.seq = j.next;
        j.next += 1;
        if j.events.len() == MAX_EVENTS {
            j.events.pop_front();
        }
        j.events.push_back(event);
    }

    pub(crate) fn events_since(&self, seq: u64) -> Vec<RuntimeEvent> {
        let j = self.journal.lock().expect("journal lock");
        j.events.iter().filter(|e| e.seq >= seq).cloned().collect()
    }

    /// The registry for more metrics (e.g. a training job's).
    pub(crate) fn with_registry<T>(&self, f: impl FnOnce(&mut Registry) -> T) -> T {
        f(&mut self.registry.lock().expect("registry lock"))
    }

    /// The Prometheus text format of every metric; `frames` is the
    /// controller's count of frames sent now.
    pub(crate) fn render(&self, frames: u64) -> String {
        let registry = self.registry.lock().expect("registry lock");
        // A counter of another's count: brought up to it under the lock.
        let seen = self.frames.get();
        if frames > seen {
            self.frames.inc_by(frames - seen);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// What a mesh's supervisor records of it for snapshots.
#[derive(Debug, Clone, Default)]
pub(crate) struct MeshRecord {
    pub(crate) owner: Option<(u64, u32)>,
    pub(crate) policy: String,
    pub(crate) restarts: u64,
    /// Per rank: `running`, `failed`, `restarting`.
    pub(crate) states: Vec<&'static str>,
    pub(crate) last_failures: VecDeque<FailureRecord>,
    /// When the oldest failure not yet recovered from was seen (ms).
    pub(crate) failed_since: Option<u64>,
}

impl MeshRecord {
    pub(crate) fn failed(&mut self, failure: &MeshFailure, at_ms: u64) {
        for r in &failure.ranks {
            if let Some(s) = self.states.get_mut(r.0 as usize) {
                *s = "failed";
            }
        }
        if self.last_failures.len() == MAX_LAST_FAILURES {
            self.last_failures.pop_front();
        }
        self.last_failures.push_back(FailureRecord {
            at_ms,
            ranks: failure.ranks.iter().map(|r| r.0).collect(),
            kind: cause_kind(&failure.cause).to_owned(),
            cause: failure.cause.to_string(),
            generation: failure.generation.0,
        });
        self.failed_since.get_or_insert(at_ms);
    }

    pub(crate) fn restarting(&mut self, ranks: &[u32]) {
        for r in ranks {
            if let Some(s) = self.states.get_mut(*r as usize) {
                *s = "restarting";
            }
        }
    }

    /// A restart of `ranks` finished; returns how long since the failure.
    pub(crate) fn recovered(&mut self, ranks: &[u32], at_ms: u64) -> Option<Duration> {
        for r in ranks {
            if let Some(s) = self.states.get_mut(*r as usize) {
                *s = "running";
            }
        }
        self.restarts += 1;
        if self.states.iter().all(|s| *s == "running") {
            self.failed_since
                .take()
                .map(|t| Duration::from_millis(at_ms.saturating_sub(t)))
        } else {
            None
        }
    }
}
