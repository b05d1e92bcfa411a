//! In-process collective bandwidth: each rank is a thread with its own
//! tokio runtime and buffer manager (shm between them, as between procs of
//! one host), control messages over the local transport. Prints bus
//! bandwidth (nccl-tests' definition) against a single-thread memcpy
//! measured in the same run.
//!
//! `cargo bench -p regent-tensor --bench collectives [-- --quick]`
//!
//! The multi-process suite (`regent bench tensor`) comes with the mesh
//! transport.
#![allow(clippy::print_stdout)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use regent_net::{ClusterCa, ProcId};
use regent_rdma::{BufferManager, ManagerConfig};
use regent_tensor::transport::local::{LocalGroup, LocalTransport};
use regent_tensor::{Algorithm, CollectiveConfig, Communicator, DType, ReduceOp, TensorBuffer};

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce(Algorithm),
    Broadcast(Algorithm),
}

/// Seconds per operation: per iteration (each after a barrier) the
/// slowest rank's time; the median and the best over `iters`.
fn run(p: usize, bytes: usize, op: Op, iters: usize) -> (f64, f64) {
    let ca = ClusterCa::generate("bench").expect("CA");
    let (mtx, mrx) = mpsc::channel::<(usize, BufferManager)>();
    let mut to_ranks = Vec::new();
    let mut handles = Vec::new();
    for rank in 0..p {
        let creds = ca
            .issue(
                &ProcId::new(&format!("rank-{rank}")).expect("id"),
                regent_net::Role::Proc,
                regent_net::Validity::job(),
            )
            .expect("creds");
        let mtx = mtx.clone();
        let (ttx, trx) = tokio::sync::oneshot::channel::<LocalTransport>();
        to_ranks.push(ttx);
        handles.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let m = BufferManager::start(ManagerConfig::default(), creds)
                    .await
                    .expect("manager");
                mtx.send((rank, m.clone())).expect("send manager");
                let t = trx.await.expect("transport");
                let config = CollectiveConfig::default()
                    .algorithm(match op {
                        Op::AllReduce(a) | Op::Broadcast(a) => a,
                    })
                    .timeout(Duration::from_secs(600))
                    .chunk_bytes(chunk_bytes());
                let mut comm = Communicator::new(t, config).await.expect("communicator");
                let mut b =
                    TensorBuffer::zeros(&m, DType::F32, &[(bytes / 4) as u64]).expect("buffer");
                let _ = b.tensor_mut().fill_(rank as f64 + 0.5);
                let once = async |comm: &mut Communicator<LocalTransport>, b: &mut TensorBuffer| {
                    match op {
                        Op::AllReduce(_) => comm.all_reduce(b, ReduceOp::Sum).await,
                        Op::Broadcast(_) => comm.broadcast(b, 0).await,
                    }
                    .expect("collective");
                };
                once(&mut comm, &mut b).await;
                let mut times = Vec::with_capacity(iters);
                for _ in 0..iters {
                    comm.barrier().await.expect("barrier");
                    let start = Instant::now();
                    once(&mut comm, &mut b).await;
                    times.push(start.elapsed().as_secs_f64());
                }
                comm.barrier().await.expect("barrier");
                times
            })
        }));
    }
    drop(mtx);
    let mut managers: Vec<Option<BufferManager>> = (0..p).map(|_| None).collect();
    for _ in 0..p {
        let (rank, m) = mrx.recv().expect("manager");
        managers[rank] = Some(m);
    }
    let (_group, transports) =
        LocalGroup::new(managers.into_iter().map(|m| m.expect("all")).collect());
    for (t, tx) in transports.into_iter().zip(to_ranks) {
        tx.send(t).expect("transport to rank");
    }
    let per_rank: Vec<Vec<f64>> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect();
    let mut slowest: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    slowest.sort_by(f64::total_cmp);
    (slowest[slowest.len() / 2], slowest[0])
}

/// The pipeline chunk: `REGENT_BENCH_CHUNK_KIB` or the default.
fn chunk_bytes() -> std::num::NonZeroUsize {
    std::env::var("REGENT_BENCH_CHUNK_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .and_then(|k| std::num::NonZeroUsize::new(k << 10))
        .unwrap_or(CollectiveConfig::default().chunk_bytes)
}

/// Bytes per second of a single-thread copy of `bytes` (best of 5).
fn memcpy(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

/// Bytes per second (of `acc`) of the f32 sum kernel, ours and tch's.
fn kernels(bytes: usize) -> (f64, f64) {
    let mut acc = vec![0u8; bytes];
    let x: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut best = (f64::MAX, f64::MAX);
    let a = tch::Tensor::zeros([(bytes / 4) as i64], (tch::Kind::Float, tch::Device::Cpu));
    let mut a = a;
    let b = tch::Tensor::ones([(bytes / 4) as i64], (tch::Kind::Float, tch::Device::Cpu));
    for _ in 0..5 {
        let t = Instant::now();
        regent_tensor::fold_bytes(ReduceOp::Sum, DType::F32, &mut acc, &x).expect("fold");
        std::hint::black_box(&mut acc);
        best.0 = best.0.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let _ = a.f_add_(&b).expect("add");
        best.1 = best.1.min(t.elapsed().as_secs_f64());
    }
    (bytes as f64 / best.0, bytes as f64 / best.1)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    tch::set_num_threads(1);
    let (ours, torch) = kernels(64 << 20);
    println!(
        "f32 sum kernel over 64 MiB: ours {:.2} GB/s, tch add_ {:.2} GB/s, memcpy {:.2} GB/s",
        ours / 1e9,
        torch / 1e9,
        memcpy(64 << 20) / 1e9
    );
    let sizes: &[usize] = if std::env::args().any(|a| a == "--64") {
        &[64 << 20]
    } else if quick {
        &[4 << 20, 64 << 20]
    } else {
        &[4 << 20, 64 << 20, 256 << 20]
    };
    let dram = memcpy(256 << 20);
    println!("memcpy of 256 MiB (DRAM): {:.2} GB/s", dram / 1e9);
    println!(
        "{:<20} {:>2} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "op", "P", "MiB", "median ms", "best ms", "busbw", "memcpy", "ratio", "vs DRAM"
    );
    for &bytes in sizes {
        let mc = memcpy(bytes);
        for p in [2usize, 4] {
            let ops = [
                Op::AllReduce(Algorithm::Direct),
                Op::AllReduce(Algorithm::Ring),
                Op::Broadcast(Algorithm::Direct),
                Op::Broadcast(Algorithm::Ring),
            ];
            for op in ops {
                let only_direct = std::env::args().any(|a| a == "--64");
                if only_direct && !matches!(op, Op::AllReduce(Algorithm::Direct)) {
                    continue;
                }
                if quick && matches!(op, Op::Broadcast(_)) && bytes > (4 << 20) {
                    continue;
                }
                let iters = ((1usize << 31) / bytes).clamp(5, 30) / if quick { 2 } else { 1 };
                let (t, best) = run(p, bytes, op, iters.max(3));
                let algbw = bytes as f64 / t;
                let bus = match op {
                    Op::AllReduce(_) => algbw * 2.0 * (p - 1) as f64 / p as f64,
                    Op::Broadcast(_) => algbw,
                };
                println!(
                    "{:<20} {:>2} {:>5} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2}",
                    format!("{op:?}"),
                    p,
                    bytes >> 20,
                    t * 1e3,
                    best * 1e3,
                    bus / 1e9,
                    mc / 1e9,
                    bus / mc,
                    bus / dram
                );
            }
        }
    }
}
