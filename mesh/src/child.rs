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

use crate::actor::{MemberError, MeshActor, decode, encode};
use crate::node::{self, Fabric, Pending};
use crate::policy::MeshPolicy;
use crate::protocol::{CastFrame, Collect, MeshId, MeshInfo, ReplyBody, SpawnChild};
use crate::runtime::{MembersFailed, MeshError};
use crate::selection::Selection;
use crate::shape::Rank;

/// The meshes owned by members of one proc, as the controller last described
/// them (`None`: stopped).
pub(crate) type Children = Arc<Mutex<HashMap<MeshId, Option<Arc<MeshInfo>>>>>;

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
            return Err(MeshError::Encode(format!(
                "could not reach the controller: {e}"
            )));
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
                    .insert(id, Some(Arc::new(info)));
                Ok(ChildMesh {
                    link: self.clone(),
                    id,
                    name: name.to_owned(),
                    _actor: PhantomData,
                })
            }
            ReplyBody::ChildSpawned(Err(message)) => Err(MeshError::Encode(message)),
            other => Err(MeshError::Encode(format!("unexpected answer {other:?}"))),
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
            Some(Some(info)) => Ok(info.clone()),
            _ => Err(MeshError::Stopped(self.name.clone())),
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
    ) -> Result<crate::protocol::Contribution, MeshError> {
        let info = self.info()?;
        selection.bind(&info.shape, 0)?;
        let frame = CastFrame {
            mesh: info.id,
            generation: info.generation,
            origin: self.link.me.clone(),
            view: info.shape.clone(),
            selection: selection.clone(),
            seed: 0,
            procs: (0, info.proc_count()),
            per_proc: info.per_proc,
            payload: encode(msg).map_err(MeshError::Encode)?,
            reply: None,
            collect,
            budget_ms: u32::try_from(self.link.timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let fabric = self.link.fabric.as_ref();
        let d = node::dispatch(fabric, &self.link.pending, &info, &frame, None).await;
        Ok(node::collect(&self.link.pending, d).await)
    }

    /// Delivers `msg` to every selected member (see `ActorMesh::cast`).
    pub async fn cast(&self, selection: &Selection, msg: &B::Msg) -> Result<(), MeshError> {
        let c = self.root_cast(selection, msg, Collect::Ack).await?;
        if c.failed.is_empty() {
            Ok(())
        } else {
            Err(MembersFailed {
                failed: c.failed.into_iter().map(|(r, e)| (Rank(r), e)).collect(),
            }
            .into())
        }
    }

    /// Sends `msg` to every selected member and gathers the replies by rank,
    /// each a value or why there is none.
    pub async fn call(
        &self,
        selection: &Selection,
        msg: &B::Msg,
    ) -> Result<Vec<(Rank, Result<B::Reply, MemberError>)>, MeshError> {
        let c = self.root_cast(selection, msg, Collect::Gather).await?;
        let mut out: Vec<(Rank, Result<B::Reply, MemberError>)> = c
            .values
            .into_iter()
            .map(|(r, bytes)| {
                (
                    Rank(r),
                    decode::<B::Reply>(&bytes).map_err(MemberError::BadReply),
                )
            })
            .chain(c.failed.into_iter().map(|(r, e)| (Rank(r), Err(e))))
            .collect();
        out.sort_by_key(|(r, _)| *r);
        Ok(out)
    }
}
