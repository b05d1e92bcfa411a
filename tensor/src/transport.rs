//! The seam between collectives and whatever connects the members of a
//! group: small control messages between ranks, failure reports, and this
//! member's buffer manager for the payload.
//!
//! A mesh implements [`Transport`] for a selection of its members (one
//! transport per member per group and generation); [`local`] implements it
//! for ranks inside one process, with real buffer managers and channels.
//!
//! # Contract
//!
//! - Ranks are `0..size()`; `rank()` is this member's.
//! - [`Transport::send`] delivers to `to` in FIFO order per (sender,
//!   receiver) pair, without loss or duplication while both live. It may
//!   wait for room (backpressure); callers bound the wait.
//! - [`Transport::recv`] returns the next message from `from`, in order.
//!   It fails with [`TransportError::PeerFailed`] **as soon as the
//!   transport learns that any member of the group failed** (died, was cut
//!   off, or the group's generation ended), naming that member, even while
//!   messages are queued; with [`TransportError::Timeout`] at `deadline`.
//!   Concurrent calls for different `from` are allowed; a future may be
//!   dropped before it completes only when the caller gives the group up.
//! - [`Transport::failure`] is the first member failure the transport
//!   learned of in this group, if any: collectives report it as the cause
//!   of their error (a survivor that gave up first and released its memory
//!   is not the culprit).
//! - [`Transport::buffers`] is this member's buffer manager: collectives
//!   register memory with it and read peers' buffers through it.

use std::future::Future;

use bytes::Bytes;
use regent_rdma::BufferManager;
use tokio::time::Instant;

pub mod local;
pub mod mesh;

/// Why the transport could not send or receive.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// A member of the group failed (died, was cut off, or its generation
    /// ended); the group can do no more collectives.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The failed member.
        rank: usize,
        /// What the transport knows.
        reason: String,
    },
    /// No message came from `rank` by the deadline.
    #[error("no message from rank {rank} by the deadline")]
    Timeout {
        /// The member waited for.
        rank: usize,
    },
    /// The message is larger than the transport carries.
    #[error("message of {len_bytes} bytes, at most {max_bytes}")]
    TooLarge {
        /// Its length.
        len_bytes: usize,
        /// The transport's limit.
        max_bytes: usize,
    },
    /// The rank is not another member of the group.
    #[error("no rank {rank} to talk to in a group of {size}")]
    NoSuchRank {
        /// The rank asked for.
        rank: usize,
        /// The group's size.
        size: usize,
    },
    /// This member's side of the transport is shut down.
    #[error("the transport is closed: {0}")]
    Closed(String),
}

impl TransportError {
    /// The member the error names, if any.
    pub fn rank(&self) -> Option<usize> {
        match self {
            TransportError::PeerFailed { rank, .. } | TransportError::Timeout { rank } => {
                Some(*rank)
            }
            _ => None,
        }
    }
}

/// What collectives need from the group they run in (see the module docs
/// for the contract). Implement the async methods with `async fn`.
pub trait Transport: Send + Sync {
    /// This member's rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// The number of members in the group.
    fn size(&self) -> usize;

    /// The largest message [`Transport::send`] carries.
    fn max_message_bytes(&self) -> usize;

    /// This member's buffer manager.
    fn buffers(&self) -> &BufferManager;

    /// The first member failure learned of in this group (rank, what is
    /// known), or `None`.
    fn failure(&self) -> Option<(usize, String)>;

    /// Sends a control message to `to` (FIFO per pair).
    fn send(
        &self,
        to: usize,
        msg: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// The next message from `from`, or an error: at `deadline`, or as
    /// soon as the transport learns that a member failed.
    fn recv(
        &self,
        from: usize,
        deadline: Instant,
    ) -> impl Future<Output = Result<Bytes, TransportError>> + Send;
}
