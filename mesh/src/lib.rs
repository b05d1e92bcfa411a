//! Meshes: shapes and selections, procs and allocators, actor meshes with cast
//! trees and reducers, and mesh-granular supervision.
//!
//! Built so far: the pure geometry of meshes, with no I/O.
//!
//! - [`shape`]: a [`Shape`] of named dimensions (`{hosts=4, gpus=8}`) over a
//!   strided [`Slice`] of a flat rank space; points, ranks, and slicing into
//!   cheap views that copy no member.
//! - [`selection`]: the [`Selection`] algebra (`*`, `none`, `first`, `any`,
//!   ranges with steps, constraints on named dimensions, `|`, `&`) with a text
//!   syntax that parses and prints (`hosts=0..2,gpus=*`), evaluated to ranks,
//!   also within a sub-view as a cast tree needs.
//!
//! The rest (procs, allocators, actor meshes) is being built (see
//! `ARCHITECTURE.md`). The semantics of shapes and selections are in
//! `mesh/SHAPES.md`.
#![forbid(unsafe_code)]

pub mod actor;
pub mod alloc;
pub mod boot;
mod bootstrap;
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
