//! Mesh actors: user-defined actors that live in meshes, spawned by name in
//! any proc with serialized arguments, answering each message with a reply.
//!
//! Inside a proc each member runs as a ractor actor ([`MemberActor`]) under
//! the proc's OTP supervisor, wrapped so that a panic is reported as a panic.
//! A handler that returns an error fails its member (as a ractor handler that
//! returns an error does); the caller of that message gets the error.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;

use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use regent_net::{Generation, ProcId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::shape::{Point, Rank};

/// The error type of mesh actor callbacks.
pub type ActorError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An actor that lives in a mesh.
///
/// Register each type with [`register_actor!`](crate::register_actor) so that
/// every proc (the same binary, started by [`crate::bootstrap`]) can spawn it
/// by [`MeshActor::NAME`].
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

    /// Creates a member. An error (or panic) here is a start failure.
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
}

/// Where a member sits: its mesh, rank, point and generation; and how it
/// spawns meshes of its own.
#[derive(Debug, Clone)]
pub struct Member {
    pub(crate) mesh: String,
    pub(crate) rank: Rank,
    pub(crate) point: Point,
    pub(crate) generation: Generation,
    pub(crate) proc: ProcId,
    pub(crate) link: Option<crate::child::MemberLink>,
}

impl Member {
    /// Spawns a mesh of `B` that this member owns, on the procs of its own
    /// mesh (`per_proc` members on each), supervised by the controller with
    /// `policy`. When that mesh escalates, this member fails; when this
    /// member exits or is restarted, that mesh stops.
    pub async fn spawn_mesh<B: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &B::Args,
        policy: crate::policy::MeshPolicy,
    ) -> Result<crate::child::ChildMesh<B>, crate::runtime::MeshError> {
        match &self.link {
            Some(link) => link.spawn::<B>(name, per_proc, args, policy).await,
            None => Err(crate::runtime::MeshError::SpawnChild {
                mesh: name.to_owned(),
                message: "this member cannot reach a controller (simulation)".into(),
            }),
        }
    }

    /// The mesh's name.
    pub fn mesh(&self) -> &str {
        &self.mesh
    }

    /// The member's rank in the mesh.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The member's point in the mesh's shape.
    pub fn point(&self) -> &Point {
        &self.point
    }

    /// The mesh generation this member belongs to.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The proc the member runs in.
    pub fn proc(&self) -> &ProcId {
        &self.proc
    }
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

/// A message to a member, as the proc delivers it.
pub struct MemberMsg {
    /// The encoded message.
    pub(crate) payload: Bytes,
    /// Where the reply goes, if anyone waits for it.
    pub(crate) reply: Option<oneshot::Sender<EncodedReply>>,
}

impl fmt::Debug for MemberMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemberMsg")
            .field("payload_bytes", &self.payload.len())
            .field("reply", &self.reply.is_some())
            .finish()
    }
}

/// Encodes a value for the wire (postcard, as the control plane).
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Bytes, String> {
    postcard::to_allocvec(value)
        .map(Bytes::from)
        .map_err(|e| e.to_string())
}

/// Decodes a value from the wire.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| e.to_string())
}

/// The ractor actor that runs one member of type `A`.
pub struct MemberActor<A>(PhantomData<fn() -> A>);

impl<A> MemberActor<A> {
    pub(crate) fn new() -> Self {
        Self(PhantomData)
    }
}

/// What a [`MemberActor`] starts from.
pub struct MemberStart {
    pub(crate) member: Member,
    pub(crate) args: Bytes,
}

/// A running member's state.
pub struct MemberState<A> {
    actor: A,
    member: Member,
}

impl<A: MeshActor> Actor for MemberActor<A> {
    type Msg = MemberMsg;
    type State = MemberState<A>;
    type Arguments = MemberStart;

    async fn pre_start(
        &self,
        _: ActorRef<MemberMsg>,
        start: MemberStart,
    ) -> Result<MemberState<A>, ActorProcessingErr> {
        let args: A::Args =
            decode(&start.args).map_err(|e| format!("bad arguments for {}: {e}", A::NAME))?;
        let actor = A::new(&start.member, args).await?;
        Ok(MemberState {
            actor,
            member: start.member,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<MemberMsg>,
        msg: MemberMsg,
        state: &mut MemberState<A>,
    ) -> Result<(), ActorProcessingErr> {
        let MemberMsg { payload, reply } = msg;
        let answer = |r: EncodedReply| {
            if let Some(reply) = reply {
                // The caller may have given up; that is fine.
                let _ = reply.send(r);
            }
        };
        let message: A::Msg = match decode(&payload) {
            Ok(m) => m,
            Err(e) => {
                answer(Err(MemberError::BadMessage(e)));
                return Ok(());
            }
        };
        // A panic unwinds through here to the Guarded wrapper, which reports
        // it; the dropped reply sender tells the caller the member failed.
        match state.actor.handle(&state.member, message).await {
            Ok(value) => {
                answer(encode(&value).map_err(MemberError::BadReply));
                Ok(())
            }
            Err(e) => {
                let text = e.to_string();
                answer(Err(MemberError::Failed(text.clone())));
                Err(e)
            }
        }
    }
}
