//! The sending side: one session per peer proc (a connection this endpoint
//! dials, redialed after failures) and, within it, one pair per (sender
//! actor, receiver actor) with its own QUIC stream and [`SendWindow`].
//!
//! Tasks: a session driver dials, handshakes and runs the heartbeat; each
//! pair has a driver that opens the pair's stream on every new connection,
//! replays what is unacknowledged and writes new messages, and an
//! acknowledgement reader per stream.

use std::future::Future as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::{RecvStream, SendStream};
use rustls_pki_types::CertificateDer;
use tokio::sync::{Notify, Semaphore, TryAcquireError, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Inner, lock};
use crate::error::{LinkFailure, SendFailure, UndeliveredCause};
use crate::event::{Direction, TransportEvent};
use crate::fxhash::FxHashMap;
use crate::id::{ActorId, Generation, Incarnation, PortId, ProcId, Seq, TypeTag};
use crate::link::{self, ReadFailure, classify, code};
use crate::session::{Pending, SendWindow};
use crate::tls::{CertificateFacts, Role, certificate_facts};
use crate::wire::{
    self, Control, Envelope, FrameDecoder, Hello, PROTOCOL_VERSION, ToReceiver, ToSender, WireError,
};

/// First and largest pause between dial attempts.
const BACKOFF_FIRST: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// (sender actor, receiver actor).
pub(crate) type PairKey = (ActorId, ActorId);

/// A kept message: the envelope (given back on failure) and its frame.
#[derive(Debug)]
pub(crate) struct Outgoing {
    pub(crate) envelope: Envelope,
    frame: Bytes,
    max_frame_bytes: usize,
}

impl Pending for Outgoing {
    fn renumber(&mut self, seq: Seq) {
        self.envelope.seq = seq;
        // A smaller sequence never encodes longer, so the frame that fit
        // before fits now; keep the old frame if encoding fails regardless.
        match wire::encode_message_frame(&self.envelope, self.max_frame_bytes) {
            Ok(frame) => self.frame = frame,
            Err(e) => tracing::error!(error = %e, "re-encoding a renumbered message failed"),
        }
    }
}

/// The connection state a session publishes to its pairs.
#[derive(Clone)]
pub(crate) enum Link {
    Connecting,
    Up {
        conn: quinn::Connection,
        epoch: u64,
        incarnation: Incarnation,
    },
    Closed,
}

/// The sending side towards one peer proc.
pub(crate) struct Session {
    peer: ProcId,
    link: watch::Sender<Link>,
    pairs: Mutex<SessionPairs>,
    /// The role of the peer's certificate, once a dial got that far.
    peer_role: Mutex<Option<Role>>,
}

#[derive(Default)]
struct SessionPairs {
    closed: bool,
    map: FxHashMap<PairKey, Arc<Pair>>,
}

/// One (sender actor, receiver actor) pair.
pub(crate) struct Pair {
    key: PairKey,
    epoch: u64,
    state: Mutex<PairState>,
    permits: Semaphore,
    wake: Notify,
}

struct PairState {
    window: SendWindow<Outgoing>,
    /// The peer incarnation the window's sequences belong to.
    incarnation: Option<Incarnation>,
    closed: bool,
    /// The pair's stream while nobody writes to it: `send` writes here
    /// directly (without waking the driver) when the write completes at
    /// once; the driver takes it out for writes that may wait.
    stream: Option<SendStream>,
    /// Bytes a direct write could not finish, written first by the driver.
    carry: Vec<Bytes>,
    /// When the last message was accepted (for closing idle pairs).
    last_send: Instant,
}

impl Session {
    /// The role of the peer's certificate on the latest connection.
    pub(crate) fn peer_role(&self) -> Option<Role> {
        *lock(&self.peer_role)
    }

    fn is_closed(&self) -> bool {
        lock(&self.pairs).closed
    }

    /// Pairs in the session.
    pub(crate) fn open_pairs(&self) -> usize {
        lock(&self.pairs).map.len()
    }

    /// Messages kept by all pairs.
    pub(crate) fn unacknowledged(&self) -> usize {
        let pairs: Vec<Arc<Pair>> = lock(&self.pairs).map.values().cloned().collect();
        pairs.iter().map(|p| lock(&p.state).window.len()).sum()
    }
}

/// Why a try at enqueueing must start over.
enum Retry {
    Closed,
}

/// Accepts a message for a remote port: finds (or starts) the session and
/// pair, waits for buffer space, and keeps it for the pair driver.
pub(crate) async fn enqueue(
    inner: &Arc<Inner>,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: Bytes,
) -> Result<(), SendFailure> {
    // A pair can close (idle, or its session gave up) between lookup and
    // push; then a fresh one is made. Three tries bound this loop: a new
    // pair cannot close before it has been idle for `pair_idle_timeout`.
    for _ in 0..3 {
        if *inner.shutdown.borrow() {
            return Err(SendFailure::Closed);
        }
        let pair = pair_for(inner, to.proc(), (from.clone(), to.actor.clone()))?;
        let Ok(permit) = pair.permits.acquire().await else {
            continue;
        };
        if let Some(result) = accept(
            inner, &pair, permit, from, to, generation, type_tag, &payload,
        ) {
            return result;
        }
    }
    Err(SendFailure::Closed)
}

/// Like [`enqueue`], failing with `Full` instead of waiting.
pub(crate) fn try_enqueue(
    inner: &Arc<Inner>,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: &Bytes,
) -> Result<(), SendFailure> {
    match attempt(inner, from, to, generation, type_tag, payload) {
        Attempted::Done(result) => result,
        Attempted::Full(_) => Err(SendFailure::Full),
    }
}

/// What [`attempt`] did.
pub(crate) enum Attempted {
    Done(Result<(), SendFailure>),
    /// The pair's buffer is full: [`enqueue_on`] waits for room in it.
    Full(Arc<Pair>),
}

/// [`enqueue`] without the wait: done, or the pair whose buffer is full.
pub(crate) fn attempt(
    inner: &Arc<Inner>,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: &Bytes,
) -> Attempted {
    for _ in 0..3 {
        if *inner.shutdown.borrow() {
            return Attempted::Done(Err(SendFailure::Closed));
        }
        let pair = match pair_for(inner, to.proc(), (from.clone(), to.actor.clone())) {
            Ok(pair) => pair,
            Err(failure) => return Attempted::Done(Err(failure)),
        };
        let permit = match pair.permits.try_acquire() {
            Ok(p) => p,
            Err(TryAcquireError::NoPermits) => return Attempted::Full(pair.clone()),
            Err(TryAcquireError::Closed) => continue,
        };
        if let Some(result) = accept(
            inner, &pair, permit, from, to, generation, type_tag, payload,
        ) {
            return Attempted::Done(result);
        }
    }
    Attempted::Done(Err(SendFailure::Closed))
}

/// [`enqueue`] on the pair that [`attempt`] found full: waits for room in
/// it (no second lookup); if the pair closed meanwhile, starts over.
pub(crate) async fn enqueue_on(
    inner: &Arc<Inner>,
    pair: Arc<Pair>,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: Bytes,
) -> Result<(), SendFailure> {
    if let Ok(permit) = pair.permits.acquire().await
        && let Some(result) = accept(
            inner, &pair, permit, from, to, generation, type_tag, &payload,
        )
    {
        return result;
    }
    enqueue(inner, from, to, generation, type_tag, payload).await
}

/// Keeps the message in the pair (holding a buffer permit) and writes it if
/// that completes at once; `None` when the pair closed meanwhile.
#[allow(clippy::too_many_arguments)]
fn accept(
    inner: &Inner,
    pair: &Pair,
    permit: tokio::sync::SemaphorePermit<'_>,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: &Bytes,
) -> Option<Result<(), SendFailure>> {
    match push(inner, pair, from, to, generation, type_tag, payload.clone()) {
        Ok(()) => {
            // Given back by `add_permits` when the message leaves the window.
            permit.forget();
            write_now(pair);
            Some(Ok(()))
        }
        Err(Ok(Retry::Closed)) => None,
        Err(Err(failure)) => Some(Err(failure)),
    }
}

fn push(
    inner: &Inner,
    pair: &Pair,
    from: &ActorId,
    to: &PortId,
    generation: Generation,
    type_tag: TypeTag,
    payload: Bytes,
) -> Result<(), Result<Retry, SendFailure>> {
    let mut state = lock(&pair.state);
    if state.closed {
        return Err(Ok(Retry::Closed));
    }
    let seq = state.window.next_seq();
    let envelope = Envelope {
        sender: from.clone(),
        receiver: to.clone(),
        seq,
        generation,
        type_tag,
        payload,
    };
    let max_frame_bytes = inner.config.max_frame_bytes;
    let frame = wire::encode_message_frame(&envelope, max_frame_bytes)
        .map_err(|e| Err(SendFailure::Wire(e)))?;
    inner.traffic.sent(frame.len());
    state.last_send = Instant::now();
    state.window.push(
        seq,
        Outgoing {
            envelope,
            frame,
            max_frame_bytes,
        },
    );
    Ok(())
}

/// Writes what is unwritten straight to the pair's stream if that completes
/// without waiting (one poll of a cancel-safe write); otherwise leaves the
/// rest to the pair driver. Saves a task hop per message on the hot path.
fn write_now(pair: &Pair) {
    let mut guard = lock(&pair.state);
    let state = &mut *guard;
    let Some(stream) = state.stream.as_mut().filter(|_| state.carry.is_empty()) else {
        drop(guard);
        pair.wake.notify_one();
        return;
    };
    let mut chunks: Vec<Bytes> = Vec::new();
    state
        .window
        .take_unwritten(|o| chunks.push(o.frame.clone()));
    let mut rest: &mut [Bytes] = &mut chunks;
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    while !rest.is_empty() {
        let poll = std::pin::pin!(stream.write_chunks(rest)).poll(&mut cx);
        match poll {
            std::task::Poll::Ready(Ok(written)) => rest = &mut rest[written.chunks..],
            // Blocked (nothing written) or failed: the driver takes over and
            // meets the same condition.
            std::task::Poll::Ready(Err(_)) | std::task::Poll::Pending => break,
        }
    }
    if rest.is_empty() {
        return;
    }
    // A partly written chunk was advanced in place to its unwritten part.
    state
        .carry
        .extend(rest.iter().filter(|b| !b.is_empty()).cloned());
    drop(guard);
    pair.wake.notify_one();
}

fn pair_for(inner: &Arc<Inner>, peer: &ProcId, key: PairKey) -> Result<Arc<Pair>, SendFailure> {
    let session = {
        let mut sessions = lock(&inner.sessions);
        match sessions.get(peer) {
            Some(s) if !s.is_closed() => s.clone(),
            _ => {
                let addr = inner
                    .route(peer)
                    .ok_or_else(|| SendFailure::NoRoute(peer.clone()))?;
                let session = Arc::new(Session {
                    peer: peer.clone(),
                    link: watch::Sender::new(Link::Connecting),
                    pairs: Mutex::default(),
                    peer_role: Mutex::new(None),
                });
                sessions.insert(peer.clone(), session.clone());
                // On the endpoint's runtime: the caller's may end first,
                // and the session (and the connection it dials, whose
                // driver quinn starts where it is dialed) must not.
                inner.spawn(drive_session(inner.clone(), session.clone(), addr));
                session
            }
        }
    };
    let mut pairs = lock(&session.pairs);
    if pairs.closed {
        // The session gave up a moment ago; the next try makes a new one.
        drop(pairs);
        let mut sessions = lock(&inner.sessions);
        if sessions.get(peer).is_some_and(|s| Arc::ptr_eq(s, &session)) {
            sessions.remove(peer);
        }
        return Err(SendFailure::Closed);
    }
    if let Some(pair) = pairs.map.get(&key) {
        return Ok(pair.clone());
    }
    let pair = Arc::new(Pair {
        key: key.clone(),
        epoch: inner.next_pair_epoch(),
        state: Mutex::new(PairState {
            window: SendWindow::new(),
            incarnation: None,
            closed: false,
            stream: None,
            carry: Vec::new(),
            last_send: Instant::now(),
        }),
        permits: Semaphore::new(inner.config.send_buffer_messages.get()),
        wake: Notify::new(),
    });
    pairs.map.insert(key, pair.clone());
    inner.spawn(drive_pair(inner.clone(), session.clone(), pair.clone()));
    Ok(pair)
}

/// What a dial yields.
struct Handshake {
    conn: quinn::Connection,
    send: SendStream,
    recv: RecvStream,
    decoder: FrameDecoder,
    incarnation: Incarnation,
    /// The role and expiry of the peer's certificate.
    facts: CertificateFacts,
}

async fn dial(inner: &Inner, peer: &ProcId, addr: SocketAddr) -> Result<Handshake, LinkFailure> {
    let connecting = inner
        .quic
        .connect_with(inner.client_config(), addr, peer.as_str())
        .map_err(|e| LinkFailure::Unreachable(e.to_string()))?;
    let conn = connecting.await.map_err(|e| match classify(&e) {
        LinkFailure::ConnectionLost(m) => LinkFailure::Unreachable(m),
        other => other,
    })?;
    let result = async {
        // rustls verified the chain and that it names `peer`.
        let facts = conn
            .peer_identity()
            .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or_else(|| LinkFailure::Refused(format!("{peer} presented no certificate")))
            .and_then(|chain| match chain.first() {
                Some(leaf) => certificate_facts(leaf)
                    .map_err(|e| LinkFailure::Refused(format!("certificate of {peer}: {e}"))),
                None => Err(LinkFailure::Refused(format!(
                    "{peer} presented no certificate"
                ))),
            })?;
        if facts.expired_at(std::time::SystemTime::now()) {
            return Err(LinkFailure::Refused(format!(
                "the certificate of {peer} expired at {}",
                crate::tls::utc_date(facts.not_after)
            )));
        }
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| classify(&e))?;
        let hello = Control::Hello(Hello {
            version: PROTOCOL_VERSION,
            proc: inner.proc.clone(),
            incarnation: inner.incarnation,
            peer: peer.clone(),
            listen: Some(inner.advertised),
        });
        let frame = wire::encode_frame(&hello, inner.config.max_frame_bytes)
            .map_err(|e| LinkFailure::Protocol(e.to_string()))?;
        send.write_chunk(frame)
            .await
            .map_err(|e| link::classify_write(&e))?;
        let mut decoder = FrameDecoder::new(inner.config.max_frame_bytes);
        match link::read_value::<Control>(&mut recv, &mut decoder).await {
            Ok(Control::Welcome(w)) if w.proc == *peer => Ok(Handshake {
                conn: conn.clone(),
                send,
                recv,
                decoder,
                incarnation: w.incarnation,
                facts,
            }),
            Ok(Control::Welcome(w)) => Err(LinkFailure::Protocol(format!(
                "dialed {peer} but {} answered",
                w.proc
            ))),
            Ok(Control::Refuse { reason }) => Err(LinkFailure::Refused(reason)),
            Ok(other) => Err(LinkFailure::Protocol(format!(
                "unexpected handshake frame {other:?}"
            ))),
            Err(ReadFailure::Wire(e)) => Err(LinkFailure::Protocol(e.to_string())),
            Err(ReadFailure::Link(f)) => Err(f),
            Err(ReadFailure::Finished) => {
                // The listener refused and closed; its reason comes with the
                // connection close.
                Err(classify(&conn.closed().await))
            }
        }
    }
    .await;
    if result.is_err() {
        link::close(&conn, code::REFUSED, "handshake failed");
    }
    result
}

async fn drive_session(inner: Arc<Inner>, session: Arc<Session>, first_addr: SocketAddr) {
    let peer = session.peer.clone();
    let mut shutdown = inner.shutdown.subscribe();
    let mut known: Option<Incarnation> = None;
    let mut give_up_at: Option<Instant> = None;
    let mut backoff = BACKOFF_FIRST;
    let mut outage_reported = false;
    let mut epoch = 0u64;
    let last_failure = loop {
        if *shutdown.borrow() {
            break LinkFailure::EndpointClosed;
        }
        let addr = inner.route(&peer).unwrap_or(first_addr);
        let attempt = tokio::time::timeout(inner.config.connect_timeout, dial(&inner, &peer, addr))
            .await
            .unwrap_or_else(|_| {
                Err(LinkFailure::Unreachable(format!(
                    "no handshake within {:?}",
                    inner.config.connect_timeout
                )))
            });
        match attempt {
            Ok(hs) => {
                let resumed = known == Some(hs.incarnation);
                if let Some(previous) = known.filter(|k| *k != hs.incarnation) {
                    inner.emit(TransportEvent::PeerRestarted {
                        peer: peer.clone(),
                        previous,
                        current: hs.incarnation,
                    });
                }
                known = Some(hs.incarnation);
                *lock(&session.peer_role) = Some(hs.facts.role);
                epoch += 1;
                tracing::debug!(proc = %inner.proc, %peer, resumed, "outbound link up");
                session.link.send_replace(Link::Up {
                    conn: hs.conn.clone(),
                    epoch,
                    incarnation: hs.incarnation,
                });
                inner.emit(TransportEvent::LinkUp {
                    peer: peer.clone(),
                    direction: Direction::Outbound,
                    incarnation: hs.incarnation,
                    resumed,
                });
                let failure = link::run_control(
                    &hs.conn,
                    hs.send,
                    hs.recv,
                    hs.decoder,
                    inner.config.detector(),
                    hs.facts.not_after,
                    &mut shutdown,
                )
                .await;
                session.link.send_replace(Link::Connecting);
                link::close(&hs.conn, link::close_code(&failure), &failure.to_string());
                if failure == LinkFailure::EndpointClosed {
                    break failure;
                }
                tracing::debug!(proc = %inner.proc, %peer, %failure, "outbound link failed");
                inner.emit(TransportEvent::LinkFailed {
                    peer: peer.clone(),
                    direction: Direction::Outbound,
                    cause: failure.clone(),
                });
                outage_reported = true;
                give_up_at = Some(Instant::now() + inner.config.reconnect_timeout);
                backoff = BACKOFF_FIRST;
            }
            Err(failure) => {
                tracing::debug!(proc = %inner.proc, %peer, %failure, "dial failed");
                if !outage_reported {
                    inner.emit(TransportEvent::LinkFailed {
                        peer: peer.clone(),
                        direction: Direction::Outbound,
                        cause: failure.clone(),
                    });
                    outage_reported = true;
                }
                let deadline = *give_up_at
                    .get_or_insert_with(|| Instant::now() + inner.config.reconnect_timeout);
                let now = Instant::now();
                if now >= deadline {
                    break failure;
                }
                // Biased: see `link::run_control`.
                tokio::select! {
                    biased;
                    _ = shutdown.changed() => {}
                    _ = tokio::time::sleep(backoff.min(deadline - now)) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    };
    close_session(&inner, &session, last_failure);
}

/// Ends a session: no more pairs, everything kept comes back.
fn close_session(inner: &Inner, session: &Arc<Session>, cause: LinkFailure) {
    tracing::debug!(proc = %inner.proc, peer = %session.peer, %cause, "session closed");
    session.link.send_replace(Link::Closed);
    let pairs: Vec<Arc<Pair>> = {
        let mut pairs = lock(&session.pairs);
        pairs.closed = true;
        let mut pairs: Vec<Arc<Pair>> = pairs.map.drain().map(|(_, p)| p).collect();
        // In the order the pairs were made, not the map's (random) order:
        // what comes back, and which senders wake first, replays.
        pairs.sort_by_key(|p| p.epoch);
        pairs
    };
    {
        let mut sessions = lock(&inner.sessions);
        if sessions
            .get(&session.peer)
            .is_some_and(|s| Arc::ptr_eq(s, session))
        {
            sessions.remove(&session.peer);
        }
    }
    if cause != LinkFailure::EndpointClosed {
        inner.emit(TransportEvent::LinkClosed {
            peer: session.peer.clone(),
            cause: cause.clone(),
        });
    }
    for pair in pairs {
        let items = {
            let mut state = lock(&pair.state);
            state.closed = true;
            state.window.give_back_all()
        };
        pair.permits.close();
        inner.give_back(items, UndeliveredCause::LinkFailed(cause.clone()));
    }
}

/// How a pair's stream ended.
enum StreamEnd {
    /// The connection failed or was replaced: wait for the next one.
    LinkLost,
    /// The session closed.
    SessionClosed,
    /// The pair was idle and closed itself.
    Idle,
    /// The peer closed the stream over bad input, or sent bad input itself.
    Refused(String),
}

async fn drive_pair(inner: Arc<Inner>, session: Arc<Session>, pair: Arc<Pair>) {
    let mut link_rx = session.link.subscribe();
    let mut last_epoch = 0u64;
    loop {
        // Wait for a connection newer than the last one used.
        let (conn, epoch, incarnation) = loop {
            let link = link_rx.borrow_and_update().clone();
            match link {
                Link::Up {
                    conn,
                    epoch,
                    incarnation,
                } if epoch != last_epoch => break (conn, epoch, incarnation),
                Link::Closed => return,
                _ => {
                    if link_rx.changed().await.is_err() {
                        return;
                    }
                }
            }
        };
        last_epoch = epoch;
        let restarted = {
            let mut state = lock(&pair.state);
            if state.closed {
                return;
            }
            let restarted = state.incarnation.is_some_and(|i| i != incarnation);
            state.incarnation = Some(incarnation);
            restarted.then(|| state.window.restart_session())
        };
        if let Some(items) = restarted {
            pair.permits.add_permits(items.len());
            inner.give_back(items, UndeliveredCause::PeerRestarted);
        }
        let end = run_stream(&inner, &session, &pair, &conn, &mut link_rx).await;
        match end {
            StreamEnd::LinkLost => {}
            StreamEnd::SessionClosed | StreamEnd::Idle => return,
            StreamEnd::Refused(reason) => {
                let items = lock(&pair.state).window.give_back_written();
                pair.permits.add_permits(items.len());
                inner.give_back(items, UndeliveredCause::StreamClosed(reason));
                // The connection is fine: open a new stream on it.
                last_epoch = 0;
            }
        }
    }
}

/// Opens the pair's stream on `conn`, replays what is kept, and writes new
/// messages until something ends it.
async fn run_stream(
    inner: &Arc<Inner>,
    session: &Arc<Session>,
    pair: &Arc<Pair>,
    conn: &quinn::Connection,
    link_rx: &mut watch::Receiver<Link>,
) -> StreamEnd {
    // Biased (see `link::run_control`): a newer link wins over a stream on
    // the old one.
    let opened = tokio::select! {
        biased;
        _ = link_rx.changed() => return StreamEnd::LinkLost,
        r = conn.open_bi() => r,
    };
    let Ok((mut send, recv)) = opened else {
        return wait_for_new_link(link_rx).await;
    };
    let first_seq = {
        let mut state = lock(&pair.state);
        state.carry.clear();
        state.window.rewind()
    };
    let open = ToReceiver::Open {
        sender: pair.key.0.clone(),
        receiver: pair.key.1.clone(),
        pair_epoch: pair.epoch,
        first_seq,
    };
    let Ok(open) = wire::encode_frame(&open, inner.config.max_frame_bytes) else {
        return StreamEnd::Refused("Open frame does not encode".into());
    };
    if send.write_chunk(open).await.is_err() {
        return wait_for_new_link(link_rx).await;
    }
    lock(&pair.state).stream = Some(send);
    let mut acks: JoinHandle<AckEnd> = tokio::spawn(read_acks(inner.clone(), pair.clone(), recv));
    let mut chunks: Vec<Bytes> = Vec::new();
    // Not before this: the pair was found busy at its last idle check.
    let mut next_idle_check = Instant::now();
    let end = loop {
        let (taken, last_send) = {
            let mut state = lock(&pair.state);
            chunks.append(&mut state.carry);
            state
                .window
                .take_unwritten(|o| chunks.push(o.frame.clone()));
            let taken = if chunks.is_empty() {
                None
            } else {
                state.stream.take()
            };
            (taken, state.last_send)
        };
        if let Some(mut send) = taken {
            crate::spin::poke();
            let write = send.write_all_chunks(&mut chunks);
            let result = tokio::select! {
                biased;
                _ = link_rx.changed() => break StreamEnd::LinkLost,
                r = write => r,
            };
            chunks.clear();
            if let Err(e) = result {
                tracing::debug!(pair = ?pair.key, error = %e, "pair stream write failed");
                break match e {
                    quinn::WriteError::Stopped(_) => refused_reason(&mut acks).await,
                    _ => StreamEnd::LinkLost,
                };
            }
            lock(&pair.state).stream = Some(send);
            continue;
        }
        // Only this driver takes the stream out, so it is in place here.
        chunks.clear();
        let idle_at = (last_send + inner.config.pair_idle_timeout).max(next_idle_check);
        // Biased (see `link::run_control`): the link and the stream's end
        // first (each ready once), then new messages, then the idle check.
        tokio::select! {
            biased;
            changed = link_rx.changed() => {
                break if changed.is_err() { StreamEnd::SessionClosed } else { StreamEnd::LinkLost };
            }
            ack_end = &mut acks => break match ack_end {
                Ok(AckEnd::Closed(reason)) => StreamEnd::Refused(reason),
                Ok(AckEnd::Protocol(e)) => {
                    inner.emit(TransportEvent::ProtocolViolation { peer: session.peer.clone(), error: e.clone() });
                    if let Some(mut send) = lock(&pair.state).stream.take() {
                        let _ = send.reset(code::PROTOCOL);
                    }
                    StreamEnd::Refused(e.to_string())
                }
                Ok(AckEnd::Finished) => StreamEnd::Refused("peer finished the stream".into()),
                Ok(AckEnd::Lost) | Err(_) => StreamEnd::LinkLost,
            },
            _ = pair.wake.notified() => {}
            _ = tokio::time::sleep_until(idle_at) => {
                if close_if_idle(session, pair, inner.config.pair_idle_timeout) {
                    if let Some(mut send) = lock(&pair.state).stream.take() {
                        let _ = send.finish();
                    }
                    break StreamEnd::Idle;
                }
                // Unacknowledged messages (or a send just now): look again
                // later.
                next_idle_check = Instant::now() + inner.config.pair_idle_timeout / 4;
            }
        }
    };
    {
        // The stream is over: later sends wait for the next one.
        let mut state = lock(&pair.state);
        state.stream = None;
        state.carry.clear();
    }
    if !matches!(end, StreamEnd::Idle) {
        acks.abort();
    }
    if matches!(end, StreamEnd::LinkLost) && matches!(&*link_rx.borrow(), Link::Closed) {
        return StreamEnd::SessionClosed;
    }
    end
}

async fn wait_for_new_link(link_rx: &mut watch::Receiver<Link>) -> StreamEnd {
    // The connection failed under us; the session driver notices and
    // publishes a new state.
    match link_rx.changed().await {
        Ok(()) => StreamEnd::LinkLost,
        Err(_) => StreamEnd::SessionClosed,
    }
}

/// The peer stopped our writes: read its final frames for the reason.
async fn refused_reason(acks: &mut JoinHandle<AckEnd>) -> StreamEnd {
    match tokio::time::timeout(Duration::from_secs(1), acks).await {
        Ok(Ok(AckEnd::Closed(reason))) => StreamEnd::Refused(reason),
        Ok(Ok(AckEnd::Protocol(e))) => StreamEnd::Refused(e.to_string()),
        Ok(Ok(AckEnd::Finished)) => StreamEnd::Refused("peer stopped the stream".into()),
        Ok(Ok(AckEnd::Lost)) | Ok(Err(_)) => StreamEnd::LinkLost,
        Err(_) => StreamEnd::Refused("peer stopped the stream".into()),
    }
}

/// Closes the pair if nothing is kept and nothing was sent for
/// `idle_timeout`; later sends make a new pair (with a
/// new epoch, so the receiver starts it fresh).
fn close_if_idle(session: &Session, pair: &Arc<Pair>, idle_timeout: Duration) -> bool {
    let mut pairs = lock(&session.pairs);
    let mut state = lock(&pair.state);
    if !state.window.is_empty() || state.last_send.elapsed() < idle_timeout {
        return false;
    }
    state.closed = true;
    pair.permits.close();
    if pairs
        .map
        .get(&pair.key)
        .is_some_and(|p| Arc::ptr_eq(p, pair))
    {
        pairs.map.remove(&pair.key);
    }
    true
}

/// How the acknowledgement side of a stream ended.
#[derive(Debug)]
enum AckEnd {
    /// The peer closed the stream with a reason.
    Closed(String),
    /// The peer sent bad frames.
    Protocol(WireError),
    /// The peer finished its side.
    Finished,
    /// The stream or connection failed.
    Lost,
}

async fn read_acks(inner: Arc<Inner>, pair: Arc<Pair>, mut recv: RecvStream) -> AckEnd {
    let mut decoder = FrameDecoder::new(inner.config.max_frame_bytes);
    loop {
        let frame = match link::read_value::<ToSender>(&mut recv, &mut decoder).await {
            Ok(frame) => frame,
            Err(ReadFailure::Finished) => return AckEnd::Finished,
            Err(ReadFailure::Wire(e)) => return AckEnd::Protocol(e),
            Err(ReadFailure::Link(_)) => return AckEnd::Lost,
        };
        match frame {
            ToSender::Ack { up_to } => {
                let released = lock(&pair.state).window.ack(up_to);
                match released {
                    Ok(items) => pair.permits.add_permits(items.len()),
                    Err(e) => return AckEnd::Protocol(e),
                }
            }
            ToSender::Reject { seq, cause } => {
                let rejected = lock(&pair.state).window.reject(seq);
                match rejected {
                    Ok(item) => {
                        pair.permits.add_permits(1);
                        inner.give_back(vec![item], UndeliveredCause::Rejected(cause));
                    }
                    Err(e) => return AckEnd::Protocol(e),
                }
            }
            ToSender::Close { reason } => return AckEnd::Closed(reason),
        }
    }
}
