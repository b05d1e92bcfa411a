//! What both ends of a connection share: error codes, reading frames from a
//! QUIC stream, and the control stream's heartbeat loop (failure detection).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use quinn::{ConnectionError, ReadError, RecvStream, SendStream, VarInt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::detector::Detector;
use crate::error::LinkFailure;
use crate::wire::{self, Control, FrameDecoder, WireError};

/// Application error codes on connections and streams.
pub(crate) mod code {
    use quinn::VarInt;
    /// Orderly shutdown of the endpoint.
    pub(crate) const SHUTDOWN: VarInt = VarInt::from_u32(1);
    /// The handshake was refused (identity, version).
    pub(crate) const REFUSED: VarInt = VarInt::from_u32(2);
    /// The link was declared failed by this side.
    pub(crate) const FAILED: VarInt = VarInt::from_u32(3);
    /// A newer connection from the same peer replaced this one.
    pub(crate) const REPLACED: VarInt = VarInt::from_u32(4);
    /// Bad input on a stream.
    pub(crate) const PROTOCOL: VarInt = VarInt::from_u32(5);
}

/// Largest chunk read from a stream at once.
pub(crate) const READ_CHUNK_BYTES: usize = 64 << 10;

/// The code a link closes its connection with after `failure`: an orderly
/// shutdown when this endpoint is closing (the peer then learns that this
/// side shut down, not that the link failed), else a failure.
pub(crate) fn close_code(failure: &LinkFailure) -> VarInt {
    if *failure == LinkFailure::EndpointClosed {
        code::SHUTDOWN
    } else {
        code::FAILED
    }
}

/// Classifies a connection error as a link failure.
pub(crate) fn classify(e: &ConnectionError) -> LinkFailure {
    match e {
        ConnectionError::TimedOut => LinkFailure::IdleTimeout,
        ConnectionError::LocallyClosed => LinkFailure::EndpointClosed,
        ConnectionError::TransportError(t) if is_crypto(u64::from(t.code)) => {
            LinkFailure::Refused(t.to_string())
        }
        ConnectionError::ConnectionClosed(c) if is_crypto(u64::from(c.error_code)) => {
            LinkFailure::Refused(c.to_string())
        }
        ConnectionError::ApplicationClosed(c) if c.error_code == code::REFUSED => {
            LinkFailure::Refused(String::from_utf8_lossy(&c.reason).into_owned())
        }
        ConnectionError::ApplicationClosed(c) if c.error_code == code::SHUTDOWN => {
            LinkFailure::PeerShutdown
        }
        other => LinkFailure::ConnectionLost(other.to_string()),
    }
}

/// TLS alerts travel as QUIC crypto errors 0x100..=0x1ff.
fn is_crypto(code: u64) -> bool {
    (0x100..=0x1ff).contains(&code)
}

/// Classifies a stream read error.
pub(crate) fn classify_read(e: &ReadError) -> LinkFailure {
    match e {
        ReadError::ConnectionLost(c) => classify(c),
        other => LinkFailure::ConnectionLost(other.to_string()),
    }
}

/// Classifies a stream write error.
pub(crate) fn classify_write(e: &quinn::WriteError) -> LinkFailure {
    match e {
        quinn::WriteError::ConnectionLost(c) => classify(c),
        other => LinkFailure::ConnectionLost(other.to_string()),
    }
}

/// Why reading a frame from a stream stopped.
#[derive(Debug)]
pub(crate) enum ReadFailure {
    /// The bytes were bad.
    Wire(WireError),
    /// The stream or connection failed.
    Link(LinkFailure),
    /// The stream ended cleanly on a frame boundary.
    Finished,
}

/// Reads the next frame body, pulling chunks as needed.
pub(crate) async fn read_frame(
    recv: &mut RecvStream,
    decoder: &mut FrameDecoder,
) -> Result<Bytes, ReadFailure> {
    loop {
        if let Some(body) = decoder.next_frame().map_err(ReadFailure::Wire)? {
            return Ok(body);
        }
        match recv.read_chunk(READ_CHUNK_BYTES, true).await {
            Ok(Some(chunk)) => decoder.push(&chunk.bytes),
            Ok(None) => {
                decoder.finish().map_err(ReadFailure::Wire)?;
                return Err(ReadFailure::Finished);
            }
            Err(e) => return Err(ReadFailure::Link(classify_read(&e))),
        }
    }
}

/// Reads and decodes the next frame.
pub(crate) async fn read_value<T: DeserializeOwned>(
    recv: &mut RecvStream,
    decoder: &mut FrameDecoder,
) -> Result<T, ReadFailure> {
    let body = read_frame(recv, decoder).await?;
    wire::decode_body(&body).map_err(ReadFailure::Wire)
}

/// How long until `t` (zero if it passed).
pub(crate) fn until(t: SystemTime) -> Duration {
    t.duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

/// Runs the control stream after the handshake: sends a heartbeat every
/// `heartbeat_interval`, and returns the failure when the peer has been
/// silent for longer than `detector` allows (the failure timeout, or an
/// allowance adapted to the heartbeats' jitter), the connection closes, the
/// peer breaks the protocol, the peer's certificate expires
/// (`peer_not_after`), or the endpoint shuts down.
pub(crate) async fn run_control(
    conn: &quinn::Connection,
    mut send: SendStream,
    mut recv: RecvStream,
    mut decoder: FrameDecoder,
    (heartbeat_interval, mut detector): (Duration, Detector),
    peer_not_after: SystemTime,
    shutdown: &mut watch::Receiver<bool>,
) -> LinkFailure {
    // A certificate is valid through its last second (webpki compares whole
    // seconds), so it has expired one second after `not_after`
    // (`CertificateFacts::expired_at`). tokio's sleep
    // takes any duration (a far expiry sleeps "forever").
    let expiry = tokio::time::sleep(until(peer_not_after).saturating_add(Duration::from_secs(1)));
    tokio::pin!(expiry);
    let heartbeat = match wire::encode_frame(&Control::Heartbeat, usize::MAX) {
        Ok(frame) => frame,
        Err(e) => return LinkFailure::Protocol(e.to_string()),
    };
    // One timer for both duties: the next heartbeat to send, and the
    // moment the peer's silence would pass the detector's allowance (so a
    // silence is found when it passes, not at the next periodic check).
    let mut next_heartbeat = Instant::now();
    let timer = tokio::time::sleep_until(next_heartbeat);
    tokio::pin!(timer);
    loop {
        // Frames that came along with the handshake.
        loop {
            match decoder.next_frame() {
                Ok(Some(body)) => match wire::decode_body::<Control>(&body) {
                    Ok(Control::Heartbeat) => detector.heard(Instant::now()),
                    Ok(other) => {
                        return LinkFailure::Protocol(format!(
                            "unexpected control frame {other:?}"
                        ));
                    }
                    Err(e) => return LinkFailure::Protocol(e.to_string()),
                },
                Ok(None) => break,
                Err(e) => return LinkFailure::Protocol(e.to_string()),
            }
        }
        if *shutdown.borrow() {
            return LinkFailure::EndpointClosed;
        }
        timer
            .as_mut()
            .reset(next_heartbeat.min(detector.deadline()));
        // Biased (fixed order, as in every select of this crate): a random
        // order is drawn from tokio's per-runtime generator, which cannot be
        // seeded on stable tokio, and would break replay in simulation.
        // Rare events first; the timer before the stream, so a peer that
        // floods the control stream cannot starve the heartbeats (the timer
        // is set in the future after each firing, so it starves nothing).
        tokio::select! {
            biased;
            _ = shutdown.changed() => return LinkFailure::EndpointClosed,
            e = conn.closed() => return classify(&e),
            () = &mut expiry => {
                return LinkFailure::Refused(format!(
                    "the peer's certificate expired at {}",
                    crate::tls::utc_date(peer_not_after)
                ));
            }
            () = &mut timer => {
                let now = Instant::now();
                if let Some(silent_for) = detector.failed(now) {
                    // The timer wins ties: after this process was starved
                    // (descheduled, stopped), the peer's heartbeats may sit
                    // unread. Heard now is heard: take what is there first.
                    tokio::select! {
                        biased;
                        chunk = recv.read_chunk(READ_CHUNK_BYTES, true) => match chunk {
                            Ok(Some(chunk)) => {
                                detector.heard(now);
                                decoder.push(&chunk.bytes);
                                continue;
                            }
                            Ok(None) => {
                                return LinkFailure::ConnectionLost(
                                    "control stream finished".into(),
                                );
                            }
                            Err(e) => return classify_read(&e),
                        },
                        () = std::future::ready(()) => {
                            return LinkFailure::HeartbeatTimeout { silent_for };
                        }
                    }
                }
                if now >= next_heartbeat {
                    next_heartbeat = now + heartbeat_interval;
                    // Heartbeats are 5 bytes against a window of hundreds of
                    // KiB, so this write does not wait on a silent peer.
                    if let Err(e) = send.write_chunk(heartbeat.clone()).await {
                        return classify_write(&e);
                    }
                }
            }
            chunk = recv.read_chunk(READ_CHUNK_BYTES, true) => match chunk {
                Ok(Some(chunk)) => {
                    detector.heard(Instant::now());
                    decoder.push(&chunk.bytes);
                }
                Ok(None) => {
                    return LinkFailure::ConnectionLost("control stream finished".into());
                }
                Err(e) => return classify_read(&e),
            },
        }
    }
}

/// Closes a connection with `code`, giving the reason in words.
pub(crate) fn close(conn: &quinn::Connection, code: VarInt, reason: &str) {
    conn.close(code, reason.as_bytes());
}
