//! Tensors (tch) on regent's buffer plane.
//!
//! This crate is being built (see `ARCHITECTURE.md`).
//! It is one of the two crates allowed `unsafe` (FFI and registered
//! memory); every block carries a `// SAFETY:` note.
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

#[cfg(test)]
mod testing;
