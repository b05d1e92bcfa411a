//! Configuration of a [`crate::BufferManager`]: plain values with documented
//! defaults and builder-style setters.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::Error;
use crate::handle::HostId;

pub use crate::ids::BackendKind;

/// How the reader picks a backend for a buffer (see [`crate::choose_backend`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendPolicy {
    /// ibverbs when both ends have it, else shm on the same host, else tcp.
    #[default]
    Auto,
    /// Only this backend; operations fail with [`Error::NoBackend`] when it
    /// cannot reach the buffer. For tests and benchmarks.
    Only(BackendKind),
}

/// Configuration of a buffer manager.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Where the tcp backend listens. Default `127.0.0.1:0`; a proc that
    /// serves other hosts binds a routable address.
    pub tcp_bind_addr: SocketAddr,
    /// The tcp address put in handles, when it differs from the bound one
    /// (e.g. bound to `0.0.0.0`). Default: the bound address.
    pub tcp_advertise_addr: Option<SocketAddr>,
    /// Bytes per tcp request. Default 4 MiB; at most 64 MiB.
    pub tcp_chunk_bytes: NonZeroU32,
    /// Requests in flight per tcp connection. Default 4.
    pub tcp_window_chunks: NonZeroU32,
    /// Connections per (reader, owner) pair used by one operation.
    /// Default 1 (2 cores on the reference machine). The owner serves each
    /// connection in a task of its own, and the caller, on a multi-thread
    /// runtime, runs each of an operation's connections on a thread of its
    /// own, so more spread both sides' copying and sealing over the cores.
    /// On 2 cores, where both processes' work already fills them, 2
    /// connections moved 64 MiB writes about 10% faster than 1 and reads
    /// 0-5% (16 operations each, two runs).
    pub tcp_connections: NonZeroU32,
    /// Authenticated connections the tcp server serves at once (counted
    /// once the handshake and identity check are done). Default 256.
    pub tcp_max_clients: NonZeroU32,
    /// Accepted connections that have not sent a byte yet, held at once.
    /// When full, a new connection makes the server drop the oldest silent
    /// one. Default 1024.
    pub tcp_max_silent: NonZeroU32,
    /// Connections in their handshake (TLS, hello, identity check) at once,
    /// from all addresses; one more is refused. Default 128.
    pub tcp_max_handshakes: NonZeroU32,
    /// Connections in their handshake at once from one IP address; one
    /// more is refused. Default 32.
    pub tcp_max_handshakes_per_addr: NonZeroU32,
    /// Deadline for a connection from accept to the end of its handshake
    /// (first bytes, TLS, hello, identity check) on the server. Default
    /// 3 s: a cluster member on a loaded machine needs milliseconds.
    pub tcp_handshake_timeout: Duration,
    /// A tcp connection idle this long is closed by the server (and not
    /// reused by the client after half of it). Default 10 min.
    pub tcp_idle_timeout: Duration,
    /// Deadline for connecting (TCP and TLS handshake). Default 10 s.
    pub connect_timeout: Duration,
    /// Deadline for each chunk of an operation to make progress. Default
    /// 30 s.
    pub op_timeout: Duration,
    /// Bytes copied between liveness checks of the shm backend. Default
    /// 256 MiB (tens of milliseconds of copying): large enough that libc's
    /// memcpy copies a chunk the way it copies one large buffer (with
    /// non-temporal stores above its threshold, 114 MiB on the reference
    /// machine); smaller chunks measured 0.6x memcpy at 1 GiB.
    pub shm_chunk_bytes: NonZeroU32,
    /// Copies of this many bytes or more by the shm backend run off the
    /// runtime's worker threads (`tokio::task::block_in_place`, on a
    /// multi-thread runtime), so they never hold up the control plane's
    /// tasks. Default 4 MiB (under half a millisecond of copying).
    pub shm_blocking_bytes: usize,
    /// Such copies running at once per manager (others wait their turn).
    /// Default 4; at most 64.
    pub shm_copy_threads: NonZeroU32,
    /// How long [`crate::LocalBuffer::set_access`] waits for peers'
    /// operations already copying to finish before it gives up with
    /// [`Error::Busy`]. Default 10 s.
    pub access_timeout: Duration,
    /// How often mapped segments of other procs are checked for release or
    /// owner death, so their memory is unmapped even if no operation
    /// touches them again. Default 250 ms.
    pub liveness_interval: Duration,
    /// Peers' segments kept mapped at once. Default 1024.
    pub max_peer_segments: usize,
    /// Buffers registered at once. Default 65 536.
    pub max_buffers: usize,
    /// Whether to serve buffers through shm (and use shm as a reader).
    /// Default true.
    pub shm: bool,
    /// Whether to register buffers with a verbs device when the `ibverbs`
    /// feature is on and a device is present. Default true.
    pub ibverbs: bool,
    /// The verbs device to use (by name); default the first one.
    pub ibverbs_device: Option<String>,
    /// Backend choice. Default [`BackendPolicy::Auto`].
    pub backend: BackendPolicy,
    /// This host's identity; default [`HostId::local`]. A test can set a
    /// different one to make two procs of one machine look remote.
    pub host: Option<HostId>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            tcp_bind_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_advertise_addr: None,
            tcp_chunk_bytes: NonZeroU32::new(4 << 20).expect("nonzero"),
            tcp_window_chunks: NonZeroU32::new(4).expect("nonzero"),
            tcp_connections: NonZeroU32::new(1).expect("nonzero"),
            tcp_max_clients: NonZeroU32::new(256).expect("nonzero"),
            tcp_max_silent: NonZeroU32::new(1024).expect("nonzero"),
            tcp_max_handshakes: NonZeroU32::new(128).expect("nonzero"),
            tcp_max_handshakes_per_addr: NonZeroU32::new(32).expect("nonzero"),
            tcp_handshake_timeout: Duration::from_secs(3),
            tcp_idle_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(10),
            op_timeout: Duration::from_secs(30),
            shm_chunk_bytes: NonZeroU32::new(256 << 20).expect("nonzero"),
            shm_blocking_bytes: 4 << 20,
            shm_copy_threads: NonZeroU32::new(4).expect("nonzero"),
            access_timeout: Duration::from_secs(10),
            liveness_interval: Duration::from_millis(250),
            max_peer_segments: 1024,
            max_buffers: 65_536,
            shm: true,
            ibverbs: true,
            ibverbs_device: None,
            backend: BackendPolicy::Auto,
            host: None,
        }
    }
}

/// The longest deadline a config may hold (a day).
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The largest tcp chunk.
pub const MAX_TCP_CHUNK_BYTES: u32 = 64 << 20;

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$name = value;
            self
        }
    };
}

impl ManagerConfig {
    setter!(
        /// Sets [`Self::tcp_bind_addr`].
        tcp_bind_addr: SocketAddr
    );
    setter!(
        /// Sets [`Self::tcp_advertise_addr`].
        tcp_advertise_addr: Option<SocketAddr>
    );
    setter!(
        /// Sets [`Self::tcp_chunk_bytes`].
        tcp_chunk_bytes: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_window_chunks`].
        tcp_window_chunks: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_connections`].
        tcp_connections: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_max_clients`].
        tcp_max_clients: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_max_silent`].
        tcp_max_silent: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_max_handshakes`].
        tcp_max_handshakes: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_max_handshakes_per_addr`].
        tcp_max_handshakes_per_addr: NonZeroU32
    );
    setter!(
        /// Sets [`Self::tcp_handshake_timeout`].
        tcp_handshake_timeout: Duration
    );
    setter!(
        /// Sets [`Self::tcp_idle_timeout`].
        tcp_idle_timeout: Duration
    );
    setter!(
        /// Sets [`Self::connect_timeout`].
        connect_timeout: Duration
    );
    setter!(
        /// Sets [`Self::op_timeout`].
        op_timeout: Duration
    );
    setter!(
        /// Sets [`Self::shm_chunk_bytes`].
        shm_chunk_bytes: NonZeroU32
    );
    setter!(
        /// Sets [`Self::shm_blocking_bytes`].
        shm_blocking_bytes: usize
    );
    setter!(
        /// Sets [`Self::shm_copy_threads`].
        shm_copy_threads: NonZeroU32
    );
    setter!(
        /// Sets [`Self::access_timeout`].
        access_timeout: Duration
    );
    setter!(
        /// Sets [`Self::liveness_interval`].
        liveness_interval: Duration
    );
    setter!(
        /// Sets [`Self::max_peer_segments`].
        max_peer_segments: usize
    );
    setter!(
        /// Sets [`Self::max_buffers`].
        max_buffers: usize
    );
    setter!(
        /// Sets [`Self::shm`].
        shm: bool
    );
    setter!(
        /// Sets [`Self::ibverbs`].
        ibverbs: bool
    );
    setter!(
        /// Sets [`Self::ibverbs_device`].
        ibverbs_device: Option<String>
    );
    setter!(
        /// Sets [`Self::backend`].
        backend: BackendPolicy
    );
    setter!(
        /// Sets [`Self::host`].
        host: Option<HostId>
    );

    /// Checks the values against their bounds.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |s: &str| Err(Error::Config(s.to_owned()));
        if self.tcp_chunk_bytes.get() > MAX_TCP_CHUNK_BYTES {
            return bad("tcp_chunk_bytes above 64 MiB");
        }
        if self.tcp_window_chunks.get() > 64 {
            return bad("tcp_window_chunks above 64");
        }
        if self.tcp_connections.get() > 16 {
            return bad("tcp_connections above 16");
        }
        if self.shm_copy_threads.get() > 64 {
            return bad("shm_copy_threads above 64");
        }
        if self.tcp_max_silent.get() > 1 << 16 || self.tcp_max_handshakes.get() > 1 << 16 {
            return bad("tcp_max_silent and tcp_max_handshakes at most 65536");
        }
        if self.tcp_max_handshakes_per_addr > self.tcp_max_handshakes {
            return bad("tcp_max_handshakes_per_addr above tcp_max_handshakes");
        }
        if self.max_peer_segments == 0 || self.max_buffers == 0 {
            return bad("max_peer_segments and max_buffers must be positive");
        }
        for (name, d) in [
            ("connect_timeout", self.connect_timeout),
            ("op_timeout", self.op_timeout),
            ("liveness_interval", self.liveness_interval),
            ("tcp_idle_timeout", self.tcp_idle_timeout),
            ("tcp_handshake_timeout", self.tcp_handshake_timeout),
            ("access_timeout", self.access_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!("{name} must be positive")));
            }
            // Deadlines are added to `Instant`s: a huge one would overflow.
            if d > MAX_TIMEOUT {
                return Err(Error::Config(format!("{name} above {MAX_TIMEOUT:?}")));
            }
        }
        Ok(())
    }
}
