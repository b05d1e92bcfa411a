//! The errors of the mesh crate's boundary: [`MeshError`] for operations on
//! meshes, [`MemberError`] for one member that did not get or answer a
//! message, [`MembersFailed`] for the members of a cast or call that did not.

use std::time::Duration;

use bytes::Bytes;
use regent_net::ProcId;
use serde::{Deserialize, Serialize};

use crate::alloc::AllocError;
use crate::selection::SelectionError;
use crate::shape::{Rank, ShapeError};

/// What went wrong in a mesh operation.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// Procs could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The control plane failed.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
    /// A name was invalid.
    #[error(transparent)]
    Id(#[from] regent_net::IdError),
    /// A shape was invalid.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A selection did not fit the mesh.
    #[error(transparent)]
    Selection(#[from] SelectionError),
    /// Members could not be spawned on a proc.
    #[error("spawning {mesh} on proc {proc}: {message}")]
    Spawn {
        /// The mesh.
        mesh: String,
        /// The proc.
        proc: ProcId,
        /// Why.
        message: String,
    },
    /// A member's mesh could not be spawned: the controller refused it or
    /// could not be reached.
    #[error("spawning {mesh}: {message}")]
    SpawnChild {
        /// The mesh.
        mesh: String,
        /// Why.
        message: String,
    },
    /// A value could not be encoded.
    #[error("encoding: {0}")]
    Encode(String),
    /// No answer in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What.
        what: String,
        /// After how long.
        after: Duration,
    },
    /// The reducer is not registered in this binary.
    #[error("no reducer {0} is registered")]
    NoSuchReducer(&'static str),
    /// No member has this rank.
    #[error("no member has rank {}", .0.0)]
    NoSuchRank(Rank),
    /// The mesh has stopped (by its policy, by escalation, or on request).
    #[error("mesh {0} has stopped")]
    Stopped(String),
    /// The controller's control thread (where its tasks run) could not
    /// start, or has ended.
    #[error("the controller's control thread: {0}")]
    Control(String),
    /// The message does not fit a control-plane frame (the controller's and
    /// its procs' `max_frame_bytes`).
    #[error(
        "a message of {bytes} bytes does not fit a frame (max_frame_bytes = {max_frame_bytes})"
    )]
    TooLarge {
        /// The encoded message's size.
        bytes: usize,
        /// The limit.
        max_frame_bytes: usize,
    },
    /// What was asked is not available on this side (e.g. the payload plane
    /// in a simulated proc, or stopping a mesh one does not own).
    #[error("{0}")]
    Unavailable(String),
    /// A mesh reference of the wrong actor type was asked for.
    #[error("mesh {mesh} holds actors of type {expected:?}, not {found:?}")]
    WrongType {
        /// The mesh.
        mesh: String,
        /// Its actor type.
        expected: String,
        /// The type asked for.
        found: &'static str,
    },
    /// Some members did not get or answer the message.
    #[error(transparent)]
    Members(#[from] MembersFailed),
}

/// The members that did not get (or answer) a cast or call, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} member(s) failed: {}", failed.len(), summary(failed))]
pub struct MembersFailed {
    /// By rank.
    pub failed: Vec<(Rank, MemberError)>,
}

fn summary(failed: &[(Rank, MemberError)]) -> String {
    let mut parts: Vec<String> = failed
        .iter()
        .take(4)
        .map(|(r, e)| format!("rank {}: {e}", r.0))
        .collect();
    if failed.len() > 4 {
        parts.push(format!("and {} more", failed.len() - 4));
    }
    parts.join("; ")
}

/// Why one member did not answer a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum MemberError {
    /// The message could not be decoded as the actor's message type.
    #[error("bad message: {0}")]
    BadMessage(String),
    /// The handler returned an error (the member has failed).
    #[error("handler failed: {0}")]
    Failed(String),
    /// The handler panicked (the member has failed).
    #[error("handler panicked: {0}")]
    Panicked(String),
    /// The member is not running (it failed, was stopped, or its proc is
    /// gone).
    #[error("member not running: {0}")]
    NotRunning(String),
    /// No answer arrived within the deadline.
    #[error("no answer within the deadline")]
    Timeout,
    /// The reply could not be encoded or decoded.
    #[error("bad reply: {0}")]
    BadReply(String),
}

/// A reply as it travels: the encoded value, or why there is none.
pub type EncodedReply = Result<Bytes, MemberError>;
