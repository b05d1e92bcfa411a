//! The messages between a controller and the proc runtimes, and between the
//! procs of a cast tree. All travel on the control plane (`regent-net`),
//! which authenticates senders and bounds frame sizes; every field decoded
//! here is checked before use.

use std::num::NonZeroU32;

use bytes::Bytes;
use regent_net::{ActorId, Generation, Message, PortId, ProcAddr};
use serde::{Deserialize, Serialize};

use crate::actor::MemberError;
use crate::selection::Selection;
use crate::shape::Shape;

/// A mesh's identity: unique among the meshes of one controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MeshId(pub u64);

/// Everything a proc needs to know about a mesh it hosts members of.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MeshInfo {
    /// The mesh.
    pub id: MeshId,
    /// Its name (the actor name of its members).
    pub name: String,
    /// The registered actor type of its members.
    pub actor_type: String,
    /// Its shape: the proc mesh's dimensions and one more for the members of
    /// each proc, row-major over ranks `0..len`.
    pub shape: Shape,
    /// Members per proc: proc `p` hosts ranks `p * per_proc .. (p + 1) *
    /// per_proc`.
    pub per_proc: u32,
    /// The procs, by proc rank.
    pub procs: Vec<ProcAddr>,
    /// The cast tree's fan-out.
    pub fanout: NonZeroU32,
    /// Where member failures are reported.
    pub owner: PortId,
    /// The current generation.
    pub generation: Generation,
}

impl MeshInfo {
    /// Checks the invariants a proc relies on.
    pub fn validate(&self) -> Result<(), String> {
        let procs = u32::try_from(self.procs.len()).map_err(|_| "too many procs".to_owned())?;
        let expected = u64::from(procs) * u64::from(self.per_proc);
        if self.per_proc == 0 {
            return Err("a mesh needs at least one member per proc".into());
        }
        if self.shape.len() as u64 != expected {
            return Err(format!(
                "shape {} has {} members, expected {} procs x {} per proc",
                self.shape,
                self.shape.len(),
                procs,
                self.per_proc
            ));
        }
        Ok(())
    }

    /// The number of procs.
    pub fn proc_count(&self) -> u32 {
        // validate() bounds it to u32.
        self.procs.len() as u32
    }
}

/// How the results of a cast come back up the tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Collect {
    /// Only which members could not be reached (a cast).
    Ack,
    /// Every reply, with its rank (a call).
    Gather,
    /// Replies combined by the named reducer, inside the tree.
    Reduce(String),
}

/// Where a node sends its subtree's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyTo {
    /// The port of the parent node (a proc's reply port, or the caller's).
    pub port: PortId,
    /// The parent's number for this call.
    pub call: u64,
}

/// A cast on its way down the tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CastFrame {
    /// The mesh.
    pub mesh: MeshId,
    /// The generation the sender addresses; members of another generation do
    /// not receive it.
    pub generation: Generation,
    /// The actor that cast it.
    pub origin: ActorId,
    /// The view cast to (the whole mesh's shape, or a slice of it).
    pub view: Shape,
    /// Which members of the view.
    pub selection: Selection,
    /// Decides the members `any` picks, the same at every node.
    pub seed: u64,
    /// The procs this node's subtree covers; the node is the first.
    pub procs: (u32, u32),
    /// Members per proc (so that a node that does not host the mesh can
    /// still name the ranks it could not reach).
    pub per_proc: u32,
    /// The encoded message.
    pub payload: Bytes,
    /// How results come back; `None` for fire-and-forget.
    pub reply: Option<ReplyTo>,
    /// How to combine results.
    pub collect: Collect,
    /// How long this node may take before it reports what it has.
    pub budget_ms: u32,
}

/// The result of a subtree.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contribution {
    /// Gathered replies by rank (for [`Collect::Gather`]).
    pub values: Vec<(u32, Bytes)>,
    /// The combined reply (for [`Collect::Reduce`]), if any member replied.
    pub reduced: Option<Bytes>,
    /// Members that did not reply, and why.
    pub failed: Vec<(u32, MemberError)>,
    /// How many members delivered or replied.
    pub ok: u32,
}

/// A command from a controller (or a parent node) to a proc's control port.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ProcCommand {
    /// Spawn this proc's members of a mesh.
    Spawn {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh.
        info: MeshInfo,
        /// This proc's rank in the mesh.
        proc_rank: u32,
        /// The encoded arguments of every member.
        args: Bytes,
    },
    /// Stop this proc's members of a mesh, in reverse rank order.
    Stop {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh.
        mesh: MeshId,
    },
    /// Respawn some of this proc's members of a mesh in the mesh's new
    /// generation (`info.generation`), replacing their current lives.
    Respawn {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh, in its new generation.
        info: MeshInfo,
        /// The ranks to respawn (all hosted here).
        ranks: Vec<u32>,
        /// The encoded arguments.
        args: Bytes,
    },
    /// Enroll this proc's members of a mesh in a new generation (and learn
    /// where its procs now are): casts of older generations are refused from
    /// now on.
    Update {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh, in its new generation.
        info: MeshInfo,
    },
    /// A cast to deliver here and forward down the tree.
    Cast(CastFrame),
    /// A mesh owned by one of this proc's members was spawned, restarted or
    /// moved: its current generation and procs (so the member can cast to it).
    ChildInfo {
        /// The owned mesh.
        info: MeshInfo,
    },
    /// A mesh owned by one of this proc's members has stopped.
    ChildGone {
        /// The owned mesh.
        mesh: MeshId,
    },
    /// The owner is alive: renew its lease.
    Renew,
    /// Stop the proc itself (exit code 0).
    Exit,
}

impl Message for ProcCommand {
    const TYPE_NAME: &'static str = "regent/mesh/ProcCommand";
}

/// An answer to a [`ProcCommand`], or a subtree's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcReply {
    /// The number of the request or call it answers.
    pub call: u64,
    /// The answer.
    pub body: ReplyBody,
}

/// The body of a [`ProcReply`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ReplyBody {
    /// The members were spawned, or why not.
    Spawned(Result<(), String>),
    /// The members were stopped.
    Stopped,
    /// The proc enrolled its members in the new generation.
    Updated,
    /// A mesh a member asked for was spawned (its info), or why not.
    ChildSpawned(Result<MeshInfo, String>),
    /// A subtree's result.
    Cast(Contribution),
}

impl Message for ProcReply {
    const TYPE_NAME: &'static str = "regent/mesh/ProcReply";
}

/// A member exited on its own: sent by its proc to the mesh's owner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberExited {
    /// The mesh.
    pub mesh: MeshId,
    /// The member's rank.
    pub rank: u32,
    /// The generation of the member's life.
    pub generation: Generation,
    /// Why.
    pub cause: crate::policy::FailureCause,
}

impl Message for MemberExited {
    const TYPE_NAME: &'static str = "regent/mesh/MemberExited";
}

/// A member asks the controller to spawn a mesh that it will own, on the
/// procs of its own mesh.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpawnChild {
    /// The member's proc's number for this request.
    pub call: u64,
    /// Where to answer (the member's proc's reply port).
    pub reply_to: PortId,
    /// The member's mesh.
    pub parent: MeshId,
    /// The member's rank: the owner of the new mesh.
    pub rank: u32,
    /// The new mesh's name.
    pub name: String,
    /// Its registered actor type.
    pub actor_type: String,
    /// Members per proc.
    pub per_proc: u32,
    /// The encoded arguments of every member.
    pub args: Bytes,
    /// Its policy.
    pub policy: crate::policy::PolicyWire,
}

impl Message for SpawnChild {
    const TYPE_NAME: &'static str = "regent/mesh/SpawnChild";
}

/// Decodes a [`ProcCommand`] as a proc's command port does and checks what
/// the proc checks before acting on it; `None` where it would refuse it.
/// The fuzzing entry point (`fuzz/fuzz_targets/mesh_protocol.rs`), not API.
#[doc(hidden)]
pub fn fuzz_decode_command(bytes: &[u8]) -> Option<ProcCommand> {
    let command: ProcCommand = regent_net::wire::decode_body(bytes).ok()?;
    if let ProcCommand::Spawn { info, .. }
    | ProcCommand::Respawn { info, .. }
    | ProcCommand::Update { info, .. }
    | ProcCommand::ChildInfo { info } = &command
    {
        info.validate().ok()?;
    }
    Some(command)
}

/// Decodes and checks a [`ProcReply`], like [`fuzz_decode_command`].
#[doc(hidden)]
pub fn fuzz_decode_reply(bytes: &[u8]) -> Option<ProcReply> {
    let reply: ProcReply = regent_net::wire::decode_body(bytes).ok()?;
    if let ReplyBody::ChildSpawned(Ok(info)) = &reply.body {
        info.validate().ok()?;
    }
    Some(reply)
}

/// Decodes and checks a [`MemberExited`], like [`fuzz_decode_command`].
#[doc(hidden)]
pub fn fuzz_decode_member_exited(bytes: &[u8]) -> Option<MemberExited> {
    regent_net::wire::decode_body(bytes).ok()
}

/// Decodes and checks a [`SpawnChild`], like [`fuzz_decode_command`].
#[doc(hidden)]
pub fn fuzz_decode_spawn_child(bytes: &[u8]) -> Option<SpawnChild> {
    regent_net::wire::decode_body(bytes).ok()
}

/// Names of the well-known actors of a proc.
pub mod names {
    /// The proc runtime's actor: port 0 takes [`super::ProcCommand`]s, port 1
    /// takes [`super::ProcReply`]s from child nodes.
    pub const PROC: &str = "regent-proc";
    /// The controller's actor: port 1 takes [`super::ProcReply`]s.
    pub const CONTROLLER: &str = "regent-controller";
    /// Port of commands.
    pub const COMMAND_PORT: u32 = 0;
    /// Port of replies.
    pub const REPLY_PORT: u32 = 1;
    /// The controller's port of [`super::MemberExited`] reports.
    pub const EVENT_PORT: u32 = 2;
    /// The controller's port of [`super::SpawnChild`] requests.
    pub const SPAWN_PORT: u32 = 3;
}
