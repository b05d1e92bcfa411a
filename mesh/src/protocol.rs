//! The messages between a controller and the proc runtimes, and between the
//! procs of a cast tree. All travel on the control plane (`regent-net`),
//! which authenticates senders and bounds frame sizes. Every message a proc
//! takes is checked here before use ([`ProcCommand::validate`],
//! [`CastFrame::validate_at`]): counts and ranges are bounded, and the
//! arithmetic on them is checked.

use std::num::NonZeroU32;

use bytes::Bytes;
use regent_net::{ActorId, ActorName, Generation, Message, PortId, ProcAddr, ProcId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::MemberError;
use crate::policy::{Decision, FailureCause, MeshFailure, PolicyWire};
use crate::selection::{Selected, Selection};
use crate::shape::Shape;

mod relay;
pub use relay::{Hop, MAX_RELAY_FAILED, RelayBody, RelayFrame, RelayOutcome, Relayed};

/// The most procs a mesh may have.
pub const MAX_PROCS: u32 = 1 << 20;
/// The most members a mesh may have on one proc.
pub const MAX_PER_PROC: u32 = 1 << 12;
/// The longest budget a cast may carry (a day).
pub const MAX_BUDGET_MS: u32 = 24 * 3600 * 1000;
/// The longest names (mesh names, actor types, reducers) a message may carry.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest failure text a message may carry.
pub const MAX_TEXT_BYTES: usize = 16 << 10;
/// The most casts one [`CastFrame`] carries (its own and those batched
/// after it, [`CastFrame::more`]).
pub const MAX_BATCHED_CASTS: usize = 64;

/// A mesh's identity: unique among the meshes of one controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MeshId(pub u64);

/// The capability to cast to a mesh: a random number made at spawn, known
/// to the mesh's owner, its procs, and whoever they hand a reference to. A
/// cast without it is refused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CastToken(pub u128);

impl CastToken {
    /// A fresh token from the OS's random source.
    pub fn random() -> Self {
        Self::drawn(&crate::entropy::Entropy::os())
    }

    /// A fresh token from `entropy` (seeded in a simulation).
    pub(crate) fn drawn(entropy: &crate::entropy::Entropy) -> Self {
        let (a, b) = (entropy.next_u64(), entropy.next_u64());
        Self(u128::from(a) << 64 | u128::from(b))
    }
}

impl std::fmt::Debug for CastToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CastToken(..)")
    }
}

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
    /// The capability casts to the mesh carry.
    pub token: CastToken,
}

impl MeshInfo {
    /// Checks the invariants a proc relies on.
    pub fn validate(&self) -> Result<(), String> {
        ActorName::new(&self.name).map_err(|e| format!("mesh name: {e}"))?;
        if self.actor_type.len() > MAX_NAME_BYTES {
            return Err(format!("actor type name over {MAX_NAME_BYTES} bytes"));
        }
        let procs = u32::try_from(self.procs.len())
            .ok()
            .filter(|&p| p > 0 && p <= MAX_PROCS)
            .ok_or_else(|| format!("a mesh has 1..={MAX_PROCS} procs, not {}", self.procs.len()))?;
        if self.per_proc == 0 || self.per_proc > MAX_PER_PROC {
            return Err(format!(
                "a mesh has 1..={MAX_PER_PROC} members per proc, not {}",
                self.per_proc
            ));
        }
        let expected = u64::from(procs) * u64::from(self.per_proc);
        if self.shape.len() as u64 != expected {
            return Err(format!(
                "shape {} has {} members, expected {} procs x {} per proc",
                self.shape,
                self.shape.len(),
                procs,
                self.per_proc
            ));
        }
        if self.shape.layout().offset() != 0
            || self.shape.layout().max_rank() as u64 + 1 != expected
        {
            return Err(format!(
                "shape {} is not row-major over its ranks",
                self.shape
            ));
        }
        Ok(())
    }

    /// The number of procs.
    pub fn proc_count(&self) -> u32 {
        // validate() bounds it to MAX_PROCS.
        self.procs.len() as u32
    }

    /// The number of members (`procs * per_proc`, bounded by validation).
    pub fn members(&self) -> u32 {
        self.proc_count().saturating_mul(self.per_proc)
    }

    /// The proc rank of `proc`, if it hosts members of this generation.
    pub fn proc_rank(&self, proc: &ProcId) -> Option<u32> {
        self.procs
            .iter()
            .position(|a| &a.proc == proc)
            .map(|p| p as u32)
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

/// A cast's place in its sender's order: the sender's caster (a number
/// drawn when it starts, so that a restarted sender is a new one) and the
/// cast's number among that caster's casts, from 1 in dispatch order. A
/// proc never serves a cast after a later one of the same caster
/// (docs/semantics.md §4.2, FIFO per sender): when a tree's path changes
/// under a sender's casts (it routes around a proc it learned lost, and
/// that proc was only cut off), an earlier cast may come the old way after
/// a later one came the new way, and is refused rather than served out of
/// order.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct CastOrder {
    /// The sending caster's incarnation.
    pub caster: u64,
    /// The cast's number among the caster's casts; 0 for a frame outside
    /// any caster's order ([`CastOrder::NONE`]), which is never refused for
    /// its order.
    pub seq: u64,
}

impl CastOrder {
    /// No place in any order (frames that tests build by hand).
    pub const NONE: CastOrder = CastOrder { caster: 0, seq: 0 };
}

/// A cast on its way down the tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CastFrame {
    /// The mesh.
    pub mesh: MeshId,
    /// The generation the sender addresses; members of another generation do
    /// not receive it.
    pub generation: Generation,
    /// The mesh's capability.
    pub token: CastToken,
    /// The actor that cast it.
    pub origin: ActorId,
    /// Its place in the order of `origin`'s casts.
    pub order: CastOrder,
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
    /// Proc ranks the sender knows to be lost: nodes route around them.
    pub lost: Vec<u32>,
    /// The encoded message.
    pub payload: Bytes,
    /// The messages of the casts that follow this one in its sender's order
    /// (numbered on from `order.seq`), the same in every other field: a
    /// sender's consecutive casts to the same members, all fire-and-forget
    /// or all waiting for results, sent as one frame and delivered in order
    /// (empty for a single cast). With a `reply`, each cast has its own
    /// results: the `i`-th (from 0, this frame's own) answers call
    /// `reply.call + i`. At most [`MAX_BATCHED_CASTS`] casts in all.
    pub more: Vec<Bytes>,
    /// How results come back; `None` for fire-and-forget.
    pub reply: Option<ReplyTo>,
    /// How to combine results.
    pub collect: Collect,
    /// How long this node may take before it reports what it has.
    pub budget_ms: u32,
}

impl CastFrame {
    /// Checks what a node that does not host the mesh (or hosts another
    /// generation of it) relies on to answer for its subtree.
    pub fn validate(&self) -> Result<(), String> {
        let (lo, hi) = self.procs;
        if lo >= hi || hi > MAX_PROCS {
            return Err(format!("proc range {lo}..{hi} is empty or too large"));
        }
        if self.per_proc == 0 || self.per_proc > MAX_PER_PROC {
            return Err(format!("{} members per proc", self.per_proc));
        }
        if self.budget_ms > MAX_BUDGET_MS {
            return Err(format!("budget of {} ms", self.budget_ms));
        }
        if self.lost.len() > MAX_PROCS as usize || self.lost.iter().any(|&p| p >= MAX_PROCS) {
            return Err("lost procs out of range".into());
        }
        if let Collect::Reduce(name) = &self.collect
            && name.len() > MAX_NAME_BYTES
        {
            return Err("reducer name too long".into());
        }
        if !self.more.is_empty() {
            if self.more.len() >= MAX_BATCHED_CASTS {
                return Err(format!(
                    "{} casts in one frame (at most {MAX_BATCHED_CASTS})",
                    self.more.len() + 1
                ));
            }
            if let Some(reply) = &self.reply
                && reply.call.checked_add(self.more.len() as u64).is_none()
            {
                return Err("a batch of casts answered past the last call number".into());
            }
            if self.order.seq.checked_add(self.more.len() as u64).is_none() {
                return Err("a batch of casts numbered past the last number".into());
            }
        }
        Ok(())
    }

    /// The messages of the casts this frame carries, in their order.
    pub fn payloads(&self) -> impl Iterator<Item = &Bytes> {
        std::iter::once(&self.payload).chain(&self.more)
    }

    /// The number in its sender's order of the last cast this frame
    /// carries (`order.seq` for a single cast; checked by `validate`).
    pub fn last_seq(&self) -> u64 {
        self.order.seq.saturating_add(self.more.len() as u64)
    }

    /// Checks a frame against the mesh as the receiving proc hosts it: this
    /// proc is the head of the frame's range (`proc_rank`), the range and
    /// the view lie within the mesh, the layout matches, and the selection
    /// binds to the view: what it selects is returned.
    pub fn validate_at(&self, info: &MeshInfo, proc_rank: u32) -> Result<Selected, String> {
        self.validate()?;
        let (lo, hi) = self.procs;
        if lo != proc_rank {
            return Err(format!(
                "a frame for the subtree of proc {lo} reached proc {proc_rank}"
            ));
        }
        if hi > info.proc_count() {
            return Err(format!(
                "proc range {lo}..{hi} exceeds the mesh's {} procs",
                info.proc_count()
            ));
        }
        if self.per_proc != info.per_proc {
            return Err(format!(
                "{} members per proc, the mesh has {}",
                self.per_proc, info.per_proc
            ));
        }
        if self.lost.iter().any(|&p| p >= info.proc_count()) {
            return Err("a lost proc outside the mesh".into());
        }
        if self.view.layout().max_rank() >= info.members() as usize {
            return Err(format!(
                "view {} is not a view of {}",
                self.view, info.shape
            ));
        }
        self.selection
            .bind(&self.view, self.seed)
            .map_err(|e| format!("selection: {e}"))
    }
}

/// A cast frame's encoding as a [`ProcCommand::Cast`] for the children of
/// one fan-out, whose frames differ only in `procs` and the call number of
/// `reply` (every child answers to the same port): the rest is encoded
/// once, and each child's bytes are those runs with its own fields between
/// them. postcard writes a struct's fields in order with nothing between
/// them, an enum's variant as its index before its content, and an
/// option's tag before its value, so the bytes equal the derived encoding
/// of the child's command (a property test checks them against it).
#[derive(Debug)]
pub(crate) struct CastEncoding {
    /// The runs, back to back: the variant's index and the fields before
    /// `procs`; the fields between `procs` and `reply`; the reply's port;
    /// the fields after `reply`.
    runs: Vec<u8>,
    /// Where the middle, port and tail runs start in `runs`.
    middle: usize,
    port: usize,
    tail: usize,
    /// The port every child answers to, `None` for fire-and-forget.
    reply_port: Option<PortId>,
    /// Every child's budget.
    budget_ms: u32,
}

/// One child of a fan-out: its frame is the fan-out's with its own `procs`,
/// its call number at the children's reply port, and the children's
/// budget.
pub(crate) struct ChildCast<'a> {
    /// The frame the fan-out forwards.
    pub(crate) frame: &'a CastFrame,
    /// Its children's shared runs.
    pub(crate) encoded: &'a CastEncoding,
    /// The procs the child's subtree covers.
    pub(crate) procs: (u32, u32),
    /// The child's call number, where the children answer (the runs'
    /// reply port); `None` where they do not.
    pub(crate) call: Option<u64>,
}

impl ChildCast<'_> {
    /// The child's frame.
    pub(crate) fn frame(self) -> CastFrame {
        CastFrame {
            procs: self.procs,
            reply: self
                .encoded
                .reply_port
                .clone()
                .zip(self.call)
                .map(|(port, call)| ReplyTo { port, call }),
            budget_ms: self.encoded.budget_ms,
            ..self.frame.clone()
        }
    }

    /// The child's command, encoded.
    pub(crate) fn bytes(&self) -> Result<Bytes, String> {
        self.encoded.child(self.procs, self.call)
    }
}

impl CastEncoding {
    /// The shared runs of `frame`'s children, each with `budget_ms` and
    /// answering to `reply_port`.
    pub(crate) fn new(
        frame: &CastFrame,
        budget_ms: u32,
        reply_port: Option<PortId>,
    ) -> Result<Self, String> {
        /// [`ProcCommand`]'s variants up to `Cast`, at the same indices.
        #[derive(Serialize)]
        #[allow(dead_code)] // only `Cast` is built; the others keep its index
        enum CommandHead<'a> {
            Spawn(()),
            Stop(()),
            Respawn(()),
            Update(()),
            Failed(()),
            Cast(Head<'a>),
        }
        #[derive(Serialize)]
        struct Head<'a> {
            mesh: &'a MeshId,
            generation: &'a Generation,
            token: &'a CastToken,
            origin: &'a ActorId,
            order: &'a CastOrder,
            view: &'a Shape,
            selection: &'a Selection,
            seed: u64,
        }
        #[derive(Serialize)]
        struct Middle<'a> {
            per_proc: u32,
            lost: &'a Vec<u32>,
            payload: &'a Bytes,
            more: &'a Vec<Bytes>,
        }
        #[derive(Serialize)]
        struct Tail<'a> {
            collect: &'a Collect,
            budget_ms: u32,
        }
        // Every field named, in order: a field added to `CastFrame` fails
        // to compile here until it has its place in a run.
        let CastFrame {
            mesh,
            generation,
            token,
            origin,
            order,
            view,
            selection,
            seed,
            procs: _,
            per_proc,
            lost,
            payload,
            more,
            reply: _,
            collect,
            budget_ms: _,
        } = frame;
        let err = |e: postcard::Error| e.to_string();
        let room = 256 + payload.len() + more.iter().map(|m| m.len() + 5).sum::<usize>();
        let head = CommandHead::Cast(Head {
            mesh,
            generation,
            token,
            origin,
            order,
            view,
            selection,
            seed: *seed,
        });
        let runs = postcard::to_extend(&head, Vec::with_capacity(room)).map_err(err)?;
        let middle = runs.len();
        let runs = postcard::to_extend(
            &Middle {
                per_proc: *per_proc,
                lost,
                payload,
                more,
            },
            runs,
        )
        .map_err(err)?;
        let port = runs.len();
        let runs = match &reply_port {
            Some(p) => postcard::to_extend(p, runs).map_err(err)?,
            None => runs,
        };
        let tail = runs.len();
        let runs = postcard::to_extend(&Tail { collect, budget_ms }, runs).map_err(err)?;
        Ok(Self {
            runs,
            middle,
            port,
            tail,
            reply_port,
            budget_ms,
        })
    }

    /// The encoded command of the child covering `procs`, answering as
    /// `call` at the runs' reply port; refused if `call` is there without
    /// a port or missing with one.
    fn child(&self, procs: (u32, u32), call: Option<u64>) -> Result<Bytes, String> {
        let err = |e: postcard::Error| e.to_string();
        if call.is_some() != self.reply_port.is_some() {
            return Err("a child's call number without the fan-out's reply port".into());
        }
        // Room for the two varints of `procs`, the option's tag, the call.
        let mut bytes = Vec::with_capacity(self.runs.len() + 2 * 5 + 1 + 10);
        bytes.extend_from_slice(&self.runs[..self.middle]);
        let mut bytes = postcard::to_extend(&procs, bytes).map_err(err)?;
        bytes.extend_from_slice(&self.runs[self.middle..self.port]);
        bytes.push(u8::from(call.is_some()));
        bytes.extend_from_slice(&self.runs[self.port..self.tail]);
        let mut bytes = match call {
            Some(call) => postcard::to_extend(&call, bytes).map_err(err)?,
            None => bytes,
        };
        bytes.extend_from_slice(&self.runs[self.tail..]);
        Ok(Bytes::from(bytes))
    }
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

impl Contribution {
    /// Checks a subtree's result against the ranks the subtree covers.
    pub fn validate(&self, ranks: std::ops::Range<u32>) -> Result<(), String> {
        let inside = |r: &u32| ranks.contains(r);
        if !self.values.iter().all(|(r, _)| inside(r))
            || !self.failed.iter().all(|(r, _)| inside(r))
        {
            return Err(format!("ranks outside the subtree's {ranks:?}"));
        }
        let len = ranks.end.saturating_sub(ranks.start);
        if self.ok > len || self.values.len() > len as usize || self.failed.len() > len as usize {
            return Err(format!("more answers than the subtree's {len} members"));
        }
        Ok(())
    }
}

/// Why a member is starting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StartKind {
    /// The mesh's first start.
    First,
    /// A restart of this rank (or of the whole mesh) after `cause`.
    Restart {
        /// The failure that led to it.
        cause: FailureCause,
        /// The generation before the one this life starts in.
        previous: Generation,
    },
}

/// What changed in a mesh at a restart: survivors are told it, restarted
/// members start with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restart {
    /// The new generation.
    pub generation: Generation,
    /// The ranks that were restarted (every rank for a gang restart).
    pub ranks: Vec<u32>,
    /// Why.
    pub cause: FailureCause,
    /// For each restarted rank, a live rank of this generation that can
    /// serve its state (spread round robin over the survivors); empty after
    /// a gang restart, when none survived.
    pub sources: Vec<(u32, u32)>,
}

impl Restart {
    /// Checks the restart against the mesh in its new generation: the
    /// ranks and sources are members, the generation is the mesh's.
    pub fn validate_for(&self, info: &MeshInfo) -> Result<(), String> {
        let members = info.members();
        let ok = self.ranks.len() <= members as usize
            && self.ranks.iter().all(|&r| r < members)
            && self.sources.len() <= members as usize
            && self
                .sources
                .iter()
                .all(|&(a, b)| a < members && b < members);
        if !ok {
            return Err("restart outside the mesh".into());
        }
        if self.generation != info.generation {
            return Err(format!(
                "a restart into generation {} of a mesh in generation {}",
                self.generation.0, info.generation.0
            ));
        }
        Ok(())
    }
}

/// What restarts changed in a mesh that a proc already hosts, since the
/// generation the proc last learned (`from`): the new generation and the
/// procs that replaced lost ones since, by proc rank. Procs that host the
/// mesh are sent this in place of the whole [`MeshInfo`], which names every
/// proc: a restart then costs the controller bytes in proportion to the
/// procs, not to their square.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshChange {
    /// The generation the change starts from: the receiving proc must know
    /// it (or a later one).
    pub from: Generation,
    /// The new generation.
    pub generation: Generation,
    /// The procs that replaced lost ones since `from`, by proc rank
    /// (ascending).
    pub moved: Vec<(u32, ProcAddr)>,
}

impl MeshChange {
    /// Checks the bounds a proc relies on before it knows the mesh.
    pub fn validate(&self) -> Result<(), String> {
        if self.moved.len() > MAX_PROCS as usize || self.moved.iter().any(|(r, _)| *r >= MAX_PROCS)
        {
            return Err("moved procs out of range".into());
        }
        if self.from > self.generation {
            return Err(format!(
                "a change from generation {} back to {}",
                self.from.0, self.generation.0
            ));
        }
        Ok(())
    }

    /// `info` with this change applied; refused when `info` is older than
    /// the change's start (moves between them would be missing), newer
    /// than its end, or a moved rank is outside the mesh.
    pub fn apply(&self, info: &MeshInfo) -> Result<MeshInfo, String> {
        if info.generation < self.from {
            return Err(format!(
                "a change from generation {} to a proc that knows generation {}",
                self.from.0, info.generation.0
            ));
        }
        if self.generation < info.generation {
            return Err(format!(
                "a change to generation {} of a mesh in generation {}",
                self.generation.0, info.generation.0
            ));
        }
        let mut next = info.clone();
        next.generation = self.generation;
        for (rank, addr) in &self.moved {
            let slot = next
                .procs
                .get_mut(*rank as usize)
                .ok_or_else(|| format!("proc rank {rank} outside the mesh"))?;
            *slot = addr.clone();
        }
        Ok(next)
    }
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
        /// Why the members start (a gang restart spawns anew).
        start: Option<Restart>,
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
    /// generation (`change.generation`), replacing their current lives, and
    /// enroll the others.
    Respawn {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh.
        mesh: MeshId,
        /// Its new generation and moved procs.
        change: MeshChange,
        /// The ranks to respawn (all hosted here).
        ranks: Vec<u32>,
        /// The encoded arguments.
        args: Bytes,
        /// What changed.
        restart: Restart,
    },
    /// Enroll this proc's members of a mesh in a new generation (and learn
    /// where its procs now are): casts of older generations are refused from
    /// now on.
    Update {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The mesh.
        mesh: MeshId,
        /// Its new generation and moved procs.
        change: MeshChange,
        /// What changed (survivors are told).
        restart: Option<Restart>,
    },
    /// Members of a mesh this proc hosts (or owns through a member) failed:
    /// sent to the survivors' procs as soon as the owner decides, before any
    /// restart, so that their work with the failed ranks (a collective)
    /// ends now and casts route around the lost procs.
    Failed {
        /// The mesh.
        mesh: MeshId,
        /// The failure.
        failure: MeshFailure,
        /// Procs of the mesh that are gone.
        lost: Vec<ProcId>,
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
    /// Ask the member that owns a mesh what to do about its failure.
    Supervise {
        /// The caller's number for this request.
        call: u64,
        /// Where to answer.
        reply_to: PortId,
        /// The owner's mesh.
        owner: MeshId,
        /// The owner's rank.
        rank: u32,
        /// The owned mesh's failure.
        failure: MeshFailure,
    },
    /// The owner is alive: renew its lease.
    Renew,
    /// Stop the proc itself (exit code 0).
    Exit,
    /// An owner-signed command (spawn, update, renewal) to carry out here
    /// and forward down the tree (the relay module). Last: the variants
    /// before it keep their encoding.
    Relay(RelayFrame),
}

impl ProcCommand {
    /// Checks every field a proc relies on (see also
    /// [`CastFrame::validate_at`] once the mesh is known).
    /// Update and Respawn carry a [`MeshChange`]: their ranks and restart
    /// are checked against the mesh once the change is applied
    /// ([`Restart::validate_for`]).
    pub fn validate(&self) -> Result<(), String> {
        // Bounds that hold in any mesh, before the mesh is known.
        let restart_bounded = |r: &Restart| {
            let most = (MAX_PROCS as usize).saturating_mul(MAX_PER_PROC as usize);
            r.ranks.len() <= most && r.sources.len() <= most
        };
        match self {
            Self::Spawn {
                info,
                proc_rank,
                start,
                ..
            } => {
                info.validate()?;
                if *proc_rank >= info.proc_count() {
                    return Err(format!("proc rank {proc_rank} outside the mesh"));
                }
                if let Some(r) = start {
                    r.validate_for(info)?;
                }
            }
            Self::Respawn {
                change,
                ranks,
                restart,
                ..
            } => {
                change.validate()?;
                if !restart_bounded(restart) || restart.generation != change.generation {
                    return Err("restart outside the change".into());
                }
                if ranks.len() > MAX_PER_PROC as usize {
                    return Err("more ranks than a proc hosts".into());
                }
            }
            Self::Update {
                change, restart, ..
            } => {
                change.validate()?;
                if restart
                    .as_ref()
                    .is_some_and(|r| !restart_bounded(r) || r.generation != change.generation)
                {
                    return Err("restart outside the change".into());
                }
            }
            Self::ChildInfo { info } => info.validate()?,
            Self::Failed { failure, lost, .. } => {
                if failure.ranks.len() > (MAX_PROCS * 4) as usize || lost.len() > MAX_PROCS as usize
                {
                    return Err("failure too large".into());
                }
            }
            Self::Supervise { failure, .. } => {
                if failure.ranks.len() > (MAX_PROCS * 4) as usize {
                    return Err("failure too large".into());
                }
            }
            Self::Cast(frame) => frame.validate()?,
            Self::Relay(frame) => frame.validate()?,
            Self::Stop { .. } | Self::ChildGone { .. } | Self::Renew | Self::Exit => {}
        }
        Ok(())
    }
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
    /// The owning member's decision about a failure of its mesh (`None`:
    /// the mesh's policy).
    Decided(Option<Decision>),
    /// A part of a subtree's result (a gather too large for one frame); the
    /// rest follows on the same stream.
    CastPart(Contribution),
    /// A subtree's (last part of its) result.
    Cast(Contribution),
    /// What came of a relayed command in a subtree.
    Relayed(RelayOutcome),
    /// Whole results of casts of one batch ([`CastFrame::more`]) that were
    /// in together, each with its place in the batch: the one at `i`
    /// answers call `call + i`. At most [`MAX_BATCHED_CASTS`] of them.
    Casts(Vec<(u32, Contribution)>),
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
    pub cause: FailureCause,
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
    /// The generation the asking life began in. A life that a restart has
    /// since replaced is refused: the mesh would outlive its owner (the
    /// restart stopped the meshes the old life owned before this one).
    pub born: Generation,
    /// The new mesh's name.
    pub name: String,
    /// Its registered actor type.
    pub actor_type: String,
    /// Members per proc.
    pub per_proc: u32,
    /// The encoded arguments of every member.
    pub args: Bytes,
    /// Its policy.
    pub policy: PolicyWire,
}

impl Message for SpawnChild {
    const TYPE_NAME: &'static str = "regent/mesh/SpawnChild";
}

/// What a proc has moved on both planes since it started, as the totals of
/// its endpoint (the control plane) and of its buffer manager (the payload
/// plane, by backend). A proc with a payload plane sends it to its owner's
/// [`names::STATS_PORT`] when its lease is renewed (every lease / 3) and
/// the totals changed since the last; the owner adds what grew to its
/// metrics. A fixed number of integers: its decoder reads at most a few
/// hundred bytes whatever the frame says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcStats {
    /// The proc's message frames on the control plane.
    pub control: regent_net::ControlTraffic,
    /// The proc's one-sided reads and writes on the payload plane.
    pub payload: regent_rdma::Traffic,
}

impl ProcStats {
    /// Whether every count of `self` is at least `earlier`'s (a proc's
    /// totals only grow).
    pub fn covers(&self, earlier: &Self) -> bool {
        self.control.covers(&earlier.control) && self.payload.covers(&earlier.payload)
    }
}

impl Message for ProcStats {
    const TYPE_NAME: &'static str = "regent/mesh/ProcStats";
}

/// Decodes a [`ProcStats`] as the controller's stats port does.
#[doc(hidden)]
pub fn fuzz_decode_proc_stats(bytes: &[u8]) -> Option<ProcStats> {
    regent_net::wire::decode_body(bytes).ok()
}

/// Decodes a [`ProcCommand`] as a proc's command port does and checks what
/// the proc checks before acting on it; `None` where it would refuse it.
/// The fuzzing entry point (`fuzz/fuzz_targets/mesh_protocol.rs`), not API.
#[doc(hidden)]
pub fn fuzz_decode_command(bytes: &[u8]) -> Option<ProcCommand> {
    let command: ProcCommand = regent_net::wire::decode_body(bytes).ok()?;
    command.validate().ok()?;
    if let ProcCommand::Relay(frame) = &command
        && let Ok(relayed) = regent_net::wire::decode_body::<Relayed>(&frame.signed)
    {
        // What a proc decodes and checks once the owner's signature
        // verifies (which the fuzzer cannot make): the signed command, as
        // the command this proc runs of it (any port will do: the proc's
        // own reply port, which the bytes do not carry).
        if let Some(reply) = &frame.reply {
            let local = relayed
                .body
                .command(frame.route[0].rank, 0, reply.port.clone());
            let _ = local.validate();
        }
    }
    if let ProcCommand::Cast(frame) = &command {
        // What a proc hosting the mesh checks next ([`CastFrame::validate_at`]):
        // the view lies within the mesh, then the selection binds to it. The
        // mesh here is one that fits the frame's own claims, of at most
        // `FUZZ_MESH_MEMBERS`: binding costs time linear in the view, which a
        // real proc bounds by the mesh it hosts, while a frame alone may
        // claim 2^32 members (a timeout, not a finding).
        const FUZZ_MESH_MEMBERS: u64 = 1 << 16;
        let claimed = u64::from(frame.procs.1) * u64::from(frame.per_proc);
        let members = claimed.min(FUZZ_MESH_MEMBERS);
        if (frame.view.layout().max_rank() as u64) < members {
            let _ = frame.selection.bind(&frame.view, frame.seed);
        }
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
    /// The controller's port of [`super::ProcStats`] reports.
    pub const STATS_PORT: u32 = 4;
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

#[cfg(test)]
mod stats_tests {
    use proptest::prelude::*;

    use super::*;

    fn backend() -> impl Strategy<Value = regent_rdma::BackendTraffic> {
        any::<[u64; 4]>().prop_map(|[a, b, c, d]| regent_rdma::BackendTraffic {
            read_bytes: a,
            reads: b,
            written_bytes: c,
            writes: d,
        })
    }

    fn stats() -> impl Strategy<Value = ProcStats> {
        (any::<[u64; 4]>(), backend(), backend(), backend()).prop_map(
            |([a, b, c, d], shm, tcp, ibverbs)| ProcStats {
                control: regent_net::ControlTraffic {
                    frames_sent: a,
                    bytes_sent: b,
                    frames_received: c,
                    bytes_received: d,
                },
                payload: regent_rdma::Traffic { shm, tcp, ibverbs },
            },
        )
    }

    proptest! {
        #[test]
        fn any_report_round_trips_in_a_bounded_frame(s in stats()) {
            let bytes = regent_net::wire::encode_payload(&s).unwrap();
            // 16 varints of at most 10 bytes each.
            prop_assert!(bytes.len() <= 160);
            prop_assert_eq!(fuzz_decode_proc_stats(&bytes), Some(s));
        }

        #[test]
        fn any_bytes_are_refused_or_decode_to_what_encodes_back(
            bytes in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            if let Some(s) = fuzz_decode_proc_stats(&bytes) {
                let again = regent_net::wire::encode_payload(&s).unwrap();
                prop_assert_eq!(fuzz_decode_proc_stats(&again), Some(s));
            }
        }
    }

    #[test]
    fn truncated_or_padded_reports_are_refused() {
        let s = ProcStats::default();
        let bytes = regent_net::wire::encode_payload(&s).unwrap();
        assert!(fuzz_decode_proc_stats(&bytes[..bytes.len() - 1]).is_none());
        let mut long = bytes.to_vec();
        long.push(0);
        assert!(fuzz_decode_proc_stats(&long).is_none());
        // A varint longer than a u64 is refused.
        let mut wide = vec![0xff; 11];
        wide.extend_from_slice(&bytes[1..]);
        assert!(fuzz_decode_proc_stats(&wide).is_none());
    }

    #[test]
    fn the_committed_fuzz_seeds_decode() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/mesh_protocol");
        for name in ["proc-stats-none", "proc-stats-busy"] {
            let bytes = std::fs::read(dir.join(name)).unwrap();
            assert!(fuzz_decode_proc_stats(&bytes).is_some(), "{name}");
        }
    }

    #[test]
    fn totals_cover_only_what_they_do_not_undercut() {
        let mut a = ProcStats::default();
        let b = a;
        a.payload.tcp.reads = 1;
        assert!(a.covers(&b) && !b.covers(&a));
        a.control.bytes_received = 0;
        let mut c = a;
        c.control.frames_sent = 5;
        c.payload.tcp.reads = 0;
        assert!(!c.covers(&a) && !a.covers(&c));
    }
}

#[cfg(test)]
mod cast_encoding_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::shape::tests::arb_shape;

    fn actor(proc: &str, name: &str, index: u32) -> ActorId {
        ActorId {
            proc: ProcId::new(proc).unwrap(),
            name: ActorName::new(name).unwrap(),
            index,
        }
    }

    fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
    }

    fn frame() -> impl Strategy<Value = CastFrame> {
        let selection = prop_oneof![
            Just(Selection::All),
            Just(Selection::None),
            Just("procs=0..2".parse::<Selection>().unwrap()),
        ];
        let collect = prop_oneof![
            Just(Collect::Ack),
            Just(Collect::Gather),
            "[a-z]{0,12}".prop_map(Collect::Reduce),
        ];
        (
            (any::<[u64; 3]>(), any::<u128>(), arb_shape(3, 4), selection),
            (any::<u32>(), proptest::collection::vec(any::<u32>(), 0..4)),
            (
                bytes(300),
                proptest::collection::vec(bytes(40), 0..3),
                collect,
            ),
            ("[a-z0-9]{1,20}", any::<u64>()),
        )
            .prop_map(
                |(
                    ([mesh, generation, seed], token, view, selection),
                    (per_proc, lost),
                    (payload, more, collect),
                    (name, index),
                )| CastFrame {
                    mesh: MeshId(mesh),
                    generation: Generation(generation),
                    token: CastToken(token),
                    origin: actor("controller", &name, index as u32),
                    order: CastOrder {
                        caster: seed.rotate_left(7),
                        seq: index,
                    },
                    view,
                    selection,
                    seed,
                    procs: (0, 1),
                    per_proc,
                    lost,
                    payload,
                    more,
                    reply: None,
                    collect,
                    budget_ms: 0,
                },
            )
    }

    fn port() -> impl Strategy<Value = PortId> {
        ("[a-z0-9]{1,30}", any::<u32>())
            .prop_map(|(proc, port)| actor(&proc, "regent-proc", 0).port(port))
    }

    proptest! {
        /// Each child's bytes from the shared runs are the derived encoding
        /// of its whole command, whatever the fields hold.
        #[test]
        fn a_child_encodes_as_its_whole_command(
            frame in frame(),
            reply_port in proptest::option::of(port()),
            children in proptest::collection::vec((any::<(u32, u32)>(), any::<u64>()), 1..4),
            budget_ms in any::<u32>(),
            other in any::<u64>(),
        ) {
            let encoded = CastEncoding::new(&frame, budget_ms, reply_port.clone()).unwrap();
            for (procs, call) in children {
                let reply = reply_port.clone().map(|port| ReplyTo { port, call });
                let call = reply.as_ref().map(|r| r.call);
                let child = ChildCast { frame: &frame, encoded: &encoded, procs, call };
                let bytes = child.bytes().unwrap();
                let whole = ProcCommand::Cast(CastFrame {
                    procs,
                    reply,
                    budget_ms,
                    ..frame.clone()
                });
                // The frame a fabric without bytes sends is the same command.
                prop_assert_eq!(format!("{:?}", ProcCommand::Cast(child.frame())), format!("{whole:?}"));
                prop_assert_eq!(&bytes[..], &encode(&whole).unwrap()[..]);
                // And it decodes back to that command.
                let back: ProcCommand = decode(&bytes).unwrap();
                prop_assert_eq!(format!("{back:?}"), format!("{whole:?}"));
                // A call number without the runs' port, or none with it,
                // is refused.
                let mismatched = match call {
                    Some(_) => None,
                    None => Some(other),
                };
                prop_assert!(encoded.child(procs, mismatched).is_err());
            }
        }
    }
}
