//! The per-proc buffer manager: registration, handles, one-sided reads and
//! writes through the chosen backend, batches and release.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};

use futures::StreamExt as _;
use regent_net::{ProcCredentials, ProcId};

use crate::choice::{LocalCaps, choose_backend};
use crate::config::{BackendKind, BackendPolicy, ManagerConfig};
use crate::error::Error;
use crate::handle::{
    BufferId, HostId, RemoteBuffer, ShmDescriptor, TcpDescriptor, VerbsDescriptor,
};
use crate::memory::{Memory, Region, STATE_REGISTERED, STATE_RELEASED};
use crate::shm::PeerSegments;
use crate::tcp::{Conn, Registry, TcpClient, TcpServer};
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
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
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
/// [`RemoteBuffer`] handle. The owner reads and writes it as a slice.
///
/// Contract (as with RDMA): while a peer's operation on a range is in
/// flight, the owner does not access that range, and peers do not write
/// ranges that others access; otherwise the bytes seen are unspecified.
/// Dropping the buffer (or [`LocalBuffer::release`]) releases it: peers'
/// later operations fail with [`Error::Released`], and the memory is freed
/// once in-flight operations and peers' mappings let go of it.
pub struct LocalBuffer {
    region: Arc<Region>,
    handle: RemoteBuffer,
    manager: Weak<Inner>,
    mr: Option<verbs::MemoryRegion>,
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl LocalBuffer {
    /// The handle to send to peers.
    pub fn handle(&self) -> &RemoteBuffer {
        &self.handle
    }

    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        self.handle.id()
    }

    /// Releases the buffer (the same as dropping it).
    pub fn release(self) {}
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

impl std::ops::Deref for LocalBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region is mapped while `self` lives; the contract of
        // registered memory (type docs) rules out concurrent peer writes to
        // bytes the owner reads.
        unsafe { self.region.data() }
    }
}

impl std::ops::DerefMut for LocalBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` excludes other references in
        // this process (the tcp server copies through raw pointers).
        unsafe { self.region.data_mut() }
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
            sweeper: Mutex::new(None),
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

    /// How many other procs' segments are mapped here now.
    pub fn mapped_peer_segments(&self) -> usize {
        self.inner.peers.len()
    }

    /// Registers memory: it gets an id and a handle with a descriptor for
    /// every backend this manager serves (shm, tcp, and verbs with a
    /// device).
    pub fn register(&self, memory: Memory) -> Result<LocalBuffer, Error> {
        let inner = &self.inner;
        if inner.registry.len() >= inner.config.max_buffers {
            return Err(Error::TooManyBuffers {
                limit: inner.config.max_buffers,
            });
        }
        let region = Arc::new(memory.region);
        let id = BufferId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let mr = match &inner.verbs {
            Some(dev) => Some(dev.register(&region)?),
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
        region.set_state(STATE_REGISTERED);
        inner.registry.insert(id, region.clone());
        tracing::debug!(buffer = %id, len_bytes = region.len_bytes(), "buffer registered");
        Ok(LocalBuffer {
            region,
            handle,
            manager: Arc::downgrade(&self.inner),
            mr,
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
        match self.backend_for(remote)? {
            BackendKind::Shm => self.shm_read(remote, offset, local).await,
            BackendKind::Tcp => self.inner.tcp_client.read(remote, offset, local).await,
            BackendKind::Ibverbs => self.verbs_transfer(remote, offset, Dir::Read(local)).await,
        }
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
        match self.backend_for(remote)? {
            BackendKind::Shm => self.shm_write(remote, offset, local).await,
            BackendKind::Tcp => self.inner.tcp_client.write(remote, offset, local).await,
            BackendKind::Ibverbs => self.verbs_transfer(remote, offset, Dir::Write(local)).await,
        }
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
        let peers = &self.inner.peers;
        let segment = peers.get(remote)?;
        let chunk = self.inner.config.shm_chunk_bytes.get() as usize;
        let mut at = offset as usize;
        for piece in local.chunks_mut(chunk) {
            segment.check().inspect_err(|_| peers.forget(remote))?;
            segment.copy_out(at, piece);
            at += piece.len();
            tokio::task::yield_now().await;
        }
        fence(Ordering::Acquire);
        // Complete only if the owner still had the buffer at the end.
        segment.check().inspect_err(|_| peers.forget(remote))
    }

    async fn shm_write(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        local: &[u8],
    ) -> Result<(), Error> {
        let peers = &self.inner.peers;
        let segment = peers.get(remote)?;
        let chunk = self.inner.config.shm_chunk_bytes.get() as usize;
        let mut at = offset as usize;
        for piece in local.chunks(chunk) {
            segment.check().inspect_err(|_| peers.forget(remote))?;
            segment.copy_in(at, piece);
            at += piece.len();
            tokio::task::yield_now().await;
        }
        // The bytes are in the owner's memory before this returns (and
        // before any control message saying so is sent).
        fence(Ordering::Release);
        segment.check().inspect_err(|_| peers.forget(remote))
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
                *staging = Some(self.register_new(VERBS_STAGING_BYTES)?);
            }
            let stage = staging.as_mut().ok_or(Error::Shutdown)?;
            let lkey = stage.mr.as_ref().map(|m| m.lkey()).ok_or(Error::Shutdown)?;
            let stage_ptr = stage.region.data_ptr() as u64;
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
