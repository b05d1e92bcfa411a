//! Meshes: one controller drives meshes of procs and actors over many
//! machines as if they were one.
//!
//! The modules read top-down (no import cycle between siblings):
//! - leaves: [`shape`], [`selection`], [`tree`] (the pure geometry of meshes
//!   and cast trees); [`protocol`] (the wire messages and their checks);
//!   [`error`]; [`policy`] (mesh supervision decisions as a pure machine);
//!   `entropy` (random ids: from the OS, or from a seed in a simulation).
//! - `fabric`-level: how frames move (the `Fabric` trait, the
//!   control-plane fabric, pending calls, lost procs), and `cast` (casts
//!   and calls rooted anywhere, one cast-tree node, and their outcomes
//!   [`Delivered`], [`ValueMesh`], [`Reduced`]).
//! - [`member`]: what a member knows and reaches ([`Member`]: its mesh, its
//!   restart context, its peers, data channels, the payload plane);
//!   [`actor`]: the [`MeshActor`] trait users implement; `life`: one
//!   member's life on its own thread; [`registry`]: actor types and reducers
//!   by name.
//! - [`actor_mesh`]: [`ActorMesh`], the reference to a mesh that casts,
//!   calls and reduces, on the controller's side and on members'.
//! - [`proc`]: the proc runtime; [`runtime`]: the controller ([`Runtime`],
//!   [`ProcMesh`], the supervisor of each mesh).
//! - [`boot`], [`host`], [`alloc`]: one binary, three roles ([`bootstrap`]);
//!   host agents; the local, host and Slurm allocators. [`inproc`],
//!   [`sim`]: procs as tasks of one process (real QUIC), and a socket-free
//!   simulation of meshes of 100,000 members; `simnet` (feature `sim`): the
//!   controller and in-process procs over a seeded simulated network, on
//!   one thread, replayable from a seed.
//!
//! The contract is in `docs/semantics.md` §3–§5.
#![forbid(unsafe_code)]

pub mod actor;
pub mod actor_mesh;
pub mod alloc;
pub mod boot;
mod bootstrap;
pub mod bugs;
mod cast;
mod entropy;
pub mod error;
mod fabric;
pub mod host;
pub mod inproc;
mod life;
pub mod logs;
mod mailbox;
pub mod member;
pub mod owner;
pub mod policy;
pub mod proc;
pub mod protocol;
pub mod reducer;
pub mod registry;
pub mod relay;
pub mod runtime;
pub mod selection;
pub mod shape;
pub mod sim;
#[cfg(feature = "sim")]
pub mod simnet;
pub mod tree;

#[doc(hidden)]
pub use inventory;

pub use actor::{ActorError, MemberThread, MeshActor};
pub use actor_mesh::{ActorMesh, MeshRef, Retry};
pub use bootstrap::{
    EXIT_BOOT_FAILED, EXIT_ENDPOINT_CLOSED, EXIT_LEASE_LAPSED, EXIT_MEMBER_STUCK, EXIT_REQUESTED,
    bootstrap,
};
pub use cast::{Delivered, Reduced, ValueMesh};
pub use error::{MemberError, MembersFailed, MeshError};
pub use member::{
    ChannelError, ChannelReceiver, ChannelSender, Member, PeerChannel, PeerState, PeersRestarted,
    StartContext,
};
pub use policy::{Decision, FailureCause, MeshFailure, MeshPolicy, MeshStatus};
pub use protocol::StartKind;
pub use reducer::{Max, Min, Reducer, Sum};
pub use runtime::{
    FailureHook, MAX_SPARES, ProcMesh, Runtime, RuntimeConfig, SpawnOptions, SuperviseHook,
};
pub use runtime::{
    FailureRecord, MeshSnapshot, MetricsRegistry, RankSnapshot, RuntimeEvent, RuntimeSnapshot,
};
pub use selection::{ParseError, Selected, Selection, SelectionError};
pub use shape::{DimName, DimRange, Point, Rank, Shape, ShapeError, Slice};

/// Tests: the size of what `make` would return, without calling it (a
/// closure of `unreachable!()` arguments names a future's type).
#[cfg(test)]
pub(crate) fn returned_size<R>(_make: impl FnOnce() -> R) -> usize {
    std::mem::size_of::<R>()
}
