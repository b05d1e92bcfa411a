//! A UDP chaos proxy in front of one node's QUIC endpoint.
//!
//! The proxy listens on its own socket; the allocator hands its address out
//! as the node's address, so every other node reaches this one only through
//! it. Like a NAT, it gives each client (a source socket) its own upstream
//! socket, so the node sees one stable peer address per client and answers
//! through the proxy: both directions of every connection to the node pass
//! here. (QUIC servers do not migrate, and the clients' addresses as the
//! node sees them never change, so no path validation goes around it.)
//!
//! Each datagram gets the [`Verdict`] of the [`Network`] for its directed
//! link — cut, or passed through drop, duplicate, reorder, delay with
//! jitter and a bandwidth cap — decided with the proxy's seeded generator.
//! Delayed datagrams wait in one bounded timer heap per proxy.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::ChaosError;
use crate::network::{LinkFaults, Network, NodeId, Verdict};
use crate::rng::{Seed, SimRng};

/// The largest UDP datagram.
const MAX_DATAGRAM_BYTES: usize = 65_535;

/// How a proxy is set up, with documented defaults.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The IP the proxy listens on and sends from. Default 127.0.0.1.
    pub bind_ip: IpAddr,
    /// Clients (source sockets) served at once; a datagram from one more is
    /// dropped. Default 1024.
    pub max_clients: usize,
    /// A client silent this long (both ways) is forgotten. Default 120 s.
    pub client_idle_timeout: Duration,
    /// Datagrams waiting for their delay at once; past it they are dropped.
    /// Default 16384.
    pub max_delayed_datagrams: usize,
    /// Backlog a bandwidth cap may build before datagrams are dropped.
    /// Default 1 s.
    pub max_queue_delay: Duration,
    /// How long a reordered datagram is held back. Default 20 ms.
    pub reorder_hold: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            max_clients: 1024,
            client_idle_timeout: Duration::from_secs(120),
            max_delayed_datagrams: 16_384,
            max_queue_delay: Duration::from_secs(1),
            reorder_hold: Duration::from_millis(20),
        }
    }
}

impl ProxyConfig {
    /// Sets the IP to listen on.
    pub fn bind_ip(mut self, ip: IpAddr) -> Self {
        self.bind_ip = ip;
        self
    }

    /// Sets the client limit.
    pub fn max_clients(mut self, n: usize) -> Self {
        self.max_clients = n;
        self
    }

    /// Sets the idle timeout of clients.
    pub fn client_idle_timeout(mut self, timeout: Duration) -> Self {
        self.client_idle_timeout = timeout;
        self
    }

    /// Sets the bound on delayed datagrams.
    pub fn max_delayed_datagrams(mut self, n: usize) -> Self {
        self.max_delayed_datagrams = n;
        self
    }

    /// Sets the backlog limit of bandwidth caps.
    pub fn max_queue_delay(mut self, d: Duration) -> Self {
        self.max_queue_delay = d;
        self
    }

    /// Sets how long reordered datagrams are held.
    pub fn reorder_hold(mut self, d: Duration) -> Self {
        self.reorder_hold = d;
        self
    }
}

/// What a proxy did, counted in datagrams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyCounts {
    /// Sent on (each copy of a duplicate counts).
    pub forwarded: u64,
    /// Dropped by a cut link (partition, isolation).
    pub cut: u64,
    /// Dropped by a drop probability.
    pub lost: u64,
    /// Dropped for lack of room (bandwidth backlog, delay heap, socket
    /// buffer, client limit).
    pub overflowed: u64,
    /// Sent twice.
    pub duplicated: u64,
    /// Held back to be overtaken.
    pub reordered: u64,
    /// Delayed (by a delay, jitter, reordering or bandwidth cap).
    pub delayed: u64,
    /// Delayed by a link's delay or jitter (a part of `delayed`).
    pub slowed: u64,
    /// Paced by a bandwidth cap (a part of `delayed`; dropped ones count in
    /// `overflowed`).
    pub throttled: u64,
}

impl std::ops::Add for ProxyCounts {
    type Output = Self;

    fn add(self, o: Self) -> Self {
        Self {
            forwarded: self.forwarded + o.forwarded,
            cut: self.cut + o.cut,
            lost: self.lost + o.lost,
            overflowed: self.overflowed + o.overflowed,
            duplicated: self.duplicated + o.duplicated,
            reordered: self.reordered + o.reordered,
            delayed: self.delayed + o.delayed,
            slowed: self.slowed + o.slowed,
            throttled: self.throttled + o.throttled,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    forwarded: AtomicU64,
    cut: AtomicU64,
    lost: AtomicU64,
    overflowed: AtomicU64,
    duplicated: AtomicU64,
    reordered: AtomicU64,
    delayed: AtomicU64,
    slowed: AtomicU64,
    throttled: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ProxyCounts {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ProxyCounts {
            forwarded: g(&self.forwarded),
            cut: g(&self.cut),
            lost: g(&self.lost),
            overflowed: g(&self.overflowed),
            duplicated: g(&self.duplicated),
            reordered: g(&self.reordered),
            delayed: g(&self.delayed),
            slowed: g(&self.slowed),
            throttled: g(&self.throttled),
        }
    }
}

/// A datagram waiting for its time.
struct Timed {
    at: Instant,
    order: u64,
    socket: Arc<StdSocket>,
    /// `None`: the socket is connected.
    to: Option<SocketAddr>,
    bytes: Vec<u8>,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.order) == (o.at, o.order)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.order).cmp(&(o.at, o.order))
    }
}

struct Shared {
    network: Network,
    node: NodeId,
    config: ProxyConfig,
    /// Where clients' datagrams arrive...
    listen: Arc<UdpSocket>,
    /// ...and the same socket, for sending without waiting for the async
    /// driver to have seen it writable (a fresh tokio socket's `try_send`
    /// fails until then, which would drop first datagrams).
    listen_tx: Arc<StdSocket>,
    rng: Mutex<SimRng>,
    counters: Counters,
    /// When each capped directed link is free again.
    busy_until: Mutex<HashMap<(NodeId, NodeId), Instant>>,
    delayed: mpsc::Sender<Timed>,
    order: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Invariant: no code panics while holding these locks.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type StdSocket = std::net::UdpSocket;

fn send_now(counters: &Counters, socket: &StdSocket, to: Option<SocketAddr>, bytes: &[u8]) {
    // Non-blocking: a full socket buffer fails at once.
    let sent = match to {
        Some(to) => socket.send_to(bytes, to),
        None => socket.send(bytes),
    };
    match sent {
        Ok(_) => Counters::bump(&counters.forwarded),
        // A full socket buffer drops, as a real link does.
        Err(_) => Counters::bump(&counters.overflowed),
    }
}

impl Shared {
    /// Passes one datagram from `from` to `to` through the link's faults.
    fn forward(
        &self,
        from: NodeId,
        to: NodeId,
        socket: &Arc<StdSocket>,
        dest: Option<SocketAddr>,
        bytes: &[u8],
    ) {
        let faults = match self.network.verdict(from, to) {
            Verdict::Cut => return Counters::bump(&self.counters.cut),
            Verdict::Pass(f) => f,
        };
        if faults.is_clean() {
            return send_now(&self.counters, socket, dest, bytes);
        }
        let (copies, delay) = {
            let mut rng = lock(&self.rng);
            if rng.chance(faults.drop_probability) {
                drop(rng);
                return Counters::bump(&self.counters.lost);
            }
            let copies = if rng.chance(faults.duplicate_probability) {
                Counters::bump(&self.counters.duplicated);
                2
            } else {
                1
            };
            let mut delay = faults.delay;
            if !faults.jitter.is_zero() {
                let swing = rng.duration(Duration::ZERO, faults.jitter * 2);
                delay = (delay + swing).saturating_sub(faults.jitter);
            }
            if !delay.is_zero() {
                Counters::bump(&self.counters.slowed);
            }
            if rng.chance(faults.reorder_probability) {
                Counters::bump(&self.counters.reordered);
                delay += self.config.reorder_hold;
            }
            (copies, delay)
        };
        let now = Instant::now();
        let mut at = now + delay;
        if let Some(rate) = faults.bandwidth_bytes_per_sec {
            match self.serialize(from, to, now, bytes.len(), rate.get()) {
                Some(done) => {
                    Counters::bump(&self.counters.throttled);
                    at = at.max(done + delay);
                }
                None => return Counters::bump(&self.counters.overflowed),
            }
        }
        for _ in 0..copies {
            if at <= now {
                send_now(&self.counters, socket, dest, bytes);
                continue;
            }
            Counters::bump(&self.counters.delayed);
            let timed = Timed {
                at,
                order: self.order.fetch_add(1, Ordering::Relaxed),
                socket: socket.clone(),
                to: dest,
                bytes: bytes.to_vec(),
            };
            if self.delayed.try_send(timed).is_err() {
                Counters::bump(&self.counters.overflowed);
            }
        }
    }

    /// When a datagram of `len` bytes has left a link capped at `rate`, or
    /// `None` if the backlog is over its limit.
    fn serialize(
        &self,
        from: NodeId,
        to: NodeId,
        now: Instant,
        len: usize,
        rate: u64,
    ) -> Option<Instant> {
        let mut busy = lock(&self.busy_until);
        let free = busy.get(&(from, to)).copied().unwrap_or(now).max(now);
        let nanos = (len as u128 * 1_000_000_000) / u128::from(rate.max(1));
        let done = free + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        if done.saturating_duration_since(now) > self.config.max_queue_delay {
            return None;
        }
        busy.insert((from, to), done);
        Some(done)
    }
}

/// A running proxy in front of one node. Dropping it stops it.
pub struct Proxy {
    node: NodeId,
    addr: SocketAddr,
    upstream: watch::Sender<Option<SocketAddr>>,
    shared: Arc<Shared>,
    tasks: Vec<AbortHandle>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("node", &self.node)
            .field("addr", &self.addr)
            .field("upstream", &*self.upstream.borrow())
            .finish_non_exhaustive()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Proxy {
    /// Starts a proxy for `node` in front of `upstream` (which may be set
    /// later, e.g. for a controller whose address must be known before it
    /// binds). Must be called within a tokio runtime.
    pub async fn start(
        network: Network,
        node: NodeId,
        upstream: Option<SocketAddr>,
        config: ProxyConfig,
        seed: Seed,
    ) -> Result<Self, ChaosError> {
        let (listen, listen_tx) = bind_pair(SocketAddr::new(config.bind_ip, 0), None)
            .map_err(|e| ChaosError::io("binding a proxy socket", e))?;
        let addr = listen
            .local_addr()
            .map_err(|e| ChaosError::io("a proxy socket's address", e))?;
        let (delayed_tx, delayed_rx) = mpsc::channel(config.max_delayed_datagrams.max(1));
        let shared = Arc::new(Shared {
            network,
            node,
            config,
            listen: Arc::new(listen),
            listen_tx: Arc::new(listen_tx),
            rng: Mutex::new(SimRng::new(seed)),
            counters: Counters::default(),
            busy_until: Mutex::new(HashMap::new()),
            delayed: delayed_tx,
            order: AtomicU64::new(0),
        });
        let (upstream_tx, upstream_rx) = watch::channel(upstream);
        let ingress = tokio::spawn(ingress(shared.clone(), upstream_rx)).abort_handle();
        let timer = tokio::spawn(timer(shared.clone(), delayed_rx)).abort_handle();
        tracing::debug!(%node, %addr, ?upstream, "chaos proxy started");
        Ok(Self {
            node,
            addr,
            upstream: upstream_tx,
            shared,
            tasks: vec![ingress, timer],
        })
    }

    /// The node it stands in front of.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Where it listens: the address to hand out as the node's.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets (or changes) where it forwards to; new clients use it.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        self.upstream.send_replace(Some(upstream));
    }

    /// What it did so far.
    pub fn counts(&self) -> ProxyCounts {
        self.shared.counters.snapshot()
    }

    /// The faults a datagram from `from` to this node meets now.
    pub fn verdict_from(&self, from: NodeId) -> Verdict {
        self.shared.network.verdict(from, self.node)
    }
}

struct Client {
    socket: Arc<StdSocket>,
    /// The client's node, resolved lazily: a proc's first datagrams (its
    /// ready report) come before the allocator registers it.
    node: Arc<AtomicU32>,
    /// Milliseconds since `epoch` of the last datagram either way.
    last_ms: Arc<AtomicU64>,
    task: AbortHandle,
}

/// Receives from clients and forwards upstream, one upstream socket per
/// client.
async fn ingress(shared: Arc<Shared>, upstream: watch::Receiver<Option<SocketAddr>>) {
    let epoch = Instant::now();
    let mut clients: HashMap<SocketAddr, Client> = HashMap::new();
    let mut buf = vec![0u8; MAX_DATAGRAM_BYTES];
    let mut last_sweep = Instant::now();
    loop {
        let (n, from) = match shared.listen.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                // ICMP errors from earlier sends surface here on Linux.
                tracing::trace!(error = %e, "proxy receive error");
                continue;
            }
        };
        let now_ms = epoch.elapsed().as_millis() as u64;
        if last_sweep.elapsed() > shared.config.client_idle_timeout / 4 {
            last_sweep = Instant::now();
            let idle_ms = shared.config.client_idle_timeout.as_millis() as u64;
            clients.retain(|_, c| {
                let keep = now_ms.saturating_sub(c.last_ms.load(Ordering::Relaxed)) < idle_ms;
                if !keep {
                    c.task.abort();
                }
                keep
            });
        }
        if !clients.contains_key(&from) {
            let Some(target) = *upstream.borrow() else {
                Counters::bump(&shared.counters.overflowed);
                continue;
            };
            if clients.len() >= shared.config.max_clients {
                Counters::bump(&shared.counters.overflowed);
                continue;
            }
            match open_client(&shared, from, target, epoch).await {
                Ok(c) => {
                    clients.insert(from, c);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "chaos proxy cannot open an upstream socket");
                    Counters::bump(&shared.counters.overflowed);
                    continue;
                }
            }
        }
        let Some(client) = clients.get(&from) else {
            continue;
        };
        client.last_ms.store(now_ms, Ordering::Relaxed);
        let node = resolve(&shared.network, &client.node, from);
        shared.forward(node, shared.node, &client.socket, None, &buf[..n]);
    }
}

async fn open_client(
    shared: &Arc<Shared>,
    from: SocketAddr,
    target: SocketAddr,
    epoch: Instant,
) -> std::io::Result<Client> {
    let (socket, socket_tx) = bind_pair(SocketAddr::new(shared.config.bind_ip, 0), Some(target))?;
    let (socket, socket_tx) = (Arc::new(socket), Arc::new(socket_tx));
    let node = Arc::new(AtomicU32::new(shared.network.node_of(from).0));
    let last_ms = Arc::new(AtomicU64::new(epoch.elapsed().as_millis() as u64));
    let task = tokio::spawn(egress(
        shared.clone(),
        socket,
        from,
        node.clone(),
        last_ms.clone(),
        epoch,
    ))
    .abort_handle();
    tracing::trace!(proxy = %shared.node, client = %from, "chaos proxy client");
    Ok(Client {
        socket: socket_tx,
        node,
        last_ms,
        task,
    })
}

/// Receives the node's answers to one client and forwards them back.
async fn egress(
    shared: Arc<Shared>,
    socket: Arc<UdpSocket>,
    client: SocketAddr,
    client_node: Arc<AtomicU32>,
    last_ms: Arc<AtomicU64>,
    epoch: Instant,
) {
    let mut buf = vec![0u8; MAX_DATAGRAM_BYTES];
    loop {
        let n = match socket.recv(&mut buf).await {
            Ok(n) => n,
            Err(e) => {
                tracing::trace!(error = %e, "proxy upstream receive error");
                // A refused port (the node is gone) is reported repeatedly;
                // do not spin on it.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        last_ms.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        let listen = shared.listen_tx.clone();
        let node = resolve(&shared.network, &client_node, client);
        shared.forward(shared.node, node, &listen, Some(client), &buf[..n]);
    }
}

/// A non-blocking UDP socket bound at `addr` (and connected to `peer`),
/// as a tokio socket to receive on and a std clone to send from.
fn bind_pair(
    addr: SocketAddr,
    peer: Option<SocketAddr>,
) -> std::io::Result<(UdpSocket, StdSocket)> {
    let std = StdSocket::bind(addr)?;
    if let Some(peer) = peer {
        std.connect(peer)?;
    }
    std.set_nonblocking(true)?;
    let tx = std.try_clone()?;
    Ok((UdpSocket::from_std(std)?, tx))
}

/// The node of a client, looked up again while it is unknown.
fn resolve(network: &Network, cached: &AtomicU32, addr: SocketAddr) -> NodeId {
    let node = NodeId(cached.load(Ordering::Relaxed));
    if node != NodeId::UNKNOWN {
        return node;
    }
    let node = network.node_of(addr);
    cached.store(node.0, Ordering::Relaxed);
    node
}

/// Sends delayed datagrams when their time comes, earliest first.
async fn timer(shared: Arc<Shared>, mut rx: mpsc::Receiver<Timed>) {
    let mut heap: BinaryHeap<Reverse<Timed>> = BinaryHeap::new();
    let counters = &shared.counters;
    loop {
        let next = heap.peek().map(|Reverse(t)| t.at);
        tokio::select! {
            item = rx.recv() => match item {
                Some(t) => heap.push(Reverse(t)),
                None => return,
            },
            () = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                let now = Instant::now();
                while heap.peek().is_some_and(|Reverse(t)| t.at <= now) {
                    if let Some(Reverse(t)) = heap.pop() {
                        send_now(counters, &t.socket, t.to, &t.bytes);
                    }
                }
            }
        }
    }
}

/// The faults of a link as the schedule describes them, for reports.
pub(crate) fn describe(f: &LinkFaults) -> String {
    let mut parts = Vec::new();
    if f.drop_probability > 0.0 {
        parts.push(format!("loss {:.0}%", f.drop_probability * 100.0));
    }
    if !f.delay.is_zero() || !f.jitter.is_zero() {
        parts.push(format!("delay {:?}±{:?}", f.delay, f.jitter));
    }
    if f.duplicate_probability > 0.0 {
        parts.push(format!("duplicate {:.0}%", f.duplicate_probability * 100.0));
    }
    if f.reorder_probability > 0.0 {
        parts.push(format!("reorder {:.0}%", f.reorder_probability * 100.0));
    }
    if let Some(b) = f.bandwidth_bytes_per_sec {
        parts.push(format!("bandwidth {} KiB/s", b.get() / 1024));
    }
    if parts.is_empty() {
        "clean".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::Direction;

    async fn echo_server() -> SocketAddr {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = server.recv_from(&mut buf).await {
                let _ = server.send_to(&buf[..n], from).await;
            }
        });
        addr
    }

    async fn round_trip(client: &UdpSocket, msg: &[u8], wait: Duration) -> Option<Duration> {
        let t = Instant::now();
        client.send(msg).await.unwrap();
        let mut buf = vec![0u8; 2048];
        loop {
            match tokio::time::timeout(wait, client.recv(&mut buf)).await {
                Ok(Ok(n)) if &buf[..n] == msg => return Some(t.elapsed()),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }

    #[tokio::test]
    async fn cuts_drop_each_direction_and_delays_delay() {
        let net = Network::new();
        let server = echo_server().await;
        let proxy = Proxy::start(
            net.clone(),
            NodeId(1),
            Some(server),
            ProxyConfig::default(),
            Seed(1),
        )
        .await
        .unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(proxy.addr()).await.unwrap();
        let wait = Duration::from_millis(400);
        // An unknown client passes a clean network.
        assert!(round_trip(&client, b"a", wait).await.is_some());
        // Registered after its first datagram: rules still find it.
        net.register(NodeId(2), "client", client.local_addr().unwrap());
        net.partition(&[NodeId(2)], &[NodeId(1)], Direction::OneWay);
        assert!(
            round_trip(&client, b"b", wait).await.is_none(),
            "to the node"
        );
        net.heal();
        assert!(round_trip(&client, b"c", wait).await.is_some());
        net.partition(&[NodeId(1)], &[NodeId(2)], Direction::OneWay);
        assert!(round_trip(&client, b"d", wait).await.is_none(), "back");
        net.heal();
        net.isolate(NodeId(1));
        assert!(round_trip(&client, b"e", wait).await.is_none(), "isolated");
        assert!(proxy.counts().cut >= 3, "{:?}", proxy.counts());
        net.heal();
        net.set_all_links(LinkFaults::new().delay(Duration::from_millis(100), Duration::ZERO));
        let rtt = round_trip(&client, b"f", Duration::from_secs(2))
            .await
            .unwrap();
        // 100 ms each way.
        assert!(rtt >= Duration::from_millis(190), "{rtt:?}");
        assert_eq!(proxy.counts().slowed, 2, "{:?}", proxy.counts());
        assert_eq!(proxy.counts().throttled, 0, "{:?}", proxy.counts());
        net.set_all_links(
            LinkFaults::new().bandwidth_bytes_per_sec(std::num::NonZeroU64::new(1 << 20)),
        );
        assert!(
            round_trip(&client, b"f2", Duration::from_secs(2))
                .await
                .is_some()
        );
        assert_eq!(proxy.counts().throttled, 2, "{:?}", proxy.counts());
        assert_eq!(proxy.counts().slowed, 2, "a cap alone adds no latency");
        net.set_all_links(LinkFaults::new().drop_probability(1.0));
        assert!(round_trip(&client, b"g", wait).await.is_none(), "lost");
        assert!(proxy.counts().lost >= 1);
        net.set_all_links(LinkFaults::new().duplicate_probability(1.0));
        assert!(round_trip(&client, b"h", wait).await.is_some());
        assert!(proxy.counts().duplicated >= 2, "{:?}", proxy.counts());
    }
}
