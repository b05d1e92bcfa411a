//! Handles: what a peer needs to reach a registered buffer, sent over the
//! control plane. A handle from the network is untrusted: it is validated
//! while it is decoded, and every descriptor is checked again when a backend
//! uses it (the shm segment's token, the tcp server's certificate).

use std::fmt;
use std::net::SocketAddr;

use regent_net::ProcId;
use serde::{Deserialize, Serialize};

use crate::access::Window;
use crate::error::Error;
pub use crate::ids::BufferId;

/// The largest buffer that can be registered or named by a handle (1 TiB).
pub const MAX_BUFFER_BYTES: u64 = 1 << 40;
/// The largest encoded handle accepted by [`RemoteBuffer::decode`].
pub const MAX_HANDLE_BYTES: usize = 512;
/// The largest pid a handle may name (Linux's `PID_MAX_LIMIT`).
const MAX_PID: u32 = 1 << 22;
/// The largest file descriptor number a handle may name.
const MAX_FD: u32 = 1 << 24;

/// Which machine (kernel and pid namespace) a proc runs on: two procs with
/// the same host id can reach each other's memory through `/proc`, so the
/// shm backend works between them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostId(pub [u8; 16]);

impl HostId {
    /// This machine: the kernel's boot id (`/proc/sys/kernel/random/boot_id`,
    /// new at every boot) mixed with the inode of this pid namespace, so two
    /// containers of one kernel with separate pid spaces differ.
    pub fn local() -> Result<Self, Error> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(Error::io("read the boot id"))?;
        let hex: Vec<u8> = boot.trim().bytes().filter(u8::is_ascii_hexdigit).collect();
        if hex.len() != 32 {
            return Err(Error::Config(format!("unexpected boot id {boot:?}")));
        }
        let mut id = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("00");
            id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
        let ns =
            std::fs::read_link("/proc/self/ns/pid").map_err(Error::io("read the pid namespace"))?;
        let inode: u64 = ns
            .to_string_lossy()
            .trim_start_matches("pid:[")
            .trim_end_matches(']')
            .parse()
            .unwrap_or(0);
        for (b, n) in id[8..].iter_mut().zip(inode.to_le_bytes()) {
            *b ^= n;
        }
        Ok(Self(id))
    }
}

impl fmt::Debug for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostId(")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// A buffer's 128-bit random capability. It is checked by every backend:
/// in the shm segment's header and by the owner's tcp server. It is never
/// logged (`Debug` hides it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Token(pub [u8; 16]);

impl Token {
    /// A fresh token from the system's secure random source.
    pub(crate) fn random() -> Result<Self, Error> {
        let mut t = [0u8; 16];
        regent_net::tls::crypto_provider()
            .secure_random
            .fill(&mut t)
            .map_err(|_| Error::Config("no secure random source".into()))?;
        Ok(Self(t))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// How a peer on the same host maps the buffer: the owner's memfd, opened
/// through `/proc/<pid>/fd/<fd>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmDescriptor {
    /// The owner's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the owner.
    pub fd: u32,
}

/// Where the owner serves the buffer over mutual TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpDescriptor {
    /// The owner's rdma tcp endpoint.
    pub addr: SocketAddr,
}

/// The verbs memory region of the buffer. Queue pairs are set up through
/// the owner's tcp endpoint, so a verbs descriptor needs a tcp one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbsDescriptor {
    /// The virtual address the region was registered at.
    pub addr: u64,
    /// Its remote key.
    pub rkey: u32,
}

/// A registered buffer of another proc, as sent over the control plane:
/// owner, id, length, host, capability token and one descriptor per
/// backend the owner serves it through. Validated on decode.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "HandleWire", into = "HandleWire")]
pub struct RemoteBuffer {
    owner: ProcId,
    id: BufferId,
    len_bytes: u64,
    host: HostId,
    token: Token,
    shm: Option<ShmDescriptor>,
    tcp: Option<TcpDescriptor>,
    verbs: Option<VerbsDescriptor>,
    window: Option<Window>,
}

/// The serialized form, checked by `TryFrom` before it becomes a handle.
#[derive(Serialize, Deserialize)]
struct HandleWire {
    owner: ProcId,
    id: BufferId,
    len_bytes: u64,
    host: HostId,
    token: Token,
    shm: Option<ShmDescriptor>,
    tcp: Option<TcpDescriptor>,
    verbs: Option<VerbsDescriptor>,
    window: Option<Window>,
}

impl TryFrom<HandleWire> for RemoteBuffer {
    type Error = Error;
    fn try_from(w: HandleWire) -> Result<Self, Error> {
        let bad = |s: String| Err(Error::InvalidHandle(s));
        if w.len_bytes == 0 || w.len_bytes > MAX_BUFFER_BYTES {
            return bad(format!(
                "length {} outside 1..={MAX_BUFFER_BYTES}",
                w.len_bytes
            ));
        }
        if w.token.0 == [0; 16] {
            return bad("zero token".into());
        }
        if w.shm.is_none() && w.tcp.is_none() && w.verbs.is_none() {
            return bad("no backend descriptor".into());
        }
        if let Some(s) = w.shm {
            if s.pid == 0 || s.pid > MAX_PID {
                return bad(format!("pid {} outside 1..={MAX_PID}", s.pid));
            }
            if s.fd > MAX_FD {
                return bad(format!("fd {} above {MAX_FD}", s.fd));
            }
        }
        if let Some(t) = w.tcp
            && (t.addr.port() == 0 || t.addr.ip().is_unspecified() || t.addr.ip().is_multicast())
        {
            return bad(format!("tcp address {} is not dialable", t.addr));
        }
        if let Some(v) = w.verbs {
            if w.tcp.is_none() {
                return bad("verbs descriptor without a tcp endpoint".into());
            }
            if v.addr.checked_add(w.len_bytes).is_none() {
                return bad("verbs region wraps the address space".into());
            }
        }
        Ok(Self {
            owner: w.owner,
            id: w.id,
            len_bytes: w.len_bytes,
            host: w.host,
            token: w.token,
            shm: w.shm,
            tcp: w.tcp,
            verbs: w.verbs,
            window: w.window,
        })
    }
}

impl From<RemoteBuffer> for HandleWire {
    fn from(r: RemoteBuffer) -> Self {
        Self {
            owner: r.owner,
            id: r.id,
            len_bytes: r.len_bytes,
            host: r.host,
            token: r.token,
            shm: r.shm,
            tcp: r.tcp,
            verbs: r.verbs,
            window: r.window,
        }
    }
}

impl fmt::Debug for RemoteBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteBuffer")
            .field("owner", &self.owner)
            .field("id", &self.id)
            .field("len_bytes", &self.len_bytes)
            .field("host", &self.host)
            .field("shm", &self.shm)
            .field("tcp", &self.tcp)
            .field("verbs", &self.verbs)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl RemoteBuffer {
    /// Builds a handle, with the checks of decoding.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        owner: ProcId,
        id: BufferId,
        len_bytes: u64,
        host: HostId,
        token: Token,
        shm: Option<ShmDescriptor>,
        tcp: Option<TcpDescriptor>,
        verbs: Option<VerbsDescriptor>,
    ) -> Result<Self, Error> {
        Self::try_from(HandleWire {
            owner,
            id,
            len_bytes,
            host,
            token,
            shm,
            tcp,
            verbs,
            window: None,
        })
    }

    /// The owner proc.
    pub fn owner(&self) -> &ProcId {
        &self.owner
    }

    /// The buffer's id within its owner.
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The owner's host.
    pub fn host(&self) -> HostId {
        self.host
    }

    /// The capability token.
    pub(crate) fn token(&self) -> Token {
        self.token
    }

    /// The shm descriptor, if the owner serves the buffer through shm.
    pub fn shm(&self) -> Option<ShmDescriptor> {
        self.shm
    }

    /// The tcp descriptor, if the owner serves the buffer through tcp.
    pub fn tcp(&self) -> Option<TcpDescriptor> {
        self.tcp
    }

    /// The verbs descriptor, if the owner registered it with a device.
    pub fn verbs(&self) -> Option<VerbsDescriptor> {
        self.verbs
    }

    /// The window this handle was granted under ([`Window`]): it works only
    /// while its owner keeps that window open. `None` for a plain handle.
    pub fn window(&self) -> Option<Window> {
        self.window
    }

    /// This handle under `window` (made by the owner when it opens one).
    pub(crate) fn with_window(&self, window: Window) -> Self {
        Self {
            window: Some(window),
            ..self.clone()
        }
    }

    /// Replaces the verbs descriptor (the owner re-registered the memory
    /// region, or dropped it).
    pub(crate) fn set_verbs(&mut self, verbs: Option<VerbsDescriptor>) {
        self.verbs = verbs;
    }

    /// Checks that `offset..offset + len_bytes` lies inside the buffer.
    pub fn check_range(&self, offset: u64, len_bytes: u64) -> Result<(), Error> {
        match offset.checked_add(len_bytes) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(Error::OutOfRange {
                buffer: self.id,
                offset,
                len_bytes,
                buffer_bytes: self.len_bytes,
            }),
        }
    }

    /// The compact wire form (postcard), as carried on the control plane.
    pub fn encode(&self) -> Vec<u8> {
        // postcard cannot fail on these types: no maps, no unsized
        // sequences beyond the proc id string, written to a Vec.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// Decodes and validates a handle from untrusted bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() > MAX_HANDLE_BYTES {
            return Err(Error::InvalidHandle(format!(
                "{} bytes, more than {MAX_HANDLE_BYTES}",
                bytes.len()
            )));
        }
        let (handle, rest) = postcard::take_from_bytes::<Self>(bytes)
            .map_err(|e| Error::InvalidHandle(e.to_string()))?;
        if !rest.is_empty() {
            return Err(Error::InvalidHandle(format!(
                "{} trailing bytes",
                rest.len()
            )));
        }
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> RemoteBuffer {
        RemoteBuffer::new(
            ProcId::new("owner-1").unwrap(),
            BufferId(7),
            4096,
            HostId([1; 16]),
            Token([9; 16]),
            Some(ShmDescriptor { pid: 42, fd: 5 }),
            Some(TcpDescriptor {
                addr: "127.0.0.1:4000".parse().unwrap(),
            }),
            None,
        )
        .unwrap()
    }

    #[test]
    fn handles_round_trip_and_stay_small() {
        let h = sample();
        let bytes = h.encode();
        assert!(bytes.len() < 128, "{} bytes", bytes.len());
        assert_eq!(RemoteBuffer::decode(&bytes).unwrap(), h);
        assert!(
            !format!("{h:?}").contains("9, 9"),
            "the token is not logged"
        );
    }

    #[test]
    fn decoding_refuses_bad_handles() {
        let mut w = HandleWire::from(sample());
        w.len_bytes = 0;
        let enc = |w: &HandleWire| postcard::to_allocvec(w).unwrap();
        assert!(matches!(
            RemoteBuffer::decode(&enc(&w)),
            Err(Error::InvalidHandle(_))
        ));
        let mut w = HandleWire::from(sample());
        w.len_bytes = MAX_BUFFER_BYTES + 1;
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut w = HandleWire::from(sample());
        w.shm = Some(ShmDescriptor { pid: 0, fd: 1 });
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut w = HandleWire::from(sample());
        w.tcp = Some(TcpDescriptor {
            addr: "0.0.0.0:80".parse().unwrap(),
        });
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut w = HandleWire::from(sample());
        w.tcp = None;
        w.verbs = Some(VerbsDescriptor { addr: 1, rkey: 2 });
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut w = HandleWire::from(sample());
        (w.shm, w.tcp) = (None, None);
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut w = HandleWire::from(sample());
        w.token = Token([0; 16]);
        assert!(RemoteBuffer::decode(&enc(&w)).is_err());
        let mut bytes = sample().encode();
        bytes.push(0);
        assert!(RemoteBuffer::decode(&bytes).is_err());
        assert!(RemoteBuffer::decode(&[0u8; MAX_HANDLE_BYTES + 1]).is_err());
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let h = sample();
        h.check_range(0, 4096).unwrap();
        h.check_range(4096, 0).unwrap();
        h.check_range(4000, 96).unwrap();
        assert!(h.check_range(4000, 97).is_err());
        assert!(h.check_range(u64::MAX, 2).is_err());
        assert!(h.check_range(4097, 0).is_err());
    }

    #[test]
    fn local_host_id_is_stable() {
        assert_eq!(HostId::local().unwrap(), HostId::local().unwrap());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = RemoteBuffer::decode(&bytes);
        }

        #[test]
        fn decoding_mutated_handles_never_panics(at in 0usize..100, byte in any::<u8>()) {
            let mut bytes = sample().encode();
            let i = at % bytes.len();
            bytes[i] = byte;
            if let Ok(h) = RemoteBuffer::decode(&bytes) {
                prop_assert!(h.len_bytes() >= 1 && h.len_bytes() <= MAX_BUFFER_BYTES);
            }
        }
    }
}
