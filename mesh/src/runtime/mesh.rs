//! A mesh as its owner, the controller, holds it: how it is supervised
//! ([`SpawnOptions`]) and what its references share with its supervisor.

use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{broadcast, mpsc, watch};

use super::observe::{MeshRecord, MeshSnapshot, Observer, RankSnapshot};
use super::supervise::Signal;
use crate::actor_mesh::{ActorMesh, Target};
use crate::cast::Caster;
use crate::error::MeshError;
use crate::policy::{Decision, MeshFailure, MeshPolicy, MeshStatus};
use crate::protocol::{MeshId, MeshInfo};
use crate::shape::Rank;

/// Decides, for one failure, what to do instead of the policy (`None`
/// keeps the policy's decision). Runs in the owner's supervisor task: keep it
/// quick.
pub type FailureHook = Arc<dyn Fn(&MeshFailure) -> Option<Decision> + Send + Sync>;

/// Decides, for one failure, what to do instead of the policy, and may take
/// its time (it is awaited: the supervisor handles nothing else meanwhile,
/// and no failure is missed). `None` keeps the policy's decision.
pub type SuperviseHook =
    Arc<dyn Fn(MeshFailure) -> BoxFuture<'static, Option<Decision>> + Send + Sync>;

/// How a mesh is supervised, given at spawn.
#[derive(Clone, Default)]
pub struct SpawnOptions {
    pub(crate) policy: MeshPolicy,
    pub(crate) hook: Option<FailureHook>,
    pub(crate) supervise: Option<SuperviseHook>,
    pub(crate) owner: Option<(MeshId, Rank)>,
}

impl fmt::Debug for SpawnOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpawnOptions")
            .field("policy", &self.policy)
            .field("hook", &self.hook.is_some())
            .field("supervise", &self.supervise.is_some())
            .field("owner", &self.owner)
            .finish()
    }
}

impl SpawnOptions {
    /// The default policy, owned by the controller.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the policy.
    pub fn policy(mut self, policy: MeshPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the owner's quick hook, which may override the policy per
    /// failure.
    pub fn on_failure(
        mut self,
        hook: impl Fn(&MeshFailure) -> Option<Decision> + Send + Sync + 'static,
    ) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Sets the owner's asynchronous supervision callback (like Monarch's
    /// `__supervise__`): awaited for every failure, before the policy; its
    /// answer overrides the policy.
    pub fn supervise<F>(mut self, f: impl Fn(MeshFailure) -> F + Send + Sync + 'static) -> Self
    where
        F: std::future::Future<Output = Option<Decision>> + Send + 'static,
    {
        self.supervise = Some(Arc::new(move |failure| Box::pin(f(failure))));
        self
    }

    /// Makes the member at `rank` of `parent` this mesh's owner: when this
    /// mesh escalates, that member fails (cause
    /// [`FailureCause::Escalated`](crate::policy::FailureCause::Escalated))
    /// and `parent`'s policy applies. Without an owner mesh, escalation
    /// reaches the root, which stops the job.
    pub fn owned_by<P>(mut self, parent: &ActorMesh<P>, rank: Rank) -> Self {
        self.owner = Some((parent.id(), rank));
        self
    }
}

/// What a mesh's references share with its supervisor.
pub(crate) struct MeshShared {
    pub(crate) id: MeshId,
    /// The current generation's mesh: procs and generation change on
    /// restarts.
    pub(crate) info: RwLock<Arc<MeshInfo>>,
    pub(crate) status: watch::Sender<MeshStatus>,
    pub(crate) failures: broadcast::Sender<MeshFailure>,
    pub(crate) supervisor: mpsc::Sender<Signal>,
    pub(crate) caster: Arc<Caster>,
    pub(crate) timeout: Duration,
    /// What snapshots show of it (written by its supervisor).
    pub(crate) record: Mutex<MeshRecord>,
    pub(crate) observer: Arc<Observer>,
}

impl MeshShared {
    pub(crate) fn info(&self) -> Arc<MeshInfo> {
        self.info.read().expect("mesh info lock").clone()
    }

    /// What a snapshot shows of this mesh now.
    pub(crate) fn snapshot(&self) -> MeshSnapshot {
        let info = self.info();
        let record = self.record.lock().expect("mesh record lock").clone();
        let status = match &*self.status.borrow() {
            MeshStatus::Running => "running",
            MeshStatus::Restarting => "restarting",
            MeshStatus::Stopped(_) => "stopped",
            MeshStatus::Escalated(_) => "escalated",
        };
        let ranks = (0..info.members())
            .map(|rank| RankSnapshot {
                rank,
                proc: info
                    .procs
                    .get((rank / info.per_proc.max(1)) as usize)
                    .map(|a| a.proc.to_string())
                    .unwrap_or_default(),
                state: record
                    .states
                    .get(rank as usize)
                    .copied()
                    .unwrap_or("running")
                    .to_owned(),
            })
            .collect();
        MeshSnapshot {
            id: self.id.0,
            name: info.name.clone(),
            owner: record.owner,
            policy: record.policy.clone(),
            generation: info.generation.0,
            status: status.to_owned(),
            restarts: record.restarts,
            ranks,
            last_failures: record.last_failures.into_iter().collect(),
        }
    }

    /// Asks the supervisor to stop the mesh, and waits until it has (at
    /// once if it already has).
    pub(crate) async fn stop(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self
            .supervisor
            .send(Signal::StopRequested(tx))
            .await
            .is_ok()
        {
            let _ = rx.await;
        }
    }
}

impl Target for MeshShared {
    fn info(&self) -> Arc<MeshInfo> {
        MeshShared::info(self)
    }

    fn caster(&self) -> &Caster {
        &self.caster
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn status(&self) -> watch::Receiver<MeshStatus> {
        self.status.subscribe()
    }

    fn failures(&self) -> broadcast::Receiver<MeshFailure> {
        self.failures.subscribe()
    }

    fn stop(&self) -> BoxFuture<'_, Result<(), MeshError>> {
        Box::pin(async move {
            MeshShared::stop(self).await;
            Ok(())
        })
    }

    fn count(&self, gathers: bool) {
        if gathers {
            self.observer.calls.inc();
        } else {
            self.observer.casts.inc();
        }
    }
}
