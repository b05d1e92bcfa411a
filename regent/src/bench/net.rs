//! `regent bench net`: the QUIC control plane between two OS processes,
//! against plain tokio TCP between the same two processes in the same run.
//!
//! The peer is this binary again (`regent bench-peer`, hidden), serving
//! three actors on its endpoint and a TCP server:
//!
//! - `rtt_p50`, `rtt_p99`: round trip of a 64-byte request and response
//!   between two actors (typed send, remote inbox, typed reply), against a
//!   64-byte TCP echo (`TCP_NODELAY`).
//! - `quinn_echo_p50`, `quinn_echo_p99`: the transport alone, a 64-byte
//!   echo on one bidirectional stream of a bare quinn connection between
//!   the same processes (the same mutual TLS, quinn's default transport),
//!   against the TCP echo; and `rtt_vs_quinn_p50/p99`, the actors' round
//!   trip against it: what the control plane adds over its transport.
//! - `one_way`: messages per second of 64-byte messages pipelined from one
//!   actor to another (until the receiver has them all), against 64-byte
//!   records pipelined over one TCP connection.
//! - `rtt_hol_p50`, `rtt_hol_p99`: the round trip while another actor's
//!   stream to the same proc is saturated (its receiver does not read, so
//!   its inbox, stream window and send buffer are full and its sender is
//!   blocked), against the unloaded round trip: the head-of-line ratio.
//!
//! - `rtt_busy_p50`: the round trip while another actor streams 4 KiB
//!   messages to a receiver that keeps up (bandwidth and CPU shared, no
//!   blocking), against the TCP echo while another TCP connection between
//!   the same processes carries 4 KiB writes as fast as it can.
//!
//! Each figure is measured in blocks alternating with its baseline (the
//! head-of-line rounds measure the unloaded round trip just before loading),
//! so that both see the same load on a shared machine.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use regent_net::{
    ClusterCa, Endpoint, EndpointConfig, Generation, Inbox, Message, ProcCredentials, ProcId,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::peer::Peer;
use super::{BenchOptions, Figure, Report, micros, percentile};

const SUITE: &str = "net";
const SERVER: &str = "bench-server";
const CLIENT: &str = "bench-client";
const PAYLOAD_BYTES: usize = 64;
const DEADLINE: Duration = Duration::from_secs(60);
/// Rounds that interleave the figures and their baselines.
const ROUNDS: usize = 4;
/// Blocks of the round-trip figures, alternating QUIC and TCP.
const RTT_BLOCKS: usize = 20;

/// A request or response of the round-trip figures.
#[derive(Debug, Serialize, Deserialize)]
struct Echo(Vec<u8>);
impl Message for Echo {
    const TYPE_NAME: &'static str = "regent-bench/net/Echo";
}

/// A message of the one-way figure; the last one asks for a `Done`.
#[derive(Debug, Serialize, Deserialize)]
struct OneWay {
    last: bool,
    body: Vec<u8>,
}
impl Message for OneWay {
    const TYPE_NAME: &'static str = "regent-bench/net/OneWay";
}

/// How many `OneWay` messages the sink had when the last one came.
#[derive(Debug, Serialize, Deserialize)]
struct Done(u64);
impl Message for Done {
    const TYPE_NAME: &'static str = "regent-bench/net/Done";
}

/// Blocks (`open: false`) or unblocks the peer's `stuck` actor.
#[derive(Debug, Serialize, Deserialize)]
struct Gate {
    open: bool,
}
impl Message for Gate {
    const TYPE_NAME: &'static str = "regent-bench/net/Gate";
}

/// The load of the head-of-line figure.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hog(Vec<u8>);
impl Message for Hog {
    const TYPE_NAME: &'static str = "regent-bench/net/Hog";
}

fn pid(name: &str) -> anyhow::Result<ProcId> {
    Ok(ProcId::new(name)?)
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let (rtt_n, one_way_n, warmup) = if opts.quick {
        (2_000, 20_000, 200)
    } else {
        (20_000, 200_000, 2_000)
    };
    let peer = ControlPeer::start().await?;
    let (endpoint, server, tcp_addr) = (&peer.endpoint, peer.server.clone(), peer.tcp_addr);
    let client = pid(CLIENT)?.actor("client", 0)?;
    let mut replies = endpoint.open_port(client.port(0))?;
    let echo = server.actor("echo", 0)?.port(0);

    let pump = pid(CLIENT)?.actor("pump", 0)?;
    let mut done = endpoint.open_port(pump.port(0))?;
    let control = server.actor("control", 0)?.port(0);
    let hog_actor = pid(CLIENT)?.actor("hog", 0)?;
    let stuck = server.actor("stuck", 0)?.port(0);

    // Rounds interleave every figure with its baseline, so that both see
    // the same machine load (the machine is shared and has 2 cores).
    let mut tcp_rtt = Vec::new();
    let mut quic_rtt = Vec::new();
    let mut hol_rtt = Vec::new();
    let mut tcp_rates = Vec::new();
    let mut quic_rates = Vec::new();
    let mut quinn_rtt = Vec::new();
    let mut tcp = tcp_echo(tcp_addr).await?;
    let mut bare = peer.quinn_echo().await?;
    tcp_round_trips(&mut tcp, warmup, &mut Vec::new()).await?;
    bare.round_trips(warmup, &mut Vec::new()).await?;
    quic_round_trips(endpoint, &mut replies, &echo, warmup, &mut Vec::new()).await?;
    for _ in 0..RTT_BLOCKS {
        tcp_round_trips(&mut tcp, rtt_n / RTT_BLOCKS, &mut tcp_rtt).await?;
        bare.round_trips(rtt_n / RTT_BLOCKS, &mut quinn_rtt).await?;
        quic_round_trips(
            endpoint,
            &mut replies,
            &echo,
            rtt_n / RTT_BLOCKS,
            &mut quic_rtt,
        )
        .await?;
    }
    let mut unloaded_rtt = Vec::new();
    let mut busy_rtt = Vec::new();
    let mut tcp_busy_rtt = Vec::new();
    let hol_block = rtt_n / ROUNDS / 2;
    for _ in 0..ROUNDS {
        tcp_rates.push(tcp_one_way(tcp_addr, one_way_n / ROUNDS).await?);
        quic_rates
            .push(quic_one_way(endpoint, &pump, &mut done, &server, one_way_n / ROUNDS).await?);

        quic_round_trips(endpoint, &mut replies, &echo, hol_block, &mut unloaded_rtt).await?;
        // Head of line: block the stuck actor and saturate its stream.
        let client = replies.port().actor.clone();
        endpoint
            .send(&client, &control, Generation(0), Gate { open: false })
            .await
            .map_err(|e| anyhow::anyhow!("{}", e.failure))?;
        let sent = Arc::new(AtomicU64::new(0));
        let hog = spawn_hog(endpoint, &hog_actor, &stuck, &sent);
        wait_until_blocked(&sent).await?;
        let kept = endpoint.unacknowledged(&server);
        quic_round_trips(endpoint, &mut replies, &echo, hol_block, &mut hol_rtt).await?;
        hog.abort();
        tracing::info!(sent = sent.load(Ordering::Relaxed), kept, "hog was blocked");
        // Unblock and drain before the next unloaded round.
        endpoint
            .send(&client, &control, Generation(0), Gate { open: true })
            .await
            .map_err(|e| anyhow::anyhow!("{}", e.failure))?;
        drain(endpoint, &server).await?;

        // Busy rather than blocked: the same actor streams to a receiver
        // that keeps up, so the connection carries bulk data meanwhile.
        let hog = spawn_hog(endpoint, &hog_actor, &stuck, &Arc::new(AtomicU64::new(0)));
        quic_round_trips(endpoint, &mut replies, &echo, hol_block, &mut busy_rtt).await?;
        hog.abort();
        drain(endpoint, &server).await?;
        // Its baseline: the TCP echo while another TCP connection between
        // the same processes carries bulk data.
        let bulk = tcp_bulk(tcp_addr).await?;
        tcp_round_trips(&mut tcp, hol_block, &mut tcp_busy_rtt).await?;
        bulk.abort();
    }
    drop(bare);
    for v in [
        &mut tcp_rtt,
        &mut quinn_rtt,
        &mut quic_rtt,
        &mut hol_rtt,
        &mut unloaded_rtt,
        &mut busy_rtt,
        &mut tcp_busy_rtt,
    ] {
        v.sort_unstable();
    }
    tcp_rates.sort_by(f64::total_cmp);
    quic_rates.sort_by(f64::total_cmp);
    let median_rate = |v: &[f64]| v[v.len() / 2];

    report.push(
        Figure::new(SUITE, "rtt_p50", micros(percentile(&quic_rtt, 50.0)), "us").against(
            "tcp_echo_p50",
            micros(percentile(&tcp_rtt, 50.0)),
            "us",
        ),
    );
    report.push(
        Figure::new(SUITE, "rtt_p99", micros(percentile(&quic_rtt, 99.0)), "us").against(
            "tcp_echo_p99",
            micros(percentile(&tcp_rtt, 99.0)),
            "us",
        ),
    );
    for p in [50.0, 99.0] {
        let quinn = micros(percentile(&quinn_rtt, p));
        report.push(
            Figure::new(SUITE, &format!("quinn_echo_p{p}"), quinn, "us").against(
                &format!("tcp_echo_p{p}"),
                micros(percentile(&tcp_rtt, p)),
                "us",
            ),
        );
        report.push(
            Figure::new(
                SUITE,
                &format!("rtt_vs_quinn_p{p}"),
                micros(percentile(&quic_rtt, p)),
                "us",
            )
            .against(&format!("quinn_echo_p{p}"), quinn, "us"),
        );
    }
    report.push(
        Figure::new(SUITE, "one_way", median_rate(&quic_rates), "msg/s").against(
            "tcp_one_way",
            median_rate(&tcp_rates),
            "msg/s",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            "rtt_hol_p50",
            micros(percentile(&hol_rtt, 50.0)),
            "us",
        )
        .against(
            "rtt_unloaded_p50",
            micros(percentile(&unloaded_rtt, 50.0)),
            "us",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            "rtt_hol_p99",
            micros(percentile(&hol_rtt, 99.0)),
            "us",
        )
        .against(
            "rtt_unloaded_p99",
            micros(percentile(&unloaded_rtt, 99.0)),
            "us",
        ),
    );
    report.push(
        Figure::new(
            SUITE,
            "rtt_busy_p50",
            micros(percentile(&busy_rtt, 50.0)),
            "us",
        )
        .against(
            "tcp_echo_busy_p50",
            micros(percentile(&tcp_busy_rtt, 50.0)),
            "us",
        ),
    );
    Ok(())
}

/// A peer process of this binary (`regent bench-peer`) and this process's
/// endpoint routed to it: the control plane between two processes, for
/// this suite's figures and other suites' baselines
/// ([`ControlPeer::one_way`]).
pub(crate) struct ControlPeer {
    peer: Peer,
    endpoint: Endpoint,
    server: ProcId,
    tcp_addr: std::net::SocketAddr,
    /// The peer's bare quinn echo ([`ControlPeer::quinn_echo`]).
    quinn_addr: std::net::SocketAddr,
    client_creds: ProcCredentials,
    /// The sender of [`ControlPeer::one_way`] and its `Done` inbox.
    pump: regent_net::ActorId,
    done: Inbox,
    /// The replies of [`ControlPeer::round_trips`].
    echoes: Inbox,
}

impl ControlPeer {
    /// Starts the peer and binds this side's endpoint.
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let ca = ClusterCa::generate("regent bench")?;
        let client_creds = ca.issue(
            &pid(CLIENT)?,
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )?;
        let (peer, ready) = Peer::start("net", "bench-peer", DEADLINE, |dir| {
            ca.issue(
                &pid(SERVER)?,
                regent_net::Role::Proc,
                regent_net::Validity::job(),
            )?
            .save(dir)?;
            Ok(())
        })
        .await?;
        let words: Vec<&str> = ready.split_whitespace().collect();
        let ["READY", quic, tcp, bare] = words.as_slice() else {
            bail!("unexpected peer line {ready:?}");
        };
        let server_addr: regent_net::ProcAddr = quic.parse()?;
        let tcp_addr: std::net::SocketAddr = tcp.parse()?;
        let quinn_addr: std::net::SocketAddr = bare.parse()?;
        let endpoint = Endpoint::bind(
            client_creds.clone(),
            "127.0.0.1:0".parse()?,
            EndpointConfig::default(),
        )?;
        endpoint.add_route(server_addr);
        let pump = pid(CLIENT)?.actor("one-way", 0)?;
        let done = endpoint.open_port(pump.port(0))?;
        let echoes = endpoint.open_port(pid(CLIENT)?.actor("echo-client", 0)?.port(0))?;
        Ok(Self {
            peer,
            endpoint,
            server: pid(SERVER)?,
            tcp_addr,
            quinn_addr,
            client_creds,
            pump,
            done,
            echoes,
        })
    }

    /// The peer process's id.
    pub(crate) fn peer_pid(&self) -> u32 {
        self.peer.pid()
    }

    /// Messages per second of `n` 64-byte messages pipelined from one
    /// actor to one of the peer's, until the peer has them all.
    pub(crate) async fn one_way(&mut self, n: usize) -> anyhow::Result<f64> {
        quic_one_way(&self.endpoint, &self.pump, &mut self.done, &self.server, n).await
    }

    /// `n` round trips of a 64-byte request and response between an actor
    /// of this endpoint and the peer's echo actor (what `rtt_p50` times),
    /// each pushed to `samples`.
    pub(crate) async fn round_trips(
        &mut self,
        n: usize,
        samples: &mut Vec<Duration>,
    ) -> anyhow::Result<()> {
        let echo = self.server.actor("echo", 0)?.port(0);
        quic_round_trips(&self.endpoint, &mut self.echoes, &echo, n, samples).await
    }
}

impl ControlPeer {
    /// A bare quinn connection to the peer's echo (this side's own quinn
    /// endpoint, the cluster's mutual TLS) with one bidirectional stream.
    async fn quinn_echo(&self) -> anyhow::Result<QuinnEcho> {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(self.client_creds.quic_client_config()?);
        let conn = tokio::time::timeout(
            DEADLINE,
            endpoint.connect(self.quinn_addr, self.server.as_str())?,
        )
        .await
        .context("quinn echo handshake timed out")??;
        let (send, recv) = conn.open_bi().await?;
        Ok(QuinnEcho {
            endpoint,
            _conn: conn,
            send,
            recv,
        })
    }
}

/// This side of the bare quinn echo.
struct QuinnEcho {
    endpoint: quinn::Endpoint,
    _conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl QuinnEcho {
    /// `n` round trips of 64 bytes, each pushed to `samples`.
    async fn round_trips(&mut self, n: usize, samples: &mut Vec<Duration>) -> anyhow::Result<()> {
        let request = [7u8; PAYLOAD_BYTES];
        let mut response = [0u8; PAYLOAD_BYTES];
        for _ in 0..n {
            let start = Instant::now();
            self.send.write_all(&request).await?;
            self.recv.read_exact(&mut response).await?;
            samples.push(start.elapsed());
        }
        Ok(())
    }
}

impl Drop for QuinnEcho {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"done");
    }
}

/// The peer's side of the bare quinn echo: each bidirectional stream's
/// bytes are written back as they come.
pub(crate) async fn serve_quinn_echo(endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(Some(n)) = recv.read(&mut buf).await {
                        if send.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }
}

impl Drop for ControlPeer {
    fn drop(&mut self) {
        self.endpoint.close();
    }
}

/// Starts an actor sending 4 KiB messages to `to` as fast as it may,
/// counting them in `sent`.
fn spawn_hog(
    endpoint: &Endpoint,
    from: &regent_net::ActorId,
    to: &regent_net::PortId,
    sent: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let (endpoint, from, to, sent) = (endpoint.clone(), from.clone(), to.clone(), sent.clone());
    tokio::spawn(async move {
        let blob = Hog(vec![0x5a; 4096]);
        while endpoint
            .send(&from, &to, Generation(0), blob.clone())
            .await
            .is_ok()
        {
            sent.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Waits until everything sent to `server` is acknowledged.
async fn drain(endpoint: &Endpoint, server: &ProcId) -> anyhow::Result<()> {
    let start = Instant::now();
    while endpoint.unacknowledged(server) > 0 {
        anyhow::ensure!(start.elapsed() < DEADLINE, "the hog's pair did not drain");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Waits until the hog's sends stop advancing (its pair is full).
async fn wait_until_blocked(sent: &AtomicU64) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = sent.load(Ordering::Relaxed);
        if now == last && now > 0 {
            return Ok(());
        }
        last = now;
        if start.elapsed() > DEADLINE {
            bail!("the hog never blocked ({now} sends)");
        }
    }
}

async fn tcp_echo(addr: std::net::SocketAddr) -> anyhow::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    stream.write_all(b"E").await?;
    Ok(stream)
}

async fn tcp_round_trips(
    stream: &mut TcpStream,
    n: usize,
    samples: &mut Vec<Duration>,
) -> anyhow::Result<()> {
    let request = [7u8; PAYLOAD_BYTES];
    let mut response = [0u8; PAYLOAD_BYTES];
    for _ in 0..n {
        let start = Instant::now();
        stream.write_all(&request).await?;
        stream.read_exact(&mut response).await?;
        samples.push(start.elapsed());
    }
    Ok(())
}

/// Starts writing 4 KiB chunks as fast as possible to a TCP sink of the
/// peer, until aborted.
async fn tcp_bulk(addr: std::net::SocketAddr) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(b"B").await?;
    Ok(tokio::spawn(async move {
        let chunk = vec![0x5a; 4096];
        while stream.write_all(&chunk).await.is_ok() {}
    }))
}

async fn tcp_one_way(addr: std::net::SocketAddr, n: usize) -> anyhow::Result<f64> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    stream.write_all(b"S").await?;
    stream.write_all(&(n as u64).to_le_bytes()).await?;
    let record = [9u8; PAYLOAD_BYTES];
    let start = Instant::now();
    for _ in 0..n {
        stream.write_all(&record).await?;
    }
    let mut count = [0u8; 8];
    stream.read_exact(&mut count).await?;
    let elapsed = start.elapsed();
    anyhow::ensure!(u64::from_le_bytes(count) == n as u64, "TCP sink count");
    Ok(n as f64 / elapsed.as_secs_f64())
}

async fn quic_round_trips(
    endpoint: &Endpoint,
    replies: &mut Inbox,
    echo: &regent_net::PortId,
    n: usize,
    samples: &mut Vec<Duration>,
) -> anyhow::Result<()> {
    let client = replies.port().actor.clone();
    for _ in 0..n {
        let start = Instant::now();
        endpoint
            .send(&client, echo, Generation(0), Echo(vec![7; PAYLOAD_BYTES]))
            .await
            .map_err(|e| anyhow::anyhow!("{}", e.failure))?;
        let reply = tokio::time::timeout(DEADLINE, replies.recv())
            .await
            .context("no echo")?
            .context("inbox closed")?;
        let Echo(body) = reply.decode::<Echo>()?;
        anyhow::ensure!(body.len() == PAYLOAD_BYTES, "echo length");
        samples.push(start.elapsed());
    }
    Ok(())
}

async fn quic_one_way(
    endpoint: &Endpoint,
    pump: &regent_net::ActorId,
    done: &mut Inbox,
    server: &ProcId,
    n: usize,
) -> anyhow::Result<f64> {
    let sink = server.actor("sink", 0)?.port(0);
    let start = Instant::now();
    for i in 0..n {
        let message = OneWay {
            last: i + 1 == n,
            body: vec![9; PAYLOAD_BYTES],
        };
        endpoint
            .send(pump, &sink, Generation(0), message)
            .await
            .map_err(|e| anyhow::anyhow!("{}", e.failure))?;
    }
    let reply = tokio::time::timeout(DEADLINE, done.recv())
        .await
        .context("no Done")?
        .context("inbox closed")?;
    let elapsed = start.elapsed();
    let Done(count) = reply.decode::<Done>()?;
    anyhow::ensure!(count == n as u64, "sink counted {count} of {n}");
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// The peer process (`regent bench-peer --dir DIR`): serves until its
/// standard input closes.
pub(crate) async fn serve_peer(dir: &Path) -> anyhow::Result<()> {
    let server = pid(SERVER)?;
    let creds = ProcCredentials::load(dir, server.clone())?;
    let bare = quinn::Endpoint::server(creds.quic_server_config()?, "127.0.0.1:0".parse()?)?;
    let bare_addr = bare.local_addr()?;
    tokio::spawn(serve_quinn_echo(bare));
    let endpoint = Endpoint::bind(creds, "127.0.0.1:0".parse()?, EndpointConfig::default())?;
    let tcp = TcpListener::bind("127.0.0.1:0").await?;
    let tcp_addr = tcp.local_addr()?;
    let echo_actor = server.actor("echo", 0)?;
    let mut echo = endpoint.open_port(echo_actor.port(0))?;
    let sink_actor = server.actor("sink", 0)?;
    let mut sink = endpoint.open_port(sink_actor.port(0))?;
    // The blocked actor of the head-of-line figure: reads its inbox only
    // while its gate is open.
    let mut stuck = endpoint.open_port(server.actor("stuck", 0)?.port(0))?;
    let mut control = endpoint.open_port(server.actor("control", 0)?.port(0))?;
    let (gate_tx, mut gate_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Some(d) = control.recv().await {
            if let Ok(Gate { open }) = d.decode::<Gate>() {
                gate_tx.send_replace(open);
            }
        }
    });
    tokio::spawn(async move {
        loop {
            let open = *gate_rx.borrow_and_update();
            if open {
                tokio::select! {
                    d = stuck.recv() => if d.is_none() { break },
                    _ = gate_rx.changed() => {}
                }
            } else if gate_rx.changed().await.is_err() {
                break;
            }
        }
    });

    let ep = endpoint.clone();
    tokio::spawn(async move {
        while let Some(d) = echo.recv().await {
            let to = d.sender.port(0);
            let Ok(body) = d.decode::<Echo>() else {
                continue;
            };
            if ep
                .send(&echo_actor, &to, Generation(0), body)
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let ep = endpoint.clone();
    tokio::spawn(async move {
        let mut count = 0u64;
        while let Some(d) = sink.recv().await {
            let to = d.sender.port(0);
            let Ok(m) = d.decode::<OneWay>() else {
                continue;
            };
            count += 1;
            if m.last {
                let _ = ep.send(&sink_actor, &to, Generation(0), Done(count)).await;
                count = 0;
            }
        }
    });
    tokio::spawn(async move {
        while let Ok((stream, _)) = tcp.accept().await {
            tokio::spawn(serve_tcp(stream));
        }
    });
    println!("READY {} {tcp_addr} {bare_addr}", endpoint.addr());
    // Exit when the parent closes our input (or dies): a thread blocks on
    // standard input and says when it ends.
    let (eof_tx, eof_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        let _ = eof_tx.send(());
    });
    let _ = eof_rx.await;
    endpoint.close();
    Ok(())
}

async fn serve_tcp(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut mode = [0u8; 1];
    stream.read_exact(&mut mode).await?;
    let mut buf = [0u8; PAYLOAD_BYTES];
    match mode[0] {
        b'E' => loop {
            stream.read_exact(&mut buf).await?;
            stream.write_all(&buf).await?;
        },
        b'B' => {
            let mut big = vec![0u8; 64 << 10];
            while stream.read(&mut big).await? > 0 {}
            Ok(())
        }
        b'S' => {
            let mut n = [0u8; 8];
            stream.read_exact(&mut n).await?;
            let n = u64::from_le_bytes(n);
            let mut big = vec![0u8; 64 << 10];
            let mut left = n * PAYLOAD_BYTES as u64;
            while left > 0 {
                let want = usize::try_from(left.min(big.len() as u64)).unwrap_or(big.len());
                let got = stream.read(&mut big[..want]).await?;
                if got == 0 {
                    return Ok(());
                }
                left -= got as u64;
            }
            stream.write_all(&n.to_le_bytes()).await
        }
        _ => Ok(()),
    }
}
