//! The trait users implement: [`MeshActor`], an actor that lives in meshes,
//! spawned by name in any proc with serialized arguments, answering each
//! message with a reply.
//!
//! Each member runs as a ractor actor on a thread of its own, so a handler
//! may block its core for seconds (tensor code does) without delaying the
//! proc's control plane or other members; an actor whose handlers never
//! block may run its members on the proc's control thread instead
//! ([`MeshActor::THREAD`]), which saves a thread hand-over on every
//! message. A handler that returns an error or panics fails its member; the
//! caller of that message gets the error.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::member::{Member, PeersRestarted};
use crate::policy::{Decision, MeshFailure};

/// Where the members of a [`MeshActor`] type run ([`MeshActor::THREAD`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemberThread {
    /// A thread of its own with a current-thread tokio runtime: a handler
    /// may block its core for seconds without delaying the proc's control
    /// plane or its other members. Tasks a member spawns end with its life.
    Own,
    /// A task on its proc's control thread, beside the control plane: a
    /// message to the member and its reply are task switches on that thread
    /// instead of two wake-ups of another one, which is most of what a
    /// small message costs on a loaded machine. Only for actors whose
    /// handlers never block (routers, counters, parameter-server shards
    /// that only copy): a handler that holds the thread delays every member
    /// of the proc and its heartbeats, and held long enough gets the proc
    /// declared failed. Tasks a member spawns run on the proc's runtime,
    /// outlive its life, and log as the proc's, not as the member's.
    Proc,
}

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
    /// Where members run: on a thread of their own (the default), or, for
    /// actors that never block, on the proc's control thread.
    const THREAD: MemberThread = MemberThread::Own;

    /// Creates a member; [`Member::start`] says whether this is a restart,
    /// after what, and which live peer can serve its state. An error (or
    /// panic) here is a start failure. It runs where the member's handlers
    /// run ([`MeshActor::THREAD`]): messages wait in the mailbox until it
    /// returns.
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
