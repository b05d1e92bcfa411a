//! Deterministic simulation of the network under the real endpoints
//! (feature `sim`).
//!
//! [`SimNet`] is an in-memory datagram network between simulated addresses
//! (one [`SocketAddr`] per simulated host). [`SimSocket`] is a
//! [`quinn::AsyncUdpSocket`] on it, and [`crate::Endpoint::bind_sim`] starts
//! a regent-net endpoint on one: quinn, rustls mutual TLS, the sessions and
//! the failure detector all run for real; only the UDP socket and the clock
//! are simulated.
//!
//! # Determinism
//!
//! Run everything on one current-thread tokio runtime with its clock paused
//! (`tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true)`):
//! time then moves only when every task waits, straight to the next timer,
//! and no real time passes. Every random choice of the network (latency,
//! loss, duplication, reordering) comes from one PCG generator seeded by
//! [`SimNet::new`]'s seed, drawn in the order datagrams are sent; quinn's
//! generators and each endpoint's incarnation are drawn from it too. Each
//! datagram sent, delivered, dropped, duplicated or held is recorded
//! ([`TraceEvent`]) and folded into [`SimNet::trace_hash`] (FNV-1a, stable
//! across runs, builds and platforms): the same seed gives the same hash.
//!
//! What stays random, and why it does not matter: rustls (key shares,
//! nonces) and quinn's connection ids, reset and token keys draw from the
//! system, but change only the contents of datagrams, never their size or
//! timing, provided the certificates have signatures of fixed length (use an
//! Ed25519 CA: [`crate::ClusterCa::generate_with`] with
//! [`crate::KeyAlgorithm::Ed25519`]). Certificate validity (and so expiry)
//! follows the real date, not the simulated clock.
//!
//! # Faults
//!
//! Per direction of a link, settable at any time: [`LinkFaults`] (latency
//! range, loss, duplication, reordering by a random extra delay), one-way
//! and two-way partitions ([`SimNet::partition`]), and hold/release
//! ([`SimNet::hold`]). Faults apply to a datagram when it is sent: one in
//! flight when a partition starts still arrives.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use rand::{RngExt as _, SeedableRng as _};
use rand_pcg::Pcg64;
use tokio::time::{Instant, Sleep};

use crate::error::Error;

/// Datagrams waiting for one socket (in flight to it or arrived); past it,
/// datagrams are dropped as by a full socket buffer.
pub const MAX_QUEUED_DATAGRAMS: usize = 1 << 16;
/// Datagrams kept on one held link; past it, they are dropped.
pub const MAX_HELD_DATAGRAMS: usize = 1 << 16;
/// Trace events kept for [`SimNet::trace`]; later ones are only hashed.
pub const MAX_TRACE_EVENTS: usize = 1 << 20;

/// The first port [`SimNet::bind`] gives for port 0.
const EPHEMERAL_PORTS: u16 = 49152;

/// The faults of one direction of a link. Defaults: latency 1 ms, no loss,
/// no duplication, no reordering.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkFaults {
    /// Shortest one-way delay. Each datagram's delay is drawn uniformly
    /// between this and `latency_max`.
    pub latency_min: Duration,
    /// Longest one-way delay (before reordering).
    pub latency_max: Duration,
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Probability that a datagram arrives twice (each copy with its own
    /// delay).
    pub duplicate: f64,
    /// Probability that a datagram gets an extra delay, drawn uniformly up
    /// to `reorder_delay_max`, so that later ones overtake it.
    pub reorder: f64,
    /// Longest extra delay of a reordered datagram.
    pub reorder_delay_max: Duration,
}

impl Default for LinkFaults {
    fn default() -> Self {
        Self {
            latency_min: Duration::from_millis(1),
            latency_max: Duration::from_millis(1),
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay_max: Duration::ZERO,
        }
    }
}

impl LinkFaults {
    /// Sets the latency range.
    pub fn latency(mut self, min: Duration, max: Duration) -> Self {
        self.latency_min = min;
        self.latency_max = max;
        self
    }

    /// Sets the loss probability.
    pub fn loss(mut self, p: f64) -> Self {
        self.loss = p;
        self
    }

    /// Sets the duplication probability.
    pub fn duplicate(mut self, p: f64) -> Self {
        self.duplicate = p;
        self
    }

    /// Sets the reordering probability and the longest extra delay.
    pub fn reorder(mut self, p: f64, delay_max: Duration) -> Self {
        self.reorder = p;
        self.reorder_delay_max = delay_max;
        self
    }

    /// Checks the values: probabilities in `0..=1`, a latency range that is
    /// not empty, delays of at most a day.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(m));
        for (name, p) in [
            ("loss", self.loss),
            ("duplicate", self.duplicate),
            ("reorder", self.reorder),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("{name} probability {p} is not in 0..=1"));
            }
        }
        if self.latency_min > self.latency_max {
            return bad(format!(
                "latency_min {:?} is over latency_max {:?}",
                self.latency_min, self.latency_max
            ));
        }
        let day = crate::config::MAX_CONFIG_DURATION;
        if self.latency_max > day || self.reorder_delay_max > day {
            return bad(format!("simulated delays are bounded by {day:?}"));
        }
        Ok(())
    }
}

/// What happened to a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceKind {
    /// A socket sent it.
    Sent,
    /// It reached its destination socket (recorded at its arrival time).
    Delivered,
    /// It was lost, and why.
    Dropped(DropCause),
    /// A second copy of it is on its way.
    Duplicated,
    /// Its link is held: it waits for [`SimNet::release`].
    Held,
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropCause {
    /// Random loss ([`LinkFaults::loss`]).
    Loss,
    /// The link is partitioned.
    Partition,
    /// No socket is bound at the destination (or it closed before the
    /// datagram was read).
    Unbound,
    /// The destination's queue is full ([`MAX_QUEUED_DATAGRAMS`]).
    QueueFull,
    /// The held link's queue is full ([`MAX_HELD_DATAGRAMS`]).
    HoldFull,
}

impl TraceKind {
    fn code(self) -> u8 {
        match self {
            Self::Sent => 1,
            Self::Delivered => 2,
            Self::Duplicated => 3,
            Self::Held => 4,
            Self::Dropped(DropCause::Loss) => 10,
            Self::Dropped(DropCause::Partition) => 11,
            Self::Dropped(DropCause::Unbound) => 12,
            Self::Dropped(DropCause::QueueFull) => 13,
            Self::Dropped(DropCause::HoldFull) => 14,
        }
    }
}

/// One entry of the network's trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceEvent {
    /// Simulated time since the network was made, in nanoseconds.
    pub at_ns: u64,
    /// What happened.
    pub kind: TraceKind,
    /// The sending socket.
    pub src: SocketAddr,
    /// The destination.
    pub dst: SocketAddr,
    /// The datagram's length in bytes.
    pub len: usize,
}

/// FNV-1a, 64 bits: a fixed function of the bytes, unlike std's
/// `DefaultHasher` (random keys in `RandomState`, and no promise of the same
/// algorithm across releases).
#[derive(Debug, Clone, Copy)]
struct Fnv64(u64);

impl Fnv64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn write_addr(&mut self, addr: &SocketAddr) {
        match addr.ip() {
            IpAddr::V4(ip) => {
                self.write(&[4]);
                self.write(&ip.octets());
            }
            IpAddr::V6(ip) => {
                self.write(&[6]);
                self.write(&ip.octets());
            }
        }
        self.write(&addr.port().to_le_bytes());
    }

    fn write_event(&mut self, e: &TraceEvent) {
        self.write(&e.at_ns.to_le_bytes());
        self.write(&[e.kind.code()]);
        self.write_addr(&e.src);
        self.write_addr(&e.dst);
        self.write(&(e.len as u64).to_le_bytes());
    }
}

/// A datagram in the network.
struct Datagram {
    src: SocketAddr,
    dst: SocketAddr,
    bytes: Box<[u8]>,
}

/// A bound socket's side of the network.
#[derive(Default)]
struct Mailbox {
    /// Datagrams on their way or arrived, by (arrival time, order sent).
    queue: BTreeMap<(Instant, u64), Datagram>,
    /// The task reading the socket, woken when a datagram is queued.
    waker: Option<Waker>,
}

struct State {
    seed: u64,
    rng: Pcg64,
    start: Instant,
    default_faults: LinkFaults,
    faults: BTreeMap<(SocketAddr, SocketAddr), LinkFaults>,
    partitioned: BTreeSet<(SocketAddr, SocketAddr)>,
    held: BTreeMap<(SocketAddr, SocketAddr), VecDeque<Datagram>>,
    sockets: BTreeMap<SocketAddr, Mailbox>,
    /// Orders datagrams that arrive at the same instant by when they were
    /// scheduled.
    next_order: u64,
    next_port: u16,
    trace: Vec<TraceEvent>,
    trace_events: u64,
    hash: Fnv64,
}

impl State {
    fn now_ns(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.start).as_nanos()).unwrap_or(u64::MAX)
    }

    fn record(&mut self, at: Instant, kind: TraceKind, d: &Datagram) {
        let event = TraceEvent {
            at_ns: self.now_ns(at),
            kind,
            src: d.src,
            dst: d.dst,
            len: d.bytes.len(),
        };
        self.hash.write_event(&event);
        self.trace_events += 1;
        if self.trace.len() < MAX_TRACE_EVENTS {
            self.trace.push(event);
        }
    }

    fn link_faults(&self, link: (SocketAddr, SocketAddr)) -> &LinkFaults {
        self.faults.get(&link).unwrap_or(&self.default_faults)
    }

    fn draw_delay(&mut self, faults: &LinkFaults) -> Duration {
        let (min, max) = (faults.latency_min, faults.latency_max);
        let mut delay = if min == max {
            min
        } else {
            self.rng.random_range(min..=max)
        };
        if faults.reorder > 0.0 && self.rng.random_bool(faults.reorder) {
            delay += self
                .rng
                .random_range(Duration::ZERO..=faults.reorder_delay_max);
        }
        delay
    }

    /// A datagram a socket just sent: partitioned, held, or on its way.
    fn send(&mut self, d: Datagram) {
        let now = Instant::now();
        self.record(now, TraceKind::Sent, &d);
        let link = (d.src, d.dst);
        if self.partitioned.contains(&link) {
            self.record(now, TraceKind::Dropped(DropCause::Partition), &d);
            return;
        }
        if let Some(queue) = self.held.get(&link) {
            if queue.len() >= MAX_HELD_DATAGRAMS {
                self.record(now, TraceKind::Dropped(DropCause::HoldFull), &d);
            } else {
                self.record(now, TraceKind::Held, &d);
                if let Some(queue) = self.held.get_mut(&link) {
                    queue.push_back(d);
                }
            }
            return;
        }
        self.transmit(now, d);
    }

    /// Puts a datagram on the wire: loss, duplication, delay.
    fn transmit(&mut self, now: Instant, d: Datagram) {
        let faults = self.link_faults((d.src, d.dst)).clone();
        if faults.loss > 0.0 && self.rng.random_bool(faults.loss) {
            self.record(now, TraceKind::Dropped(DropCause::Loss), &d);
            return;
        }
        if faults.duplicate > 0.0 && self.rng.random_bool(faults.duplicate) {
            self.record(now, TraceKind::Duplicated, &d);
            let copy = Datagram {
                src: d.src,
                dst: d.dst,
                bytes: d.bytes.clone(),
            };
            let delay = self.draw_delay(&faults);
            self.enqueue(now, now + delay, copy);
        }
        let delay = self.draw_delay(&faults);
        self.enqueue(now, now + delay, d);
    }

    fn enqueue(&mut self, now: Instant, arrival: Instant, d: Datagram) {
        let order = self.next_order;
        self.next_order += 1;
        let cause = match self.sockets.get(&d.dst) {
            None => Some(DropCause::Unbound),
            Some(m) if m.queue.len() >= MAX_QUEUED_DATAGRAMS => Some(DropCause::QueueFull),
            Some(_) => None,
        };
        if let Some(cause) = cause {
            self.record(now, TraceKind::Dropped(cause), &d);
            return;
        }
        if let Some(mailbox) = self.sockets.get_mut(&d.dst) {
            mailbox.queue.insert((arrival, order), d);
            // The reader re-arms its timer for the earliest arrival.
            if let Some(waker) = mailbox.waker.take() {
                waker.wake();
            }
        }
    }

    fn release(&mut self, link: (SocketAddr, SocketAddr)) {
        let now = Instant::now();
        for d in self.held.remove(&link).unwrap_or_default() {
            self.transmit(now, d);
        }
    }
}

/// A seeded in-memory datagram network between simulated addresses. Cheap
/// to clone (a handle). See the [module docs](self).
#[derive(Clone)]
pub struct SimNet {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for SimNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("SimNet")
            .field("seed", &s.seed)
            .field("sockets", &s.sockets.len())
            .field("trace_events", &s.trace_events)
            .finish_non_exhaustive()
    }
}

impl SimNet {
    /// A network whose random choices all come from `seed`, with
    /// [`LinkFaults::default`] on every link. Its time starts now (tokio
    /// time: call it within the simulation's runtime).
    pub fn new(seed: u64) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                seed,
                rng: Pcg64::seed_from_u64(seed),
                start: Instant::now(),
                default_faults: LinkFaults::default(),
                faults: BTreeMap::new(),
                partitioned: BTreeSet::new(),
                held: BTreeMap::new(),
                sockets: BTreeMap::new(),
                next_order: 0,
                next_port: EPHEMERAL_PORTS,
                trace: Vec::new(),
                trace_events: 0,
                hash: Fnv64(Fnv64::OFFSET),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The seed it was made with.
    pub fn seed(&self) -> u64 {
        self.lock().seed
    }

    /// Simulated time since the network was made.
    pub fn elapsed(&self) -> Duration {
        Instant::now().saturating_duration_since(self.lock().start)
    }

    /// A number drawn from the network's generator (for whatever else in a
    /// simulation must be random and replay from the seed).
    pub fn random_u64(&self) -> u64 {
        self.lock().rng.random()
    }

    /// 32 bytes drawn from the network's generator (a seed for another
    /// generator, e.g. quinn's).
    pub fn random_seed(&self) -> [u8; 32] {
        self.lock().rng.random()
    }

    /// Binds a socket at `addr`; port 0 takes a free port. Fails if the
    /// address is taken.
    pub fn bind(&self, mut addr: SocketAddr) -> io::Result<Arc<SimSocket>> {
        let mut s = self.lock();
        if addr.port() == 0 {
            let ip = addr.ip();
            let free = (s.next_port..=u16::MAX)
                .chain(EPHEMERAL_PORTS..s.next_port)
                .find(|p| !s.sockets.contains_key(&SocketAddr::new(ip, *p)));
            let Some(port) = free else {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "no free simulated port",
                ));
            };
            s.next_port = port.checked_add(1).unwrap_or(EPHEMERAL_PORTS);
            addr.set_port(port);
        }
        if s.sockets.contains_key(&addr) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("simulated address {addr} is taken"),
            ));
        }
        s.sockets.insert(addr, Mailbox::default());
        drop(s);
        Ok(Arc::new(SimSocket {
            net: self.clone(),
            addr,
            timer: Mutex::new(None),
        }))
    }

    /// Sets the faults of links with no faults of their own.
    pub fn set_default_faults(&self, faults: LinkFaults) -> Result<(), Error> {
        faults.validate()?;
        self.lock().default_faults = faults;
        Ok(())
    }

    /// Sets the faults of the link `from` → `to` (one direction).
    pub fn set_faults(
        &self,
        from: SocketAddr,
        to: SocketAddr,
        faults: LinkFaults,
    ) -> Result<(), Error> {
        faults.validate()?;
        self.lock().faults.insert((from, to), faults);
        Ok(())
    }

    /// Drops every datagram between `a` and `b`, both ways, until
    /// [`Self::repair`].
    pub fn partition(&self, a: SocketAddr, b: SocketAddr) {
        let mut s = self.lock();
        s.partitioned.insert((a, b));
        s.partitioned.insert((b, a));
    }

    /// Drops every datagram from `from` to `to` (the other way still
    /// flows).
    pub fn partition_oneway(&self, from: SocketAddr, to: SocketAddr) {
        self.lock().partitioned.insert((from, to));
    }

    /// Ends partitions between `a` and `b`, both ways.
    pub fn repair(&self, a: SocketAddr, b: SocketAddr) {
        let mut s = self.lock();
        s.partitioned.remove(&(a, b));
        s.partitioned.remove(&(b, a));
    }

    /// Keeps datagrams from `from` to `to` (one way) until
    /// [`Self::release`], which sends them on in order.
    pub fn hold(&self, from: SocketAddr, to: SocketAddr) {
        self.lock().held.entry((from, to)).or_default();
    }

    /// Sends what [`Self::hold`] kept on `from` → `to`, each with a fresh
    /// delay, and stops holding.
    pub fn release(&self, from: SocketAddr, to: SocketAddr) {
        self.lock().release((from, to));
    }

    /// Trace events recorded so far (at most [`MAX_TRACE_EVENTS`]).
    pub fn trace(&self) -> Vec<TraceEvent> {
        self.lock().trace.clone()
    }

    /// How many events happened (also past [`MAX_TRACE_EVENTS`]).
    pub fn trace_events(&self) -> u64 {
        self.lock().trace_events
    }

    /// The hash of every trace event so far, in order: equal for runs of
    /// the same seed and scenario.
    pub fn trace_hash(&self) -> u64 {
        self.lock().hash.0
    }
}

/// A UDP socket on a [`SimNet`], for quinn. Closes (unbinds) when dropped.
pub struct SimSocket {
    net: SimNet,
    addr: SocketAddr,
    /// Wakes the reader at the next arrival.
    timer: Mutex<Option<Pin<Box<Sleep>>>>,
}

impl fmt::Debug for SimSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimSocket")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for SimSocket {
    fn drop(&mut self) {
        let mut s = self.net.lock();
        let now = Instant::now();
        if let Some(mailbox) = s.sockets.remove(&self.addr) {
            for d in mailbox.queue.into_values() {
                s.record(now, TraceKind::Dropped(DropCause::Unbound), &d);
            }
        }
    }
}

/// Always writable: the network never pushes back (it drops instead).
#[derive(Debug)]
struct Writable;

impl UdpPoller for Writable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for SimSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(Writable)
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let mut s = self.net.lock();
        let segment = transmit
            .segment_size
            .unwrap_or(transmit.contents.len())
            .max(1);
        for chunk in transmit.contents.chunks(segment) {
            s.send(Datagram {
                src: self.addr,
                dst: transmit.destination,
                bytes: chunk.into(),
            });
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut timer = self.timer.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let mut s = self.net.lock();
            let now = Instant::now();
            let Some(mailbox) = s.sockets.get_mut(&self.addr) else {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "simulated socket unbound",
                )));
            };
            let mut arrived = Vec::new();
            while arrived.len() < bufs.len().min(meta.len()) {
                match mailbox.queue.first_key_value() {
                    Some((&(at, _), _)) if at <= now => {}
                    _ => break,
                }
                if let Some(((at, _), d)) = mailbox.queue.pop_first() {
                    arrived.push((at, d));
                }
            }
            let next = mailbox.queue.first_key_value().map(|(&(at, _), _)| at);
            if arrived.is_empty() {
                mailbox.waker = Some(cx.waker().clone());
            }
            for (i, (at, d)) in arrived.iter().enumerate() {
                s.record(*at, TraceKind::Delivered, d);
                let len = d.bytes.len().min(bufs[i].len());
                bufs[i][..len].copy_from_slice(&d.bytes[..len]);
                meta[i] = RecvMeta {
                    addr: d.src,
                    len,
                    stride: len,
                    ecn: None,
                    dst_ip: Some(self.addr.ip()),
                };
            }
            drop(s);
            if !arrived.is_empty() {
                return Poll::Ready(Ok(arrived.len()));
            }
            let Some(next) = next else {
                *timer = None;
                return Poll::Pending;
            };
            let sleep = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(next)));
            if sleep.deadline() != next {
                sleep.as_mut().reset(next);
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            // The next arrival is due now: take it.
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
