//! Collectives between ranks of one process: real buffer managers (shm
//! through this process's memfds, or tcp), a local transport, and results
//! compared bit for bit with serial references.

use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use regent_rdma::{BackendKind, BackendPolicy, BufferManager, HostId, ManagerConfig};
use tch::Tensor;
use tokio::time::Instant;

use super::*;
use crate::transport::local::{LocalGroup, LocalTransport, local_managers, local_managers_with};

/// The most ranks a collective test uses.
const MAX_RANKS: usize = 5;
/// Buffer managers of the harness (a reshard may use one more rank).
const MANAGERS: usize = 6;

struct Harness {
    rt: tokio::runtime::Runtime,
    managers: Vec<BufferManager>,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        crate::testing::init_torch();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let managers = rt
            .block_on(local_managers(MANAGERS, ManagerConfig::default()))
            .unwrap();
        Harness { rt, managers }
    })
}

/// Deterministic test data: floats of many magnitudes (so the order of
/// a sum changes its bits) and no NaN; integers of any value; bools 0/1.
fn data(dtype: DType, numel: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::with_capacity(numel * dtype.size_bytes());
    for _ in 0..numel {
        let x = next();
        let f = ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 2f64.powi((x % 41) as i32 - 20);
        match dtype {
            DType::F32 => out.extend((f as f32).to_ne_bytes()),
            DType::F64 => out.extend(f.to_ne_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(f).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(f).to_bits().to_ne_bytes()),
            DType::I64 => out.extend((x as i64).to_ne_bytes()),
            DType::I32 => out.extend((x as i32).to_ne_bytes()),
            DType::I16 => out.extend((x as i16).to_ne_bytes()),
            DType::I8 => out.push(x as u8),
            DType::U8 => out.push(x as u8),
            DType::Bool => out.push((x & 1) as u8),
        }
    }
    out
}

fn tensor_of(dtype: DType, bytes: &[u8]) -> Tensor {
    let numel = bytes.len() / dtype.size_bytes();
    Tensor::f_from_data_size(bytes, &[numel as i64], dtype.kind()).unwrap()
}

fn bytes_of(t: &Tensor) -> Vec<u8> {
    let dtype = DType::from_kind(t.kind()).unwrap();
    let mut v = vec![0u8; t.numel() * dtype.size_bytes()];
    t.copy_data_u8(&mut v, t.numel());
    v
}

fn buffer_with(m: &BufferManager, dtype: DType, bytes: &[u8]) -> TensorBuffer {
    TensorBuffer::copy_from(m, &tensor_of(dtype, bytes), crate::Contiguity::Refuse).unwrap()
}

/// Serial all-reduce reference for `algorithm` (the ring folds chunk `c`
/// in ring order).
fn reference_all_reduce(
    inputs: &[Vec<u8>],
    dtype: DType,
    op: ReduceOp,
    algorithm: Algorithm,
) -> Vec<u8> {
    let p = inputs.len();
    let elem = dtype.size_bytes();
    let numel = inputs[0].len() / elem;
    if algorithm != Algorithm::Ring || p == 1 {
        let refs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
        return crate::serial_fold(op, dtype, &refs).unwrap();
    }
    let mut out = Vec::new();
    for (c, range) in chunk_ranges(numel, p).into_iter().enumerate() {
        let parts: Vec<&[u8]> = ring_fold_order(c, p)
            .into_iter()
            .map(|q| &inputs[q][range.start * elem..range.end * elem])
            .collect();
        if range.is_empty() {
            continue;
        }
        out.extend(crate::serial_fold(op, dtype, &parts).unwrap());
    }
    out
}

type RankResult = Result<Vec<u8>, Error>;

/// Runs `body` on every rank of a new local group of `p` members (one
/// task each) and returns their results in rank order.
fn run_group<F, Fut>(p: usize, config: CollectiveConfig, body: F) -> Vec<RankResult>
where
    F: Fn(usize, Communicator<LocalTransport>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = RankResult> + Send + 'static,
{
    let h = harness();
    h.rt.block_on(async {
        let (_group, transports) = LocalGroup::new(h.managers[..p].to_vec());
        let body = Arc::new(body);
        let tasks: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let body = body.clone();
                let config = config.clone();
                tokio::spawn(async move {
                    let comm = Communicator::new(t, config).await?;
                    body(rank, comm).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("rank task panicked"));
        }
        out
    })
}

fn config(algorithm: Algorithm, chunk: usize) -> CollectiveConfig {
    CollectiveConfig::default()
        .algorithm(algorithm)
        .chunk_bytes(NonZeroUsize::new(chunk).unwrap())
        .timeout(Duration::from_secs(20))
}

fn arb_dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn arb_algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(vec![Algorithm::Inline, Algorithm::Direct, Algorithm::Ring])
}

fn arb_chunk() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![8usize, 24, 64, 4096])
}

/// A reduction that makes sense for `dtype`.
fn usable(op: ReduceOp, dtype: DType) -> ReduceOp {
    if op.check(dtype).is_ok() {
        op
    } else {
        ReduceOp::Max
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Every rank ends with exactly the bits of the serial reference: the
    /// rank-order fold for inline and direct, the ring-order fold per
    /// chunk for the ring; for lengths not divisible by the group size too.
    #[test]
    fn all_reduce_equals_the_serial_reference_bitwise(
        p in 1usize..=MAX_RANKS,
        numel in 0usize..1500,
        dtype in arb_dtype(),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
        algorithm in arb_algorithm(),
        chunk in arb_chunk(),
        seed in any::<u64>(),
    ) {
        let op = usable(op, dtype);
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, numel, seed + r as u64)).collect();
        let expect = reference_all_reduce(&inputs, dtype, op, algorithm);
        let inputs = Arc::new(inputs);
        let results = run_group(p, config(algorithm, chunk), move |rank, mut comm| {
            let inputs = inputs.clone();
            async move {
                let m = comm.transport().buffers().clone();
                let mut b = buffer_with(&m, dtype, &inputs[rank]);
                comm.all_reduce(&mut b, op).await?;
                Ok(bytes_of(b.tensor()))
            }
        });
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.map_err(|e| TestCaseError::fail(format!("rank {rank}: {e}")))?;
            prop_assert!(got == expect, "rank {} differs from the reference", rank);
        }
    }

    #[test]
    fn reduce_scatter_equals_the_serial_reference_bitwise(
        p in 1usize..=MAX_RANKS,
        n in 0usize..400,
        dtype in arb_dtype(),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
        algorithm in arb_algorithm(),
        chunk in arb_chunk(),
        seed in any::<u64>(),
    ) {
        let op = usable(op, dtype);
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, n * p, seed ^ (r as u64) << 32)).collect();
        let full = reference_all_reduce(&inputs, dtype, op, algorithm);
        let inputs = Arc::new(inputs);
        let results = run_group(p, config(algorithm, chunk), move |rank, mut comm| {
            let inputs = inputs.clone();
            async move {
                let m = comm.transport().buffers().clone();
                let b = buffer_with(&m, dtype, &inputs[rank]);
                let mut out = Tensor::zeros([n as i64], (dtype.kind(), tch::Device::Cpu));
                comm.reduce_scatter(&b, &mut out, op).await?;
                // The input is not modified.
                assert_eq!(bytes_of(b.tensor()), inputs[rank]);
                Ok(bytes_of(&out))
            }
        });
        let elem = dtype.size_bytes();
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.map_err(|e| TestCaseError::fail(format!("rank {rank}: {e}")))?;
            prop_assert!(got[..] == full[rank * n * elem..(rank + 1) * n * elem], "rank {}", rank);
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order(
        p in 1usize..=MAX_RANKS,
        n in 0usize..700,
        dtype in arb_dtype(),
        algorithm in arb_algorithm(),
        chunk in arb_chunk(),
        seed in any::<u64>(),
    ) {
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, n, seed + 7 * r as u64)).collect();
        let expect: Vec<u8> = inputs.concat();
        let inputs = Arc::new(inputs);
        let results = run_group(p, config(algorithm, chunk), move |rank, mut comm| {
            let inputs = inputs.clone();
            async move {
                let m = comm.transport().buffers().clone();
                let mut out = TensorBuffer::zeros(&m, dtype, &[(n * p) as u64]).unwrap();
                comm.all_gather(&tensor_of(dtype, &inputs[rank]), &mut out).await?;
                Ok(bytes_of(out.tensor()))
            }
        });
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.map_err(|e| TestCaseError::fail(format!("rank {rank}: {e}")))?;
            prop_assert!(got == expect, "rank {}", rank);
        }
    }

    #[test]
    fn broadcast_copies_the_roots_tensor(
        p in 1usize..=MAX_RANKS,
        numel in 0usize..1500,
        root in 0usize..MAX_RANKS,
        dtype in arb_dtype(),
        algorithm in arb_algorithm(),
        chunk in arb_chunk(),
        seed in any::<u64>(),
    ) {
        let root = root % p;
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, numel, seed + r as u64)).collect();
        let expect = inputs[root].clone();
        let inputs = Arc::new(inputs);
        let results = run_group(p, config(algorithm, chunk), move |rank, mut comm| {
            let inputs = inputs.clone();
            async move {
                let m = comm.transport().buffers().clone();
                let mut b = buffer_with(&m, dtype, &inputs[rank]);
                comm.broadcast(&mut b, root).await?;
                Ok(bytes_of(b.tensor()))
            }
        });
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.map_err(|e| TestCaseError::fail(format!("rank {rank}: {e}")))?;
            prop_assert!(got == expect, "rank {}", rank);
        }
    }
}

/// The exact algorithms fold in rank order for every group size: on data
/// where the order of a float sum changes its bits (checked), every member
/// gets exactly the rank-order fold.
#[test]
fn exact_algorithms_fold_in_rank_order_for_every_group_size() {
    for p in 2..=MAX_RANKS {
        let numel = 3001;
        let inputs: Vec<Vec<u8>> = (0..p)
            .map(|r| data(DType::F32, numel, 1000 + r as u64))
            .collect();
        let refs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
        let expect = crate::serial_fold(ReduceOp::Sum, DType::F32, &refs).unwrap();
        if p >= 3 {
            let mut other: Vec<&[u8]> = refs.clone();
            other.swap(p - 1, p - 2);
            let swapped = crate::serial_fold(ReduceOp::Sum, DType::F32, &other).unwrap();
            assert!(
                swapped != expect,
                "p {p}: the data does not tell orders apart"
            );
        }
        for algorithm in [Algorithm::Inline, Algorithm::Direct] {
            let inputs = Arc::new(inputs.clone());
            let results = run_group(p, config(algorithm, 64), move |rank, mut comm| {
                let inputs = inputs.clone();
                async move {
                    let m = comm.transport().buffers().clone();
                    let mut b = buffer_with(&m, DType::F32, &inputs[rank]);
                    comm.all_reduce(&mut b, ReduceOp::Sum).await?;
                    Ok(bytes_of(b.tensor()))
                }
            });
            for (rank, r) in results.into_iter().enumerate() {
                assert!(r.unwrap() == expect, "p {p} {algorithm:?}: rank {rank}");
            }
        }
    }
}

#[test]
fn auto_picks_inline_for_small_tensors_and_direct_otherwise_and_results_repeat() {
    // The same group and inputs, twice, through Auto: identical bits, and
    // equal to the rank-order fold (exact by default).
    let p = 4;
    let numel = 100_003; // not divisible by 4, and above the inline limit
    let inputs: Vec<Vec<u8>> = (0..p)
        .map(|r| data(DType::F32, numel, 99 + r as u64))
        .collect();
    let refs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
    let expect = crate::serial_fold(ReduceOp::Sum, DType::F32, &refs).unwrap();
    let inputs = Arc::new(inputs);
    for _ in 0..2 {
        let inputs = inputs.clone();
        let results = run_group(p, CollectiveConfig::default(), move |rank, mut comm| {
            let inputs = inputs.clone();
            async move {
                assert!(comm.one_host());
                assert_eq!(comm.choose(100)?, Algorithm::Inline);
                assert_eq!(comm.choose(1 << 20)?, Algorithm::Direct);
                let m = comm.transport().buffers().clone();
                let mut b = buffer_with(&m, DType::F32, &inputs[rank]);
                comm.all_reduce(&mut b, ReduceOp::Sum).await?;
                // A second collective on the same communicator.
                comm.barrier().await?;
                Ok(bytes_of(b.tensor()))
            }
        });
        for r in results {
            assert!(r.unwrap() == expect);
        }
    }
}

#[test]
fn an_f32_slice_reduces_as_its_tensor_does() {
    let p = 4;
    let results = run_group(
        p,
        config(Algorithm::Auto, 4096),
        move |rank, mut comm| async move {
            // Empty, small (inline) and large (direct), with a NaN in one.
            for numel in [0usize, 10, 50_000] {
                let bytes = data(DType::F32, numel, rank as u64);
                let mut v: Vec<f32> = bytes
                    .chunks(4)
                    .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
                    .collect();
                if rank == 2 && numel > 0 {
                    v[numel / 2] = f32::NAN;
                }
                let mut t = Tensor::from_slice(&v);
                comm.all_reduce_f32(&mut v, ReduceOp::Sum).await?;
                comm.all_reduce_tensor(&mut t, ReduceOp::Sum).await?;
                let got: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
                assert!(
                    got == bytes_of(&t),
                    "{numel} elements differ from the tensor's"
                );
                let ins: Vec<Vec<u8>> = (0..p)
                    .map(|r| {
                        let mut d = data(DType::F32, numel, r as u64);
                        if r == 2 && numel > 0 {
                            d[numel / 2 * 4..numel / 2 * 4 + 4]
                                .copy_from_slice(&f32::NAN.to_ne_bytes());
                        }
                        d
                    })
                    .collect();
                let refs: Vec<&[u8]> = ins.iter().map(|v| &v[..]).collect();
                assert!(got == crate::serial_fold(ReduceOp::Sum, DType::F32, &refs)?);
            }
            Ok(vec![])
        },
    );
    for r in results {
        r.unwrap();
    }
}

#[test]
fn plain_tensors_point_to_point_and_barriers() {
    let p = 3;
    let results = run_group(
        p,
        config(Algorithm::Auto, 4096),
        move |rank, mut comm| async move {
            let m = comm.transport().buffers().clone();
            // A staged all-reduce of a plain tensor, small (inline) and large.
            for numel in [10usize, 50_000] {
                let mut t = tensor_of(DType::F64, &data(DType::F64, numel, rank as u64));
                comm.all_reduce_tensor(&mut t, ReduceOp::Mean).await?;
                let ins: Vec<Vec<u8>> = (0..p).map(|r| data(DType::F64, numel, r as u64)).collect();
                let refs: Vec<&[u8]> = ins.iter().map(|v| &v[..]).collect();
                assert!(bytes_of(&t) == crate::serial_fold(ReduceOp::Mean, DType::F64, &refs)?);
            }
            // Send / receive around the ring, small and large.
            for numel in [7usize, 40_000] {
                let mine = buffer_with(&m, DType::I32, &data(DType::I32, numel, 10 + rank as u64));
                let mut got = TensorBuffer::zeros(&m, DType::I32, &[numel as u64]).unwrap();
                let (to, from) = ((rank + 1) % p, (rank + p - 1) % p);
                if rank % 2 == 0 {
                    comm.send(&mine, to).await?;
                    comm.recv(&mut got, from).await?;
                } else {
                    comm.recv(&mut got, from).await?;
                    comm.send(&mine, to).await?;
                }
                assert_eq!(
                    bytes_of(got.tensor()),
                    data(DType::I32, numel, 10 + from as u64)
                );
            }
            comm.barrier().await?;
            Ok(vec![])
        },
    );
    for r in results {
        r.unwrap();
    }
}

#[test]
fn across_hosts_over_tcp_the_ring_is_chosen_in_non_exact_mode() {
    let h = harness();
    // Managers that look like separate hosts and reach each other by tcp.
    let configs = (0..3u8)
        .map(|i| {
            ManagerConfig::default()
                .host(Some(HostId([i + 1; 16])))
                .backend(BackendPolicy::Only(BackendKind::Tcp))
        })
        .collect();
    let managers = h.rt.block_on(local_managers_with(configs)).unwrap();
    let numel = 30_001;
    let inputs: Vec<Vec<u8>> = (0..3)
        .map(|r| data(DType::F32, numel, 5 + r as u64))
        .collect();
    for (exact, algorithm) in [(false, Algorithm::Ring), (true, Algorithm::Direct)] {
        let expect = reference_all_reduce(&inputs, DType::F32, ReduceOp::Sum, algorithm);
        let results: Vec<RankResult> = h.rt.block_on(async {
            let (_g, ts) = LocalGroup::new(managers.clone());
            let tasks: Vec<_> = ts
                .into_iter()
                .enumerate()
                .map(|(rank, t)| {
                    let input = inputs[rank].clone();
                    tokio::spawn(async move {
                        let cfg = CollectiveConfig::default().exact(exact);
                        let mut comm = Communicator::new(t, cfg).await?;
                        assert!(!comm.one_host());
                        assert_eq!(comm.choose(1 << 20)?, algorithm);
                        let m = comm.transport().buffers().clone();
                        let mut b = buffer_with(&m, DType::F32, &input);
                        comm.all_reduce(&mut b, ReduceOp::Sum).await?;
                        Ok(bytes_of(b.tensor()))
                    })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        for r in results {
            assert!(r.unwrap() == expect, "{algorithm:?}");
        }
    }
}

#[test]
fn members_that_disagree_are_told_so_quickly() {
    // Rank 1 all-reduces a shorter tensor: every member fails with an
    // error naming it, long before the timeout.
    let started = std::time::Instant::now();
    // Members keep their communicators until all have failed (a member
    // that left would be reported gone instead).
    let all_failed = Arc::new(tokio::sync::Barrier::new(3));
    let results = run_group(3, config(Algorithm::Direct, 4096), move |rank, mut comm| {
        let all_failed = all_failed.clone();
        async move {
            let m = comm.transport().buffers().clone();
            let n = if rank == 1 { 900 } else { 1000 };
            let mut b = buffer_with(&m, DType::F32, &data(DType::F32, n, 1));
            let e = comm.all_reduce(&mut b, ReduceOp::Sum).await.unwrap_err();
            // Broken now.
            let again = comm.barrier().await.unwrap_err();
            assert!(matches!(again, Error::Broken(_)), "{again}");
            all_failed.wait().await;
            Err(e)
        }
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    for (rank, r) in results.into_iter().enumerate() {
        let e = r.unwrap_err();
        let blamed = if rank == 1 { 0 } else { 1 };
        // Rank 1 blames whoever it compared with first; the others blame 1.
        if rank != 1 {
            assert_eq!(e.culprit(), Some(blamed), "rank {rank}: {e}");
        }
        assert!(
            matches!(e, Error::Mismatch { .. } | Error::Aborted { .. }),
            "rank {rank}: {e}"
        );
    }
    // Settings that differ are refused at the start.
    let h = harness();
    let errs: Vec<Result<(), Error>> = h.rt.block_on(async {
        let (_g, ts) = LocalGroup::new(h.managers[..2].to_vec());
        let tasks: Vec<_> = ts
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                tokio::spawn(async move {
                    let chunk = if rank == 0 { 64 } else { 128 };
                    Communicator::new(t, config(Algorithm::Direct, chunk))
                        .await
                        .map(|_| ())
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    for e in errs {
        assert!(matches!(e, Err(Error::Mismatch { .. })), "{e:?}");
    }
}

/// How the faulty member fails after its allowed sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// It dies: the transport reports it to everyone, and it stops.
    Kill,
    /// It stops sending and never returns (as under SIGSTOP, with its
    /// memory still readable); nobody reports it.
    Silence,
    /// It stops as with `Silence`, and the transport's failure detector
    /// reports it after this long (as a mesh's heartbeats would).
    SilenceDetected(Duration),
}

/// A transport that fails after a number of sends.
struct Faulty {
    inner: LocalTransport,
    group: LocalGroup,
    sends_left: AtomicUsize,
    sent: Arc<AtomicUsize>,
    fault: Fault,
}

impl Transport for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
    fn buffers(&self) -> &BufferManager {
        self.inner.buffers()
    }
    fn failure(&self) -> Option<(usize, String)> {
        self.inner.failure()
    }
    async fn send(&self, to: usize, msg: Bytes) -> Result<(), TransportError> {
        let left = self.sends_left.load(Ordering::SeqCst);
        if left == 0 {
            match self.fault {
                Fault::Kill => {
                    self.group.fail(self.rank(), "killed by the test");
                    return Err(TransportError::Closed("killed".into()));
                }
                Fault::Silence => std::future::pending::<()>().await,
                Fault::SilenceDetected(after) => {
                    let (group, rank) = (self.group.clone(), self.rank());
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        group.fail(rank, "no heartbeat (detected by the test)");
                    });
                    std::future::pending::<()>().await
                }
            }
        }
        self.sends_left.store(left - 1, Ordering::SeqCst);
        self.sent.fetch_add(1, Ordering::SeqCst);
        self.inner.send(to, msg).await
    }
    async fn recv(&self, from: usize, deadline: Instant) -> Result<Bytes, TransportError> {
        self.inner.recv(from, deadline).await
    }
}

#[derive(Clone, Copy, Debug)]
enum Which {
    AllReduce,
    AllGather,
    Broadcast,
}

struct Outcome {
    /// The survivors' results (`None` for the faulty rank).
    results: Vec<Option<RankResult>>,
    /// When the last survivor returned.
    elapsed: Duration,
    /// Sends the faulty rank made after the hello exchange.
    sent: usize,
}

/// What a rank keeps until every survivor has returned: a member that gave
/// up keeps its communicator and tensor (as its caller would until it
/// handles the error), so peers still see it as the process it is.
type Kept = Box<dyn Send>;

/// Runs `which` on 4 ranks where rank `bad` fails after `cut` sends (the
/// hello exchange not counted). With `keep`, survivors keep their
/// communicator and tensor until all have returned; without, they drop
/// them at once (their peers then find their memory released).
#[allow(clippy::too_many_arguments)]
fn run_faulty(
    which: Which,
    algorithm: Algorithm,
    fault: Fault,
    bad: usize,
    cut: usize,
    timeout: Duration,
    inputs: &Arc<Vec<Vec<u8>>>,
    keep: bool,
) -> Outcome {
    let h = harness();
    let p = 4;
    let n = inputs[0].len() / 4 / p;
    let sent = Arc::new(AtomicUsize::new(0));
    h.rt.block_on(async {
        let (group, ts) = LocalGroup::new(h.managers[..p].to_vec());
        let started = Instant::now();
        let mut tasks = Vec::new();
        for (rank, t) in ts.into_iter().enumerate() {
            let inputs = inputs.clone();
            // The faulty rank waits far longer: a stopped process does not
            // give up on its own.
            let cfg =
                config(algorithm, 64).timeout(if rank == bad { timeout * 20 } else { timeout });
            let transport = Faulty {
                inner: t,
                group: group.clone(),
                // The hello exchange: 3 sends.
                sends_left: AtomicUsize::new(if rank == bad {
                    cut.saturating_add(3)
                } else {
                    usize::MAX
                }),
                sent: if rank == bad {
                    sent.clone()
                } else {
                    Arc::new(AtomicUsize::new(0))
                },
                fault,
            };
            tasks.push(tokio::spawn(async move {
                let mut comm = match Communicator::new(transport, cfg).await {
                    Ok(c) => c,
                    Err(e) => return (Err(e), Box::new(()) as Kept),
                };
                let m = comm.transport().buffers().clone();
                let (r, b) = match which {
                    Which::AllReduce => {
                        let mut b = buffer_with(&m, DType::F32, &inputs[rank]);
                        let r = comm.all_reduce(&mut b, ReduceOp::Sum).await;
                        (r, b)
                    }
                    Which::AllGather => {
                        let mut out =
                            TensorBuffer::zeros(&m, DType::F32, &[(n * p) as u64]).unwrap();
                        let input = tensor_of(DType::F32, &inputs[rank][..n * 4]);
                        let r = comm.all_gather(&input, &mut out).await;
                        (r, out)
                    }
                    Which::Broadcast => {
                        let mut b = buffer_with(&m, DType::F32, &inputs[rank]);
                        let r = comm.broadcast(&mut b, 0).await;
                        (r, b)
                    }
                };
                let r = r.map(|()| bytes_of(b.tensor()));
                if keep {
                    (r, Box::new((comm, b)) as Kept)
                } else {
                    (r, Box::new(()) as Kept)
                }
            }));
        }
        // Abort the faulty rank's task on every path (it may hang forever).
        struct AbortOnDrop(tokio::task::AbortHandle);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let _guard = AbortOnDrop(tasks[bad].abort_handle());
        let mut results = Vec::new();
        let mut kept = Vec::new();
        let mut elapsed = Duration::ZERO;
        for (rank, t) in tasks.into_iter().enumerate() {
            if rank == bad {
                results.push(None);
                continue;
            }
            let (r, k) = tokio::time::timeout(timeout * 3 + Duration::from_secs(5), t)
                .await
                .unwrap_or_else(|_| {
                    panic!("rank {rank} hung ({which:?} {algorithm:?} {fault:?} cut {cut})")
                })
                .unwrap();
            elapsed = started.elapsed();
            results.push(Some(r));
            kept.push(k);
        }
        Outcome {
            results,
            elapsed,
            // Not counting the hello exchange.
            sent: sent.load(Ordering::SeqCst).saturating_sub(3),
        }
    })
}

/// Inputs of 1001 f32 per rank, and what every rank must end with.
fn fault_inputs(which: Which, algorithm: Algorithm) -> (Arc<Vec<Vec<u8>>>, Vec<Vec<u8>>) {
    let p = 4;
    let numel = 1001;
    let inputs: Vec<Vec<u8>> = (0..p)
        .map(|r| data(DType::F32, numel, 40 + r as u64))
        .collect();
    let expect = match which {
        Which::AllReduce => {
            vec![reference_all_reduce(&inputs, DType::F32, ReduceOp::Sum, algorithm); p]
        }
        Which::AllGather => {
            let n = numel / p;
            vec![inputs.iter().flat_map(|v| v[..n * 4].to_vec()).collect(); p]
        }
        Which::Broadcast => vec![inputs[0].clone(); p],
    };
    (Arc::new(inputs), expect)
}

/// The number of sends the faulty rank makes when nothing fails (and a
/// check that then everyone gets the expected result).
fn sends_of(which: Which, algorithm: Algorithm, bad: usize) -> usize {
    let (inputs, expect) = fault_inputs(which, algorithm);
    let o = run_faulty(
        which,
        algorithm,
        Fault::Kill,
        bad,
        usize::MAX,
        Duration::from_secs(20),
        &inputs,
        true,
    );
    for (rank, r) in o.results.into_iter().enumerate() {
        if let Some(r) = r {
            assert!(r.unwrap() == expect[rank]);
        }
    }
    o.sent
}

/// Checks one outcome: every survivor returned the complete, correct
/// result, or an error that `blame` accepts. Returns how many failed.
fn check_outcome(
    o: Outcome,
    expect: &[Vec<u8>],
    what: &str,
    blame: impl Fn(&Error) -> bool,
) -> usize {
    let mut failed = 0;
    for (rank, r) in o.results.into_iter().enumerate() {
        match r {
            None => {}
            Some(Ok(got)) => assert!(
                got == expect[rank],
                "{what}: rank {rank} returned a wrong result as complete"
            ),
            Some(Err(e)) => {
                failed += 1;
                assert!(blame(&e), "{what}: rank {rank}: {e}");
            }
        }
    }
    failed
}

/// A member killed at any point of the protocol: every survivor either
/// fails with an error naming it or returns the complete, correct result,
/// and does so promptly (the transport reports the death).
#[test]
fn a_killed_member_fails_every_survivors_collective_naming_it_at_every_point() {
    let timeout = Duration::from_secs(20);
    let bad = 2;
    for which in [Which::AllReduce, Which::AllGather, Which::Broadcast] {
        for algorithm in [Algorithm::Inline, Algorithm::Direct, Algorithm::Ring] {
            let total = sends_of(which, algorithm, bad);
            let (inputs, expect) = fault_inputs(which, algorithm);
            let mut failed = 0;
            for cut in 0..=total {
                // Survivors that drop their tensors at once release memory
                // others may still read: the error still names the dead.
                for keep in [true, false] {
                    let what = format!("{which:?} {algorithm:?} cut {cut}/{total} keep {keep}");
                    let o = run_faulty(
                        which,
                        algorithm,
                        Fault::Kill,
                        bad,
                        cut,
                        timeout,
                        &inputs,
                        keep,
                    );
                    assert!(o.elapsed < timeout / 2, "{what}: waited {:?}", o.elapsed);
                    failed += check_outcome(o, &expect, &what, |e| e.culprit() == Some(bad));
                }
            }
            // (A non-root sends nothing in an inline broadcast.)
            assert!(
                failed > 0 || total == 0,
                "{which:?} {algorithm:?}: no cut made anyone fail"
            );
        }
    }
}

/// A member that stops (memory still readable, as under SIGSTOP) and that
/// the transport's failure detector reports after a while: every survivor
/// fails naming it within about that time, well before the timeout.
#[test]
fn a_stopped_member_fails_every_survivor_once_the_transport_detects_it() {
    let timeout = Duration::from_secs(30);
    let detect = Duration::from_millis(300);
    let bad = 1;
    for which in [Which::AllReduce, Which::Broadcast] {
        for algorithm in [Algorithm::Inline, Algorithm::Direct, Algorithm::Ring] {
            let total = sends_of(which, algorithm, bad);
            let (inputs, expect) = fault_inputs(which, algorithm);
            let cuts: Vec<usize> = if total <= 16 {
                (0..total).collect()
            } else {
                vec![0, 1, total / 3, total / 2, total - 1]
            };
            for cut in cuts {
                let what = format!("{which:?} {algorithm:?} cut {cut}/{total}");
                let fault = Fault::SilenceDetected(detect);
                let o = run_faulty(which, algorithm, fault, bad, cut, timeout, &inputs, true);
                assert!(
                    o.elapsed < detect + Duration::from_secs(5),
                    "{what}: {:?}",
                    o.elapsed
                );
                check_outcome(
                    o,
                    &expect,
                    &what,
                    |e| matches!(e, Error::PeerFailed { rank, .. } if *rank == bad),
                );
            }
        }
    }
}

/// A member that goes silent and that nobody reports: every survivor
/// fails by the deadline (never hangs, never returns a wrong result); with
/// the direct and inline algorithms the silent rank is among those the
/// timeout names.
#[test]
fn an_unreported_silent_member_fails_every_survivor_by_the_deadline() {
    let timeout = Duration::from_millis(1500);
    let bad = 2;
    for (which, algorithm) in [
        (Which::AllReduce, Algorithm::Direct),
        (Which::AllReduce, Algorithm::Inline),
        (Which::AllGather, Algorithm::Direct),
        (Which::AllReduce, Algorithm::Ring),
        (Which::Broadcast, Algorithm::Ring),
    ] {
        let total = sends_of(which, algorithm, bad);
        let (inputs, expect) = fault_inputs(which, algorithm);
        let cuts: Vec<usize> = if total <= 16 {
            (0..total).collect()
        } else {
            vec![0, 1, total / 3, total / 2, total - 2, total - 1]
        };
        for cut in cuts {
            let what = format!("{which:?} {algorithm:?} cut {cut}/{total}");
            let o = run_faulty(
                which,
                algorithm,
                Fault::Silence,
                bad,
                cut,
                timeout,
                &inputs,
                true,
            );
            assert!(o.elapsed < timeout * 2, "{what}: {:?}", o.elapsed);
            check_outcome(o, &expect, &what, |e| match e {
                Error::Timeout { waiting_for, .. } => {
                    algorithm == Algorithm::Ring || waiting_for.contains(&bad)
                }
                _ => false,
            });
        }
    }
}

#[test]
fn after_a_failure_the_next_generation_works() {
    // Rank 3 dies mid-all-reduce, after its `Ready`s and before any
    // `Done` (which every survivor needs from it); the survivors build a
    // group of three (the next generation, over the same managers) and
    // all-reduce again.
    let (inputs, _) = fault_inputs(Which::AllReduce, Algorithm::Direct);
    let o = run_faulty(
        Which::AllReduce,
        Algorithm::Direct,
        Fault::Kill,
        3,
        3,
        Duration::from_secs(20),
        &inputs,
        true,
    );
    assert!(o.results[..3].iter().all(|r| matches!(r, Some(Err(_)))));
    let survivors: Vec<Vec<u8>> = inputs[..3].to_vec();
    let refs: Vec<&[u8]> = survivors.iter().map(|v| &v[..]).collect();
    let expect = crate::serial_fold(ReduceOp::Sum, DType::F32, &refs).unwrap();
    let survivors = Arc::new(survivors);
    let results = run_group(3, config(Algorithm::Direct, 64), move |rank, mut comm| {
        let s = survivors.clone();
        async move {
            let m = comm.transport().buffers().clone();
            let mut b = buffer_with(&m, DType::F32, &s[rank]);
            comm.all_reduce(&mut b, ReduceOp::Sum).await?;
            Ok(bytes_of(b.tensor()))
        }
    });
    for r in results {
        assert!(r.unwrap() == expect);
    }
}

/// A transport whose receives can be slowed or made to fail.
struct Scripted {
    inner: LocalTransport,
    /// Delay the first receive from this rank.
    slow_first_from: Option<(usize, Duration)>,
    /// Fail the n-th receive (counting from 1, the hello included) from
    /// this rank.
    fail_nth_from: Option<(usize, usize)>,
    received: Vec<AtomicUsize>,
}

impl Transport for Scripted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
    fn buffers(&self) -> &BufferManager {
        self.inner.buffers()
    }
    fn failure(&self) -> Option<(usize, String)> {
        self.inner.failure()
    }
    async fn send(&self, to: usize, msg: Bytes) -> Result<(), TransportError> {
        self.inner.send(to, msg).await
    }
    async fn recv(&self, from: usize, deadline: Instant) -> Result<Bytes, TransportError> {
        let n = self.received[from].fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_nth_from == Some((from, n)) {
            return Err(TransportError::Closed("failed by the test".into()));
        }
        let m = self.inner.recv(from, deadline).await?;
        if let Some((r, d)) = self.slow_first_from
            && r == from
            && n == 2
        {
            tokio::time::sleep(d).await;
        }
        Ok(m)
    }
}

/// The Done/Ack exchange: rank 0 gives up near its end (a receive from
/// rank 2 fails) and at once overwrites its tensor, while rank 1, slowed
/// down, has not read rank 0's part yet. Rank 1 reads the overwritten
/// bytes, but must not return them as a complete result: rank 0 never
/// acknowledged its read.
#[test]
fn a_member_that_gives_up_early_cannot_make_a_peer_return_torn_data() {
    let h = harness();
    let p = 3;
    let n = 500;
    let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(DType::F32, n, 70 + r as u64)).collect();
    let expect: Vec<u8> = inputs.concat();
    let results: Vec<RankResult> = h.rt.block_on(async {
        let (_g, ts) = LocalGroup::new(h.managers[..p].to_vec());
        let tasks: Vec<_> = ts
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let input = inputs[rank].clone();
                let t = Scripted {
                    inner: t,
                    // Rank 1 reads rank 0's part 300 ms late.
                    slow_first_from: (rank == 1).then_some((0, Duration::from_millis(300))),
                    // Rank 0's 3rd receive from rank 2 (hello, Ready, Done)
                    // fails, after it sent its Done to everyone.
                    fail_nth_from: (rank == 0).then_some((2, 3)),
                    received: (0..p).map(|_| AtomicUsize::new(0)).collect(),
                };
                tokio::spawn(async move {
                    let cfg = config(Algorithm::Direct, 64).timeout(Duration::from_secs(3));
                    let mut comm = Communicator::new(t, cfg).await?;
                    let m = comm.transport().buffers().clone();
                    let mut out = TensorBuffer::zeros(&m, DType::F32, &[(n * p) as u64]).unwrap();
                    let r = comm
                        .all_gather(&tensor_of(DType::F32, &input), &mut out)
                        .await;
                    if r.is_err() {
                        // Gave up: the tensor is the caller's again. The
                        // member stays (its communicator too) for a while.
                        let _ = out.tensor_mut().fill_(777.0);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    r?;
                    Ok(bytes_of(out.tensor()))
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    assert!(results[0].is_err(), "rank 0 was made to fail");
    for (rank, r) in results.into_iter().enumerate() {
        if let Ok(got) = r {
            assert!(got == expect, "rank {rank} returned torn data as complete");
        }
    }
}

/// The block of a global tensor, contiguous.
fn block_of(global: &Tensor, b: &crate::reshard::Block) -> Tensor {
    let mut t = global.shallow_clone();
    for (d, (&o, &n)) in b.offset.iter().zip(&b.shape).enumerate() {
        t = t.narrow(d as i64, o as i64, n as i64);
    }
    t.contiguous()
}

/// Runs `plan` over a group of `g` ranks with global tensors `globals`
/// (one per tensor of the plan) and checks every destination's shards
/// bit for bit against the global tensors' blocks.
fn check_reshard(g: usize, plan: crate::ReshardPlan, globals: Vec<Tensor>) {
    let want: Vec<Vec<Vec<u8>>> = plan
        .dst_ranks
        .iter()
        .enumerate()
        .map(|(d, _)| {
            plan.tensors
                .iter()
                .zip(&globals)
                .map(|(t, x)| bytes_of(&block_of(x, &t.dst.block(&t.shape, d).unwrap())))
                .collect()
        })
        .collect();
    let src_blocks: Vec<Vec<Vec<u8>>> = plan
        .src_ranks
        .iter()
        .enumerate()
        .map(|(s, _)| {
            plan.tensors
                .iter()
                .zip(&globals)
                .map(|(t, x)| bytes_of(&block_of(x, &t.src.block(&t.shape, s).unwrap())))
                .collect()
        })
        .collect();
    let plan = Arc::new(plan);
    let src_blocks = Arc::new(src_blocks);
    let p2 = plan.clone();
    let results = run_group(g, config(Algorithm::Auto, 64), move |rank, mut comm| {
        let (plan, src_blocks) = (p2.clone(), src_blocks.clone());
        async move {
            let m = comm.transport().buffers().clone();
            let s = plan.src_ranks.iter().position(|&x| x == rank);
            let d = plan.dst_ranks.iter().position(|&x| x == rank);
            let sources: Vec<TensorBuffer> = match s {
                Some(s) => plan
                    .tensors
                    .iter()
                    .zip(&src_blocks[s])
                    .map(|(t, bytes)| {
                        let shape = t.src_shape(s).unwrap();
                        let b = TensorBuffer::zeros(&m, t.dtype, &shape).unwrap();
                        let mut b = b;
                        let src = tensor_of(t.dtype, bytes)
                            .reshape(shape.iter().map(|&x| x as i64).collect::<Vec<_>>());
                        b.tensor_mut().copy_(&src);
                        b
                    })
                    .collect(),
                None => Vec::new(),
            };
            let mut dests: Vec<TensorBuffer> = match d {
                Some(d) => plan
                    .tensors
                    .iter()
                    .map(|t| TensorBuffer::zeros(&m, t.dtype, &t.dst_shape(d).unwrap()).unwrap())
                    .collect(),
                None => Vec::new(),
            };
            // (`&TensorBuffer` is not `Send`: the references go before the
            // await; the future keeps the sources borrowed.)
            let run = {
                let refs: Vec<&TensorBuffer> = sources.iter().collect();
                comm.reshard(&plan, &refs, &mut dests)
            };
            run.await?;
            // The sources are unchanged.
            if let Some(s) = s {
                for (b, bytes) in sources.iter().zip(&src_blocks[s]) {
                    assert!(bytes_of(b.tensor()) == *bytes);
                }
            }
            Ok(dests.iter().flat_map(|b| bytes_of(b.tensor())).collect())
        }
    });
    for (rank, r) in results.into_iter().enumerate() {
        let got = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        match plan.dst_ranks.iter().position(|&x| x == rank) {
            Some(d) => assert!(got == want[d].concat(), "destination rank {rank} differs"),
            None => assert!(got.is_empty()),
        }
    }
}

fn global(dtype: DType, shape: &[u64], seed: u64) -> Tensor {
    let n: u64 = shape.iter().product();
    tensor_of(dtype, &data(dtype, n as usize, seed))
        .reshape(shape.iter().map(|&x| x as i64).collect::<Vec<_>>())
}

#[test]
fn reshard_rows_over_four_trainers_to_columns_over_two_readers() {
    use crate::{Sharding, plan_tensor};
    let shapes = [vec![64u64, 30], vec![7, 5]];
    let dtypes = [DType::F32, DType::I64];
    let tensors = shapes
        .iter()
        .zip(dtypes)
        .enumerate()
        .map(|(i, (s, dt))| {
            plan_tensor(
                &format!("w{i}"),
                dt,
                s,
                &Sharding::split(4, 0).unwrap(),
                &Sharding::split(2, 1).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let plan = crate::ReshardPlan::new(tensors, vec![0, 1, 2, 3], vec![4, 5]).unwrap();
    let globals = shapes
        .iter()
        .zip(dtypes)
        .map(|(s, dt)| global(dt, s, 3))
        .collect();
    check_reshard(6, plan, globals);
}

#[test]
fn reshard_sharded_to_replicated_and_back_on_the_same_members() {
    use crate::{Sharding, plan_tensor};
    let shape = [33u64, 17];
    let x = global(DType::BF16, &shape, 11);
    let there = plan_tensor(
        "w",
        DType::BF16,
        &shape,
        &Sharding::split(4, 0).unwrap(),
        &Sharding::replicated(4).unwrap(),
    )
    .unwrap();
    check_reshard(
        4,
        crate::ReshardPlan::new(vec![there], vec![0, 1, 2, 3], vec![0, 1, 2, 3]).unwrap(),
        vec![x.shallow_clone()],
    );
    let back = plan_tensor(
        "w",
        DType::BF16,
        &shape,
        &Sharding::replicated(4).unwrap(),
        &Sharding::split(4, 1).unwrap(),
    )
    .unwrap();
    check_reshard(
        4,
        crate::ReshardPlan::new(vec![back], vec![0, 1, 2, 3], vec![3, 2, 1, 0]).unwrap(),
        vec![x],
    );
}

#[test]
fn reshard_from_a_two_by_two_mesh_to_overlapping_members() {
    use crate::{Placement, Sharding, plan_tensor};
    let shape = [10u64, 9, 3];
    let src = Sharding::new(vec![2, 2], vec![Placement::Shard(0), Placement::Shard(1)]).unwrap();
    let dst = Sharding::new(vec![3], vec![Placement::Shard(2)]).unwrap();
    let t = plan_tensor("w", DType::F16, &shape, &src, &dst).unwrap();
    let plan = crate::ReshardPlan::new(vec![t], vec![0, 1, 2, 3], vec![2, 3, 4]).unwrap();
    check_reshard(5, plan, vec![global(DType::F16, &shape, 5)]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Random shardings, members and overlaps: destinations end with
    /// exactly the global tensor's blocks.
    #[test]
    fn reshards_are_bit_exact(
        shape in prop::collection::vec(0u64..12, 1..4),
        src_mesh in prop::collection::vec((1usize..3, any::<bool>(), 0usize..3), 1..3),
        dst_mesh in prop::collection::vec((1usize..3, any::<bool>(), 0usize..3), 1..3),
        perm in Just(()).prop_perturb(|_, mut rng| {
            let mut v: Vec<usize> = (0..MANAGERS).collect();
            for i in (1..v.len()).rev() {
                v.swap(i, (rng.next_u32() as usize) % (i + 1));
            }
            v
        }),
        seed in any::<u64>(),
    ) {
        use crate::{Placement, Sharding, plan_tensor};
        let sharding = |m: &[(usize, bool, usize)]| {
            let (mesh, placements): (Vec<usize>, Vec<Placement>) = m
                .iter()
                .map(|&(n, shard, d)| (n, if shard { Placement::Shard(d % shape.len()) } else { Placement::Replicate }))
                .unzip();
            Sharding::new(mesh, placements).unwrap()
        };
        let (src, dst) = (sharding(&src_mesh), sharding(&dst_mesh));
        prop_assume!(src.size() <= 4 && dst.size() <= 4);
        let src_ranks: Vec<usize> = perm[..src.size()].to_vec();
        let dst_ranks: Vec<usize> = perm[MANAGERS - dst.size()..].to_vec();
        let g = src_ranks.iter().chain(&dst_ranks).max().unwrap() + 1;
        let t = plan_tensor("w", DType::F32, &shape, &src, &dst).unwrap();
        let plan = crate::ReshardPlan::new(vec![t], src_ranks, dst_ranks).unwrap();
        check_reshard(g, plan, vec![global(DType::F32, &shape, seed)]);
    }
}

/// Rank 3 of an all-reduce is a zombie: it answers the survivors' `Ready`s
/// with its own, so they reduce and spread their chunks, but it never sends
/// `Done`, and acts only after every survivor's all-reduce has failed. With
/// `stall`, it is caught inside a copy into rank 0 (a stopped process)
/// when they fail. Returns the survivors' results, their buffers' bytes
/// right after their failure and after the zombie acted, and whether
/// each buffer is poisoned.
fn zombie_after_a_failed_all_reduce(stall: bool) -> Vec<(RankResult, Vec<u8>, Vec<u8>, bool)> {
    let h = harness();
    let p = 4;
    let n = 3000;
    let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(DType::F32, n, 70 + r as u64)).collect();
    h.rt.block_on(async {
        let (_group, ts) = LocalGroup::new(h.managers[..p].to_vec());
        let mut ts = ts.into_iter();
        let (failed_tx, failed_rx) = tokio::sync::watch::channel(0usize);
        let mut survivors = Vec::new();
        for input in &inputs[..3] {
            let input = input.clone();
            let t = ts.next().unwrap();
            let mut failed = failed_tx.subscribe();
            let failed_tx = failed_tx.clone();
            survivors.push(tokio::spawn(async move {
                let cfg = config(Algorithm::Direct, 4096).timeout(Duration::from_secs(1));
                let mut comm = Communicator::new(t, cfg).await.unwrap();
                let m = comm.transport().buffers().clone();
                let mut b = buffer_with(&m, DType::F32, &input);
                let r = comm.all_reduce(&mut b, ReduceOp::Sum).await;
                let right_after = bytes_of(b.tensor());
                failed_tx.send_modify(|n| *n += 1);
                // Hold the communicator and buffer until the zombie acted.
                let _ = failed.wait_for(|&n| n == usize::MAX).await;
                let later = bytes_of(b.tensor());
                (
                    r.map(|()| right_after.clone()),
                    right_after,
                    later,
                    b.poisoned().is_some(),
                )
            }));
        }
        let t = ts.next().unwrap();
        let zombie_input = inputs[3].clone();
        let mut failed = failed_rx.clone();
        let zombie = tokio::spawn(async move {
            let comm = Communicator::new(t, config(Algorithm::Direct, 4096))
                .await
                .unwrap();
            let t = comm.transport();
            let m = t.buffers().clone();
            let mine = buffer_with(&m, DType::F32, &zombie_input);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut regions = Vec::new();
            let window = mine.registered().open_window();
            for q in 0..3 {
                let (msg, _) = Msg::decode(q, t.recv(q, deadline).await.unwrap()).unwrap();
                let Body::Ready {
                    desc,
                    regions: mut r,
                } = msg.body
                else {
                    panic!("rank {q} sent {:?} first", msg.body);
                };
                let ready = Msg {
                    tag: msg.tag,
                    body: Body::Ready {
                        desc,
                        regions: vec![Region {
                            buffer: window.clone(),
                            offset: 0,
                            len: (n * 4) as u64,
                        }],
                    },
                };
                t.send(q, ready.encode(&[])).await.unwrap();
                regions.push(r.remove(0));
            }
            let stalled = stall.then(|| m.stall_copy_for_test(&regions[0].buffer).unwrap());
            failed.wait_for(|&n| n == 3).await.unwrap();
            // The survivors gave up: whatever the zombie does now is
            // refused, through every backend.
            let mut refused = Vec::new();
            for (q, region) in regions.iter().enumerate() {
                for kind in [BackendKind::Shm, BackendKind::Tcp] {
                    m.set_backend_policy(BackendPolicy::Only(kind));
                    let junk = vec![0xAB; 1024];
                    let w = m.write_from(&region.buffer, region.offset, &junk).await;
                    let mut back = vec![0u8; 1024];
                    let r = m.read_into(&region.buffer, region.offset, &mut back).await;
                    refused.push((q, kind, w.is_err(), r.is_err()));
                }
            }
            m.set_backend_policy(BackendPolicy::Auto);
            drop(stalled);
            (refused, mine)
        });
        let (refused, _mine) = zombie.await.unwrap();
        for (q, kind, w, r) in refused {
            assert!(
                w,
                "the zombie wrote rank {q}'s memory through {kind} after it failed"
            );
            assert!(
                r,
                "the zombie read rank {q}'s memory through {kind} after it failed"
            );
        }
        failed_tx.send_replace(usize::MAX);
        let mut out = Vec::new();
        for s in survivors {
            out.push(s.await.unwrap());
        }
        out
    })
}

#[test]
fn a_zombie_of_a_failed_all_reduce_never_touches_a_survivors_memory_after_it_failed() {
    for (rank, (r, right_after, later, poisoned)) in zombie_after_a_failed_all_reduce(false)
        .into_iter()
        .enumerate()
    {
        let e = r.expect_err("an all-reduce without rank 3's Done completed");
        assert!(
            matches!(&e, Error::Timeout { waiting_for, .. } if waiting_for.contains(&3)),
            "rank {rank}: {e}"
        );
        assert!(
            right_after == later,
            "rank {rank}'s memory changed after it failed"
        );
        assert!(!poisoned, "rank {rank}");
    }
}

/// A peer stopped inside a copy into a member when its all-reduce fails
/// may finish that copy whenever it resumes: the member's buffer is
/// poisoned (refused by the next collective and by `as_f32`), the others'
/// are not.
#[test]
fn a_peer_stopped_inside_a_copy_poisons_the_buffer_it_writes() {
    let h = harness();
    let results = zombie_after_a_failed_all_reduce(true);
    for (rank, (r, _, _, poisoned)) in results.iter().enumerate() {
        assert!(r.is_err(), "rank {rank}");
        assert_eq!(*poisoned, rank == 0, "rank {rank}");
    }
    // A poisoned buffer is refused by the next collective.
    h.rt.block_on(async {
        let m = h.managers[0].clone();
        let b = buffer_with(&m, DType::F32, &data(DType::F32, 10, 1));
        let stalled = {
            let plain = b.registered().open_window();
            let s = h.managers[1].stall_copy_for_test(&plain).unwrap();
            let e = b
                .registered()
                .close_window(&plain, Duration::from_millis(10))
                .await
                .unwrap_err();
            assert!(matches!(e, Error::Poisoned(_)), "{e}");
            s
        };
        let mut b = b;
        assert!(b.poisoned().is_some());
        assert!(matches!(b.as_f32_mut(), Err(Error::Poisoned(_))));
        let (_g, ts) = LocalGroup::new(h.managers[..1].to_vec());
        let mut comm = Communicator::new(
            ts.into_iter().next().unwrap(),
            config(Algorithm::Direct, 64),
        )
        .await
        .unwrap();
        let e = comm.all_reduce(&mut b, ReduceOp::Sum).await.unwrap_err();
        assert!(matches!(e, Error::Poisoned(_)), "{e}");
        drop(stalled);
    });
}
