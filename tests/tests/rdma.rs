//! The payload plane between two OS processes: this test process runs a
//! reader's buffer manager and spawns `rdma_peer` procs (see
//! `src/bin/rdma_peer.rs`) that own buffers. It checks a 1 GiB buffer moved
//! one-sidedly through shm and tcp, random ranges against a model, disjoint
//! concurrent operations, release, an owner stopped (shm still works, tcp
//! times out) and killed mid-transfer (an error within a deadline and no
//! leaked segment), the tcp backend refusing clients without a cluster
//! certificate or without its ALPN, an owner closing its buffer to other
//! processes (refused operations, no stray bytes in a held buffer), and a
//! reader served while idle connections flood the owner's tcp port.
//!
//! Every spawned process is killed and reaped by [`Peer`]'s `Drop`, also
//! when a test fails. Deadlines are generous (2-core CI machines).

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use regent_net::{ClusterCa, ProcCredentials, ProcId};
use regent_rdma::{
    Access, BackendKind, BackendPolicy, BufferManager, Error, MEMFD_NAME_PREFIX, ManagerConfig,
    Memory, RemoteBuffer,
};
use regent_tests::peers::rdma::{fill, unhex};
use regent_tests::tempdir::TempDir;
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(60);
const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

fn pid(name: &str) -> ProcId {
    ProcId::new(name).expect("valid proc id")
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

/// A spawned `rdma_peer`, killed and reaped on drop.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    pid: u32,
    _dir: TempDir,
}

impl Peer {
    async fn spawn(ca: &ClusterCa, name: &str) -> Self {
        let dir = TempDir::new("rdma", name);
        let (chain, key, ca_pem) = ca
            .issue(
                &pid(name),
                regent_net::Role::Proc,
                regent_net::Validity::job(),
            )
            .expect("issue")
            .to_pem();
        let file = |ext: &str, body: &str| {
            let p = dir.0.join(format!("{name}.{ext}"));
            std::fs::write(&p, body).expect("write credentials");
            p
        };
        let (cert, key, ca_file) = (file("crt", &chain), file("key", &key), file("ca", &ca_pem));
        let mut child = Command::new(env!("CARGO_BIN_EXE_rdma_peer"))
            .args(["--proc", name])
            .arg("--cert")
            .arg(cert)
            .arg("--key")
            .arg(key)
            .arg("--ca")
            .arg(ca_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rdma_peer");
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take().expect("piped stdin");
        let (tx, lines) = mpsc::channel(1024);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        let mut peer = Self {
            child,
            stdin,
            lines,
            pid,
            _dir: dir,
        };
        let ready = peer.line().await;
        assert_eq!(ready, format!("READY {pid}"));
        peer
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(DEADLINE, self.lines.recv())
            .await
            .expect("peer answers within the deadline")
            .expect("peer exited")
    }

    async fn command(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").expect("write to peer");
        self.stdin.flush().expect("flush to peer");
        self.line().await
    }

    /// Allocates a buffer in the peer filled with the pattern of `seed`.
    async fn alloc(&mut self, len: usize, seed: u64) -> (u64, RemoteBuffer) {
        let answer = self.command(&format!("alloc {len} {seed}")).await;
        let words: Vec<&str> = answer.split_whitespace().collect();
        let ["HANDLE", id, hex] = words.as_slice() else {
            panic!("unexpected answer {answer:?}");
        };
        // The handle crossed a process boundary as bytes: decode validates.
        let handle = RemoteBuffer::decode(&unhex(hex)).expect("valid handle");
        (id.parse().expect("id"), handle)
    }

    async fn check(&mut self, id: u64, seed: u64) -> String {
        self.command(&format!("check {id} {seed}")).await
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid as i32), signal).expect("signal the peer");
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGCONT);
        self.kill();
    }
}

async fn reader(ca: &ClusterCa, name: &str, config: ManagerConfig) -> BufferManager {
    BufferManager::start(
        config,
        ca.issue(
            &pid(name),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue"),
    )
    .await
    .expect("start the reader's manager")
}

/// Lines of this process's maps and descriptors that refer to a memfd of
/// the process `owner`.
fn mappings_of(owner: u32) -> Vec<String> {
    let name = format!("memfd:{MEMFD_NAME_PREFIX}{owner} ");
    let mut found: Vec<String> = std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&name))
        .map(str::to_owned)
        .collect();
    let exact = format!("/memfd:{MEMFD_NAME_PREFIX}{owner} ");
    for entry in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(link) = std::fs::read_link(entry.path()) {
            let link = format!("{} ", link.to_string_lossy());
            if link.starts_with(&exact) {
                found.push(link);
            }
        }
    }
    found
}

fn dev_shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("regent"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gibibyte_moves_one_sidedly_through_shm_and_tcp() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let reader = reader(&ca, "reader", ManagerConfig::default()).await;
    let (id, handle) = peer.alloc(GIB, 1).await;
    assert_eq!(handle.len_bytes(), GIB as u64);
    assert_eq!(
        reader.backend_for(&handle).expect("a backend"),
        BackendKind::Shm
    );
    // The reader's own buffer, closed to its peers: only it touches it.
    let mut local = reader
        .register_with(Memory::allocate(GIB).expect("memory"), Access::Local)
        .expect("local buffer");
    let local = local.as_mut_slice().expect("a Local buffer's bytes");
    let mut expect = pattern(GIB, 1);
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        reader.set_backend_policy(BackendPolicy::Only(kind));
        local.fill(0);
        let t = Instant::now();
        reader
            .read_into(&handle, 0, local)
            .await
            .unwrap_or_else(|e| panic!("{kind} read: {e}"));
        eprintln!("{kind}: read 1 GiB in {:?}", t.elapsed());
        assert!(local[..] == expect[..], "{kind}: the bytes read differ");
    }
    for (kind, seed) in [(BackendKind::Shm, 2), (BackendKind::Tcp, 3)] {
        reader.set_backend_policy(BackendPolicy::Only(kind));
        fill(local, seed);
        let t = Instant::now();
        reader
            .write_from(&handle, 0, local)
            .await
            .unwrap_or_else(|e| panic!("{kind} write: {e}"));
        eprintln!("{kind}: wrote 1 GiB in {:?}", t.elapsed());
        assert_eq!(
            peer.check(id, seed).await,
            "SAME",
            "{kind}: the owner's bytes"
        );
    }
    // Both directions again at an odd offset and length across chunk
    // boundaries.
    fill(&mut expect, 3);
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        reader.set_backend_policy(BackendPolicy::Only(kind));
        let (at, n) = (12_345_677usize, 300_000_001usize);
        local.fill(0);
        reader
            .read_into(&handle, at as u64, &mut local[..n])
            .await
            .expect("odd read");
        assert!(local[..n] == expect[at..at + n], "{kind}: odd range");
    }
}

#[test]
fn random_ranges_across_processes() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let len = MIB;
    let (mut peer, reader, handle) = rt.block_on(async {
        let mut peer = Peer::spawn(&ca, "owner").await;
        let reader = reader(
            &ca,
            "reader",
            ManagerConfig::default()
                .tcp_chunk_bytes(std::num::NonZeroU32::new(64 << 10).expect("nonzero")),
        )
        .await;
        let (_, handle) = peer.alloc(len, 5).await;
        (peer, reader, handle)
    });
    let mut runner = TestRunner::new(Config {
        failure_persistence: None,
        ..Config::with_cases(32)
    });
    let ops = proptest::collection::vec(
        (
            any::<bool>(),
            0usize..len + 4096,
            0usize..200_000,
            any::<u64>(),
            any::<bool>(),
        ),
        1..16,
    );
    let result = runner.run(&(any::<u64>(), ops), |(base, ops)| {
        rt.block_on(async {
            // Each case starts from a known image, written through shm.
            reader.set_backend_policy(BackendPolicy::Only(BackendKind::Shm));
            let mut model = pattern(len, base);
            reader.write_from(&handle, 0, &model).await.expect("reset");
            for (write, offset, n, seed, tcp) in ops {
                let kind = if tcp {
                    BackendKind::Tcp
                } else {
                    BackendKind::Shm
                };
                reader.set_backend_policy(BackendPolicy::Only(kind));
                let in_range = offset + n <= len;
                if write {
                    let data = pattern(n, seed);
                    let r = reader.write_from(&handle, offset as u64, &data).await;
                    if in_range {
                        r.expect("in-range write");
                        model[offset..offset + n].copy_from_slice(&data);
                    } else {
                        prop_assert!(matches!(r, Err(Error::OutOfRange { .. })), "{kind}: {r:?}");
                    }
                } else {
                    let mut got = vec![0u8; n];
                    let r = reader.read_into(&handle, offset as u64, &mut got).await;
                    if in_range {
                        r.expect("in-range read");
                        prop_assert!(got[..] == model[offset..offset + n], "{kind}: read differs");
                    } else {
                        prop_assert!(matches!(r, Err(Error::OutOfRange { .. })), "{kind}: {r:?}");
                    }
                }
            }
            let mut all = vec![0u8; len];
            reader
                .read_into(&handle, 0, &mut all)
                .await
                .expect("final read");
            prop_assert!(all == model, "the owner's buffer differs from the model");
            Ok(())
        })
    });
    rt.block_on(async { peer.kill() });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_on_disjoint_regions() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let shm = reader(
        &ca,
        "reader-shm",
        ManagerConfig::default().backend(BackendPolicy::Only(BackendKind::Shm)),
    )
    .await;
    let tcp = reader(
        &ca,
        "reader-tcp",
        ManagerConfig::default()
            .backend(BackendPolicy::Only(BackendKind::Tcp))
            .tcp_chunk_bytes(std::num::NonZeroU32::new(16 << 10).expect("nonzero")),
    )
    .await;
    const REGIONS: usize = 16;
    const REGION_BYTES: usize = 256 << 10;
    let (id, handle) = peer.alloc(REGIONS * REGION_BYTES, 0).await;
    let tasks: Vec<_> = (0..REGIONS)
        .map(|r| {
            let manager = if r % 2 == 0 { shm.clone() } else { tcp.clone() };
            let handle = handle.clone();
            tokio::spawn(async move {
                let at = (r * REGION_BYTES) as u64;
                for round in 0..4u64 {
                    let data = pattern(REGION_BYTES, 1000 * r as u64 + round);
                    manager.write_from(&handle, at, &data).await.expect("write");
                    let mut back = vec![0u8; REGION_BYTES];
                    manager
                        .read_into(&handle, at, &mut back)
                        .await
                        .expect("read");
                    assert!(back == data, "region {r} round {round}");
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(DEADLINE, t)
            .await
            .expect("tasks end within the deadline")
            .expect("task");
    }
    // The whole image, as the owner holds it.
    let mut expect = Vec::new();
    for r in 0..REGIONS {
        expect.extend(pattern(REGION_BYTES, 1000 * r as u64 + 3));
    }
    let mut all = vec![0u8; expect.len()];
    shm.read_into(&handle, 0, &mut all).await.expect("read all");
    assert!(all == expect);
    let _ = id;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_buffers_fail_across_processes() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let reader = reader(&ca, "reader", ManagerConfig::default()).await;
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        reader.set_backend_policy(BackendPolicy::Only(kind));
        let (id, handle) = peer.alloc(MIB, 9).await;
        let mut b = vec![0u8; 4096];
        reader
            .read_into(&handle, 0, &mut b)
            .await
            .expect("read before release");
        assert_eq!(
            peer.command(&format!("release {id}")).await,
            format!("RELEASED {id}")
        );
        let e = reader
            .read_into(&handle, 0, &mut b)
            .await
            .expect_err("read after release");
        assert!(matches!(e, Error::Released { .. }), "{kind}: {e}");
        let e = reader
            .write_from(&handle, 0, &b)
            .await
            .expect_err("write after release");
        assert!(matches!(e, Error::Released { .. }), "{kind}: {e}");
    }
    // The released segment is unmapped here within the deadline.
    let deadline = Instant::now() + DEADLINE;
    while !mappings_of(peer.pid).is_empty() {
        assert!(
            Instant::now() < deadline,
            "still mapped: {:?}",
            mappings_of(peer.pid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_owner_serves_shm_and_times_out_on_tcp() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let op_timeout = Duration::from_secs(2);
    let reader = reader(
        &ca,
        "reader",
        ManagerConfig::default().op_timeout(op_timeout),
    )
    .await;
    let (_, handle) = peer.alloc(8 * MIB, 4).await;
    let expect = pattern(8 * MIB, 4);
    let mut got = vec![0u8; 8 * MIB];
    reader.set_backend_policy(BackendPolicy::Only(BackendKind::Tcp));
    reader
        .read_into(&handle, 0, &mut got)
        .await
        .expect("tcp read");
    peer.signal(Signal::SIGSTOP);
    // One-sided: no thread of the stopped owner runs, and shm still works.
    reader.set_backend_policy(BackendPolicy::Only(BackendKind::Shm));
    got.fill(0);
    reader
        .read_into(&handle, 0, &mut got)
        .await
        .expect("shm read of a stopped owner");
    assert!(got == expect);
    // tcp needs the owner's serving task: a deadline, not a hang.
    reader.set_backend_policy(BackendPolicy::Only(BackendKind::Tcp));
    let t = Instant::now();
    let e = tokio::time::timeout(DEADLINE, reader.read_into(&handle, 0, &mut got))
        .await
        .expect("no hang")
        .expect_err("a stopped owner cannot serve tcp");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t.elapsed() < op_timeout * 5, "took {:?}", t.elapsed());
    peer.signal(Signal::SIGCONT);
    got.fill(0);
    reader
        .read_into(&handle, 0, &mut got)
        .await
        .expect("tcp read after SIGCONT");
    assert!(got == expect);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_killed_mid_transfer_fails_fast_and_leaks_no_segment() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let reader = reader(
        &ca,
        "reader",
        ManagerConfig::default().op_timeout(Duration::from_secs(10)),
    )
    .await;
    let len = 256 * MIB;
    let mut local = reader
        .register_with(Memory::allocate(len).expect("memory"), Access::Local)
        .expect("local buffer");
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut peer = Peer::spawn(&ca, "owner").await;
        let owner_pid = peer.pid;
        let (_, handle) = peer.alloc(len, 6).await;
        // Transfers back to back, so one is always in flight: the kill lands
        // in the middle of one.
        let done = Arc::new(AtomicU64::new(0));
        let (killed_tx, killed_rx) = tokio::sync::oneshot::channel::<Instant>();
        let transfers = {
            let reader = reader.clone();
            let done = done.clone();
            let handle = handle.clone();
            let local = local.as_mut_slice().expect("a Local buffer's bytes");
            async move {
                let mut killed_rx = killed_rx;
                let mut killed_at = None;
                loop {
                    if let Err(e) = reader.read_into(&handle, 0, local).await {
                        let killed = match killed_at {
                            Some(t) => t,
                            None => (&mut killed_rx).await.expect("kill time"),
                        };
                        return (e, killed);
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                    if killed_at.is_none() {
                        killed_at = killed_rx.try_recv().ok();
                    }
                }
            }
        };
        let killer = async {
            let deadline = Instant::now() + DEADLINE;
            while done.load(Ordering::SeqCst) == 0 {
                assert!(Instant::now() < deadline, "{kind}: no transfer completed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // Mid-transfer: the next one started right after the count.
            tokio::time::sleep(Duration::from_millis(3)).await;
            peer.signal(Signal::SIGKILL);
            let _ = killed_tx.send(Instant::now());
        };
        let ((e, killed_at), ()) =
            tokio::time::timeout(DEADLINE, async { tokio::join!(transfers, killer) })
                .await
                .expect("the reader gets an error, not a hang");
        let after = killed_at.elapsed();
        eprintln!(
            "{kind}: {} transfers, then {e} ({after:?} after the kill)",
            done.load(Ordering::SeqCst)
        );
        match kind {
            BackendKind::Shm => assert!(matches!(e, Error::OwnerDied { .. }), "shm: {e}"),
            _ => assert!(matches!(e, Error::Link { .. }), "tcp: {e}"),
        }
        assert!(e.to_string().contains("owner"), "a clear error: {e}");
        assert!(
            after < Duration::from_secs(10),
            "{kind}: error {after:?} after the kill"
        );
        peer.kill();
        assert!(
            !std::path::Path::new(&format!("/proc/{owner_pid}")).exists(),
            "owner reaped"
        );
        // No segment left: nothing of the dead owner is mapped or open here
        // (its memory is freed with the last mapping), and nothing is named
        // in /dev/shm.
        let deadline = Instant::now() + DEADLINE;
        while !mappings_of(owner_pid).is_empty() {
            assert!(
                Instant::now() < deadline,
                "{kind}: leaked {:?}",
                mappings_of(owner_pid)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(reader.mapped_peer_segments(), 0);
        assert!(dev_shm_entries().is_empty(), "{:?}", dev_shm_entries());
        // Later operations fail at once too.
        let mut b = [0u8; 8];
        assert!(reader.read_into(&handle, 0, &mut b).await.is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_backend_refuses_clients_without_a_cluster_certificate() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let (_, handle) = peer.alloc(MIB, 8).await;
    let addr = handle.tcp().expect("tcp descriptor").addr;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der().clone()).expect("root");
    let connect = |config: rustls::ClientConfig| async move {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls_pki_types::ServerName::try_from("owner".to_owned()).expect("name");
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        tls.write_all(b"RGR1\x06reader").await?;
        tls.flush().await?;
        let mut welcome = [0u8; 1];
        tls.read_exact(&mut welcome).await?;
        Ok::<u8, std::io::Error>(welcome[0])
    };
    // No certificate at all.
    let mut no_cert =
        rustls::ClientConfig::builder_with_provider(regent_net::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
    no_cert.alpn_protocols = vec![b"regent-rdma/1".to_vec()];
    let r = tokio::time::timeout(DEADLINE, connect(no_cert))
        .await
        .expect("no hang");
    assert!(
        r.is_err(),
        "a client without a certificate was served: {r:?}"
    );
    // A certificate from another cluster.
    let other = ClusterCa::generate("another cluster").expect("CA");
    let (chain, key, _) = other
        .issue(
            &pid("reader"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .to_pem();
    let ours = ca.cert_pem().to_owned();
    let stranger = ProcCredentials::danger_unchecked_from_pem(pid("reader"), &chain, &key, &ours)
        .expect("credentials");
    let mut config = stranger.client_config().expect("config");
    config.alpn_protocols = vec![b"regent-rdma/1".to_vec()];
    let r = tokio::time::timeout(DEADLINE, connect(config))
        .await
        .expect("no hang");
    assert!(
        r.is_err(),
        "another cluster's certificate was served: {r:?}"
    );
    // A member of the cluster that offers no ALPN is not speaking this
    // protocol: refused.
    let mut plain = ca
        .issue(
            &pid("reader"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .client_config()
        .expect("config");
    plain.alpn_protocols.clear();
    let r = tokio::time::timeout(DEADLINE, connect(plain))
        .await
        .expect("no hang");
    assert!(r.is_err(), "a client offering no ALPN was served: {r:?}");
    // Through the manager: a stranger's reader is refused with a clear
    // error, a cluster member's reader is served.
    let outsider = BufferManager::start(
        ManagerConfig::default().backend(BackendPolicy::Only(BackendKind::Tcp)),
        stranger,
    )
    .await
    .expect("start");
    let mut b = vec![0u8; 4096];
    let e = outsider
        .read_into(&handle, 0, &mut b)
        .await
        .expect_err("refused");
    assert!(matches!(e, Error::Refused { .. }), "{e}");
    let member = reader(
        &ca,
        "reader",
        ManagerConfig::default().backend(BackendPolicy::Only(BackendKind::Tcp)),
    )
    .await;
    member
        .read_into(&handle, 0, &mut b)
        .await
        .expect("a member is served");
    assert!(b[..] == pattern(MIB, 8)[..4096]);
}

/// Reads and writes 4 KiB of `h` through `kind`.
async fn peer_ops(
    reader: &BufferManager,
    h: &RemoteBuffer,
    kind: BackendKind,
) -> (Result<(), Error>, Result<(), Error>) {
    reader.set_backend_policy(BackendPolicy::Only(kind));
    let mut b = vec![0u8; 4096];
    let read = reader.read_into(h, 0, &mut b).await;
    let write = reader.write_from(h, 0, &b).await;
    (read, write)
}

fn closed(r: &Result<(), Error>, write: bool) -> bool {
    matches!(r, Err(Error::Closed { write: w, .. }) if *w == write)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_closes_its_buffer_to_other_processes() {
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let reader = reader(&ca, "reader", ManagerConfig::default()).await;
    let (id, handle) = peer.alloc(4 * MIB, 2).await;
    let both = [BackendKind::Shm, BackendKind::Tcp];
    assert_eq!(
        peer.command(&format!("access {id} readonly")).await,
        format!("ACCESS {id} ReadOnly")
    );
    for kind in both {
        let (r, w) = peer_ops(&reader, &handle, kind).await;
        assert!(r.is_ok(), "{kind}: {r:?}");
        assert!(closed(&w, true), "{kind}: {w:?}");
    }
    assert_eq!(
        peer.command(&format!("access {id} local")).await,
        format!("ACCESS {id} Local")
    );
    for kind in both {
        let (r, w) = peer_ops(&reader, &handle, kind).await;
        assert!(closed(&r, false) && closed(&w, true), "{kind}: {r:?} {w:?}");
    }
    assert_eq!(
        peer.command(&format!("access {id} exposed")).await,
        format!("ACCESS {id} Exposed")
    );
    for kind in both {
        let (r, w) = peer_ops(&reader, &handle, kind).await;
        assert!(r.is_ok() && w.is_ok(), "{kind}: {r:?} {w:?}");
    }

    // Writers of this process hammer the buffer through shm and tcp while
    // the owner holds it, round after round: none of their bytes land in
    // a held buffer.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for kind in both {
        let writer = self::reader(
            &ca,
            &format!("writer-{kind}"),
            ManagerConfig::default()
                .backend(BackendPolicy::Only(kind))
                .tcp_chunk_bytes(std::num::NonZeroU32::new(256 << 10).expect("nonzero")),
        )
        .await;
        let handle = handle.clone();
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let data = vec![0xEE; 4 * MIB];
            let (mut done, mut refused) = (0u32, 0u32);
            while !stop.load(Ordering::SeqCst) {
                match writer.write_from(&handle, 0, &data).await {
                    Ok(()) => done += 1,
                    Err(Error::Closed { .. }) => refused += 1,
                    Err(e) => panic!("{kind}: {e}"),
                }
                tokio::task::yield_now().await;
            }
            (kind, done, refused)
        }));
    }
    for round in 0..10 {
        assert_eq!(
            peer.command(&format!("hold {id} {} 50", 100 + round)).await,
            "INTACT",
            "round {round}: a peer's bytes landed in a held buffer"
        );
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        let (kind, done, refused) = tokio::time::timeout(DEADLINE, w)
            .await
            .expect("writers stop")
            .expect("writer");
        eprintln!("{kind}: {done} writes, {refused} refused");
        assert!(refused > 0, "{kind}: never refused, the test did not race");
    }
}

/// Connections that send nothing, from `source`, to `addr`.
async fn idle_connections(
    addr: std::net::SocketAddr,
    source: [u8; 4],
    n: usize,
) -> Vec<tokio::net::TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(std::net::SocketAddr::from((source, 0)))
            .expect("bind");
        conns.push(socket.connect(addr).await.expect("connect"));
    }
    conns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_is_served_during_a_flood_of_idle_connections() {
    use tokio::io::AsyncReadExt as _;
    let ca = ClusterCa::generate("rdma suite").expect("CA");
    let mut peer = Peer::spawn(&ca, "owner").await;
    let (_, handle) = peer.alloc(MIB, 8).await;
    let addr = handle.tcp().expect("tcp descriptor").addr;
    // The owner's defaults: a 3 s handshake deadline, 256 clients. More
    // idle connections than that, from the reader's own address and from
    // others, none sending a byte.
    let handshake_timeout = ManagerConfig::default().tcp_handshake_timeout;
    let mut flood = idle_connections(addr, [127, 0, 0, 1], 400).await;
    for last in 2..6u8 {
        flood.extend(idle_connections(addr, [127, 0, 0, last], 100).await);
    }
    let reader = reader(
        &ca,
        "reader",
        ManagerConfig::default().backend(BackendPolicy::Only(BackendKind::Tcp)),
    )
    .await;
    let t = Instant::now();
    let mut b = vec![0u8; 4096];
    tokio::time::timeout(handshake_timeout / 3, reader.read_into(&handle, 0, &mut b))
        .await
        .expect("served within a third of the handshake deadline")
        .expect("a member is served during the flood");
    eprintln!(
        "served in {:?} during a flood of {}",
        t.elapsed(),
        flood.len()
    );
    assert!(b[..] == pattern(MIB, 8)[..4096]);
    // The server closes every idle connection by its handshake deadline.
    let t = Instant::now();
    for c in &mut flood {
        let mut rest = Vec::new();
        let r = tokio::time::timeout(DEADLINE, c.read_to_end(&mut rest))
            .await
            .expect("the server closes an idle connection");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    assert!(
        t.elapsed() < handshake_timeout * 5,
        "idle connections lived {:?}",
        t.elapsed()
    );
}
