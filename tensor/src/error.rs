//! The error type of the crate boundary, [`Error`], and the transport's,
//! [`TransportError`] (re-exported by the `transport` module), which it
//! converts from.

use std::path::PathBuf;
use std::time::Duration;

/// Why a tensor operation, a collective, a reshard or a checkpoint failed.
///
/// Errors of a collective that involve another member name its rank in
/// the group; [`Error::culprit`] returns it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A layout (dtype, shape, strides, offset) is invalid, from a peer or
    /// a caller: too many dimensions, an overflowing size, a misaligned
    /// offset, or a span outside its buffer.
    #[error("invalid tensor layout: {0}")]
    Layout(String),
    /// A tensor is not contiguous (or not dense) where that is required.
    #[error(
        "tensor of shape {shape:?} and strides {strides:?} is not {what}; \
         copy it first (e.g. Contiguity::Copy)"
    )]
    NotContiguous {
        /// Its shape.
        shape: Vec<i64>,
        /// Its strides.
        strides: Vec<i64>,
        /// What was required ("contiguous" or "dense").
        what: &'static str,
    },
    /// Two tensors that must agree in layout do not.
    #[error("layout mismatch: expected {expected}, found {found}")]
    LayoutMismatch {
        /// The layout required.
        expected: String,
        /// The layout given.
        found: String,
    },
    /// A dtype, reduction, device or size this crate does not handle.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A configuration value or argument is out of range.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The buffer's memory may still be written by a peer outside any
    /// operation (see [`crate::TensorBuffer::poisoned`]): use another.
    #[error("the buffer is poisoned: {0}")]
    Poisoned(String),
    /// The buffer plane failed: registering memory, or a one-sided
    /// transfer outside a group.
    #[error("buffer plane: {0}")]
    Rdma(#[source] regent_rdma::Error),
    /// A one-sided read or write of a member's buffer failed (it released
    /// the buffer, died, or its link broke).
    #[error("one-sided operation on rank {rank}'s buffer failed: {source}")]
    Peer {
        /// The member whose buffer it was.
        rank: usize,
        /// The buffer plane's error.
        #[source]
        source: regent_rdma::Error,
    },
    /// The transport reported that a member of the group failed.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The failed member.
        rank: usize,
        /// What the transport said.
        reason: String,
    },
    /// No message came from these ranks within the collective's deadline.
    /// A silent member is always among them for the direct and inline
    /// algorithms; the ring only waits for its left neighbour.
    #[error("{what}: no message from rank(s) {waiting_for:?} within {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The ranks whose message did not come.
        waiting_for: Vec<usize>,
        /// The collective's timeout.
        after: Duration,
    },
    /// Another member gave up on the collective and said why.
    #[error("rank {by} aborted the collective because of rank {culprit}: {reason}")]
    Aborted {
        /// Who sent the abort.
        by: usize,
        /// The rank it blamed.
        culprit: usize,
        /// Its error.
        reason: String,
    },
    /// Members called different collectives, or with different arguments
    /// (dtype, length, root, reduction, config).
    #[error("rank {rank} disagrees: {detail}")]
    Mismatch {
        /// The member that disagrees with this one.
        rank: usize,
        /// How.
        detail: String,
    },
    /// A member sent a message that does not decode, or is not the one the
    /// protocol expects.
    #[error("protocol violation by rank {rank}: {detail}")]
    Protocol {
        /// The sender.
        rank: usize,
        /// What was wrong.
        detail: String,
    },
    /// A collective of this communicator failed before; its state with the
    /// other members is unknown, so it refuses further work. Build a new
    /// one (in the group's next generation).
    #[error("the communicator is broken by an earlier error: {0}")]
    Broken(String),
    /// The transport failed for a reason that names no member.
    #[error(transparent)]
    Transport(TransportError),
    /// libtorch refused an operation.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A reshard plan cannot be made or does not fit the tensors given.
    #[error("reshard: {0}")]
    Plan(String),
    /// A checkpoint is truncated, corrupted, or not what was asked for;
    /// nothing was loaded from it.
    #[error("checkpoint {}: {reason}", path.as_ref().map_or("(bytes)".into(), |p| p.display().to_string()))]
    Checkpoint {
        /// The file, if it came from one.
        path: Option<PathBuf>,
        /// What is wrong with it.
        reason: String,
    },
    /// A file system operation failed.
    #[error("{context} {}: {source}", path.display())]
    Io {
        /// What was being done.
        context: &'static str,
        /// On what.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The member this error blames, if any: the failed, silent (the first
    /// of them), disagreeing or misbehaving rank, or the owner of the
    /// buffer an operation failed on.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            Error::Peer { rank, .. }
            | Error::PeerFailed { rank, .. }
            | Error::Mismatch { rank, .. }
            | Error::Protocol { rank, .. } => Some(*rank),
            Error::Aborted { culprit, .. } => Some(*culprit),
            Error::Timeout { waiting_for, .. } => waiting_for.first().copied(),
            Error::Transport(t) => t.rank(),
            _ => None,
        }
    }

    pub(crate) fn checkpoint(path: Option<&std::path::Path>, reason: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.map(PathBuf::from),
            reason: reason.into(),
        }
    }
}

impl From<TransportError> for Error {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::PeerFailed { rank, reason } => Error::PeerFailed { rank, reason },
            other => Error::Transport(other),
        }
    }
}

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
