//! Events an endpoint reports: links coming up and failing, peers
//! restarting, refusals, protocol violations and undeliverable messages.

use std::net::SocketAddr;

use crate::error::{LinkFailure, Undeliverable};
use crate::id::{Incarnation, ProcId};
use crate::wire::WireError;

/// Which connection of a peer an event is about: the one this endpoint
/// dialed (it carries this proc's sends) or the one the peer dialed (it
/// carries the peer's sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Dialed by this endpoint.
    Outbound,
    /// Dialed by the peer.
    Inbound,
}

/// Something that happened to the transport.
#[derive(Debug, Clone, PartialEq)]
pub enum TransportEvent {
    /// A connection to or from `peer` completed its handshake.
    LinkUp {
        /// The peer.
        peer: ProcId,
        /// Which connection.
        direction: Direction,
        /// The peer's incarnation.
        incarnation: Incarnation,
        /// Whether this resumes a session with the same incarnation.
        resumed: bool,
    },
    /// A connection failed; an outbound one is redialed for up to
    /// `reconnect_timeout`.
    LinkFailed {
        /// The peer.
        peer: ProcId,
        /// Which connection.
        direction: Direction,
        /// Why.
        cause: LinkFailure,
    },
    /// An outbound session gave up after `reconnect_timeout`; its kept
    /// messages come back as [`TransportEvent::Undeliverable`].
    LinkClosed {
        /// The peer.
        peer: ProcId,
        /// The last failure.
        cause: LinkFailure,
    },
    /// A peer came back with a new incarnation: its session starts fresh.
    PeerRestarted {
        /// The peer.
        peer: ProcId,
        /// The incarnation before.
        previous: Incarnation,
        /// The new one.
        current: Incarnation,
    },
    /// An inbound connection was refused (TLS, identity or protocol).
    Refused {
        /// Where it came from.
        remote: SocketAddr,
        /// The proc it claimed to be, if it got that far.
        claimed: Option<ProcId>,
        /// Why.
        reason: String,
    },
    /// A stream from `peer` was closed over bad input.
    ProtocolViolation {
        /// The peer.
        peer: ProcId,
        /// What was wrong.
        error: WireError,
    },
    /// An accepted message could not be delivered.
    Undeliverable(Undeliverable),
}
