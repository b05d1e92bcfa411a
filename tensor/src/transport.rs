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

pub use crate::error::TransportError;

pub mod local;
pub mod mesh;

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
