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

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use regent_net::{ControlTraffic, ProcId};
use regent_rdma::BackendTraffic;

use crate::policy::{FailureCause, MeshFailure, ProcStatus};
use crate::protocol::ProcStats;

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

/// Whose control-plane frames: the controller's own (`controller`) or
/// its procs' as they report them (`procs`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SideLabel {
    side: &'static str,
}

/// A payload-plane counter's labels: the backend (`shm`, `tcp`,
/// `ibverbs`) and the way (`read`, `write`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PayloadLabel {
    backend: &'static str,
    op: &'static str,
}

/// A proc's label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcLabel {
    proc: String,
}

/// The control plane's counters, by side.
#[derive(Default)]
struct ControlCounters {
    frames_sent: Family<SideLabel, Counter>,
    bytes_sent: Family<SideLabel, Counter>,
    frames_received: Family<SideLabel, Counter>,
    bytes_received: Family<SideLabel, Counter>,
}

impl ControlCounters {
    /// Adds what grew from `before` to `now` on `side`.
    fn add(&self, side: &'static str, before: &ControlTraffic, now: &ControlTraffic) {
        let label = SideLabel { side };
        for (family, b, n) in [
            (&self.frames_sent, before.frames_sent, now.frames_sent),
            (&self.bytes_sent, before.bytes_sent, now.bytes_sent),
            (
                &self.frames_received,
                before.frames_received,
                now.frames_received,
            ),
            (
                &self.bytes_received,
                before.bytes_received,
                now.bytes_received,
            ),
        ] {
            family.get_or_create(&label).inc_by(n.saturating_sub(b));
        }
    }
}

/// The payload plane's counters, by backend and way.
#[derive(Default)]
struct PayloadCounters {
    bytes: Family<PayloadLabel, Counter>,
    ops: Family<PayloadLabel, Counter>,
    /// Bytes read and written, per live proc.
    per_proc: Family<ProcLabel, Counter>,
}

impl PayloadCounters {
    fn add(&self, proc: &ProcId, before: &regent_rdma::Traffic, now: &regent_rdma::Traffic) {
        let mut grew = 0u64;
        for (backend, b, n) in [
            ("shm", &before.shm, &now.shm),
            ("tcp", &before.tcp, &now.tcp),
            ("ibverbs", &before.ibverbs, &now.ibverbs),
        ] {
            let (b, n): (&BackendTraffic, &BackendTraffic) = (b, n);
            let read = PayloadLabel {
                backend,
                op: "read",
            };
            let write = PayloadLabel {
                backend,
                op: "write",
            };
            let read_bytes = n.read_bytes.saturating_sub(b.read_bytes);
            let written_bytes = n.written_bytes.saturating_sub(b.written_bytes);
            grew = grew
                .saturating_add(read_bytes)
                .saturating_add(written_bytes);
            self.bytes.get_or_create(&read).inc_by(read_bytes);
            self.bytes.get_or_create(&write).inc_by(written_bytes);
            self.ops
                .get_or_create(&read)
                .inc_by(n.reads.saturating_sub(b.reads));
            self.ops
                .get_or_create(&write)
                .inc_by(n.writes.saturating_sub(b.writes));
        }
        self.per_proc
            .get_or_create(&ProcLabel {
                proc: proc.to_string(),
            })
            .inc_by(grew);
    }
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
    /// Cast-tree frames the controller sent itself.
    cast_frames: Counter,
    control: ControlCounters,
    /// The controller's own control traffic counted so far.
    control_seen: Mutex<ControlTraffic>,
    payload: PayloadCounters,
    /// Each reporting proc's last totals.
    procs: Mutex<HashMap<ProcId, ProcStats>>,
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
        let cast_frames = Counter::default();
        let control = ControlCounters::default();
        let payload = PayloadCounters::default();
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
            "cast_frames_sent",
            "Cast-tree frames (commands to procs) the controller sent itself",
            cast_frames.clone(),
        );
        registry.register(
            "control_frames_sent",
            "Control-plane message frames sent on the network, by the controller or its procs (side)",
            control.frames_sent.clone(),
        );
        registry.register(
            "control_bytes_sent",
            "Bytes of those frames (prefix, envelope, payload)",
            control.bytes_sent.clone(),
        );
        registry.register(
            "control_frames_received",
            "Control-plane message frames received from the network, by the controller or its procs (side)",
            control.frames_received.clone(),
        );
        registry.register(
            "control_bytes_received",
            "Bytes of those frames",
            control.bytes_received.clone(),
        );
        registry.register(
            "payload_bytes",
            "Payload-plane bytes procs read and wrote one-sidedly, by backend and op, as they reported them",
            payload.bytes.clone(),
        );
        registry.register(
            "payload_ops",
            "Payload-plane reads and writes procs completed, by backend and op",
            payload.ops.clone(),
        );
        registry.register(
            "proc_payload_bytes",
            "Payload-plane bytes each live proc read and wrote (all backends)",
            payload.per_proc.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            casts,
            calls,
            failures,
            restarts,
            recovery,
            detection,
            cast_frames,
            control,
            control_seen: Mutex::new(ControlTraffic::default()),
            payload,
            procs: Mutex::new(HashMap::new()),
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

    /// A proc's report of its totals: what grew since its last report is
    /// added. Totals that shrank are not a proc's (they only grow): the
    /// report is refused.
    pub(crate) fn proc_stats(&self, proc: &ProcId, now: ProcStats) -> bool {
        let mut procs = self.procs.lock().expect("procs lock");
        let before = procs.get(proc).copied().unwrap_or_default();
        if !now.covers(&before) {
            return false;
        }
        self.control.add("procs", &before.control, &now.control);
        self.payload.add(proc, &before.payload, &now.payload);
        procs.insert(proc.clone(), now);
        true
    }

    /// Forgets the procs `keep` refuses (gone: their series end).
    pub(crate) fn forget_procs(&self, keep: impl Fn(&ProcId) -> bool) {
        let mut procs = self.procs.lock().expect("procs lock");
        procs.retain(|p, _| {
            let kept = keep(p);
            if !kept {
                self.payload.per_proc.remove(&ProcLabel {
                    proc: p.to_string(),
                });
            }
            kept
        });
    }

    /// Procs whose totals are remembered.
    pub(crate) fn reporting_procs(&self) -> usize {
        self.procs.lock().expect("procs lock").len()
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

    /// The Prometheus text format of every metric; `cast_frames` is the
    /// controller's count of cast-tree frames sent now, `control` its
    /// endpoint's traffic now.
    pub(crate) fn render(&self, cast_frames: u64, control: ControlTraffic) -> String {
        let registry = self.registry.lock().expect("registry lock");
        // Counters of others' counts: brought up to them under the lock.
        let seen = self.cast_frames.get();
        if cast_frames > seen {
            self.cast_frames.inc_by(cast_frames - seen);
        }
        {
            let mut seen = self.control_seen.lock().expect("control lock");
            if control.covers(&seen) {
                self.control.add("controller", &seen, &control);
                *seen = control;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str, series: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn procs_totals_add_what_grew_and_shrinking_ones_are_refused() {
        let o = Observer::new();
        let (a, b) = (ProcId::new("a").unwrap(), ProcId::new("b").unwrap());
        let mut s = ProcStats::default();
        s.payload.shm.read_bytes = 100;
        s.payload.shm.reads = 1;
        s.control.frames_sent = 3;
        assert!(o.proc_stats(&a, s));
        s.payload.shm.read_bytes = 250;
        s.payload.shm.reads = 2;
        assert!(o.proc_stats(&a, s));
        let mut t = ProcStats::default();
        t.payload.tcp.written_bytes = 7;
        t.payload.tcp.writes = 1;
        assert!(o.proc_stats(&b, t));
        // Totals that shrank are not a proc's: nothing of them counts.
        let mut shrunk = s;
        shrunk.payload.shm.read_bytes = 10;
        shrunk.control.frames_sent = 1000;
        assert!(!o.proc_stats(&a, shrunk));
        let text = o.render(0, ControlTraffic::default());
        let bytes = |backend: &str, op: &str| {
            line(
                &text,
                &format!("regent_payload_bytes_total{{backend=\"{backend}\",op=\"{op}\"}}"),
            )
        };
        assert_eq!(bytes("shm", "read"), Some(250), "{text}");
        assert_eq!(bytes("tcp", "write"), Some(7), "{text}");
        assert_eq!(
            line(&text, "regent_control_frames_sent_total{side=\"procs\"}"),
            Some(3)
        );
        assert_eq!(
            line(&text, "regent_proc_payload_bytes_total{proc=\"a\"}"),
            Some(250)
        );
        // A gone proc's series ends; the totals stay.
        o.forget_procs(|p| *p != a);
        let text = o.render(0, ControlTraffic::default());
        assert_eq!(
            line(&text, "regent_proc_payload_bytes_total{proc=\"a\"}"),
            None
        );
        assert_eq!(
            line(&text, "regent_proc_payload_bytes_total{proc=\"b\"}"),
            Some(7)
        );
        assert_eq!(o.reporting_procs(), 1);
        assert!(text.contains("regent_payload_bytes_total{backend=\"shm\",op=\"read\"} 250"));
    }

    #[test]
    fn the_controllers_own_traffic_is_brought_up_to_its_endpoints_at_each_render() {
        let o = Observer::new();
        let mut c = ControlTraffic {
            frames_sent: 2,
            bytes_sent: 90,
            frames_received: 1,
            bytes_received: 40,
        };
        o.render(5, c);
        c.bytes_sent = 150;
        let text = o.render(6, c);
        let side = "{side=\"controller\"}";
        assert_eq!(
            line(&text, &format!("regent_control_bytes_sent_total{side}")),
            Some(150)
        );
        assert_eq!(
            line(&text, &format!("regent_control_frames_sent_total{side}")),
            Some(2)
        );
        assert_eq!(
            line(&text, &format!("regent_control_bytes_received_total{side}")),
            Some(40)
        );
        assert_eq!(line(&text, "regent_cast_frames_sent_total"), Some(6));
    }
}
