//! Allocators place procs: OS processes, each running the proc runtime with
//! its own QUIC endpoint.
//!
//! The runtime (the controller) prepares one [`ProcBoot`] per proc — identity,
//! credentials signed by the cluster CA, where to report readiness — and asks
//! an [`Allocator`] to start them. The allocator starts each proc through a
//! host agent (in the controller's own process for [`LocalAllocator`], a
//! `regent host` process reached over QUIC otherwise), which hands the proc
//! its boot over stdin, learns its address when the proc reports ready, and
//! reports its exit at once ([`ProcEvent::Exited`], from `waitpid`, not
//! polled).
//!
//! A proc dies with its host agent (parent-death signal), and a host agent
//! stops the procs of an owner whose lease lapsed.

mod host;
mod local;
mod slurm;
mod tracker;

pub use host::{HostAllocator, HostAllocatorConfig, HostInfo};
pub use local::{LOCAL_HOST, LocalAllocator, LocalConfig};
pub use slurm::{SlurmAllocator, SlurmConfig, in_allocation};

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use regent_net::{ProcAddr, ProcId};
use serde::{Deserialize, Serialize};

/// Everything a proc needs to start, from its host agent over stdin. Holds a
/// private key: its `Debug` shows no secret, and it is never logged.
#[derive(Clone, Serialize, Deserialize)]
pub struct ProcBoot {
    /// The proc's identity (named by its certificate).
    pub proc: ProcId,
    /// The cluster CA certificate (PEM).
    pub ca_pem: String,
    /// The proc's certificate chain (PEM).
    pub cert_pem: String,
    /// The proc's private key (PEM). Secret.
    pub key_pem: String,
    /// Where to bind the proc's QUIC endpoint (port 0 for any).
    pub bind: SocketAddr,
    /// The endpoint the proc reports readiness to (its host agent), and
    /// whose control messages it accepts.
    pub parent: ProcAddr,
    /// The controller that owns this proc and the meshes on it.
    pub owner: ProcAddr,
    /// How long the proc keeps running without hearing from its owner
    /// before it stops itself.
    pub owner_lease: Duration,
    /// The control plane's settings (the owner's: both sides agree on frame
    /// sizes and timeouts).
    #[serde(default)]
    pub endpoint: regent_net::EndpointConfig,
    /// What this proc rank gets beyond what every proc gets.
    #[serde(default)]
    pub placement: Placement,
}

/// Where a proc rank runs beyond what all procs share: its own environment
/// and arguments (e.g. the device it owns). A replacement proc of the rank
/// gets the same.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Environment variables, set after the allocator's own.
    pub env: Vec<(String, String)>,
    /// Arguments, after the allocator's own.
    pub args: Vec<String>,
}

impl Placement {
    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }
}

impl fmt::Debug for ProcBoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcBoot")
            .field("proc", &self.proc)
            .field("bind", &self.bind)
            .field("parent", &self.parent)
            .field("owner", &self.owner)
            .field("owner_lease", &self.owner_lease)
            .field("placement", &self.placement)
            .finish_non_exhaustive()
    }
}

/// A proc an allocator started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatedProc {
    /// Its identity.
    pub proc: ProcId,
    /// Its QUIC endpoint.
    pub addr: ProcAddr,
    /// The host it runs on (the host agent's proc id, or `local`).
    pub host: String,
    /// Its OS process id on that host.
    pub pid: u32,
}

pub use crate::policy::ProcStatus;

/// What an allocator reports about its procs after starting them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcEvent {
    /// A proc process ended (reported by its host agent at once).
    Exited {
        /// The proc.
        proc: ProcId,
        /// How.
        status: ProcStatus,
    },
    /// A host agent is gone (its link failed past the failure timeout, or
    /// its process ended); its procs are presumed dead.
    HostLost {
        /// The host.
        host: String,
        /// Its procs.
        procs: Vec<ProcId>,
    },
}

/// Why an allocator could not start or control procs.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// The proc program could not be started.
    #[error("could not start proc {proc}: {message}")]
    Spawn {
        /// The proc.
        proc: ProcId,
        /// Why.
        message: String,
    },
    /// A proc did not report ready within the allocator's start timeout.
    #[error("proc {proc} did not report ready within {timeout:?}")]
    NotReady {
        /// The proc.
        proc: ProcId,
        /// The timeout.
        timeout: Duration,
    },
    /// A proc exited before it reported ready.
    #[error("proc {proc} exited before it was ready ({status})")]
    ExitedEarly {
        /// The proc.
        proc: ProcId,
        /// How.
        status: ProcStatus,
    },
    /// A host agent could not be reached or refused.
    #[error("host {host}: {message}")]
    Host {
        /// The host.
        host: String,
        /// Why.
        message: String,
    },
    /// Not enough capacity (e.g. fewer Slurm nodes than needed).
    #[error("not enough capacity: {0}")]
    Capacity(String),
    /// Slurm could not start the host agents (`srun` failed or ended, or
    /// not every agent announced itself in time).
    #[error("slurm: {0}")]
    Slurm(String),
    /// No such proc in this allocation.
    #[error("no proc {0} in this allocation")]
    UnknownProc(ProcId),
    /// An I/O error (spawning, signalling).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A control-plane error.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
}

/// A signal an allocator can deliver to a proc (for chaos tests and stops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcSignal {
    /// SIGTERM.
    Term,
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
    /// SIGCONT.
    Cont,
}

/// A future returned by an [`Allocator`].
pub type AllocFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, AllocError>> + Send + 'a>>;

/// Places procs on hosts and controls them.
///
/// The runtime fills every field of each [`ProcBoot`] but `parent` and
/// `bind`, which the allocator sets for the host it chooses.
pub trait Allocator: Send + Sync + 'static {
    /// Starts one proc per boot and returns once every one has reported
    /// ready, in the order given. On failure, the procs already started are
    /// stopped before the error returns.
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>>;

    /// Stops a proc: SIGTERM, then SIGKILL after `grace`; returns once it
    /// has exited.
    fn stop(&self, proc: &ProcId, grace: Duration) -> AllocFuture<'_, ProcStatus>;

    /// Delivers a signal to a proc.
    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()>;

    /// The stream of proc events (exits, lost hosts) of every proc this
    /// allocator started. Can be taken once.
    fn take_events(&self) -> Option<tokio::sync::mpsc::Receiver<ProcEvent>>;

    /// A control-plane event of the endpoint the allocator shares with its
    /// owner (the owner holds the endpoint's event stream and passes every
    /// event on), so that allocators that talk to remote host agents notice
    /// a lost host. The default ignores it.
    fn transport_event(&self, event: &regent_net::TransportEvent) {
        let _ = event;
    }
}
