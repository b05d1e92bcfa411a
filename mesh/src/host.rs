//! Host agents: one per machine, they start procs, report their exits at
//! once, stop them, deliver signals, and stop the procs of an owner whose
//! lease lapsed.
//!
//! - [`HostAgent`] ([`agent`]) is the logic, usable in any process with an
//!   endpoint: the controller runs one in-process for
//!   `LocalAllocator`.
//! - [`HostServer`] ([`server`]) is the `regent host` process: a
//!   [`HostAgent`] on its own endpoint that serves owners' requests over QUIC
//!   (mutual TLS: only a certificate of the cluster CA with the
//!   [`regent_net::Role::Controller`] role may be an owner, and it controls
//!   only its own procs; procs and other host agents are refused, and the
//!   refusal logged) and pushes ready and exit events back to them. An
//!   owner names the program its procs run (a path on the host), so a
//!   controller certificate is the authority to run programs as the agent's
//!   user: issue them only to controllers, and guard the CA key.
//! - [`wire`] is the protocol between procs, owners and host agents.
//!
//! What a host agent guarantees:
//!
//! - A proc's exit (code or signal) is reported when `waitpid` returns,
//!   pushed to the owner, not polled.
//! - A proc dies with its host agent: it sets its parent-death signal to
//!   SIGKILL at boot ([`crate::boot`]).
//! - An owner renews its lease ([`wire::Renew`], every lease / 3); when the
//!   lease lapses, the agent stops all of that owner's procs (SIGTERM, then
//!   SIGKILL after [`HostConfig::lease_stop_grace`]).
//! - Every queue is bounded: procs ([`HostConfig::max_procs`]), owners,
//!   events, commands per proc, requests in flight. Every duration from the
//!   wire is bounded at decode ([`wire::MAX_LEASE`],
//!   [`wire::MAX_STOP_GRACE`]) and every deadline computed with checked
//!   arithmetic: no message makes the agent panic.

pub mod agent;
pub mod server;
pub mod wire;

use std::path::PathBuf;

use regent_net::{ActorId, ProcId, Role};

pub use agent::{HostAgent, HostConfig, HostEvent, HostedProc, SpawnSpec};
pub use server::{HostOptions, HostServer, run_from_args};

/// Why a host agent refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A proc of that name already runs on this host.
    #[error("proc {0} already runs on this host")]
    Duplicate(ProcId),
    /// No such proc runs on this host.
    #[error("no proc {0} on this host")]
    UnknownProc(ProcId),
    /// The requester does not own the proc.
    #[error("{owner} does not own proc {proc}")]
    NotOwner {
        /// The proc.
        proc: ProcId,
        /// The requester.
        owner: ActorId,
    },
    /// The host runs as many procs as it may.
    #[error("this host runs its limit of {limit} procs")]
    TooManyProcs {
        /// The limit.
        limit: usize,
    },
    /// The host serves as many owners as it may.
    #[error("this host serves its limit of {limit} owners")]
    TooManyOwners {
        /// The limit.
        limit: usize,
    },
    /// The sender's certificate does not carry the role the request needs.
    #[error("{sender} is a {role}: only a controller may {what}")]
    Forbidden {
        /// The sender.
        sender: ActorId,
        /// Its role.
        role: Role,
        /// What it asked for.
        what: &'static str,
    },
    /// The proc's command queue is full (too many signals at once).
    #[error("proc {0} has too many commands pending")]
    Busy(ProcId),
    /// A spawn request is malformed (too many arguments, a bad name...).
    #[error("invalid spawn request: {0}")]
    Invalid(String),
    /// The proc's program could not be started.
    #[error("cannot start {} for proc {proc}: {source}", program.display())]
    Spawn {
        /// The proc.
        proc: ProcId,
        /// The program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The proc's boot could not be written to its stdin (it was killed).
    #[error("cannot hand proc {proc} its boot: {message}")]
    Boot {
        /// The proc.
        proc: ProcId,
        /// Why.
        message: String,
    },
    /// The agent is shutting down.
    #[error("the host agent is shut down")]
    Closed,
    /// Bad command-line options of `regent host`.
    #[error("bad host options: {0}")]
    Options(String),
    /// An I/O error of the agent itself.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A control-plane error (credentials, endpoint, sends).
    #[error(transparent)]
    Net(#[from] regent_net::Error),
}
