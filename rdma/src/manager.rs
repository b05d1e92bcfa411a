//! The per-proc buffer manager: registration, handles, one-sided reads and
//! writes through the chosen backend, batches and release.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use regent_net::{ProcCredentials, ProcId};

use crate::access::{Access, Kind, STATE_RELEASED, Waiting, Window};
use crate::choice::{LocalCaps, choose_backend};
use crate::config::{BackendKind, BackendPolicy, ManagerConfig};
use crate::error::Error;
use crate::handle::{
    BufferId, HostId, RemoteBuffer, ShmDescriptor, TcpDescriptor, VerbsDescriptor,
};
use crate::memory::{Memory, Region};
use crate::shm::{PeerSegment, PeerSegments};
use crate::tcp::{Conn, Registry, TcpClient, TcpLoad, TcpServer};
use crate::traffic::{Counters, Traffic, Way};
use crate::verbs;

/// Operations of one batch run at once.
pub const MAX_BATCH_CONCURRENCY: usize = 16;
/// The most operations in one batch.
pub const MAX_BATCH_OPS: usize = 4096;
/// Bytes of the registered staging buffer of the verbs backend, used when
/// the local side of an operation is not registered memory.
const VERBS_STAGING_BYTES: usize = 8 << 20;
/// The largest single RDMA work request.
const VERBS_MAX_WR_BYTES: usize = 1 << 30;

/// A proc's buffer manager. Cheap to clone; the tcp server and the sweeper
/// of peers' segments stop when the last clone is dropped.
#[derive(Clone)]
pub struct BufferManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for BufferManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferManager")
            .field("proc", &self.inner.proc)
            .field("host", &self.inner.host)
            .field("tcp", &self.inner.tcp_server.addr())
            .field("ibverbs", &self.inner.verbs.is_some())
            .finish_non_exhaustive()
    }
}

struct VerbsPeer {
    /// The connection whose lifetime keeps the owner's queue pair.
    _conn: Conn,
    qp: verbs::QueuePair,
}

struct Inner {
    proc: ProcId,
    host: HostId,
    config: ManagerConfig,
    policy: Mutex<BackendPolicy>,
    next_id: AtomicU64,
    registry: Arc<Registry>,
    peers: PeerSegments,
    tcp_server: TcpServer,
    tcp_client: TcpClient,
    verbs: Option<Arc<verbs::Device>>,
    /// Registered local memory by address, for the verbs lkey lookup.
    verbs_local: Mutex<BTreeMap<usize, (usize, u32)>>,
    verbs_peers: tokio::sync::Mutex<HashMap<(ProcId, SocketAddr), VerbsPeer>>,
    verbs_staging: tokio::sync::Mutex<Option<LocalBuffer>>,
    /// Large shm copies running off the worker threads at once.
    copy_permits: tokio::sync::Semaphore,
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// What this manager's operations moved.
    traffic: Counters,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .sweeper
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// Memory registered with a manager: peers reach it through its
/// [`RemoteBuffer`] handle, as far as its [`Access`] lets them.
///
/// A buffer starts [`Access::Exposed`] (or as [`BufferManager::register_with`]
/// says). The owner sees its bytes only while peers cannot write them:
/// [`Self::as_slice`] under [`Access::ReadOnly`] or [`Access::Local`],
/// [`Self::as_mut_slice`] under [`Access::Local`], or through the guard of
/// [`Self::lock_local`]. Narrowing access ([`Self::set_access`]) refuses
/// peers' new operations ([`Error::Closed`]) and waits for the copies
/// already running (`docs/semantics.md` §6.2); so a view of the bytes never
/// overlaps a peer's copy that could change them.
///
/// Dropping the buffer (or [`LocalBuffer::release`]) releases it: peers'
/// later operations fail with [`Error::Released`], and the memory is freed
/// once in-flight operations and peers' mappings let go of it.
pub struct LocalBuffer {
    region: Arc<Region>,
    handle: RemoteBuffer,
    manager: Weak<Inner>,
    mr: Option<verbs::MemoryRegion>,
    access: Access,
    access_timeout: Duration,
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("handle", &self.handle)
            .field("access", &self.access)
            .finish_non_exhaustive()
    }
}

impl LocalBuffer {
    /// The handle to send to peers. On ibverbs it changes with every change
    /// of access (see [`Self::set_access`]).
    pub fn handle(&self) -> &RemoteBuffer {
        &self.handle
    }

    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        self.handle.id()
    }

    /// Its length in bytes (at least 1).
    pub fn len(&self) -> usize {
        self.region.len_bytes()
    }

    /// Always false: a buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// What peers may do with it now.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The bytes, for reading, under [`Access::ReadOnly`] or
    /// [`Access::Local`]; [`Error::Access`] while peers may write them.
    pub fn as_slice(&self) -> Result<&[u8], Error> {
        match self.access {
            // SAFETY: peers' writes are refused and none is copying (the
            // state was stored and the write slots drained before `access`
            // changed, which needs `&mut self`, so it cannot change while
            // this borrow of `self` lives).
            Access::ReadOnly | Access::Local => Ok(unsafe { self.region.data() }),
            Access::Exposed => {
                Err(self.access_err("peers may write it; make it ReadOnly or Local"))
            }
        }
    }

    /// The bytes, for reading and writing, under [`Access::Local`];
    /// [`Error::Access`] while peers may read or write them.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], Error> {
        match self.access {
            // SAFETY: every peer operation is refused and none is copying
            // (as in `as_slice`); `&mut self` makes this the only reference
            // in this process.
            Access::Local => Ok(unsafe { self.region.data_mut() }),
            _ => Err(self.access_err("peers may read or write it; make it Local")),
        }
    }

    /// The first byte of the buffer's memory, valid for [`Self::len`]
    /// bytes until the buffer is dropped (e.g. for a tensor made on it
    /// without copying).
    ///
    /// # Using the pointer
    ///
    /// Getting the pointer is safe; every access through it is the
    /// caller's `unsafe` to justify against [`Self::access`], which only
    /// `&mut self` methods change:
    /// - [`Access::Local`]: no peer touches the bytes; the caller owns them
    ///   as it would a `&mut [u8]` it derived the pointer from, and must not
    ///   keep a view through it across a change of access.
    /// - [`Access::ReadOnly`]: peers may read at any time; the caller may
    ///   read, never write.
    /// - [`Access::Exposed`]: peers may write at any time; a reference made
    ///   from the pointer is undefined behaviour unless the application's
    ///   protocol guarantees that no peer writes the referenced bytes while
    ///   it lives (and, for `&mut`, that none reads them).
    pub fn as_ptr(&self) -> NonNull<u8> {
        NonNull::new(self.region.data_ptr()).expect("a mapping's address is never null")
    }

    /// Changes what peers may do, waiting up to the manager's
    /// `access_timeout` for peers' copies that the new access forbids
    /// (those already running; new ones are refused at once with
    /// [`Error::Closed`]). On [`Error::Busy`] the buffer keeps its
    /// previous access. Widening (towards [`Access::Exposed`]) never waits.
    ///
    /// On ibverbs the memory region is registered anew with the access
    /// flags of the new state (the old rkey stops working before this
    /// returns): [`Self::handle`] then holds a new rkey, and peers need the
    /// new handle.
    pub async fn set_access(&mut self, access: Access) -> Result<(), Error> {
        let Some(change) = self.begin_change(access) else {
            return Ok(());
        };
        // The new state is stored: peers' new copies are refused from now
        // on, so the wait is for the copies already claimed, and ends once
        // each of those is done.
        let waiting = self.region.gate().conflicting(change.previous, access);
        // On `Busy`, `change` drops and restores the previous state.
        self.wait_out(waiting, self.access_timeout).await?;
        change.commit();
        self.finish_change(access);
        Ok(())
    }

    /// Waits until every claim in `waiting` is gone, or [`Error::Busy`]
    /// after `timeout`.
    async fn wait_out(&self, mut waiting: Waiting, timeout: Duration) -> Result<(), Error> {
        let gate = self.region.gate();
        let started = Instant::now();
        let mut pause = Duration::from_micros(50);
        while !waiting.is_empty() {
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(Error::Busy {
                    buffer: self.id(),
                    pids: waiting.pids(),
                    waited,
                });
            }
            tokio::time::sleep(pause.min(timeout - waited)).await;
            pause = (pause * 2).min(Duration::from_millis(5));
            gate.settle(&mut waiting);
        }
        Ok(())
    }

    /// Opens a window on the buffer for one exchange with peers, and
    /// returns the handle to give them: it works (within what
    /// [`Self::access`] allows) only until [`Self::close_window`]. Opening
    /// a window closes the one open before, without waiting for its copies
    /// (close it first where that matters). Not for verbs: a windowed handle
    /// is served through shm or tcp only (`docs/semantics.md` §6.2).
    pub fn open_window(&self) -> RemoteBuffer {
        let window = Window::fresh();
        self.region.set_window(window);
        self.handle.with_window(window)
    }

    /// Closes the window of `handle` (made by [`Self::open_window`]): its
    /// later copies are refused with [`Error::Closed`], and this waits up
    /// to `timeout` for those already running — every copy claimed on the
    /// buffer now, of any handle (a claim does not say which window it
    /// came through). [`Error::Busy`] names the processes still copying
    /// (e.g. stopped inside one); the window stays closed. Closing a window
    /// that is not the open one only waits. A plain handle: nothing to do.
    pub async fn close_window(
        &self,
        handle: &RemoteBuffer,
        timeout: Duration,
    ) -> Result<(), Error> {
        let Some(window) = handle.window() else {
            return Ok(());
        };
        self.region.close_window(window);
        self.wait_out(self.region.gate().held(), timeout).await
    }

    /// [`Self::set_access`] without waiting: [`Error::Busy`] if a peer's
    /// copy that `access` forbids is running now.
    pub fn try_set_access(&mut self, access: Access) -> Result<(), Error> {
        let Some(change) = self.begin_change(access) else {
            return Ok(());
        };
        let waiting = self.region.gate().conflicting(change.previous, access);
        if !waiting.is_empty() {
            return Err(Error::Busy {
                buffer: self.id(),
                pids: waiting.pids(),
                waited: Duration::ZERO,
            });
        }
        change.commit();
        self.finish_change(access);
        Ok(())
    }

    /// Stores the state of `access` in the header; the returned change
    /// restores the previous one when dropped uncommitted (a failed or
    /// cancelled change). `None`: nothing to change.
    fn begin_change(&self, access: Access) -> Option<StateChange> {
        if access == self.access {
            return None;
        }
        self.region.set_state(access.state());
        Some(StateChange {
            region: self.region.clone(),
            previous: self.access,
            committed: false,
        })
    }

    fn finish_change(&mut self, access: Access) {
        self.access = access;
        self.rekey();
        tracing::trace!(buffer = %self.id(), ?access, "buffer access changed");
    }

    /// Closes the buffer to peers (waiting as [`Self::set_access`] does)
    /// until the returned guard drops; the guard derefs to the bytes, and
    /// its drop restores the previous access.
    pub async fn lock_local(&mut self) -> Result<LocalGuard<'_>, Error> {
        let restore = self.access;
        self.set_access(Access::Local).await?;
        Ok(LocalGuard {
            buffer: self,
            restore,
        })
    }

    /// [`Self::lock_local`] without waiting ([`Error::Busy`]).
    pub fn try_lock_local(&mut self) -> Result<LocalGuard<'_>, Error> {
        let restore = self.access;
        self.try_set_access(Access::Local)?;
        Ok(LocalGuard {
            buffer: self,
            restore,
        })
    }

    /// Releases the buffer (the same as dropping it).
    pub fn release(self) {}

    /// The owner's view of the state word and slots (for tests).
    #[cfg(test)]
    pub(crate) fn region_gate(&self) -> crate::access::Gate<'_> {
        self.region.gate()
    }

    fn access_err(&self, need: &'static str) -> Error {
        Error::Access {
            buffer: self.id(),
            access: self.access,
            need,
        }
    }

    /// Registers the verbs memory region anew for the current access (the
    /// old one is deregistered first, so its rkey is dead before peers are
    /// told anything). Without a device, nothing to do.
    fn rekey(&mut self) {
        let Some(old) = self.mr.take() else { return };
        let manager = self.manager.upgrade();
        let addr = self.region.data_ptr() as usize;
        if let Some(m) = &manager {
            m.verbs_local
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&addr);
        }
        {
            // Deregistered here: the old rkey is dead before anything else.
            let _deregistered = old;
        }
        self.handle.set_verbs(None);
        let Some(m) = manager else { return };
        let Some(device) = &m.verbs else { return };
        match device.register(&self.region, self.access) {
            Ok(mr) => {
                self.handle.set_verbs(Some(VerbsDescriptor {
                    addr: addr as u64,
                    rkey: mr.rkey(),
                }));
                m.verbs_local
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(addr, (self.region.len_bytes(), mr.lkey()));
                self.mr = Some(mr);
            }
            Err(e) => {
                tracing::warn!(buffer = %self.id(), error = %e, "verbs re-registration failed: the buffer is off ibverbs");
            }
        }
    }
}

/// A change of access under way: until committed, dropping it puts the
/// previous state back in the header (so a cancelled `set_access` leaves
/// the buffer as it was).
struct StateChange {
    region: Arc<Region>,
    previous: Access,
    committed: bool,
}

impl StateChange {
    fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for StateChange {
    fn drop(&mut self) {
        if !self.committed {
            self.region.set_state(self.previous.state());
        }
    }
}

/// A [`LocalBuffer`] closed to peers for as long as this lives (from
/// [`LocalBuffer::lock_local`]): it derefs to the buffer's bytes, and its
/// drop restores the access the buffer had before.
pub struct LocalGuard<'a> {
    buffer: &'a mut LocalBuffer,
    restore: Access,
}

impl std::fmt::Debug for LocalGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGuard")
            .field("buffer", &self.buffer.id())
            .field("restore", &self.restore)
            .finish()
    }
}

impl std::ops::Deref for LocalGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the buffer is `Access::Local` while the guard lives (the
        // guard holds its only `&mut`), so no peer copies it; see
        // `LocalBuffer::as_mut_slice`.
        unsafe { self.buffer.region.data() }
    }
}

impl std::ops::DerefMut for LocalGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only
        // reference to the bytes in this process.
        unsafe { self.buffer.region.data_mut() }
    }
}

impl Drop for LocalGuard<'_> {
    fn drop(&mut self) {
        // Widening never waits, so it cannot be busy.
        if let Err(e) = self.buffer.try_set_access(self.restore) {
            tracing::warn!(buffer = %self.buffer.id(), error = %e, "buffer left Local");
        }
    }
}

impl Drop for LocalBuffer {
    fn drop(&mut self) {
        // Peers that map the segment see the state first, then the tcp
        // server stops finding it; the verbs region goes before the memory.
        self.region.set_state(STATE_RELEASED);
        if let Some(m) = self.manager.upgrade() {
            m.registry.remove(self.handle.id());
            m.verbs_local
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(self.region.data_ptr() as usize));
        }
        // Deregistered here, before the memory can be unmapped.
        let _mr = self.mr.take();
        tracing::debug!(buffer = %self.handle.id(), "buffer released");
    }
}

/// One operation of a [`Batch`].
#[derive(Debug)]
pub enum Op<'a> {
    /// Read `local.len()` bytes of `remote` from `offset` into `local`.
    Read {
        /// The buffer read.
        remote: &'a RemoteBuffer,
        /// Where in it.
        offset: u64,
        /// Where the bytes go.
        local: &'a mut [u8],
    },
    /// Write `local` into `remote` at `offset`.
    Write {
        /// The buffer written.
        remote: &'a RemoteBuffer,
        /// Where in it.
        offset: u64,
        /// The bytes.
        local: &'a [u8],
    },
}

/// Operations run together by [`BufferManager::run`] (at most
/// [`MAX_BATCH_OPS`], up to [`MAX_BATCH_CONCURRENCY`] at once).
#[derive(Debug, Default)]
pub struct Batch<'a> {
    ops: Vec<Op<'a>>,
}

impl<'a> Batch<'a> {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a read.
    pub fn read(
        &mut self,
        remote: &'a RemoteBuffer,
        offset: u64,
        local: &'a mut [u8],
    ) -> &mut Self {
        self.ops.push(Op::Read {
            remote,
            offset,
            local,
        });
        self
    }

    /// Adds a write.
    pub fn write(&mut self, remote: &'a RemoteBuffer, offset: u64, local: &'a [u8]) -> &mut Self {
        self.ops.push(Op::Write {
            remote,
            offset,
            local,
        });
        self
    }

    /// How many operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

impl BufferManager {
    /// Starts the manager of the proc whose credentials are `creds`: binds
    /// the tcp server, opens a verbs device when the feature is on and one
    /// is present, and starts the sweeper of peers' segments. Needs a tokio
    /// runtime.
    pub async fn start(config: ManagerConfig, creds: ProcCredentials) -> Result<Self, Error> {
        config.validate()?;
        let host = match config.host {
            Some(h) => h,
            None => HostId::local()?,
        };
        let verbs = if config.ibverbs {
            match verbs::Device::open(config.ibverbs_device.as_deref()) {
                Ok(d) => Some(Arc::new(d)),
                Err(e) => {
                    tracing::debug!(error = %e, "ibverbs backend off");
                    None
                }
            }
        } else {
            None
        };
        let registry = Arc::new(Registry::default());
        let tcp_server = TcpServer::start(&config, &creds, registry.clone(), verbs.clone()).await?;
        let tcp_client = TcpClient::new(&config, &creds)?;
        let inner = Arc::new(Inner {
            proc: creds.proc().clone(),
            host,
            policy: Mutex::new(config.backend),
            next_id: AtomicU64::new(1),
            registry,
            peers: PeerSegments::new(config.max_peer_segments),
            tcp_server,
            tcp_client,
            verbs,
            verbs_local: Mutex::new(BTreeMap::new()),
            verbs_peers: tokio::sync::Mutex::new(HashMap::new()),
            verbs_staging: tokio::sync::Mutex::new(None),
            copy_permits: tokio::sync::Semaphore::new(config.shm_copy_threads.get() as usize),
            sweeper: Mutex::new(None),
            traffic: Counters::default(),
            config,
        });
        let weak = Arc::downgrade(&inner);
        let interval = inner.config.liveness_interval;
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(inner) = weak.upgrade() else { break };
                let n = inner.peers.sweep();
                if n > 0 {
                    tracing::debug!(unmapped = n, "unmapped segments of released or dead owners");
                }
            }
        });
        *inner.sweeper.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        tracing::debug!(proc = %inner.proc, tcp = %inner.tcp_server.addr(), "buffer manager started");
        Ok(Self { inner })
    }

    /// The proc this manager serves.
    pub fn proc(&self) -> &ProcId {
        &self.inner.proc
    }

    /// This proc's host.
    pub fn host(&self) -> HostId {
        self.inner.host
    }

    /// Where the tcp backend serves this proc's buffers.
    pub fn tcp_addr(&self) -> SocketAddr {
        self.inner.tcp_server.addr()
    }

    /// What this manager's own operations have moved so far (bytes and
    /// operations, read and written, by backend; operations that
    /// completed, counted where they were started).
    pub fn traffic(&self) -> Traffic {
        self.inner.traffic.snapshot()
    }

    /// What the tcp server holds now: connections in each stage.
    pub fn tcp_load(&self) -> TcpLoad {
        self.inner.tcp_server.load()
    }

    /// Whether this manager opened a verbs device.
    pub fn ibverbs_enabled(&self) -> bool {
        self.inner.verbs.is_some()
    }

    /// What this side can use as a reader.
    pub fn caps(&self) -> LocalCaps {
        LocalCaps {
            host: self.inner.host,
            shm: self.inner.config.shm,
            ibverbs: self.inner.verbs.is_some(),
        }
    }

    /// The backend policy now in force.
    pub fn backend_policy(&self) -> BackendPolicy {
        *self.inner.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the backend policy (for tests and benchmarks).
    pub fn set_backend_policy(&self, policy: BackendPolicy) {
        *self.inner.policy.lock().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    /// The backend an operation on `remote` would use now.
    pub fn backend_for(&self, remote: &RemoteBuffer) -> Result<BackendKind, Error> {
        choose_backend(self.backend_policy(), &self.caps(), remote)
    }

    /// How many buffers are registered.
    pub fn registered(&self) -> usize {
        self.inner.registry.len()
    }

    /// The peers' segments mapped here (for tests).
    #[cfg(test)]
    pub(crate) fn peer_segments(&self) -> &PeerSegments {
        &self.inner.peers
    }

    /// How many other procs' segments are mapped here now.
    pub fn mapped_peer_segments(&self) -> usize {
        self.inner.peers.len()
    }

    /// Registers memory, [`Access::Exposed`]: it gets an id and a handle
    /// with a descriptor for every backend this manager serves (shm, tcp,
    /// and verbs with a device).
    pub fn register(&self, memory: Memory) -> Result<LocalBuffer, Error> {
        self.register_with(memory, Access::Exposed)
    }

    /// Registers memory with the given access to begin with.
    pub fn register_with(&self, memory: Memory, access: Access) -> Result<LocalBuffer, Error> {
        let inner = &self.inner;
        if inner.registry.len() >= inner.config.max_buffers {
            return Err(Error::TooManyBuffers {
                limit: inner.config.max_buffers,
            });
        }
        let region = Arc::new(memory.region);
        let id = BufferId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let mr = match &inner.verbs {
            Some(dev) => Some(dev.register(&region, access)?),
            None => None,
        };
        let handle = RemoteBuffer::new(
            inner.proc.clone(),
            id,
            region.len_bytes() as u64,
            inner.host,
            region.token(),
            inner.config.shm.then(|| ShmDescriptor {
                pid: std::process::id(),
                fd: region.fd(),
            }),
            Some(TcpDescriptor {
                addr: inner.tcp_server.addr(),
            }),
            mr.as_ref().map(|m| VerbsDescriptor {
                addr: region.data_ptr() as u64,
                rkey: m.rkey(),
            }),
        )?;
        if let Some(m) = &mr {
            inner
                .verbs_local
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(region.data_ptr() as usize, (region.len_bytes(), m.lkey()));
        }
        region.set_state(access.state());
        inner.registry.insert(id, region.clone());
        tracing::debug!(buffer = %id, len_bytes = region.len_bytes(), "buffer registered");
        Ok(LocalBuffer {
            region,
            handle,
            manager: Arc::downgrade(&self.inner),
            mr,
            access,
            access_timeout: inner.config.access_timeout,
        })
    }

    /// Allocates `len_bytes` of memory and registers it.
    pub fn register_new(&self, len_bytes: usize) -> Result<LocalBuffer, Error> {
        self.register(Memory::allocate(len_bytes)?)
    }

    /// Releases a buffer (the same as dropping it).
    pub fn release(&self, buffer: LocalBuffer) {
        drop(buffer);
    }

    /// Reads `local.len()` bytes of `remote`, from `offset`, into `local`.
    /// One-sided: the owner's application does nothing. Fails with
    /// [`Error::OutOfRange`] before any transfer if the range is outside
    /// the buffer, and with [`Error::Released`] or [`Error::OwnerDied`]
    /// once the buffer is gone.
    pub async fn read_into(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        local: &mut [u8],
    ) -> Result<(), Error> {
        remote.check_range(offset, local.len() as u64)?;
        let len = local.len();
        let backend = self.backend_for(remote)?;
        match backend {
            BackendKind::Shm => self.shm_read(remote, offset, local).await,
            BackendKind::Tcp => self.inner.tcp_client.read(remote, offset, local).await,
            BackendKind::Ibverbs => self.verbs_transfer(remote, offset, Dir::Read(local)).await,
        }?;
        self.inner.traffic.count(backend, Way::Read, len);
        Ok(())
    }

    /// Reads `len` bytes at each `(remote, offset)` of `reads` and hands
    /// them to `f` together, in order — without copying where the buffer is
    /// mapped here (shm: `f` sees the owner's memory, under an access slot
    /// of each segment, for as long as it runs); any other read goes into
    /// its `len` bytes of `scratch` first (`reads.len() * len` bytes). For
    /// folding peers' data straight from their memory. `f` runs on this
    /// thread and should be short (it holds the slots: a large `len` is
    /// read into `scratch` instead). Returns `f`'s result only if every
    /// owner still held its buffer when `f` ended; errors as for
    /// [`Self::read_into`] (`f` may then have seen torn bytes).
    pub async fn read_many_with<R>(
        &self,
        reads: &[(&RemoteBuffer, u64)],
        len: usize,
        scratch: &mut [u8],
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, Error> {
        if scratch.len() < reads.len().saturating_mul(len) {
            return Err(Error::Config(format!(
                "{} bytes of scratch for {} reads of {len}",
                scratch.len(),
                reads.len()
            )));
        }
        let inline =
            len <= INLINE_CHUNK_BYTES.min(self.inner.config.shm_chunk_bytes.get() as usize);
        // Which reads are views (shm) and which go through the scratch.
        let at = |index: usize| {
            move |e: Error| Error::Batch {
                index,
                source: Box::new(e),
            }
        };
        let mut segments = Vec::with_capacity(reads.len());
        for (i, (remote, offset)) in reads.iter().enumerate() {
            remote.check_range(*offset, len as u64).map_err(at(i))?;
            let view = inline && self.backend_for(remote).map_err(at(i))? == BackendKind::Shm;
            segments.push(if view {
                Some(self.inner.peers.get(remote).map_err(at(i))?)
            } else {
                None
            });
        }
        let mut slots: Vec<&mut [u8]> = scratch.chunks_mut(len.max(1)).take(reads.len()).collect();
        for (i, (remote, offset)) in reads.iter().enumerate() {
            if segments[i].is_none() {
                self.read_into(remote, *offset, &mut slots[i][..len])
                    .await
                    .map_err(at(i))?;
            }
        }
        // An access slot of every mapped segment, waited for as a copy waits.
        let started = Instant::now();
        let deadline = self.inner.config.op_timeout;
        let mut entered = Vec::with_capacity(reads.len());
        for (i, segment) in segments.iter().enumerate() {
            let Some(segment) = segment else {
                entered.push(None);
                continue;
            };
            let e = loop {
                match segment.enter(Kind::Read, reads[i].0.window()) {
                    Ok(Some(e)) => break e,
                    Ok(None) => {
                        slot_wait(started, deadline).map_err(at(i))?;
                        tokio::time::sleep(SLOT_RETRY).await;
                    }
                    Err(e) => return Err(at(i)(e)),
                }
            };
            entered.push(Some(e));
        }
        // What the owners wrote before they announced it is seen here.
        fence(Ordering::Acquire);
        let r = {
            let views: Vec<&[u8]> = entered
                .iter()
                .zip(&slots)
                .zip(reads)
                .map(|((e, slot), (_, offset))| match e {
                    Some(e) => e.view(*offset as usize, len),
                    None => &slot[..len],
                })
                .collect();
            f(&views)
        };
        drop(entered);
        // Complete only if every owner still had the buffer at the end.
        for (i, segment) in segments.iter().enumerate() {
            if let Some(segment) = segment {
                segment.check().map_err(at(i))?;
            }
        }
        // The views were reads through shm (the others counted as reads
        // where they ran).
        for _ in segments.iter().flatten() {
            self.inner.traffic.count(BackendKind::Shm, Way::Read, len);
        }
        Ok(r)
    }

    /// Claims a write slot of `remote`'s segment through shm, as a copy
    /// into it does, and holds it until the returned guard drops: a peer
    /// stopped inside a copy, for tests of what waits for one (the owner's
    /// narrowing of access, the closing of a window). Not API.
    #[doc(hidden)]
    pub fn stall_copy_for_test(&self, remote: &RemoteBuffer) -> Result<StalledCopy, Error> {
        let segment = self.inner.peers.get(remote)?;
        let window = remote.window();
        let (entered_tx, entered_rx) = std::sync::mpsc::sync_channel(1);
        let (release, released) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || match segment.enter(Kind::Write, window) {
            Ok(Some(held)) => {
                let _ = entered_tx.send(Ok(()));
                let _ = released.recv();
                drop(held);
            }
            Ok(None) => {
                let _ = entered_tx.send(Err(Error::Config("every access slot is held".into())));
            }
            Err(e) => {
                let _ = entered_tx.send(Err(e));
            }
        });
        let entered = entered_rx
            .recv()
            .unwrap_or_else(|_| Err(Error::Config("the stalling thread ended".into())));
        let stalled = StalledCopy {
            release: Some(release),
            thread: Some(thread),
        };
        entered.map(|()| stalled)
    }

    /// Writes `local` into `remote` at `offset`; returns once the bytes are
    /// in the owner's memory. Errors as for [`Self::read_into`].
    pub async fn write_from(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        local: &[u8],
    ) -> Result<(), Error> {
        remote.check_range(offset, local.len() as u64)?;
        let backend = self.backend_for(remote)?;
        match backend {
            BackendKind::Shm => self.shm_write(remote, offset, local).await,
            BackendKind::Tcp => self.inner.tcp_client.write(remote, offset, local).await,
            BackendKind::Ibverbs => self.verbs_transfer(remote, offset, Dir::Write(local)).await,
        }?;
        self.inner.traffic.count(backend, Way::Write, local.len());
        Ok(())
    }

    /// Runs a batch: every range is checked first (an out-of-range
    /// operation fails the batch before any transfer), then the operations
    /// run concurrently. All of them run to their end; the error of the
    /// first failed one (by index) is returned as [`Error::Batch`].
    pub async fn run(&self, batch: Batch<'_>) -> Result<(), Error> {
        if batch.ops.len() > MAX_BATCH_OPS {
            return Err(Error::Config(format!(
                "batch of {} operations, at most {MAX_BATCH_OPS}",
                batch.ops.len()
            )));
        }
        for (index, op) in batch.ops.iter().enumerate() {
            let (remote, offset, len) = match op {
                Op::Read {
                    remote,
                    offset,
                    local,
                } => (remote, *offset, local.len()),
                Op::Write {
                    remote,
                    offset,
                    local,
                } => (remote, *offset, local.len()),
            };
            remote
                .check_range(offset, len as u64)
                .map_err(|e| Error::Batch {
                    index,
                    source: Box::new(e),
                })?;
        }
        let mut results: Vec<(usize, Result<(), Error>)> =
            futures::stream::iter(batch.ops.into_iter().enumerate().map(|(i, op)| async move {
                let r = match op {
                    Op::Read {
                        remote,
                        offset,
                        local,
                    } => self.read_into(remote, offset, local).await,
                    Op::Write {
                        remote,
                        offset,
                        local,
                    } => self.write_from(remote, offset, local).await,
                };
                (i, r)
            }))
            .buffer_unordered(MAX_BATCH_CONCURRENCY)
            .collect()
            .await;
        results.sort_by_key(|(i, _)| *i);
        match results.into_iter().find(|(_, r)| r.is_err()) {
            Some((index, Err(e))) => Err(Error::Batch {
                index,
                source: Box::new(e),
            }),
            _ => Ok(()),
        }
    }

    async fn shm_read(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        local: &mut [u8],
    ) -> Result<(), Error> {
        self.shm_copy(remote, offset, ShmDir::Read(local)).await
    }

    async fn shm_write(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        local: &[u8],
    ) -> Result<(), Error> {
        self.shm_copy(remote, offset, ShmDir::Write(local)).await?;
        // The bytes are in the owner's memory before this returns (and
        // before any control message saying so is sent).
        fence(Ordering::Release);
        Ok(())
    }

    /// One shm operation, in chunks of `shm_chunk_bytes`, each under an
    /// access slot of the segment. A large one runs off the runtime's
    /// worker threads (`block_in_place`, at most `shm_copy_threads` at
    /// once), so the tasks of the control plane keep running; a small one,
    /// or any on a current-thread runtime, runs here and yields between
    /// chunks (of at most `INLINE_CHUNK_BYTES` then).
    async fn shm_copy(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        mut dir: ShmDir<'_>,
    ) -> Result<(), Error> {
        let peers = &self.inner.peers;
        let config = &self.inner.config;
        let segment = peers.get(remote)?;
        let deadline = config.op_timeout;
        let chunk = config.shm_chunk_bytes.get() as usize;
        let blocking = dir.len() >= config.shm_blocking_bytes
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let result = if blocking {
            let _permit = self
                .inner
                .copy_permits
                .acquire()
                .await
                .map_err(|_| Error::Shutdown)?;
            tokio::task::block_in_place(|| {
                let started = Instant::now();
                let mut done = 0;
                while done < dir.len() {
                    let n = (dir.len() - done).min(chunk);
                    if !shm_chunk(
                        &segment,
                        remote.window(),
                        offset as usize + done,
                        &mut dir,
                        done,
                        n,
                    )? {
                        slot_wait(started, deadline)?;
                        std::thread::sleep(SLOT_RETRY);
                        continue;
                    }
                    done += n;
                }
                Ok(())
            })
        } else {
            let chunk = if dir.len() > chunk {
                chunk.min(INLINE_CHUNK_BYTES)
            } else {
                chunk
            };
            let started = Instant::now();
            let mut done = 0;
            let mut result = Ok(());
            while done < dir.len() {
                let n = (dir.len() - done).min(chunk);
                match shm_chunk(
                    &segment,
                    remote.window(),
                    offset as usize + done,
                    &mut dir,
                    done,
                    n,
                ) {
                    Ok(true) => done += n,
                    Ok(false) => match slot_wait(started, deadline) {
                        Ok(()) => tokio::time::sleep(SLOT_RETRY).await,
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    },
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                if done < dir.len() {
                    tokio::task::yield_now().await;
                }
            }
            result
        };
        if blocking {
            // A blocking copy never returned `Pending`: let the futures
            // that share this task (a `join!`, a batch) run.
            tokio::task::yield_now().await;
        }
        // Complete only if the owner still had the buffer at the end.
        let result = result.and_then(|()| segment.check());
        if let Err(e) = &result
            && e.is_invalidated()
        {
            peers.forget(remote);
        }
        if matches!(dir, ShmDir::Read(_)) && result.is_ok() {
            fence(Ordering::Acquire);
        }
        result
    }

    /// The lkey of registered local memory holding `ptr..ptr + len`.
    fn local_lkey(&self, ptr: usize, len: usize) -> Option<u32> {
        let map = self
            .inner
            .verbs_local
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (&start, &(region_len, lkey)) = map.range(..=ptr).next_back()?;
        (ptr + len <= start + region_len).then_some(lkey)
    }

    async fn verbs_transfer(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        mut dir: Dir<'_>,
    ) -> Result<(), Error> {
        let desc = remote.verbs().ok_or_else(|| Error::NoBackend {
            owner: remote.owner().clone(),
            buffer: remote.id(),
            reason: "no verbs descriptor".into(),
        })?;
        let Some(device) = self.inner.verbs.clone() else {
            return Err(Error::Unavailable {
                backend: BackendKind::Ibverbs,
                reason: verbs::available().err().unwrap_or_default(),
            });
        };
        let addr = remote
            .tcp()
            .map(|t| t.addr)
            .ok_or_else(|| Error::InvalidHandle("verbs descriptor without tcp".into()))?;
        let key = (remote.owner().clone(), addr);
        let mut peers = self.inner.verbs_peers.lock().await;
        if !peers.contains_key(&key) {
            let (mut qp, mine) = device.new_qp()?;
            let (conn, theirs) = self.inner.tcp_client.verbs_connect(remote, mine).await?;
            qp.connect(theirs)?;
            peers.insert(key.clone(), VerbsPeer { _conn: conn, qp });
        }
        let deadline = self.inner.config.op_timeout;
        let (ptr, len, write) = match &mut dir {
            Dir::Read(b) => (b.as_mut_ptr() as usize, b.len(), false),
            Dir::Write(b) => (b.as_ptr() as usize, b.len(), true),
        };
        let result = async {
            let peer = peers.get_mut(&key).ok_or(Error::Shutdown)?;
            if let Some(lkey) = self.local_lkey(ptr, len) {
                // Zero copy: the local side is registered memory.
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(VERBS_MAX_WR_BYTES);
                    peer.qp
                        .transfer(
                            write,
                            lkey,
                            (ptr + done) as u64,
                            n as u32,
                            desc.rkey,
                            desc.addr + offset + done as u64,
                            deadline,
                        )
                        .await?;
                    done += n;
                }
                return Ok(());
            }
            // Staged through a registered bounce buffer.
            let mut staging = self.inner.verbs_staging.lock().await;
            if staging.is_none() {
                // Never exposed: its handle goes to no one.
                let memory = Memory::allocate(VERBS_STAGING_BYTES)?;
                *staging = Some(self.register_with(memory, Access::Local)?);
            }
            let stage = staging.as_mut().ok_or(Error::Shutdown)?;
            let lkey = stage.mr.as_ref().map(|m| m.lkey()).ok_or(Error::Shutdown)?;
            let stage_ptr = stage.region.data_ptr() as u64;
            let stage = stage.as_mut_slice()?;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(VERBS_STAGING_BYTES);
                if let Dir::Write(b) = &dir {
                    stage[..n].copy_from_slice(&b[done..done + n]);
                }
                peer.qp
                    .transfer(
                        write,
                        lkey,
                        stage_ptr,
                        n as u32,
                        desc.rkey,
                        desc.addr + offset + done as u64,
                        deadline,
                    )
                    .await?;
                if let Dir::Read(b) = &mut dir {
                    b[done..done + n].copy_from_slice(&stage[..n]);
                }
                done += n;
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            // A queue pair in error state is useless: set up a new one next
            // time.
            peers.remove(&key);
        }
        result
    }
}

enum Dir<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

/// An shm operation's local side.
enum ShmDir<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl ShmDir<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Read(b) => b.len(),
            Self::Write(b) => b.len(),
        }
    }
}

/// The largest chunk of a large shm copy that runs on a worker thread (on a
/// current-thread runtime): about a millisecond of copying.
const INLINE_CHUNK_BYTES: usize = 8 << 20;
/// How long an shm copy waits before it tries again for a free access slot.
const SLOT_RETRY: Duration = Duration::from_micros(100);

/// Copies `n` bytes between `segment` at `at` and `dir` at `local_at`
/// under one access slot. `Ok(false)`: every slot is held, nothing copied.
fn shm_chunk(
    segment: &PeerSegment,
    window: Option<Window>,
    at: usize,
    dir: &mut ShmDir<'_>,
    local_at: usize,
    n: usize,
) -> Result<bool, Error> {
    let kind = match dir {
        ShmDir::Read(_) => Kind::Read,
        ShmDir::Write(_) => Kind::Write,
    };
    let Some(entered) = segment.enter(kind, window)? else {
        return Ok(false);
    };
    match dir {
        ShmDir::Read(b) => entered.copy_out(at, &mut b[local_at..local_at + n]),
        ShmDir::Write(b) => entered.copy_in(at, &b[local_at..local_at + n]),
    }
    Ok(true)
}

/// A held access slot of [`BufferManager::stall_copy_for_test`]: dropping it
/// ends the stalled copy. Not API.
#[doc(hidden)]
#[derive(Debug)]
pub struct StalledCopy {
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for StalledCopy {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Fails once an operation has waited its deadline for an access slot.
fn slot_wait(started: Instant, deadline: Duration) -> Result<(), Error> {
    if started.elapsed() >= deadline {
        return Err(Error::Timeout {
            what: "a free access slot of the shm segment",
            after: deadline,
        });
    }
    Ok(())
}
