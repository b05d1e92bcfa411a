//! Control messages of collectives: a postcard header, then (for inline
//! data) the raw payload. Every message names the operation it belongs to
//! (its tag), so members that call different collectives, or the same in a
//! different order, are told so instead of mixing them up.

use bytes::{BufMut, Bytes, BytesMut};
use regent_rdma::{HostId, RemoteBuffer};
use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::Error;
use crate::reduce::ReduceOp;

use super::Algorithm;

/// Which operation a message belongs to: the communicator's collective
/// sequence number, or a point-to-point sequence number of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Tag {
    pub(crate) p2p: bool,
    pub(crate) seq: u64,
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.p2p {
            write!(f, "point-to-point #{}", self.seq)
        } else {
            write!(f, "collective #{}", self.seq)
        }
    }
}

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum OpKind {
    Barrier,
    Broadcast,
    AllReduce,
    AllGather,
    ReduceScatter,
    Send,
    Reshard,
}

/// What every member must agree on for one operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OpDesc {
    pub(crate) kind: OpKind,
    pub(crate) dtype: DType,
    /// Elements of the operation's defining tensor (all-gather: of each
    /// member's part; reduce-scatter: of the input).
    pub(crate) numel: u64,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) root: u32,
    pub(crate) algorithm: Algorithm,
    /// A digest of the operation's plan (reshard), else 0.
    pub(crate) digest: u64,
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} of {} {} elements ({:?}",
            self.kind, self.numel, self.dtype, self.algorithm
        )?;
        if let Some(op) = self.reduce {
            write!(f, ", {op:?}")?;
        }
        if matches!(self.kind, OpKind::Broadcast) {
            write!(f, ", root {}", self.root)?;
        }
        write!(f, ")")
    }
}

/// Bytes of a member's registered buffer that peers may read: checked on
/// decode to lie inside the buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RegionWire", into = "RegionWire")]
pub(crate) struct Region {
    pub(crate) buffer: RemoteBuffer,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

#[derive(Serialize, Deserialize)]
struct RegionWire {
    buffer: RemoteBuffer,
    offset: u64,
    len: u64,
}

impl TryFrom<RegionWire> for Region {
    type Error = String;
    fn try_from(w: RegionWire) -> Result<Self, String> {
        match w.offset.checked_add(w.len) {
            Some(end) if end <= w.buffer.len_bytes() => Ok(Region {
                buffer: w.buffer,
                offset: w.offset,
                len: w.len,
            }),
            _ => Err(format!(
                "region {}+{} outside a buffer of {} bytes",
                w.offset,
                w.len,
                w.buffer.len_bytes()
            )),
        }
    }
}

impl From<Region> for RegionWire {
    fn from(r: Region) -> Self {
        RegionWire {
            buffer: r.buffer,
            offset: r.offset,
            len: r.len,
        }
    }
}

/// The settings members must share (they decide the algorithms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Agreement {
    pub(crate) algorithm: Algorithm,
    pub(crate) exact: bool,
    pub(crate) inline_max_bytes: u64,
    pub(crate) chunk_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Body {
    /// The first message of a communicator.
    Hello {
        size: u32,
        host: HostId,
        agreement: Agreement,
    },
    /// "I am in the operation; my memory is ready to be read here."
    Ready { desc: OpDesc, regions: Vec<Region> },
    /// The operation's data, inline (the payload follows the header).
    Inline { desc: OpDesc },
    /// "Step `step`'s part `sub` is ready for you."
    Signal { step: u32, sub: u32 },
    /// "I finished reading your memory."
    Done,
    /// "I saw your Done before I let go of my memory."
    Ack,
    /// "I gave up on this operation because of `culprit`."
    Abort { culprit: u32, reason: String },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Msg {
    pub(crate) tag: Tag,
    pub(crate) body: Body,
}

impl Msg {
    /// Header, then `payload`.
    pub(crate) fn encode(&self, payload: &[u8]) -> Bytes {
        // Plain data serializes into a Vec without failing.
        let header = postcard::to_allocvec(self).expect("postcard encodes a message");
        let mut b = BytesMut::with_capacity(header.len() + payload.len());
        b.put_slice(&header);
        b.put_slice(payload);
        b.freeze()
    }

    /// The message and its payload. `from` is named in the error.
    pub(crate) fn decode(from: usize, bytes: Bytes) -> Result<(Msg, Bytes), Error> {
        let (msg, rest): (Msg, _) =
            postcard::take_from_bytes(&bytes).map_err(|e| Error::Protocol {
                rank: from,
                detail: format!("undecodable message of {} bytes: {e}", bytes.len()),
            })?;
        let used = bytes.len() - rest.len();
        Ok((msg, bytes.slice(used..)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..700)) {
            let _ = Msg::decode(3, Bytes::from(bytes));
        }
    }

    #[test]
    fn payload_follows_the_header() {
        let m = Msg {
            tag: Tag { p2p: false, seq: 9 },
            body: Body::Signal { step: 2, sub: 5 },
        };
        let (back, payload) = Msg::decode(0, m.encode(b"xyz")).unwrap();
        assert_eq!(back.tag, m.tag);
        assert!(matches!(back.body, Body::Signal { step: 2, sub: 5 }));
        assert_eq!(&payload[..], b"xyz");
        let e = Msg::decode(4, Bytes::from_static(&[0xff; 3])).unwrap_err();
        assert_eq!(e.culprit(), Some(4));
    }
}
