//! `regent bench rdma`: one-sided reads and writes between two OS
//! processes, through shm and tcp, for 1 MiB, 64 MiB and 1 GiB (`--quick`:
//! the first two), against baselines measured in the same run:
//!
//! - `shm_{read,write}_<size>` and `tcp_{read,write}_<size>` against a
//!   single-thread memcpy of the same size between two populated buffers
//!   of this process (`memcpy_<size>`);
//! - `tcp_{read,write}_<size>_vs_raw` against a raw loopback TCP stream of
//!   the same size between the same two processes, plain tokio sockets
//!   from and into populated buffers of that size on both sides
//!   (`tcp_raw_{read,write}_<size>`);
//! - `tcp_{read,write}_<size>_cpu` (and `_2conns_cpu`): the CPU both
//!   processes spent per GB moved by those operations (every thread, from
//!   the scheduler's counts), against the same for the raw stream
//!   (`tcp_raw_{read,write}_<size>_cpu`). A path that costs C ms of CPU
//!   per GB moves at most (cores × 1000 / C) GB/s: at 1,000 ms/GB, 2 GB/s
//!   on 2 cores, whatever the raw stream (which leaves cores idle) does;
//! - `aead_seal_open_<size>`: sealing every byte once from where it lies
//!   into a frame and opening the frame in place, as the tcp backend's two
//!   ends do (AES-128-GCM, 256 KiB pieces), on one thread of this process,
//!   against `memcpy_<size>`; and the tcp figures against
//!   their floor, what a sealed stream cannot go below: its CPU per GB
//!   against the raw stream's plus the AEAD's
//!   (`tcp_{read,write}_<size>_cpu_vs_floor`, baseline
//!   `tcp_raw_{read,write}_<size>_cpu_plus_aead`), and its rate against the
//!   raw stream's or, if lower, the rate that CPU allows on this machine's
//!   cores (`tcp_{read,write}_<size>_vs_floor`, baseline
//!   `tcp_floor_{read,write}_<size>`). What a sealed transfer does beyond
//!   the floor is a write's one copy: its owner opens each frame in a piece
//!   buffer before copying it into the registered buffer, so that only
//!   authenticated bytes reach it;
//! - for 64 MiB and up, the same tcp figures with two connections per
//!   operation (`tcp_{read,write}_<size>_2conns`, parallel streams each
//!   carrying every other chunk, each on a thread of its own at both
//!   ends), against the same baselines;
//! - `ctrl_rtt_during_1GiB_copy` (also with `--quick`): the longest
//!   control round trip (a small TCP echo on the reader's runtime) while a
//!   task of that runtime reads 1 GiB through shm, against the longest over
//!   an idle window of the same length (`ctrl_rtt_idle`); see [`ctrl_rtt`].
//!
//! The peer is this binary again (`regent bench-rdma-peer`, hidden): it
//! owns the buffers and serves a raw TCP sink and source. This process is
//! the reader; its local side is a registered (populated) buffer, as a
//! real reader's would be. Each figure is the median over operations,
//! measured in rounds that interleave every figure with its baselines, so
//! that all see the same load on a shared machine.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use regent_net::{ClusterCa, ProcCredentials, ProcId};
use regent_rdma::{
    Access, BackendKind, BackendPolicy, BufferManager, LocalBuffer, ManagerConfig, Memory,
    RemoteBuffer,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::peer::Peer;
use super::{BenchOptions, Figure, Report, median, micros};

const SUITE: &str = "rdma";
const OWNER: &str = "bench-owner";
const READER: &str = "bench-reader";
/// The reader of the control round-trip figure, on a runtime of its own.
const CTRL_READER: &str = "bench-ctrl-reader";
const DEADLINE: Duration = Duration::from_secs(120);
const MIB: usize = 1 << 20;
/// Rounds that interleave figures and baselines.
const ROUNDS: usize = 3;
/// Connections per operation of the parallel-streams figures.
const PARALLEL_STREAMS: u32 = 2;
/// The raw TCP stream's write and read size.
const RAW_CHUNK_BYTES: usize = 4 * MIB;
/// The largest transfer the raw TCP baseline's server takes (the largest
/// figure's size): a longer request is refused, not allocated.
const MAX_RAW_BYTES: usize = 1 << 30;

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{}GiB", bytes >> 30)
    } else {
        format!("{}MiB", bytes >> 20)
    }
}

fn gb_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("odd hex length");
    }
    (0..s.len() / 2)
        .map(|i| Ok(u8::from_str_radix(&s[2 * i..2 * i + 2], 16)?))
        .collect()
}

/// Operations per round for a transfer size: about 256 MiB per figure and
/// round (at least one operation).
fn ops_per_round(bytes: usize, quick: bool) -> usize {
    let budget = if quick { 64 * MIB } else { 256 * MIB };
    (budget / bytes).clamp(1, 64)
}

/// Samples of one figure.
#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn rate(&mut self, bytes: usize) -> f64 {
        gb_per_s(bytes, median(&mut self.0))
    }
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let sizes: &[usize] = if opts.quick {
        &[MIB, 64 * MIB]
    } else {
        &[MIB, 64 * MIB, 1 << 30]
    };
    let ca = ClusterCa::generate("regent bench")?;
    let reader_creds = ca.issue(
        &ProcId::new(READER)?,
        regent_net::Role::Proc,
        regent_net::Validity::job(),
    )?;
    let (mut peer, ready) = Peer::start("rdma", "bench-rdma-peer", DEADLINE, |dir| {
        ca.issue(
            &ProcId::new(OWNER)?,
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )?
        .save(dir)?;
        Ok(())
    })
    .await?;
    let raw_addr: std::net::SocketAddr = match ready.split_whitespace().collect::<Vec<_>>()[..] {
        ["READY", addr] => addr.parse()?,
        _ => bail!("unexpected peer line {ready:?}"),
    };

    let reader = BufferManager::start(ManagerConfig::default(), reader_creds).await?;
    // Parallel streams: the same reader's proc with two connections per
    // operation (`tcp_connections`), for the large sizes.
    let reader2 = BufferManager::start(
        ManagerConfig {
            tcp_connections: std::num::NonZeroU32::new(PARALLEL_STREAMS).expect("nonzero"),
            ..ManagerConfig::default()
        },
        ca.issue(
            &ProcId::new(READER)?,
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )?,
    )
    .await?;
    let mut raw = TcpStream::connect(raw_addr).await?;
    raw.set_nodelay(true)?;

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for &bytes in sizes {
        let name = size_name(bytes);
        let handle = alloc(&mut peer, bytes).await?;
        // The reader's own buffer: registered, and closed to its peers
        // while it is the local side of transfers.
        let mut local = reader.register_with(Memory::allocate(bytes)?, Access::Local)?;
        let mut src = Memory::allocate(bytes)?;
        src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let n = ops_per_round(bytes, opts.quick);

        let mut memcpy = Samples::default();
        let mut aead = Samples::default();
        // (backend, write, tcp connections, samples)
        let mut figures: Vec<(BackendKind, bool, u32, Samples)> = vec![
            (BackendKind::Shm, false, 1, Samples::default()),
            (BackendKind::Shm, true, 1, Samples::default()),
            (BackendKind::Tcp, false, 1, Samples::default()),
            (BackendKind::Tcp, true, 1, Samples::default()),
        ];
        if bytes >= 64 * MIB {
            figures.push((
                BackendKind::Tcp,
                false,
                PARALLEL_STREAMS,
                Samples::default(),
            ));
            figures.push((BackendKind::Tcp, true, PARALLEL_STREAMS, Samples::default()));
        }
        let by = |conns: u32| if conns == 1 { &reader } else { &reader2 };
        let mut raw_read = Samples::default();
        let mut raw_write = Samples::default();
        // CPU of both processes over each tcp figure's operations and over
        // the raw ones, by (write, connections) and by direction.
        let mut tcp_cpu: Vec<Duration> = vec![Duration::ZERO; figures.len()];
        let (mut raw_read_cpu, mut raw_write_cpu) = (Duration::ZERO, Duration::ZERO);
        let peer_pid = peer.pid();
        let pair_cpu = || super::calls::pair_cpu(peer_pid);
        // Warm up: map the segment, open the connections.
        for (kind, write, conns, _) in &figures {
            transfer(by(*conns), &handle, *kind, *write, &mut local).await?;
        }
        raw_transfer(&mut raw, false, local.as_mut_slice()?).await?;
        raw_transfer(&mut raw, true, local.as_mut_slice()?).await?;
        for _ in 0..ROUNDS {
            let dst = local.as_mut_slice()?;
            for _ in 0..n {
                let t = Instant::now();
                dst.copy_from_slice(&src);
                memcpy.0.push(t.elapsed());
            }
            std::hint::black_box(&dst[..]);
            for _ in 0..n {
                let t = Instant::now();
                regent_rdma::tcp_seal_and_open(dst)?;
                aead.0.push(t.elapsed());
            }
            std::hint::black_box(&dst[..]);
            for (i, (kind, write, conns, samples)) in figures.iter_mut().enumerate() {
                let before = pair_cpu()?;
                for _ in 0..n {
                    let t = Instant::now();
                    transfer(by(*conns), &handle, *kind, *write, &mut local).await?;
                    samples.0.push(t.elapsed());
                }
                if *kind == BackendKind::Tcp {
                    tcp_cpu[i] += pair_cpu()?.saturating_sub(before);
                    let (raw_samples, raw_cpu) = if *write {
                        (&mut raw_write, &mut raw_write_cpu)
                    } else {
                        (&mut raw_read, &mut raw_read_cpu)
                    };
                    let before = pair_cpu()?;
                    for _ in 0..n {
                        let t = Instant::now();
                        raw_transfer(&mut raw, *write, local.as_mut_slice()?).await?;
                        raw_samples.0.push(t.elapsed());
                    }
                    *raw_cpu += pair_cpu()?.saturating_sub(before);
                }
            }
        }
        let memcpy_rate = memcpy.rate(bytes);
        let memcpy_name = format!("memcpy_{name}");
        let (raw_read_rate, raw_write_rate) = (raw_read.rate(bytes), raw_write.rate(bytes));
        // CPU milliseconds per GB moved (both processes); the raw ones
        // moved as many bytes per figure as each tcp figure.
        let ms_per_gb =
            |cpu: Duration, ops: usize| cpu.as_secs_f64() * 1e3 / (ops * bytes) as f64 * 1e9;
        let ops = ROUNDS * n;
        let raw_figures = |write: bool| {
            figures
                .iter()
                .filter(|f| f.0 == BackendKind::Tcp && f.1 == write)
                .count()
                .max(1)
        };
        let raw_read_cost = ms_per_gb(raw_read_cpu, ops * raw_figures(false));
        let raw_write_cost = ms_per_gb(raw_write_cpu, ops * raw_figures(true));
        // The AEAD on one thread: its time is its CPU, or more where the
        // thread waited for a core (then the floor's cost errs high).
        let aead_rate = aead.rate(bytes);
        let aead_cost = 1e3 / aead_rate;
        report.push(
            Figure::new(SUITE, &format!("aead_seal_open_{name}"), aead_rate, "GB/s")
                .samples(ops)
                .against(&memcpy_name, memcpy_rate, "GB/s"),
        );
        for (i, (kind, write, conns, samples)) in figures.iter_mut().enumerate() {
            let op = if *write { "write" } else { "read" };
            let rate = samples.rate(bytes);
            let name = if *conns == 1 {
                name.clone()
            } else {
                format!("{name}_{conns}conns")
            };
            report.push(
                Figure::new(SUITE, &format!("{kind}_{op}_{name}"), rate, "GB/s").against(
                    &memcpy_name,
                    memcpy_rate,
                    "GB/s",
                ),
            );
            if *kind == BackendKind::Tcp {
                let raw_rate = if *write {
                    raw_write_rate
                } else {
                    raw_read_rate
                };
                report.push(
                    Figure::new(SUITE, &format!("tcp_{op}_{name}_vs_raw"), rate, "GB/s").against(
                        &format!("tcp_raw_{op}_{}", size_name(bytes)),
                        raw_rate,
                        "GB/s",
                    ),
                );
                let raw_cost = if *write {
                    raw_write_cost
                } else {
                    raw_read_cost
                };
                let cost = ms_per_gb(tcp_cpu[i], ops);
                report.push(
                    Figure::new(SUITE, &format!("tcp_{op}_{name}_cpu"), cost, "ms/GB")
                        .samples(ops)
                        .against(
                            &format!("tcp_raw_{op}_{}_cpu", size_name(bytes)),
                            raw_cost,
                            "ms/GB",
                        ),
                );
                // The floor: the raw stream's CPU plus sealing and opening
                // every byte once, and the rate that CPU allows on this
                // machine's cores (or the raw stream's, if lower).
                let floor_cost = raw_cost + aead_cost;
                let floor_rate = raw_rate.min(cores * 1e3 / floor_cost);
                report.push(
                    Figure::new(
                        SUITE,
                        &format!("tcp_{op}_{name}_cpu_vs_floor"),
                        cost,
                        "ms/GB",
                    )
                    .samples(ops)
                    .against(
                        &format!("tcp_raw_{op}_{}_cpu_plus_aead", size_name(bytes)),
                        floor_cost,
                        "ms/GB",
                    ),
                );
                report.push(
                    Figure::new(SUITE, &format!("tcp_{op}_{name}_vs_floor"), rate, "GB/s").against(
                        &format!("tcp_floor_{op}_{}", size_name(bytes)),
                        floor_rate,
                        "GB/s",
                    ),
                );
            }
        }
        release(&mut peer, &handle).await?;
    }
    ctrl_rtt(&ca, &mut peer, opts.quick, report).await?;
    Ok(())
}

async fn alloc(peer: &mut Peer, bytes: usize) -> anyhow::Result<RemoteBuffer> {
    let answer = peer.ask(&format!("alloc {bytes}")).await?;
    match answer.split_whitespace().collect::<Vec<_>>()[..] {
        ["HANDLE", h] => Ok(RemoteBuffer::decode(&unhex(h)?)?),
        _ => bail!("unexpected peer answer {answer:?}"),
    }
}

async fn release(peer: &mut Peer, handle: &RemoteBuffer) -> anyhow::Result<()> {
    let id = handle.id().0;
    let answer = peer.ask(&format!("release {id}")).await?;
    if answer != format!("RELEASED {id}") {
        bail!("unexpected peer answer {answer:?}");
    }
    Ok(())
}

/// The bytes of the copy that the control round trip is measured during.
const CTRL_COPY_BYTES: usize = 1 << 30;
/// The control message: a small echo, like a heartbeat.
const CTRL_MSG_BYTES: usize = 64;

/// `ctrl_rtt_during_1GiB_copy`: the longest round trip of a 64-byte TCP
/// echo while a task of the same runtime reads 1 GiB through shm, against
/// the longest round trip over an idle window as long as the copy took.
/// Each round measures both; the figure is the median over rounds.
///
/// The echo's server and client, the copying task and a reader's buffer
/// manager of their own run on a runtime with one worker thread: a proc's
/// heartbeats and handlers share its workers, and with one the effect of a
/// copy that holds a worker cannot hide behind work stealing (it shows as a
/// round trip of a whole chunk's copy time, tens of milliseconds).
async fn ctrl_rtt(
    ca: &ClusterCa,
    peer: &mut Peer,
    quick: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let rounds = if quick { 3 } else { 7 };
    let handle = alloc(peer, CTRL_COPY_BYTES).await?;
    let creds = ca.issue(
        &ProcId::new(CTRL_READER)?,
        regent_net::Role::Proc,
        regent_net::Validity::job(),
    )?;
    let remote = handle.clone();
    let (mut during, mut idle) = tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?
            .block_on(ctrl_rounds(creds, remote, rounds))
    })
    .await??;
    report.push(
        Figure::new(
            SUITE,
            "ctrl_rtt_during_1GiB_copy",
            micros(median(&mut during)),
            "us",
        )
        .against("ctrl_rtt_idle", micros(median(&mut idle)), "us"),
    );
    release(peer, &handle).await
}

/// The rounds of [`ctrl_rtt`], on the current (one-worker) runtime: the
/// longest round trip during each copy and during each idle window.
async fn ctrl_rounds(
    creds: ProcCredentials,
    handle: RemoteBuffer,
    rounds: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let reader = BufferManager::start(
        ManagerConfig::default().backend(BackendPolicy::Only(BackendKind::Shm)),
        creds,
    )
    .await?;
    let mut local = reader.register_with(Memory::allocate(CTRL_COPY_BYTES)?, Access::Local)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let echo_addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        let mut msg = [0u8; CTRL_MSG_BYTES];
        while sock.read_exact(&mut msg).await.is_ok() {
            sock.write_all(&msg).await?;
        }
        anyhow::Ok(())
    });
    let mut client = TcpStream::connect(echo_addr).await?;
    client.set_nodelay(true)?;
    let mut idle = Vec::new();
    let mut during = Vec::new();
    for round in 0..=rounds {
        // The copy, on the worker.
        let stop = Arc::new(AtomicBool::new(false));
        let pinger = tokio::spawn(ping_until(client, stop.clone()));
        let copy = {
            let reader = reader.clone();
            let handle = handle.clone();
            let mut buffer = local;
            tokio::spawn(async move {
                let t = Instant::now();
                let r = match buffer.as_mut_slice() {
                    Ok(dst) => reader.read_into(&handle, 0, dst).await,
                    Err(e) => Err(e),
                };
                (buffer, r, t.elapsed())
            })
        };
        let (buffer, result, took) = copy.await?;
        stop.store(true, Ordering::SeqCst);
        let (c, max_during) = pinger.await??;
        result?;
        local = buffer;
        // The idle window: as long as the copy took.
        let stop = Arc::new(AtomicBool::new(false));
        let pinger = tokio::spawn(ping_until(c, stop.clone()));
        tokio::time::sleep(took).await;
        stop.store(true, Ordering::SeqCst);
        let (c, max_idle) = pinger.await??;
        client = c;
        // Round 0 warms up (maps the segment).
        if round > 0 {
            during.push(max_during);
            idle.push(max_idle);
        }
    }
    drop(client);
    let _ = tokio::time::timeout(DEADLINE, server).await;
    Ok((during, idle))
}

/// Echo round trips back to back until `stop`; returns the stream and the
/// longest round trip (at least one is made).
async fn ping_until(
    mut sock: TcpStream,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(TcpStream, Duration)> {
    let mut msg = [7u8; CTRL_MSG_BYTES];
    let mut longest = Duration::ZERO;
    loop {
        let t = Instant::now();
        sock.write_all(&msg).await?;
        sock.read_exact(&mut msg).await?;
        longest = longest.max(t.elapsed());
        if stop.load(Ordering::SeqCst) {
            return Ok((sock, longest));
        }
    }
}

async fn transfer(
    reader: &BufferManager,
    handle: &RemoteBuffer,
    kind: BackendKind,
    write: bool,
    local: &mut LocalBuffer,
) -> anyhow::Result<()> {
    reader.set_backend_policy(BackendPolicy::Only(kind));
    if write {
        reader.write_from(handle, 0, local.as_slice()?).await?;
    } else {
        reader.read_into(handle, 0, local.as_mut_slice()?).await?;
    }
    Ok(())
}

/// One raw TCP transfer of `local.len()` bytes: the peer sends them (read)
/// or receives them and acknowledges (write).
async fn raw_transfer(raw: &mut TcpStream, write: bool, local: &mut [u8]) -> anyhow::Result<()> {
    let mut req = [0u8; 9];
    req[0] = if write { b'W' } else { b'R' };
    req[1..].copy_from_slice(&(local.len() as u64).to_le_bytes());
    raw.write_all(&req).await?;
    if write {
        for chunk in local.chunks(RAW_CHUNK_BYTES) {
            raw.write_all(chunk).await?;
        }
        let mut ack = [0u8; 1];
        raw.read_exact(&mut ack).await?;
    } else {
        for chunk in local.chunks_mut(RAW_CHUNK_BYTES) {
            raw.read_exact(chunk).await?;
        }
    }
    Ok(())
}

/// The peer: owns the buffers the reader moves, and serves the raw TCP
/// baseline. Prints `READY <raw tcp addr>`, then answers `alloc <bytes>`
/// with `HANDLE <hex>` and `release <id>` with `RELEASED <id>`.
pub(crate) async fn serve_peer(dir: &Path) -> anyhow::Result<()> {
    let creds = ProcCredentials::load(dir, ProcId::new(OWNER)?)?;
    let manager = BufferManager::start(ManagerConfig::default(), creds).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("READY {}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Err(e) = serve_raw(sock).await {
                    tracing::debug!(error = %e, "raw tcp baseline connection ended");
                }
            });
        }
    });
    let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(16);
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    let mut buffers = std::collections::HashMap::new();
    while let Some(line) = rx.recv().await {
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["alloc", bytes] => {
                let mut memory = Memory::allocate(bytes.parse()?)?;
                memory
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, b)| *b = (i * 7) as u8);
                let buffer = manager.register(memory)?;
                println!("HANDLE {}", hex(&buffer.handle().encode()));
                buffers.insert(buffer.id().0, buffer);
            }
            ["release", id] => {
                let id: u64 = id.parse()?;
                buffers.remove(&id);
                println!("RELEASED {id}");
            }
            _ => println!("ERROR {line:?}"),
        }
    }
    Ok(())
}

/// The raw TCP baseline's server side: `R <len>` sends `len` bytes, `W
/// <len>` receives them and acknowledges with one byte. Like a registered
/// buffer, its buffer is populated and as large as the transfer: a write
/// lands every byte in memory, a read sends every byte from memory (a
/// smaller buffer used over and over stays in the cache, which no
/// transfer of the payload plane gets).
async fn serve_raw(mut sock: TcpStream) -> anyhow::Result<()> {
    sock.set_nodelay(true)?;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut req = [0u8; 9];
        if sock.read_exact(&mut req).await.is_err() {
            return Ok(());
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&req[1..]);
        let len = usize::try_from(u64::from_le_bytes(len))?;
        anyhow::ensure!(
            len <= MAX_RAW_BYTES,
            "a raw transfer of {len} bytes (at most {MAX_RAW_BYTES})"
        );
        if buf.len() != len {
            buf = vec![1u8; len];
        }
        match req[0] {
            b'R' => {
                for chunk in buf.chunks(RAW_CHUNK_BYTES) {
                    sock.write_all(chunk).await?;
                }
            }
            b'W' => {
                for chunk in buf.chunks_mut(RAW_CHUNK_BYTES) {
                    sock.read_exact(chunk).await?;
                }
                sock.write_all(&[1]).await?;
            }
            other => bail!("unknown raw request {other}"),
        }
    }
}
