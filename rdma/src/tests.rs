//! In-process tests: two managers of one process talk through every
//! backend (shm opens this process's own memfds through `/proc/self`). The
//! two-process suite, with SIGKILL of an owner, is `tests/tests/rdma.rs`.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use regent_net::{ClusterCa, ProcCredentials, ProcId};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::handle::Token;
use crate::tcp::wire::{ALPN, HELLO_MAGIC};
use crate::*;

fn pid(name: &str) -> ProcId {
    ProcId::new(name).unwrap()
}

struct Pair {
    ca: ClusterCa,
    owner: BufferManager,
    reader: BufferManager,
}

async fn pair(config: ManagerConfig) -> Pair {
    let ca = ClusterCa::generate("rdma test").unwrap();
    let owner = BufferManager::start(
        config.clone(),
        ca.issue(
            &pid("owner"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let reader = BufferManager::start(
        config,
        ca.issue(
            &pid("reader"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    Pair { ca, owner, reader }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const BACKENDS: [BackendKind; 2] = [BackendKind::Shm, BackendKind::Tcp];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_through_each_backend() {
    let p = pair(
        ManagerConfig::default().tcp_chunk_bytes(std::num::NonZeroU32::new(64 << 10).unwrap()),
    )
    .await;
    let len = 1 << 20;
    let mut data = pattern(len, 3);
    let buf = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
    let handle = RemoteBuffer::decode(&buf.handle().encode()).unwrap();
    assert_eq!(p.reader.backend_for(&handle).unwrap(), BackendKind::Shm);
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut got = vec![0u8; len];
        p.reader.read_into(&handle, 0, &mut got).await.unwrap();
        assert!(got == data, "{kind}: whole read");
        let mut part = vec![0u8; 1000];
        p.reader.read_into(&handle, 777, &mut part).await.unwrap();
        assert_eq!(part, data[777..1777], "{kind}: partial read");
        let new = pattern(300_000, kind as u8 + 7);
        p.reader.write_from(&handle, 5000, &new).await.unwrap();
        assert_eq!(
            buf[5000..305_000],
            new[..],
            "{kind}: the owner sees the write"
        );
        let mut back = vec![0u8; new.len()];
        p.reader.read_into(&handle, 5000, &mut back).await.unwrap();
        assert_eq!(back, new, "{kind}: read back");
        data[5000..305_000].copy_from_slice(&new);
        p.reader
            .read_into(&handle, len as u64, &mut [])
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_is_an_error_for_each_backend() {
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.handle().clone();
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut b = vec![0u8; 100];
        for offset in [4000, 4097, u64::MAX - 10] {
            let e = p.reader.read_into(&h, offset, &mut b).await.unwrap_err();
            assert!(matches!(e, Error::OutOfRange { .. }), "{kind}: {e}");
            let e = p.reader.write_from(&h, offset, &b).await.unwrap_err();
            assert!(matches!(e, Error::OutOfRange { .. }), "{kind}: {e}");
        }
        let mut big = vec![0u8; 4097];
        assert!(p.reader.read_into(&h, 0, &mut big).await.is_err());
    }
    // The owner checks too: a handle that lies about its length is refused
    // by the tcp server, and by the shm backend's size check.
    let liar = RemoteBuffer::new(
        h.owner().clone(),
        h.id(),
        8192,
        h.host(),
        h.token(),
        h.shm(),
        h.tcp(),
        None,
    )
    .unwrap();
    p.reader
        .set_backend_policy(BackendPolicy::Only(BackendKind::Tcp));
    let mut b = vec![0u8; 100];
    let e = p.reader.read_into(&liar, 5000, &mut b).await.unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    p.reader
        .set_backend_policy(BackendPolicy::Only(BackendKind::Shm));
    let e = p.reader.read_into(&liar, 5000, &mut b).await.unwrap_err();
    assert!(matches!(e, Error::Shm { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_buffers_fail_with_a_clear_error() {
    let p = pair(ManagerConfig::default().liveness_interval(Duration::from_millis(20))).await;
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let buf = p.owner.register_new(1 << 16).unwrap();
        let h = buf.handle().clone();
        let mut b = vec![0u8; 10];
        p.reader.read_into(&h, 0, &mut b).await.unwrap();
        p.owner.release(buf);
        let e = p.reader.read_into(&h, 0, &mut b).await.unwrap_err();
        assert!(matches!(e, Error::Released { .. }), "{kind}: {e}");
        assert!(e.is_invalidated());
        let e = p.reader.write_from(&h, 0, &b).await.unwrap_err();
        assert!(matches!(e, Error::Released { .. }), "{kind}: {e}");
    }
    // The sweeper unmapped the released segment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while p.reader.mapped_peer_segments() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "segment still mapped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(p.owner.registered(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_reaches_nothing() {
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.handle();
    let forged = RemoteBuffer::new(
        h.owner().clone(),
        h.id(),
        h.len_bytes(),
        h.host(),
        Token([0xAB; 16]),
        h.shm(),
        h.tcp(),
        None,
    )
    .unwrap();
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut b = vec![0u8; 10];
        let e = p.reader.read_into(&forged, 0, &mut b).await.unwrap_err();
        assert!(matches!(e, Error::Released { .. }), "{kind}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_run_disjoint_operations_concurrently() {
    let p = pair(ManagerConfig::default()).await;
    let len = 64 * 4096;
    let buf = p
        .owner
        .register(Memory::copy_from(&pattern(len, 1)).unwrap())
        .unwrap();
    let h = buf.handle().clone();
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut outs = vec![vec![0u8; 4096]; 32];
        let ins: Vec<Vec<u8>> = (0..32).map(|i| pattern(4096, 100 + i as u8)).collect();
        let mut batch = Batch::new();
        for (i, out) in outs.iter_mut().enumerate() {
            batch.read(&h, (2 * i * 4096) as u64, out);
        }
        for (i, data) in ins.iter().enumerate() {
            batch.write(&h, ((2 * i + 1) * 4096) as u64, data);
        }
        assert_eq!(batch.len(), 64);
        p.reader.run(batch).await.unwrap();
        let expect = pattern(len, 1);
        for (i, out) in outs.iter().enumerate() {
            assert_eq!(out[..], expect[2 * i * 4096..(2 * i + 1) * 4096], "{kind}");
        }
        for (i, data) in ins.iter().enumerate() {
            assert_eq!(
                buf[(2 * i + 1) * 4096..(2 * i + 2) * 4096],
                data[..],
                "{kind}"
            );
        }
        // An out-of-range operation fails the batch before any transfer.
        let mut a = vec![0u8; 10];
        let mut b = vec![0u8; 10];
        let mut batch = Batch::new();
        batch.read(&h, 0, &mut a).read(&h, len as u64 - 5, &mut b);
        let e = p.reader.run(batch).await.unwrap_err();
        assert!(matches!(e, Error::Batch { index: 1, .. }), "{e}");
    }
    // Concurrent tasks on disjoint regions, each with its own manager call.
    p.reader.set_backend_policy(BackendPolicy::Auto);
    let tasks: Vec<_> = (0..8u8)
        .map(|i| {
            let reader = p.reader.clone();
            let h = h.clone();
            tokio::spawn(async move {
                reader.set_backend_policy(BackendPolicy::Auto);
                let data = vec![i; 8192];
                let at = u64::from(i) * 8192;
                reader.write_from(&h, at, &data).await.unwrap();
                let mut back = vec![0u8; 8192];
                reader.read_into(&h, at, &mut back).await.unwrap();
                assert_eq!(back, data);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn raw_tls_client(
    addr: std::net::SocketAddr,
    server: &ProcId,
    config: rustls::ClientConfig,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::try_from(server.as_str().to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// Sends a hello and waits for the welcome; an error means refused.
async fn hello(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    claim: &str,
) -> std::io::Result<u8> {
    let mut h = HELLO_MAGIC.to_vec();
    h.push(claim.len() as u8);
    h.extend_from_slice(claim.as_bytes());
    tls.write_all(&h).await?;
    tls.flush().await?;
    let mut w = [0u8; 1];
    tls.read_exact(&mut w).await?;
    Ok(w[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_backend_refuses_clients_without_a_cluster_certificate() {
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let addr = buf.handle().tcp().unwrap().addr;
    let owner = pid("owner");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(p.ca.cert_der().clone()).unwrap();

    // No client certificate: the server refuses (TLS 1.3 may let the
    // client's handshake finish; the refusal shows at the first read).
    let mut config =
        rustls::ClientConfig::builder_with_provider(regent_net::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
    config.alpn_protocols = vec![ALPN.to_vec()];
    match raw_tls_client(addr, &owner, config).await {
        Err(_) => {}
        Ok(mut tls) => assert!(
            hello(&mut tls, "reader").await.is_err(),
            "served a client with no certificate"
        ),
    }

    // A certificate of another CA: refused.
    let other = ClusterCa::generate("other cluster").unwrap();
    let stranger: ProcCredentials = other
        .issue(
            &pid("reader"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap();
    let (chain, key, _) = stranger.to_pem();
    let (_, _, our_ca) =
        p.ca.issue(
            &pid("x"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap()
        .to_pem();
    let mixed =
        ProcCredentials::danger_unchecked_from_pem(pid("reader"), &chain, &key, &our_ca).unwrap();
    let mut config = mixed.client_config().unwrap();
    config.alpn_protocols = vec![ALPN.to_vec()];
    match raw_tls_client(addr, &owner, config).await {
        Err(_) => {}
        Ok(mut tls) => assert!(
            hello(&mut tls, "reader").await.is_err(),
            "served another cluster's cert"
        ),
    }

    // A cluster certificate that claims another proc: refused by the
    // identity check.
    let mallory =
        p.ca.issue(
            &pid("mallory"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap();
    let mut config = mallory.client_config().unwrap();
    config.alpn_protocols = vec![ALPN.to_vec()];
    let mut tls = raw_tls_client(addr, &owner, config.clone()).await.unwrap();
    assert_ne!(
        hello(&mut tls, "reader").await.unwrap_or(1),
        0,
        "a lying client was accepted"
    );
    // The same certificate, claiming itself: accepted.
    let mut tls = raw_tls_client(addr, &owner, config).await.unwrap();
    assert_eq!(hello(&mut tls, "mallory").await.unwrap(), 0);

    // The reader refuses an owner whose certificate names someone else.
    let impostor = BufferManager::start(
        ManagerConfig::default(),
        p.ca.issue(
            &pid("impostor"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let h = buf.handle();
    let fake = RemoteBuffer::new(
        h.owner().clone(),
        h.id(),
        h.len_bytes(),
        h.host(),
        h.token(),
        None,
        Some(TcpDescriptor {
            addr: impostor.tcp_addr(),
        }),
        None,
    )
    .unwrap();
    let mut b = vec![0u8; 10];
    let e = p.reader.read_into(&fake, 0, &mut b).await.unwrap_err();
    assert!(matches!(e, Error::Refused { .. }), "{e}");
}

#[test]
fn memory_is_a_sealed_private_memfd_with_no_name() {
    let m = Memory::allocate(8192).unwrap();
    assert!(m.iter().all(|&b| b == 0));
    let fd = m.region.fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
    let link = link.to_string_lossy();
    assert!(
        link.starts_with(&format!("/memfd:{MEMFD_NAME_PREFIX}")),
        "{link}"
    );
    let meta = std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert!(Memory::allocate(0).is_err());
    let shm_names: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        !shm_names
            .iter()
            .any(|n| n.to_string_lossy().contains("regent"))
    );
    drop(m);
    assert!(
        std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .map_or(true, |l| !l.to_string_lossy().contains(MEMFD_NAME_PREFIX))
    );
}

#[test]
fn the_ibverbs_backend_reports_whether_it_is_available() {
    match ibverbs_available() {
        Err(why) => {
            println!("skipped: no RDMA device ({why})");
        }
        Ok(()) => {
            // A device is present: a manager opens it and offers verbs.
            let rt = runtime();
            rt.block_on(async {
                let p = pair(ManagerConfig::default()).await;
                assert!(p.owner.ibverbs_enabled());
                let buf = p
                    .owner
                    .register(Memory::copy_from(&pattern(1 << 20, 9)).unwrap())
                    .unwrap();
                assert!(buf.handle().verbs().is_some());
                let mut got = vec![0u8; 1 << 20];
                p.reader.read_into(buf.handle(), 0, &mut got).await.unwrap();
                assert_eq!(got, pattern(1 << 20, 9));
            });
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random offsets and lengths through each backend, against a model of
    /// the buffer: reads see the model, writes change it, out-of-range
    /// requests fail and change nothing.
    #[test]
    fn random_ranges_keep_their_bytes(
        ops in proptest::collection::vec((any::<bool>(), 0u64..70_000, 0usize..20_000, any::<u8>()), 1..12),
    ) {
        let rt = runtime();
        rt.block_on(async {
            let p = pair(ManagerConfig::default()
                .tcp_chunk_bytes(std::num::NonZeroU32::new(4096).unwrap())).await;
            let len = 65_536usize;
            let mut model = pattern(len, 42);
            let buf = p.owner.register(Memory::copy_from(&model).unwrap()).unwrap();
            let h = buf.handle().clone();
            for (i, (write, offset, n, seed)) in ops.into_iter().enumerate() {
                let kind = BACKENDS[i % 2];
                p.reader.set_backend_policy(BackendPolicy::Only(kind));
                let in_range = offset as usize + n <= len;
                if write {
                    let data = pattern(n, seed);
                    let r = p.reader.write_from(&h, offset, &data).await;
                    if in_range {
                        r.unwrap();
                        model[offset as usize..offset as usize + n].copy_from_slice(&data);
                    } else {
                        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{kind}");
                    }
                } else {
                    let mut got = vec![0u8; n];
                    let r = p.reader.read_into(&h, offset, &mut got).await;
                    if in_range {
                        r.unwrap();
                        assert!(got[..] == model[offset as usize..offset as usize + n], "{kind}");
                    } else {
                        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{kind}");
                    }
                }
            }
            assert!(buf[..] == model[..]);
        });
    }
}
