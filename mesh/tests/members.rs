//! What members can do, over in-process procs (real proc runtimes, real
//! QUIC with mutual TLS, one process): reach their peers through their own
//! mesh (calls, casts, point-to-point sends, data channels) with the
//! controller out of the data path, reach meshes they were handed, use the
//! payload plane, learn why they started and when peers restarted, retry in
//! the next generation, start slowly without stalling their proc, stop with
//! a hook, and decide the failures of meshes they own. Faults that need real
//! processes (SIGKILL, SIGSTOP, a core blocked for seconds) are in the
//! end-to-end suite (`tests/tests/members.rs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use regent_mesh::inproc::InProcAllocator;
use regent_mesh::protocol::StartKind;
use regent_mesh::selection::DimSpec;
use regent_mesh::{
    ActorError, ActorMesh, ChannelError, Decision, FailureCause, Max, Member, MemberError,
    MeshActor, MeshError, MeshFailure, MeshPolicy, MeshRef, MeshStatus, PeerChannel,
    PeersRestarted, ProcMesh, Rank, Retry, Runtime, RuntimeConfig, Selection, Shape, SpawnOptions,
    Sum,
};
use regent_net::Generation;
use regent_rdma::{LocalBuffer, RemoteBuffer};
use serde::{Deserialize, Serialize};

/// Generous: the machines are shared and have two cores.
const DEADLINE: Duration = Duration::from_secs(20);

/// A member that talks to its peers.
struct Peer {
    rank: u32,
    start: StartSeen,
    /// Values recorded from `Record`, in arrival order.
    seen: Vec<(u32, u64)>,
    /// Every `peers_restarted` this life was told.
    restarts: Vec<RestartSeen>,
    /// A buffer this member shares on the payload plane.
    shared: Option<LocalBuffer>,
    /// A mesh this member was handed in its args.
    store: Option<ActorMesh<Store>>,
    /// Data channels this member opened, by tag.
    channels: HashMap<u16, PeerChannel>,
    /// What its heal source answered from `new`, on a restart with one.
    healed: Option<Result<u64, String>>,
}

/// [`regent_mesh::StartContext`] as a member reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StartSeen {
    generation: u64,
    kind: StartKind,
    restarted: Vec<u32>,
    source: Option<u32>,
}

/// [`PeersRestarted`] as a member reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct RestartSeen {
    generation: u64,
    ranks: Vec<u32>,
    sources: Vec<(u32, u32)>,
    /// `Member::generation()` when the callback ran.
    member_generation: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct PeerArgs {
    store: Option<MeshRef<Store>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Op {
    /// Who and where the member is, and what it was told.
    Whoami,
    /// Call the first rank of `to` with the rest; reply with the path the
    /// call took (this rank first).
    Chain(Vec<u32>),
    /// Pass a token on to the next rank (`cast_nowait`) until `laps` are
    /// done; rank 0 counts the laps.
    Token { laps: u32 },
    /// How many laps rank 0 has seen.
    Laps,
    /// Remember a value.
    Record { from: u32, value: u64 },
    /// The values remembered.
    Seen,
    /// Send `count` values to `to`: every 7th with a waited cast, the
    /// others fire-and-forget.
    Stream { to: u32, count: u64 },
    /// Call `to` with `msg` within `timeout_ms` (retrying in the next
    /// generation with `retry`); reply with what came back.
    Ask {
        to: u32,
        msg: Box<Op>,
        timeout_ms: u64,
        retry: bool,
    },
    /// What the heal source answered from `new`.
    Healed,
    /// Ask for a peer reference of the wrong actor type.
    WrongType,
    /// The member's view of its mesh: whether it runs, and its generation.
    View,
    /// Sleep (yielding).
    Sleep(u64),
    /// Fail the handler.
    Fail,
    /// Fail if this is rank `.0` and the mesh is in generation 0; else
    /// reply with the generation.
    FailInFirstGeneration(u32),
    /// Reply with the rank (for reductions).
    Rank,
    /// Register `len` bytes filled with `seed`-derived bytes; reply with the
    /// handle.
    Share { len: usize, seed: u8 },
    /// Read a peer's buffer one-sidedly; reply with its checksum.
    Read(RemoteBuffer),
    /// Write `byte` over a peer's buffer.
    Write { to: RemoteBuffer, byte: u8 },
    /// The checksum of this member's own shared buffer.
    Checksum,
    /// Open data channel `tag` (messages sent to a channel before its
    /// receiver opened it are not kept).
    ChannelOpen(u16),
    /// Send `data` to `to` on data channel `tag`.
    ChannelSend { tag: u16, to: u32, data: Vec<u8> },
    /// Receive from `from` on data channel `tag` within `timeout_ms`.
    ChannelRecv {
        tag: u16,
        from: u32,
        timeout_ms: u64,
    },
    /// Call the store mesh this member was handed in its args.
    AskStore(StoreOp),
    /// Call the store mesh handed in this message.
    AskStoreAt(MeshRef<Store>, StoreOp),
    /// Spawn an owned mesh of `Child` named `name` (one per proc).
    Own { name: String },
    /// Tell the owned mesh's member `rank` to fail.
    FailChild { name: String, rank: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Reply {
    Me {
        rank: u32,
        start: StartSeen,
        generation_now: u64,
        restarts: Vec<RestartSeen>,
    },
    Path(Vec<u32>),
    Count(u64),
    Values(Vec<(u32, u64)>),
    /// What a call to a peer gave: replies, or failures by rank.
    Asked(Result<Box<Reply>, Vec<(u32, MemberError)>>),
    Handle(RemoteBuffer),
    Healed(Option<Result<u64, String>>),
    View {
        running: bool,
        generation: u64,
    },
    Bytes(Vec<u8>),
    Error(String),
    Store(u64),
    Ok,
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The selection of exactly `rank` in `shape`: a point-to-point send.
fn only(shape: &Shape, rank: Rank) -> Selection {
    let point = shape.point_of(rank).expect("a rank of the mesh");
    Selection::dims(
        point
            .names()
            .iter()
            .zip(point.coords())
            .map(|(n, c)| (n.as_str().to_owned(), DimSpec::Index(*c))),
    )
    .expect("a point's own names")
}

/// (mesh, rank) of every `stopping` hook that ran, in this process.
static STOPPED: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

impl MeshActor for Peer {
    const NAME: &'static str = "test/members/peer";
    type Args = PeerArgs;
    type Msg = Op;
    type Reply = Reply;

    async fn new(member: &Member, args: PeerArgs) -> Result<Self, ActorError> {
        let s = member.start();
        let store = match &args.store {
            Some(r) => Some(member.bind(r)?),
            None => None,
        };
        // A restarted member asks its source for state from `new` (the
        // source is a live member of this member's generation).
        let healed = match s.source {
            Some(source) if member.mesh() == "healing" => {
                let peers = member.peers::<Peer>()?;
                Some(match peers.call_one(source, &Op::Rank).await {
                    Ok(Reply::Count(n)) => Ok(n),
                    Ok(other) => Err(format!("{other:?}")),
                    Err(e) => Err(e.to_string()),
                })
            }
            _ => None,
        };
        Ok(Self {
            rank: member.rank().0,
            start: StartSeen {
                generation: s.generation.0,
                kind: s.kind.clone(),
                restarted: s.restarted.iter().map(|r| r.0).collect(),
                source: s.source.map(|r| r.0),
            },
            seen: Vec::new(),
            restarts: Vec::new(),
            shared: None,
            store,
            channels: HashMap::new(),
            healed,
        })
    }

    async fn handle(&mut self, member: &Member, op: Op) -> Result<Reply, ActorError> {
        Ok(match op {
            Op::Whoami => Reply::Me {
                rank: self.rank,
                start: self.start.clone(),
                generation_now: member.generation().0,
                restarts: self.restarts.clone(),
            },
            Op::Chain(mut to) => {
                if to.is_empty() {
                    return Ok(Reply::Path(vec![self.rank]));
                }
                let next = to.remove(0);
                let peers = member.peers::<Peer>()?;
                match peers.call_one(Rank(next), &Op::Chain(to)).await? {
                    Reply::Path(mut p) => {
                        p.insert(0, self.rank);
                        Reply::Path(p)
                    }
                    other => return Err(format!("unexpected {other:?}").into()),
                }
            }
            Op::Token { laps } => {
                let peers = member.peers::<Peer>()?;
                let size = member.size();
                let mut laps = laps;
                if self.rank == 0 {
                    self.seen.push((0, u64::from(laps)));
                    if laps == 0 {
                        return Ok(Reply::Ok);
                    }
                    laps -= 1;
                }
                let next = Rank((self.rank + 1) % size);
                peers
                    .cast_nowait(&only(&peers.mesh_shape(), next), &Op::Token { laps })
                    .await?;
                Reply::Ok
            }
            Op::Laps => Reply::Count(self.seen.len() as u64),
            Op::Record { from, value } => {
                self.seen.push((from, value));
                Reply::Ok
            }
            Op::Seen => Reply::Values(self.seen.clone()),
            Op::Stream { to, count } => {
                let peers = member.peers::<Peer>()?;
                let to = only(&peers.mesh_shape(), Rank(to));
                for value in 0..count {
                    let msg = Op::Record {
                        from: self.rank,
                        value,
                    };
                    if value % 7 == 0 {
                        peers.cast(&to, &msg).await?.into_result()?;
                    } else {
                        peers.cast_nowait(&to, &msg).await?;
                    }
                }
                Reply::Ok
            }
            Op::Ask {
                to,
                msg,
                timeout_ms,
                retry,
            } => {
                let mut peers = member.peers::<Peer>()?;
                if retry {
                    peers = peers.with_retry(Retry::new(3, DEADLINE));
                }
                let timeout = Duration::from_millis(timeout_ms);
                let vm = peers
                    .call_within(&only(&peers.mesh_shape(), Rank(to)), &msg, timeout)
                    .await?;
                Reply::Asked(match vm.into_result() {
                    Ok(mut values) => Ok(Box::new(values.pop().ok_or("no reply")?.1)),
                    Err(f) => Err(f.failed.into_iter().map(|(r, e)| (r.0, e)).collect()),
                })
            }
            Op::View => {
                let peers = member.peers::<Peer>()?;
                let running = peers.status() == MeshStatus::Running;
                Reply::View {
                    running,
                    generation: peers.generation().0,
                }
            }
            Op::Healed => Reply::Healed(self.healed.clone()),
            Op::WrongType => match member.peers::<Store>() {
                Ok(_) => Reply::Ok,
                Err(e @ MeshError::WrongType { .. }) => Reply::Error(e.to_string()),
                Err(e) => return Err(e.into()),
            },
            Op::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Reply::Ok
            }
            Op::Fail => return Err(format!("rank {} told to fail", self.rank).into()),
            Op::FailInFirstGeneration(rank) => {
                if rank == self.rank && member.generation() == Generation(0) {
                    return Err(format!("rank {} fails in generation 0", self.rank).into());
                }
                Reply::Count(member.generation().0)
            }
            Op::Rank => Reply::Count(u64::from(self.rank)),
            Op::Share { len, seed } => {
                let memory = regent_rdma::Memory::copy_from(&pattern(len, seed))?;
                let buffer = member.buffers()?.register(memory)?;
                let handle = buffer.handle().clone();
                self.shared = Some(buffer);
                Reply::Handle(handle)
            }
            Op::Read(remote) => {
                let mut local = vec![0u8; remote.len_bytes() as usize];
                member.buffers()?.read_into(&remote, 0, &mut local).await?;
                Reply::Count(checksum(&local))
            }
            Op::Write { to, byte } => {
                let data = vec![byte; to.len_bytes() as usize];
                member.buffers()?.write_from(&to, 0, &data).await?;
                Reply::Ok
            }
            Op::Checksum => {
                // Peers may write it while it is exposed: read it shut.
                let buffer = self.shared.as_mut().ok_or("nothing shared")?;
                buffer.set_access(regent_rdma::Access::ReadOnly).await?;
                let sum = checksum(buffer.as_slice()?);
                buffer.set_access(regent_rdma::Access::Exposed).await?;
                Reply::Count(sum)
            }
            Op::ChannelOpen(tag) => {
                self.channel(member, tag)?;
                Reply::Ok
            }
            Op::ChannelSend { tag, to, data } => {
                let channel = self.channel(member, tag)?;
                let deadline = tokio::time::Instant::now() + DEADLINE;
                channel.send(Rank(to), data.into(), deadline).await?;
                Reply::Ok
            }
            Op::ChannelRecv {
                tag,
                from,
                timeout_ms,
            } => {
                let channel = self.channel(member, tag)?;
                let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
                match channel.recv_from(Rank(from), deadline).await {
                    Ok(data) => Reply::Bytes(data.to_vec()),
                    Err(e) => Reply::Error(channel_error(&e)),
                }
            }
            Op::AskStore(op) => {
                let store = self.store.as_ref().ok_or("no store in my args")?;
                Reply::Store(store.call_one(Rank(0), &op).await?)
            }
            Op::AskStoreAt(r, op) => {
                let store = member.bind(&r)?;
                let values = store.call(&Selection::All, &op).await?.into_result()?;
                Reply::Store(values.iter().map(|(_, v)| v).sum())
            }
            Op::Own { name } => {
                let child = member
                    .spawn_mesh::<Child>(&name, 1, &(), MeshPolicy::default())
                    .await?;
                CHILDREN
                    .lock()
                    .expect("children lock")
                    .push((name, child.clone()));
                Reply::Ok
            }
            Op::FailChild { name, rank } => {
                let child = CHILDREN
                    .lock()
                    .expect("children lock")
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, c)| c.clone())
                    .ok_or("no such child")?;
                match child.call_one(Rank(rank), &ChildOp::Fail).await {
                    Err(MeshError::Members(f)) => {
                        Reply::Asked(Err(f.failed.into_iter().map(|(r, e)| (r.0, e)).collect()))
                    }
                    other => Reply::Error(format!("{other:?}")),
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

    async fn stopping(&mut self, member: &Member) {
        STOPPED
            .lock()
            .expect("stopped lock")
            .push((member.mesh().to_owned(), self.rank));
    }

    async fn supervise(&mut self, _: &Member, failure: &MeshFailure) -> Option<Decision> {
        let mut seen = OWNER_SAW.lock().expect("owner saw lock");
        seen.push((self.rank, failure.clone()));
        // The first failure of an owned mesh restarts its member, the next
        // stops that mesh.
        Some(if seen.len() == 1 {
            Decision::RestartMember
        } else {
            Decision::Stop
        })
    }
}

impl Peer {
    /// The data channel `tag`, opened on first use and kept.
    fn channel(&mut self, member: &Member, tag: u16) -> Result<&mut PeerChannel, MeshError> {
        match self.channels.entry(tag) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => Ok(e.insert(member.channel(tag)?)),
        }
    }
}

fn channel_error(e: &ChannelError) -> String {
    match e {
        ChannelError::PeerFailed(r) => format!("peer-failed {}", r.0),
        ChannelError::Timeout(r) => format!("timeout {}", r.0),
        other => other.to_string(),
    }
}

/// Meshes owned by members of this process, by name.
static CHILDREN: Mutex<Vec<(String, ActorMesh<Child>)>> = Mutex::new(Vec::new());
/// What owning members decided about, in order: (owner rank, failure).
static OWNER_SAW: Mutex<Vec<(u32, MeshFailure)>> = Mutex::new(Vec::new());

/// A key-value-less store: answers with `base + rank`.
struct Store {
    base: u64,
    rank: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum StoreOp {
    Get,
    Fail,
}

impl MeshActor for Store {
    const NAME: &'static str = "test/members/store";
    type Args = u64;
    type Msg = StoreOp;
    type Reply = u64;

    async fn new(member: &Member, base: u64) -> Result<Self, ActorError> {
        Ok(Self {
            base,
            rank: member.rank().0,
        })
    }

    async fn handle(&mut self, _: &Member, op: StoreOp) -> Result<u64, ActorError> {
        match op {
            StoreOp::Get => Ok(self.base + u64::from(self.rank)),
            StoreOp::Fail => Err("store told to fail".into()),
        }
    }
}

/// A mesh owned by a member.
struct Child {
    generation: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum ChildOp {
    Generation,
    Fail,
}

impl MeshActor for Child {
    const NAME: &'static str = "test/members/child";
    type Args = ();
    type Msg = ChildOp;
    type Reply = u64;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            generation: member.generation().0,
        })
    }

    async fn handle(&mut self, _: &Member, op: ChildOp) -> Result<u64, ActorError> {
        match op {
            ChildOp::Generation => Ok(self.generation),
            ChildOp::Fail => Err("child told to fail".into()),
        }
    }
}

/// Starts that block their thread for this long (ms) in `new`, for meshes
/// named `slow`.
static SLOW_START_MS: AtomicU32 = AtomicU32::new(0);

/// A member whose `new` blocks its thread (when its mesh is named `slow`).
struct Sluggish;

impl MeshActor for Sluggish {
    const NAME: &'static str = "test/members/sluggish";
    type Args = ();
    type Msg = ();
    type Reply = u32;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        if member.mesh() == "slow" {
            let ms = SLOW_START_MS.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(u64::from(ms)));
        }
        Ok(Self)
    }

    async fn handle(&mut self, member: &Member, (): ()) -> Result<u32, ActorError> {
        Ok(member.rank().0)
    }
}

regent_mesh::register_actor!(Peer);
regent_mesh::register_actor!(Store);
regent_mesh::register_actor!(Child);
regent_mesh::register_actor!(Sluggish);

async fn procs(n: usize) -> (Runtime, ProcMesh) {
    let config = RuntimeConfig::default().call_timeout(DEADLINE);
    let rt = Runtime::start(config).await.unwrap();
    let pm = rt
        .spawn_procs(
            Arc::new(InProcAllocator::default()),
            Shape::new([("procs", n)]).unwrap(),
        )
        .await
        .unwrap();
    (rt, pm)
}

async fn peers(
    n: usize,
    per_proc: u32,
    options: SpawnOptions,
) -> (Runtime, ProcMesh, ActorMesh<Peer>) {
    let (rt, pm) = procs(n).await;
    let mesh = pm
        .spawn_with::<Peer>("peers", per_proc, &PeerArgs::default(), options)
        .await
        .unwrap();
    (rt, pm, mesh)
}

async fn whoami(mesh: &ActorMesh<Peer>) -> Vec<(u32, StartSeen, u64, Vec<RestartSeen>)> {
    mesh.call(&Selection::All, &Op::Whoami)
        .await
        .unwrap()
        .into_result()
        .unwrap()
        .into_iter()
        .map(|(r, reply)| match reply {
            Reply::Me {
                rank,
                start,
                generation_now,
                restarts,
            } => {
                assert_eq!(rank, r.0, "each member answers for its own rank");
                (rank, start, generation_now, restarts)
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

async fn running_at(mesh: &ActorMesh<Peer>, generation: u64) {
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 >= generation
    })
    .await
    .unwrap();
}

async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !check().await {
        assert!(
            t.elapsed() < DEADLINE,
            "{what} did not happen in {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_call_and_cast_to_peers_without_the_controller() {
    let (rt, _pm, mesh) = peers(3, 2, SpawnOptions::new()).await;
    // A baseline: the controller's frames for one call to one member.
    let before = rt.frames_sent();
    let _ = mesh.call_one(Rank(0), &Op::Rank).await.unwrap();
    let one_call = rt.frames_sent() - before;
    // A call that runs through five members, each calling the next over
    // its own mesh reference.
    let before = rt.frames_sent();
    let path = mesh
        .call_one(Rank(0), &Op::Chain(vec![3, 5, 1, 4, 2]))
        .await
        .unwrap();
    assert_eq!(path, Reply::Path(vec![0, 3, 5, 1, 4, 2]));
    assert_eq!(
        rt.frames_sent() - before,
        one_call,
        "the controller sent only its own call: members called each other directly"
    );
    // A token passed round the ring ten times with fire-and-forget casts.
    let before = rt.frames_sent();
    mesh.call_one(Rank(0), &Op::Token { laps: 10 })
        .await
        .unwrap();
    wait_until("ten laps of the token", || async {
        mesh.call_one(Rank(0), &Op::Laps).await.unwrap() == Reply::Count(11)
    })
    .await;
    let after_laps = rt.frames_sent();
    let laps = match mesh.call_one(Rank(0), &Op::Seen).await.unwrap() {
        Reply::Values(v) => v.into_iter().map(|(_, l)| l).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        laps,
        (0..=10).rev().collect::<Vec<_>>(),
        "each lap once, in order"
    );
    assert!(
        after_laps - before < 60,
        "the ring's 60 hops did not go through the controller ({} frames)",
        after_laps - before
    );
    // A reference of the wrong actor type is refused.
    match mesh.call_one(Rank(1), &Op::WrongType).await.unwrap() {
        Reply::Error(e) => assert!(e.contains("test/members/peer"), "{e}"),
        other => panic!("a peer reference of the wrong type was given: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn casts_from_a_member_arrive_in_order() {
    let (_rt, _pm, mesh) = peers(2, 2, SpawnOptions::new()).await;
    // Ranks 0 and 1 (proc 0) each stream 300 values to rank 3 (proc 1),
    // at the same time, most of them fire-and-forget.
    let count = 300;
    let streams = [0u32, 1].map(|from| {
        let mesh = mesh.clone();
        async move {
            mesh.call_one(Rank(from), &Op::Stream { to: 3, count })
                .await
        }
    });
    for r in futures::future::join_all(streams).await {
        assert_eq!(r.unwrap(), Reply::Ok);
    }
    wait_until("every value at rank 3", || async {
        match mesh.call_one(Rank(3), &Op::Seen).await.unwrap() {
            Reply::Values(v) => v.len() as u64 == 2 * count,
            other => panic!("{other:?}"),
        }
    })
    .await;
    let Reply::Values(seen) = mesh.call_one(Rank(3), &Op::Seen).await.unwrap() else {
        panic!()
    };
    for from in [0, 1] {
        let values: Vec<u64> = seen
            .iter()
            .filter(|(f, _)| *f == from)
            .map(|(_, v)| *v)
            .collect();
        assert_eq!(
            values,
            (0..count).collect::<Vec<_>>(),
            "casts from rank {from} kept their order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_call_keeps_its_deadline_and_reports_failures_by_rank() {
    let (_rt, _pm, mesh) = peers(2, 2, SpawnOptions::new()).await;
    // A peer that answers too late: the call ends at its deadline.
    let t = Instant::now();
    let asked = mesh
        .call_one(
            Rank(0),
            &Op::Ask {
                to: 2,
                msg: Box::new(Op::Sleep(4000)),
                timeout_ms: 300,
                retry: false,
            },
        )
        .await
        .unwrap();
    let took = t.elapsed();
    assert_eq!(asked, Reply::Asked(Err(vec![(2, MemberError::Timeout)])));
    assert!(
        took < Duration::from_millis(2500),
        "the call waited {took:?}, past its 300 ms deadline"
    );
    // A peer that answers: its reply comes back.
    let asked = mesh
        .call_one(
            Rank(0),
            &Op::Ask {
                to: 3,
                msg: Box::new(Op::Rank),
                timeout_ms: 10_000,
                retry: false,
            },
        )
        .await
        .unwrap();
    assert_eq!(asked, Reply::Asked(Ok(Box::new(Reply::Count(3)))));
    // A peer whose handler fails: the caller sees it by rank.
    let asked = mesh
        .call_one(
            Rank(1),
            &Op::Ask {
                to: 2,
                msg: Box::new(Op::Fail),
                timeout_ms: 10_000,
                retry: false,
            },
        )
        .await
        .unwrap();
    match asked {
        Reply::Asked(Err(failed)) => {
            assert_eq!(failed.len(), 1);
            assert_eq!(failed[0].0, 2);
            assert!(
                matches!(&failed[0].1, MemberError::Failed(m) if m.contains("told to fail")),
                "{failed:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_message_meshes_they_were_handed() {
    let (_rt, pm) = procs(2).await;
    let store = pm.spawn::<Store>("store", 2, &100).await.unwrap();
    let args = PeerArgs {
        store: Some(store.reference()),
    };
    let mesh = pm.spawn::<Peer>("peers", 1, &args).await.unwrap();
    // Through the reference in its args.
    let got = mesh
        .call(&Selection::All, &Op::AskStore(StoreOp::Get))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert!(got.iter().all(|(_, r)| *r == Reply::Store(100)), "{got:?}");
    // Through a reference in a message, calling every store member.
    let other = pm.spawn::<Store>("store2", 2, &1000).await.unwrap();
    let got = mesh
        .call_one(Rank(1), &Op::AskStoreAt(other.reference(), StoreOp::Get))
        .await
        .unwrap();
    assert_eq!(got, Reply::Store(1000 + 1001 + 1002 + 1003));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_channels_carry_bytes_and_fail_fast_when_the_peer_fails() {
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    for tag in [7, 8] {
        mesh.call(&Selection::All, &Op::ChannelOpen(tag))
            .await
            .unwrap()
            .into_result()
            .unwrap();
    }
    let recv_op = Op::ChannelRecv {
        tag: 7,
        from: 0,
        timeout_ms: 15_000,
    };
    let send_op = Op::ChannelSend {
        tag: 7,
        to: 1,
        data: b"gradients".to_vec(),
    };
    let (got, sent) = futures::join!(
        mesh.call_one(Rank(1), &recv_op),
        mesh.call_one(Rank(0), &send_op)
    );
    assert_eq!(sent.unwrap(), Reply::Ok);
    assert_eq!(got.unwrap(), Reply::Bytes(b"gradients".to_vec()));
    // Rank 1 waits for rank 0, which fails: the wait ends at once, long
    // before its 15 s deadline.
    let t = Instant::now();
    let recv_op = Op::ChannelRecv {
        tag: 8,
        from: 0,
        timeout_ms: 15_000,
    };
    let recv = mesh.call_one(Rank(1), &recv_op);
    let fail = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        mesh.call_one(Rank(0), &Op::Fail).await
    };
    let (got, failed) = futures::join!(recv, fail);
    assert!(failed.is_err(), "rank 0 failed its handler");
    let took = t.elapsed();
    // Told that rank 0 failed, or (if the restart was quicker) that the
    // mesh moved on: either way at once.
    match got.unwrap() {
        Reply::Error(e) => assert!(
            e == "peer-failed 0" || e.starts_with("the mesh moved to generation 1"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(took < Duration::from_secs(10), "the wait took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_channel_fails_fast_when_a_peer_of_an_older_generation_fails() {
    // The owner restarts the first failure at once and holds its decision
    // on the next: a failed peer then stays down.
    let asked = Arc::new(AtomicU32::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let options = {
        let asked = asked.clone();
        let release = release.clone();
        SpawnOptions::new().supervise(move |_failure| {
            let first = asked.fetch_add(1, Ordering::SeqCst) == 0;
            let release = release.clone();
            async move {
                if !first {
                    tokio::time::timeout(DEADLINE, release.notified())
                        .await
                        .ok();
                }
                None
            }
        })
    };
    let (_rt, _pm, mesh) = peers(2, 1, options).await;
    let _ = mesh.call_one(Rank(1), &Op::Fail).await.unwrap_err();
    running_at(&mesh, 1).await;
    mesh.call(&Selection::All, &Op::ChannelOpen(9))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    // Rank 0's life began in generation 0; the mesh is in generation 1.
    let t = Instant::now();
    let recv_op = Op::ChannelRecv {
        tag: 9,
        from: 0,
        timeout_ms: 12_000,
    };
    let fail = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        mesh.call_one(Rank(0), &Op::Fail).await
    };
    let (got, failed) = futures::join!(mesh.call_one(Rank(1), &recv_op), fail);
    assert!(failed.is_err());
    let took = t.elapsed();
    assert_eq!(got.unwrap(), Reply::Error("peer-failed 0".into()));
    assert!(took < Duration::from_secs(8), "the wait took {took:?}");
    release.notify_one();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_read_and_write_peers_buffers_one_sidedly() {
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    let len = 1 << 20;
    let Reply::Handle(handle) = mesh
        .call_one(Rank(0), &Op::Share { len, seed: 9 })
        .await
        .unwrap()
    else {
        panic!("no handle")
    };
    assert_eq!(handle.len_bytes(), len as u64);
    let want = checksum(&pattern(len, 9));
    let read = mesh
        .call_one(Rank(1), &Op::Read(handle.clone()))
        .await
        .unwrap();
    assert_eq!(read, Reply::Count(want), "rank 1 read rank 0's bytes");
    mesh.call_one(
        Rank(1),
        &Op::Write {
            to: handle,
            byte: 0xAB,
        },
    )
    .await
    .unwrap();
    let own = mesh.call_one(Rank(0), &Op::Checksum).await.unwrap();
    assert_eq!(
        own,
        Reply::Count(checksum(&vec![0xAB; len])),
        "rank 1's write landed in rank 0's memory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_member_knows_why_and_survivors_are_told() {
    let (_rt, _pm, mesh) = peers(3, 2, SpawnOptions::new()).await;
    let before = whoami(&mesh).await;
    for (rank, start, now, restarts) in &before {
        assert_eq!(start.kind, StartKind::First, "rank {rank}");
        assert_eq!((start.generation, *now), (0, 0));
        assert_eq!(start.source, None);
        assert!(restarts.is_empty());
    }
    let err = mesh.call_one(Rank(3), &Op::Fail).await.unwrap_err();
    assert!(matches!(err, MeshError::Members(_)), "{err}");
    running_at(&mesh, 1).await;
    let after = whoami(&mesh).await;
    for (rank, start, now, restarts) in &after {
        assert_eq!(*now, 1, "rank {rank} sees generation 1");
        if *rank == 3 {
            match &start.kind {
                StartKind::Restart { cause, previous } => {
                    assert_eq!(*previous, Generation(0));
                    assert!(
                        matches!(cause, FailureCause::Actor { message, panicked: false } if message.contains("told to fail")),
                        "{cause:?}"
                    );
                }
                other => panic!("rank 3 started as {other:?}"),
            }
            assert_eq!(start.generation, 1);
            assert_eq!(start.restarted, vec![3]);
            // The first live rank serves the only restarted one.
            assert_eq!(start.source, Some(0));
            assert!(restarts.is_empty());
        } else {
            assert_eq!(
                start.kind,
                StartKind::First,
                "rank {rank} was not restarted"
            );
            assert_eq!(
                restarts,
                &vec![RestartSeen {
                    generation: 1,
                    ranks: vec![3],
                    sources: vec![(3, 0)],
                    member_generation: 1,
                }],
                "rank {rank} was told, in generation 1"
            );
        }
    }
    // Every member's own view of the mesh is current (no report about the
    // replaced life leaves it restarting).
    wait_until(
        "every member sees the mesh running in generation 1",
        || async {
            let views = mesh.call(&Selection::All, &Op::View).await.unwrap();
            views.is_complete()
                && views.values().iter().all(|(_, v)| {
                    *v == Reply::View {
                        running: true,
                        generation: 1,
                    }
                })
        },
    )
    .await;
    // A gang restart: every member starts again, with no source.
    let (_rt, _pm, gang) = peers(
        2,
        2,
        SpawnOptions::new().policy(MeshPolicy::new(Decision::RestartMesh)),
    )
    .await;
    let _ = gang.call_one(Rank(1), &Op::Fail).await.unwrap_err();
    running_at(&gang, 1).await;
    for (rank, start, now, restarts) in whoami(&gang).await {
        assert!(
            matches!(start.kind, StartKind::Restart { .. }),
            "rank {rank}"
        );
        assert_eq!(start.restarted, vec![0, 1, 2, 3]);
        assert_eq!((start.generation, now, start.source), (1, 1, None));
        assert!(restarts.is_empty());
    }
}

/// A restarted member reaches its heal source from `new`: by the time the
/// restarted life starts, the source's proc is in the new generation. Rank
/// 0 restarts, again and again; its source, rank 1, is on another proc,
/// which the owner tells after rank 0's proc (in proc order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_member_reaches_its_source_from_new() {
    let (_rt, pm) = procs(3).await;
    let policy = MeshPolicy::default().intensity(30, Duration::from_secs(60));
    let mesh = pm
        .spawn_with::<Peer>(
            "healing",
            1,
            &PeerArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .unwrap();
    for round in 1..=20u64 {
        let _ = mesh.call_one(Rank(0), &Op::Fail).await.unwrap_err();
        running_at(&mesh, round).await;
        let healed = mesh.call_one(Rank(0), &Op::Healed).await.unwrap();
        assert_eq!(
            healed,
            Reply::Healed(Some(Ok(1))),
            "round {round}: rank 0 healing from rank 1"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_casts_retry_in_the_next_generation() {
    let (_rt, _pm, mesh) = peers(2, 2, SpawnOptions::new()).await;
    // Without a retry, a call that loses a member says so.
    let vm = mesh
        .call(&Selection::All, &Op::FailInFirstGeneration(2))
        .await
        .unwrap();
    assert_eq!(
        vm.failed().iter().map(|(r, _)| r.0).collect::<Vec<_>>(),
        vec![2],
        "only rank 2 fails: {:?}",
        vm.failed()
    );
    // With one, the call is sent again once the mesh runs in generation 1,
    // and completes.
    let (_rt, _pm, mesh) = peers(2, 2, SpawnOptions::new()).await;
    let retrying = mesh.with_retry(Retry::new(3, DEADLINE));
    let vm = retrying
        .call(&Selection::All, &Op::FailInFirstGeneration(2))
        .await
        .unwrap();
    let values = vm.into_result().expect("the retry completed the call");
    assert_eq!(
        values,
        (0..4)
            .map(|r| (Rank(r), Reply::Count(1)))
            .collect::<Vec<_>>(),
        "every reply came from generation 1"
    );
    // A cast retries the same way.
    let (_rt, _pm, mesh) = peers(2, 2, SpawnOptions::new()).await;
    let mut failures = mesh.failures();
    let _ = mesh.call_one(Rank(1), &Op::Fail).await.unwrap_err();
    tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    let d = mesh
        .with_retry(Retry::new(3, DEADLINE))
        .cast(&Selection::All, &Op::Rank)
        .await
        .unwrap();
    assert!(d.is_complete(), "{d:?}");
    assert_eq!(d.delivered(), 4);
    assert_eq!(mesh.generation(), Generation(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_bounded_by_its_count_and_its_deadline() {
    // A message that always fails: three tries (two retries), each in a
    // newer generation, then the failure.
    let policy = MeshPolicy::default().intensity(10, Duration::from_secs(60));
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new().policy(policy)).await;
    let one = mesh.at("procs", 1).unwrap();
    let vm = one
        .with_retry(Retry::new(2, DEADLINE))
        .call(&Selection::All, &Op::Fail)
        .await
        .unwrap();
    assert!(!vm.is_complete());
    running_at(&mesh, 3).await;
    assert_eq!(
        mesh.generation(),
        Generation(3),
        "three tries, three restarts, no more"
    );
    // A mesh that does not run again within the deadline (its owner holds
    // the decision): the retry ends at the deadline with the failure.
    let release = Arc::new(tokio::sync::Notify::new());
    let (_rt, _pm, mesh) = peers(2, 1, holding(&release)).await;
    let t = Instant::now();
    let vm = mesh
        .with_retry(Retry::new(5, Duration::from_secs(2)))
        .call(&Selection::All, &Op::FailInFirstGeneration(0))
        .await
        .unwrap();
    let took = t.elapsed();
    assert_eq!(vm.failed().len(), 1);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(10),
        "the retry gave up after {took:?}"
    );
    release.notify_one();
    // A mesh that stops: the retry ends at once.
    let (_rt, _pm, mesh) = peers(
        2,
        1,
        SpawnOptions::new().policy(MeshPolicy::new(Decision::Stop)),
    )
    .await;
    let t = Instant::now();
    let vm = mesh
        .with_retry(Retry::new(5, DEADLINE))
        .call(&Selection::All, &Op::FailInFirstGeneration(0))
        .await
        .unwrap();
    // Rank 0 failed (rank 1 may have been stopped before it answered).
    assert_eq!(vm.failed()[0].0, Rank(0), "{vm:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let status = mesh.status();
    assert!(status.is_done(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_in_next_generation_redoes_a_step() {
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    let tries = AtomicU32::new(0);
    let values = mesh
        .retry_in_next_generation(Retry::new(2, DEADLINE), || {
            tries.fetch_add(1, Ordering::SeqCst);
            let mesh = mesh.clone();
            async move {
                let vm = mesh
                    .call(&Selection::All, &Op::FailInFirstGeneration(1))
                    .await?;
                Ok(vm.into_result()?)
            }
        })
        .await
        .unwrap();
    assert_eq!(
        tries.load(Ordering::SeqCst),
        2,
        "one failed step, one retry"
    );
    assert_eq!(
        values,
        vec![(Rank(0), Reply::Count(1)), (Rank(1), Reply::Count(1))]
    );
    // An error that is not a lost member is not retried.
    let tries = AtomicU32::new(0);
    let r: Result<(), MeshError> = mesh
        .retry_in_next_generation(Retry::new(2, DEADLINE), || {
            tries.fetch_add(1, Ordering::SeqCst);
            async { Err(MeshError::Unavailable("not a member failure".into())) }
        })
        .await;
    assert!(matches!(r, Err(MeshError::Unavailable(_))));
    assert_eq!(tries.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_retries_a_call_to_its_peers_in_the_next_generation() {
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    // Rank 0 asks rank 1, which fails in generation 0. Without a retry the
    // failure shows; with one (on the member's own mesh reference), the
    // answer comes from generation 1.
    let ask = |retry| Op::Ask {
        to: 1,
        msg: Box::new(Op::FailInFirstGeneration(1)),
        timeout_ms: 10_000,
        retry,
    };
    let asked = mesh.call_one(Rank(0), &ask(false)).await.unwrap();
    assert!(matches!(asked, Reply::Asked(Err(_))), "{asked:?}");
    let (_rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    let asked = mesh.call_one(Rank(0), &ask(true)).await.unwrap();
    assert_eq!(asked, Reply::Asked(Ok(Box::new(Reply::Count(1)))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_report_partial_failure_the_same_way() {
    // The owner holds its decision until told: meanwhile rank 2 is down.
    let release = Arc::new(tokio::sync::Notify::new());
    let (_rt, _pm, mesh) = peers(2, 2, holding(&release)).await;
    let mut failures = mesh.failures();
    let _ = mesh.call_one(Rank(2), &Op::Fail).await.unwrap_err();
    // The owner has the failure (and holds its decision).
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(failure.ranks, vec![Rank(2)]);
    // A cast: three delivered, rank 2 not running.
    let d = mesh.cast(&Selection::All, &Op::Rank).await.unwrap();
    assert_eq!(d.delivered(), 3);
    assert!(!d.is_complete());
    assert_eq!(
        d.failed().iter().map(|(r, _)| r.0).collect::<Vec<_>>(),
        vec![2]
    );
    assert!(matches!(d.failed()[0].1, MemberError::NotRunning(_)));
    let err = d.into_result().unwrap_err();
    assert_eq!(err.failed.len(), 1);
    // A call: three replies by rank, rank 2 failed.
    let vm = mesh.call(&Selection::All, &Op::Rank).await.unwrap();
    assert_eq!(vm.len(), 3, "{vm:?}");
    assert!(!vm.is_complete());
    assert_eq!(vm.get(Rank(3)), Some(&Reply::Count(3)));
    assert_eq!(vm.get(Rank(2)), None);
    assert_eq!(
        vm.failed().iter().map(|(r, _)| r.0).collect::<Vec<_>>(),
        vec![2]
    );
    assert_eq!(vm.into_result().unwrap_err().failed[0].0, Rank(2));
    // Fire and forget: returns without waiting for anyone.
    mesh.cast_nowait(&Selection::All, &Op::Rank).await.unwrap();
    // A cast with its own deadline to a sleeping member still delivers
    // (a cast waits for the mailbox, not the handler).
    let d = mesh
        .cast_within(
            &"procs=0".parse().unwrap(),
            &Op::Sleep(50),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(d.into_result().unwrap(), 2);
    release.notify_one();
    running_at(&mesh, 1).await;
    let d = mesh.cast(&Selection::All, &Op::Rank).await.unwrap();
    assert!(d.is_complete());
}

/// An owner that holds every decision until `release` is notified (or
/// `DEADLINE` passes): meanwhile the failed members stay down.
fn holding(release: &Arc<tokio::sync::Notify>) -> SpawnOptions {
    let hold = release.clone();
    SpawnOptions::new().supervise(move |_failure| {
        let hold = hold.clone();
        async move {
            tokio::time::timeout(DEADLINE, hold.notified()).await.ok();
            None
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reductions_report_partial_failure_the_same_way() {
    let release = Arc::new(tokio::sync::Notify::new());
    let (_rt, pm) = procs(2).await;
    let store = pm
        .spawn_with::<Store>("store", 2, &10, holding(&release))
        .await
        .unwrap();
    let full = store
        .reduce::<Sum<u64>>(&Selection::All, &StoreOp::Get)
        .await
        .unwrap();
    assert!(full.is_complete());
    assert_eq!(full.contributors, 4);
    assert_eq!(full.into_result().unwrap(), Some(10 + 11 + 12 + 13));
    let mut failures = store.failures();
    let _ = store.call_one(Rank(3), &StoreOp::Fail).await.unwrap_err();
    let failure = tokio::time::timeout(DEADLINE, failures.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(failure.ranks, vec![Rank(3)]);
    let part = store
        .reduce::<Max<u64>>(&Selection::All, &StoreOp::Get)
        .await
        .unwrap();
    assert!(!part.is_complete());
    assert_eq!(part.value, Some(12), "the max of the three that answered");
    assert_eq!(part.contributors, 3);
    assert_eq!(
        part.failed().iter().map(|(r, _)| r.0).collect::<Vec<_>>(),
        vec![3]
    );
    assert_eq!(part.into_result().unwrap_err().failed[0].0, Rank(3));
    release.notify_one();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_start_does_not_stall_its_proc() {
    let (_rt, pm) = procs(2).await;
    let pm = Arc::new(pm);
    let fast = pm.spawn::<Sluggish>("fast", 1, &()).await.unwrap();
    SLOW_START_MS.store(4000, Ordering::SeqCst);
    let spawning = {
        let pm = pm.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let r = pm.spawn::<Sluggish>("slow", 2, &()).await;
            (t.elapsed(), r)
        })
    };
    // While four `new`s block their threads on the same procs, the fast
    // mesh answers at once, again and again.
    let t = Instant::now();
    let mut calls = 0;
    while t.elapsed() < Duration::from_secs(3) {
        let c = Instant::now();
        let vm = fast.call(&Selection::All, &()).await.unwrap();
        assert_eq!(vm.into_result().unwrap().len(), 2);
        assert!(
            c.elapsed() < Duration::from_secs(1),
            "a call took {:?} while another mesh started",
            c.elapsed()
        );
        calls += 1;
    }
    assert!(calls >= 3, "{calls} calls");
    let (took, slow) = spawning.await.unwrap();
    let slow = slow.unwrap();
    assert!(
        took >= Duration::from_secs(4),
        "the spawn waited for every new ({took:?})"
    );
    assert_eq!(
        slow.call(&Selection::All, &())
            .await
            .unwrap()
            .into_result()
            .unwrap()
            .len(),
        4
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stopping_hook_runs_when_a_mesh_is_stopped_not_when_a_member_fails() {
    let (_rt, pm) = procs(2).await;
    let mesh = pm
        .spawn::<Peer>("hooked", 2, &PeerArgs::default())
        .await
        .unwrap();
    let _ = mesh.call_one(Rank(1), &Op::Fail).await.unwrap_err();
    running_at(&mesh, 1).await;
    let hooked = |name: &str| -> BTreeSet<u32> {
        STOPPED
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, _)| m == name)
            .map(|(_, r)| *r)
            .collect()
    };
    assert!(
        hooked("hooked").is_empty(),
        "a failed member's hook did not run"
    );
    mesh.stop().await.unwrap();
    assert_eq!(hooked("hooked"), BTreeSet::from([0, 1, 2, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_owner_decides_each_failure() {
    let seen = Arc::new(Mutex::new(Vec::<MeshFailure>::new()));
    let log = seen.clone();
    let options = SpawnOptions::new().supervise(move |failure| {
        let log = log.clone();
        async move {
            // Takes its time: the supervisor awaits it.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut log = log.lock().unwrap();
            log.push(failure);
            Some(if log.len() == 1 {
                Decision::RestartMember
            } else {
                Decision::Stop
            })
        }
    });
    let (_rt, _pm, mesh) = peers(2, 1, options).await;
    let _ = mesh.call_one(Rank(1), &Op::Fail).await.unwrap_err();
    running_at(&mesh, 1).await;
    let _ = mesh.call_one(Rank(0), &Op::Fail).await.unwrap_err();
    let status = mesh
        .wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
    assert!(matches!(status, MeshStatus::Stopped(Some(_))), "{status:?}");
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.iter()
            .map(|f| (f.ranks.clone(), f.generation.0))
            .collect::<Vec<_>>(),
        vec![(vec![Rank(1)], 0), (vec![Rank(0)], 0)],
        "the owner was asked once per failure, in order (rank 0's life is of generation 0)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_decides_the_failures_of_a_mesh_it_owns() {
    let (rt, _pm, mesh) = peers(2, 1, SpawnOptions::new()).await;
    assert_eq!(
        mesh.call_one(
            Rank(1),
            &Op::Own {
                name: "kids".into()
            }
        )
        .await
        .unwrap(),
        Reply::Ok
    );
    let kids = CHILDREN
        .lock()
        .unwrap()
        .iter()
        .find(|(n, _)| n == "kids")
        .map(|(_, c)| c.clone())
        .unwrap();
    // The first failure: the owner restarts the member.
    let r = mesh
        .call_one(
            Rank(1),
            &Op::FailChild {
                name: "kids".into(),
                rank: 0,
            },
        )
        .await
        .unwrap();
    assert!(matches!(r, Reply::Asked(Err(_))), "{r:?}");
    kids.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && kids.generation().0 >= 1
    })
    .await
    .unwrap();
    // The second: the owner stops the mesh.
    let _ = mesh
        .call_one(
            Rank(1),
            &Op::FailChild {
                name: "kids".into(),
                rank: 1,
            },
        )
        .await
        .unwrap();
    kids.wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
    wait_until("the owned mesh is gone from the controller", || async {
        !rt.live_meshes().contains(&"kids".to_owned())
    })
    .await;
    let saw = OWNER_SAW.lock().unwrap();
    assert_eq!(
        saw.iter()
            .map(|(o, f)| (*o, f.mesh.clone(), f.ranks.clone()))
            .collect::<Vec<_>>(),
        vec![
            (1, "kids".to_owned(), vec![Rank(0)]),
            (1, "kids".to_owned(), vec![Rank(1)])
        ]
    );
    // The owner itself is untouched.
    assert_eq!(mesh.generation(), Generation(0));
    assert_eq!(mesh.status(), MeshStatus::Running);
}

/// A call that races its mesh's stop (the policy stops the mesh at the
/// first failure, while the call is still queued for the other members)
/// ends at once, not at its deadline. A race: it is tried many times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_racing_its_meshs_stop_ends_at_once() {
    for _ in 0..30 {
        let (_rt, _pm, mesh) = peers(
            2,
            1,
            SpawnOptions::new().policy(MeshPolicy::new(Decision::Stop)),
        )
        .await;
        let t = Instant::now();
        let vm = mesh
            .call_within(
                &Selection::All,
                &Op::FailInFirstGeneration(0),
                Duration::from_secs(8),
            )
            .await
            .unwrap();
        let took = t.elapsed();
        assert_eq!(vm.failed()[0].0, Rank(0), "{vm:?}");
        assert!(
            took < Duration::from_secs(4),
            "the call waited {took:?} for a member of a stopped mesh: {vm:?}"
        );
    }
}
