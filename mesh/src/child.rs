//! Meshes spawned by members of other meshes.
//!
//! A member asks the controller (its mesh's owner) to spawn a mesh on the
//! procs of its own mesh; the member becomes that mesh's owner. The new mesh
//! is supervised in the controller like any other, with the member's policy;
//! when it escalates, the member fails with [`FailureCause::Escalated`], and
//! its own mesh's policy applies — so meshes spawned by actors form a tree
//! that escalation walks to the root. When the member exits or is restarted,
//! the meshes it owns stop. The member casts and calls its mesh directly, as
//! the root of the mesh's cast tree in its own proc.
//!
//! [`FailureCause::Escalated`]: crate::policy::FailureCause::Escalated

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use regent_net::{ActorId, Generation, PortId};

use crate::actor::{MeshActor, encode};
use crate::node::{self, Fabric, Pending};
use crate::policy::MeshPolicy;
use crate::protocol::{Collect, Contribution, MeshId, MeshInfo, ReplyBody, SpawnChild};
use crate::runtime::mesh::{acked, cast_frame, gathered};
use crate::runtime::{MeshError, ValueMesh};
use crate::selection::Selection;
use crate::shape::Shape;

/// The live meshes owned by members of one proc, as the controller last
/// described them (a stopped one is forgotten).
pub(crate) type Children = Arc<Mutex<HashMap<MeshId, Arc<MeshInfo>>>>;

/// How a member reaches the controller and its own meshes.
#[derive(Clone)]
pub(crate) struct MemberLink {
    pub(crate) fabric: Arc<dyn Fabric>,
    pub(crate) pending: Arc<Pending>,
    /// The controller's spawn port.
    pub(crate) controller: PortId,
    /// The actor casts are sent as.
    pub(crate) me: ActorId,
    pub(crate) mesh: MeshId,
    pub(crate) rank: u32,
    pub(crate) children: Children,
    /// How long requests and casts wait.
    pub(crate) timeout: std::time::Duration,
}

impl fmt::Debug for MemberLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemberLink")
            .field("mesh", &self.mesh)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl MemberLink {
    /// Asks the controller for a mesh of `B` owned by this member.
    pub(crate) async fn spawn<B: MeshActor>(
        &self,
        name: &str,
        per_proc: u32,
        args: &B::Args,
        policy: MeshPolicy,
    ) -> Result<ChildMesh<B>, MeshError> {
        let refused = |message: String| MeshError::SpawnChild {
            mesh: name.to_owned(),
            message,
        };
        let (call, answer) = self.pending.request();
        let request = SpawnChild {
            call,
            reply_to: self.fabric.reply_port(),
            parent: self.mesh,
            rank: self.rank,
            name: name.to_owned(),
            actor_type: B::NAME.to_owned(),
            per_proc,
            args: encode(args).map_err(MeshError::Encode)?,
            policy: policy.into(),
        };
        if let Err(e) = self
            .fabric
            .spawn_child(self.controller.clone(), request)
            .await
        {
            self.pending.forget(call);
            return Err(refused(format!("could not reach the controller: {e}")));
        }
        let body = match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(body)) => body,
            _ => {
                self.pending.forget(call);
                return Err(MeshError::Timeout {
                    what: format!("spawning {name}"),
                    after: self.timeout,
                });
            }
        };
        match body {
            ReplyBody::ChildSpawned(Ok(info)) => {
                let id = info.id;
                self.children
                    .lock()
                    .expect("children lock")
                    .insert(id, Arc::new(info));
                Ok(ChildMesh {
                    link: self.clone(),
                    id,
                    name: name.to_owned(),
                    _actor: PhantomData,
                })
            }
            ReplyBody::ChildSpawned(Err(message)) => Err(refused(message)),
            other => Err(refused(format!("unexpected answer {other:?}"))),
        }
    }
}

/// A mesh owned by a member, as that member sees it.
pub struct ChildMesh<B> {
    link: MemberLink,
    id: MeshId,
    name: String,
    _actor: PhantomData<fn() -> B>,
}

impl<B> fmt::Debug for ChildMesh<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildMesh")
            .field("name", &self.name)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl<B: MeshActor> ChildMesh<B> {
    /// The mesh's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn info(&self) -> Result<Arc<MeshInfo>, MeshError> {
        match self
            .link
            .children
            .lock()
            .expect("children lock")
            .get(&self.id)
        {
            Some(info) => Ok(info.clone()),
            None => Err(MeshError::Stopped(self.name.clone())),
        }
    }

    /// The mesh's current generation (it grows with every restart).
    pub fn generation(&self) -> Result<Generation, MeshError> {
        Ok(self.info()?.generation)
    }

    async fn root_cast(
        &self,
        selection: &Selection,
        msg: &B::Msg,
        collect: Collect,
    ) -> Result<(Shape, Contribution), MeshError> {
        let info = self.info()?;
        let (origin, timeout) = (self.link.me.clone(), self.link.timeout);
        let frame = cast_frame(
            &info,
            info.shape.clone(),
            origin,
            selection,
            msg,
            collect,
            timeout,
        )?;
        let fabric = self.link.fabric.as_ref();
        let c = node::from_root(fabric, &self.link.pending, &info, &frame).await;
        Ok((frame.view, c))
    }

    /// Delivers `msg` to every selected member (see `ActorMesh::cast`).
    pub async fn cast(&self, selection: &Selection, msg: &B::Msg) -> Result<(), MeshError> {
        let (_, c) = self.root_cast(selection, msg, Collect::Ack).await?;
        acked(c)
    }

    /// Sends `msg` to every selected member and gathers the replies by rank
    /// (see `ActorMesh::call`).
    pub async fn call(
        &self,
        selection: &Selection,
        msg: &B::Msg,
    ) -> Result<ValueMesh<B::Reply>, MeshError> {
        let (shape, c) = self.root_cast(selection, msg, Collect::Gather).await?;
        Ok(gathered(shape, c))
    }
}
