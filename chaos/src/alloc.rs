//! [`ChaosAllocator`]: any allocator, with a chaos [`Proxy`] in front of
//! every proc it starts.
//!
//! It hands out each proc's proxy address as the proc's address
//! (`AllocatedProc::addr`), so the controller and every other proc reach
//! the proc only through its proxy, and registers the proc's real socket in
//! the [`Network`] so that other proxies know its datagrams. It also keeps
//! the history of every proc it started — pid, start, exit — for the
//! process-table invariants, and stops a proc's proxy when the proc exits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use regent_mesh::alloc::{
    AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use regent_net::{ProcAddr, ProcId, TransportEvent};
use tokio::sync::mpsc;

use crate::network::{Network, NodeId};
use crate::proxy::{Proxy, ProxyConfig, ProxyCounts};
use crate::rng::Seed;

/// The capacity of the event channel handed to the runtime.
const EVENT_BUFFER: usize = 4096;

/// One proc as the chaos allocator started it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcRecord {
    /// Its identity.
    pub proc: ProcId,
    /// Its node in the chaos network.
    pub node: NodeId,
    /// Its OS process id.
    pub pid: u32,
    /// Its real QUIC endpoint (behind the proxy).
    pub real: ProcAddr,
    /// When it was started.
    pub started: Instant,
    /// How and when it exited, once it did.
    pub exited: Option<(ProcStatus, Instant)>,
}

#[derive(Default)]
struct State {
    records: Vec<ProcRecord>,
    by_proc: HashMap<ProcId, usize>,
    proxies: HashMap<ProcId, Proxy>,
    /// Counts of proxies already stopped.
    retired: ProxyCounts,
}

struct Shared {
    state: Mutex<State>,
    network: Network,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Invariant: no code panics while holding it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An allocator that puts a chaos proxy in front of every proc another
/// allocator starts. See the module documentation.
pub struct ChaosAllocator {
    inner: Arc<dyn Allocator>,
    shared: Arc<Shared>,
    config: ProxyConfig,
    seed: Seed,
    next_node: AtomicU32,
    events: Mutex<Option<mpsc::Receiver<ProcEvent>>>,
    pump: tokio::task::AbortHandle,
}

impl std::fmt::Debug for ChaosAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChaosAllocator")
            .field("procs", &self.shared.lock().records.len())
            .finish_non_exhaustive()
    }
}

impl Drop for ChaosAllocator {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

impl ChaosAllocator {
    /// Wraps `inner`; proxies join `network` and draw their packet fates
    /// from `seed`. Takes `inner`'s event stream. Must be called within a
    /// tokio runtime.
    pub fn new(
        inner: Arc<dyn Allocator>,
        network: Network,
        config: ProxyConfig,
        seed: Seed,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            network,
        });
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let upstream = inner.take_events();
        let pump = tokio::spawn(pump(upstream, tx, shared.clone())).abort_handle();
        Self {
            inner,
            shared,
            config,
            seed,
            // Node 0 is the controller.
            next_node: AtomicU32::new(1),
            events: Mutex::new(Some(rx)),
            pump,
        }
    }

    /// The allocator behind the proxies.
    pub fn inner(&self) -> &Arc<dyn Allocator> {
        &self.inner
    }

    /// The chaos network.
    pub fn network(&self) -> &Network {
        &self.shared.network
    }

    /// Every proc started so far, in start order.
    pub fn history(&self) -> Vec<ProcRecord> {
        self.shared.lock().records.clone()
    }

    /// The record of one proc.
    pub fn record(&self, proc: &ProcId) -> Option<ProcRecord> {
        let s = self.shared.lock();
        s.by_proc.get(proc).map(|&i| s.records[i].clone())
    }

    /// The node of a proc.
    pub fn node_of(&self, proc: &ProcId) -> Option<NodeId> {
        self.record(proc).map(|r| r.node)
    }

    /// What every proxy did so far, stopped ones included.
    pub fn proxy_counts(&self) -> ProxyCounts {
        let s = self.shared.lock();
        s.proxies
            .values()
            .fold(s.retired, |acc, p| acc + p.counts())
    }

    async fn allocate_inner(
        &self,
        boots: Vec<ProcBoot>,
    ) -> Result<Vec<AllocatedProc>, regent_mesh::alloc::AllocError> {
        let procs = self.inner.allocate(boots).await?;
        let mut out = Vec::with_capacity(procs.len());
        let mut started = Vec::with_capacity(procs.len());
        for p in &procs {
            let node = NodeId(self.next_node.fetch_add(1, Ordering::Relaxed));
            let seed = self.seed.derive_n("proxy", u64::from(node.0));
            let proxy = match Proxy::start(
                self.shared.network.clone(),
                node,
                Some(p.addr.socket),
                self.config.clone(),
                seed,
            )
            .await
            {
                Ok(proxy) => proxy,
                Err(e) => {
                    // Stop what this call started: the caller gets nothing.
                    for q in &procs {
                        let _ = self.inner.stop(&q.proc, Duration::ZERO).await;
                    }
                    return Err(regent_mesh::alloc::AllocError::Io(std::io::Error::other(
                        e.to_string(),
                    )));
                }
            };
            self.shared
                .network
                .register(node, p.proc.to_string(), p.addr.socket);
            out.push(AllocatedProc {
                proc: p.proc.clone(),
                addr: ProcAddr {
                    socket: proxy.addr(),
                    proc: p.proc.clone(),
                },
                host: p.host.clone(),
                pid: p.pid,
            });
            tracing::debug!(proc = %p.proc, %node, real = %p.addr.socket, proxy = %proxy.addr(), "proc behind a chaos proxy");
            started.push((
                ProcRecord {
                    proc: p.proc.clone(),
                    node,
                    pid: p.pid,
                    real: p.addr.clone(),
                    started: Instant::now(),
                    exited: None,
                },
                proxy,
            ));
        }
        let mut s = self.shared.lock();
        for (record, proxy) in started {
            let exited_already = s
                .by_proc
                .get(&record.proc)
                .and_then(|&i| s.records[i].exited);
            let proc = record.proc.clone();
            match s.by_proc.get(&proc).copied() {
                // Its exit came before this bookkeeping: keep the exit.
                Some(i) => {
                    let mut r = record;
                    r.exited = exited_already;
                    s.records[i] = r;
                }
                None => {
                    let i = s.records.len();
                    s.records.push(record);
                    s.by_proc.insert(proc.clone(), i);
                }
            }
            if exited_already.is_none() {
                s.proxies.insert(proc, proxy);
            }
        }
        Ok(out)
    }
}

/// Passes the inner allocator's events on, noting exits and stopping the
/// exited procs' proxies.
async fn pump(
    upstream: Option<mpsc::Receiver<ProcEvent>>,
    tx: mpsc::Sender<ProcEvent>,
    shared: Arc<Shared>,
) {
    let Some(mut upstream) = upstream else {
        return;
    };
    while let Some(event) = upstream.recv().await {
        if let ProcEvent::Exited { proc, status, .. } = &event {
            let mut s = shared.lock();
            match s.by_proc.get(proc).copied() {
                Some(i) => {
                    s.records[i].exited = Some((*status, Instant::now()));
                    let node = s.records[i].node;
                    shared.network.forget(node);
                }
                None => {
                    // Exited before allocate() returned: remember it so the
                    // record gets it.
                    let i = s.records.len();
                    s.records.push(ProcRecord {
                        proc: proc.clone(),
                        node: NodeId::UNKNOWN,
                        pid: 0,
                        real: ProcAddr {
                            socket: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
                            proc: proc.clone(),
                        },
                        started: Instant::now(),
                        exited: Some((*status, Instant::now())),
                    });
                    s.by_proc.insert(proc.clone(), i);
                }
            }
            if let Some(proxy) = s.proxies.remove(proc) {
                s.retired = s.retired + proxy.counts();
            }
        }
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

impl Allocator for ChaosAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        Box::pin(self.allocate_inner(boots))
    }

    fn stop(&self, proc: &ProcId, grace: Duration) -> AllocFuture<'_, ProcStatus> {
        self.inner.stop(proc, grace)
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        self.inner.signal(proc, signal)
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn take_logs(&self) -> Option<mpsc::Receiver<regent_mesh::logs::LogLine>> {
        self.inner.take_logs()
    }

    fn transport_event(&self, event: &TransportEvent) {
        self.inner.transport_event(event);
    }
}
