//! Proc meshes: procs started together, on which actor meshes are spawned.
//!
//! A proc mesh keeps one slot per proc rank. When a proc dies, the first
//! mesh supervisor that restarts members on it asks its slot for a
//! replacement; the slot starts one fresh proc (with the rank's placement)
//! and every other mesh on that proc gets the same one — so meshes that
//! shared a proc (a trainer and its data loader) stay together.
//!
//! A proc mesh may keep warm spares ([`ProcMesh::keep_spares`]): procs
//! started ahead, leased and connected but hosting nothing. A replacement
//! then takes a spare at once instead of starting a proc (the process, its
//! boot, its certificate and handshake: most of a restart), and a new
//! spare is started in the background.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use regent_net::{ActorName, Generation, ProcAddr, ProcId};

use super::mesh::{MeshShared, SpawnOptions};
use super::supervise;
use super::{MeshError, Runtime};
use crate::actor::MeshActor;
use crate::actor_mesh::ActorMesh;
use crate::alloc::{AllocatedProc, Allocator, Placement};
use crate::protocol::{MeshInfo, ProcCommand, ReplyBody, Restart, encode};
use crate::relay::{Hop, RelayBody};
use crate::shape::Shape;

/// The name of the dimension an [`ActorMesh`] adds to its proc mesh's shape
/// for the members of each proc.
pub const MEMBER_DIM: &str = "actors";

/// The most warm spares a proc mesh keeps ([`ProcMesh::keep_spares`]):
/// each is an idle process, and a count past this would ask the allocator
/// for that many at once.
pub const MAX_SPARES: usize = 256;

/// Replaced procs a proc mesh remembers (for [`ProcMesh::all_procs`]).
const MAX_REPLACED: usize = 1024;

/// The procs of a proc mesh by rank, as they are now, and how to replace
/// one.
pub(crate) struct ProcSlots {
    rt: Runtime,
    allocator: Arc<dyn Allocator>,
    current: Mutex<Vec<AllocatedProc>>,
    placements: Vec<Placement>,
    /// Procs that were replaced, oldest first (bounded).
    replaced: Mutex<VecDeque<AllocatedProc>>,
    /// One replacement at a time.
    replacing: tokio::sync::Mutex<()>,
    /// Warm spares and how many to keep.
    spares: Mutex<Spares>,
    /// Replacements that took a spare.
    spares_taken: std::sync::atomic::AtomicU64,
}

/// A proc mesh's warm spares.
#[derive(Default)]
struct Spares {
    /// How many to keep.
    target: usize,
    /// Started and ready, oldest first.
    ready: VecDeque<AllocatedProc>,
    /// Being started.
    starting: usize,
    /// When each spare still held by the restart that took it was taken:
    /// it counts as kept until that restart ends and settles
    /// ([`ProcSlots::restart_ended`]), or for [`SPARES_WATCH`] at the most.
    held: Vec<Instant>,
    /// The proc mesh stopped: no more spares; one that comes up is
    /// stopped.
    stopped: bool,
    /// A task replaces spares that die while they wait.
    watched: bool,
}

/// How long after a restart ends the spares it took start to be replaced.
/// `regent bench recovery` (2 cores, 12 kills): with the refill started
/// when a spare is taken, or when the restart ends, the member answers
/// 5-6 ms after the failure (p50); 100 ms later, 2.9-3.2 ms.
const SPARE_REFILL_SETTLE: Duration = Duration::from_millis(100);

/// How long the spares' watcher waits for news of a lost proc before it
/// looks again whether its proc mesh is still there.
const SPARES_WATCH: Duration = Duration::from_secs(1);

impl ProcSlots {
    /// The procs now, by rank.
    pub(crate) fn current(&self) -> Vec<AllocatedProc> {
        self.current.lock().expect("proc slots lock").clone()
    }

    /// The proc of rank `rank` in place of `dead`: a fresh one (a warm
    /// spare, or started now with the rank's placement) if the slot's proc
    /// is lost, else the one already there (which replaced `dead`). A spare
    /// taken here is replaced once the restart ends
    /// ([`Self::restart_ended`]).
    pub(crate) async fn replace(
        self: &Arc<Self>,
        rank: u32,
        dead: &ProcId,
    ) -> Result<AllocatedProc, MeshError> {
        let _one = self.replacing.lock().await;
        let now = self
            .current
            .lock()
            .expect("proc slots lock")
            .get(rank as usize)
            .cloned()
            .ok_or(MeshError::NoSuchRank(crate::shape::Rank(rank)))?;
        // The slot's proc stands unless it is lost: a replacement made for
        // another mesh, or for an earlier attempt of this restart that
        // failed elsewhere, is used again (never a second one per loss).
        if !self.rt.is_lost(&now.proc) {
            return Ok(now);
        }
        let placement = self
            .placements
            .get(rank as usize)
            .cloned()
            .unwrap_or_default();
        let fresh = match self.take_spare(&placement) {
            Some(spare) => {
                self.spares_taken
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(proc_rank = rank, old = %dead, new = %spare.proc, "a warm spare replaces a lost proc");
                spare
            }
            None => {
                let mut fresh = self.rt.allocate(&self.allocator, vec![placement]).await?;
                let fresh = fresh.pop().ok_or_else(|| MeshError::Spawn {
                    mesh: String::new(),
                    proc: dead.clone(),
                    message: "the allocator started no proc".into(),
                })?;
                tracing::info!(proc_rank = rank, old = %dead, new = %fresh.proc, "fresh proc replaces a lost one");
                fresh
            }
        };
        let old = std::mem::replace(
            &mut self.current.lock().expect("proc slots lock")[rank as usize],
            fresh.clone(),
        );
        let mut replaced = self.replaced.lock().expect("replaced lock");
        replaced.push_back(old);
        if replaced.len() > MAX_REPLACED {
            replaced.pop_front();
        }
        Ok(fresh)
    }

    /// A live spare for a rank placed at `placement` (spares are started
    /// with the default placement, so only such ranks take them); dead
    /// spares met on the way are dropped.
    fn take_spare(&self, placement: &Placement) -> Option<AllocatedProc> {
        if *placement != Placement::default() {
            return None;
        }
        let mut spares = self.spares.lock().expect("spares lock");
        while let Some(spare) = spares.ready.pop_front() {
            if !self.rt.is_lost(&spare.proc) {
                spares.held.push(Instant::now());
                return Some(spare);
            }
        }
        None
    }

    /// A restart of a mesh on these procs ended: the spares restarts took
    /// are replaced [`SPARE_REFILL_SETTLE`] later (not while a restart, or
    /// the first work after it, runs: starting a process loads libtorch,
    /// CPU the recovering mesh needs more).
    pub(crate) fn restart_ended(self: &Arc<Self>) {
        if self.spares.lock().expect("spares lock").target == 0 {
            // No spares kept: none to replace (and no timer task).
            return;
        }
        let slots = self.clone();
        let ended = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(SPARE_REFILL_SETTLE).await;
            // Spares taken since are held by restarts still running.
            let mut spares = slots.spares.lock().expect("spares lock");
            spares.held.retain(|taken| *taken > ended);
            drop(spares);
            slots.refill_spares();
        });
    }

    /// Starts spares in the background until the target is ready, starting
    /// or held again (the dead ones dropped first).
    fn refill_spares(self: &Arc<Self>) {
        let missing = {
            let mut spares = self.spares.lock().expect("spares lock");
            spares.ready.retain(|p| !self.rt.is_lost(&p.proc));
            spares.held.retain(|taken| taken.elapsed() < SPARES_WATCH);
            let have = spares.ready.len() + spares.starting + spares.held.len();
            let missing = spares.target.saturating_sub(have);
            if spares.stopped || missing == 0 {
                return;
            }
            spares.starting += missing;
            missing
        };
        let slots = self.clone();
        tokio::spawn(async move {
            if let Err(e) = slots.start_spares(missing).await {
                tracing::warn!(error = %e, "starting warm spares failed");
            }
        });
    }

    /// Starts `missing` spares, already counted in `starting`, and makes
    /// them ready (leased and connected); those that come up after the proc
    /// mesh stopped are stopped too.
    async fn start_spares(&self, missing: usize) -> Result<(), MeshError> {
        let started = self
            .rt
            .allocate(&self.allocator, vec![Placement::default(); missing])
            .await;
        let late = {
            let mut spares = self.spares.lock().expect("spares lock");
            spares.starting -= missing;
            let procs = started?;
            if spares.stopped {
                procs
            } else {
                for p in &procs {
                    self.rt.warm_up(&p.proc);
                }
                spares.ready.extend(procs);
                Vec::new()
            }
        };
        for p in late {
            self.rt.release(&p.proc);
            let _ = self.allocator.stop(&p.proc, Duration::ZERO).await;
        }
        Ok(())
    }

    /// Replaces spares that die while they wait (killed, their host lost),
    /// until the proc mesh stops or is gone.
    fn watch_spares(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(slots) = weak.upgrade() else { return };
                if slots.spares.lock().expect("spares lock").stopped {
                    return;
                }
                let lost = &slots.rt.inner.fabric.lost;
                let changed = lost.changed();
                tokio::pin!(changed);
                changed.as_mut().enable();
                // Drops the dead spares, if any, and starts what is missing.
                slots.refill_spares();
                let _ = tokio::time::timeout(SPARES_WATCH, changed).await;
            }
        });
    }

    /// Ends the spares: those ready are returned (to stop), none is started
    /// again.
    fn end_spares(&self) -> Vec<AllocatedProc> {
        let mut spares = self.spares.lock().expect("spares lock");
        spares.stopped = true;
        spares.ready.drain(..).collect()
    }
}

/// Procs started by a [`Runtime`], with a shape.
pub struct ProcMesh {
    rt: Runtime,
    slots: Arc<ProcSlots>,
    shape: Shape,
}

impl fmt::Debug for ProcMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcMesh")
            .field("shape", &self.shape)
            .field("procs", &self.slots.current())
            .finish_non_exhaustive()
    }
}

impl ProcMesh {
    pub(super) fn new(
        rt: Runtime,
        allocator: Arc<dyn Allocator>,
        procs: Vec<AllocatedProc>,
        placements: Vec<Placement>,
        shape: Shape,
    ) -> Self {
        Self {
            slots: Arc::new(ProcSlots {
                rt: rt.clone(),
                allocator,
                current: Mutex::new(procs),
                placements,
                replaced: Mutex::new(VecDeque::new()),
                replacing: tokio::sync::Mutex::new(()),
                spares: Mutex::new(Spares::default()),
                spares_taken: std::sync::atomic::AtomicU64::new(0),
            }),
            rt,
            shape,
        }
    }

    /// The procs, by rank, as they are now (replacements included).
    pub fn procs(&self) -> Vec<AllocatedProc> {
        self.slots.current()
    }

    /// Every proc started for this mesh: those now, its warm spares, and
    /// the last 1024 replaced ones.
    pub fn all_procs(&self) -> Vec<AllocatedProc> {
        let mut all = self.slots.current();
        all.extend(
            self.slots
                .spares
                .lock()
                .expect("spares lock")
                .ready
                .iter()
                .cloned(),
        );
        all.extend(
            self.slots
                .replaced
                .lock()
                .expect("replaced lock")
                .iter()
                .cloned(),
        );
        all
    }

    /// Keeps `n` warm spare procs (started now, and again in the
    /// background each time one is taken): a proc of the default placement
    /// that dies is replaced by a spare at once, so its members answer
    /// again after a command round trip instead of a proc's start. Each
    /// spare costs an idle process (its memory, a QUIC connection with
    /// heartbeats, its lease renewals). Returns once the spares are up;
    /// `n` below the count kept stops none until they are taken. More than
    /// [`MAX_SPARES`] is refused, before anything starts.
    pub async fn keep_spares(&self, n: usize) -> Result<(), MeshError> {
        if n > MAX_SPARES {
            return Err(MeshError::Unavailable(format!(
                "a proc mesh keeps at most {MAX_SPARES} warm spares, not {n}"
            )));
        }
        let slots = self.slots.clone();
        self.rt
            .on_control(async move {
                let (missing, watch) = {
                    let mut spares = slots.spares.lock().expect("spares lock");
                    spares.target = n;
                    let watch = n > 0 && !spares.watched;
                    spares.watched |= watch;
                    let missing = n.saturating_sub(spares.ready.len() + spares.starting);
                    spares.starting += missing;
                    (missing, watch)
                };
                if watch {
                    slots.watch_spares();
                }
                if missing > 0 {
                    slots.start_spares(missing).await?;
                }
                Ok(())
            })
            .await
    }

    /// The warm spares ready now (live ones: a spare known to have died is
    /// left out, and replaced in the background).
    pub fn spares(&self) -> Vec<AllocatedProc> {
        let spares = self.slots.spares.lock().expect("spares lock");
        spares
            .ready
            .iter()
            .filter(|p| !self.rt.is_lost(&p.proc))
            .cloned()
            .collect()
    }

    /// How many lost procs a warm spare replaced so far.
    pub fn spares_taken(&self) -> u64 {
        self.slots
            .spares_taken
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The allocator that started the procs.
    pub fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.slots.allocator
    }

    /// The runtime that owns them.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// Spawns `per_proc` members of `A` on every proc, each created from
    /// `args`, owned by the controller with the default policy.
    pub async fn spawn<A: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &A::Args,
    ) -> Result<ActorMesh<A>, MeshError> {
        self.spawn_with(name, per_proc, args, SpawnOptions::default())
            .await
    }

    /// Spawns `per_proc` members of `A` on every proc (as they are now),
    /// each created from `args`, supervised as `options` say. The mesh's
    /// shape is this proc mesh's, plus a dimension [`MEMBER_DIM`] of size
    /// `per_proc`. Returns once every member has started; if one fails to
    /// start, the others are stopped.
    pub async fn spawn_with<A: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &A::Args,
        options: SpawnOptions,
    ) -> Result<ActorMesh<A>, MeshError> {
        let dims: Vec<(String, usize)> = self
            .shape
            .dims()
            .map(|(n, s)| (n.as_str().to_owned(), s))
            .collect();
        let on: Vec<ProcAddr> = self
            .slots
            .current()
            .iter()
            .map(|p| p.addr.clone())
            .collect();
        let args = encode(args).map_err(MeshError::Encode)?;
        let name = name.to_owned();
        let (rt, slots) = (self.rt.clone(), self.slots.clone());
        let shared = self
            .rt
            .on_control(async move {
                let spec = MeshSpec {
                    name: &name,
                    actor_type: A::NAME,
                    per_proc,
                    args,
                    dims,
                    options,
                };
                spawn_mesh(&rt, &slots, &on, spec).await
            })
            .await?;
        Ok(ActorMesh::new(shared))
    }

    /// Stops every mesh on these procs (so that no supervisor takes the
    /// procs' exits for failures), then every proc (SIGTERM, then SIGKILL
    /// after `grace`), and waits for their exits.
    pub async fn stop(self, grace: Duration) -> Result<(), MeshError> {
        let rt = self.rt.clone();
        rt.on_control(self.stop_here(grace)).await
    }

    async fn stop_here(self, grace: Duration) -> Result<(), MeshError> {
        let mut procs = self.slots.current();
        procs.extend(self.slots.end_spares());
        let ids: std::collections::HashSet<ProcId> = procs.iter().map(|p| p.proc.clone()).collect();
        self.rt.stop_meshes_on(&ids).await;
        for p in &procs {
            self.rt.release(&p.proc);
        }
        let allocator = &self.slots.allocator;
        let stops = procs.iter().map(|p| allocator.stop(&p.proc, grace));
        let mut first = None;
        for r in join_all(stops).await {
            if let Err(e) = r {
                // A proc that already exited is not an error to report.
                if !matches!(e, crate::alloc::AllocError::UnknownProc(_)) {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }
}

/// What to spawn, independent of the actor's type.
pub(super) struct MeshSpec<'a> {
    pub(super) name: &'a str,
    pub(super) actor_type: &'a str,
    pub(super) per_proc: u32,
    pub(super) args: bytes::Bytes,
    /// The dimensions of the procs (the mesh adds [`MEMBER_DIM`]).
    pub(super) dims: Vec<(String, usize)>,
    pub(super) options: SpawnOptions,
}

/// Spawns a mesh on the procs `on` (by proc rank) and starts its
/// supervisor; if a member fails to start, the others are stopped.
pub(super) async fn spawn_mesh(
    rt: &Runtime,
    slots: &Arc<ProcSlots>,
    on: &[ProcAddr],
    spec: MeshSpec<'_>,
) -> Result<Arc<MeshShared>, MeshError> {
    ActorName::new(spec.name)?;
    let mut dims = spec.dims;
    dims.push((MEMBER_DIM.to_owned(), spec.per_proc as usize));
    let shape = Shape::new(dims)?;
    let info = MeshInfo {
        id: rt.next_mesh_id(),
        name: spec.name.to_owned(),
        actor_type: spec.actor_type.to_owned(),
        shape,
        per_proc: spec.per_proc,
        procs: on.to_vec(),
        fanout: rt.config().fanout,
        owner: rt.event_port(),
        generation: Generation(0),
        token: rt.cast_token(),
    };
    info.validate().map_err(MeshError::Encode)?;
    let every: Vec<u32> = (0..info.proc_count()).collect();
    let body = RelayBody::Spawn {
        info: Box::new(info.clone()),
        args: spec.args.clone(),
        start: None,
    };
    let results = relay_to(rt, &info, &every, body).await;
    let failed = results.into_iter().find_map(|(_, r)| r.err());
    let shared = supervise::start(supervise::Setup {
        rt: rt.clone(),
        info,
        args: spec.args,
        slots: slots.clone(),
        options: spec.options,
    });
    if let Some(err) = failed {
        shared.stop().await;
        return Err(err);
    }
    Ok(shared)
}

/// Relays `body` (signed) down the tree over the procs `ranks` of `info`
/// and gives each rank's result, in the order of `ranks`.
pub(super) async fn relay_to(
    rt: &Runtime,
    info: &MeshInfo,
    ranks: &[u32],
    body: RelayBody,
) -> Vec<(u32, Result<(), MeshError>)> {
    if ranks.is_empty() {
        return Vec::new();
    }
    let proc_of = |r: u32| &info.procs[r as usize];
    let route = ranks
        .iter()
        .map(|&rank| Hop {
            rank,
            addr: proc_of(rank).clone(),
        })
        .collect();
    let error = |rank: u32, message: String| MeshError::Spawn {
        mesh: info.name.clone(),
        proc: proc_of(rank).proc.clone(),
        message,
    };
    let outcome = match rt.relay(route, body, rt.config().call_timeout, true).await {
        Ok(o) => o,
        Err(e) => {
            let why = format!("not relayed: {e}");
            return ranks
                .iter()
                .map(|&r| (r, Err(error(r, why.clone()))))
                .collect();
        }
    };
    let unnamed = outcome.more_failed;
    let mut failed: std::collections::HashMap<ProcId, String> =
        outcome.failed.into_iter().collect();
    ranks
        .iter()
        .map(|&r| match failed.remove(&proc_of(r).proc) {
            Some(why) => (r, Err(error(r, why))),
            // Past the outcome's bound failures are only counted: any proc
            // not named may be one of them.
            None if unnamed > 0 => (
                r,
                Err(error(r, format!("one of {unnamed} failures not named"))),
            ),
            None => (r, Ok(())),
        })
        .collect()
}

/// Spawns proc `rank`'s members of a mesh on `proc`.
pub(super) async fn spawn_on(
    rt: &Runtime,
    info: &MeshInfo,
    rank: u32,
    proc: &ProcId,
    args: &bytes::Bytes,
    start: Option<&Restart>,
) -> Result<(), MeshError> {
    let reply_to = rt.reply_port();
    let body = rt
        .request(
            proc,
            |call| ProcCommand::Spawn {
                call,
                reply_to,
                info: info.clone(),
                proc_rank: rank,
                args: args.clone(),
                start: start.cloned(),
            },
            &info.name,
        )
        .await?;
    spawned(body, info, proc)
}

pub(super) fn spawned(body: ReplyBody, info: &MeshInfo, proc: &ProcId) -> Result<(), MeshError> {
    match body {
        ReplyBody::Spawned(Ok(())) | ReplyBody::Updated => Ok(()),
        ReplyBody::Spawned(Err(message)) => Err(MeshError::Spawn {
            mesh: info.name.clone(),
            proc: proc.clone(),
            message,
        }),
        other => Err(MeshError::Spawn {
            mesh: info.name.clone(),
            proc: proc.clone(),
            message: format!("unexpected answer {other:?}"),
        }),
    }
}
