//! Meshes: one controller drives meshes of procs and actors over many
//! machines as if they were one.
//!
//! - [`shape`], [`selection`]: the pure geometry of meshes — named
//!   dimensions, strided views, and the selection algebra with its text
//!   syntax (`hosts=0..2,gpus=*`).
//! - [`boot`], [`host`], [`alloc`]: one binary, three roles
//!   ([`bootstrap`]); host agents that start procs and report their exits at
//!   once; the local, host and Slurm allocators.
//! - [`runtime`]: the controller — [`Runtime`], [`ProcMesh`],
//!   [`ActorMesh`] with casts, calls and reductions through cast trees of
//!   bounded fan-out ([`tree`], `node`), and the supervisor of each mesh.
//! - [`proc`]: the proc runtime: members under an OTP supervisor, tree
//!   forwarding, generations.
//! - [`policy`]: mesh-granular supervision decisions as a pure machine.
//! - [`actor`], [`registry`]: [`MeshActor`], registered by name, and
//!   reducers.
//! - [`inproc`], [`sim`]: procs as tasks of one process (real QUIC), and a
//!   socket-free simulation of meshes of 100,000 members.
//!
//! The contract is in `docs/semantics.md` §3–§5.
#![forbid(unsafe_code)]

pub mod actor;
pub mod alloc;
pub mod boot;
mod bootstrap;
pub mod child;
pub mod host;
pub mod inproc;
mod node;
pub mod policy;
pub mod proc;
pub mod protocol;
pub mod registry;
pub mod runtime;
pub mod selection;
pub mod shape;
pub mod sim;
pub mod tree;

#[doc(hidden)]
pub use inventory;

pub use actor::{ActorError, Member, MemberError, MeshActor};
pub use bootstrap::{
    EXIT_BOOT_FAILED, EXIT_ENDPOINT_CLOSED, EXIT_LEASE_LAPSED, EXIT_REQUESTED, bootstrap,
};
pub use policy::{Decision, FailureCause, MeshFailure, MeshPolicy};
pub use registry::{Max, Min, Reducer, Sum};
pub use runtime::{
    ActorMesh, FailureHook, MembersFailed, MeshError, MeshStatus, ProcMesh, Reduced, Runtime,
    RuntimeConfig, SpawnOptions, ValueMesh,
};
pub use selection::{ParseError, Selected, Selection, SelectionError};
pub use shape::{DimName, DimRange, Point, Rank, Shape, ShapeError, Slice};
