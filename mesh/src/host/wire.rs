//! The host agent's wire protocol: what procs, owners and host agents say to
//! each other over the control plane (QUIC with mutual TLS, `regent-net`).
//!
//! Every message goes to or from well-known ports:
//!
//! | from | to | messages |
//! |---|---|---|
//! | proc (`regent-proc[0]`) | its host agent's [`host_port`] | [`Ready`] |
//! | owner (`regent-alloc[k]`) | a host agent's [`host_port`] | [`HostRequest`], [`Renew`] |
//! | host agent (`regent-host[0]`) | the owner actor's port 0 | [`HostReply`], [`ProcReady`], [`ProcExited`], [`ProcLogs`] |
//! | host agent started by Slurm | the port named by `--announce-port` | [`HostHello`] |
//!
//! Senders are authenticated by the transport (a delivery's sender proc is
//! the one named by its certificate from the cluster CA, and its role the
//! one that certificate carries); the host agent takes [`HostRequest`]s and
//! [`Renew`]s only from [`regent_net::Role::Controller`]s and [`Ready`] only
//! from [`regent_net::Role::Proc`]s, and checks in addition that an owner
//! only controls its own procs and that a [`Ready`] comes from the proc it
//! names. Every list in a message is bounded ([`MAX_SPAWN_ARGS`],
//! [`MAX_SPAWN_ENV`]) on top of the transport's frame limit, and every
//! duration at decode ([`MAX_LEASE`], [`MAX_STOP_GRACE`]): a message with a
//! longer one does not decode.

use std::fmt;
use std::time::Duration;

use regent_net::{ActorId, Message, ProcAddr, ProcId};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use crate::boot::{ProcBoot, ProcSignal};
use crate::logs::LogLine;
use crate::policy::ProcStatus;

pub use crate::boot::{HOST_ACTOR, PROC_ACTOR, Ready, host_actor, host_port, proc_actor};

/// The actor name of an allocator on its owner's endpoint (index `k`).
pub const ALLOC_ACTOR: &str = "regent-alloc";
/// The most arguments a [`SpawnRequest`] may carry.
pub const MAX_SPAWN_ARGS: usize = 1024;
/// The most environment variables a [`SpawnRequest`] may carry.
pub const MAX_SPAWN_ENV: usize = 1024;
/// The longest lease a host agent takes ([`SpawnRequest::lease`],
/// [`Renew::lease`], and a proc's `owner_lease`): one day. Owners renew
/// every lease / 3, so longer ones only delay the stop of an abandoned
/// owner's procs.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
/// The longest grace between SIGTERM and SIGKILL of a stop
/// ([`HostOp::Stop`], the agent's `lease_stop_grace`): one hour.
pub const MAX_STOP_GRACE: Duration = Duration::from_secs(3600);
/// The longest duration any message may carry (the longer of
/// [`MAX_LEASE`] and [`MAX_STOP_GRACE`]): a deadline that far from now
/// always exists.
pub const MAX_WIRE_DURATION: Duration = MAX_LEASE;

/// Decodes a duration of at most `max`. (postcard drops the message of a
/// custom error: the agent's refusal names the bounds itself.)
fn at_most<'de, D: Deserializer<'de>>(
    d: D,
    max: Duration,
    what: &str,
) -> Result<Duration, D::Error> {
    let value = Duration::deserialize(d)?;
    if value > max {
        return Err(D::Error::custom(format!(
            "{what} of {value:?} is longer than {max:?}"
        )));
    }
    Ok(value)
}

fn lease<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    at_most(d, MAX_LEASE, "lease")
}

fn stop_grace<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    at_most(d, MAX_STOP_GRACE, "stop grace")
}

/// The actor of the `index`th allocator on `owner`'s endpoint; its port 0
/// receives the host agents' replies and events.
pub fn alloc_actor(owner: &ProcId, index: u32) -> ActorId {
    // Invariant: ALLOC_ACTOR is a valid actor name (checked by a unit test).
    owner
        .actor(ALLOC_ACTOR, index)
        .expect("ALLOC_ACTOR is a valid actor name")
}

/// Names a request of one owner, echoed in its [`HostReply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A request of an owner to a host agent, answered by a [`HostReply`] with
/// the same id (also when the rest of it does not decode).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostRequest {
    /// The request's id (unique per owner actor). First on the wire, so a
    /// request whose `op` does not decode is still answered.
    pub id: RequestId,
    /// What to do.
    pub op: HostOp,
}

impl Message for HostRequest {
    const TYPE_NAME: &'static str = "regent/host/Request";
}

/// What an owner asks of a host agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum HostOp {
    /// Start a proc; replied with [`ReplyOk::Spawned`] once the process
    /// runs, then [`ProcReady`] once it reported ready.
    Spawn(Box<SpawnRequest>),
    /// Stop a proc of this owner: SIGTERM, then SIGKILL after `grace`.
    /// Replied with [`ReplyOk::Done`] at once; the exit comes as
    /// [`ProcExited`].
    Stop {
        /// The proc.
        proc: ProcId,
        /// How long it may take to exit after SIGTERM (at most
        /// [`MAX_STOP_GRACE`]).
        #[serde(deserialize_with = "stop_grace")]
        grace: Duration,
    },
    /// Deliver a signal to a proc of this owner; replied with
    /// [`ReplyOk::Done`].
    Signal {
        /// The proc.
        proc: ProcId,
        /// The signal.
        signal: ProcSignal,
    },
    /// Stop every proc and exit. Obeyed only from the controller the agent
    /// announced itself to (an agent started for it, as by Slurm); replied
    /// with [`ReplyOk::Done`] before the agent stops.
    Shutdown,
}

/// How to start one proc on a host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpawnRequest {
    /// The proc's boot (holds its private key; written to its stdin only).
    /// `boot.owner.proc` must be the requesting proc.
    pub boot: ProcBoot,
    /// The program to run (a path on the host); `None` runs the host
    /// agent's default program.
    pub program: Option<String>,
    /// Its arguments (at most [`MAX_SPAWN_ARGS`]).
    pub args: Vec<String>,
    /// Environment variables set on top of the host agent's own (at most
    /// [`MAX_SPAWN_ENV`]). `REGENT_ROLE` and `REGENT_PARENT_PID` are set by
    /// the host agent and cannot be overridden.
    pub env: Vec<(String, String)>,
    /// The owner's lease: if the host agent hears no [`Renew`] (nor
    /// request) from the owner for this long, it stops all the owner's
    /// procs. At most [`MAX_LEASE`].
    #[serde(deserialize_with = "lease")]
    pub lease: Duration,
}

/// A host agent's answer to a [`HostRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostReply {
    /// The request answered.
    pub id: RequestId,
    /// What came of it: done, or refused with the reason.
    pub outcome: Result<ReplyOk, String>,
}

impl Message for HostReply {
    const TYPE_NAME: &'static str = "regent/host/Reply";
}

/// A request that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplyOk {
    /// The proc process runs with this pid (it is not ready yet).
    Spawned {
        /// Its OS process id.
        pid: u32,
    },
    /// Done (stop started, signal delivered).
    Done,
}

/// Renews the sender's lease on a host agent. Owners send it every
/// lease / 3; any request renews too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renew {
    /// The lease from now on (at most [`MAX_LEASE`]).
    #[serde(deserialize_with = "lease")]
    pub lease: Duration,
}

impl Message for Renew {
    const TYPE_NAME: &'static str = "regent/host/Renew";
}

/// A host agent tells an owner that one of its procs reported ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcReady {
    /// The proc.
    pub proc: ProcId,
    /// Its endpoint.
    pub addr: ProcAddr,
    /// Its OS process id.
    pub pid: u32,
}

impl Message for ProcReady {
    const TYPE_NAME: &'static str = "regent/host/ProcReady";
}

/// A host agent tells an owner that one of its procs ended (sent when
/// `waitpid` returns: at once, not polled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcExited {
    /// The proc.
    pub proc: ProcId,
    /// Its OS process id.
    pub pid: u32,
    /// How it ended.
    pub status: ProcStatus,
    /// Its last lines of output (at most [`crate::logs::MAX_TAIL_LINES`]
    /// at decode).
    #[serde(deserialize_with = "crate::logs::bounded_tail")]
    pub last_lines: Vec<LogLine>,
}

impl Message for ProcExited {
    const TYPE_NAME: &'static str = "regent/host/ProcExited";
}

/// A host agent hands an owner lines of its procs' output, in the order
/// they were read (per proc and stream).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcLogs {
    /// The lines (at most [`crate::logs::MAX_LOG_BATCH`] at decode, each
    /// at most [`crate::logs::MAX_LINE_BYTES`]).
    #[serde(deserialize_with = "crate::logs::bounded_batch")]
    pub lines: Vec<LogLine>,
    /// Lines for this owner the agent dropped since the last batch (its
    /// queue to the owner was full).
    pub dropped: u64,
}

impl Message for ProcLogs {
    const TYPE_NAME: &'static str = "regent/host/ProcLogs";
}

/// A host agent started for an owner (by Slurm) announces itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostHello {
    /// The host agent's endpoint.
    pub addr: ProcAddr,
    /// Its OS process id.
    pub pid: u32,
    /// The machine's host name.
    pub hostname: String,
}

impl Message for HostHello {
    const TYPE_NAME: &'static str = "regent/host/Hello";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_known_actors_are_valid() {
        let p = ProcId::new("p").unwrap();
        assert_eq!(host_port(&p).to_string(), "p/regent-host[0]#0");
        assert_eq!(proc_actor(&p).to_string(), "p/regent-proc[0]");
        assert_eq!(alloc_actor(&p, 3).to_string(), "p/regent-alloc[3]");
    }

    #[test]
    fn type_names_are_distinct() {
        let names = [
            Ready::TYPE_NAME,
            HostRequest::TYPE_NAME,
            HostReply::TYPE_NAME,
            Renew::TYPE_NAME,
            ProcReady::TYPE_NAME,
            ProcExited::TYPE_NAME,
            ProcLogs::TYPE_NAME,
            HostHello::TYPE_NAME,
        ];
        let set: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(set.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("regent/host/")));
    }

    #[test]
    fn durations_past_their_bound_do_not_decode() {
        use regent_net::wire::{decode_body, encode_payload};
        for lease in [MAX_LEASE + Duration::from_nanos(1), Duration::MAX] {
            let bytes = encode_payload(&Renew { lease }).unwrap();
            assert!(decode_body::<Renew>(&bytes).is_err(), "{lease:?} decoded");
        }
        let bytes = encode_payload(&Renew { lease: MAX_LEASE }).unwrap();
        assert_eq!(decode_body::<Renew>(&bytes).unwrap().lease, MAX_LEASE);
        let stop = |grace| HostRequest {
            id: RequestId(9),
            op: HostOp::Stop {
                proc: ProcId::new("p").unwrap(),
                grace,
            },
        };
        let bytes = encode_payload(&stop(Duration::MAX)).unwrap();
        assert!(decode_body::<HostRequest>(&bytes).is_err());
        // The id still reads (the agent answers with it).
        let (id, _) = postcard::take_from_bytes::<RequestId>(&bytes).unwrap();
        assert_eq!(id, RequestId(9));
        let bytes = encode_payload(&stop(MAX_STOP_GRACE)).unwrap();
        assert!(decode_body::<HostRequest>(&bytes).is_ok());
    }

    #[test]
    fn messages_round_trip_through_the_wire_codec() {
        let reply = HostReply {
            id: RequestId(7),
            outcome: Err("no".into()),
        };
        let bytes = regent_net::wire::encode_payload(&reply).unwrap();
        let back: HostReply = regent_net::wire::decode_body(&bytes).unwrap();
        assert_eq!(back, reply);
        let exited = ProcExited {
            proc: ProcId::new("p-1").unwrap(),
            pid: 42,
            status: ProcStatus::Signal(9),
            last_lines: vec![LogLine {
                proc: ProcId::new("p-1").unwrap(),
                stream: crate::logs::LogStream::Stderr,
                text: "partial".into(),
            }],
        };
        let bytes = regent_net::wire::encode_payload(&exited).unwrap();
        assert_eq!(
            regent_net::wire::decode_body::<ProcExited>(&bytes).unwrap(),
            exited
        );
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;
    use crate::logs::{LogStream, MAX_LINE_BYTES, MAX_LOG_BATCH, MAX_TAIL_LINES};
    use proptest::prelude::*;
    use regent_net::wire::{decode_body, encode_payload};

    fn line(text: String) -> LogLine {
        LogLine {
            proc: ProcId::new("p0-1").unwrap(),
            stream: LogStream::Stdout,
            text,
        }
    }

    fn exited(lines: usize) -> ProcExited {
        ProcExited {
            proc: ProcId::new("p0-1").unwrap(),
            pid: 7,
            status: ProcStatus::Code(1),
            last_lines: (0..lines).map(|i| line(i.to_string())).collect(),
        }
    }

    #[test]
    fn lists_past_their_bound_do_not_decode() {
        let mut fat = exited(3);
        for l in &mut fat.last_lines {
            l.text = "f".repeat(MAX_LINE_BYTES);
        }
        assert!(decode_body::<ProcExited>(&encode_payload(&fat).unwrap()).is_err());
        fat.last_lines.truncate(1);
        assert!(decode_body::<ProcExited>(&encode_payload(&fat).unwrap()).is_ok());
        let ok = encode_payload(&exited(MAX_TAIL_LINES)).unwrap();
        assert_eq!(
            decode_body::<ProcExited>(&ok).unwrap(),
            exited(MAX_TAIL_LINES)
        );
        let long = encode_payload(&exited(MAX_TAIL_LINES + 1)).unwrap();
        let err = decode_body::<ProcExited>(&long).unwrap_err();
        assert!(!err.to_string().is_empty());
        let batch = |n: usize| ProcLogs {
            lines: (0..n).map(|i| line(i.to_string())).collect(),
            dropped: 3,
        };
        let ok = encode_payload(&batch(MAX_LOG_BATCH)).unwrap();
        assert_eq!(decode_body::<ProcLogs>(&ok).unwrap(), batch(MAX_LOG_BATCH));
        assert!(
            decode_body::<ProcLogs>(&encode_payload(&batch(MAX_LOG_BATCH + 1)).unwrap()).is_err()
        );
        let fat = ProcLogs {
            lines: vec![line("z".repeat(MAX_LINE_BYTES + 1))],
            dropped: 0,
        };
        assert!(decode_body::<ProcLogs>(&encode_payload(&fat).unwrap()).is_err());
    }

    proptest! {
        /// Any bytes: a clear error or a batch within its bounds; never a
        /// panic.
        #[test]
        fn proc_logs_decode_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            match decode_body::<ProcLogs>(&bytes) {
                Ok(m) => {
                    prop_assert!(m.lines.len() <= MAX_LOG_BATCH);
                    prop_assert!(m.lines.iter().all(|l| l.text.len() <= MAX_LINE_BYTES));
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            if let Ok(m) = decode_body::<ProcExited>(&bytes) {
                prop_assert!(m.last_lines.len() <= MAX_TAIL_LINES);
            }
        }

        /// Batches round-trip.
        #[test]
        fn proc_logs_round_trip(texts in proptest::collection::vec("\\PC{0,80}", 0..40), dropped: u64) {
            let m = ProcLogs { lines: texts.into_iter().map(line).collect(), dropped };
            let back = decode_body::<ProcLogs>(&encode_payload(&m).unwrap()).unwrap();
            prop_assert_eq!(back, m);
        }
    }
}
