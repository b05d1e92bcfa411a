//! The trait users implement: [`MeshActor`], an actor that lives in meshes,
//! spawned by name in any proc with serialized arguments, answering each
//! message with a reply.
//!
//! Each member runs as a ractor actor on a thread of its own, so a handler may block its core for seconds (tensor code
//! does) without delaying the proc's control plane or other members. A
//! handler that returns an error or panics fails its member; the caller of
//! that message gets the error.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::member::{Member, PeersRestarted};
use crate::policy::{Decision, MeshFailure};

/// The error type of mesh actor callbacks.
pub type ActorError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An actor that lives in a mesh.
///
/// Register each type with `register_actor!` so that every proc (the same
/// binary, started by `bootstrap()`) can spawn it by [`MeshActor::NAME`].
pub trait MeshActor: Sized + Send + 'static {
    /// The name procs know this type by: unique in the cluster, stable across
    /// versions that talk to each other (e.g. `"trainer"`).
    const NAME: &'static str;
    /// What each member is created from.
    type Args: Serialize + DeserializeOwned + Send + Sync + 'static;
    /// The messages it handles.
    type Msg: Serialize + DeserializeOwned + Send + 'static;
    /// The reply to each message.
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// Creates a member; [`Member::start`] says whether this is a restart,
    /// after what, and which live peer can serve its state. An error (or
    /// panic) here is a start failure. It runs on the member's own thread,
    /// beside the proc's control plane: messages wait in the mailbox until
    /// it returns.
    fn new(
        member: &Member,
        args: Self::Args,
    ) -> impl Future<Output = Result<Self, ActorError>> + Send;

    /// Handles one message. An error (or panic) fails the member.
    fn handle(
        &mut self,
        member: &Member,
        msg: Self::Msg,
    ) -> impl Future<Output = Result<Self::Reply, ActorError>> + Send;

    /// Peers of this member's mesh were restarted into a new generation
    /// (this member survived). Runs in mailbox order with messages. An error
    /// fails the member.
    fn peers_restarted(
        &mut self,
        member: &Member,
        change: &PeersRestarted,
    ) -> impl Future<Output = Result<(), ActorError>> + Send {
        let _ = (member, change);
        async { Ok(()) }
    }

    /// The member is being stopped on purpose (its mesh stops or restarts,
    /// or its proc is stopped): flush what must not be lost. Bounded by the
    /// member's shutdown time; not called when the member failed or is
    /// killed.
    fn stopping(&mut self, member: &Member) -> impl Future<Output = ()> + Send {
        let _ = member;
        async {}
    }

    /// A mesh this member owns ([`Member::spawn_mesh`]) failed: decide what
    /// to do (`None`: that mesh's policy). The owner's supervisor waits for
    /// the answer for a bounded time, then applies the policy.
    fn supervise(
        &mut self,
        member: &Member,
        failure: &MeshFailure,
    ) -> impl Future<Output = Option<Decision>> + Send {
        let _ = (member, failure);
        async { None }
    }
}
