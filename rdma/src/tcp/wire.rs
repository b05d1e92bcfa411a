//! The framing of the tcp backend (inside TLS). Fixed-size little-endian
//! headers with checked decoders: bytes from the network never panic.
//!
//! ```text
//! hello    client -> server  "RGR1" | id_len u8 | proc id (1..=63 bytes)
//! welcome  server -> client  status u8 (0 accepted, 1 identity refused, 2 server full)
//! request  client -> server  op u8 | 0 0 0 | len u32 | buffer u64 | offset u64 | token [16]
//!                            | window u32 (0: none)
//!                            (a write is followed by len bytes)
//! response server -> client  status u8 | 0 0 0 | len u32
//!                            (a successful read is followed by len bytes)
//! ```
//!
//! Requests on a connection are answered in order, so a client pipelines
//! them without tags.

use crate::access::Window;
use crate::handle::{BufferId, Token};

/// The ALPN protocol of the tcp backend (the control plane uses another,
/// so neither side mistakes one for the other).
pub(crate) const ALPN: &[u8] = b"regent-rdma/2";
pub(crate) const HELLO_MAGIC: [u8; 4] = *b"RGR1";
pub(crate) const REQUEST_BYTES: usize = 44;
pub(crate) const RESPONSE_BYTES: usize = 8;
pub(crate) const WELCOME_OK: u8 = 0;
pub(crate) const WELCOME_REFUSED: u8 = 1;
pub(crate) const WELCOME_BUSY: u8 = 2;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Send `len` bytes of the buffer from `offset`.
    Read = 1,
    /// Store the `len` bytes that follow at `offset`.
    Write = 2,
    /// Set up a verbs queue pair: the payload is the client's endpoint.
    VerbsConnect = 3,
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) op: Op,
    pub(crate) len_bytes: u32,
    pub(crate) buffer: BufferId,
    pub(crate) offset: u64,
    pub(crate) token: Token,
    /// The window of a windowed handle (`access::Window`).
    pub(crate) window: Option<Window>,
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0] = self.op as u8;
        b[4..8].copy_from_slice(&self.len_bytes.to_le_bytes());
        b[8..16].copy_from_slice(&self.buffer.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..40].copy_from_slice(&self.token.0);
        b[40..44].copy_from_slice(&self.window.map_or(0, Window::get).to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; REQUEST_BYTES]) -> Result<Self, String> {
        let op = match b[0] {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::VerbsConnect,
            other => return Err(format!("unknown op {other}")),
        };
        if b[1..4] != [0, 0, 0] {
            return Err("reserved bytes are not zero".into());
        }
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut len = [0u8; 4];
        len.copy_from_slice(&b[4..8]);
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[24..40]);
        let mut window = [0u8; 4];
        window.copy_from_slice(&b[40..44]);
        Ok(Self {
            op,
            len_bytes: u32::from_le_bytes(len),
            buffer: BufferId(u64_at(8)),
            offset: u64_at(16),
            token: Token(token),
            window: Window::from_word(u32::from_le_bytes(window)),
        })
    }
}

/// The outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Ok = 0,
    /// No such buffer, or the token does not match: released (or never
    /// given to this client).
    UnknownBuffer = 1,
    OutOfRange = 2,
    TooLarge = 3,
    Unsupported = 4,
    Failed = 5,
    /// The owner closed the buffer to this operation for now (its access
    /// is `Local`, or `ReadOnly` for a write).
    Closed = 6,
}

/// A response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: Status,
    pub(crate) len_bytes: u32,
}

impl Response {
    pub(crate) fn encode(&self) -> [u8; RESPONSE_BYTES] {
        let mut b = [0u8; RESPONSE_BYTES];
        b[0] = self.status as u8;
        b[4..8].copy_from_slice(&self.len_bytes.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; RESPONSE_BYTES]) -> Result<Self, String> {
        let status = match b[0] {
            0 => Status::Ok,
            1 => Status::UnknownBuffer,
            2 => Status::OutOfRange,
            3 => Status::TooLarge,
            4 => Status::Unsupported,
            5 => Status::Failed,
            6 => Status::Closed,
            other => return Err(format!("unknown status {other}")),
        };
        if b[1..4] != [0, 0, 0] {
            return Err("reserved bytes are not zero".into());
        }
        let mut len = [0u8; 4];
        len.copy_from_slice(&b[4..8]);
        Ok(Self {
            status,
            len_bytes: u32::from_le_bytes(len),
        })
    }
}

/// Decodes a request header as the tcp server does and encodes what it
/// accepts back; `None` where it refuses the header. The fuzzing entry point
/// (`fuzz/fuzz_targets/rdma_tcp_headers.rs`, through the crate root), not API.
#[doc(hidden)]
pub fn fuzz_request(header: &[u8; REQUEST_BYTES]) -> Option<[u8; REQUEST_BYTES]> {
    Request::decode(header).ok().map(|r| r.encode())
}

/// Decodes a response header as a tcp client does, like [`fuzz_request`].
#[doc(hidden)]
pub fn fuzz_response(header: &[u8; RESPONSE_BYTES]) -> Option<[u8; RESPONSE_BYTES]> {
    Response::decode(header).ok().map(|r| r.encode())
}

/// Compares tokens in time independent of where they differ.
pub(crate) fn token_eq(a: &Token, b: &Token) -> bool {
    a.0.iter()
        .zip(b.0.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_round_trip() {
        let r = Request {
            op: Op::Write,
            len_bytes: 1 << 22,
            buffer: BufferId(3),
            offset: 1 << 40,
            token: Token([5; 16]),
            window: Window::from_word(0x0102_0304),
        };
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        let none = Request { window: None, ..r };
        assert_eq!(Request::decode(&none.encode()).unwrap(), none);
        let s = Response {
            status: Status::OutOfRange,
            len_bytes: 9,
        };
        assert_eq!(Response::decode(&s.encode()).unwrap(), s);
        assert!(token_eq(&Token([1; 16]), &Token([1; 16])));
        assert!(!token_eq(&Token([1; 16]), &Token([2; 16])));
    }

    proptest! {
        #[test]
        fn decoders_never_panic(
            req in proptest::array::uniform32(any::<u8>()),
            tail in any::<[u8; 12]>(),
        ) {
            let mut b = [0u8; REQUEST_BYTES];
            b[..32].copy_from_slice(&req);
            b[32..].copy_from_slice(&tail);
            if let Ok(r) = Request::decode(&b) {
                prop_assert_eq!(r.encode(), b);
            }
            let mut resp = [0u8; RESPONSE_BYTES];
            resp.copy_from_slice(&tail[..RESPONSE_BYTES]);
            let _ = Response::decode(&resp);
        }
    }
}
