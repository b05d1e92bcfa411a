//! What a member knows and can reach: [`Member`] is given to every callback
//! of a mesh actor. It says where the member sits (mesh,
//! rank, point, proc), which generation the mesh is in now, why it started
//! ([`StartContext`]: first start or restart, after what, and which live
//! peer can serve its state), and gives it the proc's services: its own mesh
//! as a mesh reference ([`Member::peers`]), meshes it owns or was given,
//! point-to-point data channels to its peers ([`Member::channel`]) and the
//! payload plane ([`Member::buffers`]).

pub mod channel;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use regent_net::{ActorId, Endpoint, Generation, PortId, ProcId};
use regent_rdma::BufferManager;
use tokio::sync::watch;

use crate::cast::Caster;
use crate::error::MeshError;
use crate::fabric::{Fabric, Pending};
use crate::policy::{MeshFailure, MeshStatus};
use crate::protocol::{MeshId, MeshInfo, Restart, StartKind};
use crate::shape::{Point, Rank};

pub(crate) use crate::mailbox::MemberMsg;
pub use crate::mailbox::PeersRestarted;
pub use channel::{ChannelError, ChannelReceiver, ChannelSender, PeerChannel};

/// Why a member started, and who can serve it state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartContext {
    /// The generation this life belongs to.
    pub generation: Generation,
    /// The first start of the mesh, or a restart (after what).
    pub kind: StartKind,
    /// The ranks restarted with this one (every rank after a gang restart).
    pub restarted: Vec<Rank>,
    /// A live rank of this generation that can serve this member's state
    /// (`None` on a first start, after a gang restart, or when no rank
    /// survived).
    pub source: Option<Rank>,
}

impl StartContext {
    pub(crate) fn first() -> Self {
        Self {
            generation: Generation(0),
            kind: StartKind::First,
            restarted: Vec::new(),
            source: None,
        }
    }

    pub(crate) fn of(
        rank: u32,
        generation: Generation,
        previous: Generation,
        restart: Option<&Restart>,
    ) -> Self {
        match restart {
            None => Self {
                generation,
                ..Self::first()
            },
            Some(r) => Self {
                generation,
                kind: StartKind::Restart {
                    cause: r.cause.clone(),
                    previous,
                },
                restarted: r.ranks.iter().copied().map(Rank).collect(),
                source: r
                    .sources
                    .iter()
                    .find(|(restarted, _)| *restarted == rank)
                    .map(|(_, source)| Rank(*source)),
            },
        }
    }

    /// Whether this life is a restart.
    pub fn is_restart(&self) -> bool {
        matches!(self.kind, StartKind::Restart { .. })
    }
}

/// Where a member's mesh stands, as its proc knows it (updated when the
/// owner reports a failure and when a restart completes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerState {
    /// The mesh's current generation.
    pub generation: Generation,
    /// Ranks reported failed and not yet restarted (in `generation`).
    pub failed: Vec<Rank>,
}

/// What a proc knows of a mesh its members host or own: its current info
/// and where it stands.
pub(crate) struct KnownMesh {
    pub(crate) info: RwLock<Arc<MeshInfo>>,
    pub(crate) state: watch::Sender<PeerState>,
    pub(crate) status: watch::Sender<MeshStatus>,
    pub(crate) failures: tokio::sync::broadcast::Sender<MeshFailure>,
    /// When each rank's current life began, as this proc learned it.
    lives: Mutex<Lives>,
}

/// The generation each rank's current life began in: `base` (the last gang
/// restart this proc learned of), or a later restart of the rank alone.
/// Holds at most one entry per rank of the mesh.
#[derive(Default)]
struct Lives {
    base: Generation,
    restarted: HashMap<u32, Generation>,
}

impl Lives {
    fn began(&self, rank: Rank) -> Generation {
        self.restarted
            .get(&rank.0)
            .copied()
            .unwrap_or(self.base)
            .max(self.base)
    }
}

impl KnownMesh {
    pub(crate) fn new(info: MeshInfo) -> Arc<Self> {
        let state = PeerState {
            generation: info.generation,
            failed: Vec::new(),
        };
        Arc::new(Self {
            info: RwLock::new(Arc::new(info)),
            state: watch::channel(state).0,
            status: watch::channel(MeshStatus::Running).0,
            failures: tokio::sync::broadcast::channel(KNOWN_FAILURES).0,
            lives: Mutex::new(Lives::default()),
        })
    }

    /// Ranks were restarted (every rank for a gang restart): their lives
    /// begin in the restart's generation.
    pub(crate) fn restarted(&self, restart: &Restart) {
        let members = self.info().members();
        let mut lives = self.lives.lock().expect("lives lock");
        if restart.ranks.len() as u64 >= u64::from(members) {
            lives.base = lives.base.max(restart.generation);
            lives.restarted.clear();
            return;
        }
        for &rank in &restart.ranks {
            if rank < members {
                let began = lives.restarted.entry(rank).or_insert(restart.generation);
                *began = (*began).max(restart.generation);
            }
        }
    }

    pub(crate) fn info(&self) -> Arc<MeshInfo> {
        self.info.read().expect("known mesh lock").clone()
    }

    /// The generation the current life of `rank` began in.
    pub(crate) fn life_began(&self, rank: Rank) -> Generation {
        self.lives.lock().expect("lives lock").began(rank)
    }

    /// A new generation is in force.
    pub(crate) fn update(&self, info: MeshInfo) {
        let generation = info.generation;
        *self.info.write().expect("known mesh lock") = Arc::new(info);
        self.state.send_modify(|s| {
            if generation > s.generation {
                s.generation = generation;
                s.failed.clear();
            }
        });
        self.status.send_replace(MeshStatus::Running);
    }

    /// The mesh stopped.
    pub(crate) fn gone(&self) {
        self.status.send_replace(MeshStatus::Stopped(None));
    }

    /// Ranks failed (reported by the owner before restarting them). A
    /// report about lives a restart already replaced is stale and changes
    /// nothing: the owner's report may arrive after the restart's own
    /// command, and a survivor's life may be older than the mesh's
    /// generation (its failure still counts).
    pub(crate) fn failed(&self, failure: &MeshFailure) {
        let current: Vec<Rank> = {
            let lives = self.lives.lock().expect("lives lock");
            failure
                .ranks
                .iter()
                .copied()
                .filter(|&r| lives.began(r) <= failure.generation)
                .collect()
        };
        if current.is_empty() {
            tracing::debug!(%failure, "a stale failure report ignored");
            return;
        }
        let _ = self.failures.send(failure.clone());
        self.state.send_modify(|s| {
            s.failed.extend(current);
            s.failed.sort_unstable();
            s.failed.dedup();
        });
        self.status.send_replace(MeshStatus::Restarting);
    }
}

/// The bound on failures a proc keeps for slow readers of a known mesh.
const KNOWN_FAILURES: usize = 64;

/// The meshes a proc knows: those its members belong to, and those they own.
pub(crate) type Known = Arc<Mutex<HashMap<MeshId, Arc<KnownMesh>>>>;

/// What every member of a proc can reach.
pub(crate) struct ProcServices {
    pub(crate) fabric: Arc<dyn Fabric>,
    pub(crate) pending: Arc<Pending>,
    /// Casts from this proc's members (one caster: their casts keep their
    /// order).
    pub(crate) caster: Arc<Caster>,
    pub(crate) known: Known,
    /// The control plane, where there is one (not in the simulation).
    pub(crate) endpoint: Option<Endpoint>,
    /// The payload plane, where there is one.
    pub(crate) buffers: Option<Arc<BufferManager>>,
    /// How long members' own requests and casts wait by default.
    pub(crate) timeout: Duration,
}

impl ProcServices {
    pub(crate) fn known(&self, mesh: MeshId) -> Option<Arc<KnownMesh>> {
        self.known
            .lock()
            .expect("known meshes lock")
            .get(&mesh)
            .cloned()
    }
}

/// Where a member sits, why it started, and what it can reach (see the
/// module docs). Cheap to clone.
#[derive(Clone)]
pub struct Member {
    pub(crate) inner: Arc<MemberInner>,
}

pub(crate) struct MemberInner {
    pub(crate) mesh: MeshId,
    pub(crate) name: String,
    pub(crate) rank: Rank,
    pub(crate) point: Point,
    pub(crate) proc: ProcId,
    pub(crate) start: StartContext,
    pub(crate) state: watch::Receiver<PeerState>,
    /// The controller's spawn port (where members ask for meshes).
    pub(crate) controller: PortId,
    pub(crate) services: Arc<ProcServices>,
}

impl fmt::Debug for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Member")
            .field("mesh", &self.inner.name)
            .field("rank", &self.inner.rank)
            .field("generation", &self.generation())
            .field("proc", &self.inner.proc)
            .finish_non_exhaustive()
    }
}

impl Member {
    /// The mesh's name.
    pub fn mesh(&self) -> &str {
        &self.inner.name
    }

    /// The member's rank in the mesh.
    pub fn rank(&self) -> Rank {
        self.inner.rank
    }

    /// The member's point in the mesh's shape.
    pub fn point(&self) -> &Point {
        &self.inner.point
    }

    /// The mesh's current generation (it grows at every restart; a member
    /// restarted into a generation sees at least that one).
    pub fn generation(&self) -> Generation {
        self.inner.state.borrow().generation
    }

    /// Where the mesh stands now: its generation and the ranks reported
    /// failed and not yet restarted. Watch it to end work with failed peers
    /// early (collectives do).
    pub fn peer_state(&self) -> watch::Receiver<PeerState> {
        self.inner.state.clone()
    }

    /// Failures of this mesh's members as the owner reports them to this
    /// proc (ranks, cause, and the generation of the failed lives), from
    /// now on; a report about lives a restart already replaced is left out
    /// (the survivors' lives may be older than the mesh's generation).
    /// Unlike [`Member::peer_state`], which keeps only the latest state,
    /// every report is kept (the last 64 for a slow reader), so a failure
    /// followed at once by the restart that repairs it is still seen, with
    /// its cause.
    pub fn failures(&self) -> Result<tokio::sync::broadcast::Receiver<MeshFailure>, MeshError> {
        let known = self
            .known()
            .ok_or_else(|| MeshError::Stopped(self.inner.name.clone()))?;
        Ok(known.failures.subscribe())
    }

    /// Why this life started.
    pub fn start(&self) -> &StartContext {
        &self.inner.start
    }

    /// The proc the member runs in.
    pub fn proc(&self) -> &ProcId {
        &self.inner.proc
    }

    /// The number of members of the mesh.
    pub fn size(&self) -> u32 {
        self.known().map_or(0, |k| k.info().members())
    }

    /// The proc's payload plane: register memory, hand out handles, read and
    /// write peers' buffers one-sidedly.
    pub fn buffers(&self) -> Result<&Arc<BufferManager>, MeshError> {
        self.inner
            .services
            .buffers
            .as_ref()
            .ok_or_else(|| MeshError::Unavailable("this proc has no payload plane".into()))
    }

    /// A point-to-point data channel to the other members of this mesh,
    /// beside the mailbox (see [`PeerChannel`]). `tag` tells channels apart:
    /// members open the same tag to talk on it.
    pub fn channel(&self, tag: u16) -> Result<PeerChannel, MeshError> {
        let endpoint = self
            .inner
            .services
            .endpoint
            .clone()
            .ok_or_else(|| MeshError::Unavailable("this proc has no control plane".into()))?;
        let known = self
            .known()
            .ok_or_else(|| MeshError::Stopped(self.inner.name.clone()))?;
        PeerChannel::open(self, endpoint, known, tag)
    }

    pub(crate) fn known(&self) -> Option<Arc<KnownMesh>> {
        self.inner.services.known(self.inner.mesh)
    }

    /// The actor this member sends as on its data channels.
    pub(crate) fn actor_id(&self) -> Result<ActorId, MeshError> {
        Ok(ActorId {
            proc: self.inner.proc.clone(),
            name: regent_net::ActorName::new(&self.inner.name)?,
            index: self.inner.rank.0,
        })
    }
}

#[cfg(test)]
mod tests;
