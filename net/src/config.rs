//! The endpoint's configuration.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use crate::error::Error;

/// Everything tunable about an endpoint, with documented defaults. Fields are
/// public; the same-named methods set them builder-style. A controller hands
/// its settings to its procs in their boot (serialized; missing fields take
/// their defaults).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EndpointConfig {
    /// The largest frame body accepted or sent, in bytes. Default 1 MiB;
    /// at most 4 GiB − 1 (the prefix is a `u32`).
    pub max_frame_bytes: usize,
    /// How often each side of a link sends a heartbeat (and the QUIC
    /// keep-alive interval). Default 100 ms.
    pub heartbeat_interval: Duration,
    /// A link silent this long is declared failed (also QUIC's idle
    /// timeout). Default 1 s; at least twice `heartbeat_interval`.
    pub failure_timeout: Duration,
    /// When set, the silence a link allows adapts to the jitter of its
    /// peer's heartbeats (their mean interval plus six standard
    /// deviations; see `docs/semantics.md` §2.4), between this and
    /// `failure_timeout`: a quiet peer that stops is found after about this
    /// long, one whose heartbeats arrive late is given up to
    /// `failure_timeout`. Default `None`: a fixed `failure_timeout`. At
    /// least twice `heartbeat_interval`.
    pub failure_timeout_min: Option<Duration>,
    /// How long one dial (QUIC and TLS handshake plus `Hello`/`Welcome`) may
    /// take. Default 2 s.
    pub connect_timeout: Duration,
    /// After a link fails, how long the sender keeps redialing (with backoff
    /// from 10 ms to 500 ms) and keeps unacknowledged messages for resume
    /// before giving them back as undeliverable. Default 10 s.
    pub reconnect_timeout: Duration,
    /// Messages kept per (sender actor, receiver actor) pair until
    /// acknowledged; `send` waits and `try_send` fails when full. Default
    /// 1024.
    pub send_buffer_messages: NonZeroUsize,
    /// Capacity of each inbox (port). A full inbox stops reading the streams
    /// that feed it, which backs up only their senders. Default 1024.
    pub inbox_messages: NonZeroUsize,
    /// A receiver acknowledges after this many messages of a stream...
    /// Default 64.
    pub ack_every_messages: NonZeroUsize,
    /// ...or this long after the first unacknowledged one. Default 25 ms
    /// (QUIC's own default delay, which this also sets: see
    /// `quic_ack_threshold_packets`). Each acknowledgement sent on the
    /// timer is a packet, and a wake-up of both procs: a 16-proc gather
    /// every 1.4 ms ran 14% more gathers a second at 25 ms than at 5 ms.
    pub ack_delay: Duration,
    /// QUIC acknowledges received packets after this many ack-eliciting
    /// packets or `ack_delay`, whichever comes first (requested from the peer
    /// with the ACK frequency extension; 1 keeps QUIC's default of one ACK
    /// per two packets or 25 ms). Default 16.
    pub quic_ack_threshold_packets: u32,
    /// Concurrent data streams a peer may open to this endpoint (one per
    /// (sender actor, receiver actor) pair with traffic). Default 256.
    pub max_streams_per_peer: u32,
    /// Flow-control window of one stream, in bytes. The connection window is
    /// this times `max_streams_per_peer`, so blocked streams cannot starve
    /// the others. Default 512 KiB.
    pub stream_window_bytes: u32,
    /// A pair's stream with nothing pending is closed after this long idle
    /// (both sides then drop its state). Default 30 s.
    pub pair_idle_timeout: Duration,
    /// Size of the UDP socket's kernel send and receive buffers. Default
    /// 4 MiB (the kernel default of 208 KiB drops packets on loopback).
    pub udp_buffer_bytes: usize,
    /// Capacity of the event channel; events past it are counted and logged,
    /// not queued. Default 4096.
    pub event_buffer: NonZeroUsize,
    /// Peers whose receive state (duplicate detection) is kept; past this,
    /// the state of disconnected peers is dropped, least recent first.
    /// Default 4096.
    pub max_peers: usize,
    /// The address given to peers for replies, when the bound address is not
    /// the one they should use (a proxy, a wildcard bind). Default: the
    /// bound address.
    pub advertised_addr: Option<SocketAddr>,
    /// Incoming connections in their handshake (QUIC, TLS and `Hello`) at
    /// once; each holds about 60 KiB until it completes or fails (within
    /// `connect_timeout`). Past half of it, a dialer whose address is not
    /// validated is sent a stateless QUIC Retry first (a flood of Initials
    /// from spoofed or silent sources then holds no state); past all of it,
    /// attempts wait (see `max_pending_handshakes`). Default 64.
    pub max_handshakes: NonZeroUsize,
    /// Connection attempts with a validated address waiting for a
    /// handshake slot, each for at most `connect_timeout` (then refused).
    /// Also QUIC's limit on attempts not yet taken up (each holds its first
    /// datagrams, at most 16 KiB, 4 MiB for all): past it, quinn refuses at
    /// once. Default 1024.
    pub max_pending_handshakes: NonZeroUsize,
    /// The longest a control thread (the controller's, a proc's) keeps
    /// polling for the next message after it moved one, before it parks;
    /// the window adapts below it (see [`crate::spin`]). Zero: never.
    /// Default 200 us; at most [`MAX_CONTROL_SPIN`].
    pub control_spin: Duration,
}

/// The longest [`EndpointConfig::control_spin`]: past a few hundred
/// microseconds a spin buys nothing a park would not.
pub const MAX_CONTROL_SPIN: Duration = Duration::from_millis(10);

/// The longest duration an [`EndpointConfig`] accepts for any of its
/// timeouts and intervals (one day): longer is surely a mistake, and the
/// bound keeps `Instant` arithmetic far from overflowing.
pub const MAX_CONFIG_DURATION: Duration = Duration::from_secs(24 * 3600);

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: 1 << 20,
            heartbeat_interval: Duration::from_millis(100),
            failure_timeout: Duration::from_secs(1),
            failure_timeout_min: None,
            connect_timeout: Duration::from_secs(2),
            reconnect_timeout: Duration::from_secs(10),
            send_buffer_messages: NonZeroUsize::new(1024).unwrap_or(NonZeroUsize::MIN),
            inbox_messages: NonZeroUsize::new(1024).unwrap_or(NonZeroUsize::MIN),
            ack_every_messages: NonZeroUsize::new(64).unwrap_or(NonZeroUsize::MIN),
            ack_delay: Duration::from_millis(25),
            quic_ack_threshold_packets: 16,
            max_streams_per_peer: 256,
            stream_window_bytes: 512 << 10,
            pair_idle_timeout: Duration::from_secs(30),
            udp_buffer_bytes: 4 << 20,
            event_buffer: NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN),
            max_peers: 4096,
            advertised_addr: None,
            max_handshakes: NonZeroUsize::new(64).unwrap_or(NonZeroUsize::MIN),
            max_pending_handshakes: NonZeroUsize::new(1024).unwrap_or(NonZeroUsize::MIN),
            control_spin: Duration::from_micros(200),
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        impl EndpointConfig {
            $(
                $(#[$doc])*
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = value;
                    self
                }
            )*
        }
    };
}

setters! {
    /// Sets the frame size limit.
    max_frame_bytes: usize;
    /// Sets the heartbeat interval.
    heartbeat_interval: Duration;
    /// Sets the failure timeout.
    failure_timeout: Duration;
    /// Sets the adaptive failure timeout's minimum.
    failure_timeout_min: Option<Duration>;
    /// Sets the connect timeout.
    connect_timeout: Duration;
    /// Sets the reconnect timeout.
    reconnect_timeout: Duration;
    /// Sets the per-pair send buffer.
    send_buffer_messages: NonZeroUsize;
    /// Sets the inbox capacity.
    inbox_messages: NonZeroUsize;
    /// Sets the acknowledgement batch.
    ack_every_messages: NonZeroUsize;
    /// Sets the acknowledgement delay.
    ack_delay: Duration;
    /// Sets the QUIC acknowledgement threshold.
    quic_ack_threshold_packets: u32;
    /// Sets the stream limit per peer.
    max_streams_per_peer: u32;
    /// Sets the per-stream window.
    stream_window_bytes: u32;
    /// Sets the idle timeout of a pair's stream.
    pair_idle_timeout: Duration;
    /// Sets the UDP buffer sizes.
    udp_buffer_bytes: usize;
    /// Sets the event channel capacity.
    event_buffer: NonZeroUsize;
    /// Sets the bound on peers' receive state.
    max_peers: usize;
    /// Sets the advertised address.
    advertised_addr: Option<SocketAddr>;
    /// Sets the bound on incoming handshakes.
    max_handshakes: NonZeroUsize;
    /// Sets the bound on connection attempts waiting for a handshake slot.
    max_pending_handshakes: NonZeroUsize;
    /// Sets the control threads' spin window.
    control_spin: Duration;
}

impl EndpointConfig {
    /// Checks the values against each other.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(m));
        if self.max_frame_bytes == 0 || self.max_frame_bytes > u32::MAX as usize {
            return bad(format!(
                "max_frame_bytes = {} is not in 1..=u32::MAX",
                self.max_frame_bytes
            ));
        }
        for (name, d) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("failure_timeout", self.failure_timeout),
            ("connect_timeout", self.connect_timeout),
            ("reconnect_timeout", self.reconnect_timeout),
            ("ack_delay", self.ack_delay),
            ("pair_idle_timeout", self.pair_idle_timeout),
        ] {
            if d > MAX_CONFIG_DURATION {
                return bad(format!(
                    "{name} = {d:?} is longer than {MAX_CONFIG_DURATION:?}"
                ));
            }
        }
        if self.control_spin > MAX_CONTROL_SPIN {
            return bad(format!(
                "control_spin = {:?} is longer than {MAX_CONTROL_SPIN:?}",
                self.control_spin
            ));
        }
        if self.heartbeat_interval.is_zero() {
            return bad("heartbeat_interval is zero".into());
        }
        if self.failure_timeout < self.heartbeat_interval * 2 {
            return bad(format!(
                "failure_timeout {:?} is under twice heartbeat_interval {:?}",
                self.failure_timeout, self.heartbeat_interval
            ));
        }
        if let Some(min) = self.failure_timeout_min
            && (min < self.heartbeat_interval * 2 || min > self.failure_timeout)
        {
            return bad(format!(
                "failure_timeout_min {min:?} is not between twice heartbeat_interval {:?} \
                 and failure_timeout {:?}",
                self.heartbeat_interval, self.failure_timeout
            ));
        }
        if self.connect_timeout.is_zero() || self.ack_delay.is_zero() {
            return bad("connect_timeout and ack_delay must be positive".into());
        }
        if self.max_streams_per_peer == 0 || self.stream_window_bytes == 0 {
            return bad("max_streams_per_peer and stream_window_bytes must be positive".into());
        }
        if self.quic_ack_threshold_packets == 0 {
            return bad("quic_ack_threshold_packets is zero".into());
        }
        if self.max_peers == 0 {
            return bad("max_peers is zero".into());
        }
        Ok(())
    }
}

impl EndpointConfig {
    /// A new link's heartbeat interval and failure detector.
    pub(crate) fn detector(&self) -> (Duration, crate::detector::Detector) {
        (
            self.heartbeat_interval,
            crate::detector::Detector::new(
                tokio::time::Instant::now(),
                self.heartbeat_interval,
                self.failure_timeout,
                self.failure_timeout_min,
            ),
        )
    }
}
