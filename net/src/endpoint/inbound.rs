//! The receiving side: admitting connection attempts (a bounded number of
//! handshakes at once, a stateless Retry for unvalidated dialers under
//! load), accepting connections (TLS verified by rustls, the claimed proc
//! checked against the certificate, its role read from it), the handshake,
//! and one task per data stream that checks, deduplicates, delivers and
//! acknowledges.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use quinn::{RecvStream, SendStream};
use rustls_pki_types::CertificateDer;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::outbound::PairKey;
use super::{Delivering, Inner, PortEntry, lock};
use crate::error::LinkFailure;
use crate::event::{Direction, TransportEvent};
use crate::id::{Incarnation, PortId, ProcId, Seq};
use crate::link::{self, READ_CHUNK_BYTES, ReadFailure, code};
use crate::session::{RecvWindow, Verdict};
use crate::tls::{CertificateFacts, Role, certificate_facts, verify_proc_identity};
use crate::wire::{
    self, Control, FrameDecoder, Hello, PROTOCOL_VERSION, RejectCause, ToReceiver, ToSender,
    Welcome, WireError,
};

type SharedWindow = Arc<tokio::sync::Mutex<RecvWindow>>;

/// Receive state of every peer that dialed this endpoint.
#[derive(Default)]
pub(crate) struct InboundPeers {
    map: Mutex<HashMap<ProcId, PeerEntry>>,
    /// Connection attempts sent a Retry, and refused for want of a slot.
    retried: AtomicU64,
    refused: AtomicU64,
}

struct PeerEntry {
    state: Arc<PeerRecv>,
    conn: Option<quinn::Connection>,
    /// The role of the certificate of its latest connection.
    role: Role,
    last_active: Instant,
}

/// Receive state of one incarnation of a peer.
pub(crate) struct PeerRecv {
    incarnation: Incarnation,
    pairs: Mutex<HashMap<PairKey, (u64, SharedWindow)>>,
    max_pairs: usize,
}

impl InboundPeers {
    /// Records a new connection from `proc`; a connection it replaces is
    /// closed, and a new incarnation gets fresh state. Returns the state and
    /// the previous incarnation if this one is different.
    fn register(
        &self,
        proc: &ProcId,
        incarnation: Incarnation,
        role: Role,
        conn: quinn::Connection,
        max_peers: usize,
        max_pairs: usize,
    ) -> (Arc<PeerRecv>, Option<Incarnation>, bool) {
        let fresh = || {
            Arc::new(PeerRecv {
                incarnation,
                pairs: Mutex::default(),
                max_pairs,
            })
        };
        let mut map = lock(&self.map);
        if let Some(entry) = map.get_mut(proc) {
            if let Some(old) = entry.conn.replace(conn) {
                link::close(&old, code::REPLACED, "replaced by a newer connection");
            }
            entry.role = role;
            entry.last_active = Instant::now();
            if entry.state.incarnation == incarnation {
                return (entry.state.clone(), None, true);
            }
            let previous = entry.state.incarnation;
            entry.state = fresh();
            return (entry.state.clone(), Some(previous), false);
        }
        if map.len() >= max_peers {
            // Forget the least recently active disconnected peer.
            // Ties (common under a paused clock) go to the smallest id, not
            // to the map's random order.
            let victim = map
                .iter()
                .filter(|(_, e)| e.conn.is_none())
                .min_by(|(p, e), (q, f)| e.last_active.cmp(&f.last_active).then_with(|| p.cmp(q)))
                .map(|(p, _)| p.clone());
            if let Some(victim) = victim {
                tracing::debug!(peer = %victim, "forgetting receive state of an idle peer");
                map.remove(&victim);
            }
        }
        let state = fresh();
        map.insert(
            proc.clone(),
            PeerEntry {
                state: state.clone(),
                conn: Some(conn),
                role,
                last_active: Instant::now(),
            },
        );
        (state, None, false)
    }

    /// The role of `proc`'s latest inbound connection.
    pub(crate) fn role(&self, proc: &ProcId) -> Option<Role> {
        lock(&self.map).get(proc).map(|e| e.role)
    }

    /// (attempts sent a Retry, attempts refused for want of a slot).
    pub(crate) fn admission_counts(&self) -> (u64, u64) {
        (
            self.retried.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }

    fn disconnected(&self, proc: &ProcId, conn: &quinn::Connection) {
        let mut map = lock(&self.map);
        if let Some(entry) = map.get_mut(proc)
            && entry
                .conn
                .as_ref()
                .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            entry.conn = None;
            entry.last_active = Instant::now();
        }
    }
}

impl PeerRecv {
    fn window(&self, key: &PairKey, epoch: u64) -> SharedWindow {
        let mut pairs = lock(&self.pairs);
        if let Some((e, w)) = pairs.get(key)
            && *e == epoch
        {
            return w.clone();
        }
        if pairs.len() >= self.max_pairs {
            // Drop the state of pairs no stream is using (their senders
            // start a new epoch when they come back).
            pairs.retain(|_, (_, w)| Arc::strong_count(w) > 1);
        }
        let w = Arc::new(tokio::sync::Mutex::new(RecvWindow::new(epoch)));
        pairs.insert(key.clone(), (epoch, w.clone()));
        w
    }

    fn remove(&self, key: &PairKey, window: &SharedWindow) {
        let mut pairs = lock(&self.pairs);
        if pairs.get(key).is_some_and(|(_, w)| Arc::ptr_eq(w, window)) {
            pairs.remove(key);
        }
    }
}

/// What to do with a connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Take a handshake slot now.
    Accept,
    /// Answer with a stateless Retry: the dialer must prove it receives at
    /// its address before it gets any state.
    Retry,
    /// Wait (up to `connect_timeout`) for a slot.
    Wait,
    /// Refuse at once.
    Refuse,
}

/// The admission policy (no I/O): unvalidated dialers are accepted while
/// under half the handshake slots are taken and sent a Retry past that;
/// validated ones take a free slot, or wait while fewer than
/// `max_pending` wait, or are refused.
pub(crate) fn admission(
    validated: bool,
    in_flight: usize,
    pending: usize,
    max_handshakes: usize,
    max_pending: usize,
) -> Admission {
    if !validated && in_flight >= max_handshakes / 2 {
        Admission::Retry
    } else if in_flight < max_handshakes {
        Admission::Accept
    } else if pending < max_pending {
        Admission::Wait
    } else {
        Admission::Refuse
    }
}

/// Admits connection attempts until the endpoint closes (see
/// [`admission`]). Nothing here waits: a flood is answered as fast as it
/// comes.
pub(crate) async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.quic.accept().await {
        let pending = inner.pending_handshakes.load(Ordering::Relaxed);
        let max_pending = inner.config.max_pending_handshakes.get();
        let decision = admission(
            incoming.remote_address_validated(),
            inner.handshakes_in_flight(),
            pending,
            inner.config.max_handshakes.get(),
            max_pending,
        );
        let permit = match decision {
            Admission::Retry => {
                let n = inner.inbound.retried.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::info!(proc = %inner.proc, retried = n, "handshakes under load: unvalidated dialers sent a Retry");
                }
                // Not validated implies may_retry (quinn's guarantee); refuse
                // if it says otherwise.
                if let Err(e) = incoming.retry() {
                    e.into_incoming().refuse();
                }
                continue;
            }
            Admission::Refuse => None,
            Admission::Accept | Admission::Wait => {
                inner.handshakes.clone().try_acquire_owned().ok()
            }
        };
        if let Some(permit) = permit {
            tokio::spawn(handle_incoming(inner.clone(), incoming, permit));
        } else if pending < max_pending {
            inner.pending_handshakes.fetch_add(1, Ordering::Relaxed);
            let inner = inner.clone();
            tokio::spawn(async move {
                let slots = inner.handshakes.clone();
                let permit =
                    tokio::time::timeout(inner.config.connect_timeout, slots.acquire_owned()).await;
                inner.pending_handshakes.fetch_sub(1, Ordering::Relaxed);
                match permit {
                    Ok(Ok(permit)) => handle_incoming(inner, incoming, permit).await,
                    _ => refuse_attempt(&inner, incoming),
                }
            });
        } else {
            refuse_attempt(&inner, incoming);
        }
    }
}

fn refuse_attempt(inner: &Inner, incoming: quinn::Incoming) {
    let n = inner.inbound.refused.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        tracing::warn!(proc = %inner.proc, refused = n, remote = %incoming.remote_address(), "no handshake slot: connection attempts refused");
    }
    incoming.refuse();
}

/// Runs one admitted connection; `slot` is held until its `Hello` is
/// checked.
async fn handle_incoming(inner: Arc<Inner>, incoming: quinn::Incoming, slot: OwnedSemaphorePermit) {
    let remote = incoming.remote_address();
    let timeout = inner.config.connect_timeout;
    let refused = |claimed: Option<ProcId>, reason: String| {
        tracing::info!(proc = %inner.proc, %remote, ?claimed, %reason, "inbound connection refused");
        inner.emit(TransportEvent::Refused {
            remote,
            claimed,
            reason,
        });
    };
    let conn = match tokio::time::timeout(timeout, incoming).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return refused(None, format!("handshake failed: {e}")),
        Err(_) => return refused(None, format!("no handshake within {timeout:?}")),
    };
    let chain: Vec<CertificateDer<'static>> = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|b| *b)
        .unwrap_or_default();
    let hello = async {
        let (send, mut recv) = conn.accept_bi().await.map_err(|e| link::classify(&e))?;
        let mut decoder = FrameDecoder::new(inner.config.max_frame_bytes);
        match link::read_value::<Control>(&mut recv, &mut decoder).await {
            Ok(Control::Hello(hello)) => Ok((send, recv, decoder, hello)),
            Ok(other) => Err(LinkFailure::Protocol(format!(
                "expected Hello, got {other:?}"
            ))),
            Err(ReadFailure::Wire(e)) => Err(LinkFailure::Protocol(e.to_string())),
            Err(ReadFailure::Link(f)) => Err(f),
            Err(ReadFailure::Finished) => Err(LinkFailure::Protocol("no Hello".into())),
        }
    };
    let (mut send, recv, decoder, hello) = match tokio::time::timeout(timeout, hello).await {
        Ok(Ok(x)) => x,
        Ok(Err(f)) => {
            link::close(&conn, code::REFUSED, &f.to_string());
            return refused(None, f.to_string());
        }
        Err(_) => {
            link::close(&conn, code::REFUSED, "no Hello in time");
            return refused(None, format!("no Hello within {timeout:?}"));
        }
    };
    let facts = match check_hello(&inner, &hello, &chain) {
        Ok(facts) => facts,
        Err(reason) => {
            drop(slot);
            if let Ok(frame) = wire::encode_frame(
                &Control::Refuse {
                    reason: reason.clone(),
                },
                inner.config.max_frame_bytes,
            ) {
                let _ = send.write_chunk(frame).await;
                let _ = send.finish();
            }
            link::close(&conn, code::REFUSED, &reason);
            return refused(Some(hello.proc), reason);
        }
    };
    drop(slot);
    let peer = hello.proc.clone();
    let max_pairs = (inner.config.max_streams_per_peer as usize).saturating_mul(4);
    let (state, previous, resumed) = inner.inbound.register(
        &peer,
        hello.incarnation,
        facts.role,
        conn.clone(),
        inner.config.max_peers,
        max_pairs,
    );
    if let Some(addr) = hello.listen {
        inner.learn_route(&peer, addr, previous.is_some());
    }
    let welcome = Control::Welcome(Welcome {
        proc: inner.proc.clone(),
        incarnation: inner.incarnation,
    });
    let sent = match wire::encode_frame(&welcome, inner.config.max_frame_bytes) {
        Ok(frame) => send.write_chunk(frame).await.is_ok(),
        Err(_) => false,
    };
    if !sent {
        inner.inbound.disconnected(&peer, &conn);
        return;
    }
    if let Some(previous) = previous {
        inner.emit(TransportEvent::PeerRestarted {
            peer: peer.clone(),
            previous,
            current: hello.incarnation,
        });
    }
    tracing::debug!(proc = %inner.proc, %peer, role = %facts.role, resumed, "inbound link up");
    inner.emit(TransportEvent::LinkUp {
        peer: peer.clone(),
        direction: Direction::Inbound,
        incarnation: hello.incarnation,
        resumed,
    });
    let streams = tokio::spawn(accept_streams(
        inner.clone(),
        conn.clone(),
        peer.clone(),
        facts.role,
        state,
    ));
    let mut shutdown = inner.shutdown.subscribe();
    let failure = link::run_control(
        &conn,
        send,
        recv,
        decoder,
        inner.config.detector(),
        facts.not_after,
        &mut shutdown,
    )
    .await;
    link::close(&conn, link::close_code(&failure), &failure.to_string());
    streams.abort();
    inner.inbound.disconnected(&peer, &conn);
    if failure != LinkFailure::EndpointClosed {
        tracing::debug!(proc = %inner.proc, %peer, %failure, "inbound link failed");
        inner.emit(TransportEvent::LinkFailed {
            peer,
            direction: Direction::Inbound,
            cause: failure,
        });
    }
}

/// Checks a dialer's `Hello` against its (chain-verified) certificate and
/// reads the certificate's role and expiry.
fn check_hello(
    inner: &Inner,
    hello: &Hello,
    chain: &[CertificateDer<'_>],
) -> Result<CertificateFacts, String> {
    if hello.version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} (this proc speaks {PROTOCOL_VERSION})",
            hello.version
        ));
    }
    if hello.peer != inner.proc {
        return Err(format!("dialed {} but this is {}", hello.peer, inner.proc));
    }
    verify_proc_identity(chain, &hello.proc).map_err(|e| e.to_string())?;
    let leaf = chain.first().ok_or("no certificate")?;
    let facts =
        certificate_facts(leaf).map_err(|e| format!("certificate of {}: {e}", hello.proc))?;
    // rustls checked the dates; this holds even if that check were skipped.
    if facts.expired_at(std::time::SystemTime::now()) {
        return Err(format!(
            "the certificate of {} expired at {}",
            hello.proc,
            crate::tls::utc_date(facts.not_after)
        ));
    }
    Ok(facts)
}

async fn accept_streams(
    inner: Arc<Inner>,
    conn: quinn::Connection,
    peer: ProcId,
    role: Role,
    state: Arc<PeerRecv>,
) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(receive_stream(
            inner.clone(),
            peer.clone(),
            role,
            state.clone(),
            send,
            recv,
        ));
    }
}

/// What a receiving stream writes back, batched per read.
struct Replies {
    frames: Vec<Bytes>,
    max_frame_bytes: usize,
}

impl Replies {
    fn push(&mut self, frame: &ToSender) {
        // ToSender frames are a few bytes; only a Close reason could be long,
        // and it is cut to fit.
        match wire::encode_frame(frame, self.max_frame_bytes) {
            Ok(f) => self.frames.push(f),
            Err(e) => tracing::error!(error = %e, "cannot encode a reply frame"),
        }
    }

    async fn flush(&mut self, send: &mut SendStream) -> bool {
        if self.frames.is_empty() {
            return true;
        }
        let ok = send.write_all_chunks(&mut self.frames).await.is_ok();
        self.frames.clear();
        ok
    }
}

async fn receive_stream(
    inner: Arc<Inner>,
    peer: ProcId,
    role: Role,
    state: Arc<PeerRecv>,
    mut send: SendStream,
    mut recv: RecvStream,
) {
    let max = inner.config.max_frame_bytes;
    let mut decoder = FrameDecoder::new(max);
    let mut replies = Replies {
        frames: Vec::new(),
        max_frame_bytes: max,
    };
    let (key, epoch, first_seq) =
        match link::read_value::<ToReceiver>(&mut recv, &mut decoder).await {
            Ok(ToReceiver::Open {
                sender,
                receiver,
                pair_epoch,
                first_seq,
            }) => ((sender, receiver), pair_epoch, first_seq),
            Ok(ToReceiver::Message(_)) => {
                let e = WireError::Protocol("stream starts without Open".into());
                return violation(&inner, &peer, e, None, &mut replies, &mut send, &mut recv).await;
            }
            Err(ReadFailure::Wire(e)) => {
                return violation(&inner, &peer, e, None, &mut replies, &mut send, &mut recv).await;
            }
            Err(_) => return,
        };
    if key.0.proc != peer {
        let e = WireError::Protocol(format!(
            "sender {} is not of the authenticated proc {peer}",
            key.0
        ));
        return violation(&inner, &peer, e, None, &mut replies, &mut send, &mut recv).await;
    }
    if key.1.proc != inner.proc {
        let e = WireError::Protocol(format!("receiver {} is not of this proc", key.1));
        return violation(&inner, &peer, e, None, &mut replies, &mut send, &mut recv).await;
    }
    let window = state.window(&key, epoch);
    let mut cursor = match window.lock().await.open(first_seq) {
        Ok(c) => c,
        Err(e) => {
            return violation(&inner, &peer, e, None, &mut replies, &mut send, &mut recv).await;
        }
    };
    // The highest sequence seen on this stream; acknowledgements never go
    // past it (the sender may not have rewritten later ones here yet).
    let mut last_seen: Option<Seq> = None;
    let mut last_acked: Option<Seq> = None;
    let mut unacked = 0usize;
    let mut ack_due: Option<Instant> = None;
    let mut port_cache: Option<(PortId, PortEntry)> = None;
    let ack_every = inner.config.ack_every_messages.get();
    loop {
        // Handle every complete frame buffered (the first read may have
        // brought messages along with the Open).
        if decoder.buffered() > 0 {
            let mut w = window.lock().await;
            loop {
                let body = match decoder.next_frame() {
                    Ok(Some(body)) => body,
                    Ok(None) => break,
                    Err(e) => {
                        drop(w);
                        return violation(
                            &inner,
                            &peer,
                            e,
                            last_seen,
                            &mut replies,
                            &mut send,
                            &mut recv,
                        )
                        .await;
                    }
                };
                let frame_bytes = body.len() + wire::LENGTH_PREFIX_BYTES;
                let envelope = match wire::decode_body::<ToReceiver>(&body) {
                    Ok(ToReceiver::Message(envelope)) => envelope,
                    Ok(ToReceiver::Open { .. }) => {
                        drop(w);
                        let e = WireError::Protocol("second Open on a stream".into());
                        return violation(
                            &inner,
                            &peer,
                            e,
                            last_seen,
                            &mut replies,
                            &mut send,
                            &mut recv,
                        )
                        .await;
                    }
                    Err(e) => {
                        drop(w);
                        return violation(
                            &inner,
                            &peer,
                            e,
                            last_seen,
                            &mut replies,
                            &mut send,
                            &mut recv,
                        )
                        .await;
                    }
                };
                if envelope.sender != key.0 || envelope.receiver.actor != key.1 {
                    drop(w);
                    let e = WireError::Protocol(format!(
                        "message {} -> {} on the stream of {} -> {}",
                        envelope.sender, envelope.receiver, key.0, key.1
                    ));
                    return violation(
                        &inner,
                        &peer,
                        e,
                        last_seen,
                        &mut replies,
                        &mut send,
                        &mut recv,
                    )
                    .await;
                }
                let seq = envelope.seq;
                match w.arrive(&mut cursor, seq) {
                    Ok(Verdict::Deliver) => {
                        inner.traffic.received(frame_bytes);
                        let outcome =
                            match inner.try_deliver_remote(envelope, role, &mut port_cache) {
                                Ok(()) => Ok(()),
                                Err(Delivering::Rejected(cause)) => Err(cause),
                                Err(Delivering::Full(inbox, delivery)) => inbox
                                    .send(*delivery)
                                    .await
                                    .map_err(|_| RejectCause::NoSuchPort),
                            };
                        if let Err(cause) = &outcome {
                            tracing::debug!(proc = %inner.proc, %peer, seq = seq.0, %cause, "message rejected");
                            replies.push(&ToSender::Reject {
                                seq,
                                cause: cause.clone(),
                            });
                        }
                        w.handled(seq, outcome.err());
                    }
                    Ok(Verdict::Duplicate(rejected)) => {
                        tracing::trace!(seq = seq.0, "duplicate dropped");
                        if let Some(cause) = rejected {
                            replies.push(&ToSender::Reject { seq, cause });
                        }
                    }
                    Err(e) => {
                        drop(w);
                        return violation(
                            &inner,
                            &peer,
                            e,
                            last_seen,
                            &mut replies,
                            &mut send,
                            &mut recv,
                        )
                        .await;
                    }
                }
                last_seen = Some(seq);
                unacked += 1;
            }
            drop(w);
            if unacked >= ack_every || !replies.frames.is_empty() {
                if let Some(up_to) = last_seen.filter(|s| Some(*s) != last_acked) {
                    replies.push(&ToSender::Ack { up_to });
                    last_acked = Some(up_to);
                }
                unacked = 0;
                ack_due = None;
            } else if unacked > 0 && ack_due.is_none() {
                ack_due = Some(Instant::now() + inner.config.ack_delay);
            }
            if !replies.flush(&mut send).await {
                return;
            }
        }
        // Biased (see `link::run_control`): the acknowledgement timer first;
        // it is ready once per batch, so a busy stream cannot starve it.
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(ack_due.unwrap_or_else(Instant::now)), if ack_due.is_some() => {
                ack_due = None;
                unacked = 0;
                if let Some(up_to) = last_seen.filter(|s| Some(*s) != last_acked) {
                    replies.push(&ToSender::Ack { up_to });
                    last_acked = Some(up_to);
                }
                if !replies.flush(&mut send).await {
                    return;
                }
            }
            chunk = recv.read_chunk(READ_CHUNK_BYTES, true) => match chunk {
                Ok(Some(chunk)) => {
                    crate::spin::arrived();
                    decoder.push(&chunk.bytes)
                }
                Ok(None) => {
                    if let Err(e) = decoder.finish() {
                        return violation(&inner, &peer, e, last_seen, &mut replies, &mut send, &mut recv).await;
                    }
                    if let Some(up_to) = last_seen.filter(|s| Some(*s) != last_acked) {
                        replies.push(&ToSender::Ack { up_to });
                    }
                    replies.flush(&mut send).await;
                    let _ = send.finish();
                    // The sender finishes a pair only when everything is
                    // acknowledged; a later pair of the same actors gets a new
                    // epoch.
                    state.remove(&key, &window);
                    return;
                }
                Err(_) => return,
            },
        }
    }
}

/// Bad input on a stream: report it, acknowledge what was handled, tell the
/// sender why, and close the stream both ways.
async fn violation(
    inner: &Inner,
    peer: &ProcId,
    error: WireError,
    last_seen: Option<Seq>,
    replies: &mut Replies,
    send: &mut SendStream,
    recv: &mut RecvStream,
) {
    tracing::warn!(proc = %inner.proc, %peer, %error, "closing a stream over bad input");
    if let Some(up_to) = last_seen {
        replies.push(&ToSender::Ack { up_to });
    }
    let mut reason = error.to_string();
    let mut cut = reason.len().min(1024);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    reason.truncate(cut);
    replies.push(&ToSender::Close { reason });
    replies.flush(send).await;
    let _ = send.finish();
    let _ = recv.stop(code::PROTOCOL);
    inner.emit(TransportEvent::ProtocolViolation {
        peer: peer.clone(),
        error,
    });
}
