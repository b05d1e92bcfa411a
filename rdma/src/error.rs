//! The one error type of the crate boundary.

use std::net::SocketAddr;
use std::time::Duration;

use regent_net::ProcId;

use crate::ids::{BackendKind, BufferId};

/// Why registering memory or a one-sided operation failed.
///
/// The variants that mean "the buffer is gone" ([`Error::Released`],
/// [`Error::OwnerDied`]) are stable: retrying the same handle fails again.
/// [`Error::is_invalidated`] tells them apart from transient failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range.
    #[error("invalid config: {0}")]
    Config(String),
    /// A buffer length is zero or above the limit.
    #[error("buffer length {len_bytes} bytes is outside 1..={max_bytes}")]
    Length {
        /// The length asked for.
        len_bytes: u64,
        /// The largest length allowed.
        max_bytes: u64,
    },
    /// The manager holds as many registered buffers as its config allows.
    #[error("{limit} buffers are registered already")]
    TooManyBuffers {
        /// The configured limit (`ManagerConfig::max_buffers`).
        limit: usize,
    },
    /// Allocating, sealing or mapping shared memory failed.
    #[error("{context}: {source}")]
    Memory {
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An operation's range (offset and length) falls outside the buffer.
    #[error("range {offset}..{offset}+{len_bytes} is outside {buffer} of {buffer_bytes} bytes")]
    OutOfRange {
        /// The buffer.
        buffer: BufferId,
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len_bytes: u64,
        /// The buffer's length.
        buffer_bytes: u64,
    },
    /// The owner released the buffer (or no longer has it).
    #[error("{buffer} of {owner} was released")]
    Released {
        /// The owner proc.
        owner: ProcId,
        /// The buffer.
        buffer: BufferId,
    },
    /// The owner has closed the buffer to this kind of operation for now:
    /// it holds it locally ([`crate::Access::Local`]: reads and writes are
    /// refused) or read-only ([`crate::Access::ReadOnly`]: writes are
    /// refused). Not an invalidation: the same handle works again once the
    /// owner reopens the buffer (on ibverbs, see [`crate::LocalBuffer::set_access`]).
    #[error("{buffer} of {owner} is closed to peers' {}", if *write { "writes" } else { "reads" })]
    Closed {
        /// The owner proc.
        owner: ProcId,
        /// The buffer.
        buffer: BufferId,
        /// Whether the refused operation was a write.
        write: bool,
    },
    /// The owner could not close its buffer to peers: operations of these
    /// processes were still copying when the deadline passed (or, for a
    /// `try_` call, at once). The buffer keeps its previous access.
    #[error("{buffer} is busy: operations of pids {pids:?} in flight after {waited:?}")]
    Busy {
        /// The buffer.
        buffer: BufferId,
        /// The processes whose operations hold it (this one's own pid for
        /// its tcp server).
        pids: Vec<u32>,
        /// How long the owner waited.
        waited: Duration,
    },
    /// The owner asked for a view of its buffer that its current access
    /// does not allow (e.g. a slice while peers may write it).
    #[error("{buffer} is {access:?} to peers: {need}")]
    Access {
        /// The buffer.
        buffer: BufferId,
        /// Its access now.
        access: crate::Access,
        /// What the view needs.
        need: &'static str,
    },
    /// The owner proc died; its buffers are gone.
    #[error("owner {owner} of {buffer} died")]
    OwnerDied {
        /// The owner proc.
        owner: ProcId,
        /// The buffer.
        buffer: BufferId,
    },
    /// No backend can reach the buffer under the current policy.
    #[error("no backend reaches {buffer} of {owner}: {reason}")]
    NoBackend {
        /// The owner proc.
        owner: ProcId,
        /// The buffer.
        buffer: BufferId,
        /// Why each candidate was ruled out.
        reason: String,
    },
    /// A backend cannot run on this machine (no device, or built without it).
    #[error("backend {backend} unavailable: {reason}")]
    Unavailable {
        /// The backend.
        backend: BackendKind,
        /// Why.
        reason: String,
    },
    /// The shared-memory segment of a handle could not be opened, or is not
    /// the segment the handle names.
    #[error("shared memory of {buffer} of {owner}: {reason}")]
    Shm {
        /// The owner proc.
        owner: ProcId,
        /// The buffer.
        buffer: BufferId,
        /// What went wrong.
        reason: String,
    },
    /// Connecting to the owner's tcp endpoint failed, or the connection
    /// broke mid-operation (the owner died, or the network failed).
    #[error("tcp link to {owner} at {addr}: {reason}")]
    Link {
        /// The owner proc.
        owner: ProcId,
        /// Its tcp endpoint.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// The other side refused this one, or this one refused it: TLS
    /// handshake or proc identity check.
    #[error("{peer} refused: {reason}")]
    Refused {
        /// The proc (or address) on the other side.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The other side broke the protocol (bytes from the network are never
    /// trusted).
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// The proc (or address) on the other side.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// An operation made no progress within its deadline.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// A handle failed validation (from the network, so untrusted).
    #[error("invalid buffer handle: {0}")]
    InvalidHandle(String),
    /// A verbs call failed.
    #[error("verbs {context}: {reason}")]
    Verbs {
        /// The call.
        context: &'static str,
        /// The error it returned.
        reason: String,
    },
    /// TLS setup from the cluster credentials failed.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// One operation of a batch failed (the others may have completed).
    #[error("operation {index} of the batch failed: {source}")]
    Batch {
        /// Its index in the batch.
        index: usize,
        /// Why it failed.
        #[source]
        source: Box<Error>,
    },
    /// The manager was shut down.
    #[error("the buffer manager is shut down")]
    Shutdown,
}

impl Error {
    /// Whether the buffer is gone for good: released, or its owner died.
    /// (A batch error answers for the operation that failed.)
    pub fn is_invalidated(&self) -> bool {
        match self {
            Self::Released { .. } | Self::OwnerDied { .. } => true,
            Self::Batch { source, .. } => source.is_invalidated(),
            _ => false,
        }
    }

    pub(crate) fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { context, source }
    }

    pub(crate) fn memory(context: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Memory { context, source }
    }
}
