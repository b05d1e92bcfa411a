//! The tcp backend: the owner serves its registered buffers over mutual TLS
//! (the cluster CA and proc certificates of `regent-net`), chunked and
//! pipelined, on one or more connections.
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

pub(crate) mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use regent_net::{ProcCredentials, ProcId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::{MAX_TCP_CHUNK_BYTES, ManagerConfig};
use crate::error::Error;
use crate::handle::{BufferId, RemoteBuffer, Token};
use crate::memory::Region;
use crate::verbs::{self, QP_ENDPOINT_BYTES, QpEndpoint};
use wire::{
    ALPN, HELLO_MAGIC, Op, REQUEST_BYTES, RESPONSE_BYTES, Request, Response, Status, WELCOME_OK,
    WELCOME_REFUSED, token_eq,
};

/// Bytes the server copies out of (or into) a buffer per step: small enough
/// to stay in cache between the copy and TLS.
const SERVER_PIECE_BYTES: usize = 256 << 10;
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
    Ok((
        TlsAcceptor::from(Arc::new(server)),
        TlsConnector::from(Arc::new(client_config(creds)?)),
    ))
}

/// The control plane's client config, with one change: AES-128-GCM is
/// offered first (the server follows the client's order), which costs
/// fewer rounds per byte than AES-256-GCM on bulk data. Same trust (the
/// cluster CA only), same certificate, TLS 1.3 only.
fn client_config(creds: &ProcCredentials) -> Result<rustls::ClientConfig, Error> {
    use rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    use rustls_pki_types::pem::PemObject as _;
    let tls_err = |context: &'static str| {
        move |e: rustls::Error| {
            Error::Net(regent_net::Error::Tls {
                context,
                reason: e.to_string(),
            })
        }
    };
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != TLS13_AES_128_GCM_SHA256);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(creds.ca().clone())
        .map_err(tls_err("trust the cluster CA"))?;
    let (_, key_pem, _) = creds.to_pem();
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| {
        Error::Net(regent_net::Error::Certificate {
            context: "proc key",
            reason: e.to_string(),
        })
    })?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err("client protocol versions"))?
        .with_root_certificates(roots)
        .with_client_auth_cert(creds.chain().to_vec(), key)
        .map_err(tls_err("client certificate"))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
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
            handshake_timeout: config.connect_timeout,
            idle_timeout: config.tcp_idle_timeout,
        };
        let max_clients = config.tcp_max_clients.get() as usize;
        let task = tokio::spawn(accept_loop(listener, ctx, max_clients));
        tracing::debug!(%addr, "rdma tcp server listening");
        Ok(Self { addr, task })
    }

    /// The address put in handles.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn accept_loop(listener: TcpListener, ctx: ServeCtx, max_clients: usize) {
    // Connection tasks live in this set: aborting the loop drops them.
    let mut conns = JoinSet::new();
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
                if conns.len() >= max_clients {
                    tracing::warn!(%peer, max_clients, "rdma tcp server full, connection dropped");
                    continue;
                }
                let ctx = ctx.clone();
                conns.spawn(async move {
                    if let Err(e) = serve_connection(tcp, peer, ctx).await {
                        tracing::debug!(%peer, error = %e, "rdma tcp connection ended");
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve_connection(tcp: TcpStream, peer: SocketAddr, ctx: ServeCtx) -> Result<(), Error> {
    let _ = tcp.set_nodelay(true);
    let refused = |reason: String| Error::Refused {
        peer: peer.to_string(),
        reason,
    };
    let mut tls = timeout(ctx.handshake_timeout, ctx.acceptor.accept(socket(tcp)))
        .await
        .map_err(|_| Error::Timeout {
            what: "rdma tcp handshake",
            after: ctx.handshake_timeout,
        })?
        .map_err(|e| refused(format!("TLS handshake: {e}")))?;
    // Hello: the proc the client claims to be, checked against its
    // (chain-verified) certificate.
    let mut head = [0u8; 5];
    timeout(ctx.handshake_timeout, tls.read_exact(&mut head))
        .await
        .map_err(|_| Error::Timeout {
            what: "rdma tcp hello",
            after: ctx.handshake_timeout,
        })?
        .map_err(|e| refused(format!("no hello: {e}")))?;
    let id_len = head[4] as usize;
    if head[..4] != HELLO_MAGIC || id_len == 0 || id_len > regent_net::id::MAX_PROC_ID_BYTES {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            reason: "bad hello".into(),
        });
    }
    let mut id = vec![0u8; id_len];
    timeout(ctx.handshake_timeout, tls.read_exact(&mut id))
        .await
        .map_err(|_| Error::Timeout {
            what: "rdma tcp hello",
            after: ctx.handshake_timeout,
        })?
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
    tls.write_all(&[WELCOME_OK])
        .await
        .map_err(Error::io("write welcome"))?;
    tls.flush().await.map_err(Error::io("write welcome"))?;
    tracing::debug!(%peer, client = %claimed, "rdma tcp client accepted");
    let peer_name = claimed.to_string();

    let mut piece = vec![0u8; SERVER_PIECE_BYTES];
    let mut qps = Vec::new();
    loop {
        let mut hdr = [0u8; REQUEST_BYTES];
        match timeout(ctx.idle_timeout, tls.read_exact(&mut hdr)).await {
            Err(_) => return Ok(()), // idle: close
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(Error::io("read request")(e)),
            Ok(Ok(_)) => {}
        }
        let req = Request::decode(&hdr).map_err(|reason| Error::Protocol {
            peer: peer_name.clone(),
            reason,
        })?;
        if req.len_bytes > MAX_TCP_CHUNK_BYTES {
            send_response(&mut tls, Status::TooLarge, 0).await?;
            return Err(Error::Protocol {
                peer: peer_name,
                reason: format!("request of {} bytes", req.len_bytes),
            });
        }
        match req.op {
            Op::Read => match ctx.registry.lookup(&req) {
                Ok(region) => {
                    send_header(&mut tls, Status::Ok, req.len_bytes).await?;
                    let mut done = 0usize;
                    let len = req.len_bytes as usize;
                    while done < len {
                        let n = (len - done).min(piece.len());
                        region.copy_out(req.offset as usize + done, &mut piece[..n]);
                        tls.write_all(&piece[..n])
                            .await
                            .map_err(Error::io("send read data"))?;
                        done += n;
                    }
                    tls.flush().await.map_err(Error::io("send read data"))?;
                }
                Err(status) => send_response(&mut tls, status, 0).await?,
            },
            Op::Write => {
                let target = ctx.registry.lookup(&req);
                let len = req.len_bytes as usize;
                let mut done = 0usize;
                while done < len {
                    let n = (len - done).min(piece.len());
                    timeout(ctx.idle_timeout, tls.read_exact(&mut piece[..n]))
                        .await
                        .map_err(|_| Error::Timeout {
                            what: "write payload",
                            after: ctx.idle_timeout,
                        })?
                        .map_err(Error::io("read write data"))?;
                    // Refused writes are read and dropped, keeping the
                    // stream in step.
                    if let Ok(region) = &target {
                        region.copy_in(req.offset as usize + done, &piece[..n]);
                    }
                    done += n;
                }
                let status = match target {
                    Ok(_) => {
                        // The bytes are in the buffer before the client
                        // hears so.
                        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
                        Status::Ok
                    }
                    Err(s) => s,
                };
                send_response(&mut tls, status, 0).await?;
            }
            Op::VerbsConnect => {
                if req.len_bytes as usize != QP_ENDPOINT_BYTES {
                    return Err(Error::Protocol {
                        peer: peer_name,
                        reason: "verbs endpoint of the wrong size".into(),
                    });
                }
                let mut ep = [0u8; QP_ENDPOINT_BYTES];
                tls.read_exact(&mut ep)
                    .await
                    .map_err(Error::io("read verbs endpoint"))?;
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
                        send_header(&mut tls, Status::Ok, QP_ENDPOINT_BYTES as u32).await?;
                        tls.write_all(&mine.encode())
                            .await
                            .map_err(Error::io("send verbs endpoint"))?;
                        tls.flush()
                            .await
                            .map_err(Error::io("send verbs endpoint"))?;
                    }
                    Err(status) => send_response(&mut tls, status, 0).await?,
                }
            }
        }
    }
}

async fn send_header<S: AsyncWrite + Unpin>(
    s: &mut S,
    status: Status,
    len: u32,
) -> Result<(), Error> {
    let r = Response {
        status,
        len_bytes: len,
    };
    s.write_all(&r.encode())
        .await
        .map_err(Error::io("send response"))
}

async fn send_response<S: AsyncWrite + Unpin>(
    s: &mut S,
    status: Status,
    len: u32,
) -> Result<(), Error> {
    send_header(s, status, len).await?;
    s.flush().await.map_err(Error::io("send response"))
}

/// One authenticated connection to an owner.
pub(crate) struct Conn {
    stream: tokio_rustls::client::TlsStream<Socket>,
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
        if welcome[0] != WELCOME_OK {
            return Err(refused("the owner refused our identity".into()));
        }
        Ok(Conn {
            stream: tls,
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
            list.retain(|c| c.last_used.elapsed() < self.reuse_within);
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
        let result = futures::future::try_join_all(
            conns
                .iter_mut()
                .zip(jobs)
                .map(|(c, job)| self.read_job(c, remote, addr, job)),
        )
        .await;
        self.finish(remote, addr, conns, result.map(|_| ()))
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
        let result = futures::future::try_join_all(
            conns
                .iter_mut()
                .zip(jobs)
                .map(|(c, job)| self.write_job(c, remote, addr, job)),
        )
        .await;
        self.finish(remote, addr, conns, result.map(|_| ()))
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
            Ok(()) | Err(Error::Released { .. } | Error::OutOfRange { .. }) => {
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
                    s.write_all(&Self::request(remote, Op::Read, at, len))
                        .await
                        .map_err(|e| link(format!("send request: {e}")))?;
                    sent += 1;
                }
                s.flush()
                    .await
                    .map_err(|e| link(format!("send request: {e}")))?;
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
                    first.get_or_insert(status_error(remote, status, heads[i]));
                    continue;
                }
            }
            timeout(self.op_timeout, s.read_exact(buf))
                .await
                .map_err(|_| Error::Timeout {
                    what: "rdma tcp read chunk",
                    after: self.op_timeout,
                })?
                .map_err(|e| link(format!("receive data: {e}")))?;
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
        for i in 0..heads.len() {
            if sent < heads.len() && sent < i + self.window {
                while sent < heads.len() && sent < i + self.window {
                    let (at, len) = heads[sent];
                    s.write_all(&Self::request(remote, Op::Write, at, len))
                        .await
                        .map_err(|e| link(format!("send request: {e}")))?;
                    timeout(self.op_timeout, s.write_all(job.chunks[sent].1))
                        .await
                        .map_err(|_| Error::Timeout {
                            what: "rdma tcp write chunk",
                            after: self.op_timeout,
                        })?
                        .map_err(|e| link(format!("send data: {e}")))?;
                    sent += 1;
                }
                s.flush()
                    .await
                    .map_err(|e| link(format!("send data: {e}")))?;
            }
            let resp = self.response(s, remote, addr, heads[i]).await?;
            if resp.status != Status::Ok {
                first.get_or_insert(status_error(remote, resp.status, heads[i]));
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn response<S: AsyncRead + Unpin>(
        &self,
        s: &mut S,
        remote: &RemoteBuffer,
        addr: SocketAddr,
        _chunk: (u64, usize),
    ) -> Result<Response, Error> {
        let mut b = [0u8; RESPONSE_BYTES];
        timeout(self.op_timeout, s.read_exact(&mut b))
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
        };
        s.write_all(&req.encode())
            .await
            .map_err(|e| link(e.to_string()))?;
        s.write_all(&mine.encode())
            .await
            .map_err(|e| link(e.to_string()))?;
        s.flush().await.map_err(|e| link(e.to_string()))?;
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
        let mut ep = [0u8; QP_ENDPOINT_BYTES];
        timeout(self.op_timeout, s.read_exact(&mut ep))
            .await
            .map_err(|_| Error::Timeout {
                what: "verbs endpoint",
                after: self.op_timeout,
            })?
            .map_err(|e| link(e.to_string()))?;
        Ok((conn, QpEndpoint::decode(&ep)))
    }
}

fn status_error(remote: &RemoteBuffer, status: Status, (offset, len): (u64, usize)) -> Error {
    match status {
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
