//! Errors at the crate boundary. A failed send gives the message back
//! ([`SendError`]); a message that fails after it was accepted comes back as
//! an [`Undeliverable`] event.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::id::{Generation, IdError, PortId, ProcId};
use crate::wire::{Envelope, RejectCause, WireError};

/// Errors of setting up and running an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range.
    #[error("invalid config: {0}")]
    Config(String),
    /// Making or parsing a certificate or key failed.
    #[error("{context}: {reason}")]
    Certificate {
        /// What was being done.
        context: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// Building a TLS configuration failed.
    #[error("TLS {context}: {reason}")]
    Tls {
        /// What was being built.
        context: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// A peer's certificate does not name the proc it claims to be.
    #[error("peer claiming to be {claimed} refused: {reason}")]
    Identity {
        /// The claimed proc.
        claimed: ProcId,
        /// Why it was refused.
        reason: String,
    },
    /// An I/O operation failed.
    #[error("{context}{}: {source}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Io {
        /// What was being done.
        context: &'static str,
        /// The file, if any.
        path: Option<PathBuf>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A name or address did not parse.
    #[error(transparent)]
    Id(#[from] IdError),
    /// Bytes from the network were refused.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Why a link to a peer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkFailure {
    /// No heartbeat (nor any other frame) arrived within `failure_timeout`.
    #[error("no heartbeat for {silent_for:?}")]
    HeartbeatTimeout {
        /// How long the peer was silent.
        silent_for: Duration,
    },
    /// QUIC's idle timeout expired (no packet within `failure_timeout`).
    #[error("QUIC idle timeout")]
    IdleTimeout,
    /// The peer closed its endpoint in order: it is shutting down (a proc
    /// that exits closes its endpoint on the way out), so whoever tracks its
    /// process may learn why it ended.
    #[error("the peer shut its endpoint down")]
    PeerShutdown,
    /// The connection failed or was closed by the peer.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The peer could not be reached (dial or handshake failed).
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// The peer (or this side) refused the other: TLS or identity check.
    #[error("refused: {0}")]
    Refused(String),
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// This endpoint was closed.
    #[error("endpoint closed")]
    EndpointClosed,
}

/// Why an accepted message came back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UndeliveredCause {
    /// The receiver rejected it.
    #[error("rejected by the receiver: {0}")]
    Rejected(#[from] RejectCause),
    /// The peer restarted (new incarnation) before acknowledging it; the old
    /// incarnation may or may not have delivered it.
    #[error("peer restarted before acknowledging it")]
    PeerRestarted,
    /// The link failed and did not come back within `reconnect_timeout`.
    #[error("link failed: {0}")]
    LinkFailed(LinkFailure),
    /// The peer closed the message's stream over bad input on it.
    #[error("stream closed by the peer: {0}")]
    StreamClosed(String),
}

/// A message that was accepted by `send` and then could not be delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undeliverable {
    /// The message as it was sent.
    pub envelope: Envelope,
    /// Why it came back.
    pub cause: UndeliveredCause,
}

impl fmt::Display for Undeliverable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "message {} -> {} seq {} undeliverable: {}",
            self.envelope.sender, self.envelope.receiver, self.envelope.seq.0, self.cause
        )
    }
}

/// Why `send` refused a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendFailure {
    /// The pair's send buffer (or the local inbox) is full (`try_send` only;
    /// `send` waits).
    #[error("send buffer full")]
    Full,
    /// No address is known for the receiver's proc (see `Endpoint::add_route`).
    #[error("no route to proc {0}")]
    NoRoute(ProcId),
    /// The receiver is in this proc and has no inbox at that port.
    #[error("no such port {0}")]
    NoSuchPort(PortId),
    /// The receiver is in this proc and its port is fenced at a newer
    /// generation.
    #[error("port fenced at {fence:?}")]
    Fenced {
        /// The port's fence.
        fence: Generation,
    },
    /// The sender is not an actor of this proc.
    #[error("sender of proc {0} cannot send from this proc")]
    ForeignSender(ProcId),
    /// The message does not fit in a frame, or cannot be encoded.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The endpoint is closed.
    #[error("endpoint closed")]
    Closed,
}

/// A refused send, with the message given back.
#[derive(Debug, thiserror::Error)]
#[error("send failed: {failure}")]
pub struct SendError<M> {
    /// The message.
    pub message: M,
    /// Why.
    pub failure: SendFailure,
}
