//! regent: a fault-tolerant supervisor runtime in the Erlang/OTP style for
//! distributed ML training.
//!
//! This facade re-exports the public API of the workspace's crates, and
//! nothing else: the `regent` command's benchmarks, demo and chaos runs are
//! modules of the binary (`src/main.rs`), so a user's binary registers none
//! of their actor types and carries none of their hooks.
#![forbid(unsafe_code)]

pub use regent_mesh as mesh;
pub use regent_mesh::bootstrap;
pub use regent_net as net;
pub use regent_rdma as rdma;
pub use regent_supervisor as supervisor;
pub use regent_tensor as tensor;
pub use regent_train as train;
