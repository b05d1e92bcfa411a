//! The identifiers every other module names, errors included: a leaf, so
//! that `error` depends on nothing else of the crate.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A way to move bytes to and from a registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Verbs RC queue pairs on an RDMA NIC (cargo feature `ibverbs`).
    Ibverbs,
    /// The owner's memory mapped by the peer (same host only).
    Shm,
    /// The owner's tcp endpoint, mutual TLS with the cluster certificates.
    Tcp,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ibverbs => "ibverbs",
            Self::Shm => "shm",
            Self::Tcp => "tcp",
        })
    }
}

/// A buffer's number within its owner proc; never reused by a manager.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufferId(pub u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer#{}", self.0)
    }
}

impl fmt::Debug for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufferId({})", self.0)
    }
}
