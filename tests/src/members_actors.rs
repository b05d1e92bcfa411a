//! The mesh actors of the members suite (`tests/members.rs`), registered in
//! its proc binary (`members_proc`) and in the test binary that drives it:
//! a [`Trainer`] that talks to its peers, blocks its core, shares buffers
//! and reports why it started; a [`Loader`] that only says where it runs
//! (to show that meshes sharing a proc move together).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use regent_mesh::protocol::StartKind;
use regent_mesh::{
    ActorError, ChannelError, Member, MemberError, MeshActor, MeshStatus, PeerChannel,
    PeersRestarted, Rank, Retry, Selection,
};
use regent_rdma::{BackendKind, BackendPolicy, LocalBuffer, RemoteBuffer};
use serde::{Deserialize, Serialize};

/// The environment variable a test's placement sets per proc rank.
pub const SLOT_ENV: &str = "REGENT_TEST_SLOT";

/// How long a member's own calls may take at most in this suite.
const MEMBER_DEADLINE: Duration = Duration::from_secs(60);

/// Why a member started, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartSeen {
    /// The generation of this life.
    pub generation: u64,
    /// First start or restart (after what).
    pub kind: StartKind,
    /// The ranks restarted with it.
    pub restarted: Vec<u32>,
    /// The live rank to heal from.
    pub source: Option<u32>,
}

/// A `peers_restarted` callback, as a survivor reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartSeen {
    /// The mesh's new generation.
    pub generation: u64,
    /// The restarted ranks.
    pub ranks: Vec<u32>,
    /// (restarted rank, its source).
    pub sources: Vec<(u32, u32)>,
    /// `Member::generation()` during the callback.
    pub member_generation: u64,
}

/// Who a member is and where it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Me {
    /// Its rank.
    pub rank: u32,
    /// Its proc's OS process.
    pub pid: u32,
    /// Its proc.
    pub proc: String,
    /// Why it started.
    pub start: StartSeen,
    /// The mesh's generation now.
    pub generation_now: u64,
    /// What it was told of its peers' restarts.
    pub restarts: Vec<RestartSeen>,
    /// Its proc's [`SLOT_ENV`].
    pub slot: Option<String>,
    /// Its proc's arguments (after the program).
    pub args: Vec<String>,
}

/// What a [`Trainer`] is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TrainerOp {
    /// Reply [`TrainerReply::Me`].
    Whoami,
    /// Reply with the number.
    Echo(u64),
    /// Block this member's thread (a busy loop, never yielding) this many
    /// milliseconds: what a tensor kernel does to its core.
    Spin(u64),
    /// Sleep (yielding) this many milliseconds.
    Sleep(u64),
    /// Fail if this is rank `.0` and the mesh is in generation 0; else
    /// reply with the generation.
    FailInFirstGeneration(u32),
    /// Call rank `to` of this member's own mesh with `msg` within
    /// `timeout_ms`, retrying in the next generation with `retry`.
    Ask {
        /// The peer.
        to: u32,
        /// What to ask it.
        msg: Box<TrainerOp>,
        /// The call's deadline.
        timeout_ms: u64,
        /// Whether to retry in the next generation.
        retry: bool,
    },
    /// Register `len` bytes (a pattern of `seed`); reply with the handle.
    Share {
        /// Bytes.
        len: usize,
        /// The pattern's seed.
        seed: u8,
    },
    /// Read a peer's buffer one-sidedly through `backend` (the manager's
    /// choice when `None`); reply with its checksum and the backend.
    Read {
        /// The buffer.
        handle: RemoteBuffer,
        /// Force this backend.
        backend: Option<String>,
    },
    /// Open data channel `tag`.
    ChannelOpen(u16),
    /// Receive from `from` on channel `tag` within `timeout_ms`.
    ChannelRecv {
        /// The channel.
        tag: u16,
        /// The peer.
        from: u32,
        /// The wait's deadline.
        timeout_ms: u64,
    },
}

/// A [`Trainer`]'s reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TrainerReply {
    /// Who answered.
    Me(Box<Me>),
    /// A number.
    Count(u64),
    /// How long a spin ran, in milliseconds.
    Spun(u64),
    /// What a call to a peer gave: its reply, or the failures by rank.
    Asked(Result<Box<TrainerReply>, Vec<(u32, MemberError)>>),
    /// A buffer handle.
    Handle(RemoteBuffer),
    /// A checksum and the backend that read it.
    Read {
        /// The checksum.
        checksum: u64,
        /// The backend.
        backend: String,
    },
    /// Bytes from a channel.
    Bytes(Vec<u8>),
    /// An error the handler reports without failing.
    Error(String),
    /// Done.
    Ok,
}

/// The checksum (FNV-1a) buffers are compared by.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The bytes a `Share` registers.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A member that talks to its peers (see [`TrainerOp`]).
pub struct Trainer {
    rank: u32,
    start: StartSeen,
    restarts: Vec<RestartSeen>,
    shared: Vec<LocalBuffer>,
    channels: HashMap<u16, PeerChannel>,
}

impl Trainer {
    fn me(&self, member: &Member) -> Me {
        Me {
            rank: self.rank,
            pid: std::process::id(),
            proc: member.proc().to_string(),
            start: self.start.clone(),
            generation_now: member.generation().0,
            restarts: self.restarts.clone(),
            slot: std::env::var(SLOT_ENV).ok(),
            args: std::env::args().skip(1).collect(),
        }
    }

    fn channel(&mut self, member: &Member, tag: u16) -> Result<&mut PeerChannel, ActorError> {
        match self.channels.entry(tag) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => Ok(e.insert(member.channel(tag)?)),
        }
    }
}

fn channel_error(e: &ChannelError) -> String {
    match e {
        ChannelError::PeerFailed(r) => format!("peer-failed {}", r.0),
        ChannelError::Restarted { .. } => "restarted".into(),
        ChannelError::Timeout(r) => format!("timeout {}", r.0),
        other => other.to_string(),
    }
}

impl MeshActor for Trainer {
    const NAME: &'static str = "e2e/members/trainer";
    type Args = ();
    type Msg = TrainerOp;
    type Reply = TrainerReply;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        let s = member.start();
        Ok(Self {
            rank: member.rank().0,
            start: StartSeen {
                generation: s.generation.0,
                kind: s.kind.clone(),
                restarted: s.restarted.iter().map(|r| r.0).collect(),
                source: s.source.map(|r| r.0),
            },
            restarts: Vec::new(),
            shared: Vec::new(),
            channels: HashMap::new(),
        })
    }

    async fn handle(&mut self, member: &Member, op: TrainerOp) -> Result<TrainerReply, ActorError> {
        Ok(match op {
            TrainerOp::Whoami => TrainerReply::Me(Box::new(self.me(member))),
            TrainerOp::Echo(x) => TrainerReply::Count(x),
            TrainerOp::Spin(ms) => {
                let t = Instant::now();
                let mut x = 0u64;
                while t.elapsed() < Duration::from_millis(ms) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                TrainerReply::Spun(t.elapsed().as_millis() as u64)
            }
            TrainerOp::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                TrainerReply::Ok
            }
            TrainerOp::FailInFirstGeneration(rank) => {
                if rank == self.rank && member.generation().0 == 0 {
                    return Err(format!("rank {rank} fails in generation 0").into());
                }
                TrainerReply::Count(member.generation().0)
            }
            TrainerOp::Ask {
                to,
                msg,
                timeout_ms,
                retry,
            } => {
                let mut peers = member
                    .peers::<Trainer>()?
                    .within(Duration::from_millis(timeout_ms));
                if retry {
                    peers = peers.with_retry(Retry::new(3, MEMBER_DEADLINE));
                }
                let shape = peers.mesh_shape();
                let point = shape.point_of(Rank(to)).ok_or("no such rank")?;
                let only =
                    Selection::dims(point.names().iter().zip(point.coords()).map(|(n, c)| {
                        (
                            n.as_str().to_owned(),
                            regent_mesh::selection::DimSpec::Index(*c),
                        )
                    }))?;
                let vm = peers.call(&only, &msg).await?;
                TrainerReply::Asked(match vm.into_result() {
                    Ok(mut values) => Ok(Box::new(values.pop().ok_or("no reply")?.1)),
                    Err(f) => Err(f.failed.into_iter().map(|(r, e)| (r.0, e)).collect()),
                })
            }
            TrainerOp::Share { len, seed } => {
                // Peers only read it.
                let memory = regent_rdma::Memory::copy_from(&pattern(len, seed))?;
                let buffer = member
                    .buffers()?
                    .register_with(memory, regent_rdma::Access::ReadOnly)?;
                let handle = buffer.handle().clone();
                self.shared.push(buffer);
                TrainerReply::Handle(handle)
            }
            TrainerOp::Read { handle, backend } => {
                let buffers = member.buffers()?;
                buffers.set_backend_policy(match backend.as_deref() {
                    None => BackendPolicy::Auto,
                    Some("shm") => BackendPolicy::Only(BackendKind::Shm),
                    Some("tcp") => BackendPolicy::Only(BackendKind::Tcp),
                    Some(other) => return Err(format!("no backend {other}").into()),
                });
                let used = buffers.backend_for(&handle)?;
                let mut local = vec![0u8; handle.len_bytes() as usize];
                let read = tokio::time::timeout(
                    MEMBER_DEADLINE,
                    buffers.read_into(&handle, 0, &mut local),
                )
                .await;
                buffers.set_backend_policy(BackendPolicy::Auto);
                match read {
                    Ok(Ok(())) => TrainerReply::Read {
                        checksum: checksum(&local),
                        backend: used.to_string(),
                    },
                    Ok(Err(e)) => TrainerReply::Error(e.to_string()),
                    Err(_) => TrainerReply::Error("the read did not end".into()),
                }
            }
            TrainerOp::ChannelOpen(tag) => {
                self.channel(member, tag)?;
                TrainerReply::Ok
            }
            TrainerOp::ChannelRecv {
                tag,
                from,
                timeout_ms,
            } => {
                let channel = self.channel(member, tag)?;
                let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
                match channel.recv_from(Rank(from), deadline).await {
                    Ok(data) => TrainerReply::Bytes(data.to_vec()),
                    Err(e) => TrainerReply::Error(channel_error(&e)),
                }
            }
        })
    }

    async fn peers_restarted(
        &mut self,
        member: &Member,
        change: &PeersRestarted,
    ) -> Result<(), ActorError> {
        self.restarts.push(RestartSeen {
            generation: change.generation.0,
            ranks: change.ranks.iter().map(|r| r.0).collect(),
            sources: change.sources.iter().map(|(a, b)| (a.0, b.0)).collect(),
            member_generation: member.generation().0,
        });
        Ok(())
    }
}

/// A member that only says where it runs: a data loader beside a trainer.
pub struct Loader;

/// Where a [`Loader`] runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    /// Its rank.
    pub rank: u32,
    /// Its proc's OS process.
    pub pid: u32,
    /// Its generation now.
    pub generation: u64,
}

impl MeshActor for Loader {
    const NAME: &'static str = "e2e/members/loader";
    type Args = ();
    type Msg = ();
    type Reply = Place;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self)
    }

    async fn handle(&mut self, member: &Member, (): ()) -> Result<Place, ActorError> {
        Ok(Place {
            rank: member.rank().0,
            pid: std::process::id(),
            generation: member.generation().0,
        })
    }
}

/// Whether a status is the running one (for `wait_status`).
pub fn running(status: &MeshStatus) -> bool {
    *status == MeshStatus::Running
}

regent_mesh::register_actor!(Trainer);
regent_mesh::register_actor!(Loader);
