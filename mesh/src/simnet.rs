//! Deterministic simulation of a whole cluster (feature `sim`): the
//! controller's [`Runtime`] and in-process procs over one seeded
//! [`SimNet`], on one current-thread tokio runtime with a paused clock.
//!
//! What runs real: the controller (mesh supervision, policies, leases,
//! routing, the root of cast trees), every proc's runtime (cast-tree nodes,
//! members as ractor actors, generations, fencing), and the control plane
//! under them (quinn, rustls mutual TLS, sessions, failure detection). What
//! is simulated: the UDP sockets and the network ([`SimNet`]), the clock
//! (tokio's, paused: time jumps to the next timer when every task waits),
//! and process boundaries (a proc is a task with its own endpoint; there is
//! no payload plane). Every random choice of the mesh layer (cast tokens,
//! cast seeds) and of the network is drawn from the one seed, so a run of a
//! scenario replays exactly: same seed, same [`SimNet::trace_hash`].
//!
//! Proc faults ([`SimAllocator`], also reachable through
//! [`Allocator::signal`]): a kill aborts the proc's task and closes its
//! endpoint, and its exit is reported to the runtime; a pause holds every
//! link to and from the proc (peers see a stopped process: silence, then
//! everything at once on resume; its exit report, if it exits meanwhile,
//! waits for the resume too); a host loss cuts the proc off the network and
//! kills it without any report, so only the failure detector sees it.
//!
//! Run a scenario with [`simulate`]; start the cluster inside it with
//! [`SimCluster::start`].

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use regent_net::sim::SimNet;
use regent_net::{ClusterCa, KeyAlgorithm, ProcId, Validity};
use tokio::sync::mpsc;

use crate::alloc::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::error::MeshError;
use crate::inproc::InProcAllocator;
use crate::runtime::{ProcMesh, Runtime, RuntimeConfig};
use crate::shape::Shape;

/// The bound on proc events queued for the runtime.
const EVENTS: usize = 1024;

/// Runs `scenario` to its end on a fresh current-thread tokio runtime whose
/// clock starts paused: the runtime a simulation must run on.
pub fn simulate<F: Future>(scenario: impl FnOnce() -> F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        // Building a current-thread runtime fails only if the OS refuses
        // its timer resources: nothing a simulation could go on without.
        .expect("a current-thread runtime")
        .block_on(scenario())
}

/// A controller and its procs on one simulated network (see the module
/// docs).
pub struct SimCluster {
    net: SimNet,
    runtime: Runtime,
    allocator: Arc<SimAllocator>,
    procs: ProcMesh,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCluster")
            .field("net", &self.net)
            .field("procs", &self.procs)
            .finish_non_exhaustive()
    }
}

impl SimCluster {
    /// Starts, on a new [`SimNet`] seeded with `seed`, a controller
    /// configured by `config` (its endpoint at `config.bind`, its procs' at
    /// `config.proc_bind`, both simulated addresses; an Ed25519 cluster CA,
    /// so that datagram sizes replay) and a proc mesh of `procs` procs, in
    /// one dimension `procs`. Call it within [`simulate`].
    pub async fn start(seed: u64, procs: usize, config: RuntimeConfig) -> Result<Self, MeshError> {
        let net = SimNet::new(seed);
        let ca = ClusterCa::generate_with(
            "regent sim",
            Validity::for_duration(Validity::CA)?,
            KeyAlgorithm::Ed25519,
        )?;
        let runtime = Runtime::start_sim(config, ca, &net)?;
        let allocator = Arc::new(SimAllocator::new(&net, runtime.addr().socket));
        let shape = Shape::new([("procs", procs)])?;
        let procs = runtime.spawn_procs(allocator.clone(), shape).await?;
        Ok(Self {
            net,
            runtime,
            allocator,
            procs,
        })
    }

    /// The network: its faults, trace and hash.
    pub fn net(&self) -> &SimNet {
        &self.net
    }

    /// The controller.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The procs, as they are now (replacements included).
    pub fn procs(&self) -> &ProcMesh {
        &self.procs
    }

    /// The allocator of the procs, with their faults.
    pub fn allocator(&self) -> &Arc<SimAllocator> {
        &self.allocator
    }

    /// The controller's simulated address.
    pub fn controller_addr(&self) -> SocketAddr {
        self.runtime.addr().socket
    }
}

/// The fault state of the simulated procs.
#[derive(Default)]
struct Faults {
    /// Every proc started, and its simulated address.
    addrs: BTreeMap<ProcId, SocketAddr>,
    /// Procs paused: their links are held.
    paused: BTreeSet<ProcId>,
    /// Procs cut off the network (their host was lost).
    isolated: BTreeSet<ProcId>,
    /// Exit reports of paused procs, sent on their resume.
    deferred: Vec<ProcEvent>,
}

impl Faults {
    /// The other ends of every link of `proc`: the controller and every
    /// other proc.
    fn peers_of(&self, proc: &ProcId, controller: SocketAddr) -> Vec<SocketAddr> {
        std::iter::once(controller)
            .chain(
                self.addrs
                    .iter()
                    .filter(|(p, _)| *p != proc)
                    .map(|(_, a)| *a),
            )
            .collect()
    }

    fn concerns(event: &ProcEvent, set: &BTreeSet<ProcId>) -> bool {
        match event {
            ProcEvent::Exited { proc, .. } => set.contains(proc),
            ProcEvent::HostLost { procs, .. } => procs.iter().any(|p| set.contains(p)),
        }
    }
}

/// An [`InProcAllocator`] on a [`SimNet`], with process and host faults
/// (see the module docs). [`Allocator::signal`] maps `Kill` and `Term` to
/// [`Self::kill`], `Stop` to [`Self::pause`], `Cont` to [`Self::resume`].
pub struct SimAllocator {
    inner: InProcAllocator,
    net: SimNet,
    controller: SocketAddr,
    faults: Arc<Mutex<Faults>>,
    events_tx: mpsc::Sender<ProcEvent>,
    events_rx: Mutex<Option<mpsc::Receiver<ProcEvent>>>,
    /// Passes the inner allocator's events on, holding or dropping those of
    /// paused and lost procs.
    forward: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for SimAllocator {
    fn drop(&mut self) {
        if let Some(task) = self.lock_forward().take() {
            task.abort();
        }
    }
}

impl SimAllocator {
    /// Procs on `net`, owned by the controller at `controller`.
    pub fn new(net: &SimNet, controller: SocketAddr) -> Self {
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        Self {
            inner: InProcAllocator::on_simnet(net),
            net: net.clone(),
            controller,
            faults: Arc::default(),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
            forward: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Faults> {
        // Held for bookkeeping only, never across an await or a panic.
        self.faults.lock().expect("sim faults lock")
    }

    fn lock_forward(&self) -> MutexGuard<'_, Option<tokio::task::JoinHandle<()>>> {
        self.forward.lock().expect("sim forward lock")
    }

    /// The simulated address of a proc this allocator started.
    pub fn addr_of(&self, proc: &ProcId) -> Option<SocketAddr> {
        self.lock().addrs.get(proc).copied()
    }

    fn known(&self, proc: &ProcId) -> Result<SocketAddr, AllocError> {
        self.addr_of(proc)
            .ok_or_else(|| AllocError::UnknownProc(proc.clone()))
    }

    /// Kills a proc: its task is aborted, its endpoint closed, and its exit
    /// (SIGKILL) reported. A paused proc's held links stay held (what it
    /// had not sent is never sent).
    pub fn kill(&self, proc: &ProcId) -> Result<(), AllocError> {
        self.known(proc)?;
        self.lock().paused.remove(proc);
        self.inner.kill(proc)
    }

    /// Pauses a proc, as SIGSTOP looks to its peers: every datagram to or
    /// from it is held until [`Self::resume`]. Its tasks still run, but hear
    /// nothing and are heard by nobody; if it exits meanwhile (its lease
    /// lapsed), the report waits for the resume.
    pub fn pause(&self, proc: &ProcId) -> Result<(), AllocError> {
        let addr = self.known(proc)?;
        let mut faults = self.lock();
        if !faults.paused.insert(proc.clone()) {
            return Ok(());
        }
        for peer in faults.peers_of(proc, self.controller) {
            self.net.hold(addr, peer);
            self.net.hold(peer, addr);
        }
        Ok(())
    }

    /// Resumes a paused proc: what its links held is sent on, in order, and
    /// its exit report, if it exited meanwhile, is sent.
    pub fn resume(&self, proc: &ProcId) -> Result<(), AllocError> {
        let addr = self.known(proc)?;
        let deferred = {
            let mut faults = self.lock();
            if !faults.paused.remove(proc) {
                return Ok(());
            }
            for peer in faults.peers_of(proc, self.controller) {
                self.net.release(addr, peer);
                self.net.release(peer, addr);
            }
            let one = BTreeSet::from([proc.clone()]);
            let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut faults.deferred)
                .into_iter()
                .partition(|e| Faults::concerns(e, &one));
            faults.deferred = keep;
            due
        };
        for event in deferred {
            let _ = self.events_tx.try_send(event);
        }
        Ok(())
    }

    /// Loses a proc's host: the proc is cut off the network both ways and
    /// killed, and nothing reports it (no exit, no host loss): its peers
    /// learn it from their failure detectors.
    pub fn lose_host(&self, proc: &ProcId) -> Result<(), AllocError> {
        let addr = self.known(proc)?;
        {
            let mut faults = self.lock();
            faults.isolated.insert(proc.clone());
            for peer in faults.peers_of(proc, self.controller) {
                self.net.partition(addr, peer);
            }
        }
        self.inner.kill(proc)
    }

    /// Applies the faults in force to the links of procs just started.
    fn started(&self, procs: &[AllocatedProc]) {
        let mut faults = self.lock();
        for p in procs {
            let addr = p.addr.socket;
            for paused in &faults.paused {
                if let Some(&other) = faults.addrs.get(paused) {
                    self.net.hold(addr, other);
                    self.net.hold(other, addr);
                }
            }
            for isolated in &faults.isolated {
                if let Some(&other) = faults.addrs.get(isolated) {
                    self.net.partition(addr, other);
                }
            }
            faults.addrs.insert(p.proc.clone(), addr);
        }
    }
}

/// Passes the inner allocator's events on: those of lost hosts' procs are
/// dropped, those of paused procs wait for their resume.
async fn forward(
    faults: Arc<Mutex<Faults>>,
    mut from: mpsc::Receiver<ProcEvent>,
    to: mpsc::Sender<ProcEvent>,
) {
    while let Some(event) = from.recv().await {
        {
            let mut f = faults.lock().expect("sim faults lock");
            if Faults::concerns(&event, &f.isolated) {
                continue;
            }
            if Faults::concerns(&event, &f.paused) {
                f.deferred.push(event);
                continue;
            }
        }
        if to.send(event).await.is_err() {
            return;
        }
    }
}

impl Allocator for SimAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        async move {
            let procs = self.inner.allocate(boots).await?;
            self.started(&procs);
            Ok(procs)
        }
        .boxed()
    }

    fn stop(&self, proc: &ProcId, _grace: Duration) -> AllocFuture<'_, ProcStatus> {
        let r = self.kill(proc).map(|()| ProcStatus::Signal(9));
        async move { r }.boxed()
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        let r = match signal {
            ProcSignal::Kill | ProcSignal::Term => self.kill(proc),
            ProcSignal::Stop => self.pause(proc),
            ProcSignal::Cont => self.resume(proc),
        };
        async move { r }.boxed()
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        let rx = self.events_rx.lock().expect("events lock").take()?;
        if let Some(inner) = self.inner.take_events() {
            let task = tokio::spawn(forward(self.faults.clone(), inner, self.events_tx.clone()));
            *self.lock_forward() = Some(task);
        }
        Some(rx)
    }
}
