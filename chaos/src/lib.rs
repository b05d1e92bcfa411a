//! Fault injection for regent: process and link faults, seeded fault
//! schedules, invariant checkers and the scenario runner — so that every
//! recovery claim is proven under faults, reproducibly.
//!
//! - Injectors: process faults go through the [`Allocator`]'s signals
//!   (SIGKILL, SIGSTOP/SIGCONT, SIGTERM), actor panics through the
//!   workload actor ([`workload::Tally`], told to panic); link faults through a
//!   UDP [`Proxy`] in front of every node's QUIC endpoint, driven by the
//!   shared [`Network`] rules (drop, delay with jitter, duplicate, reorder,
//!   bandwidth cap, blackhole, one-way and two-way partitions), changeable
//!   while the run goes on; with root, kernel-level cuts between network
//!   namespaces ([`netns`]).
//! - [`Schedule`]: a seeded, pure generator of fault timelines; the same
//!   seed replays the same timeline.
//! - [`invariant`]: checkers of what must hold after faults.
//! - [`scenario`]: the runner that puts them together over a mesh running a
//!   workload ([`workload::Tally`]) that counts and checks its messages.
//!
//! The contract is in `docs/semantics.md` §7; the code map in
//! `ARCHITECTURE.md`.
//!
//! [`Allocator`]: regent_mesh::alloc::Allocator
#![forbid(unsafe_code)]

pub mod alloc;
pub mod cluster;
pub mod injector;
pub mod invariant;
pub mod netns;
pub mod network;
pub mod process;
pub mod proxy;
pub mod rng;
pub mod scenario;
pub mod schedule;
#[cfg(feature = "sim")]
pub mod sim;
pub mod workload;

pub use alloc::{ChaosAllocator, ProcRecord};
pub use cluster::{ChaosCluster, ClusterConfig};
pub use injector::{Injection, Injector};
pub use invariant::InvariantResult;
pub use network::{Direction, LinkFaults, Network, NodeId, Rules, Verdict};
pub use proxy::{Proxy, ProxyConfig, ProxyCounts};
pub use rng::{Seed, SimRng};
pub use scenario::{LatencyStats, Length, Progress, Report, Scenario, WorkloadConfig};
pub use schedule::{Fault, FaultKind, FaultMix, Schedule, ScheduleConfig, ScheduledFault, Target};

/// What went wrong in the chaos machinery itself (not in the system under
/// test: that is what a [`Report`] tells).
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// A socket or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The mesh runtime failed (starting procs, spawning the workload).
    #[error(transparent)]
    Mesh(#[from] regent_mesh::MeshError),
    /// A network-namespace command failed.
    #[error("network namespaces: {0}")]
    Netns(String),
}

impl ChaosError {
    pub(crate) fn io(context: &'static str, source: std::io::Error) -> Self {
        Self::Io { context, source }
    }
}
