//! `regent bench mesh`: meshes of real proc processes (this binary, started
//! by the local allocator).
//!
//! - `call_gather_<P>x<M>`: a call to every member of a mesh of P procs × M
//!   members (N in all), replies
//!   gathered through the tree, against N concurrent calls to one member
//!   each (`call_one`, joined: what gathering by hand costs); and
//!   `call_gather_<P>x<M>_vs_call_one`, the same against one call to one member
//!   (a raw round trip). The three are timed in turn in every round, on the
//!   same members.
//!   With one member per proc also `call_gather_<P>x1_on_proc_thread` and
//!   its `_vs_call_one`: the same for members of `MemberThread::Proc`, on
//!   their proc's control thread instead of threads of their own.
//!   `call_gather_<P>x<M>_cpu` (and `_on_proc_thread`): what one gather
//!   costs in CPU, the controller's process and every proc together (the
//!   scheduler's counts of their threads), over a block of gathers back to
//!   back, against the CPU time the machine's cores had per gather of that
//!   block (`cores_x_gather`): a ratio near 1 says the gather is bound by
//!   the machine's CPU, not by waiting.
//!   `call_gather_<P>x<M>_vs_tcp` (and `_on_proc_thread`): the gather
//!   against the same machine's floor for it, a 64-byte TCP echo from the
//!   controller to every member at once (`tcp_fanout_<N>`: a tokio echo
//!   server on each member's runtime, so on the thread the member's
//!   messages reach it on; the controller writes to all N connections,
//!   then reads the N answers), timed in turn in the same rounds; and
//!   `call_gather_<P>x<M>_cpu_vs_tcp`, the CPU of one gather against the
//!   CPU of one such fan-out (`tcp_fanout_cpu`), both over blocks back to
//!   back: what the control plane, the cast tree and the members' dispatch
//!   add to waking N processes and hearing back; and
//!   `call_gather_<P>x<M>_runs_vs_tcp`, how often any thread of those
//!   processes was put on a CPU per gather, against the same per fan-out
//!   (`tcp_fanout_runs`): the wake-ups, each gather's and each fan-out's
//!   (a control thread's spin turns after a `sched_yield` count too, as in
//!   `call_rtt_runs`).
//!   With one member per proc also `call_gather_<P>x1_vs_quinn` (and
//!   `_on_proc_thread`): the gather against the floor of its own transport,
//!   a 64-byte echo from the controller to every proc at once over bare
//!   quinn (`quinn_fanout_<N>`: a quinn endpoint with the control plane's
//!   mutual TLS in a member of each proc, on the same kind of thread as the
//!   gathered members, one connection and bidirectional stream to each,
//!   timed in turn in the same rounds), `call_gather_<P>x1_cpu_vs_quinn`
//!   (CPU, against `quinn_fanout_cpu`), and `quinn_fanout_<N>_vs_tcp`, that
//!   floor against the TCP one: what QUIC and TLS cost before the control
//!   plane adds anything.
//! - `cold_spawn_4_procs`: four procs started and a mesh spawned on them and
//!   answering, against starting four bare processes of this binary.
//! - `controller_frames_<P>_procs`: messages the controller sends per cast,
//!   as the number of procs grows, averaged over its casts, on a runtime of
//!   cast fan-out 4 (no baseline: the claim is that it stays at most the
//!   fan-out).
//! - `peer_call_rtt`: a member's call to a peer in another proc through
//!   its own mesh reference (`Member::peers`), timed in the member, against
//!   the controller's call to the same peer (`controller_call_rtt`); rounds
//!   interleave the two.
//! - `peer_read_64mib_shm`: a member reading a peer's 64 MiB buffer (in
//!   another proc of the host) one-sidedly through shm, into a registered
//!   buffer, against a single-thread memcpy of 64 MiB between two populated
//!   buffers in the reader's proc (`memcpy_64mib`), interleaved.
//! - `control_rtt_core_blocked`: the controller's call to a member whose
//!   neighbour in the same proc spins on its core in a handler, against the
//!   same call while nobody spins (`control_rtt_idle`), interleaved.
//! - `sim_*`: the in-memory simulation (no sockets) of casts to 10,000 and
//!   100,000 members: the tree depth measured from the hops the frames took
//!   beside the formula's, the frames the controller and all nodes sent for
//!   one cast (deterministic: one cast is the sample), the gather time;
//!   and what the controller sends (frames, and bytes of the encoded
//!   commands) to spawn the mesh, to restart one proc's members (a
//!   `Respawn` there and an `Update` to every other proc, each with the
//!   change since the proc's generation, taken by the real proc runtimes),
//!   against the same restart with the whole mesh in every command (as
//!   before changes), and for one round of lease renewals.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use regent_mesh::alloc::{Allocator, LocalAllocator};
use regent_mesh::{
    ActorError, ActorMesh, Member, MemberThread, MeshActor, ProcMesh, Rank, Runtime, RuntimeConfig,
    Selection, Shape,
};

use regent_rdma::{BackendKind, BackendPolicy, RemoteBuffer};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::calls::{Cost, ECHO_BYTES, family_cost};

use super::{BenchOptions, Figure, Report, median, micros};

const SUITE: &str = "mesh";
/// The suffix of the figures of members on their proc's thread.
const ON_PROC: &str = "_on_proc_thread";
/// How long the floors' connections (TCP connects, quinn handshakes) may
/// take: a proc that never answers fails the suite instead of hanging it.
const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

/// The benchmarks' mesh actor: answers `x` with `x` plus its rank, and
/// [`Echo::TCP_ECHO`] with the port of a TCP echo server it started.
pub(crate) struct Echo {
    rank: u32,
}

impl MeshActor for Echo {
    const NAME: &'static str = "regent-bench/echo";
    type Args = ();
    type Msg = u64;
    type Reply = u64;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            rank: member.rank().0,
        })
    }

    async fn handle(&mut self, _: &Member, x: u64) -> Result<u64, ActorError> {
        if x == Self::TCP_ECHO {
            return Ok(u64::from(start_tcp_echo().await?));
        }
        Ok(x.wrapping_add(u64::from(self.rank)))
    }
}

impl Echo {
    /// The message that starts a TCP echo server on the member's runtime
    /// (see [`start_tcp_echo`]) and answers its port: the message stays a
    /// `u64`, so that the gathers' figures measure what they always did.
    pub(crate) const TCP_ECHO: u64 = u64::MAX;
}

regent_mesh::register_actor!(Echo);

/// Starts a TCP echo server of [`ECHO_BYTES`]-byte requests on the current
/// runtime (a member's: it ends with the member's life), `TCP_NODELAY` on
/// each connection; returns its port on 127.0.0.1.
async fn start_tcp_echo() -> std::io::Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let mut buf = [0u8; ECHO_BYTES];
                while stream.read_exact(&mut buf).await.is_ok() {
                    if stream.write_all(&buf).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// [`Echo`] on its proc's thread ([`MemberThread::Proc`]).
pub(crate) struct EchoOnProc(Echo);

impl MeshActor for EchoOnProc {
    const NAME: &'static str = "regent-bench/echo-on-proc";
    type Args = ();
    type Msg = u64;
    type Reply = u64;
    const THREAD: MemberThread = MemberThread::Proc;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Echo::new(member, ()).await.map(Self)
    }

    async fn handle(&mut self, member: &Member, x: u64) -> Result<u64, ActorError> {
        self.0.handle(member, x).await
    }
}

regent_mesh::register_actor!(EchoOnProc);

/// The credentials of the gathers' bare quinn echo servers, in PEM: one
/// identity for every server, issued by a CA the run makes for them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EchoCredentials {
    proc: String,
    chain: String,
    key: String,
    ca: String,
}

/// A bare quinn echo server on its member's runtime, started with the
/// member: the control plane's mutual TLS and quinn's default transport,
/// without the control plane (see [`super::net::serve_quinn_echo`]).
/// Answers anything with its port.
pub(crate) struct QuinnEcho {
    endpoint: quinn::Endpoint,
    port: u16,
}

impl MeshActor for QuinnEcho {
    const NAME: &'static str = "regent-bench/quinn-echo";
    type Args = EchoCredentials;
    type Msg = ();
    type Reply = u16;

    async fn new(_: &Member, creds: EchoCredentials) -> Result<Self, ActorError> {
        let creds = regent_net::ProcCredentials::from_pem(
            creds.proc.parse()?,
            &creds.chain,
            &creds.key,
            &creds.ca,
        )?;
        let endpoint =
            quinn::Endpoint::server(creds.quic_server_config()?, "127.0.0.1:0".parse()?)?;
        let port = endpoint.local_addr()?.port();
        tokio::spawn(super::net::serve_quinn_echo(endpoint.clone()));
        Ok(Self { endpoint, port })
    }

    async fn handle(&mut self, _: &Member, (): ()) -> Result<u16, ActorError> {
        Ok(self.port)
    }
}

impl Drop for QuinnEcho {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"done");
    }
}

regent_mesh::register_actor!(QuinnEcho);

/// [`QuinnEcho`] on its proc's thread ([`MemberThread::Proc`]), beside
/// [`EchoOnProc`].
pub(crate) struct QuinnEchoOnProc(QuinnEcho);

impl MeshActor for QuinnEchoOnProc {
    const NAME: &'static str = "regent-bench/quinn-echo-on-proc";
    type Args = EchoCredentials;
    type Msg = ();
    type Reply = u16;
    const THREAD: MemberThread = MemberThread::Proc;

    async fn new(member: &Member, creds: EchoCredentials) -> Result<Self, ActorError> {
        QuinnEcho::new(member, creds).await.map(Self)
    }

    async fn handle(&mut self, member: &Member, (): ()) -> Result<u16, ActorError> {
        self.0.handle(member, ()).await
    }
}

regent_mesh::register_actor!(QuinnEchoOnProc);

/// The bare quinn floor of a gather over one member per proc: a
/// [`QuinnEcho`] (or [`QuinnEchoOnProc`]) member in every proc, and this
/// side's connection and bidirectional stream to each.
struct QuinnFloor<Q: MeshActor> {
    servers: ActorMesh<Q>,
    endpoint: quinn::Endpoint,
    streams: Vec<(quinn::SendStream, quinn::RecvStream)>,
}

impl<Q: MeshActor<Args = EchoCredentials, Msg = (), Reply = u16>> QuinnFloor<Q> {
    /// Starts a server in every proc of `pm` and connects to each, as a
    /// client of the same CA.
    async fn start(pm: &ProcMesh) -> anyhow::Result<Self> {
        let ca = regent_net::ClusterCa::generate("regent bench quinn echo")?;
        let server = regent_net::ProcId::new("bench-quinn-echo")?;
        let (chain, key, ca_pem) = ca
            .issue(&server, regent_net::Role::Proc, regent_net::Validity::job())?
            .to_pem();
        let creds = EchoCredentials {
            proc: server.to_string(),
            chain,
            key,
            ca: ca_pem,
        };
        let client = ca.issue(
            &regent_net::ProcId::new("bench-quinn-client")?,
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )?;
        let servers: ActorMesh<Q> = pm.spawn("quinn-echo", 1, &creds).await?;
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(client.quic_client_config()?);
        let mut streams = Vec::new();
        for (_, port) in servers.call(&Selection::All, &()).await?.into_result()? {
            let connecting = endpoint.connect(
                (std::net::Ipv4Addr::LOCALHOST, port).into(),
                server.as_str(),
            )?;
            let conn = tokio::time::timeout(CONNECT_DEADLINE, connecting)
                .await
                .context("a quinn echo's handshake timed out")??;
            streams.push(conn.open_bi().await?);
        }
        Ok(Self {
            servers,
            endpoint,
            streams,
        })
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.endpoint.close(0u32.into(), b"done");
        self.servers.stop().await?;
        Ok(())
    }
}

/// The member benchmarks' actor (see the module docs).
pub(crate) struct Bench {
    shared: Vec<regent_rdma::LocalBuffer>,
    /// `Echo`s received.
    echoes: u64,
}

/// What a [`Bench`] member is told.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum BenchOp {
    /// Reply at once.
    Echo(u64),
    /// Call peer `to` `rounds` times (one at a time); reply with each round
    /// trip in nanoseconds.
    CallPeer { to: u32, rounds: u32 },
    /// Register `len` bytes; reply with the handle.
    Share(usize),
    /// Read `handle` `rounds` times through shm, and memcpy as many times;
    /// reply with both durations in nanoseconds.
    ReadPeer { handle: RemoteBuffer, rounds: u32 },
    /// Spin on this member's core (never yielding) for `ms`.
    Spin(u64),
    /// Start a TCP echo server (64-byte requests) on this member's
    /// runtime; reply with its port.
    TcpEcho,
    /// Reply with how many `Echo`s this life received.
    Count,
    /// Reply with the id of this member's proc process.
    Pid,
}

/// A [`Bench`] member's reply.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum BenchReply {
    Ok,
    Nanos(Vec<u64>),
    Handle(RemoteBuffer),
    Reads { read: Vec<u64>, memcpy: Vec<u64> },
    Port(u16),
    Count(u64),
    Pid(u32),
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl MeshActor for Bench {
    const NAME: &'static str = "regent-bench/member";
    type Args = ();
    type Msg = BenchOp;
    type Reply = BenchReply;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            shared: Vec::new(),
            echoes: 0,
        })
    }

    async fn handle(&mut self, member: &Member, op: BenchOp) -> Result<BenchReply, ActorError> {
        Ok(match op {
            BenchOp::Echo(_) => {
                self.echoes += 1;
                BenchReply::Ok
            }
            BenchOp::Count => BenchReply::Count(self.echoes),
            BenchOp::Pid => BenchReply::Pid(std::process::id()),
            BenchOp::TcpEcho => BenchReply::Port(start_tcp_echo().await?),
            BenchOp::CallPeer { to, rounds } => {
                let peers = member.peers::<Bench>()?;
                let mut out = Vec::with_capacity(rounds as usize);
                for i in 0..rounds {
                    let t = Instant::now();
                    peers
                        .call_one(Rank(to), &BenchOp::Echo(u64::from(i)))
                        .await?;
                    out.push(nanos(t.elapsed()));
                }
                BenchReply::Nanos(out)
            }
            BenchOp::Share(len) => {
                let mut memory = regent_rdma::Memory::allocate(len)?;
                memory
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, b)| *b = i as u8);
                // Peers only read it.
                let buffer = member
                    .buffers()?
                    .register_with(memory, regent_rdma::Access::ReadOnly)?;
                let handle = buffer.handle().clone();
                self.shared.push(buffer);
                BenchReply::Handle(handle)
            }
            BenchOp::ReadPeer { handle, rounds } => {
                let buffers = member.buffers()?;
                buffers.set_backend_policy(BackendPolicy::Only(BackendKind::Shm));
                let len = handle.len_bytes() as usize;
                // A registered buffer of this proc's own (no peer touches it).
                let mut local = buffers.register_with(
                    regent_rdma::Memory::allocate(len)?,
                    regent_rdma::Access::Local,
                )?;
                let local = local.as_mut_slice()?;
                let mut src = regent_rdma::Memory::allocate(len)?;
                src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
                local.fill(1);
                // Warm up: map the peer's segment.
                buffers.read_into(&handle, 0, local).await?;
                let (mut read, mut memcpy) = (Vec::new(), Vec::new());
                for _ in 0..rounds {
                    let t = Instant::now();
                    local.copy_from_slice(&src);
                    memcpy.push(nanos(t.elapsed()));
                    std::hint::black_box(&local[..]);
                    let t = Instant::now();
                    buffers.read_into(&handle, 0, local).await?;
                    read.push(nanos(t.elapsed()));
                }
                buffers.set_backend_policy(BackendPolicy::Auto);
                if local[len - 1] != (len - 1) as u8 {
                    return Err("the read brought other bytes than the peer shared".into());
                }
                BenchReply::Reads { read, memcpy }
            }
            BenchOp::Spin(ms) => {
                let t = Instant::now();
                let mut x = 0u64;
                while t.elapsed() < Duration::from_millis(ms) {
                    x = std::hint::black_box(
                        x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1),
                    );
                }
                BenchReply::Ok
            }
        })
    }
}

regent_mesh::register_actor!(Bench);

/// [`Bench`] on its proc's thread ([`MemberThread::Proc`]), for the call
/// figures only: nothing there blocks.
pub(crate) struct BenchOnProc(Bench);

impl MeshActor for BenchOnProc {
    const NAME: &'static str = "regent-bench/member-on-proc";
    type Args = ();
    type Msg = BenchOp;
    type Reply = BenchReply;
    const THREAD: MemberThread = MemberThread::Proc;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Bench::new(member, ()).await.map(Self)
    }

    async fn handle(&mut self, member: &Member, op: BenchOp) -> Result<BenchReply, ActorError> {
        if matches!(op, BenchOp::Spin(_)) {
            return Err("a spin would hold the proc's thread".into());
        }
        self.0.handle(member, op).await
    }
}

regent_mesh::register_actor!(BenchOnProc);

fn durations(ns: Vec<u64>) -> Vec<Duration> {
    ns.into_iter().map(Duration::from_nanos).collect()
}

/// `peer_call_rtt` against `controller_call_rtt`: rank 0 (proc 0) and the
/// controller each call rank 1 (proc 1), in interleaved rounds.
async fn peer_call(report: &mut Report, pm: &ProcMesh, rounds: u32) -> anyhow::Result<()> {
    let mesh: ActorMesh<Bench> = pm.spawn("bench", 1, &()).await?;
    let per_round = 50;
    let (mut peer, mut controller) = (Vec::new(), Vec::new());
    // The first round warms both paths up and is not counted.
    for round in 0..=rounds {
        let mut c = Vec::with_capacity(per_round as usize);
        for i in 0..per_round {
            let t = Instant::now();
            mesh.call_one(Rank(1), &BenchOp::Echo(u64::from(i))).await?;
            c.push(t.elapsed());
        }
        let BenchReply::Nanos(p) = mesh
            .call_one(
                Rank(0),
                &BenchOp::CallPeer {
                    to: 1,
                    rounds: per_round,
                },
            )
            .await?
        else {
            anyhow::bail!("the member did not time its calls");
        };
        if round > 0 {
            controller.extend(c);
            peer.extend(durations(p));
        }
    }
    mesh.stop().await?;
    let n = peer.len();
    report.push(
        Figure::new(SUITE, "peer_call_rtt", micros(median(&mut peer)), "us")
            .samples(n)
            .against("controller_call_rtt", micros(median(&mut controller)), "us"),
    );
    Ok(())
}

/// `peer_read_64mib_shm` against `memcpy_64mib`, in the reader's proc.
async fn peer_read(report: &mut Report, pm: &ProcMesh, rounds: u32) -> anyhow::Result<()> {
    const BYTES: usize = 64 << 20;
    let mesh: ActorMesh<Bench> = pm.spawn("bench", 1, &()).await?;
    let BenchReply::Handle(handle) = mesh.call_one(Rank(0), &BenchOp::Share(BYTES)).await? else {
        anyhow::bail!("no handle");
    };
    let read = BenchOp::ReadPeer { handle, rounds };
    let BenchReply::Reads { read, memcpy } = mesh.call_one(Rank(1), &read).await? else {
        anyhow::bail!("the member did not time its reads");
    };
    mesh.stop().await?;
    let rate =
        |ns: Vec<u64>| BYTES as f64 / median(&mut durations(ns)).as_secs_f64().max(1e-9) / 1e9;
    let n = read.len();
    report.push(
        Figure::new(SUITE, "peer_read_64mib_shm", rate(read), "GB/s")
            .samples(n)
            .against("memcpy_64mib", rate(memcpy), "GB/s"),
    );
    Ok(())
}

/// `control_rtt_core_blocked` against `control_rtt_idle`: calls to rank 1
/// while rank 0, in the same proc, spins (or not), in interleaved rounds.
async fn blocked_core(report: &mut Report, pm: &ProcMesh, rounds: u32) -> anyhow::Result<()> {
    let mesh: ActorMesh<Bench> = pm.spawn("bench", 2, &()).await?;
    let spin_ms = 1000;
    let (mut idle, mut blocked) = (Vec::new(), Vec::new());
    for i in 0..200 {
        mesh.call_one(Rank(1), &BenchOp::Echo(i)).await?;
    }
    for _ in 0..rounds {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(spin_ms / 2) {
            let c = Instant::now();
            mesh.call_one(Rank(1), &BenchOp::Echo(0)).await?;
            idle.push(c.elapsed());
        }
        let spinner = mesh.clone();
        let spin =
            tokio::spawn(async move { spinner.call_one(Rank(0), &BenchOp::Spin(spin_ms)).await });
        // Let the spin begin (its call reaches the member first).
        tokio::time::sleep(Duration::from_millis(20)).await;
        while !spin.is_finished() {
            let c = Instant::now();
            mesh.call_one(Rank(1), &BenchOp::Echo(0)).await?;
            blocked.push(c.elapsed());
        }
        spin.await??;
    }
    mesh.stop().await?;
    let n = blocked.len();
    report.push(
        Figure::new(
            SUITE,
            "control_rtt_core_blocked",
            micros(median(&mut blocked)),
            "us",
        )
        .samples(n)
        .against("control_rtt_idle", micros(median(&mut idle)), "us"),
    );
    Ok(())
}

/// A runtime with a local allocator running this binary as procs.
pub(crate) async fn cluster(
    config: RuntimeConfig,
) -> anyhow::Result<(Runtime, Arc<dyn Allocator>)> {
    let rt = Runtime::start(config).await?;
    let alloc: Arc<dyn Allocator> = Arc::new(LocalAllocator::new(rt.endpoint().clone())?);
    Ok((rt, alloc))
}

async fn procs(rt: &Runtime, alloc: &Arc<dyn Allocator>, n: usize) -> anyhow::Result<ProcMesh> {
    Ok(rt
        .spawn_procs(alloc.clone(), Shape::new([("procs", n)])?)
        .await?)
}

/// The call-all-and-gather figures of `A`'s members (names ending in
/// `suffix`).
/// With `quinn` (one member per proc), also against the bare quinn
/// fan-out's floor.
async fn call_gather<A, Q>(
    report: &mut Report,
    pm: &ProcMesh,
    per_proc: u32,
    rounds: usize,
    suffix: &str,
    mut quinn: Option<QuinnFloor<Q>>,
) -> anyhow::Result<()>
where
    A: MeshActor<Args = (), Msg = u64, Reply = u64>,
    Q: MeshActor<Args = EchoCredentials, Msg = (), Reply = u16>,
{
    let mesh: ActorMesh<A> = pm.spawn("echo", per_proc, &()).await?;
    let n = mesh.shape().len();
    let procs = pm.shape().len();
    let all = Selection::All;
    let mut tcp = Vec::with_capacity(n);
    for (_, port) in mesh.call(&all, &Echo::TCP_ECHO).await?.into_result()? {
        let port = u16::try_from(port)?;
        let stream =
            tokio::time::timeout(CONNECT_DEADLINE, TcpStream::connect(("127.0.0.1", port)))
                .await
                .context("a TCP echo's connect timed out")??;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        tcp.push((write, read));
    }
    for _ in 0..10 {
        mesh.call(&all, &1).await?.into_result()?;
        echo_fanout(&mut tcp).await?;
        if let Some(q) = &mut quinn {
            echo_fanout(&mut q.streams).await?;
        }
    }
    let mut gathers = Vec::with_capacity(rounds);
    let mut fanouts = Vec::with_capacity(rounds);
    let mut quinn_fanouts = Vec::with_capacity(rounds);
    let mut concurrent = Vec::with_capacity(rounds);
    let mut single = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        let replies = mesh.call(&all, &1).await?.into_result()?;
        gathers.push(t.elapsed());
        anyhow::ensure!(replies.len() == n, "{} of {n} replied", replies.len());
        let t = Instant::now();
        echo_fanout(&mut tcp).await?;
        fanouts.push(t.elapsed());
        if let Some(q) = &mut quinn {
            let t = Instant::now();
            echo_fanout(&mut q.streams).await?;
            quinn_fanouts.push(t.elapsed());
        }
        let t = Instant::now();
        let each =
            futures::future::join_all((0..n).map(|r| mesh.call_one(Rank(r as u32), &1))).await;
        concurrent.push(t.elapsed());
        for r in each {
            r?;
        }
        let t = Instant::now();
        mesh.call_one(Rank(0), &1).await?;
        single.push(t.elapsed());
    }
    // What a gather costs the machine: a block of gathers back to back,
    // the CPU of the controller and every proc against the CPU time the
    // machine's cores had meanwhile.
    let block = rounds.max(100);
    let (mut cost, mut tcp_cost) = (Cost::default(), Cost::default());
    let before = family_cost()?;
    let t = Instant::now();
    for _ in 0..block {
        mesh.call(&all, &1).await?.into_result()?;
    }
    let wall = t.elapsed();
    cost.add(before, family_cost()?);
    let before = family_cost()?;
    for _ in 0..block {
        echo_fanout(&mut tcp).await?;
    }
    tcp_cost.add(before, family_cost()?);
    let mut quinn_cost = Cost::default();
    if let Some(q) = &mut quinn {
        let before = family_cost()?;
        for _ in 0..block {
            echo_fanout(&mut q.streams).await?;
        }
        quinn_cost.add(before, family_cost()?);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    drop(tcp);
    mesh.stop().await?;
    let gather = micros(median(&mut gathers));
    let tcp_fanout = micros(median(&mut fanouts));
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}_cpu{suffix}"),
            micros(cost.cpu) / block as f64,
            "us",
        )
        .samples(block)
        .against(
            "cores_x_gather",
            micros(wall) * cores as f64 / block as f64,
            "us",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}_cpu_vs_tcp{suffix}"),
            micros(cost.cpu) / block as f64,
            "us",
        )
        .samples(block)
        .against("tcp_fanout_cpu", micros(tcp_cost.cpu) / block as f64, "us"),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}_runs_vs_tcp{suffix}"),
            cost.runs as f64 / block as f64,
            "runs",
        )
        .samples(block)
        .against(
            "tcp_fanout_runs",
            tcp_cost.runs as f64 / block as f64,
            "runs",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}_vs_tcp{suffix}"),
            gather,
            "us",
        )
        .samples(rounds)
        .against(&format!("tcp_fanout_{n}"), tcp_fanout, "us"),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}{suffix}"),
            gather,
            "us",
        )
        .samples(rounds)
        .against(
            &format!("concurrent_call_one_{n}"),
            micros(median(&mut concurrent)),
            "us",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_gather_{procs}x{per_proc}_vs_call_one{suffix}"),
            gather,
            "us",
        )
        .samples(rounds)
        .against("call_one", micros(median(&mut single)), "us"),
    );
    if let Some(q) = quinn {
        q.stop().await?;
        report.push(
            Figure::new(
                SUITE,
                &format!("call_gather_{procs}x{per_proc}_cpu_vs_quinn{suffix}"),
                micros(cost.cpu) / block as f64,
                "us",
            )
            .samples(block)
            .against(
                "quinn_fanout_cpu",
                micros(quinn_cost.cpu) / block as f64,
                "us",
            ),
        );
        let quinn_fanout = micros(median(&mut quinn_fanouts));
        report.push(
            Figure::new(
                SUITE,
                &format!("call_gather_{procs}x{per_proc}_vs_quinn{suffix}"),
                gather,
                "us",
            )
            .samples(rounds)
            .against(&format!("quinn_fanout_{n}"), quinn_fanout, "us"),
        );
        report.push(
            Figure::new(
                SUITE,
                &format!("quinn_fanout_{n}_vs_tcp{suffix}"),
                quinn_fanout,
                "us",
            )
            .samples(rounds)
            .against(&format!("tcp_fanout_{n}"), tcp_fanout, "us"),
        );
    }
    Ok(())
}

/// One round of a gather's floor, over TCP or bare quinn: a request on
/// every connection (its writing and reading halves), then every answer,
/// each checked.
async fn echo_fanout<W, R>(conns: &mut [(W, R)]) -> anyhow::Result<()>
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
{
    let request = [7u8; ECHO_BYTES];
    for (send, _) in conns.iter_mut() {
        send.write_all(&request).await?;
    }
    let mut answer = [0u8; ECHO_BYTES];
    for (_, recv) in conns.iter_mut() {
        recv.read_exact(&mut answer).await?;
        anyhow::ensure!(answer == request, "an echo answered other bytes");
    }
    Ok(())
}

async fn cold_spawn(report: &mut Report, rounds: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut spawns = Vec::with_capacity(rounds);
    let mut bare = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
        let t = Instant::now();
        let pm = procs(&rt, &alloc, 4).await?;
        let mesh: ActorMesh<Echo> = pm.spawn("echo", 1, &()).await?;
        mesh.call(&Selection::All, &1).await?.into_result()?;
        spawns.push(t.elapsed());
        pm.stop(Duration::from_secs(2)).await?;
        let t = Instant::now();
        let mut children = Vec::new();
        for _ in 0..4 {
            children.push(
                tokio::process::Command::new(&exe)
                    .arg("--version")
                    .stdout(std::process::Stdio::null())
                    .spawn()?,
            );
        }
        for mut c in children {
            c.wait().await?;
        }
        bare.push(t.elapsed());
    }
    report.push(
        Figure::new(
            SUITE,
            "cold_spawn_4_procs",
            median(&mut spawns).as_secs_f64() * 1e3,
            "ms",
        )
        .samples(rounds)
        .against(
            "bare_process_4",
            median(&mut bare).as_secs_f64() * 1e3,
            "ms",
        ),
    );
    Ok(())
}

async fn controller_frames(
    report: &mut Report,
    fanout: NonZeroU32,
    proc_counts: &[usize],
) -> anyhow::Result<()> {
    for &p in proc_counts {
        let (rt, alloc) = cluster(RuntimeConfig::default().fanout(fanout)).await?;
        let pm = procs(&rt, &alloc, p).await?;
        let mesh: ActorMesh<Echo> = pm.spawn("echo", 1, &()).await?;
        let before = rt.frames_sent();
        let casts = 10;
        for _ in 0..casts {
            mesh.cast(&Selection::All, &1).await?.into_result()?;
        }
        let per_cast = (rt.frames_sent() - before) as f64 / f64::from(casts);
        report.push(
            Figure::new(
                SUITE,
                &format!("controller_frames_{p}_procs"),
                per_cast,
                "msg/cast",
            )
            .samples(casts as usize),
        );
        pm.stop(Duration::from_secs(2)).await?;
    }
    Ok(())
}

async fn simulation(report: &mut Report, members: &[(u32, u32)]) -> anyhow::Result<()> {
    let fanout = NonZeroU32::new(16).expect("non-zero");
    for &(procs, per_proc) in members {
        let r = regent_mesh::sim::simulate(procs, per_proc, fanout).await?;
        let n = r.members;
        // One cast is the sample of the counts: the tree is deterministic.
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_depth_measured"),
                f64::from(r.depth),
                "hops",
            )
            .samples(1),
        );
        report.push(Figure::new(
            SUITE,
            &format!("sim_{n}_depth_formula"),
            f64::from(r.depth_formula),
            "hops",
        ));
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_controller_frames"),
                r.controller_frames as f64,
                "msg/cast",
            )
            .samples(1),
        );
        // Each proc receives a cast once: the claim is frames = procs.
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_frames"),
                r.frames as f64,
                "msg/cast",
            )
            .samples(1),
        );
        report.push(Figure::new(
            SUITE,
            &format!("sim_{n}_procs"),
            f64::from(r.procs),
            "procs",
        ));
        // What the controller sends to spawn, restart and renew, relayed
        // down the tree: frames and the bytes of the encoded commands,
        // against the same commands sent to each proc.
        let kb = |b: u64| b as f64 / 1e3;
        for (what, (frames, bytes), (frames_each, bytes_each)) in [
            ("spawn", r.spawn_sent, r.spawn_each),
            ("restart", r.restart_sent, r.restart_each),
            ("renew", r.renew_sent, r.renew_each),
        ] {
            let each = format!("{what}_to_each_proc");
            report.push(
                Figure::new(
                    SUITE,
                    &format!("sim_{n}_{what}_controller_frames"),
                    frames as f64,
                    "msg",
                )
                .samples(1)
                .against(&each, frames_each as f64, "msg"),
            );
            report.push(
                Figure::new(
                    SUITE,
                    &format!("sim_{n}_{what}_controller_bytes"),
                    kb(bytes),
                    "kB",
                )
                .samples(1)
                .against(&each, kb(bytes_each), "kB"),
            );
        }
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_gather"),
                r.gather.as_secs_f64() * 1e3,
                "ms",
            )
            .samples(1),
        );
    }
    Ok(())
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let rounds = if opts.quick { 20 } else { 200 };
    let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
    for (p, per_proc) in [(1usize, 1u32), (2, 4), (4, 4), (16, 1), (4, 16), (4, 64)] {
        let pm = procs(&rt, &alloc, p).await?;
        let rounds = if per_proc >= 16 { rounds / 4 } else { rounds };
        if per_proc == 1 {
            let quinn = QuinnFloor::<QuinnEcho>::start(&pm).await?;
            call_gather::<Echo, _>(report, &pm, per_proc, rounds, "", Some(quinn)).await?;
            let quinn = QuinnFloor::<QuinnEchoOnProc>::start(&pm).await?;
            call_gather::<EchoOnProc, _>(report, &pm, per_proc, rounds, ON_PROC, Some(quinn))
                .await?;
        } else {
            let none: Option<QuinnFloor<QuinnEcho>> = None;
            call_gather::<Echo, _>(report, &pm, per_proc, rounds, "", none).await?;
        }
        pm.stop(Duration::from_secs(2)).await?;
    }
    // The member figures, on two procs.
    let pm = procs(&rt, &alloc, 2).await?;
    super::calls::run::<Bench>(opts, report, &pm, "").await?;
    super::calls::run::<BenchOnProc>(opts, report, &pm, ON_PROC).await?;
    let member_rounds = if opts.quick { 5 } else { 40 };
    peer_call(report, &pm, member_rounds).await?;
    peer_read(report, &pm, if opts.quick { 10 } else { 50 }).await?;
    blocked_core(report, &pm, if opts.quick { 3 } else { 10 }).await?;
    pm.stop(Duration::from_secs(2)).await?;
    drop(rt);
    // The controller's cost per cast past the fan-out: on a runtime of a
    // small fan-out, so that meshes past it fit this machine.
    let fanout = NonZeroU32::new(super::calls::CPU_FANOUT).expect("non-zero");
    let (small, small_alloc) = cluster(RuntimeConfig::default().fanout(fanout)).await?;
    let counts: &[usize] = if opts.quick { &[4, 16] } else { &[4, 8, 16] };
    super::calls::cpu_per_cast(opts, report, &small, &small_alloc, counts).await?;
    drop(small);
    cold_spawn(report, if opts.quick { 3 } else { 10 }).await?;
    controller_frames(
        report,
        fanout,
        if opts.quick { &[4, 16] } else { &[1, 4, 16] },
    )
    .await?;
    // 10,000 and 100,000 members (issue 17's scale figures): in memory,
    // seconds each.
    let sims: &[(u32, u32)] = &[(625, 16), (3125, 32)];
    simulation(report, sims).await?;
    Ok(())
}
