//! [`HostAllocator`]: procs on `regent host` agents already running at
//! given addresses, reached over QUIC with mutual TLS.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use regent_net::{
    ActorId, Delivery, Endpoint, Generation, Inbox, Message as _, ProcAddr, ProcId, TransportEvent,
    TypeTag,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use super::tracker::{Tracker, await_ready};
use super::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::host::wire::{
    self, HostHello, HostOp, HostReply, HostRequest, ProcExited, ProcLogs, ProcReady, Renew,
    ReplyOk, RequestId, SpawnRequest,
};

/// Allocators one endpoint may hold (each has its own actor
/// `regent-alloc[k]`).
const MAX_ALLOCATORS_PER_ENDPOINT: u32 = 64;
/// Requests in flight at once.
const MAX_PENDING_REQUESTS: usize = 65_536;

/// Configuration of a [`HostAllocator`], with documented defaults. Fields
/// are public; the same-named methods set them builder-style.
#[derive(Debug, Clone)]
pub struct HostAllocatorConfig {
    /// The program the host agents run as procs (a path on the hosts).
    /// Default: `None`, each agent's default program.
    pub program: Option<String>,
    /// Arguments of every proc. Default none.
    pub args: Vec<String>,
    /// Environment variables of every proc, on top of the agent's. Default
    /// none.
    pub env: Vec<(String, String)>,
    /// How long a proc may take to report ready. Default 30 s.
    pub start_timeout: Duration,
    /// This owner's lease on each host agent, renewed every lease / 3: an
    /// agent that hears nothing for this long stops this owner's procs.
    /// Default 10 s.
    pub lease: Duration,
    /// How long a host agent may take to answer a request. Default 10 s.
    pub request_timeout: Duration,
    /// Capacity of the [`ProcEvent`] channel; events past it are dropped
    /// and counted. Default 4096.
    pub event_buffer: NonZeroUsize,
}

impl Default for HostAllocatorConfig {
    fn default() -> Self {
        Self {
            program: None,
            args: Vec::new(),
            env: Vec::new(),
            start_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            event_buffer: NonZeroUsize::new(4096).expect("4096 is not zero"),
        }
    }
}

impl HostAllocatorConfig {
    /// Sets the proc program (a path on the hosts).
    pub fn program(mut self, path: impl Into<String>) -> Self {
        self.program = Some(path.into());
        self
    }

    /// Adds proc arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds a proc environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the start timeout.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Sets the lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the request timeout.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets the event channel capacity.
    pub fn event_buffer(mut self, capacity: NonZeroUsize) -> Self {
        self.event_buffer = capacity;
        self
    }
}

/// A host agent as a [`HostAllocator`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostInfo {
    /// Its endpoint.
    pub addr: ProcAddr,
    /// Why it is lost, if it is.
    pub lost: Option<String>,
}

struct HostEntry {
    addr: ProcAddr,
    lost: Option<String>,
}

#[derive(Default)]
struct HostTable {
    hosts: Vec<HostEntry>,
    next: usize,
    /// Agents whose [`HostHello`] is awaited (started by Slurm).
    expected: HashSet<ProcId>,
    hellos: Option<mpsc::Sender<HostHello>>,
}

type ReplyTx = oneshot::Sender<Result<ReplyOk, String>>;

struct Shared {
    endpoint: Endpoint,
    me: ActorId,
    tracker: Tracker,
    hosts: Mutex<HostTable>,
    pending: Mutex<HashMap<RequestId, (ProcId, ReplyTx)>>,
    next_id: AtomicU64,
    lease: watch::Sender<Duration>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain tables: nothing a panicking holder could leave half-done matters.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Places procs round-robin on host agents (`regent host`) reached over
/// QUIC. Renews this owner's lease on every agent every lease / 3. A host
/// agent whose link fails yields [`ProcEvent::HostLost`] for its procs:
/// feed the endpoint's [`TransportEvent`]s to
/// [`HostAllocator::handle_transport_event`], or let the allocator take the
/// endpoint's event stream ([`HostAllocator::watch_transport_events`]).
///
/// Dropping the allocator stops the renewals: the agents stop its procs
/// when the lease lapses. [`HostAllocator::shutdown`] stops them at once.
pub struct HostAllocator {
    shared: Arc<Shared>,
    config: HostAllocatorConfig,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl std::fmt::Debug for HostAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAllocator")
            .field("me", &self.shared.me)
            .field("hosts", &self.hosts())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Drop for HostAllocator {
    fn drop(&mut self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }
}

impl HostAllocator {
    /// An allocator over the host agents at `hosts`, with the default
    /// configuration. Opens its port (`regent-alloc[k]#0`, the first free
    /// `k`) on the owner's endpoint. Must be called within a tokio runtime.
    pub fn new(endpoint: Endpoint, hosts: Vec<ProcAddr>) -> Result<Self, AllocError> {
        Self::with_config(endpoint, hosts, HostAllocatorConfig::default())
    }

    /// An allocator with `config`.
    pub fn with_config(
        endpoint: Endpoint,
        hosts: Vec<ProcAddr>,
        config: HostAllocatorConfig,
    ) -> Result<Self, AllocError> {
        let (me, inbox) = open_alloc_port(&endpoint)?;
        let (lease, lease_rx) = watch::channel(config.lease);
        let shared = Arc::new(Shared {
            endpoint,
            me,
            tracker: Tracker::new(config.event_buffer.get()),
            hosts: Mutex::new(HostTable::default()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            lease,
        });
        for addr in hosts {
            shared.add_host(addr);
        }
        let dispatcher = tokio::spawn(dispatch(shared.clone(), inbox)).abort_handle();
        let renewals = tokio::spawn(renew(shared.clone(), lease_rx)).abort_handle();
        Ok(Self {
            shared,
            config,
            tasks: Mutex::new(vec![dispatcher, renewals]),
        })
    }

    /// Sets the proc program on the hosts (builder-style).
    pub fn program(mut self, path: impl Into<String>) -> Self {
        self.config.program = Some(path.into());
        self
    }

    /// Adds proc arguments (builder-style).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.config.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds a proc environment variable (builder-style).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.env.push((key.into(), value.into()));
        self
    }

    /// Sets the start timeout (builder-style).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.config.start_timeout = timeout;
        self
    }

    /// Sets the lease (builder-style); renewals follow at once.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self.shared.lease.send_replace(lease);
        self
    }

    /// Takes the endpoint's transport event stream and watches it for lost
    /// host agents. Fails if the stream was taken already (then call
    /// [`Self::handle_transport_event`] from its holder).
    pub fn watch_transport_events(self) -> Result<Self, AllocError> {
        self.watch_events()?;
        Ok(self)
    }

    pub(crate) fn watch_events(&self) -> Result<(), AllocError> {
        let mut events = self
            .shared
            .endpoint
            .take_events()
            .ok_or_else(|| AllocError::Host {
                host: String::new(),
                message: "the endpoint's transport events were already taken".into(),
            })?;
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                shared.handle_transport_event(&event);
            }
        });
        lock(&self.tasks).push(task.abort_handle());
        Ok(())
    }

    /// Reacts to a transport event: a failed or closed link to a host agent,
    /// or a restarted one, loses that host ([`ProcEvent::HostLost`]).
    pub fn handle_transport_event(&self, event: &TransportEvent) {
        self.shared.handle_transport_event(event);
    }

    /// The configuration.
    pub fn config(&self) -> &HostAllocatorConfig {
        &self.config
    }

    /// The owner actor this allocator speaks as (its port 0 receives).
    pub fn actor(&self) -> &ActorId {
        &self.shared.me
    }

    /// The host agents.
    pub fn hosts(&self) -> Vec<HostInfo> {
        lock(&self.shared.hosts)
            .hosts
            .iter()
            .map(|h| HostInfo {
                addr: h.addr.clone(),
                lost: h.lost.clone(),
            })
            .collect()
    }

    /// Adds a host agent.
    pub fn add_host(&self, addr: ProcAddr) {
        self.shared.add_host(addr);
    }

    /// Awaits [`HostHello`]s from the agents named `names` (adding each as
    /// it comes) and returns them in arrival order.
    pub(crate) async fn await_hellos(
        &self,
        names: &[ProcId],
        timeout: Duration,
        mut gave_up: impl FnMut() -> Option<String>,
    ) -> Result<Vec<HostHello>, AllocError> {
        let (tx, mut rx) = mpsc::channel(names.len().max(1));
        {
            let mut table = lock(&self.shared.hosts);
            table.expected.extend(names.iter().cloned());
            table.hellos = Some(tx);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut hellos = Vec::with_capacity(names.len());
        let mut check = tokio::time::interval(Duration::from_millis(100));
        while hellos.len() < names.len() {
            tokio::select! {
                hello = rx.recv() => match hello {
                    Some(h) => hellos.push(h),
                    None => break,
                },
                _ = check.tick() => {
                    if let Some(why) = gave_up() {
                        return Err(AllocError::Capacity(why));
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    return Err(AllocError::Capacity(format!(
                        "{} of {} host agents announced themselves within {timeout:?}",
                        hellos.len(),
                        names.len()
                    )));
                }
            }
        }
        lock(&self.shared.hosts).hellos = None;
        Ok(hellos)
    }

    /// Events dropped because the event channel was full.
    pub fn dropped_events(&self) -> u64 {
        self.shared.tracker.dropped_events()
    }

    /// Stops every proc of this allocator (SIGTERM, then SIGKILL after
    /// `grace`) and waits until all have exited or their hosts are lost.
    pub async fn shutdown(&self, grace: Duration) {
        let procs = self.shared.tracker.procs();
        let stops = procs.iter().map(|p| self.stop_inner(p.clone(), grace));
        for (proc, result) in procs.iter().zip(futures::future::join_all(stops).await) {
            if let Err(e) = result {
                tracing::warn!(%proc, error = %e, "stop at shutdown failed");
            }
        }
    }

    /// Asks every live host agent to stop its procs and exit
    /// ([`HostOp::Shutdown`]; agents obey only the controller they were
    /// started for). Returns the agents that refused or did not answer.
    pub(crate) async fn shutdown_hosts(&self) -> Vec<(ProcId, AllocError)> {
        let live: Vec<ProcId> = lock(&self.shared.hosts)
            .hosts
            .iter()
            .filter(|h| h.lost.is_none())
            .map(|h| h.addr.proc.clone())
            .collect();
        let asks = live.iter().map(|h| self.request(h, HostOp::Shutdown));
        live.iter()
            .cloned()
            .zip(futures::future::join_all(asks).await)
            .filter_map(|(h, r)| r.err().map(|e| (h, e)))
            .collect()
    }

    async fn allocate_inner(&self, boots: Vec<ProcBoot>) -> Result<Vec<AllocatedProc>, AllocError> {
        // Placement first: round-robin over the live hosts.
        let mut placed = Vec::with_capacity(boots.len());
        {
            let mut table = lock(&self.shared.hosts);
            let live: Vec<ProcAddr> = table
                .hosts
                .iter()
                .filter(|h| h.lost.is_none())
                .map(|h| h.addr.clone())
                .collect();
            if live.is_empty() && !boots.is_empty() {
                return Err(AllocError::Capacity("no live host agent".into()));
            }
            for mut boot in boots {
                let host = live[table.next % live.len()].clone();
                table.next = table.next.wrapping_add(1);
                boot.parent = host.clone();
                boot.bind = SocketAddr::new(host.socket.ip(), 0);
                placed.push((host, boot));
            }
        }
        let mut waits = Vec::with_capacity(placed.len());
        let mut spawns = Vec::with_capacity(placed.len());
        let mut registered = Vec::with_capacity(placed.len());
        for (host, boot) in placed {
            let proc = boot.proc.clone();
            let name = host.proc.to_string();
            match self.shared.tracker.register(&proc, &name) {
                Ok(rx) => {
                    registered.push(proc.clone());
                    waits.push((proc.clone(), name, rx));
                }
                Err(e) => {
                    for p in &registered {
                        self.shared.tracker.forget(p);
                    }
                    return Err(e);
                }
            }
            // The rank's own placement after what every proc gets.
            let mut args = self.config.args.clone();
            args.extend(boot.placement.args.iter().cloned());
            let mut env = self.config.env.clone();
            env.extend(boot.placement.env.iter().cloned());
            let request = SpawnRequest {
                boot,
                program: self.config.program.clone(),
                args,
                env,
                lease: self.config.lease,
            };
            spawns.push(async move {
                let r = self
                    .request(&host.proc, HostOp::Spawn(Box::new(request)))
                    .await;
                (proc, r)
            });
        }
        let mut failure = None;
        let mut started = Vec::new();
        for (proc, result) in futures::future::join_all(spawns).await {
            match result {
                Ok(ReplyOk::Spawned { pid }) => {
                    self.shared.tracker.set_pid(&proc, pid);
                    started.push(proc);
                }
                Ok(ReplyOk::Done) => {
                    failure.get_or_insert(AllocError::Spawn {
                        proc: proc.clone(),
                        message: "host agent answered a spawn without a pid".into(),
                    });
                    self.shared.tracker.forget(&proc);
                }
                Err(e) => {
                    failure.get_or_insert(match e {
                        AllocError::Host { message, .. } => AllocError::Spawn {
                            proc: proc.clone(),
                            message,
                        },
                        other => other,
                    });
                    self.shared.tracker.forget(&proc);
                }
            }
        }
        let result = match failure {
            Some(e) => Err(e),
            None => await_ready(waits, self.config.start_timeout).await,
        };
        if result.is_err() {
            let stops = started
                .iter()
                .map(|p| self.stop_inner(p.clone(), Duration::ZERO));
            for (proc, r) in started.iter().zip(futures::future::join_all(stops).await) {
                if let Err(e) = r {
                    tracing::warn!(%proc, error = %e, "cannot stop proc after a failed allocation");
                }
                self.shared.tracker.forget(proc);
            }
        }
        result
    }

    async fn stop_inner(&self, proc: ProcId, grace: Duration) -> Result<ProcStatus, AllocError> {
        let host = self
            .shared
            .tracker
            .host_of(&proc)
            .ok_or_else(|| AllocError::UnknownProc(proc.clone()))?;
        let host_id = ProcId::new(&host).map_err(regent_net::Error::from)?;
        let exited = self.shared.tracker.stop_waiter(&proc)?;
        let refused = self
            .request(
                &host_id,
                HostOp::Stop {
                    proc: proc.clone(),
                    grace,
                },
            )
            .await
            .err();
        // A refusal may only mean it exited just now: its exit is then on
        // its way. Otherwise the exit comes within the grace (then SIGKILL).
        let wait = match refused {
            Some(_) => Duration::from_secs(1),
            None => grace + self.config.request_timeout,
        };
        match tokio::time::timeout(wait, exited).await {
            Ok(Ok(Ok(status))) => Ok(status),
            Ok(Ok(Err(message))) => Err(AllocError::Host { host, message }),
            Ok(Err(_)) => Err(AllocError::UnknownProc(proc)),
            Err(_) => Err(refused.unwrap_or_else(|| AllocError::Host {
                host,
                message: format!("proc {proc} not reported exited within {wait:?}"),
            })),
        }
    }

    async fn request(&self, host: &ProcId, op: HostOp) -> Result<ReplyOk, AllocError> {
        self.shared
            .request(host, op, self.config.request_timeout)
            .await
    }
}

impl Shared {
    fn add_host(&self, addr: ProcAddr) {
        {
            let mut table = lock(&self.hosts);
            if let Some(h) = table.hosts.iter_mut().find(|h| h.addr.proc == addr.proc) {
                h.addr = addr.clone();
            } else {
                table.hosts.push(HostEntry {
                    addr: addr.clone(),
                    lost: None,
                });
            }
        }
        self.endpoint.add_route(addr.clone());
        // Renew at once: it opens the link, so a dead agent is noticed, and
        // starts the lease.
        let lease = *self.lease.borrow();
        if let Err(e) = self.endpoint.try_send(
            &self.me,
            &wire::host_port(&addr.proc),
            Generation(0),
            Renew { lease },
        ) {
            tracing::warn!(host = %addr, failure = %e.failure, "first renewal not sent");
        }
    }

    fn is_host(&self, proc: &ProcId) -> bool {
        lock(&self.hosts).hosts.iter().any(|h| &h.addr.proc == proc)
    }

    fn handle_transport_event(&self, event: &TransportEvent) {
        let (peer, why) = match event {
            TransportEvent::LinkFailed { peer, cause, .. } => {
                (peer, format!("link failed: {cause}"))
            }
            TransportEvent::LinkClosed { peer, cause } => (peer, format!("link closed: {cause}")),
            TransportEvent::PeerRestarted { peer, .. } => (peer, "restarted".to_owned()),
            _ => return,
        };
        self.lose(peer, &why);
    }

    fn lose(&self, host: &ProcId, why: &str) {
        {
            let mut table = lock(&self.hosts);
            match table.hosts.iter_mut().find(|h| &h.addr.proc == host) {
                Some(h) if h.lost.is_none() => h.lost = Some(why.to_owned()),
                _ => return,
            }
        }
        let failed: Vec<ReplyTx> = {
            let mut pending = lock(&self.pending);
            let ids: Vec<RequestId> = pending
                .iter()
                .filter(|(_, (h, _))| h == host)
                .map(|(id, _)| *id)
                .collect();
            ids.iter()
                .filter_map(|id| pending.remove(id).map(|(_, tx)| tx))
                .collect()
        };
        for tx in failed {
            let _ = tx.send(Err(format!("host lost: {why}")));
        }
        self.tracker.on_host_lost(host.as_str(), why);
    }

    async fn request(
        &self,
        host: &ProcId,
        op: HostOp,
        timeout: Duration,
    ) -> Result<ReplyOk, AllocError> {
        let host_err = |message: String| AllocError::Host {
            host: host.to_string(),
            message,
        };
        if let Some(why) = lock(&self.hosts)
            .hosts
            .iter()
            .find(|h| &h.addr.proc == host)
            .and_then(|h| h.lost.clone())
        {
            return Err(host_err(format!("lost: {why}")));
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if pending.len() >= MAX_PENDING_REQUESTS {
                return Err(host_err("too many requests in flight".into()));
            }
            pending.insert(id, (host.clone(), tx));
        }
        let sent = self
            .endpoint
            .send(
                &self.me,
                &wire::host_port(host),
                Generation(0),
                HostRequest { id, op },
            )
            .await;
        if let Err(e) = sent {
            lock(&self.pending).remove(&id);
            return Err(host_err(format!("request not sent: {}", e.failure)));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(ok))) => Ok(ok),
            Ok(Ok(Err(message))) => Err(host_err(message)),
            Ok(Err(_)) => Err(host_err("allocator closed".into())),
            Err(_) => {
                lock(&self.pending).remove(&id);
                Err(host_err(format!("no reply to {id} within {timeout:?}")))
            }
        }
    }

    fn on_delivery(&self, delivery: Delivery) {
        const REPLY: TypeTag = TypeTag::of::<HostReply>();
        const READY: TypeTag = TypeTag::of::<ProcReady>();
        const EXITED: TypeTag = TypeTag::of::<ProcExited>();
        const LOGS: TypeTag = TypeTag::of::<ProcLogs>();
        const HELLO: TypeTag = TypeTag::of::<HostHello>();
        let sender = delivery.sender.proc.clone();
        let tag = delivery.type_tag;
        if tag == HELLO {
            match delivery.decode::<HostHello>() {
                Ok(hello) => self.on_hello(&sender, hello),
                Err(e) => tracing::warn!(%sender, error = %e, "bad {}", HostHello::TYPE_NAME),
            }
            return;
        }
        if !self.is_host(&sender) {
            tracing::warn!(%sender, type_tag = ?tag, "message from a proc that is not a host agent of this allocator");
            return;
        }
        let host = sender.as_str();
        let bad = |e: regent_net::WireError| tracing::warn!(%sender, error = %e, "bad message from host agent");
        match tag {
            REPLY => match delivery.decode::<HostReply>() {
                Ok(reply) => {
                    let waiter = {
                        let mut pending = lock(&self.pending);
                        match pending.get(&reply.id) {
                            Some((h, _)) if h == &sender => pending.remove(&reply.id),
                            _ => None,
                        }
                    };
                    match waiter {
                        Some((_, tx)) => {
                            let _ = tx.send(reply.outcome);
                        }
                        None => {
                            tracing::debug!(%sender, id = %reply.id, "reply to no pending request")
                        }
                    }
                }
                Err(e) => bad(e),
            },
            READY => match delivery.decode::<ProcReady>() {
                Ok(m) if m.addr.proc == m.proc => {
                    self.endpoint.add_route(m.addr.clone());
                    self.tracker.on_ready(host, &m.proc, m.addr, m.pid);
                }
                Ok(m) => {
                    tracing::warn!(%sender, proc = %m.proc, addr = %m.addr, "ready report with a foreign address")
                }
                Err(e) => bad(e),
            },
            EXITED => match delivery.decode::<ProcExited>() {
                Ok(m) => self
                    .tracker
                    .on_exited(host, &m.proc, m.status, m.last_lines),
                Err(e) => bad(e),
            },
            LOGS => match delivery.decode::<ProcLogs>() {
                Ok(m) => {
                    if m.dropped > 0 {
                        tracing::debug!(%sender, dropped = m.dropped, "the host agent dropped log lines");
                        self.tracker.count_dropped(m.dropped);
                    }
                    for line in m.lines {
                        self.tracker.on_log(Some(host), line);
                    }
                }
                Err(e) => bad(e),
            },
            other => tracing::warn!(%sender, type_tag = ?other, "unknown message from host agent"),
        }
    }

    fn on_hello(&self, sender: &ProcId, hello: HostHello) {
        let notify = {
            let mut table = lock(&self.hosts);
            if hello.addr.proc != *sender || !table.expected.remove(sender) {
                tracing::warn!(%sender, addr = %hello.addr, "unexpected host announcement");
                return;
            }
            table.hellos.clone()
        };
        tracing::info!(host = %hello.addr, hostname = hello.hostname, pid = hello.pid, "host agent announced");
        self.add_host(hello.addr.clone());
        if let Some(tx) = notify {
            let _ = tx.try_send(hello);
        }
    }
}

fn open_alloc_port(endpoint: &Endpoint) -> Result<(ActorId, Inbox), AllocError> {
    let mut last = None;
    for k in 0..MAX_ALLOCATORS_PER_ENDPOINT {
        let me = wire::alloc_actor(endpoint.proc(), k);
        match endpoint.open_port(me.port(0)) {
            Ok(inbox) => return Ok((me, inbox)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || AllocError::Capacity("no allocator port".into()),
        AllocError::Net,
    ))
}

async fn dispatch(shared: Arc<Shared>, mut inbox: Inbox) {
    while let Some(delivery) = inbox.recv().await {
        shared.on_delivery(delivery);
    }
}

async fn renew(shared: Arc<Shared>, mut lease: watch::Receiver<Duration>) {
    loop {
        let current = *lease.borrow_and_update();
        let hosts: Vec<ProcId> = lock(&shared.hosts)
            .hosts
            .iter()
            .filter(|h| h.lost.is_none())
            .map(|h| h.addr.proc.clone())
            .collect();
        for host in hosts {
            if let Err(e) = shared.endpoint.try_send(
                &shared.me,
                &wire::host_port(&host),
                Generation(0),
                Renew { lease: current },
            ) {
                tracing::warn!(%host, failure = %e.failure, "lease renewal not sent");
            }
        }
        let period = (current / 3).max(Duration::from_millis(10));
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            changed = lease.changed() => if changed.is_err() { break },
        }
    }
}

impl Allocator for HostAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        Box::pin(self.allocate_inner(boots))
    }

    fn stop(&self, proc: &ProcId, grace: Duration) -> AllocFuture<'_, ProcStatus> {
        Box::pin(self.stop_inner(proc.clone(), grace))
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        let proc = proc.clone();
        Box::pin(async move {
            let host = self
                .shared
                .tracker
                .host_of(&proc)
                .ok_or_else(|| AllocError::UnknownProc(proc.clone()))?;
            let host = ProcId::new(&host).map_err(regent_net::Error::from)?;
            self.request(&host, HostOp::Signal { proc, signal })
                .await
                .map(|_| ())
        })
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        self.shared.tracker.take_events()
    }

    fn take_logs(&self) -> Option<mpsc::Receiver<crate::logs::LogLine>> {
        self.shared.tracker.take_logs()
    }
    fn transport_event(&self, event: &regent_net::TransportEvent) {
        self.handle_transport_event(event);
    }
}
