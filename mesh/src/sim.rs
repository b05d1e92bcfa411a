//! A simulation of large meshes in one process, without sockets: the real
//! proc runtime, cast-tree nodes and member actors, with commands and replies
//! carried by in-memory channels instead of QUIC. It shows what the tree does
//! at 10,000 or 100,000 members — depth, the controller's fan-out, every
//! member reached exactly once — on one machine.
//!
//! The depth is measured, not computed: every command travels with the
//! number of hops it has taken (in the simulation's channels, not in the
//! wire types), a proc's commands go one hop further than the one it is
//! handling, and the depth is the most hops a cast frame took. A proc
//! forwards a cast while it handles it (before taking its next command),
//! so what it sends belongs to the frame it handles.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use regent_net::{Generation, PortId, ProcAddr, ProcId};
use tokio::sync::mpsc;

use crate::actor::{ActorError, MeshActor};
use crate::cast::node;
use crate::fabric::{Fabric, LostProcs, Pending, SendProblem, proc_port};
use crate::member::Member;
use crate::proc::ProcRuntime;
use crate::protocol::{
    CastFrame, CastToken, Collect, Contribution, MeshId, MeshInfo, ProcCommand, ProcReply,
    ReplyBody, encode, names,
};
use crate::relay::{self, Hop, RelayBody, RelaySigner};
use crate::selection::Selection;
use crate::shape::Shape;
use crate::tree;

/// The member of simulated meshes: answers with its rank.
struct SimMember {
    rank: u32,
}

impl MeshActor for SimMember {
    const NAME: &'static str = "regent/sim-member";
    type Args = ();
    type Msg = u64;
    type Reply = u32;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            rank: member.rank().0,
        })
    }

    async fn handle(&mut self, _: &Member, _: u64) -> Result<u32, ActorError> {
        Ok(self.rank)
    }
}

/// Known to the simulated procs through their fabric, not the registry: a
/// user's binary registers no actor of the simulation.
static SIM_MEMBER: crate::registry::ActorType = crate::registry::ActorType::of::<SimMember>();

fn sim_types(name: &str) -> Option<&'static crate::registry::ActorType> {
    (name == SimMember::NAME).then_some(&SIM_MEMBER)
}

/// A command, the hops it has taken (1: sent by the controller) and its
/// sender.
type Hopped = (u32, ProcId, ProcCommand);

struct World {
    inboxes: Vec<mpsc::UnboundedSender<Hopped>>,
    pending: HashMap<ProcId, Arc<Pending>>,
    /// Each proc's rank (its inbox).
    index: HashMap<ProcId, u32>,
    frames: AtomicU64,
    /// The most hops a cast frame has taken since it was last reset.
    cast_hops: AtomicU32,
}

struct SimFabric {
    world: Arc<World>,
    me: ProcId,
    sent: AtomicU64,
    /// Bytes of the commands other than casts sent (their encoded
    /// payload).
    sent_bytes: AtomicU64,
    lost: LostProcs,
    /// Hops the command this node is handling took (0 at the controller).
    hops: AtomicU32,
}

impl Fabric for SimFabric {
    fn command(
        &self,
        _: &MeshInfo,
        proc: u32,
        cmd: ProcCommand,
        _: tokio::time::Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        self.send(proc, cmd)
    }

    fn send_to(
        &self,
        addr: &ProcAddr,
        cmd: ProcCommand,
        _: tokio::time::Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        match self.world.index.get(&addr.proc) {
            Some(&proc) => self.send(proc, cmd),
            None => {
                let e = SendProblem::Other(format!("no proc {}", addr.proc));
                async move { Err(e) }.boxed()
            }
        }
    }

    fn reply(&self, port: PortId, reply: ProcReply) -> BoxFuture<'_, ()> {
        if let Some(p) = self.world.pending.get(port.proc()) {
            p.resolve(reply.call, reply.body, &self.me);
        }
        async {}.boxed()
    }

    fn reply_port(&self) -> PortId {
        proc_port(&self.me, names::REPLY_PORT)
    }

    fn proc(&self) -> &ProcId {
        &self.me
    }

    fn lost(&self) -> &LostProcs {
        &self.lost
    }

    fn own_threads(&self) -> bool {
        false
    }
}

impl SimFabric {
    /// Sends `cmd` to proc `proc`, counting it.
    fn send(&self, proc: u32, cmd: ProcCommand) -> BoxFuture<'_, Result<(), SendProblem>> {
        self.world.frames.fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(1, Ordering::Relaxed);
        let hops = self.hops.load(Ordering::Relaxed).saturating_add(1);
        if matches!(cmd, ProcCommand::Cast(_)) {
            self.world.cast_hops.fetch_max(hops, Ordering::Relaxed);
        } else {
            // Encoded only to be counted (the channels carry the command):
            // not the casts, whose bytes no figure reports.
            let bytes = encode(&cmd).map_or(0, |b| b.len() as u64);
            self.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        let r = self
            .world
            .inboxes
            .get(proc as usize)
            .ok_or_else(|| SendProblem::Other(format!("no proc {proc}")))
            .and_then(|tx| {
                tx.send((hops, self.me.clone(), cmd))
                    .map_err(|_| SendProblem::Other(format!("proc {proc} is gone")))
            });
        async move { r }.boxed()
    }
}

/// What a simulation measured.
#[derive(Debug, Clone)]
pub struct SimReport {
    /// Members in the mesh.
    pub members: u32,
    /// Procs hosting them.
    pub procs: u32,
    /// The tree's fan-out.
    pub fanout: u32,
    /// Hops from the controller to the farthest proc, measured: the most
    /// hops a frame of the cast took.
    pub depth: u32,
    /// The depth the tree's formula gives (`tree::depth`), which the
    /// measured one checks.
    pub depth_formula: u32,
    /// Frames the controller sent for one cast.
    pub controller_frames: u64,
    /// Frames all nodes sent for one cast.
    pub frames: u64,
    /// Members that answered the gathering call (each exactly once).
    pub answered: u32,
    /// The controller's frames and bytes (encoded commands) for the spawn,
    /// relayed down the tree.
    pub spawn_sent: (u64, u64),
    /// The same for a spawn sent to each proc: the baseline.
    pub spawn_each: (u64, u64),
    /// The controller's frames and bytes for a restart of proc 0's members
    /// in their proc ([`ProcCommand::Respawn`] there, an `Update` with a
    /// [`MeshChange`](crate::protocol::MeshChange) relayed to every other
    /// proc).
    pub restart_sent: (u64, u64),
    /// The same with the update sent to each proc: the baseline.
    pub restart_each: (u64, u64),
    /// The controller's frames and bytes for one lease renewal of every
    /// proc, relayed.
    pub renew_sent: (u64, u64),
    /// The same sent to each proc: the baseline.
    pub renew_each: (u64, u64),
    /// Time to spawn every member.
    pub spawn: Duration,
    /// Time for one cast to reach every member's mailbox (acknowledged).
    pub cast: Duration,
    /// Time for one call to gather every member's reply.
    pub gather: Duration,
}

/// Why a simulation failed.
#[derive(Debug, thiserror::Error)]
#[error("simulation: {0}")]
pub struct SimError(String);

fn err(e: impl std::fmt::Display) -> SimError {
    SimError(e.to_string())
}

/// Procs of the simulation, each a real proc runtime fed by an in-memory
/// channel, and the root (the controller's side) that commands them.
struct SimWorld {
    world: Arc<World>,
    root: ProcId,
    ids: Vec<ProcId>,
    fabric: SimFabric,
    root_pending: Arc<Pending>,
    /// The controller's signing key for relayed commands.
    signer: RelaySigner,
    tasks: Vec<tokio::task::JoinHandle<Result<(), SimError>>>,
}

impl SimWorld {
    /// Starts `procs` proc runtimes.
    fn start(procs: u32) -> Result<Self, SimError> {
        let root = ProcId::new("sim-root").map_err(err)?;
        let ids: Vec<ProcId> = (0..procs)
            .map(|i| ProcId::new(&format!("sim-{i}")))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        let mut pending: HashMap<ProcId, Arc<Pending>> = ids
            .iter()
            .map(|p| (p.clone(), Arc::new(Pending::default())))
            .collect();
        pending.insert(root.clone(), Arc::new(Pending::default()));
        let mut inboxes = Vec::with_capacity(procs as usize);
        let mut receivers = Vec::with_capacity(procs as usize);
        for _ in 0..procs {
            let (tx, rx) = mpsc::unbounded_channel();
            inboxes.push(tx);
            receivers.push(rx);
        }
        let index = ids.iter().cloned().zip(0..).collect();
        let world = Arc::new(World {
            inboxes,
            pending,
            index,
            frames: AtomicU64::new(0),
            cast_hops: AtomicU32::new(0),
        });
        let signer = RelaySigner::new(&crate::entropy::Entropy::os());
        let key = signer.public();
        let mut tasks = Vec::with_capacity(procs as usize);
        for (id, mut rx) in ids.iter().cloned().zip(receivers) {
            let fabric = Arc::new(SimFabric::new(&world, id.clone()));
            let p = world.pending[&id].clone();
            let owner = root.clone();
            tasks.push(tokio::spawn(async move {
                let mut rt = ProcRuntime::start(
                    fabric.clone(),
                    p,
                    None,
                    None,
                    sim_types,
                    crate::entropy::Entropy::os(),
                );
                rt.trust(Some(key));
                while let Some((hops, sender, cmd)) = rx.recv().await {
                    fabric.hops.store(hops, Ordering::Relaxed);
                    // The root is the owner; procs only forward casts.
                    let from_owner = sender == owner;
                    if rt.handle(cmd, from_owner, &sender).is_some() {
                        break;
                    }
                }
                rt.shutdown().await;
                Ok::<(), SimError>(())
            }));
        }
        let fabric = SimFabric::new(&world, root.clone());
        let root_pending = world.pending[&root].clone();
        Ok(Self {
            world,
            root,
            ids,
            fabric,
            root_pending,
            signer,
            tasks,
        })
    }

    /// A mesh of `per_proc` members on every proc, in generation 0.
    fn mesh(&self, per_proc: u32, fanout: NonZeroU32) -> Result<MeshInfo, SimError> {
        let procs = self.ids.len();
        let info = MeshInfo {
            id: MeshId(0),
            name: "sim".into(),
            actor_type: SimMember::NAME.into(),
            shape: Shape::new([("procs", procs), ("actors", per_proc as usize)]).map_err(err)?,
            per_proc,
            procs: self
                .ids
                .iter()
                .map(|p| ProcAddr {
                    socket: SocketAddr::from(([127, 0, 0, 1], 0)),
                    proc: p.clone(),
                })
                .collect(),
            fanout,
            owner: self.fabric.reply_port(),
            generation: Generation(0),
            token: CastToken::random(),
        };
        info.validate().map_err(err)?;
        Ok(info)
    }

    /// Sends a command to proc `rank` that expects a reply; returns it.
    async fn request(
        &self,
        info: &MeshInfo,
        rank: u32,
        command: impl FnOnce(u64, PortId) -> ProcCommand,
    ) -> Result<tokio::sync::oneshot::Receiver<ReplyBody>, SimError> {
        let (call, answer) = self.root_pending.request(&self.ids[rank as usize]);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        self.fabric
            .command(
                info,
                rank,
                command(call, self.fabric.reply_port()),
                deadline,
            )
            .await
            .map_err(err)?;
        Ok(answer)
    }

    /// Relays `body`, signed, to the procs `ranks` of `info` as the
    /// controller does; checks that every one carried it out.
    async fn relay(&self, info: &MeshInfo, ranks: &[u32], body: RelayBody) -> Result<(), SimError> {
        let route = ranks
            .iter()
            .map(|&rank| Hop {
                rank,
                addr: info.procs[rank as usize].clone(),
            })
            .collect();
        let frame = self
            .signer
            .frame(body, route, info.fanout, Duration::from_secs(120))
            .map_err(err)?;
        let o = relay::spread(&self.fabric, &self.root_pending, &frame, true, None).await;
        if !o.all_done() || o.done as usize != ranks.len() {
            return Err(SimError(format!(
                "relayed to {} of {} procs; failed: {:?}",
                o.done,
                ranks.len(),
                o.failed.first()
            )));
        }
        Ok(())
    }

    /// Spawns the mesh's members on every proc, down the tree. The
    /// controller's frames and bytes for the same spawn sent to each proc
    /// (the baseline).
    async fn spawn(&self, info: &MeshInfo) -> Result<(u64, u64), SimError> {
        let args = encode(&()).map_err(err)?;
        let every: Vec<u32> = (0..info.proc_count()).collect();
        let body = RelayBody::Spawn {
            info: Box::new(info.clone()),
            args: args.clone(),
            start: None,
        };
        self.relay(info, &every, body).await?;
        let mut each = 0;
        for proc_rank in every {
            let cmd = ProcCommand::Spawn {
                call: u64::from(proc_rank),
                reply_to: self.fabric.reply_port(),
                info: info.clone(),
                proc_rank,
                args: args.clone(),
                start: None,
            };
            each += encode(&cmd).map_err(err)?.len() as u64;
        }
        Ok((u64::from(info.proc_count()), each))
    }

    /// Restarts proc 0's members in their proc as the controller does:
    /// `Respawn` there, and an `Update` relayed down the tree of every other
    /// proc, with the change from generation `info.generation` (nothing
    /// moved); checks the answers. The mesh in its new generation, and the
    /// controller's frames and bytes for the same commands sent to each
    /// proc (the baseline).
    async fn restart_proc_0(&self, info: &MeshInfo) -> Result<(MeshInfo, (u64, u64)), SimError> {
        let mut next = info.clone();
        next.generation = Generation(info.generation.0 + 1);
        let change = crate::protocol::MeshChange {
            from: info.generation,
            generation: next.generation,
            moved: Vec::new(),
        };
        let ranks: Vec<u32> = (0..info.per_proc).collect();
        let restart = crate::protocol::Restart {
            generation: next.generation,
            ranks: ranks.clone(),
            cause: crate::policy::FailureCause::Stopped,
            sources: ranks
                .iter()
                .map(|&r| (r, info.per_proc.min(info.members() - 1)))
                .collect(),
        };
        let respawn = self
            .request(&next, 0, |call, reply_to| ProcCommand::Respawn {
                call,
                reply_to,
                mesh: next.id,
                change: change.clone(),
                ranks: ranks.clone(),
                args: encode(&()).unwrap_or_default(),
                restart: restart.clone(),
            })
            .await?;
        let others: Vec<u32> = (1..next.proc_count()).collect();
        let update = RelayBody::Update {
            mesh: next.id,
            change: change.clone(),
            restart: Some(restart.clone()),
        };
        self.relay(&next, &others, update).await?;
        match respawn.await.map_err(err)? {
            ReplyBody::Spawned(Ok(())) => {}
            other => return Err(SimError(format!("restart failed: {other:?}"))),
        }
        // The baseline: the respawn, and an update to each other proc.
        let mut each = 0;
        for rank in others {
            let cmd = ProcCommand::Update {
                call: u64::from(rank),
                reply_to: self.fabric.reply_port(),
                mesh: next.id,
                change: change.clone(),
                restart: Some(restart.clone()),
            };
            each += encode(&cmd).map_err(err)?.len() as u64;
        }
        let respawn = ProcCommand::Respawn {
            call: 0,
            reply_to: self.fabric.reply_port(),
            mesh: next.id,
            change,
            ranks,
            args: encode(&()).unwrap_or_default(),
            restart,
        };
        each += encode(&respawn).map_err(err)?.len() as u64;
        let frames = u64::from(next.proc_count());
        Ok((next, (frames, each)))
    }

    /// A cast of `7` from the root to every member of `info` (in its
    /// generation), with `budget`.
    fn frame(
        &self,
        info: &MeshInfo,
        collect: Collect,
        budget: Duration,
    ) -> Result<CastFrame, SimError> {
        Ok(CastFrame {
            mesh: info.id,
            generation: info.generation,
            token: info.token,
            origin: regent_net::ActorId {
                proc: self.root.clone(),
                name: regent_net::ActorName::new(names::CONTROLLER).map_err(err)?,
                index: 0,
            },
            order: crate::protocol::CastOrder::NONE,
            view: info.shape.clone(),
            selection: Selection::All,
            seed: 0,
            procs: (0, info.proc_count()),
            per_proc: info.per_proc,
            lost: Vec::new(),
            payload: encode(&7u64).map_err(err)?,
            more: Vec::new(),
            // At the root, `reply` says results are wanted.
            reply: Some(crate::protocol::ReplyTo {
                port: self.fabric.reply_port(),
                call: u64::MAX,
            }),
            collect,
            budget_ms: u32::try_from(budget.as_millis()).unwrap_or(u32::MAX),
        })
    }

    /// Casts through the tree from the root and collects the result.
    async fn cast(&self, info: &MeshInfo, frame: &CastFrame) -> Contribution {
        let cast = node::Bound::new(frame.clone()).expect("the simulation's selections bind");
        let mut ds = node::dispatch(&self.fabric, &self.root_pending, info, &cast, None).await;
        let d = ds.pop().expect("a single cast");
        node::collect(&self.root_pending, d).await
    }

    /// Casts through the tree as proc `rank` does for its members (the
    /// frame's root is there) and collects the result.
    #[cfg(test)]
    async fn cast_from(&self, rank: u32, info: &MeshInfo, frame: &CastFrame) -> Contribution {
        let me = self.ids[rank as usize].clone();
        let pending = self.world.pending[&me].clone();
        let mut frame = frame.clone();
        frame.origin.proc = me.clone();
        let fabric = SimFabric::new(&self.world, me);
        let cast = node::Bound::new(frame).expect("the simulation's selections bind");
        let mut ds = node::dispatch(&fabric, &pending, info, &cast, None).await;
        let d = ds.pop().expect("a single cast");
        node::collect(&pending, d).await
    }

    /// Tells every proc to exit and waits for them.
    async fn exit(self) -> Result<(), SimError> {
        for tx in &self.world.inboxes {
            let _ = tx.send((1, self.root.clone(), ProcCommand::Exit));
        }
        for t in self.tasks {
            t.await.map_err(err)??;
        }
        Ok(())
    }
}

impl SimFabric {
    fn new(world: &Arc<World>, me: ProcId) -> Self {
        Self {
            world: world.clone(),
            me,
            sent: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            lost: LostProcs::default(),
            hops: AtomicU32::new(0),
        }
    }
}

/// Simulates a mesh of `procs * per_proc` members and one cast and one call
/// to all of them.
pub async fn simulate(
    procs: u32,
    per_proc: u32,
    fanout: NonZeroU32,
) -> Result<SimReport, SimError> {
    let sim = SimWorld::start(procs)?;
    let info = sim.mesh(per_proc, fanout)?;
    let sent = |f: &SimFabric| {
        (
            f.sent.load(Ordering::Relaxed),
            f.sent_bytes.load(Ordering::Relaxed),
        )
    };
    let minus = |(a, b): (u64, u64), (c, d): (u64, u64)| (a - c, b - d);
    let t = Instant::now();
    let spawn_each = sim.spawn(&info).await?;
    let spawn = t.elapsed();
    let spawn_sent = sent(&sim.fabric);
    let before = spawn_sent;
    let (info, restart_each) = sim.restart_proc_0(&info).await?;
    let restart_sent = minus(sent(&sim.fabric), before);
    let before = sent(&sim.fabric);
    let every: Vec<u32> = (0..procs).collect();
    sim.relay(&info, &every, RelayBody::Renew).await?;
    let renew_sent = minus(sent(&sim.fabric), before);
    let renew_bytes = encode(&ProcCommand::Renew).map_err(err)?.len() as u64;
    let renew_each = (u64::from(procs), renew_bytes * u64::from(procs));
    let budget = Duration::from_secs(120);
    let world = &sim.world;
    let fabric = &sim.fabric;
    let frames_before = world.frames.load(Ordering::Relaxed);
    let sent_before = fabric.sent.load(Ordering::Relaxed);
    world.cast_hops.store(0, Ordering::Relaxed);
    let t = Instant::now();
    let d = node::dispatch(
        fabric,
        &sim.root_pending,
        &info,
        &node::Bound::new(sim.frame(&info, Collect::Ack, budget)?).map_err(err)?,
        None,
    )
    .await
    .pop()
    .expect("a single cast");
    let controller_frames = fabric.sent.load(Ordering::Relaxed) - sent_before;
    let acked = node::collect(&sim.root_pending, d).await;
    let cast = t.elapsed();
    let frames = world.frames.load(Ordering::Relaxed) - frames_before;
    let depth = world.cast_hops.load(Ordering::Relaxed);
    if !acked.failed.is_empty() || acked.ok != procs * per_proc {
        return Err(SimError(format!(
            "cast reached {} of {} members ({} failed)",
            acked.ok,
            procs * per_proc,
            acked.failed.len()
        )));
    }

    let t = Instant::now();
    let gathered = sim
        .cast(&info, &sim.frame(&info, Collect::Gather, budget)?)
        .await;
    let gather = t.elapsed();
    // Every member exactly once: ranks 0..n, in order, no gaps, no repeats.
    let exactly_once = gathered
        .values
        .iter()
        .enumerate()
        .all(|(i, (rank, _))| *rank == i as u32);
    if !exactly_once || gathered.values.len() as u32 != procs * per_proc {
        return Err(SimError(format!(
            "gather got {} replies for {} members",
            gathered.values.len(),
            procs * per_proc
        )));
    }
    sim.exit().await?;
    Ok(SimReport {
        members: procs * per_proc,
        procs,
        fanout: fanout.get(),
        depth,
        depth_formula: tree::depth(procs, fanout),
        controller_frames,
        frames,
        spawn_sent,
        spawn_each,
        restart_sent,
        restart_each,
        renew_sent,
        renew_each,
        answered: gathered.values.len() as u32,
        spawn,
        cast,
        gather,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MemberError;
    use crate::policy::FailureCause;
    use crate::protocol::Restart;

    fn generation(info: &MeshInfo, g: u64) -> MeshInfo {
        MeshInfo {
            generation: Generation(g),
            ..info.clone()
        }
    }

    async fn update(sim: &SimWorld, info: &MeshInfo, rank: u32) {
        let answer = sim
            .request(info, rank, |call, reply_to| ProcCommand::Update {
                call,
                reply_to,
                mesh: info.id,
                change: crate::protocol::MeshChange {
                    from: Generation(0),
                    generation: info.generation,
                    moved: Vec::new(),
                },
                restart: None,
            })
            .await
            .unwrap();
        assert!(matches!(answer.await.unwrap(), ReplyBody::Updated));
    }

    fn ranks(values: &[(u32, bytes::Bytes)]) -> Vec<u32> {
        values.iter().map(|(r, _)| *r).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cast_for_a_generation_a_proc_has_not_learned_waits_for_its_update() {
        // Proc 0 learns generation 1 before proc 1 (as when the owner's
        // updates cross): a cast in generation 1 reaches proc 1 first.
        let sim = SimWorld::start(2).unwrap();
        let info = sim.mesh(1, NonZeroU32::new(16).unwrap()).unwrap();
        sim.spawn(&info).await.unwrap();
        let next = generation(&info, 1);
        update(&sim, &next, 0).await;
        let frame = sim
            .frame(&next, Collect::Gather, Duration::from_secs(20))
            .unwrap();
        // From the controller, which never sends ahead of its procs, such a
        // cast is refused at once.
        let refused = sim.cast(&next, &frame).await;
        assert_eq!(refused.failed.len(), 1, "{refused:?}");
        assert_eq!(refused.failed[0].0, 1);
        let c = {
            let cast = sim.cast_from(0, &next, &frame);
            tokio::pin!(cast);
            // Held at proc 1, not refused as of another generation.
            assert!(
                tokio::time::timeout(Duration::from_millis(300), &mut cast)
                    .await
                    .is_err(),
                "the cast was answered before proc 1 learned its generation"
            );
            // Casts of other senders pass it: the controller's, still in
            // generation 0, reaches rank 1 (proc 0 has moved on).
            let old = sim
                .frame(&info, Collect::Gather, Duration::from_secs(20))
                .unwrap();
            let c = tokio::time::timeout(Duration::from_secs(10), sim.cast(&info, &old))
                .await
                .expect("a cast of another sender waited behind the held one");
            assert_eq!(ranks(&c.values), vec![1], "{c:?}");
            update(&sim, &next, 1).await;
            cast.await
        };
        assert!(c.failed.is_empty(), "{:?}", c.failed);
        assert_eq!(ranks(&c.values), vec![0, 1]);
        // A generation that never comes: the cast fails at its budget.
        let budget = Duration::from_millis(400);
        let frame = sim
            .frame(&generation(&info, 2), Collect::Gather, budget)
            .unwrap();
        let t = Instant::now();
        let c = sim.cast_from(0, &generation(&info, 2), &frame).await;
        assert!(t.elapsed() >= budget.mul_f64(0.7), "{:?}", t.elapsed());
        assert_eq!(c.failed.len(), 2, "{c:?}");
        for (_, e) in &c.failed {
            assert!(matches!(e, MemberError::NotRunning(_)), "{e:?}");
        }
        // The mesh still serves its generation afterwards.
        let frame = sim
            .frame(&next, Collect::Gather, Duration::from_secs(20))
            .unwrap();
        assert_eq!(ranks(&sim.cast(&next, &frame).await.values), vec![0, 1]);
        sim.exit().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cast_to_a_member_being_respawned_reaches_its_new_life() {
        // The cast arrives right behind the respawn: the old life is retired
        // and the new one not in its slot yet. It waits for it.
        let sim = SimWorld::start(1).unwrap();
        let info = sim.mesh(2, NonZeroU32::new(16).unwrap()).unwrap();
        sim.spawn(&info).await.unwrap();
        for round in 1..=5u64 {
            let next = generation(&info, round);
            let respawned = sim
                .request(&next, 0, |call, reply_to| ProcCommand::Respawn {
                    call,
                    reply_to,
                    mesh: next.id,
                    change: crate::protocol::MeshChange {
                        from: Generation(round - 1),
                        generation: next.generation,
                        moved: Vec::new(),
                    },
                    ranks: vec![1],
                    args: encode(&()).unwrap(),
                    restart: Restart {
                        generation: next.generation,
                        ranks: vec![1],
                        cause: FailureCause::Stopped,
                        sources: vec![(1, 0)],
                    },
                })
                .await
                .unwrap();
            let frame = sim
                .frame(&next, Collect::Gather, Duration::from_secs(20))
                .unwrap();
            let c = sim.cast(&next, &frame).await;
            assert!(c.failed.is_empty(), "round {round}: {:?}", c.failed);
            assert_eq!(ranks(&c.values), vec![0, 1]);
            assert!(matches!(
                respawned.await.unwrap(),
                ReplyBody::Spawned(Ok(()))
            ));
        }
        sim.exit().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_thousand_members_are_reached_once_through_a_shallow_tree() {
        let fanout = NonZeroU32::new(16).unwrap();
        let r = simulate(625, 16, fanout).await.unwrap();
        assert_eq!(r.members, 10_000);
        assert_eq!(r.answered, 10_000);
        // Measured from the hops the frames took, and as the formula says.
        assert_eq!(r.depth, 3, "{r:?}");
        assert_eq!(r.depth_formula, 3, "{r:?}");
        assert!(r.controller_frames <= 16, "{r:?}");
        // Each proc receives the cast once: one frame per proc.
        assert_eq!(r.frames, 625, "{r:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spawn_restart_and_renewal_cost_the_controller_a_fanout_of_frames() {
        let fanout = NonZeroU32::new(16).unwrap();
        let r = simulate(625, 16, fanout).await.unwrap();
        // Relayed down the tree: at most one frame per top-level subtree
        // (and the restart's one respawn), where each proc took one.
        assert_eq!(r.spawn_sent.0, 16, "{r:?}");
        assert_eq!(r.restart_sent.0, 1 + 16, "{r:?}");
        assert_eq!(r.renew_sent.0, 16, "{r:?}");
        assert_eq!(
            (r.spawn_each.0, r.restart_each.0, r.renew_each.0),
            (625, 625, 625)
        );
        // A spawn's frames carry the mesh (every proc) and their subtree's
        // route: the controller sends the mesh 16 times, not 625.
        assert!(r.spawn_sent.1 * 20 < r.spawn_each.1, "{r:?}");
        // A renewal is signed (64 bytes and the command) and names every
        // proc once in its routes: a few times the bytes of bare renewals,
        // in 16 frames where they took 625.
        assert!(r.renew_sent.1 < 40 * r.renew_each.1, "{r:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_measured_depth_follows_the_fanout() {
        // Fan-out 2 over 9 procs: the controller sends to the heads of
        // 0..5 and 5..9; proc 0 to those of 1..3 and 3..5; proc 1 to proc 2:
        // three hops to proc 2.
        let r = simulate(9, 1, NonZeroU32::new(2).unwrap()).await.unwrap();
        assert_eq!((r.depth, r.depth_formula), (3, 3), "{r:?}");
        assert_eq!(r.answered, 9);
        let flat = simulate(5, 2, NonZeroU32::new(16).unwrap()).await.unwrap();
        assert_eq!((flat.depth, flat.depth_formula), (1, 1), "{flat:?}");
    }
}
