//! Tensors (tch) on regent's buffer plane.
//!
//! - [`TensorBuffer`]: a tch tensor inside registered memory (no copy),
//!   reachable by peers through its [`TensorHandle`]; the buffer stays
//!   registered while any tensor over it lives.
//! - [`Communicator`]: barrier, broadcast, all-reduce, all-gather,
//!   reduce-scatter, send/recv and [`Communicator::reshard`] over a
//!   [`Transport`] (the mesh's members, or [`transport::local`] inside one
//!   process); deterministic results, exact (rank-order) by default, and
//!   failures that name the rank within the transport's detection time.
//! - [`reshard`]: the pure planner for moving sharded tensors between
//!   meshes.
//! - [`checkpoint`]: safetensors files with a checksum, written
//!   atomically, refused whole when truncated or corrupted.
//!
//! The contract is `docs/semantics.md` §8; the code map is in
//! `ARCHITECTURE.md`. This is one of the two crates allowed `unsafe` (FFI
//! and registered memory); every block carries a `// SAFETY:` note.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod buffer;
pub mod checkpoint;
pub mod collective;
pub mod dtype;
pub mod error;
pub mod layout;
pub mod reduce;
pub mod reshard;
pub mod transport;

pub use buffer::{Contiguity, TensorBuffer};
pub use collective::{Algorithm, CollectiveConfig, Communicator};
pub use dtype::DType;
pub use error::Error;
pub use layout::{Layout, TensorHandle};
pub use reduce::{ReduceOp, fold_bytes, serial_fold};
pub use reshard::{Placement, ReshardPlan, Sharding, plan_tensor};
pub use transport::{Transport, TransportError};

/// The tch this crate is built with (for crates above it, so that one
/// version is in the graph and only this crate and `train/` name it as a
/// dependency).
pub use tch;

#[cfg(test)]
mod testing;
