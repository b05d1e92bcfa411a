//! The host agent's wire protocol: what procs, owners and host agents say to
//! each other over the control plane (QUIC with mutual TLS, `regent-net`).
//!
//! Every message goes to or from well-known ports:
//!
//! | from | to | messages |
//! |---|---|---|
//! | proc (`regent-proc[0]`) | its host agent's [`host_port`] | [`Ready`] |
//! | owner (`regent-alloc[k]`) | a host agent's [`host_port`] | [`HostRequest`], [`Renew`] |
//! | host agent (`regent-host[0]`) | the owner actor's port 0 | [`HostReply`], [`ProcReady`], [`ProcExited`] |
//! | host agent started by Slurm | the port named by `--announce-port` | [`HostHello`] |
//!
//! Senders are authenticated by the transport (a delivery's sender proc is
//! the one named by its certificate from the cluster CA); the host agent
//! checks in addition that an owner only controls its own procs and that a
//! [`Ready`] comes from the proc it names. Every list in a message is
//! bounded ([`MAX_SPAWN_ARGS`], [`MAX_SPAWN_ENV`]) on top of the transport's
//! frame limit, and every duration (a lease, a stop grace, the proc's owner
//! lease in a boot) by [`MAX_WIRE_DURATION`]: decoding refuses a longer one,
//! since the agent and the proc turn them into deadlines from now, and
//! `Instant + Duration` panics where the sum does not exist.

use std::fmt;
use std::time::Duration;

use regent_net::{ActorId, Message, PortId, ProcAddr, ProcId};
use serde::{Deserialize, Deserializer, Serialize};

use crate::alloc::{ProcBoot, ProcSignal, ProcStatus};

/// The actor name of a host agent's port (index 0, port 0).
pub const HOST_ACTOR: &str = "regent-host";
/// The actor name a proc sends its [`Ready`] from (index 0).
pub const PROC_ACTOR: &str = "regent-proc";
/// The actor name of an allocator on its owner's endpoint (index `k`).
pub const ALLOC_ACTOR: &str = "regent-alloc";
/// The most arguments a [`SpawnRequest`] may carry.
pub const MAX_SPAWN_ARGS: usize = 1024;
/// The most environment variables a [`SpawnRequest`] may carry.
pub const MAX_SPAWN_ENV: usize = 1024;
/// The longest duration a message may carry (365 days): a deadline that far
/// from now always exists.
pub const MAX_WIRE_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Decodes a duration, refusing one over [`MAX_WIRE_DURATION`].
fn bounded_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let duration = Duration::deserialize(d)?;
    check_duration(duration).map_err(serde::de::Error::custom)?;
    Ok(duration)
}

/// Decodes a boot, refusing an owner lease over [`MAX_WIRE_DURATION`].
fn bounded_boot<'de, D: Deserializer<'de>>(d: D) -> Result<ProcBoot, D::Error> {
    let boot = ProcBoot::deserialize(d)?;
    check_duration(boot.owner_lease)
        .map_err(|e| serde::de::Error::custom(format!("owner lease: {e}")))?;
    Ok(boot)
}

fn check_duration(duration: Duration) -> Result<(), String> {
    if duration > MAX_WIRE_DURATION {
        return Err(format!(
            "duration of {duration:?} exceeds {MAX_WIRE_DURATION:?}"
        ));
    }
    Ok(())
}

/// The actor that holds a host agent's port in proc `host`.
pub fn host_actor(host: &ProcId) -> ActorId {
    // Invariant: HOST_ACTOR is a valid actor name (checked by a unit test).
    host.actor(HOST_ACTOR, 0)
        .expect("HOST_ACTOR is a valid actor name")
}

/// The port of the host agent in proc `host`: procs report [`Ready`] there,
/// owners send [`HostRequest`]s and [`Renew`]s there.
pub fn host_port(host: &ProcId) -> PortId {
    host_actor(host).port(0)
}

/// The actor a proc sends its [`Ready`] from.
pub fn proc_actor(proc: &ProcId) -> ActorId {
    // Invariant: PROC_ACTOR is a valid actor name (checked by a unit test).
    proc.actor(PROC_ACTOR, 0)
        .expect("PROC_ACTOR is a valid actor name")
}

/// The actor of the `index`th allocator on `owner`'s endpoint; its port 0
/// receives the host agents' replies and events.
pub fn alloc_actor(owner: &ProcId, index: u32) -> ActorId {
    // Invariant: ALLOC_ACTOR is a valid actor name (checked by a unit test).
    owner
        .actor(ALLOC_ACTOR, index)
        .expect("ALLOC_ACTOR is a valid actor name")
}

/// Tells the host agent that a proc is up: its endpoint is bound and its
/// runtime serves. Sent once by the proc (see
/// [`crate::boot::ProcStart::report_ready`]) to its parent's [`host_port`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// The proc's endpoint.
    pub addr: ProcAddr,
    /// Its OS process id (checked against the spawned child's).
    pub pid: u32,
}

impl Message for Ready {
    const TYPE_NAME: &'static str = "regent/host/Ready";
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
/// the same id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostRequest {
    /// The request's id (unique per owner actor).
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
        /// [`MAX_WIRE_DURATION`]).
        #[serde(deserialize_with = "bounded_duration")]
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
    /// `boot.owner.proc` must be the requesting proc; `boot.owner_lease` is
    /// at most [`MAX_WIRE_DURATION`].
    #[serde(deserialize_with = "bounded_boot")]
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
    /// procs. At most [`MAX_WIRE_DURATION`].
    #[serde(deserialize_with = "bounded_duration")]
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
    /// The lease from now on (at most [`MAX_WIRE_DURATION`]).
    #[serde(deserialize_with = "bounded_duration")]
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
}

impl Message for ProcExited {
    const TYPE_NAME: &'static str = "regent/host/ProcExited";
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
            HostHello::TYPE_NAME,
        ];
        let set: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(set.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("regent/host/")));
    }

    #[test]
    fn durations_over_the_bound_are_refused_on_decode() {
        use regent_net::wire::{decode_body, encode_payload};
        let over = MAX_WIRE_DURATION + Duration::from_nanos(1);
        // A deadline MAX_WIRE_DURATION from now exists.
        assert!(
            std::time::Instant::now()
                .checked_add(MAX_WIRE_DURATION)
                .is_some()
        );

        let renew = |lease| encode_payload(&Renew { lease }).unwrap();
        assert!(decode_body::<Renew>(&renew(MAX_WIRE_DURATION)).is_ok());
        for lease in [over, Duration::MAX] {
            assert!(decode_body::<Renew>(&renew(lease)).is_err(), "{lease:?}");
        }
        // postcard drops the message of a refusal; a self-describing
        // format shows it.
        let json = serde_json::to_string(&Renew { lease: over }).unwrap();
        let e = serde_json::from_str::<Renew>(&json).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");

        let proc = ProcId::new("p-1").unwrap();
        let stop = |grace| {
            encode_payload(&HostRequest {
                id: RequestId(1),
                op: HostOp::Stop {
                    proc: proc.clone(),
                    grace,
                },
            })
            .unwrap()
        };
        assert!(decode_body::<HostRequest>(&stop(MAX_WIRE_DURATION)).is_ok());
        assert!(decode_body::<HostRequest>(&stop(over)).is_err());

        let owner: ProcAddr = "quic://127.0.0.1:1/owner".parse().unwrap();
        let spawn = |lease, owner_lease| {
            let boot = ProcBoot {
                proc: proc.clone(),
                ca_pem: String::new(),
                cert_pem: String::new(),
                key_pem: String::new(),
                bind: "127.0.0.1:0".parse().unwrap(),
                parent: owner.clone(),
                owner: owner.clone(),
                owner_lease,
            };
            let op = HostOp::Spawn(Box::new(SpawnRequest {
                boot,
                program: None,
                args: vec![],
                env: vec![],
                lease,
            }));
            encode_payload(&HostRequest {
                id: RequestId(2),
                op,
            })
            .unwrap()
        };
        let max = MAX_WIRE_DURATION;
        assert!(decode_body::<HostRequest>(&spawn(max, max)).is_ok());
        assert!(decode_body::<HostRequest>(&spawn(over, max)).is_err());
        assert!(decode_body::<HostRequest>(&spawn(max, over)).is_err());
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
        };
        let bytes = regent_net::wire::encode_payload(&exited).unwrap();
        assert_eq!(
            regent_net::wire::decode_body::<ProcExited>(&bytes).unwrap(),
            exited
        );
    }
}
