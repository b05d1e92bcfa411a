//! [`Injector`]: plays faults against a running mesh — signals through the
//! allocator, rules in the chaos network, panics through the workload's
//! hook — and undoes the lasting ones when they end.
//!
//! Proc ranks are resolved when a fault starts (the proc at that rank of
//! the mesh now), and a lasting fault remembers what it resolved to, so its
//! end undoes exactly what its start did. The network's rules are always
//! recomputed from the set of network faults in force, so overlapping
//! faults compose and ending one leaves the others.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use regent_mesh::alloc::{Allocator, ProcSignal};
use regent_mesh::{ActorMesh, Rank, Selection};
use regent_net::ProcId;

use crate::alloc::ChaosAllocator;
use crate::netns::Hosts;
use crate::network::{Direction, LinkFaults, Network, NodeId, Rules};
use crate::schedule::{Fault, FaultKind, ScheduledFault, Target};
use crate::workload::{Tally, TallyMsg};

/// What one fault start did.
#[derive(Debug, Clone)]
pub struct Injection {
    /// Its number (to end it).
    pub id: u64,
    /// The fault.
    pub fault: Fault,
    /// When it started.
    pub at: Instant,
    /// The procs it hit (whose failure the owner should detect).
    pub procs: Vec<ProcId>,
    /// The member ranks it hit (panics).
    pub ranks: Vec<u32>,
    /// Whether it applied (a target may be gone).
    pub applied: bool,
}

#[derive(Debug, Clone)]
enum NetPiece {
    Isolate(NodeId),
    Partition(Vec<NodeId>, Vec<NodeId>, Direction),
    Degrade(Option<NodeId>, LinkFaults),
}

/// Plays faults; see the module documentation.
pub struct Injector {
    alloc: Arc<ChaosAllocator>,
    network: Network,
    mesh: ActorMesh<Tally>,
    next: u64,
    net: BTreeMap<u64, NetPiece>,
    paused: HashMap<u64, ProcId>,
    counts: BTreeMap<FaultKind, u64>,
    stop_grace: Duration,
    hosts: Option<Arc<Hosts>>,
    /// Host faults in force, to undo, with what a cut's effect is
    /// measured from.
    host_faults: HashMap<u64, (Fault, Option<CutBaseline>)>,
    /// Packets the kernel dropped because of host faults, by kind.
    host_dropped: BTreeMap<FaultKind, u64>,
}

/// A host's counters read just after its link went down.
#[derive(Debug, Clone, Copy)]
struct CutBaseline {
    /// Packets the host had received.
    rx: u64,
    /// Packets the root namespace had sent toward the hosts.
    root_tx: u64,
}

impl std::fmt::Debug for Injector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Injector")
            .field("net", &self.net)
            .field("paused", &self.paused)
            .finish_non_exhaustive()
    }
}

impl Injector {
    /// An injector for `mesh`, whose procs `alloc` started.
    pub fn new(alloc: Arc<ChaosAllocator>, mesh: ActorMesh<Tally>) -> Self {
        Self {
            network: alloc.network().clone(),
            alloc,
            mesh,
            next: 0,
            net: BTreeMap::new(),
            paused: HashMap::new(),
            counts: BTreeMap::new(),
            stop_grace: Duration::from_secs(1),
            hosts: None,
            host_faults: HashMap::new(),
            host_dropped: BTreeMap::new(),
        }
    }

    /// Lets it play kernel-level faults between these namespace hosts.
    pub fn with_hosts(mut self, hosts: Option<Arc<Hosts>>) -> Self {
        self.hosts = hosts;
        self
    }

    fn host_op(&self, fault: &Fault, undo: bool) -> bool {
        let Some(h) = &self.hosts else {
            tracing::warn!(%fault, "a host fault without namespace hosts: skipped");
            return false;
        };
        let r = match (fault, undo) {
            (Fault::HostCut { host }, false) => h.cut(*host),
            (Fault::HostCut { host }, true) => h.heal(*host),
            (Fault::HostFirewall { host }, false) => h.drop_all(*host),
            (Fault::HostFirewall { host }, true) => h.undrop_all(*host),
            (Fault::HostBlock { from, to }, false) => h.block(*from, *to),
            (Fault::HostBlock { from, to }, true) => h.unblock(*from, *to),
            _ => return false,
        };
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%fault, undo, error = %e, "host fault failed");
                false
            }
        }
    }

    /// Faults started so far, by kind (those that applied).
    pub fn counts(&self) -> &BTreeMap<FaultKind, u64> {
        &self.counts
    }

    /// Packets the kernel dropped because of host faults that have ended,
    /// by kind, from its counters: the firewall's and the bridge block's
    /// drop rules; for a link cut, the packets the root namespace sent
    /// toward the hosts while the host received none (a cut host that
    /// received anything counts nothing).
    pub fn host_dropped(&self) -> &BTreeMap<FaultKind, u64> {
        &self.host_dropped
    }

    /// Reads a cut host's counters (just after the cut).
    fn cut_baseline(&self, fault: &Fault) -> Option<CutBaseline> {
        let (Fault::HostCut { host }, Some(h)) = (fault, &self.hosts) else {
            return None;
        };
        match (h.rx_packets(*host), h.root_tx_packets()) {
            (Ok(rx), Ok(root_tx)) => Some(CutBaseline { rx, root_tx }),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(%fault, error = %e, "reading a cut host's counters");
                None
            }
        }
    }

    /// What a host fault in force has dropped so far (read before it is
    /// undone).
    fn host_effect(&self, fault: &Fault, baseline: Option<CutBaseline>) -> u64 {
        let Some(h) = &self.hosts else { return 0 };
        let count = match fault {
            Fault::HostFirewall { host } => h.dropped(*host),
            Fault::HostBlock { from, to } => h.blocked(*from, *to),
            Fault::HostCut { host } => {
                let Some(b) = baseline else { return 0 };
                match (h.rx_packets(*host), h.root_tx_packets()) {
                    (Ok(rx), Ok(tx)) if rx == b.rx => Ok(tx.saturating_sub(b.root_tx)),
                    (Ok(rx), Ok(_)) => {
                        tracing::warn!(%fault, received = rx.saturating_sub(b.rx), "a cut host received packets");
                        Ok(0)
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                }
            }
            _ => Ok(0),
        };
        count.unwrap_or_else(|e| {
            tracing::warn!(%fault, error = %e, "reading a host fault's counters");
            0
        })
    }

    fn proc_at(&self, rank: u32) -> Option<ProcId> {
        proc_at(&self.mesh, rank)
    }

    fn node(&self, target: Target) -> Option<NodeId> {
        match target {
            Target::Controller => Some(NodeId::CONTROLLER),
            Target::Proc(p) => self.proc_at(p).and_then(|p| self.alloc.node_of(&p)),
        }
    }

    fn apply_net(&self) {
        let mut rules = Rules::default();
        for piece in self.net.values() {
            match piece {
                NetPiece::Isolate(n) => {
                    rules.isolated.insert(*n);
                }
                NetPiece::Partition(a, b, d) => rules.partition(a, b, *d),
                NetPiece::Degrade(None, f) => rules.all_links = rules.all_links.compose(*f),
                NetPiece::Degrade(Some(n), f) => {
                    let e = rules.nodes.entry(*n).or_default();
                    *e = e.compose(*f);
                }
            }
        }
        self.network.set_rules(rules);
    }

    /// Starts a fault.
    pub async fn start(&mut self, fault: &Fault) -> Injection {
        let id = self.next;
        self.next += 1;
        let mut inj = Injection {
            id,
            fault: fault.clone(),
            at: Instant::now(),
            procs: Vec::new(),
            ranks: Vec::new(),
            applied: false,
        };
        match fault {
            Fault::Kill { proc } | Fault::Stop { proc } | Fault::Pause { proc } => {
                let Some(p) = self.proc_at(*proc) else {
                    return inj;
                };
                let result = match fault {
                    Fault::Kill { .. } => self.alloc.signal(&p, ProcSignal::Kill).await,
                    Fault::Pause { .. } => self.alloc.signal(&p, ProcSignal::Stop).await,
                    _ => self.alloc.signal(&p, ProcSignal::Term).await,
                };
                if let Err(e) = result {
                    tracing::info!(proc = %p, error = %e, %fault, "fault target gone");
                    return inj;
                }
                if matches!(fault, Fault::Stop { .. }) {
                    // The graceful stop's SIGKILL after the grace.
                    let alloc = self.alloc.clone();
                    let (grace, victim) = (self.stop_grace, p.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        let _ = alloc.signal(&victim, ProcSignal::Kill).await;
                    });
                }
                if matches!(fault, Fault::Pause { .. }) {
                    self.paused.insert(id, p.clone());
                }
                inj.procs.push(p);
            }
            Fault::Panic { rank } => {
                if !panic_member(&self.mesh, *rank) {
                    return inj;
                }
                inj.ranks.push(*rank);
            }
            Fault::Blackhole { proc } => {
                let Some(p) = self.proc_at(*proc) else {
                    return inj;
                };
                let Some(n) = self.alloc.node_of(&p) else {
                    return inj;
                };
                self.net.insert(id, NetPiece::Isolate(n));
                inj.procs.push(p);
            }
            Fault::Partition { a, b, one_way } => {
                let na: Vec<NodeId> = a.iter().filter_map(|t| self.node(*t)).collect();
                let nb: Vec<NodeId> = b.iter().filter_map(|t| self.node(*t)).collect();
                if na.is_empty() || nb.is_empty() {
                    return inj;
                }
                inj.procs = cut_off_procs(a, b, |r| self.proc_at(r));
                let d = if *one_way {
                    Direction::OneWay
                } else {
                    Direction::Both
                };
                self.net.insert(id, NetPiece::Partition(na, nb, d));
            }
            Fault::Degrade { proc, faults, .. } => {
                let node = match proc {
                    None => None,
                    Some(r) => match self.proc_at(*r).and_then(|p| self.alloc.node_of(&p)) {
                        Some(n) => Some(n),
                        None => return inj,
                    },
                };
                self.net.insert(id, NetPiece::Degrade(node, *faults));
            }
            // Real procs share the machine's clock, and their allocator
            // reports every exit: only a simulation can do these.
            Fault::HostLoss { .. } | Fault::ClockJump { .. } => {
                tracing::warn!(%fault, "a simulated-only fault in a real run: skipped");
                return inj;
            }
            Fault::HostCut { .. } | Fault::HostFirewall { .. } | Fault::HostBlock { .. } => {
                if !self.host_op(fault, false) {
                    return inj;
                }
                let baseline = self.cut_baseline(fault);
                self.host_faults.insert(id, (fault.clone(), baseline));
            }
        }
        if fault.kind().is_link_fault() {
            self.apply_net();
        }
        inj.applied = true;
        *self.counts.entry(fault.kind()).or_insert(0) += 1;
        tracing::info!(id, %fault, "fault injected");
        inj
    }

    /// Ends a lasting fault started as `id` (resumes a paused proc, removes
    /// network rules). Ending one that is not in force does nothing.
    pub async fn end(&mut self, id: u64) {
        if let Some(p) = self.paused.remove(&id) {
            if let Err(e) = self.alloc.signal(&p, ProcSignal::Cont).await {
                tracing::debug!(proc = %p, error = %e, "resuming a proc that is gone");
            }
            tracing::info!(id, proc = %p, "fault ended: resumed");
        }
        if let Some((f, baseline)) = self.host_faults.remove(&id) {
            let dropped = self.host_effect(&f, baseline);
            *self.host_dropped.entry(f.kind()).or_insert(0) += dropped;
            self.host_op(&f, true);
            tracing::info!(id, %f, "fault ended: host healed");
        }
        if self.net.remove(&id).is_some() {
            self.apply_net();
            tracing::info!(id, "fault ended: network rule removed");
        }
    }

    /// Ends every fault in force: a clean network, every paused proc
    /// resumed.
    pub async fn heal_all(&mut self) {
        let mut ids: Vec<u64> = self.paused.keys().copied().collect();
        ids.extend(self.host_faults.keys().copied());
        for id in ids {
            self.end(id).await;
        }
        self.net.clear();
        self.network.heal();
    }

    /// Plays a schedule: starts and ends each fault at its time from now.
    /// `on_start` sees every start (for detection bookkeeping). Returns
    /// when the last fault has ended (every fault in force is ended).
    pub async fn play(
        &mut self,
        faults: &[ScheduledFault],
        on_start: impl FnMut(&ScheduledFault, &Injection),
    ) {
        play(self, faults, on_start).await;
    }
}

impl FaultPlane for Injector {
    async fn start(&mut self, fault: &Fault) -> Injection {
        Injector::start(self, fault).await
    }

    async fn end(&mut self, id: u64) {
        Injector::end(self, id).await;
    }

    async fn heal_all(&mut self) {
        Injector::heal_all(self).await;
    }
}

/// What faults are played on: real procs behind proxies ([`Injector`]), or
/// a simulated cluster (the `sim` module).
pub(crate) trait FaultPlane {
    /// Starts a fault.
    async fn start(&mut self, fault: &Fault) -> Injection;
    /// Ends the lasting fault started as `id`.
    async fn end(&mut self, id: u64);
    /// Ends every fault in force.
    async fn heal_all(&mut self);
}

/// The proc at proc rank `rank` of `mesh`, if it has one.
pub(crate) fn proc_at(mesh: &ActorMesh<Tally>, rank: u32) -> Option<ProcId> {
    mesh.procs().get(rank as usize).map(|a| a.proc.clone())
}

/// The procs a partition between `a` and `b` cuts from the controller (the
/// side without it): the ones whose failure the controller may detect.
pub(crate) fn cut_off_procs(
    a: &[Target],
    b: &[Target],
    proc_at: impl Fn(u32) -> Option<ProcId>,
) -> Vec<ProcId> {
    let cut_off = if a.contains(&Target::Controller) {
        b
    } else {
        a
    };
    cut_off
        .iter()
        .filter_map(|t| match t {
            Target::Proc(r) => proc_at(*r),
            Target::Controller => None,
        })
        .collect()
}

/// Makes the member at `rank` panic (its call fails: that is the point);
/// false if the mesh has no such rank.
pub(crate) fn panic_member(mesh: &ActorMesh<Tally>, rank: u32) -> bool {
    let Some(selection) = rank_selection(mesh, rank) else {
        return false;
    };
    let mesh = mesh.clone();
    tokio::spawn(async move {
        let _ = mesh
            .call_within(&selection, &TallyMsg::Panic, Duration::from_secs(5))
            .await;
    });
    true
}

/// The selection of one rank of `mesh` (`None` past its shape).
pub(crate) fn rank_selection(mesh: &ActorMesh<Tally>, rank: u32) -> Option<Selection> {
    let point = mesh.mesh_shape().point_of(Rank(rank))?;
    let text: Vec<String> = point
        .names()
        .iter()
        .zip(point.coords())
        .map(|(n, c)| format!("{}={c}", n.as_str()))
        .collect();
    text.join(",").parse::<Selection>().ok()
}

/// Plays a schedule on `plane` (see [`Injector::play`]).
pub(crate) async fn play<P: FaultPlane>(
    plane: &mut P,
    faults: &[ScheduledFault],
    mut on_start: impl FnMut(&ScheduledFault, &Injection),
) {
    let t0 = tokio::time::Instant::now();
    // (time, order, start?, index)
    let mut events: Vec<(Duration, u8, usize)> = Vec::new();
    for (i, f) in faults.iter().enumerate() {
        events.push((f.at, 1, i));
        if let Some(d) = f.lasts {
            events.push((f.at + d, 0, i));
        }
    }
    // Ends before starts at the same instant.
    events.sort_by_key(|(t, kind, i)| (*t, *kind, *i));
    let mut ids: HashMap<usize, u64> = HashMap::new();
    for (t, kind, i) in events {
        tokio::time::sleep_until(t0 + t).await;
        if kind == 1 {
            let inj = plane.start(&faults[i].fault).await;
            on_start(&faults[i], &inj);
            if inj.applied {
                ids.insert(i, inj.id);
            }
        } else if let Some(id) = ids.remove(&i) {
            plane.end(id).await;
        }
    }
    plane.heal_all().await;
}
