//! regent: a fault-tolerant supervisor runtime in the Erlang/OTP style for
//! distributed ML training.
//!
//! This facade re-exports the public API of the workspace's crates.
#![forbid(unsafe_code)]

pub use regent_mesh as mesh;
pub use regent_mesh::bootstrap;
pub use regent_net as net;
pub use regent_supervisor as supervisor;

pub mod bench;
pub mod chaos;
pub mod demo;
