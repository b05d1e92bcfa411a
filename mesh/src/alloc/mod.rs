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

use std::time::Duration;

use regent_net::{ProcAddr, ProcId};
use serde::{Deserialize, Serialize};

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

pub use crate::boot::{Placement, ProcBoot, ProcSignal};
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
        /// Its last lines of output (at most
        /// [`crate::logs::MAX_TAIL_LINES`]; the partial last line
        /// included).
        last_lines: Vec<crate::logs::LogLine>,
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

    /// The stream of output lines of every proc this allocator started
    /// (stdout, stderr). Can be taken once; until then lines go to this
    /// process's stderr. The default has none.
    fn take_logs(&self) -> Option<tokio::sync::mpsc::Receiver<crate::logs::LogLine>> {
        None
    }

    /// A control-plane event of the endpoint the allocator shares with its
    /// owner (the owner holds the endpoint's event stream and passes every
    /// event on), so that allocators that talk to remote host agents notice
    /// a lost host. The default ignores it.
    fn transport_event(&self, event: &regent_net::TransportEvent) {
        let _ = event;
    }
}
