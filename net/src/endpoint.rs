//! The endpoint of a proc: one quinn endpoint (one UDP socket) that both
//! listens and dials, the proc's ports (inboxes), its routes to other procs,
//! and the send path (local fast path or an outbound session).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use bytes::Bytes;
use quinn::{IdleTimeout, VarInt};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::config::EndpointConfig;
use crate::error::{Error, SendError, SendFailure, Undeliverable};
use crate::event::TransportEvent;
use crate::fxhash::FxHashMap;
use crate::id::{
    ActorId, Generation, Incarnation, Message, PortId, ProcAddr, ProcId, Seq, TypeTag,
};
use crate::link::code;
use crate::tls::{ProcCredentials, Role, crypto_provider};
use crate::wire::{self, Envelope, RejectCause};

pub(crate) mod inbound;
pub(crate) mod inbox;
pub(crate) mod outbound;

use inbound::InboundPeers;
use inbox::{Delivery, Inbox, Payload};
use outbound::{Outgoing, Session};

/// Locks a std mutex, recovering from poison: the maps behind these locks
/// hold no invariant that a panicking holder could break half-way.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A port's entry: where deliveries go, and its fence.
#[derive(Clone)]
pub(crate) struct PortEntry {
    pub(crate) tx: mpsc::Sender<Delivery>,
    pub(crate) fence: Arc<AtomicU64>,
}

/// Why [`Inner::try_deliver_remote`] did not deliver.
pub(crate) enum Delivering {
    /// The message is refused.
    Rejected(RejectCause),
    /// The inbox is full: the delivery waits for room in it (boxed: the
    /// rare case, kept out of every delivery's result).
    Full(mpsc::Sender<Delivery>, Box<Delivery>),
}

/// State shared by an endpoint's handles and tasks.
pub(crate) struct Inner {
    pub(crate) proc: ProcId,
    pub(crate) incarnation: Incarnation,
    pub(crate) config: EndpointConfig,
    pub(crate) quic: quinn::Endpoint,
    /// The role of this proc's certificate (renewals keep it).
    pub(crate) role: Role,
    /// The configs of the current credentials, replaced on renewal.
    client_config: Mutex<quinn::ClientConfig>,
    not_after: Mutex<SystemTime>,
    transport: Arc<quinn::TransportConfig>,
    /// Slots of incoming connections in their handshake.
    pub(crate) handshakes: Arc<Semaphore>,
    /// Validated connection attempts waiting for a slot.
    pub(crate) pending_handshakes: AtomicUsize,
    local_addr: SocketAddr,
    pub(crate) advertised: SocketAddr,
    routes: Mutex<HashMap<ProcId, SocketAddr>>,
    ports: Mutex<HashMap<PortId, PortEntry>>,
    pub(crate) sessions: Mutex<FxHashMap<ProcId, Arc<Session>>>,
    pub(crate) inbound: InboundPeers,
    events_tx: mpsc::Sender<TransportEvent>,
    events_rx: Mutex<Option<mpsc::Receiver<TransportEvent>>>,
    dropped_events: AtomicU64,
    /// Message frames and their bytes, sent and received.
    pub(crate) traffic: TrafficCounters,
    next_pair_epoch: AtomicU64,
    pub(crate) shutdown: watch::Sender<bool>,
    /// The runtime the endpoint was bound on, where all its tasks run. A
    /// send may come from another runtime (a member's, which ends with the
    /// member); what it starts (a link, a pair's stream) must not end with
    /// it.
    runtime: tokio::runtime::Handle,
}

impl Inner {
    /// Starts one of the endpoint's tasks on its own runtime.
    pub(crate) fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.spawn(task)
    }

    /// Reports an event; never waits. Events past the channel's capacity are
    /// counted and logged.
    pub(crate) fn emit(&self, event: TransportEvent) {
        tracing::debug!(proc = %self.proc, ?event, "transport event");
        match self.events_tx.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(event)) => {
                let n = self.dropped_events.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(proc = %self.proc, dropped = n, ?event, "event channel full; events dropped");
                }
            }
            // Nobody listens any more: the owner dropped the receiver.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Reports messages that came back.
    pub(crate) fn give_back(&self, items: Vec<Outgoing>, cause: crate::error::UndeliveredCause) {
        for item in items {
            tracing::debug!(proc = %self.proc, receiver = %item.envelope.receiver, seq = item.envelope.seq.0, %cause, "undeliverable");
            self.emit(TransportEvent::Undeliverable(Undeliverable {
                envelope: item.envelope,
                cause: cause.clone(),
            }));
        }
    }

    /// The client config of the current credentials.
    pub(crate) fn client_config(&self) -> quinn::ClientConfig {
        lock(&self.client_config).clone()
    }

    /// Incoming connections now in their handshake.
    pub(crate) fn handshakes_in_flight(&self) -> usize {
        self.config
            .max_handshakes
            .get()
            .saturating_sub(self.handshakes.available_permits())
    }

    pub(crate) fn route(&self, proc: &ProcId) -> Option<SocketAddr> {
        lock(&self.routes).get(proc).copied()
    }

    /// Learns a peer's listening address from its `Hello`: kept unless a
    /// route was set, replaced when the peer restarted.
    pub(crate) fn learn_route(&self, proc: &ProcId, addr: SocketAddr, restarted: bool) {
        let mut routes = lock(&self.routes);
        if restarted || !routes.contains_key(proc) {
            routes.insert(proc.clone(), addr);
        }
    }

    pub(crate) fn next_pair_epoch(&self) -> u64 {
        self.next_pair_epoch.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn port(&self, port: &PortId) -> Option<PortEntry> {
        lock(&self.ports).get(port).cloned()
    }

    pub(crate) fn close_port(&self, port: &PortId, fence: &Arc<AtomicU64>) {
        let mut ports = lock(&self.ports);
        if ports
            .get(port)
            .is_some_and(|e| Arc::ptr_eq(&e.fence, fence))
        {
            ports.remove(port);
        }
    }

    /// Delivers a message from another proc to its port's inbox if there is
    /// room (the rule), else gives back the delivery and the inbox to wait
    /// on. Not a future: the caller's own state holds the message only
    /// while an inbox is full, so the usual delivery copies nothing into a
    /// future, and the port's sender is borrowed from the cache, not cloned.
    pub(crate) fn try_deliver_remote(
        &self,
        envelope: Envelope,
        sender_role: Role,
        cache: &mut Option<(PortId, PortEntry)>,
    ) -> Result<(), Delivering> {
        let entry = match cache {
            Some((port, entry)) if *port == envelope.receiver && !entry.tx.is_closed() => entry,
            _ => {
                let entry = self
                    .port(&envelope.receiver)
                    .ok_or(Delivering::Rejected(RejectCause::NoSuchPort))?;
                &cache.insert((envelope.receiver.clone(), entry)).1
            }
        };
        let fence = Generation(entry.fence.load(Ordering::Acquire));
        if envelope.generation < fence {
            return Err(Delivering::Rejected(RejectCause::Fenced { fence }));
        }
        let delivery = Delivery {
            sender: envelope.sender,
            sender_role,
            receiver: envelope.receiver,
            seq: envelope.seq,
            generation: envelope.generation,
            type_tag: envelope.type_tag,
            payload: Payload::Wire(envelope.payload),
        };
        match entry.tx.try_send(delivery) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(delivery)) => {
                Err(Delivering::Full(entry.tx.clone(), Box::new(delivery)))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(Delivering::Rejected(RejectCause::NoSuchPort))
            }
        }
    }

    fn shutdown_now(&self) {
        if self.shutdown.send_replace(true) {
            return;
        }
        tracing::debug!(proc = %self.proc, "endpoint closing");
        self.quic.close(code::SHUTDOWN, b"endpoint closed");
        // Inboxes end (their receivers wake) in port order, not the map's
        // random order, so a simulated shutdown replays.
        let mut ports: Vec<(PortId, PortEntry)> = lock(&self.ports).drain().collect();
        ports.sort_by(|(a, _), (b, _)| a.cmp(b));
        drop(ports);
    }
}

/// The message frames an endpoint has sent and received on the network
/// ([`Endpoint::traffic`]): each message once, counted with its whole frame
/// (length prefix, envelope, payload) as it enters its pair's send window
/// and as it arrives for delivery the first time (duplicates after a
/// reconnect are not counted again). Local deliveries, acknowledgements,
/// handshakes and QUIC's own overhead are not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ControlTraffic {
    /// Message frames sent.
    pub frames_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Message frames received.
    pub frames_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
}

impl ControlTraffic {
    /// Whether every count of `self` is at least `earlier`'s (counts only
    /// grow).
    pub fn covers(&self, earlier: &Self) -> bool {
        self.frames_sent >= earlier.frames_sent
            && self.bytes_sent >= earlier.bytes_sent
            && self.frames_received >= earlier.frames_received
            && self.bytes_received >= earlier.bytes_received
    }
}

/// The live counts of [`ControlTraffic`] (relaxed: one `fetch_add` per
/// count per message).
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    frames_sent: AtomicU64,
    bytes_sent: AtomicU64,
    frames_received: AtomicU64,
    bytes_received: AtomicU64,
}

impl TrafficCounters {
    pub(crate) fn sent(&self, frame_bytes: usize) {
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent
            .fetch_add(frame_bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn received(&self, frame_bytes: usize) {
        self.frames_received.fetch_add(1, Ordering::Relaxed);
        self.bytes_received
            .fetch_add(frame_bytes as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ControlTraffic {
        ControlTraffic {
            frames_sent: self.frames_sent.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            frames_received: self.frames_received.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
        }
    }
}

/// Incoming handshakes of an endpoint ([`Endpoint::handshake_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeStats {
    /// Connections in their handshake now (at most `max_handshakes`).
    pub in_flight: usize,
    /// Validated attempts waiting for a slot now (at most
    /// `max_pending_handshakes`).
    pub pending: usize,
    /// Attempts answered with a stateless Retry since the endpoint started.
    pub retried: u64,
    /// Attempts refused for want of a slot since the endpoint started.
    pub refused: u64,
}

/// A send after its checks: a local delivery, or a remote message with its
/// encoded payload.
enum Prepared<M> {
    Local(Delivery),
    Remote(M, Bytes),
}

/// A send done at once, or the wait for room it needs.
enum Attempt<'a, M> {
    Done(Result<(), SendError<M>>),
    Wait(std::pin::Pin<Box<dyn Future<Output = Result<(), SendError<M>>> + Send + 'a>>),
}

/// Gives an encoded payload back from its delivery.
fn wire_back(delivery: Delivery, failure: SendFailure) -> SendError<Bytes> {
    let message = match delivery.payload {
        Payload::Wire(bytes) => bytes,
        Payload::Local(_) => unreachable!("encoded payloads are delivered as wire bytes"),
    };
    SendError { message, failure }
}

/// Gives a local message back: the delivery was built from an `M`.
fn give_back_local<M: Message>(delivery: Delivery, failure: SendFailure) -> SendError<M> {
    let message = match delivery.payload {
        Payload::Local(any) => match any.downcast::<M>() {
            Ok(m) => *m,
            Err(_) => unreachable!("local deliveries are boxed from the sent M"),
        },
        Payload::Wire(_) => unreachable!("sends of an M build local payloads"),
    };
    SendError { message, failure }
}

/// Closes the endpoint when the last [`Endpoint`] handle goes.
struct CloseOnDrop(Arc<Inner>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.shutdown_now();
    }
}

/// A proc's endpoint on the control plane. Cheap to clone; the endpoint
/// closes when the last clone is dropped or [`Endpoint::close`] is called.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
    _close: Arc<CloseOnDrop>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("proc", &self.inner.proc)
            .field("incarnation", &self.inner.incarnation)
            .field("local_addr", &self.inner.local_addr)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Binds a UDP socket at `addr` and starts the endpoint of the proc named
    /// by `credentials`. Must be called within a tokio runtime: the
    /// endpoint's tasks (its links, and every pair's stream, whichever
    /// runtime the send that opened it came from) run on it.
    pub fn bind(
        credentials: ProcCredentials,
        addr: SocketAddr,
        config: EndpointConfig,
    ) -> Result<Self, Error> {
        config.validate()?;
        let socket = std::net::UdpSocket::bind(addr).map_err(io("bind UDP socket"))?;
        let state =
            quinn_udp::UdpSocketState::new((&socket).into()).map_err(io("UDP socket state"))?;
        for (what, result) in [
            (
                "receive",
                state.set_recv_buffer_size((&socket).into(), config.udp_buffer_bytes),
            ),
            (
                "send",
                state.set_send_buffer_size((&socket).into(), config.udp_buffer_bytes),
            ),
        ] {
            if let Err(e) = result {
                tracing::warn!(bytes = config.udp_buffer_bytes, error = %e, "cannot set UDP {what} buffer size");
            }
        }

        let quic = |server_config| {
            quinn::Endpoint::new(
                quinn::EndpointConfig::default(),
                Some(server_config),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
        };
        Self::start(credentials, config, random_incarnation()?, quic)
    }

    /// Starts the endpoint of the proc named by `credentials` on the
    /// simulated network `net`, at `addr` (one simulated host): the real
    /// quinn endpoint and rustls mutual TLS, over [`crate::sim::SimSocket`].
    /// quinn's generator and the incarnation are drawn from the network's
    /// seed, so a run replays from it (see [`crate::sim`]). Must be called
    /// within the (current-thread, paused-clock) runtime the simulation runs
    /// on.
    #[cfg(feature = "sim")]
    pub fn bind_sim(
        credentials: ProcCredentials,
        net: &crate::sim::SimNet,
        addr: SocketAddr,
        config: EndpointConfig,
    ) -> Result<Self, Error> {
        config.validate()?;
        let socket = net.bind(addr).map_err(io("bind simulated UDP socket"))?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config.rng_seed(Some(net.random_seed()));
        let incarnation = Incarnation(net.random_u64());
        let quic = |server_config| {
            quinn::Endpoint::new_with_abstract_socket(
                endpoint_config,
                Some(server_config),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
        };
        Self::start(credentials, config, incarnation, quic)
    }

    /// What both `bind`s share once they have a socket: the QUIC configs,
    /// the quinn endpoint (made by `quic` from the server config), the
    /// state, and the accept loop.
    fn start(
        credentials: ProcCredentials,
        config: EndpointConfig,
        incarnation: Incarnation,
        quic: impl FnOnce(quinn::ServerConfig) -> std::io::Result<quinn::Endpoint>,
    ) -> Result<Self, Error> {
        let transport = Arc::new(transport_config(&config)?);
        let (server_config, client_config) = quic_configs(&credentials, &config, &transport)?;
        let quic = quic(server_config).map_err(io("start QUIC endpoint"))?;
        let local_addr = quic.local_addr().map_err(io("local address"))?;
        let (events_tx, events_rx) = mpsc::channel(config.event_buffer.get());
        let inner = Arc::new(Inner {
            proc: credentials.proc().clone(),
            incarnation,
            advertised: config.advertised_addr.unwrap_or(local_addr),
            handshakes: Arc::new(Semaphore::new(config.max_handshakes.get())),
            pending_handshakes: AtomicUsize::new(0),
            config,
            quic,
            role: credentials.role(),
            client_config: Mutex::new(client_config),
            not_after: Mutex::new(credentials.not_after()),
            transport,
            local_addr,
            routes: Mutex::default(),
            ports: Mutex::default(),
            sessions: Mutex::default(),
            inbound: InboundPeers::default(),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
            dropped_events: AtomicU64::new(0),
            traffic: TrafficCounters::default(),
            next_pair_epoch: AtomicU64::new(1),
            shutdown: watch::Sender::new(false),
            runtime: tokio::runtime::Handle::current(),
        });
        tracing::info!(proc = %inner.proc, role = %inner.role, incarnation = %inner.incarnation, addr = %local_addr, "endpoint bound");
        inner.spawn(inbound::accept_loop(inner.clone()));
        Ok(Self {
            _close: Arc::new(CloseOnDrop(inner.clone())),
            inner,
        })
    }

    /// This proc.
    pub fn proc(&self) -> &ProcId {
        &self.inner.proc
    }

    /// This run of the proc.
    pub fn incarnation(&self) -> Incarnation {
        self.inner.incarnation
    }

    /// The role of this proc's certificate.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// When this proc's certificate expires: peers close its links then and
    /// refuse new ones, unless [`Self::renew_credentials`] installed a new
    /// one before.
    pub fn credentials_not_after(&self) -> SystemTime {
        *lock(&self.inner.not_after)
    }

    /// Replaces this proc's certificate (and key) with a newer one of the
    /// same proc and role, e.g. issued again by the CA before the old one
    /// expires. New connections, both ways, present the new certificate at
    /// once; links up now keep going until the old certificate expires,
    /// when peers close them and they are redialed with the new one (as any
    /// failed link: messages are kept and resumed).
    pub fn renew_credentials(&self, credentials: ProcCredentials) -> Result<(), Error> {
        if *credentials.proc() != self.inner.proc || credentials.role() != self.inner.role {
            return Err(Error::Config(format!(
                "renewal with the credentials of {} ({}) for {} ({})",
                credentials.proc(),
                credentials.role(),
                self.inner.proc,
                self.inner.role
            )));
        }
        let (server, client) =
            quic_configs(&credentials, &self.inner.config, &self.inner.transport)?;
        self.inner.quic.set_server_config(Some(server));
        *lock(&self.inner.client_config) = client;
        *lock(&self.inner.not_after) = credentials.not_after();
        tracing::info!(proc = %self.inner.proc, not_after = ?credentials.not_after(), "credentials renewed");
        Ok(())
    }

    /// The role of `peer`'s certificate, as verified on its latest
    /// connection to or from this endpoint; `None` if none was made.
    pub fn peer_role(&self, peer: &ProcId) -> Option<Role> {
        self.inner.inbound.role(peer).or_else(|| {
            let session = lock(&self.inner.sessions).get(peer).cloned();
            session.and_then(|s| s.peer_role())
        })
    }

    /// Where incoming handshakes stand: how many are in flight and waiting
    /// now, and how many attempts were sent a Retry or refused so far.
    pub fn handshake_stats(&self) -> HandshakeStats {
        let (retried, refused) = self.inner.inbound.admission_counts();
        HandshakeStats {
            in_flight: self.inner.handshakes_in_flight(),
            pending: self.inner.pending_handshakes.load(Ordering::Relaxed),
            retried,
            refused,
        }
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The address peers should dial (the advertised or bound address).
    pub fn addr(&self) -> ProcAddr {
        ProcAddr {
            socket: self.inner.advertised,
            proc: self.inner.proc.clone(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.inner.config
    }

    /// Tells the endpoint where a proc listens (replacing what it knew).
    /// Routes to procs that dialed this one are learned from their `Hello`.
    pub fn add_route(&self, addr: ProcAddr) {
        lock(&self.inner.routes).insert(addr.proc, addr.socket);
    }

    /// Adds a route to a proc unless one is known: for addresses from a
    /// less trusted source than the one that set the known route (a relay's
    /// unsigned hops), which must not move it.
    pub fn add_route_if_unknown(&self, addr: ProcAddr) {
        lock(&self.inner.routes)
            .entry(addr.proc)
            .or_insert(addr.socket);
    }

    /// Forgets the route to a proc.
    pub fn remove_route(&self, proc: &ProcId) {
        lock(&self.inner.routes).remove(proc);
    }

    /// Opens an inbox at `port` (a port of an actor of this proc).
    pub fn open_port(&self, port: PortId) -> Result<Inbox, Error> {
        if *port.proc() != self.inner.proc {
            return Err(Error::Config(format!(
                "port {port} is not in proc {}",
                self.inner.proc
            )));
        }
        if *self.inner.shutdown.borrow() {
            return Err(Error::Config("endpoint closed".into()));
        }
        let mut ports = lock(&self.inner.ports);
        if ports.contains_key(&port) {
            return Err(Error::Config(format!("port {port} is already open")));
        }
        let (tx, rx) = mpsc::channel(self.inner.config.inbox_messages.get());
        let fence = Arc::new(AtomicU64::new(0));
        ports.insert(
            port.clone(),
            PortEntry {
                tx,
                fence: fence.clone(),
            },
        );
        Ok(Inbox {
            port,
            rx,
            fence,
            endpoint: self.inner.clone(),
        })
    }

    /// The event stream; `Some` only the first time.
    pub fn take_events(&self) -> Option<mpsc::Receiver<TransportEvent>> {
        lock(&self.inner.events_rx).take()
    }

    /// Messages to `peer` accepted and not yet acknowledged (kept for resume
    /// or waiting for buffer space to be written).
    pub fn unacknowledged(&self, peer: &ProcId) -> usize {
        let session = lock(&self.inner.sessions).get(peer).cloned();
        session.map_or(0, |s| s.unacknowledged())
    }

    /// Pairs (sender actor, receiver actor) with a stream open to `peer`.
    pub fn open_pairs(&self, peer: &ProcId) -> usize {
        let session = lock(&self.inner.sessions).get(peer).cloned();
        session.map_or(0, |s| s.open_pairs())
    }

    /// The message frames this endpoint has sent and received on the
    /// network so far.
    pub fn traffic(&self) -> ControlTraffic {
        self.inner.traffic.snapshot()
    }

    /// Events dropped because the event channel was full.
    pub fn dropped_events(&self) -> u64 {
        self.inner.dropped_events.load(Ordering::Relaxed)
    }

    /// Sends `message` from `from` (an actor of this proc) to `to`, waiting
    /// while the pair's send buffer (or a local inbox) is full. `Ok` means
    /// accepted: a remote message that later cannot be delivered comes back
    /// as [`TransportEvent::Undeliverable`].
    pub async fn send<M: Message>(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        message: M,
    ) -> Result<(), SendError<M>> {
        // Room in the buffer is the rule: only a send that must wait keeps
        // its wait (a kilobyte of state, with the message) on the heap,
        // rather than every send's future, which callers box and move.
        let wait = match self.send_or_wait(from, to, generation, message) {
            Attempt::Done(sent) => return sent,
            Attempt::Wait(wait) => wait,
        };
        wait.await
    }

    /// [`Self::send`] when it need not wait; else the wait.
    fn send_or_wait<'a, M: Message>(
        &'a self,
        from: &'a ActorId,
        to: &'a PortId,
        generation: Generation,
        message: M,
    ) -> Attempt<'a, M> {
        let prepared = match self.prepare(from, to, generation, message) {
            Ok(p) => p,
            Err(e) => return Attempt::Done(Err(e)),
        };
        match prepared {
            Prepared::Local(delivery) => self.local_or_wait(delivery, give_back_local::<M>),
            Prepared::Remote(message, payload) => {
                let tag = TypeTag::of::<M>();
                self.remote_or_wait(from, to, generation, tag, payload, message)
            }
        }
    }

    /// A remote send of an encoded payload done at once, or its wait for
    /// room; `message` is what a failure gives back.
    fn remote_or_wait<'a, M: Send + 'a>(
        &'a self,
        from: &'a ActorId,
        to: &'a PortId,
        generation: Generation,
        tag: TypeTag,
        payload: Bytes,
        message: M,
    ) -> Attempt<'a, M> {
        match outbound::attempt(&self.inner, from, to, generation, tag, &payload) {
            outbound::Attempted::Done(sent) => {
                Attempt::Done(sent.map_err(|failure| SendError { message, failure }))
            }
            outbound::Attempted::Full(pair) => Attempt::Wait(Box::pin(async move {
                outbound::enqueue_on(&self.inner, pair, from, to, generation, tag, payload)
                    .await
                    .map_err(|failure| SendError { message, failure })
            })),
        }
    }

    /// Like [`Self::send`], for a sender that does not want the message back
    /// on failure: it is encoded at once and only its bytes are kept, so the
    /// future stays small however large the message (a caller that moves
    /// its future through layers of its own copies it at each). A local
    /// receiver gets it as [`Payload::Wire`], as from [`Self::send_raw`].
    pub async fn send_ref<M: Message>(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        message: &M,
    ) -> Result<(), SendFailure> {
        if from.proc != self.inner.proc {
            return Err(SendFailure::ForeignSender(from.proc.clone()));
        }
        let payload = wire::encode_payload(message)?;
        let tag = TypeTag::of::<M>();
        // Nothing is given back, so the payload is not kept for a failure.
        let attempt = if *to.proc() == self.inner.proc {
            let delivery = self.wire_delivery(from, to, generation, tag, payload);
            self.local_or_wait(delivery, |_, failure| SendError {
                message: (),
                failure,
            })
        } else {
            self.remote_or_wait(from, to, generation, tag, payload, ())
        };
        let sent = match attempt {
            Attempt::Done(sent) => sent,
            Attempt::Wait(wait) => wait.await,
        };
        sent.map_err(|e| e.failure)
    }

    /// A local delivery of an encoded payload.
    fn wire_delivery(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        type_tag: TypeTag,
        payload: Bytes,
    ) -> Delivery {
        Delivery {
            sender: from.clone(),
            sender_role: self.inner.role,
            receiver: to.clone(),
            seq: Seq(0),
            generation,
            type_tag,
            payload: Payload::Wire(payload),
        }
    }

    /// A local delivery put in its inbox at once, or its wait for room;
    /// `back` gives a failed delivery's message back.
    fn local_or_wait<'a, M: Send + 'a>(
        &'a self,
        delivery: Delivery,
        back: fn(Delivery, SendFailure) -> SendError<M>,
    ) -> Attempt<'a, M> {
        let entry = match self.local_port(&delivery) {
            Ok(entry) => entry,
            Err(failure) => return Attempt::Done(Err(back(delivery, failure))),
        };
        match entry.tx.try_send(delivery) {
            Ok(()) => Attempt::Done(Ok(())),
            Err(mpsc::error::TrySendError::Full(delivery)) => Attempt::Wait(Box::pin(async move {
                entry.tx.send(delivery).await.map_err(|e| {
                    let port = e.0.receiver.clone();
                    back(e.0, SendFailure::NoSuchPort(port))
                })
            })),
            Err(mpsc::error::TrySendError::Closed(d)) => {
                let port = d.receiver.clone();
                Attempt::Done(Err(back(d, SendFailure::NoSuchPort(port))))
            }
        }
    }

    /// Like [`Self::send`] but fails with [`SendFailure::Full`] instead of
    /// waiting.
    pub fn try_send<M: Message>(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        message: M,
    ) -> Result<(), SendError<M>> {
        match self.prepare(from, to, generation, message)? {
            Prepared::Local(delivery) => match self.local_port(&delivery) {
                Ok(entry) => entry.tx.try_send(delivery).map_err(|e| match e {
                    mpsc::error::TrySendError::Full(d) => give_back_local(d, SendFailure::Full),
                    mpsc::error::TrySendError::Closed(d) => {
                        let port = d.receiver.clone();
                        give_back_local(d, SendFailure::NoSuchPort(port))
                    }
                }),
                Err(failure) => Err(give_back_local(delivery, failure)),
            },
            Prepared::Remote(message, payload) => outbound::try_enqueue(
                &self.inner,
                from,
                to,
                generation,
                TypeTag::of::<M>(),
                &payload,
            )
            .map_err(|failure| SendError { message, failure }),
        }
    }

    /// Sends an already encoded payload of type `type_tag` (forwarding). A
    /// local receiver gets it as [`Payload::Wire`].
    pub async fn send_raw(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        type_tag: TypeTag,
        payload: Bytes,
    ) -> Result<(), SendError<Bytes>> {
        if from.proc != self.inner.proc {
            return Err(SendError {
                message: payload,
                failure: SendFailure::ForeignSender(from.proc.clone()),
            });
        }
        let attempt = if *to.proc() == self.inner.proc {
            let delivery = self.wire_delivery(from, to, generation, type_tag, payload);
            self.local_or_wait(delivery, wire_back)
        } else {
            self.remote_or_wait(from, to, generation, type_tag, payload.clone(), payload)
        };
        match attempt {
            Attempt::Done(sent) => sent,
            Attempt::Wait(wait) => wait.await,
        }
    }

    /// Checks the sender and either builds the local delivery (the value,
    /// unencoded) or encodes the payload for a remote send.
    fn prepare<M: Message>(
        &self,
        from: &ActorId,
        to: &PortId,
        generation: Generation,
        message: M,
    ) -> Result<Prepared<M>, SendError<M>> {
        if from.proc != self.inner.proc {
            return Err(SendError {
                message,
                failure: SendFailure::ForeignSender(from.proc.clone()),
            });
        }
        if *to.proc() == self.inner.proc {
            return Ok(Prepared::Local(Delivery {
                sender: from.clone(),
                sender_role: self.inner.role,
                receiver: to.clone(),
                seq: Seq(0),
                generation,
                type_tag: TypeTag::of::<M>(),
                payload: Payload::Local(Box::new(message)),
            }));
        }
        match wire::encode_payload(&message) {
            Ok(payload) => Ok(Prepared::Remote(message, payload)),
            Err(e) => Err(SendError {
                message,
                failure: e.into(),
            }),
        }
    }

    /// The open, unfenced local port a delivery goes to.
    fn local_port(&self, delivery: &Delivery) -> Result<PortEntry, SendFailure> {
        let entry = self
            .inner
            .port(&delivery.receiver)
            .ok_or_else(|| SendFailure::NoSuchPort(delivery.receiver.clone()))?;
        let fence = Generation(entry.fence.load(Ordering::Acquire));
        if delivery.generation < fence {
            return Err(SendFailure::Fenced { fence });
        }
        Ok(entry)
    }

    /// Closes the endpoint: every connection closes, kept messages come back
    /// as undeliverable, inboxes end.
    pub fn close(&self) {
        self.inner.shutdown_now();
    }

    /// Waits until the closed endpoint's connections have told their peers.
    pub async fn wait_idle(&self) {
        self.inner.quic.wait_idle().await;
    }
}

/// Wraps an I/O error with what was being done.
fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io {
        context,
        path: None,
        source,
    }
}

/// A fresh incarnation, drawn from the crypto provider's generator.
fn random_incarnation() -> Result<Incarnation, Error> {
    let mut random = [0u8; 8];
    crypto_provider()
        .secure_random
        .fill(&mut random)
        .map_err(|e| Error::Tls {
            context: "random incarnation",
            reason: format!("{e:?}"),
        })?;
    Ok(Incarnation(u64::from_le_bytes(random)))
}

/// The quinn server and client configs of `credentials`, with the
/// endpoint's transport and its bounds on incoming connection attempts.
fn quic_configs(
    credentials: &ProcCredentials,
    config: &EndpointConfig,
    transport: &Arc<quinn::TransportConfig>,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), Error> {
    let mut server = credentials.quic_server_config()?;
    server.transport_config(transport.clone());
    server.max_incoming(config.max_pending_handshakes.get());
    server.incoming_buffer_size(INCOMING_BUFFER_BYTES);
    server.incoming_buffer_size_total(INCOMING_BUFFER_TOTAL_BYTES);
    let mut client = credentials.quic_client_config()?;
    client.transport_config(transport.clone());
    Ok((server, client))
}

/// Datagrams quinn buffers for one connection attempt not yet taken up
/// (besides its first), and for all of them together; more are dropped
/// (and retransmitted by the dialer).
const INCOMING_BUFFER_BYTES: u64 = 16 << 10;
const INCOMING_BUFFER_TOTAL_BYTES: u64 = 4 << 20;

fn transport_config(config: &EndpointConfig) -> Result<quinn::TransportConfig, Error> {
    let mut t = quinn::TransportConfig::default();
    // One control stream besides the data streams.
    let streams = config.max_streams_per_peer.saturating_add(1);
    t.max_concurrent_bidi_streams(VarInt::from_u32(streams));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.stream_receive_window(VarInt::from_u32(config.stream_window_bytes));
    let connection_window = u64::from(config.stream_window_bytes) * u64::from(streams);
    t.receive_window(VarInt::from_u64(connection_window).unwrap_or(VarInt::MAX));
    t.send_window(connection_window);
    t.keep_alive_interval(Some(config.heartbeat_interval));
    t.max_idle_timeout(Some(
        IdleTimeout::try_from(config.failure_timeout).map_err(|_| {
            Error::Config(format!(
                "failure_timeout {:?} too long",
                config.failure_timeout
            ))
        })?,
    ));
    t.datagram_receive_buffer_size(None);
    if config.quic_ack_threshold_packets > 1 {
        // Ask the peer (QUIC ACK frequency extension) for fewer ACK-only
        // packets: with one connection per direction, ACKs cannot ride on
        // replies, and each costs both procs a wakeup.
        let mut ack = quinn::AckFrequencyConfig::default();
        ack.ack_eliciting_threshold(VarInt::from_u32(config.quic_ack_threshold_packets - 1));
        ack.max_ack_delay(Some(config.ack_delay));
        t.ack_frequency_config(Some(ack));
    }
    Ok(t)
}
