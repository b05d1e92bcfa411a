//! Proc meshes: procs started together, on which actor meshes are spawned.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use regent_net::{ActorName, Generation, ProcAddr};

use super::mesh::{ActorMesh, SpawnOptions};
use super::supervise;
use super::{MeshError, Runtime};
use crate::actor::{MeshActor, encode};
use crate::alloc::{AllocatedProc, Allocator};
use crate::protocol::{MeshInfo, ProcCommand, ReplyBody};
use crate::shape::Shape;

/// The name of the dimension an [`ActorMesh`] adds to its proc mesh's shape
/// for the members of each proc.
pub const MEMBER_DIM: &str = "actors";

/// Procs started by a [`Runtime`], with a shape.
pub struct ProcMesh {
    rt: Runtime,
    allocator: Arc<dyn Allocator>,
    /// The procs, by rank, plus any started later to replace failed ones.
    procs: Arc<Mutex<Vec<AllocatedProc>>>,
    initial: Vec<AllocatedProc>,
    shape: Shape,
}

impl fmt::Debug for ProcMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcMesh")
            .field("shape", &self.shape)
            .field("procs", &self.initial)
            .finish_non_exhaustive()
    }
}

impl ProcMesh {
    pub(super) fn new(
        rt: Runtime,
        allocator: Arc<dyn Allocator>,
        procs: Vec<AllocatedProc>,
        shape: Shape,
    ) -> Self {
        Self {
            rt,
            allocator,
            procs: Arc::new(Mutex::new(procs.clone())),
            initial: procs,
            shape,
        }
    }

    /// The procs, by rank, as started.
    pub fn procs(&self) -> &[AllocatedProc] {
        &self.initial
    }

    /// Every proc started for this mesh so far, replacements included.
    pub fn all_procs(&self) -> Vec<AllocatedProc> {
        self.procs.lock().expect("procs lock").clone()
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The allocator that started the procs.
    pub fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.allocator
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

    /// Spawns `per_proc` members of `A` on every proc, each created from
    /// `args`, supervised as `options` say. The mesh's shape is this proc
    /// mesh's, plus a dimension [`MEMBER_DIM`] of size `per_proc`. Returns
    /// once every member has started; if one fails to start, the others are
    /// stopped.
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
        let on: Vec<ProcAddr> = self.initial.iter().map(|p| p.addr.clone()).collect();
        let spec = MeshSpec {
            name,
            actor_type: A::NAME,
            per_proc,
            args: encode(args).map_err(MeshError::Encode)?,
            dims,
            options,
        };
        let shared = spawn_mesh(&self.rt, &self.allocator, &self.procs, &on, spec).await?;
        Ok(ActorMesh::new(self.rt.clone(), shared))
    }

    /// Stops every mesh on these procs (so that no supervisor takes the
    /// procs' exits for failures), then every proc (SIGTERM, then SIGKILL
    /// after `grace`), replacements included, and waits for their exits.
    pub async fn stop(self, grace: Duration) -> Result<(), MeshError> {
        let procs = self.all_procs();
        let ids: std::collections::HashSet<regent_net::ProcId> =
            procs.iter().map(|p| p.proc.clone()).collect();
        self.rt.stop_meshes_on(&ids).await;
        for p in &procs {
            self.rt.release(&p.proc);
        }
        let stops = procs.iter().map(|p| self.allocator.stop(&p.proc, grace));
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
    allocator: &Arc<dyn Allocator>,
    procs: &Arc<Mutex<Vec<AllocatedProc>>>,
    on: &[ProcAddr],
    spec: MeshSpec<'_>,
) -> Result<Arc<super::mesh::MeshShared>, MeshError> {
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
    };
    info.validate().map_err(MeshError::Encode)?;
    let spawns = on
        .iter()
        .enumerate()
        .map(|(rank, addr)| spawn_on(rt, &info, rank as u32, &addr.proc, &spec.args));
    let results = join_all(spawns).await;
    let failed = results.into_iter().find_map(Result::err);
    let shared = supervise::start(supervise::Setup {
        rt: rt.clone(),
        info,
        args: spec.args,
        allocator: allocator.clone(),
        procs: procs.clone(),
        options: spec.options,
    });
    if let Some(err) = failed {
        shared.stop().await;
        return Err(err);
    }
    Ok(shared)
}

/// Spawns proc `rank`'s members of a mesh on `proc`.
pub(super) async fn spawn_on(
    rt: &Runtime,
    info: &MeshInfo,
    rank: u32,
    proc: &regent_net::ProcId,
    args: &bytes::Bytes,
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
            },
            &info.name,
        )
        .await?;
    spawned(body, info, proc)
}

pub(super) fn spawned(
    body: ReplyBody,
    info: &MeshInfo,
    proc: &regent_net::ProcId,
) -> Result<(), MeshError> {
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
