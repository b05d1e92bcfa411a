//! The tcp backend: the owner serves its registered buffers over mutual TLS
//! (the cluster CA and proc certificates of `regent-net`), chunked and
//! pipelined, on one or more connections. After the handshake, hello and
//! welcome the connection's TLS keys carry frames of up to 1 MiB
//! ([`sealed`]) instead of TLS's 16 KiB records: a reader's socket bytes
//! land in its destination and are opened there, with no copy through
//! rustls's buffers.
//!
//! One-sided from the reader's point of view: the reader's request names
//! the buffer, range and token, and the owner's serving task (not the
//! owner's application code) copies between the socket and the buffer.
//! Without RDMA some thread of the owner must do that copy; it is this
//! crate's task, on the owner's tokio runtime.
//!
//! Security: the server requires a client certificate signed by the cluster
//! CA (rustls refuses any other at the handshake), reads the proc id the
//! client claims and checks that the certificate names it; the client checks
//! that the server's certificate names the owner of the handle. Each request
//! carries the buffer's 128-bit token, so holding a cluster certificate is
//! not enough to reach a buffer whose handle one was not given. Requests are
//! bounded (`MAX_TCP_CHUNK_BYTES`) and land only in registered, in-range
//! regions.

pub(crate) mod sealed;
pub(crate) mod wire;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use regent_net::{ProcCredentials, ProcId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::access::{Kind, Refusal, STATE_LOCAL, STATE_READ_ONLY, Window};
use crate::config::{MAX_TCP_CHUNK_BYTES, ManagerConfig};
use crate::error::Error;
use crate::handle::{BufferId, RemoteBuffer, Token};
use crate::memory::Region;
use crate::verbs::{self, QP_ENDPOINT_BYTES, QpEndpoint};
use sealed::{MAX_FRAME_BYTES, Room, Sealed, same_page_offset};
use wire::{
    ALPN, HELLO_MAGIC, Op, REQUEST_BYTES, RESPONSE_BYTES, Request, Response, Status, WELCOME_BUSY,
    WELCOME_OK, WELCOME_REFUSED, token_eq,
};

/// Bytes per sealed frame of data, and per copy out of (or into) a buffer
/// by the server: small enough to stay in cache between the copy and the
/// encryption.
const PIECE_BYTES: usize = 256 << 10;
const _: () = assert!(PIECE_BYTES <= MAX_FRAME_BYTES);
/// Queue pairs one connection may set up.
const MAX_QPS_PER_CONNECTION: usize = 4;

/// The buffers a manager serves, by id.
#[derive(Default)]
pub(crate) struct Registry {
    buffers: RwLock<HashMap<BufferId, Arc<Region>>>,
}

impl Registry {
    pub(crate) fn insert(&self, id: BufferId, region: Arc<Region>) {
        self.write().insert(id, region);
    }

    pub(crate) fn remove(&self, id: BufferId) -> Option<Arc<Region>> {
        self.write().remove(&id)
    }

    pub(crate) fn len(&self) -> usize {
        self.buffers.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The region of a request whose token and range check out.
    fn lookup(&self, req: &Request) -> Result<Arc<Region>, Status> {
        let map = self.buffers.read().unwrap_or_else(|p| p.into_inner());
        let region = map.get(&req.buffer).ok_or(Status::UnknownBuffer)?;
        if !token_eq(&region.token(), &req.token) {
            return Err(Status::UnknownBuffer);
        }
        match req.offset.checked_add(u64::from(req.len_bytes)) {
            Some(end) if end <= region.len_bytes() as u64 => Ok(region.clone()),
            _ => Err(Status::OutOfRange),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<BufferId, Arc<Region>>> {
        // Each write is a single insert or remove: a panic cannot leave the
        // map half-changed.
        self.buffers.write().unwrap_or_else(|p| p.into_inner())
    }
}

fn tls_configs(creds: &ProcCredentials) -> Result<(TlsAcceptor, TlsConnector), Error> {
    let mut server = creds.server_config()?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    // After the welcome the connection's frames are sealed with its TLS
    // keys by this crate (`sealed`).
    server.enable_secret_extraction = true;
    // The control plane's client config (AES-128-GCM first, see
    // `regent_net::tls::crypto_provider`), with this plane's ALPN.
    let mut client = creds.client_config()?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    client.enable_secret_extraction = true;
    Ok((
        TlsAcceptor::from(Arc::new(server)),
        TlsConnector::from(Arc::new(client)),
    ))
}

/// Seals and opens `bytes` in place in the pieces a transfer's frames
/// carry (AES-128-GCM): the AEAD's CPU per byte, which `regent bench rdma`
/// adds to a raw stream's for the tcp figures' floor. Not API.
#[doc(hidden)]
pub fn seal_and_open(bytes: &mut [u8]) -> std::io::Result<()> {
    sealed::seal_and_open(bytes, PIECE_BYTES)
}

/// Socket reads go through a buffer this large: rustls asks for 4 KiB at a
/// time, which would otherwise cost a system call per 4 KiB.
const SOCKET_READ_BUFFER_BYTES: usize = 256 << 10;

/// A TCP stream with buffered reads (writes pass through).
type Socket = tokio::io::BufReader<TcpStream>;

fn socket(tcp: TcpStream) -> Socket {
    tokio::io::BufReader::with_capacity(SOCKET_READ_BUFFER_BYTES, tcp)
}

/// The owner's side: a listener and one task per connection. Dropping it
/// stops them all.
pub(crate) struct TcpServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    connections: Arc<AtomicUsize>,
    admission: SharedAdmission,
    clients: Arc<Semaphore>,
    max_clients: usize,
}

/// What the tcp server holds now (see [`crate::BufferManager::tcp_load`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpLoad {
    /// Connections accepted and not yet ended, in any stage.
    pub connections: usize,
    /// Connections that have not sent a byte yet.
    pub silent: usize,
    /// Connections in their handshake.
    pub handshaking: usize,
    /// Authenticated connections being served.
    pub serving: usize,
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct ServeCtx {
    acceptor: TlsAcceptor,
    registry: Arc<Registry>,
    verbs: Option<Arc<verbs::Device>>,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    op_timeout: Duration,
}

/// How many connections the server holds in each stage.
#[derive(Clone, Copy)]
struct Limits {
    /// Authenticated connections.
    clients: usize,
    /// Connections that have not sent a byte yet.
    silent: usize,
    /// Connections in their handshake, in all.
    handshakes: usize,
    /// Connections in their handshake, per IP address.
    handshakes_per_addr: usize,
}

impl TcpServer {
    pub(crate) async fn start(
        config: &ManagerConfig,
        creds: &ProcCredentials,
        registry: Arc<Registry>,
        verbs: Option<Arc<verbs::Device>>,
    ) -> Result<Self, Error> {
        let (acceptor, _) = tls_configs(creds)?;
        let listener = TcpListener::bind(config.tcp_bind_addr)
            .await
            .map_err(Error::io("bind the rdma tcp listener"))?;
        let bound = listener
            .local_addr()
            .map_err(Error::io("rdma tcp listener address"))?;
        let addr = config.tcp_advertise_addr.unwrap_or(bound);
        let ctx = ServeCtx {
            acceptor,
            registry,
            verbs,
            handshake_timeout: config.tcp_handshake_timeout,
            idle_timeout: config.tcp_idle_timeout,
            op_timeout: config.op_timeout,
        };
        let limits = Limits {
            clients: config.tcp_max_clients.get() as usize,
            silent: config.tcp_max_silent.get() as usize,
            handshakes: config.tcp_max_handshakes.get() as usize,
            handshakes_per_addr: config.tcp_max_handshakes_per_addr.get() as usize,
        };
        let connections = Arc::new(AtomicUsize::new(0));
        let admission = SharedAdmission::default();
        let clients = Arc::new(Semaphore::new(limits.clients));
        let task = tokio::spawn(accept_loop(
            listener,
            ctx,
            limits,
            Shared {
                connections: connections.clone(),
                admission: admission.clone(),
                clients: clients.clone(),
            },
        ));
        tracing::debug!(%addr, "rdma tcp server listening");
        Ok(Self {
            addr,
            task,
            connections,
            admission,
            clients,
            max_clients: limits.clients,
        })
    }

    /// The address put in handles.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the server holds now.
    pub(crate) fn load(&self) -> TcpLoad {
        let (silent, handshaking) = {
            let a = lock_admission(&self.admission);
            (a.silent.len(), a.handshakes)
        };
        TcpLoad {
            connections: self.connections.load(Ordering::SeqCst),
            silent,
            handshaking,
            serving: self.max_clients - self.clients.available_permits(),
        }
    }
}

/// A connection that has not sent a byte yet.
struct Silent {
    since: Instant,
    abort: AbortHandle,
}

/// The silent connections, by a number of the accept loop, and the
/// connections in their handshake, per address.
#[derive(Default)]
struct Admission {
    next: u64,
    silent: HashMap<u64, Silent>,
    handshakes: usize,
    handshakes_by_addr: HashMap<IpAddr, usize>,
}

type SharedAdmission = Arc<Mutex<Admission>>;

fn lock_admission(a: &SharedAdmission) -> std::sync::MutexGuard<'_, Admission> {
    // Every change is a single insert, removal or count: a panic leaves
    // the tables consistent.
    a.lock().unwrap_or_else(|p| p.into_inner())
}

impl Admission {
    /// Makes room for one more silent connection: when the table is full,
    /// the oldest silent one is dropped. A client that means business sends
    /// its TLS hello at once and leaves this table within microseconds, so
    /// idle connections cannot keep it out however many there are.
    fn make_room(&mut self, limit: usize) {
        if self.silent.len() < limit {
            return;
        }
        let oldest = self
            .silent
            .iter()
            .min_by_key(|(_, c)| c.since)
            .map(|(&id, _)| id);
        if let Some(c) = oldest.and_then(|id| self.silent.remove(&id)) {
            c.abort.abort();
            tracing::debug!("rdma tcp: the oldest silent connection dropped to make room");
        }
    }
}

/// A connection's place in the admission tables: first among the silent
/// ones, then (once it has sent bytes) among the handshakes. Dropping it
/// leaves whichever it holds.
struct Place {
    id: u64,
    addr: IpAddr,
    handshaking: bool,
    table: SharedAdmission,
}

impl Place {
    /// Leaves the silent table for the handshakes, if there is room for
    /// one more in all and from this address; false if there is not, or if
    /// the connection was dropped from the silent table meanwhile.
    fn start_handshake(&mut self, limits: Limits) -> bool {
        let mut t = lock_admission(&self.table);
        if t.silent.remove(&self.id).is_none() {
            return false;
        }
        let from_addr = t.handshakes_by_addr.get(&self.addr).copied().unwrap_or(0);
        if t.handshakes >= limits.handshakes || from_addr >= limits.handshakes_per_addr {
            return false;
        }
        t.handshakes += 1;
        *t.handshakes_by_addr.entry(self.addr).or_default() += 1;
        self.handshaking = true;
        true
    }

    /// Leaves the handshakes (done: served or refused).
    fn finish(&mut self) {
        if !std::mem::take(&mut self.handshaking) {
            return;
        }
        let mut t = lock_admission(&self.table);
        t.handshakes = t.handshakes.saturating_sub(1);
        if let Some(n) = t.handshakes_by_addr.get_mut(&self.addr) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                t.handshakes_by_addr.remove(&self.addr);
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.finish();
        lock_admission(&self.table).silent.remove(&self.id);
    }
}

/// Counts a connection task while it lives.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What the accept loop shares with the server's handle.
struct Shared {
    connections: Arc<AtomicUsize>,
    admission: SharedAdmission,
    clients: Arc<Semaphore>,
}

async fn accept_loop(listener: TcpListener, ctx: ServeCtx, limits: Limits, shared: Shared) {
    // Connection tasks live in this set: aborting the loop drops them.
    let mut conns = JoinSet::new();
    let Shared {
        connections,
        admission,
        clients,
    } = shared;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "rdma tcp accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let mut table = lock_admission(&admission);
                table.make_room(limits.silent);
                let id = table.next;
                table.next += 1;
                let place = Place { id, addr: peer.ip(), handshaking: false, table: admission.clone() };
                let ctx = ctx.clone();
                let clients = clients.clone();
                connections.fetch_add(1, Ordering::SeqCst);
                let counted = Counted(connections.clone());
                // Inserted under the lock the task needs to leave the table,
                // so it is there before the task looks.
                let abort = conns.spawn(async move {
                    let _counted = counted;
                    if let Err(e) = serve_connection(tcp, peer, ctx, place, limits, clients).await {
                        tracing::debug!(%peer, error = %e, "rdma tcp connection ended");
                    }
                });
                table.silent.insert(id, Silent { since: Instant::now(), abort });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Waits for `f` at most `after`; its I/O error is reported as `what`.
async fn within<T>(
    after: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Error> {
    match timeout(after, f).await {
        Err(_) => Err(Error::Timeout { what, after }),
        Ok(r) => r.map_err(Error::io(what)),
    }
}

type ServerTls = tokio_rustls::server::TlsStream<Socket>;

/// Hands a connection whose handshake, hello and welcome are done over to
/// the sealed frames, with its TLS keys and sequence numbers.
pub(crate) fn seal(io: Socket, conn: impl Into<rustls::Connection>) -> Result<Sealed, String> {
    let mut conn = conn.into();
    let state = conn.process_new_packets().map_err(|e| e.to_string())?;
    if state.plaintext_bytes_to_read() != 0 {
        return Err("bytes after the hello or welcome, before the first frame".into());
    }
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| format!("take the TLS keys: {e}"))?;
    Sealed::new(io, secrets)
}

/// TLS, the ALPN, the hello and the identity check: the client's proc.
async fn handshake(
    tcp: TcpStream,
    peer: SocketAddr,
    ctx: &ServeCtx,
) -> Result<(ServerTls, ProcId), Error> {
    let refused = |reason: String| Error::Refused {
        peer: peer.to_string(),
        reason,
    };
    let mut tls = ctx
        .acceptor
        .accept(socket(tcp))
        .await
        .map_err(|e| refused(format!("TLS handshake: {e}")))?;
    // rustls refuses a client whose ALPN list lacks ours, but lets one
    // through that offers none: it is not speaking this protocol.
    if tls.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(refused("the client offered no ALPN regent-rdma/2".into()));
    }
    // Hello: the proc the client claims to be, checked against its
    // (chain-verified) certificate.
    let mut head = [0u8; 5];
    tls.read_exact(&mut head)
        .await
        .map_err(|e| refused(format!("no hello: {e}")))?;
    let id_len = head[4] as usize;
    if head[..4] != HELLO_MAGIC || id_len == 0 || id_len > regent_net::id::MAX_PROC_ID_BYTES {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            reason: "bad hello".into(),
        });
    }
    let mut id = vec![0u8; id_len];
    tls.read_exact(&mut id)
        .await
        .map_err(Error::io("read hello"))?;
    let claimed = std::str::from_utf8(&id)
        .ok()
        .and_then(|s| ProcId::new(s).ok())
        .ok_or_else(|| Error::Protocol {
            peer: peer.to_string(),
            reason: "hello names no valid proc".into(),
        })?;
    let certs = tls.get_ref().1.peer_certificates().unwrap_or_default();
    if let Err(e) = regent_net::tls::verify_proc_identity(certs, &claimed) {
        let _ = tls.write_all(&[WELCOME_REFUSED]).await;
        let _ = tls.shutdown().await;
        tracing::warn!(%peer, %claimed, "rdma tcp client refused: {e}");
        return Err(refused(e.to_string()));
    }
    Ok((tls, claimed))
}

async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    ctx: ServeCtx,
    mut place: Place,
    limits: Limits,
    clients: Arc<Semaphore>,
) -> Result<(), Error> {
    let _ = tcp.set_nodelay(true);
    let late = |what| Error::Timeout {
        what,
        after: ctx.handshake_timeout,
    };
    // One deadline from accept to the welcome: a connection that sends
    // nothing, or stalls in its handshake, holds its place this long at most.
    let deadline = tokio::time::Instant::now() + ctx.handshake_timeout;
    // `readable` may report readiness spuriously; a peek returns only once
    // a byte is there (0: the client closed).
    let mut first = [0u8; 1];
    let n = tokio::time::timeout_at(deadline, tcp.peek(&mut first))
        .await
        .map_err(|_| late("rdma tcp client's first bytes"))?
        .map_err(Error::io("wait for the client's first bytes"))?;
    if n == 0 {
        return Ok(());
    }
    if !place.start_handshake(limits) {
        return Err(Error::Refused {
            peer: peer.to_string(),
            reason: "too many handshakes in progress (from this address or in all)".into(),
        });
    }
    let (mut tls, claimed) = tokio::time::timeout_at(deadline, handshake(tcp, peer, &ctx))
        .await
        .map_err(|_| late("rdma tcp handshake"))??;
    place.finish();
    let Ok(_client) = clients.try_acquire_owned() else {
        let _ = within(ctx.op_timeout, "write welcome", async {
            tls.write_all(&[WELCOME_BUSY]).await?;
            tls.shutdown().await
        })
        .await;
        tracing::warn!(%peer, client = %claimed, "rdma tcp server full, client refused");
        return Err(Error::Refused {
            peer: peer.to_string(),
            reason: "the server serves as many clients as it may".into(),
        });
    };
    within(ctx.op_timeout, "write welcome", async {
        tls.write_all(&[WELCOME_OK]).await?;
        tls.flush().await
    })
    .await?;
    tracing::debug!(%peer, client = %claimed, "rdma tcp client accepted");
    let peer_name = claimed.to_string();
    let op_timeout = ctx.op_timeout;
    let (io, conn) = tls.into_inner();
    let mut tls = seal(io, conn).map_err(|reason| Error::Protocol {
        peer: peer_name.clone(),
        reason,
    })?;

    // A read piece is sealed from the region into its frame (length,
    // payload, tag); a write piece is opened in place, then copied into the
    // region. Each is placed like the bytes of the region it is sealed from
    // or copied into.
    let mut room = Room::new(PIECE_BYTES);
    let mut qps = Vec::new();
    loop {
        match timeout(ctx.idle_timeout, tls.at_eof()).await {
            Err(_) | Ok(Ok(true)) => return Ok(()), // idle or closed: close
            Ok(Err(e)) => return Err(Error::io("read request")(e)),
            Ok(Ok(false)) => {}
        }
        let hdr = within(op_timeout, "read request", tls.recv_msg::<REQUEST_BYTES>()).await?;
        let req = Request::decode(&hdr).map_err(|reason| Error::Protocol {
            peer: peer_name.clone(),
            reason,
        })?;
        let window = req.window;
        if req.len_bytes > MAX_TCP_CHUNK_BYTES {
            send_response(&mut tls, Status::TooLarge, 0, op_timeout).await?;
            return Err(Error::Protocol {
                peer: peer_name,
                reason: format!("request of {} bytes", req.len_bytes),
            });
        }
        match req.op {
            Op::Read => {
                let len = req.len_bytes as usize;
                // The first piece decides the answer: refused, or the bytes.
                let region = match ctx.registry.lookup(&req) {
                    Ok(region) => region,
                    Err(status) => {
                        send_response(&mut tls, status, 0, op_timeout).await?;
                        continue;
                    }
                };
                if len == 0 {
                    let status = region_access(&region, Kind::Read, window, op_timeout)
                        .await
                        .err()
                        .unwrap_or(Status::Ok);
                    send_response(&mut tls, status, 0, op_timeout).await?;
                    continue;
                }
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(PIECE_BYTES);
                    let at = req.offset as usize + done;
                    let frame = room.frame(n, region.data_ptr().wrapping_add(at));
                    let entered = match region_access(&region, Kind::Read, window, op_timeout).await
                    {
                        Ok(entered) => entered,
                        Err(status) if done == 0 => {
                            send_response(&mut tls, status, 0, op_timeout).await?;
                            break;
                        }
                        Err(status) => {
                            // The bytes were promised and may not be read
                            // now (closed or released mid-request): the
                            // stream cannot stay in step, so it ends.
                            return Err(Error::Protocol {
                                peer: peer_name,
                                reason: format!(
                                    "read of {} refused mid-request ({status:?})",
                                    req.buffer
                                ),
                            });
                        }
                    };
                    // Sealed straight from the region under its slot, the
                    // answer's header first (a frame's sequence number is
                    // its place in the stream); the slot is given back
                    // before the write waits.
                    if done == 0 {
                        queue_header(&mut tls, Status::Ok, req.len_bytes)?;
                    }
                    let sealed = tls.seal_into(entered.view(at, n), frame);
                    drop(entered);
                    sealed.map_err(Error::io("seal read data"))?;
                    // Header (first piece) and sealed piece in one write.
                    within(op_timeout, "send read data", tls.write_frame(frame)).await?;
                    done += n;
                }
            }
            Op::Write => {
                let target = ctx.registry.lookup(&req);
                let mut status = target.as_ref().err().copied().unwrap_or(Status::Ok);
                let len = req.len_bytes as usize;
                let mut done = 0usize;
                while done < len {
                    // Placed like the bytes' place in the region (only an
                    // address: a refused write's offset is never used).
                    let like = target.as_ref().map_or(std::ptr::null_mut(), |r| {
                        r.data_ptr()
                            .wrapping_add(req.offset as usize)
                            .wrapping_add(done)
                    });
                    let piece = room.payload((len - done).min(PIECE_BYTES), like);
                    // Opened in the piece buffer, never in the region: only
                    // authenticated bytes land there.
                    let n = timeout(ctx.idle_timeout, tls.recv_into(piece))
                        .await
                        .map_err(|_| Error::Timeout {
                            what: "write payload",
                            after: ctx.idle_timeout,
                        })?
                        .map_err(Error::io("read write data"))?;
                    // Refused writes are read and dropped, keeping the
                    // stream in step.
                    if let (Ok(region), Status::Ok) = (&target, status) {
                        let at = req.offset as usize + done;
                        match region_access(region, Kind::Write, window, op_timeout).await {
                            Ok(entered) => {
                                debug_assert!(
                                    same_page_offset(
                                        piece.as_ptr(),
                                        region.data_ptr().wrapping_add(at)
                                    ),
                                    "a piece placed unlike its region's bytes"
                                );
                                entered.copy_in(at, &piece[..n]);
                            }
                            Err(s) => status = s,
                        }
                    }
                    done += n;
                }
                if status == Status::Ok {
                    // The bytes are in the buffer before the client hears
                    // so.
                    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
                }
                send_response(&mut tls, status, 0, op_timeout).await?;
            }
            Op::VerbsConnect => {
                if req.len_bytes as usize != QP_ENDPOINT_BYTES {
                    return Err(Error::Protocol {
                        peer: peer_name,
                        reason: "verbs endpoint of the wrong size".into(),
                    });
                }
                let ep = within(
                    op_timeout,
                    "read verbs endpoint",
                    tls.recv_msg::<QP_ENDPOINT_BYTES>(),
                )
                .await?;
                let client = QpEndpoint::decode(&ep);
                let answer = match (&ctx.verbs, qps.len() < MAX_QPS_PER_CONNECTION) {
                    (None, _) => Err(Status::Unsupported),
                    (Some(_), false) => Err(Status::Failed),
                    (Some(dev), true) => dev.accept_qp(client).map_err(|e| {
                        tracing::warn!(peer = %peer_name, error = %e, "verbs connect failed");
                        Status::Failed
                    }),
                };
                match answer {
                    Ok((qp, mine)) => {
                        // The queue pair lives as long as this connection.
                        qps.push(qp);
                        queue_header(&mut tls, Status::Ok, QP_ENDPOINT_BYTES as u32)?;
                        within(op_timeout, "send verbs endpoint", async {
                            tls.queue(&mine.encode())?;
                            tls.flush().await
                        })
                        .await?;
                    }
                    Err(status) => send_response(&mut tls, status, 0, op_timeout).await?,
                }
            }
        }
    }
}

/// Enters `region` for `kind` (the caller's range was checked against the
/// buffer by `Registry::lookup`, and is again by `Entered`'s copies and
/// views): the slot is held while the returned `Entered` lives, which the
/// caller drops before its next await. Refused with `Closed` when the owner does
/// not allow it now, `UnknownBuffer` once released, `Failed` when no slot
/// frees within `deadline`.
async fn region_access(
    region: &Region,
    kind: Kind,
    window: Option<Window>,
    deadline: Duration,
) -> Result<crate::memory::Entered<'_>, Status> {
    let started = Instant::now();
    loop {
        let refusal = match region.enter(kind, window) {
            Ok(entered) => return Ok(entered),
            Err(refusal) => refusal,
        };
        match refusal {
            Refusal::State(STATE_READ_ONLY | STATE_LOCAL) | Refusal::Window => {
                return Err(Status::Closed);
            }
            Refusal::State(_) => return Err(Status::UnknownBuffer),
            Refusal::Full if started.elapsed() < deadline => {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            Refusal::Full => return Err(Status::Failed),
        }
    }
}

fn queue_header(s: &mut Sealed, status: Status, len: u32) -> Result<(), Error> {
    let r = Response {
        status,
        len_bytes: len,
    };
    s.queue(&r.encode()).map_err(Error::io("send response"))
}

async fn send_response(
    s: &mut Sealed,
    status: Status,
    len: u32,
    deadline: Duration,
) -> Result<(), Error> {
    queue_header(s, status, len)?;
    within(deadline, "send response", s.flush()).await
}

/// One authenticated connection to an owner.
pub(crate) struct Conn {
    stream: Sealed,
    last_used: Instant,
}

/// The reader's side: connects to owners and runs pipelined requests.
pub(crate) struct TcpClient {
    me: ProcId,
    connector: TlsConnector,
    pool: Mutex<HashMap<(ProcId, SocketAddr), Vec<Conn>>>,
    connections: usize,
    chunk_bytes: usize,
    window: usize,
    connect_timeout: Duration,
    op_timeout: Duration,
    reuse_within: Duration,
}

/// Runs the streams of one operation, one per connection, and returns the
/// first failure by stream.
///
/// On a multi-thread runtime, each stream of several runs on a thread of
/// its own: this one (off the runtime's workers, through
/// `block_in_place`, so their other tasks move on) and scoped threads for
/// the others, all joined before this returns. Streams that one task
/// drove would take turns on one core, while a sealed stream's sender is
/// bound by its CPU (copying and sealing each piece). One stream, or any
/// on a current-thread runtime, runs here.
pub(crate) async fn parallel_streams<F>(streams: Vec<F>) -> Result<(), Error>
where
    F: Future<Output = Result<(), Error>> + Send,
{
    let threads = streams.len() > 1
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if !threads {
        return futures::future::try_join_all(streams).await.map(|_| ());
    }
    let rt = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let mut streams = streams.into_iter();
            let here = streams.next();
            let others: Vec<_> = streams
                .map(|stream| {
                    let rt = &rt;
                    std::thread::Builder::new()
                        .name("regent-rdma-tcp".into())
                        .spawn_scoped(scope, move || rt.block_on(stream))
                })
                .collect();
            // A stream whose thread could not start was never polled:
            // nothing of it reached the connection, which the failure
            // retires.
            let mut results = vec![here.map_or(Ok(()), |stream| rt.block_on(stream))];
            for thread in others {
                results.push(match thread {
                    Ok(thread) => thread
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    Err(e) => Err(Error::io("start a tcp stream's thread")(e)),
                });
            }
            results.into_iter().collect()
        })
    })
}

/// Owners whose connections are kept at once.
const MAX_POOLED_OWNERS: usize = 1024;

/// What one connection does in one operation: (offset, bytes) chunks in
/// order.
struct Job<B> {
    chunks: Vec<(u64, B)>,
}

impl TcpClient {
    pub(crate) fn new(config: &ManagerConfig, creds: &ProcCredentials) -> Result<Self, Error> {
        let (_, connector) = tls_configs(creds)?;
        Ok(Self {
            me: creds.proc().clone(),
            connector,
            pool: Mutex::new(HashMap::new()),
            connections: config.tcp_connections.get() as usize,
            chunk_bytes: config.tcp_chunk_bytes.get() as usize,
            window: config.tcp_window_chunks.get() as usize,
            connect_timeout: config.connect_timeout,
            op_timeout: config.op_timeout,
            reuse_within: config.tcp_idle_timeout / 2,
        })
    }

    fn link_err(remote: &RemoteBuffer, addr: SocketAddr) -> impl Fn(String) -> Error + '_ {
        move |reason| Error::Link {
            owner: remote.owner().clone(),
            addr,
            reason,
        }
    }

    /// Waits at most `op_timeout` for a send to the owner (a stopped or
    /// overwhelmed owner stops reading, and the socket fills up).
    async fn send(
        &self,
        link: &impl Fn(String) -> Error,
        what: &'static str,
        f: impl std::future::Future<Output = std::io::Result<()>>,
    ) -> Result<(), Error> {
        match timeout(self.op_timeout, f).await {
            Err(_) => Err(Error::Timeout {
                what,
                after: self.op_timeout,
            }),
            Ok(r) => r.map_err(|e| link(format!("{what}: {e}"))),
        }
    }

    fn addr(remote: &RemoteBuffer) -> Result<SocketAddr, Error> {
        remote
            .tcp()
            .map(|t| t.addr)
            .ok_or_else(|| Error::NoBackend {
                owner: remote.owner().clone(),
                buffer: remote.id(),
                reason: "the owner serves no tcp".into(),
            })
    }

    /// Opens an authenticated connection to `owner` at `addr`.
    pub(crate) async fn connect(&self, owner: &ProcId, addr: SocketAddr) -> Result<Conn, Error> {
        let link = |reason: String| Error::Link {
            owner: owner.clone(),
            addr,
            reason,
        };
        let deadline = self.connect_timeout;
        let tcp = timeout(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| link(format!("connect timed out after {deadline:?}")))?
            .map_err(|e| link(format!("connect: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let name = regent_net::tls::server_name(owner)?;
        let refused = |reason: String| Error::Refused {
            peer: owner.to_string(),
            reason,
        };
        let mut tls = timeout(deadline, self.connector.connect(name, socket(tcp)))
            .await
            .map_err(|_| link(format!("TLS handshake timed out after {deadline:?}")))?
            .map_err(|e| refused(format!("TLS handshake: {e}")))?;
        let me = self.me.as_str().as_bytes();
        let mut hello = Vec::with_capacity(5 + me.len());
        hello.extend_from_slice(&HELLO_MAGIC);
        hello.push(me.len() as u8);
        hello.extend_from_slice(me);
        let mut welcome = [0u8; 1];
        // With TLS 1.3 a server that refuses our certificate says so only
        // after the client finished its handshake: it shows here.
        timeout(deadline, async {
            tls.write_all(&hello).await?;
            tls.flush().await?;
            tls.read_exact(&mut welcome).await
        })
        .await
        .map_err(|_| link(format!("hello timed out after {deadline:?}")))?
        .map_err(|e| refused(format!("after the handshake: {e}")))?;
        match welcome[0] {
            WELCOME_OK => {}
            WELCOME_BUSY => {
                return Err(refused("the owner serves as many clients as it may".into()));
            }
            _ => return Err(refused("the owner refused our identity".into())),
        }
        let (io, conn) = tls.into_inner();
        let stream = seal(io, conn).map_err(|reason| Error::Protocol {
            peer: owner.to_string(),
            reason,
        })?;
        Ok(Conn {
            stream,
            last_used: Instant::now(),
        })
    }

    /// Takes `n` connections to the owner: pooled ones first, new ones
    /// for the rest.
    async fn checkout(
        &self,
        owner: &ProcId,
        addr: SocketAddr,
        n: usize,
    ) -> Result<Vec<Conn>, Error> {
        let mut conns = {
            let mut pool = self.lock_pool();
            let list = pool.entry((owner.clone(), addr)).or_default();
            // Retired at half their keys' limit, so an operation never
            // runs into it.
            list.retain(|c| {
                c.last_used.elapsed() < self.reuse_within
                    && c.stream.used() < sealed::KEY_LIMIT_BYTES / 2
            });
            let keep = list.len().saturating_sub(n);
            list.split_off(keep)
        };
        let missing = n - conns.len();
        let fresh =
            futures::future::try_join_all((0..missing).map(|_| self.connect(owner, addr))).await?;
        conns.extend(fresh);
        Ok(conns)
    }

    fn checkin(&self, owner: &ProcId, addr: SocketAddr, conns: Vec<Conn>) {
        let mut pool = self.lock_pool();
        if pool.len() >= MAX_POOLED_OWNERS
            && !pool.contains_key(&(owner.clone(), addr))
            && let Some(k) = pool.keys().next().cloned()
        {
            pool.remove(&k);
        }
        let list = pool.entry((owner.clone(), addr)).or_default();
        for mut c in conns {
            if list.len() < self.connections {
                c.last_used = Instant::now();
                list.push(c);
            }
        }
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, HashMap<(ProcId, SocketAddr), Vec<Conn>>> {
        // Single inserts and removals: a panic leaves the pool consistent.
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the pooled connections to an owner (after a failure).
    pub(crate) fn forget(&self, owner: &ProcId, addr: SocketAddr) {
        self.lock_pool().remove(&(owner.clone(), addr));
    }

    /// How many connections per operation this client uses for `len`
    /// bytes.
    fn fan_out(&self, len: usize) -> usize {
        len.div_ceil(self.chunk_bytes).clamp(1, self.connections)
    }

    /// Reads `dst.len()` bytes of `remote` from `offset`.
    pub(crate) async fn read(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), Error> {
        let addr = Self::addr(remote)?;
        let n = self.fan_out(dst.len());
        let mut jobs: Vec<Job<&mut [u8]>> = (0..n).map(|_| Job { chunks: Vec::new() }).collect();
        for (i, chunk) in dst.chunks_mut(self.chunk_bytes).enumerate() {
            let at = offset + (i * self.chunk_bytes) as u64;
            jobs[i % n].chunks.push((at, chunk));
        }
        let mut conns = self.checkout(remote.owner(), addr, n).await?;
        let streams = conns
            .iter_mut()
            .zip(jobs)
            .map(|(c, job)| self.read_job(c, remote, addr, job))
            .collect();
        let result = parallel_streams(streams).await;
        self.finish(remote, addr, conns, result)
    }

    /// Writes `src` to `remote` at `offset`.
    pub(crate) async fn write(
        &self,
        remote: &RemoteBuffer,
        offset: u64,
        src: &[u8],
    ) -> Result<(), Error> {
        let addr = Self::addr(remote)?;
        let n = self.fan_out(src.len());
        let mut jobs: Vec<Job<&[u8]>> = (0..n).map(|_| Job { chunks: Vec::new() }).collect();
        for (i, chunk) in src.chunks(self.chunk_bytes).enumerate() {
            let at = offset + (i * self.chunk_bytes) as u64;
            jobs[i % n].chunks.push((at, chunk));
        }
        let mut conns = self.checkout(remote.owner(), addr, n).await?;
        let streams = conns
            .iter_mut()
            .zip(jobs)
            .map(|(c, job)| self.write_job(c, remote, addr, job))
            .collect();
        let result = parallel_streams(streams).await;
        self.finish(remote, addr, conns, result)
    }

    fn finish(
        &self,
        remote: &RemoteBuffer,
        addr: SocketAddr,
        conns: Vec<Conn>,
        result: Result<(), Error>,
    ) -> Result<(), Error> {
        match &result {
            // A refused request leaves the stream in step: the connections
            // stay usable.
            Ok(())
            | Err(Error::Released { .. } | Error::OutOfRange { .. } | Error::Closed { .. }) => {
                self.checkin(remote.owner(), addr, conns)
            }
            Err(_) => self.forget(remote.owner(), addr),
        }
        result
    }

    fn request(remote: &RemoteBuffer, op: Op, offset: u64, len: usize) -> [u8; REQUEST_BYTES] {
        Request {
            op,
            len_bytes: len as u32,
            buffer: remote.id(),
            offset,
            token: remote.token(),
            window: remote.window(),
        }
        .encode()
    }

    async fn read_job(
        &self,
        conn: &mut Conn,
        remote: &RemoteBuffer,
        addr: SocketAddr,
        job: Job<&mut [u8]>,
    ) -> Result<(), Error> {
        let link = Self::link_err(remote, addr);
        let heads: Vec<(u64, usize)> = job.chunks.iter().map(|(o, b)| (*o, b.len())).collect();
        let s = &mut conn.stream;
        let mut sent = 0;
        let mut first = None;
        for (i, (_, buf)) in job.chunks.into_iter().enumerate() {
            // Keep `window` requests in flight.
            if sent < heads.len() && sent < i + self.window {
                while sent < heads.len() && sent < i + self.window {
                    let (at, len) = heads[sent];
                    let req = Self::request(remote, Op::Read, at, len);
                    s.queue(&req)
                        .map_err(|e| link(format!("send request: {e}")))?;
                    sent += 1;
                }
                self.send(&link, "send request", s.flush()).await?;
            }
            let resp = self.response(s, remote, addr, heads[i]).await?;
            match resp.status {
                Status::Ok if resp.len_bytes as usize == buf.len() => {}
                Status::Ok => {
                    return Err(Error::Protocol {
                        peer: remote.owner().to_string(),
                        reason: "read answered with another length".into(),
                    });
                }
                status => {
                    // Keep draining the pipeline so the stream stays in
                    // step, then report the first failure.
                    first.get_or_insert(status_error(remote, status, heads[i], false));
                    continue;
                }
            }
            // Each frame lands in `buf` and is opened there.
            let mut got = 0;
            while got < buf.len() {
                got += timeout(self.op_timeout, s.recv_into(&mut buf[got..]))
                    .await
                    .map_err(|_| Error::Timeout {
                        what: "rdma tcp read chunk",
                        after: self.op_timeout,
                    })?
                    .map_err(|e| link(format!("receive data: {e}")))?;
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn write_job(
        &self,
        conn: &mut Conn,
        remote: &RemoteBuffer,
        addr: SocketAddr,
        job: Job<&[u8]>,
    ) -> Result<(), Error> {
        let link = Self::link_err(remote, addr);
        let heads: Vec<(u64, usize)> = job.chunks.iter().map(|(o, b)| (*o, b.len())).collect();
        let s = &mut conn.stream;
        let mut sent = 0;
        let mut first = None;
        let mut room = Room::new(PIECE_BYTES.min(self.chunk_bytes));
        for i in 0..heads.len() {
            while sent < heads.len() && sent < i + self.window {
                let (at, len) = heads[sent];
                let req = Self::request(remote, Op::Write, at, len);
                s.queue(&req)
                    .map_err(|e| link(format!("send request: {e}")))?;
                // Sealed piece by piece (the first with the request).
                for piece in job.chunks[sent].1.chunks(PIECE_BYTES) {
                    // Sealed from the source into the frame, placed like
                    // the source (see `sealed::Room`).
                    let f = room.frame(piece.len(), piece.as_ptr());
                    s.seal_into(piece, f)
                        .map_err(|e| link(format!("seal data: {e}")))?;
                    self.send(&link, "send data", s.write_frame(f)).await?;
                }
                sent += 1;
            }
            let resp = self.response(s, remote, addr, heads[i]).await?;
            if resp.status != Status::Ok {
                first.get_or_insert(status_error(remote, resp.status, heads[i], true));
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn response(
        &self,
        s: &mut Sealed,
        remote: &RemoteBuffer,
        addr: SocketAddr,
        _chunk: (u64, usize),
    ) -> Result<Response, Error> {
        let b = timeout(self.op_timeout, s.recv_msg::<RESPONSE_BYTES>())
            .await
            .map_err(|_| Error::Timeout {
                what: "rdma tcp response",
                after: self.op_timeout,
            })?
            .map_err(|e| Error::Link {
                owner: remote.owner().clone(),
                addr,
                reason: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "the owner closed the connection".into()
                } else {
                    format!("receive response: {e}")
                },
            })?;
        Response::decode(&b).map_err(|reason| Error::Protocol {
            peer: remote.owner().to_string(),
            reason,
        })
    }

    /// Sets up a verbs queue pair with the owner over a dedicated
    /// connection, which then keeps the owner's end alive.
    pub(crate) async fn verbs_connect(
        &self,
        remote: &RemoteBuffer,
        mine: QpEndpoint,
    ) -> Result<(Conn, QpEndpoint), Error> {
        let addr = Self::addr(remote)?;
        let mut conn = self.connect(remote.owner(), addr).await?;
        let link = Self::link_err(remote, addr);
        let s = &mut conn.stream;
        let req = Request {
            op: Op::VerbsConnect,
            len_bytes: QP_ENDPOINT_BYTES as u32,
            buffer: remote.id(),
            offset: 0,
            token: Token(remote.token().0),
            window: None,
        };
        self.send(&link, "send verbs endpoint", async {
            s.queue(&req.encode())?;
            s.queue(&mine.encode())?;
            s.flush().await
        })
        .await?;
        let resp = self.response(s, remote, addr, (0, 0)).await?;
        if resp.status != Status::Ok || resp.len_bytes as usize != QP_ENDPOINT_BYTES {
            return Err(Error::Unavailable {
                backend: crate::BackendKind::Ibverbs,
                reason: format!(
                    "the owner could not set up a queue pair ({:?})",
                    resp.status
                ),
            });
        }
        let ep = timeout(self.op_timeout, s.recv_msg::<QP_ENDPOINT_BYTES>())
            .await
            .map_err(|_| Error::Timeout {
                what: "verbs endpoint",
                after: self.op_timeout,
            })?
            .map_err(|e| link(e.to_string()))?;
        Ok((conn, QpEndpoint::decode(&ep)))
    }
}

fn status_error(
    remote: &RemoteBuffer,
    status: Status,
    (offset, len): (u64, usize),
    write: bool,
) -> Error {
    match status {
        Status::Closed => Error::Closed {
            owner: remote.owner().clone(),
            buffer: remote.id(),
            write,
        },
        Status::UnknownBuffer => Error::Released {
            owner: remote.owner().clone(),
            buffer: remote.id(),
        },
        Status::OutOfRange => Error::OutOfRange {
            buffer: remote.id(),
            offset,
            len_bytes: len as u64,
            buffer_bytes: remote.len_bytes(),
        },
        other => Error::Protocol {
            peer: remote.owner().to_string(),
            reason: format!("request refused: {other:?}"),
        },
    }
}
