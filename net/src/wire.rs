//! The wire: length-prefixed frames, the envelope, the protocol frames and
//! their codec. No sockets here: everything is bytes in, values out, so the
//! fuzz targets and proptests drive exactly the code the transport runs.
//!
//! A frame is a 4-byte little-endian body length followed by the body, a
//! [postcard](https://docs.rs/postcard) encoding of one protocol value. The
//! length is checked against `max_frame_bytes` before any of the body is
//! buffered, and a body must decode exactly (no trailing bytes).
//!
//! Streams of a connection (the dialer opens all of them):
//! - the control stream (the first one): [`Control`] frames both ways —
//!   `Hello` from the dialer, `Welcome` or `Refuse` back, then `Heartbeat`s;
//! - one data stream per (sender actor, receiver actor) pair: [`ToReceiver`]
//!   frames (`Open`, then `Message`s) from the dialer, [`ToSender`] frames
//!   (`Ack`, `Reject`) back.

use std::net::SocketAddr;

use bytes::{Buf, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::id::{ActorId, Generation, Incarnation, PortId, ProcId, Seq, TypeTag};

/// The protocol version in `Hello`; a peer with another one is refused.
pub const PROTOCOL_VERSION: u32 = 1;
/// The most a decoder reserves ahead of the bytes it has.
const READ_RESERVE_BYTES: usize = 64 << 10;
/// Bytes of the length prefix of a frame.
pub const LENGTH_PREFIX_BYTES: usize = 4;

/// Why bytes from the network were refused. Each closes the stream (or, on
/// the control stream, the connection) it arrived on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A frame announces a body longer than the configured maximum.
    #[error("frame of {len} bytes exceeds max_frame_bytes = {max}")]
    FrameTooLarge {
        /// The announced body length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame ({buffered} of {needed} bytes)")]
    Truncated {
        /// Bytes received of the frame (prefix included).
        buffered: usize,
        /// Bytes the frame needs (prefix included), when the prefix is known.
        needed: usize,
    },
    /// A frame body does not decode as the expected value.
    #[error("undecodable frame body: {0}")]
    Decode(String),
    /// A frame body decoded but left bytes over.
    #[error("{0} bytes left over after the frame body")]
    TrailingBytes(usize),
    /// A value could not be encoded (only for values the codec cannot
    /// represent; never from bytes on the wire).
    #[error("cannot encode: {0}")]
    Encode(String),
    /// A payload holds another message type than the one asked for.
    #[error("payload is of type {found:?}, not {expected:?}")]
    TypeMismatch {
        /// The tag asked for.
        expected: TypeTag,
        /// The tag on the envelope.
        found: TypeTag,
    },
    /// A well-formed frame that breaks the protocol (wrong order, wrong
    /// sender, sequence gap...).
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// One message between actors, as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// The sending actor; its proc must be the one named by the sending
    /// connection's certificate.
    pub sender: ActorId,
    /// The receiving port.
    pub receiver: PortId,
    /// Position on the (sender actor, receiver actor) pair, from 1.
    pub seq: Seq,
    /// The sender's mesh generation (fencing, see `docs/semantics.md` §2).
    pub generation: Generation,
    /// The payload's message type.
    pub type_tag: TypeTag,
    /// The encoded message.
    pub payload: Bytes,
}

/// Control stream frames.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// First frame from the dialer.
    Hello(Hello),
    /// The listener's answer to an acceptable `Hello`.
    Welcome(Welcome),
    /// The listener's answer to an unacceptable `Hello`, before it closes.
    Refuse {
        /// Why, for the dialer's logs and events.
        reason: String,
    },
    /// Liveness, sent by both sides every `heartbeat_interval`.
    Heartbeat,
}

/// The dialer's introduction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The dialing proc; its certificate must name it.
    pub proc: ProcId,
    /// The dialing proc's incarnation.
    pub incarnation: Incarnation,
    /// The proc the dialer means to reach.
    pub peer: ProcId,
    /// Where the dialer listens, so the listener can reply without a route.
    pub listen: Option<SocketAddr>,
}

/// The listener's introduction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The listening proc.
    pub proc: ProcId,
    /// Its incarnation: a change tells the dialer the peer restarted.
    pub incarnation: Incarnation,
}

/// Frames from the sending side of a data stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToReceiver {
    /// First frame of a data stream.
    Open {
        /// The sending actor of the pair.
        sender: ActorId,
        /// The receiving actor of the pair.
        receiver: ActorId,
        /// Tells this pair apart from an earlier pair of the same actors
        /// (unique per sender incarnation); a new epoch starts fresh.
        pair_epoch: u64,
        /// The sequence of the first message on this stream. Sequences below
        /// it that the receiver has not seen were given back to the sender.
        first_seq: Seq,
    },
    /// A message; its sequence is one past the previous one on the stream.
    Message(Envelope),
}

/// Frames from the receiving side of a data stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToSender {
    /// Every message up to and including `up_to` was placed in its inbox
    /// (or rejected with a `Reject` sent before this).
    Ack {
        /// The highest sequence handled.
        up_to: Seq,
    },
    /// The receiver closes the stream over bad input (sent after a final
    /// `Ack`, before it finishes the stream).
    Close {
        /// What was wrong, in words.
        reason: String,
    },
    /// A message that was not delivered, and why.
    Reject {
        /// Its sequence.
        seq: Seq,
        /// Why.
        cause: RejectCause,
    },
}

/// Why a receiver did not deliver a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RejectCause {
    /// No inbox is open at the receiving port.
    #[error("no such port")]
    NoSuchPort,
    /// The port is fenced at a newer generation than the message's.
    #[error("fenced: the port accepts generation {fence:?} and newer")]
    Fenced {
        /// The port's fence.
        fence: Generation,
    },
}

/// Encodes `value` as one frame (prefix included).
pub fn encode_frame<T: Serialize>(value: &T, max_frame_bytes: usize) -> Result<Bytes, WireError> {
    encode_frame_with(value, max_frame_bytes, 128)
}

/// [`encode_frame`] into a buffer that starts with room for `capacity`
/// bytes of body.
fn encode_frame_with<T: Serialize>(
    value: &T,
    max_frame_bytes: usize,
    capacity: usize,
) -> Result<Bytes, WireError> {
    let mut buf = Vec::with_capacity(LENGTH_PREFIX_BYTES + capacity);
    buf.extend_from_slice(&[0; LENGTH_PREFIX_BYTES]);
    let mut buf = encode_into(value, buf)?;
    let len = buf.len() - LENGTH_PREFIX_BYTES;
    if len > max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len: len as u64,
            max: max_frame_bytes,
        });
    }
    // The check above bounds len by max_frame_bytes, which config validation
    // keeps at or below u32::MAX.
    let prefix = u32::try_from(len).map_err(|_| WireError::FrameTooLarge {
        len: len as u64,
        max: max_frame_bytes,
    })?;
    buf[..LENGTH_PREFIX_BYTES].copy_from_slice(&prefix.to_le_bytes());
    Ok(Bytes::from(buf))
}

/// Postcard's output into a `Vec`, appending slices whole: the flavor of
/// `postcard::to_extend` pushes a string's or a payload's bytes one at a
/// time, which was most of the cost of encoding a control message.
struct VecOutput(Vec<u8>);

impl postcard::ser_flavors::Flavor for VecOutput {
    type Output = Vec<u8>;

    #[inline(always)]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.0.push(byte);
        Ok(())
    }

    #[inline(always)]
    fn try_extend(&mut self, bytes: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Vec<u8>> {
        Ok(self.0)
    }
}

/// Appends `value`'s encoding to `buf`.
fn encode_into<T: Serialize>(value: &T, buf: Vec<u8>) -> Result<Vec<u8>, WireError> {
    postcard::serialize_with_flavor(value, VecOutput(buf))
        .map_err(|e| WireError::Encode(e.to_string()))
}

/// The bytes an envelope's frame takes beyond its payload's, about: the
/// sender's and receiver's names and the small fields.
const ENVELOPE_HEADROOM_BYTES: usize = 160;

/// Encodes a `ToReceiver::Message` frame without copying the envelope.
pub(crate) fn encode_message_frame(
    envelope: &Envelope,
    max_frame_bytes: usize,
) -> Result<Bytes, WireError> {
    /// Serializes exactly as [`ToReceiver`] (same variant indices).
    #[derive(Serialize)]
    enum ToReceiverRef<'a> {
        #[allow(dead_code)]
        Open(()),
        Message(&'a Envelope),
    }
    encode_frame_with(
        &ToReceiverRef::Message(envelope),
        max_frame_bytes,
        envelope
            .payload
            .len()
            .saturating_add(ENVELOPE_HEADROOM_BYTES),
    )
}

/// Decodes one frame body as `T`; the whole body must be used.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| WireError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

/// Decodes an envelope body (the fuzz and proptest entry point for the
/// envelope codec).
pub fn decode_envelope(body: &[u8]) -> Result<Envelope, WireError> {
    decode_body(body)
}

/// The capacity an encoded payload starts with.
const PAYLOAD_START_BYTES: usize = 256;

/// Encodes a message payload.
pub fn encode_payload<T: Serialize>(value: &T) -> Result<Bytes, WireError> {
    // Room for a typical control message up front: growing from empty
    // reallocates four or five times on the way to it.
    encode_into(value, Vec::with_capacity(PAYLOAD_START_BYTES)).map(Bytes::from)
}

/// Splits a byte stream into frame bodies: push what arrives, pop frames.
/// The buffer never holds more than one frame (`max_frame_bytes` plus the
/// prefix) beyond the bytes of the last push.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    max_frame_bytes: usize,
}

impl FrameDecoder {
    /// A decoder refusing bodies over `max_frame_bytes`.
    pub fn new(max_frame_bytes: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max_frame_bytes,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame body, `None` if more bytes are needed, or the
    /// error of an oversized frame (found as soon as its prefix is in).
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, WireError> {
        if self.buf.len() < LENGTH_PREFIX_BYTES {
            return Ok(None);
        }
        let mut prefix = [0u8; LENGTH_PREFIX_BYTES];
        prefix.copy_from_slice(&self.buf[..LENGTH_PREFIX_BYTES]);
        let len = u32::from_le_bytes(prefix) as usize;
        if len > self.max_frame_bytes {
            return Err(WireError::FrameTooLarge {
                len: len as u64,
                max: self.max_frame_bytes,
            });
        }
        if self.buf.len() < LENGTH_PREFIX_BYTES + len {
            // Grow with the bytes that arrive, not with what the prefix
            // announces: a peer announcing large frames and sending nothing
            // costs no memory.
            let missing = LENGTH_PREFIX_BYTES + len - self.buf.len();
            self.buf.reserve(missing.min(READ_RESERVE_BYTES));
            return Ok(None);
        }
        self.buf.advance(LENGTH_PREFIX_BYTES);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Checks that the stream ended on a frame boundary.
    pub fn finish(&self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let needed = if self.buf.len() >= LENGTH_PREFIX_BYTES {
            let mut prefix = [0u8; LENGTH_PREFIX_BYTES];
            prefix.copy_from_slice(&self.buf[..LENGTH_PREFIX_BYTES]);
            LENGTH_PREFIX_BYTES + u32::from_le_bytes(prefix) as usize
        } else {
            LENGTH_PREFIX_BYTES
        };
        Err(WireError::Truncated {
            buffered: self.buf.len(),
            needed,
        })
    }
}

/// Splits `bytes` (a whole stream) into frames and decodes each as `T`,
/// stopping at the first error: the fuzz and proptest entry point for the
/// frame decoder.
pub fn decode_stream<T: DeserializeOwned>(
    bytes: &[u8],
    max_frame_bytes: usize,
) -> Result<Vec<T>, WireError> {
    let mut decoder = FrameDecoder::new(max_frame_bytes);
    decoder.push(bytes);
    let mut out = Vec::new();
    while let Some(body) = decoder.next_frame()? {
        out.push(decode_body(&body)?);
    }
    decoder.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests;
