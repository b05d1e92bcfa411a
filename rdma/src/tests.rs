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
    let mut buf = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
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
            buf.try_lock_local().unwrap()[5000..305_000],
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
async fn each_completed_operation_is_counted_by_its_backend_where_it_started() {
    let p = pair(ManagerConfig::default()).await;
    let data = pattern(100_000, 9);
    let a = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
    let b = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
    let (ha, hb) = (a.handle().clone(), b.handle().clone());
    assert_eq!(p.reader.traffic(), Traffic::default());
    let mut want = Traffic::default();
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut got = vec![0u8; 70_000];
        p.reader.read_into(&ha, 10, &mut got).await.unwrap();
        p.reader.write_from(&ha, 0, &got[..1234]).await.unwrap();
        // Refused before any transfer: not counted.
        assert!(p.reader.read_into(&ha, 99_999, &mut got).await.is_err());
        let mut batch = Batch::new();
        let (x, y) = got.split_at_mut(500);
        batch.read(&hb, 0, x).write(&hb, 0, &y[..300]);
        p.reader.run(batch).await.unwrap();
        // Views (shm) or reads into the scratch (tcp): two reads of 2000.
        let mut scratch = vec![0u8; 4000];
        p.reader
            .read_many_with(&[(&ha, 0), (&hb, 0)], 2000, &mut scratch, |_| ())
            .await
            .unwrap();
        let w = match kind {
            BackendKind::Shm => &mut want.shm,
            _ => &mut want.tcp,
        };
        *w = BackendTraffic {
            read_bytes: 70_000 + 500 + 2 * 2000,
            reads: 4,
            written_bytes: 1234 + 300,
            writes: 2,
        };
        assert_eq!(p.reader.traffic(), want, "{kind}");
    }
    // The owner started nothing.
    assert_eq!(p.owner.traffic(), Traffic::default());
    assert_eq!(want.total_bytes(), 2 * (70_000 + 500 + 4000 + 1234 + 300));
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
async fn reads_handed_to_a_function_see_the_owners_bytes_in_place_over_shm() {
    let p = pair(ManagerConfig::default()).await;
    let len = 3000;
    let a = pattern(10_000, 1);
    let b = pattern(10_000, 2);
    let ba = p.owner.register(Memory::copy_from(&a).unwrap()).unwrap();
    let bb = p.owner.register(Memory::copy_from(&b).unwrap()).unwrap();
    let (ha, hb) = (ba.handle().clone(), bb.handle().clone());
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut scratch = vec![0u8; 2 * len];
        let (sum, in_scratch) = p
            .reader
            .read_many_with(&[(&ha, 100), (&hb, 7000)], len, &mut scratch, |views| {
                assert_eq!(views.len(), 2);
                assert_eq!(views[0], &a[100..100 + len], "{kind}");
                assert_eq!(views[1], &b[7000..7000 + len], "{kind}");
                let sum: u64 = views
                    .iter()
                    .flat_map(|v| v.iter())
                    .map(|&x| u64::from(x))
                    .sum();
                (sum, views[0].as_ptr())
            })
            .await
            .unwrap();
        let want: u64 = a[100..100 + len]
            .iter()
            .chain(&b[7000..7000 + len])
            .map(|&x| u64::from(x))
            .sum();
        assert_eq!(sum, want);
        // Over shm the function saw the owner's memory, not a copy; other
        // backends read into the scratch first.
        let scratch_used = in_scratch == scratch.as_ptr();
        assert_eq!(scratch_used, kind != BackendKind::Shm, "{kind}");
        assert_eq!(
            scratch.iter().any(|&x| x != 0),
            kind != BackendKind::Shm,
            "{kind}"
        );
        // Out of range, or too little scratch: refused before anything runs.
        let e = p
            .reader
            .read_many_with(&[(&ha, 9000)], len, &mut scratch, |_| ())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Batch { index: 0, source } if matches!(**source, Error::OutOfRange { .. })),
            "{kind}: {e}"
        );
        assert!(
            p.reader
                .read_many_with(&[(&ha, 0), (&hb, 0)], len, &mut scratch[..len], |_| ())
                .await
                .is_err()
        );
    }
    // A released buffer fails the read (naming it by its index).
    p.reader
        .set_backend_policy(BackendPolicy::Only(BackendKind::Shm));
    p.owner.release(ba);
    let mut scratch = vec![0u8; len];
    let e = p
        .reader
        .read_many_with(&[(&ha, 0)], len, &mut scratch, |_| ())
        .await
        .unwrap_err();
    assert!(e.is_invalidated(), "{e}");
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
    let mut buf = p
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
        let owner_view = buf.try_lock_local().unwrap();
        for (i, data) in ins.iter().enumerate() {
            assert_eq!(
                owner_view[(2 * i + 1) * 4096..(2 * i + 2) * 4096],
                data[..],
                "{kind}"
            );
        }
        drop(owner_view);
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
            let mut buf = p.owner.register(Memory::copy_from(&model).unwrap()).unwrap();
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
            assert!(buf.try_lock_local().unwrap()[..] == model[..]);
        });
    }
}

/// Reads and writes `h` through `kind`; each result is `Ok` or the error.
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
async fn each_access_state_allows_what_it_says() {
    let p = pair(ManagerConfig::default()).await;
    let mut buf = p.owner.register_new(1 << 16).unwrap();
    let h = buf.handle().clone();
    assert_eq!(buf.access(), Access::Exposed);
    // Exposed: no owner view; peers read and write.
    assert!(matches!(buf.as_slice(), Err(Error::Access { .. })));
    assert!(matches!(buf.as_mut_slice(), Err(Error::Access { .. })));
    for kind in BACKENDS {
        let (r, w) = peer_ops(&p.reader, &h, kind).await;
        assert!(r.is_ok() && w.is_ok(), "{kind}: {r:?} {w:?}");
    }
    // ReadOnly: the owner reads; peers read, their writes are refused.
    buf.set_access(Access::ReadOnly).await.unwrap();
    assert_eq!(buf.as_slice().unwrap().len(), 1 << 16);
    assert!(matches!(buf.as_mut_slice(), Err(Error::Access { .. })));
    for kind in BACKENDS {
        let (r, w) = peer_ops(&p.reader, &h, kind).await;
        assert!(r.is_ok(), "{kind}: {r:?}");
        assert!(closed(&w, true), "{kind}: {w:?}");
        assert!(!w.unwrap_err().is_invalidated());
    }
    // Local: the owner reads and writes; every peer operation is refused.
    buf.set_access(Access::Local).await.unwrap();
    buf.as_mut_slice().unwrap()[..4].copy_from_slice(b"mine");
    for kind in BACKENDS {
        let (r, w) = peer_ops(&p.reader, &h, kind).await;
        assert!(closed(&r, false), "{kind}: {r:?}");
        assert!(closed(&w, true), "{kind}: {w:?}");
    }
    // Reopened: the same handle works again and sees the owner's bytes.
    buf.set_access(Access::Exposed).await.unwrap();
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let mut b = [0u8; 4];
        p.reader.read_into(&h, 0, &mut b).await.unwrap();
        assert_eq!(&b, b"mine", "{kind}");
    }
    // A guard closes the buffer while it lives and restores the access
    // it found.
    buf.set_access(Access::ReadOnly).await.unwrap();
    {
        let mut g = buf.lock_local().await.unwrap();
        g[..4].copy_from_slice(b"held");
        let (r, _) = peer_ops(&p.reader, &h, BackendKind::Shm).await;
        assert!(closed(&r, false), "{r:?}");
    }
    assert_eq!(buf.access(), Access::ReadOnly);
    assert_eq!(&buf.as_slice().unwrap()[..4], b"held");
    // Registered Local to begin with: closed from the start.
    let local = p
        .owner
        .register_with(Memory::allocate(4096).unwrap(), Access::Local)
        .unwrap();
    let (r, w) = peer_ops(&p.reader, local.handle(), BackendKind::Shm).await;
    assert!(closed(&r, false) && closed(&w, true), "{r:?} {w:?}");
}

/// A peer of the pair's cluster named `name` that uses only `kind`, its tcp
/// operations in chunks of `chunk` bytes.
async fn peer_on(p: &Pair, kind: BackendKind, name: &str, chunk: u32) -> BufferManager {
    let creds =
        p.ca.issue(
            &pid(name),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap();
    let config = ManagerConfig::default()
        .backend(BackendPolicy::Only(kind))
        .tcp_chunk_bytes(std::num::NonZeroU32::new(chunk).unwrap());
    BufferManager::start(config, creds).await.unwrap()
}

/// The reader's mapping of `h`, through which a test holds slots as a
/// peer's copy in flight would.
fn peer_segment(reader: &BufferManager, h: &RemoteBuffer) -> Arc<crate::shm::PeerSegment> {
    reader.peer_segments().get(h).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_waits_for_peer_copies_in_flight_and_only_for_those_it_forbids() {
    use crate::access::Kind;
    let p = pair(ManagerConfig::default().access_timeout(Duration::from_millis(300))).await;
    let mut buf = p.owner.register_new(1 << 16).unwrap();
    let h = buf.handle().clone();
    let segment = peer_segment(&p.reader, &h);
    let me = std::process::id();

    // A read in flight: ReadOnly does not wait for it, Local does.
    let read = segment
        .enter(Kind::Read, None)
        .unwrap()
        .expect("a free slot");
    buf.try_set_access(Access::ReadOnly).unwrap();
    let e = buf.try_set_access(Access::Local).unwrap_err();
    assert!(
        matches!(&e, Error::Busy { pids, .. } if pids == &[me]),
        "{e}"
    );
    assert_eq!(
        buf.access(),
        Access::ReadOnly,
        "a busy close keeps the access"
    );
    // With a deadline: Busy once it passed, not before.
    let t = std::time::Instant::now();
    let e = buf.set_access(Access::Local).await.unwrap_err();
    assert!(matches!(e, Error::Busy { .. }), "{e}");
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(buf.access(), Access::ReadOnly);
    // A close given up (its future dropped) leaves the access as it was.
    {
        let closing = buf.set_access(Access::Local);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), closing)
                .await
                .is_err()
        );
    }
    assert_eq!(buf.access(), Access::ReadOnly);
    let again = segment.enter(Kind::Read, None).unwrap();
    assert!(again.is_some(), "peers read again after a cancelled close");
    drop(again);
    // New peer copies are refused while the owner waits; the wait ends
    // when the copy in flight does.
    {
        let closing = buf.set_access(Access::Local);
        tokio::pin!(closing);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut closing)
                .await
                .is_err(),
            "closed while a read was copying"
        );
        assert!(matches!(
            segment.enter(Kind::Read, None),
            Err(Error::Closed { .. })
        ));
        drop(read);
        tokio::time::timeout(Duration::from_secs(10), closing)
            .await
            .expect("the close ends once the copy does")
            .unwrap();
    }
    assert_eq!(buf.access(), Access::Local);

    // A write in flight: ReadOnly waits for it. Widening never waits, even
    // for a slot a refused peer holds for a moment.
    buf.set_access(Access::Exposed).await.unwrap();
    let write = segment
        .enter(Kind::Write, None)
        .unwrap()
        .expect("a free slot");
    let e = buf.try_set_access(Access::ReadOnly).unwrap_err();
    assert!(matches!(e, Error::Busy { .. }), "{e}");
    drop(write);
    buf.try_set_access(Access::Local).unwrap();
    let gate = buf.region_gate();
    let refused = gate.enter(Kind::Write, None);
    assert!(refused.is_err());
    drop(refused);
    buf.try_set_access(Access::ReadOnly).unwrap();
}

/// A windowed handle works only while its window is open, through shm and
/// tcp alike: once the owner closes it (or opens the next one), its reads
/// and writes are refused, even though the buffer is exposed again and the
/// new window's handle works; a plain handle is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_window_refuses_its_handle_even_when_the_buffer_is_opened_again() {
    let p = pair(ManagerConfig::default()).await;
    let data = pattern(8192, 5);
    let buf = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
    let plain = buf.handle().clone();
    assert_eq!(plain.window(), None);
    for kind in BACKENDS {
        p.reader.set_backend_policy(BackendPolicy::Only(kind));
        let first = buf.open_window();
        assert!(first.window().is_some());
        // The window travels with the handle.
        let first = RemoteBuffer::decode(&first.encode()).unwrap();
        let mut got = vec![0u8; 100];
        p.reader.read_into(&first, 10, &mut got).await.unwrap();
        assert_eq!(got, data[10..110], "{kind}");
        p.reader
            .write_from(&first, 200, &data[200..300])
            .await
            .unwrap();
        buf.close_window(&first, Duration::from_secs(5))
            .await
            .unwrap();
        let e = p.reader.read_into(&first, 10, &mut got).await.unwrap_err();
        assert!(
            matches!(e, Error::Closed { write: false, .. }),
            "{kind}: {e}"
        );
        let e = p.reader.write_from(&first, 0, &[9; 10]).await.unwrap_err();
        assert!(
            matches!(e, Error::Closed { write: true, .. }),
            "{kind}: {e}"
        );
        let mut scratch = vec![0u8; 100];
        let e = p
            .reader
            .read_many_with(&[(&first, 0)], 100, &mut scratch, |_| ())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Batch { source, .. } if matches!(**source, Error::Closed { .. })),
            "{kind}: {e}"
        );
        // The next window: its handle works, the old one's still does not.
        let second = buf.open_window();
        assert_ne!(second.window(), first.window());
        p.reader.read_into(&second, 10, &mut got).await.unwrap();
        assert!(
            p.reader.read_into(&first, 10, &mut got).await.is_err(),
            "{kind}"
        );
        assert!(
            p.reader.write_from(&first, 0, &[9; 10]).await.is_err(),
            "{kind}"
        );
        p.reader.read_into(&plain, 10, &mut got).await.unwrap();
        buf.close_window(&second, Duration::from_secs(5))
            .await
            .unwrap();
    }
    // Nothing the closed windows' handles tried landed.
    p.reader.set_backend_policy(BackendPolicy::Auto);
    let mut all = vec![0u8; 8192];
    p.reader.read_into(&plain, 0, &mut all).await.unwrap();
    assert!(all == data);
}

/// Closing a window waits for a copy claimed under it before the close
/// (here a claim held by a stopped-looking peer), and refuses claims made
/// after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_window_waits_for_its_copy_in_flight() {
    use crate::access::Kind;
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.open_window();
    let segment = peer_segment(&p.reader, &h);
    let write = segment
        .enter(Kind::Write, h.window())
        .unwrap()
        .expect("a free slot");
    let e = buf
        .close_window(&h, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Busy { .. }), "{e}");
    // Closed all the same: a new claim under it is refused.
    assert!(matches!(
        segment.enter(Kind::Write, h.window()),
        Err(Error::Closed { write: true, .. })
    ));
    {
        let closing = buf.close_window(&h, Duration::from_secs(10));
        tokio::pin!(closing);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut closing)
                .await
                .is_err(),
            "closed while a write was copying"
        );
        drop(write);
        tokio::time::timeout(Duration::from_secs(10), closing)
            .await
            .expect("the close ends once the copy does")
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_of_dead_processes_are_freed_and_live_ones_waited_for() {
    use std::sync::atomic::Ordering;
    let p = pair(ManagerConfig::default()).await;
    let mut buf = p.owner.register_new(4096).unwrap();
    // A process that has exited (and was reaped) held a write slot.
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    // A live process holds another.
    let mut live = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let live_pid = live.id();
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let gate = buf.region_gate();
    gate.slots[7].store((u64::from(dead_pid) << 32) | 2, Ordering::SeqCst);
    gate.slots[9].store((u64::from(live_pid) << 32) | 1, Ordering::SeqCst);
    let e = buf.try_set_access(Access::Local).unwrap_err();
    assert!(
        matches!(&e, Error::Busy { pids, .. } if pids == &[live_pid]),
        "{e}"
    );
    assert_eq!(
        buf.region_gate().slots[7].load(Ordering::SeqCst),
        0,
        "dead slot freed"
    );
    // Killed but not yet reaped counts as gone too.
    live.kill().unwrap();
    let live = Reap(live);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while buf.try_set_access(Access::Local).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed process's slot stays"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(live);
    assert_eq!(buf.region_gate().slots[9].load(Ordering::SeqCst), 0);
}

/// Peers write a pattern in a loop through shm and tcp while the owner
/// holds the buffer locally, round after round: no byte of theirs lands
/// while the owner holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_never_touch_a_buffer_the_owner_holds() {
    let p = pair(
        ManagerConfig::default().tcp_chunk_bytes(std::num::NonZeroU32::new(64 << 10).unwrap()),
    )
    .await;
    let len = 1 << 20;
    let mut buf = p.owner.register_new(len).unwrap();
    let h = buf.handle().clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for kind in BACKENDS {
        let writer = peer_on(&p, kind, &format!("writer-{kind}"), 64 << 10).await;
        let h = h.clone();
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let (mut done, mut refused) = (0u32, 0u32);
            let data = vec![0xEE; h.len_bytes() as usize];
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match writer.write_from(&h, 0, &data).await {
                    Ok(()) => done += 1,
                    // Also when the close lands mid-operation: the rest
                    // of the bytes are dropped, and the write says so.
                    Err(Error::Closed { .. }) => refused += 1,
                    Err(e) => panic!("{kind}: {e}"),
                }
                tokio::task::yield_now().await;
            }
            (kind, done, refused)
        }));
    }
    for round in 0..40u8 {
        {
            let mut g = buf.lock_local().await.unwrap();
            g.fill(round);
            tokio::time::sleep(Duration::from_millis(3)).await;
            let stray = g.iter().position(|&b| b != round);
            assert_eq!(stray, None, "round {round}: a peer wrote a held buffer");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in writers {
        let (kind, done, refused) = w.await.unwrap();
        eprintln!("{kind}: {done} writes, {refused} refused");
        assert!(refused > 0, "{kind}: never refused, the test did not race");
    }
}

/// Peers read a buffer through each backend while its owner, round after
/// round, holds it and rewrites it whole with the round's number: every
/// piece a read returns was taken under its slot, so it is one round's
/// bytes, never a mix of the owner's rewrite and the bytes before it (the
/// tcp owner seals each piece straight from the buffer while it holds the
/// piece's read slot). With the slot given back before the seal it failed
/// in 6 runs of 6; with one tcp reader, or the owner holding the buffer a
/// millisecond a round, it caught that only about half the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_never_read_a_buffer_the_owner_is_rewriting() {
    const PIECE: usize = 256 << 10;
    let p = pair(
        ManagerConfig::default().tcp_chunk_bytes(std::num::NonZeroU32::new(PIECE as u32).unwrap()),
    )
    .await;
    let len = 1 << 20;
    let mut buf = p.owner.register_new(len).unwrap();
    let h = buf.handle().clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    // Three tcp readers, so that a seal is in flight more often.
    let kinds = [
        BackendKind::Shm,
        BackendKind::Tcp,
        BackendKind::Tcp,
        BackendKind::Tcp,
    ];
    for (i, kind) in kinds.into_iter().enumerate() {
        let reader = peer_on(&p, kind, &format!("reader-{i}"), PIECE as u32).await;
        let h = h.clone();
        let stop = stop.clone();
        readers.push(tokio::spawn(async move {
            let (mut done, mut refused) = (0u32, 0u32);
            let mut got = vec![0u8; h.len_bytes() as usize];
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match reader.read_into(&h, 0, &mut got).await {
                    Ok(()) => {
                        done += 1;
                        for (i, piece) in got.chunks(PIECE).enumerate() {
                            let torn = piece.iter().position(|&b| b != piece[0]);
                            assert_eq!(torn, None, "{kind}: piece {i} mixes two rounds");
                        }
                    }
                    Err(Error::Closed { .. }) => refused += 1,
                    Err(e) => panic!("{kind}: {e}"),
                }
                tokio::task::yield_now().await;
            }
            (kind, done, refused)
        }));
    }
    for round in 0..2000u32 {
        {
            let mut g = buf.lock_local().await.unwrap();
            // In steps, as a computation would: a piece sealed without its
            // slot held reads bytes of two rounds.
            for part in g.chunks_mut(4 << 10) {
                part.fill(round as u8);
                std::hint::black_box(&part);
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for r in readers {
        let (kind, done, refused) = r.await.unwrap();
        eprintln!("{kind}: {done} reads, {refused} refused");
        assert!(
            done > 0 && refused > 0,
            "{kind}: the reads did not race the owner"
        );
    }
}

/// Waits until `cond` holds, or panics with `what` after `within`.
async fn until(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A cluster member's raw client config for the payload server, with or
/// without our ALPN.
fn member_config(ca: &ClusterCa, name: &str, alpn: bool) -> rustls::ClientConfig {
    let mut config = ca
        .issue(
            &pid(name),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .unwrap()
        .client_config()
        .unwrap();
    config.alpn_protocols = if alpn {
        vec![ALPN.to_vec()]
    } else {
        Vec::new()
    };
    config.enable_secret_extraction = true;
    config
}

/// A raw client's connection after its welcome, on sealed frames.
fn sealed(
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> crate::tcp::sealed::Sealed {
    let (tcp, conn) = tls.into_inner();
    crate::tcp::seal(tokio::io::BufReader::new(tcp), conn).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_server_gives_up_on_a_reader_that_stops_reading() {
    use crate::tcp::wire::{Op as WireOp, Request};
    let op_timeout = Duration::from_secs(1);
    let p = pair(ManagerConfig::default().op_timeout(op_timeout)).await;
    let len = 32 << 20;
    let buf = p.owner.register_new(len).unwrap();
    let h = buf.handle().clone();
    let mut tls = raw_tls_client(
        h.tcp().unwrap().addr,
        &pid("owner"),
        member_config(&p.ca, "stalled", true),
    )
    .await
    .unwrap();
    assert_eq!(hello(&mut tls, "stalled").await.unwrap(), 0);
    assert_eq!(p.owner.tcp_load().serving, 1);
    // Ask for 32 MiB and read none of it: the server fills the socket
    // buffers and its send stalls.
    let req = Request {
        op: WireOp::Read,
        len_bytes: len as u32,
        buffer: h.id(),
        offset: 0,
        token: h.token(),
        window: None,
    };
    let mut tls = sealed(tls);
    tls.queue(&req.encode()).unwrap();
    tls.flush().await.unwrap();
    let sent = std::time::Instant::now();
    until(
        Duration::from_secs(30),
        "the server still waits on the stalled reader",
        || p.owner.tcp_load().connections == 0,
    )
    .await;
    let after = sent.elapsed();
    assert!(
        after >= op_timeout / 2,
        "dropped after {after:?}, before its deadline"
    );
    // What the socket held arrives, then the end: never the 32 MiB.
    let mut got = Vec::new();
    let mut raw = tls.into_inner();
    let _ = tokio::time::timeout(Duration::from_secs(30), raw.read_to_end(&mut got)).await;
    assert!(got.len() < len, "the whole read arrived");
}

/// Sends a partial TLS record from `source` and stalls: a handshake that
/// never ends.
async fn stalled_handshake(addr: std::net::SocketAddr, source: [u8; 4]) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .unwrap();
    let mut tcp = socket.connect(addr).await.unwrap();
    tcp.write_all(&[0x16, 0x03, 0x01, 0x00]).await.unwrap();
    tcp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_are_bounded_per_address_and_by_a_deadline() {
    let handshake_timeout = Duration::from_millis(1500);
    let p = pair(
        ManagerConfig::default()
            .tcp_max_handshakes_per_addr(std::num::NonZeroU32::new(2).unwrap())
            .tcp_max_handshakes(std::num::NonZeroU32::new(4).unwrap())
            .tcp_handshake_timeout(handshake_timeout)
            .backend(BackendPolicy::Only(BackendKind::Tcp)),
    )
    .await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.handle().clone();
    let addr = h.tcp().unwrap().addr;
    // Two handshakes from 127.0.0.1 that never end fill its share.
    let mut stalled = vec![
        stalled_handshake(addr, [127, 0, 0, 1]).await,
        stalled_handshake(addr, [127, 0, 0, 1]).await,
    ];
    until(
        Duration::from_secs(10),
        "the stalled handshakes started",
        || p.owner.tcp_load().handshaking == 2,
    )
    .await;
    let started = std::time::Instant::now();
    // A third from the same address is refused at once...
    let mut b = vec![0u8; 16];
    let e = p.reader.read_into(&h, 0, &mut b).await.unwrap_err();
    assert!(
        matches!(e, Error::Refused { .. } | Error::Link { .. }),
        "{e}"
    );
    // ...one from another address is served...
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(([127, 0, 0, 2], 0).into()).unwrap();
    let tcp = socket.connect(addr).await.unwrap();
    let name = ServerName::try_from("owner".to_owned()).unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(member_config(&p.ca, "other", true)))
        .connect(name, tcp)
        .await
        .unwrap();
    assert_eq!(hello(&mut tls, "other").await.unwrap(), 0);
    // ...and once the stalled ones reach their deadline, so is 127.0.0.1.
    until(
        Duration::from_secs(30),
        "stalled handshakes outlived their deadline",
        || p.owner.tcp_load().handshaking == 0,
    )
    .await;
    assert!(started.elapsed() < handshake_timeout * 4);
    for s in &mut stalled {
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
        assert!(
            matches!(n, Ok(Ok(0)) | Ok(Err(_))),
            "the server closed it: {n:?}"
        );
    }
    p.reader.read_into(&h, 0, &mut b).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_offering_no_alpn_is_refused() {
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let addr = buf.handle().tcp().unwrap().addr;
    let owner = pid("owner");
    match raw_tls_client(addr, &owner, member_config(&p.ca, "plain", false)).await {
        Err(_) => {}
        Ok(mut tls) => assert!(
            hello(&mut tls, "plain").await.is_err(),
            "served a client that offered no ALPN"
        ),
    }
    // The same member with the ALPN is served.
    let mut tls = raw_tls_client(addr, &owner, member_config(&p.ca, "plain", true))
        .await
        .unwrap();
    assert_eq!(hello(&mut tls, "plain").await.unwrap(), 0);
}

/// shm copies above `shm_blocking_bytes` leave the worker on a
/// multi-thread runtime and go in yielding pieces on a current-thread one;
/// either way every byte lands, in both directions, over many chunks.
fn shm_copies_are_whole(rt: tokio::runtime::Runtime) {
    rt.block_on(async {
        let p = pair(
            ManagerConfig::default()
                .backend(BackendPolicy::Only(BackendKind::Shm))
                .shm_blocking_bytes(1 << 20)
                .shm_chunk_bytes(std::num::NonZeroU32::new(3 << 20).unwrap()),
        )
        .await;
        let len = 20 << 20;
        let data = pattern(len, 5);
        let mut buf = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
        let h = buf.handle().clone();
        let mut got = vec![0u8; len - 3];
        p.reader.read_into(&h, 3, &mut got).await.unwrap();
        assert!(got[..] == data[3..]);
        let new = pattern(len - 7, 9);
        p.reader.write_from(&h, 7, &new).await.unwrap();
        assert!(buf.try_lock_local().unwrap()[7..] == new[..]);
        // Below the threshold: inline, one chunk.
        let mut small = vec![0u8; 1000];
        p.reader.read_into(&h, 7, &mut small).await.unwrap();
        assert!(small[..] == new[..1000]);
    });
}

#[test]
fn shm_copies_are_whole_on_a_multi_thread_runtime() {
    shm_copies_are_whole(runtime());
}

#[test]
fn shm_copies_are_whole_on_a_current_thread_runtime() {
    shm_copies_are_whole(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    );
}

/// Reads and writes over three connections per operation, chunks of 64
/// KiB dealt round-robin: every byte lands where it belongs, whether the
/// streams run on threads of their own or share this task.
fn parallel_streams_move_every_byte(rt: tokio::runtime::Runtime) {
    rt.block_on(async {
        let p = pair(
            ManagerConfig::default()
                .backend(BackendPolicy::Only(BackendKind::Tcp))
                .tcp_connections(std::num::NonZeroU32::new(3).unwrap())
                .tcp_chunk_bytes(std::num::NonZeroU32::new(64 << 10).unwrap()),
        )
        .await;
        let len = (4 << 20) + 12_345;
        let data = pattern(len, 11);
        let mut buf = p.owner.register(Memory::copy_from(&data).unwrap()).unwrap();
        let h = buf.handle().clone();
        for round in 0..3u8 {
            let mut got = vec![0u8; len - 777];
            p.reader.read_into(&h, 777, &mut got).await.unwrap();
            assert!(
                got[..] == buf.try_lock_local().unwrap()[777..],
                "read {round}"
            );
            let new = pattern(len - 1001 - usize::from(round), 40 + round);
            p.reader.write_from(&h, 1001, &new).await.unwrap();
            assert!(
                buf.try_lock_local().unwrap()[1001..1001 + new.len()] == new[..],
                "write {round}"
            );
        }
        // The operations reused their connections: three, not one per
        // operation and stream.
        assert_eq!(p.owner.tcp_load().connections, 3);
    });
}

#[test]
fn parallel_streams_move_every_byte_on_a_multi_thread_runtime() {
    parallel_streams_move_every_byte(runtime());
}

#[test]
fn parallel_streams_move_every_byte_on_a_current_thread_runtime() {
    parallel_streams_move_every_byte(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    );
}

/// Each stream of an operation on a multi-thread runtime runs on a thread
/// of its own: streams that each wait, without yielding, for the others to
/// have started all finish. Driven by one task, the first would wait alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_streams_run_each_on_a_thread_of_its_own() {
    const STREAMS: usize = 3;
    let arrived = std::sync::atomic::AtomicUsize::new(0);
    let streams = (0..STREAMS)
        .map(|_| async {
            arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let waited = std::time::Instant::now();
            while arrived.load(std::sync::atomic::Ordering::SeqCst) < STREAMS {
                if waited.elapsed() > Duration::from_secs(5) {
                    return Err(Error::Config("a stream waited alone".into()));
                }
                std::thread::yield_now();
            }
            Ok(())
        })
        .collect();
    crate::tcp::parallel_streams(streams).await.unwrap();
    // The first failure, by stream, is the answer; every stream ran.
    let ran = std::sync::atomic::AtomicUsize::new(0);
    let streams = (0..STREAMS)
        .map(|i| {
            let ran = &ran;
            async move {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                match i {
                    0 => Ok(()),
                    _ => Err(Error::Config(format!("stream {i}"))),
                }
            }
        })
        .collect();
    let err = crate::tcp::parallel_streams(streams).await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m == "stream 1"), "{err}");
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), STREAMS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_beyond_the_table_evict_the_oldest() {
    let p = pair(
        ManagerConfig::default()
            .tcp_max_silent(std::num::NonZeroU32::new(8).unwrap())
            .backend(BackendPolicy::Only(BackendKind::Tcp)),
    )
    .await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.handle().clone();
    let addr = h.tcp().unwrap().addr;
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    until(
        Duration::from_secs(10),
        "the silent table stays bounded",
        || {
            let load = p.owner.tcp_load();
            load.silent == 8 && load.connections == 8
        },
    )
    .await;
    // The oldest twelve were dropped (the server closed them)...
    for s in &mut silent[..12] {
        let mut rest = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
    }
    // ...and a reader still gets in: it evicts one more silent connection.
    let mut b = vec![0u8; 16];
    p.reader.read_into(&h, 0, &mut b).await.unwrap();
    let load = p.owner.tcp_load();
    assert_eq!((load.serving, load.silent), (1, 7), "{load:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_after_the_owner_closed_is_not_waited_for() {
    use crate::access::Kind;
    use std::sync::atomic::Ordering;
    let p = pair(ManagerConfig::default().access_timeout(Duration::from_secs(20))).await;
    let mut buf = p.owner.register_new(1 << 16).unwrap();
    let h = buf.handle().clone();
    let segment = peer_segment(&p.reader, &h);
    let in_flight = segment
        .enter(Kind::Read, None)
        .unwrap()
        .expect("a free slot");
    let closing = buf.set_access(Access::Local);
    tokio::pin!(closing);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut closing)
            .await
            .is_err()
    );
    // A peer claims a slot now, after the owner stored Local, and is
    // preempted before it reads the state: it will refuse, never copy. The
    // owner must not wait for it (a stream of such retries would starve it).
    let late = segment
        .slots()
        .iter()
        .find(|s| s.load(Ordering::SeqCst) == 0)
        .expect("a free slot");
    late.store(
        (u64::from(std::process::id()) << 32) | (12_345 << 2) | 1,
        Ordering::SeqCst,
    );
    drop(in_flight);
    let t = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(15), closing)
        .await
        .expect("the owner waited for a claim made after it closed")
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    late.store(0, Ordering::SeqCst);
}

/// A write refused for its range, with an offset near `u64::MAX` and more
/// than one piece of data, is read to its end and answered `OutOfRange`,
/// and the connection stays in step: the offset from the wire is never
/// added to anything while the refused data is drained. (The server's
/// debug build panics on such an overflow, and the answer never comes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_with_a_huge_offset_is_drained_and_answered() {
    use crate::tcp::sealed::{HEAD_BYTES, TAG_BYTES};
    use crate::tcp::wire::{Op as WireOp, RESPONSE_BYTES, Request, Response, Status};
    let p = pair(ManagerConfig::default()).await;
    let buf = p.owner.register_new(4096).unwrap();
    let h = buf.handle().clone();
    let mut tls = raw_tls_client(
        h.tcp().unwrap().addr,
        &pid("owner"),
        member_config(&p.ca, "huge-offset", true),
    )
    .await
    .unwrap();
    assert_eq!(hello(&mut tls, "huge-offset").await.unwrap(), 0);
    let mut tls = sealed(tls);
    let request = |op, offset, len: usize| Request {
        op,
        len_bytes: len as u32,
        buffer: h.id(),
        offset,
        token: h.token(),
        window: None,
    };
    // Three pieces' worth (the server reads 256 KiB at a time).
    let len = 600 << 10;
    tls.queue(&request(WireOp::Write, u64::MAX - 10, len).encode())
        .unwrap();
    for piece in [256 << 10, 256 << 10, len - (512 << 10)] {
        let mut frame = vec![0u8; HEAD_BYTES + piece + TAG_BYTES];
        tls.seal_into(&vec![7u8; piece], &mut frame).unwrap();
        tls.write_frame(&frame).await.unwrap();
    }
    let answer = |b: [u8; RESPONSE_BYTES]| Response::decode(&b).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), tls.recv_msg::<RESPONSE_BYTES>())
        .await
        .expect("the refused write was answered")
        .unwrap();
    assert_eq!(answer(got).status, Status::OutOfRange);
    // In step: a read of the buffer's first bytes is answered with them.
    tls.queue(&request(WireOp::Read, 0, 8).encode()).unwrap();
    tls.flush().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), tls.recv_msg::<RESPONSE_BYTES>())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answer(got).status, Status::Ok);
    let mut bytes = [1u8; 8];
    assert_eq!(tls.recv_into(&mut bytes).await.unwrap(), 8);
    assert_eq!(bytes, [0u8; 8]);
}
