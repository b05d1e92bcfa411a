//! What reaches a member's mailbox: user messages (casts and calls), and
//! the runtime's own — peers restarted, and a decision asked of an owner.

use std::fmt;

use bytes::Bytes;
use regent_net::Generation;
use tokio::sync::oneshot;

use crate::error::EncodedReply;
use crate::policy::{Decision, FailureCause, MeshFailure};
use crate::protocol::Restart;
use crate::shape::Rank;

/// Peers of a member's mesh restarted: survivors are told (through
/// `MeshActor::peers_restarted`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeersRestarted {
    /// The mesh's new generation.
    pub generation: Generation,
    /// The restarted ranks.
    pub ranks: Vec<Rank>,
    /// Why they failed.
    pub cause: FailureCause,
    /// For each restarted rank, the live rank chosen to serve its state.
    pub sources: Vec<(Rank, Rank)>,
}

impl PeersRestarted {
    pub(crate) fn from(r: &Restart) -> Self {
        Self {
            generation: r.generation,
            ranks: r.ranks.iter().copied().map(Rank).collect(),
            cause: r.cause.clone(),
            sources: r.sources.iter().map(|&(a, b)| (Rank(a), Rank(b))).collect(),
        }
    }

    /// The rank that `rank` heals from, if it restarted and a source lives.
    pub fn source_of(&self, rank: Rank) -> Option<Rank> {
        self.sources
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, s)| *s)
    }
}

/// A message to a member, as the proc delivers it.
pub(crate) enum MemberMsg {
    /// A user message (a cast or call).
    User {
        /// The encoded message.
        payload: Bytes,
        /// Where the reply goes, if anyone waits for it.
        reply: Option<oneshot::Sender<EncodedReply>>,
    },
    /// Peers restarted.
    PeersRestarted(PeersRestarted),
    /// A mesh this member owns failed: decide.
    Supervise {
        /// The owned mesh's failure.
        failure: MeshFailure,
        /// The decision (`None`: the policy).
        reply: oneshot::Sender<Option<Decision>>,
    },
}

impl MemberMsg {
    pub(crate) fn user(payload: Bytes, reply: Option<oneshot::Sender<EncodedReply>>) -> Self {
        Self::User { payload, reply }
    }
}

impl fmt::Debug for MemberMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::User { payload, reply } => f
                .debug_struct("User")
                .field("payload_bytes", &payload.len())
                .field("reply", &reply.is_some())
                .finish(),
            Self::PeersRestarted(p) => f.debug_tuple("PeersRestarted").field(p).finish(),
            Self::Supervise { failure, .. } => f
                .debug_struct("Supervise")
                .field("failure", failure)
                .finish(),
        }
    }
}
