//! The mesh actor of the tensor suite (`tests/tensor.rs`), registered in
//! its proc binary (`tensor_proc`) and in the test binary that drives it:
//! members that run collectives over the mesh transport in a handler and
//! answer with digests of their results, which the test compares with a
//! serial reference of the same inputs ([`input`]).

use std::hash::Hasher as _;
use std::time::{Duration, SystemTime};

use regent_mesh::{ActorError, Member, MeshActor, Rank};
use regent_tensor::tch::{self, Tensor};
use regent_tensor::transport::mesh::MeshTransport;
use regent_tensor::{
    Algorithm, CollectiveConfig, Communicator, Contiguity, DType, Error, ReduceOp, TensorBuffer,
    TensorHandle,
};
use serde::{Deserialize, Serialize};

/// The most elements one operation may ask for (4 GiB of f32).
pub const MAX_LEN: u64 = 1 << 30;

/// A member that runs collectives with its peers (every member of the
/// mesh, in rank order) and keeps one communicator per generation and
/// algorithm.
pub struct Collectives {
    rank: u32,
    comm: Option<Comm>,
    /// A tensor published with [`TensorOp::Publish`], until released.
    published: Option<TensorBuffer>,
}

struct Comm {
    generation: u64,
    algorithm: Algorithm,
    comm: Communicator<MeshTransport>,
}

/// What a [`Collectives`] member is told. Inputs are [`input`]`(seed,
/// rank, len)` (for a broadcast, the root's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TensorOp {
    /// `iterations` all-reduces of the same input (each iteration copies
    /// it in again), every result compared with the first. `progress`: a
    /// directory where the member writes the iterations it completed
    /// (file `rank-<rank>`), for a test to wait on.
    AllReduce {
        /// Elements of f32.
        len: u64,
        /// The inputs' seed.
        seed: u64,
        /// How many times.
        iterations: u64,
        /// The reduction.
        op: ReduceOp,
        /// The algorithm.
        algorithm: Algorithm,
        /// Where to note progress.
        progress: Option<String>,
    },
    /// The root's input to every member.
    Broadcast {
        /// Elements of f32.
        len: u64,
        /// The inputs' seed.
        seed: u64,
        /// The root.
        root: u32,
        /// The algorithm.
        algorithm: Algorithm,
    },
    /// Every member's input, gathered in rank order.
    AllGather {
        /// Elements of f32 per member.
        len: u64,
        /// The inputs' seed.
        seed: u64,
        /// The algorithm.
        algorithm: Algorithm,
    },
    /// The reduction of every member's input, chunk `i` at member `i`.
    ReduceScatter {
        /// Elements of f32 of the input (a multiple of the group size).
        len: u64,
        /// The inputs' seed.
        seed: u64,
        /// The reduction.
        op: ReduceOp,
        /// The algorithm.
        algorithm: Algorithm,
    },
    /// `from` sends its input to `to` (the others do nothing).
    SendRecv {
        /// Elements of f32.
        len: u64,
        /// The inputs' seed.
        seed: u64,
        /// The sender.
        from: u32,
        /// The receiver.
        to: u32,
    },
    /// Keep the input in registered memory and answer its handle.
    Publish {
        /// Elements of f32.
        len: u64,
        /// The inputs' seed.
        seed: u64,
    },
    /// Read a peer's tensor by its handle, one-sidedly.
    Fetch(TensorHandle),
    /// Release the published tensor.
    Release,
}

/// A [`Collectives`] member's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TensorReply {
    /// The digest ([`digest`]) of the result, and the generation it ran in.
    Digest {
        /// The digest.
        digest: u64,
        /// The mesh's generation.
        generation: u64,
        /// Iterations completed (1 but for all-reduces).
        iterations: u64,
    },
    /// The member took no part.
    Idle,
    /// A published tensor's handle.
    Handle(TensorHandle),
    /// The operation failed.
    Failed {
        /// The error, as displayed.
        error: String,
        /// The rank it blames ([`Error::culprit`]; group ranks are mesh
        /// ranks here), if any.
        culprit: Option<u32>,
        /// When the member saw the error, in nanoseconds since the Unix
        /// epoch (procs of one host share the clock).
        at_unix_ns: u64,
        /// Iterations completed before it.
        completed: u64,
        /// The mesh's generation.
        generation: u64,
    },
}

/// Deterministic f32 inputs of member `rank`: mantissas and exponents
/// spread so that the order of a sum changes its bits.
pub fn input(seed: u64, rank: u32, len: usize) -> Vec<f32> {
    let mut s = seed ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            // splitmix64
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let mantissa = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exponent = ((z >> 8) & 15) as i32 - 8;
            mantissa * 2f32.powi(exponent)
        })
        .collect()
}

/// The bytes of f32 values, as they lie in memory.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// A digest of bytes (the same in every process of one build).
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    h.write(bytes);
    h.write_usize(bytes.len());
    h.finish()
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, Error> {
    let n = t.numel();
    let mut out = vec![0u8; n * 4];
    t.f_copy_data_u8(&mut out, n)?;
    Ok(out)
}

fn checked_len(len: u64) -> Result<usize, ActorError> {
    if len == 0 || len > MAX_LEN {
        return Err(format!("len {len} outside 1..={MAX_LEN}").into());
    }
    Ok(len as usize)
}

/// The channel tag of the communicator of `generation` and `algorithm`:
/// members agree on it without talking, and a new generation never reuses
/// the port of the last one.
fn tag(generation: u64, algorithm: Algorithm) -> u16 {
    let a = match algorithm {
        Algorithm::Auto => 0,
        Algorithm::Inline => 1,
        Algorithm::Direct => 2,
        Algorithm::Ring => 3,
    };
    1 + ((generation % 4096) * 4 + a) as u16
}

impl Collectives {
    /// The communicator of this generation with `algorithm`, made (with
    /// every member of the mesh) if there is none yet.
    async fn comm(
        &mut self,
        member: &Member,
        algorithm: Algorithm,
    ) -> Result<&mut Communicator<MeshTransport>, Error> {
        let generation = member.generation().0;
        let current = self
            .comm
            .as_ref()
            .is_some_and(|c| c.generation == generation && c.algorithm == algorithm);
        if !current {
            // The old one goes first: its tasks hold its channel's port.
            self.comm = None;
            tokio::task::yield_now().await;
            let group = (0..member.size()).map(Rank).collect();
            let transport = MeshTransport::new(member, group, tag(generation, algorithm))?;
            let config = CollectiveConfig::default()
                .algorithm(algorithm)
                .timeout(Duration::from_secs(60));
            let comm = Communicator::new(transport, config).await?;
            self.comm = Some(Comm {
                generation,
                algorithm,
                comm,
            });
        }
        // Set just above.
        let c = self.comm.as_mut().expect("a communicator");
        if let Some(broken) = c.comm.broken() {
            return Err(Error::Broken(format!(
                "{broken} (and the mesh is still in generation {generation})"
            )));
        }
        Ok(&mut c.comm)
    }

    async fn run(
        &mut self,
        member: &Member,
        op: TensorOp,
        completed: &mut u64,
    ) -> Result<TensorReply, ActorError> {
        let rank = self.rank;
        let generation = member.generation().0;
        let manager = member.buffers()?.clone();
        let done = |digest: u64, iterations: u64| TensorReply::Digest {
            digest,
            generation,
            iterations,
        };
        Ok(match op {
            TensorOp::AllReduce {
                len,
                seed,
                iterations,
                op,
                algorithm,
                progress,
            } => {
                let n = checked_len(len)?;
                let base = Tensor::from_slice(&input(seed, rank, n));
                let mut data = TensorBuffer::zeros(&manager, DType::F32, &[len])?;
                let comm = self.comm(member, algorithm).await?;
                let mut first = None;
                for i in 0..iterations {
                    data.tensor_mut().f_copy_(&base)?;
                    comm.all_reduce(&mut data, op).await?;
                    let d = digest(&tensor_bytes(data.tensor())?);
                    if *first.get_or_insert(d) != d {
                        return Err(format!(
                            "iteration {i} gave another result than the first (digest {d:x}, not {:x})",
                            first.unwrap_or_default()
                        )
                        .into());
                    }
                    *completed = i + 1;
                    if let Some(dir) = &progress {
                        let path = std::path::Path::new(dir).join(format!("rank-{rank}"));
                        std::fs::write(path, (i + 1).to_string())?;
                    }
                }
                done(first.unwrap_or_default(), iterations)
            }
            TensorOp::Broadcast {
                len,
                seed,
                root,
                algorithm,
            } => {
                let n = checked_len(len)?;
                let mut data = if rank == root {
                    TensorBuffer::copy_from(
                        &manager,
                        &Tensor::from_slice(&input(seed, rank, n)),
                        Contiguity::Refuse,
                    )?
                } else {
                    TensorBuffer::zeros(&manager, DType::F32, &[len])?
                };
                let comm = self.comm(member, algorithm).await?;
                comm.broadcast(&mut data, root as usize).await?;
                done(digest(&tensor_bytes(data.tensor())?), 1)
            }
            TensorOp::AllGather {
                len,
                seed,
                algorithm,
            } => {
                let n = checked_len(len)?;
                let size = u64::from(member.size());
                let mine = Tensor::from_slice(&input(seed, rank, n));
                let mut out = TensorBuffer::zeros(&manager, DType::F32, &[len * size])?;
                let comm = self.comm(member, algorithm).await?;
                comm.all_gather(&mine, &mut out).await?;
                done(digest(&tensor_bytes(out.tensor())?), 1)
            }
            TensorOp::ReduceScatter {
                len,
                seed,
                op,
                algorithm,
            } => {
                let n = checked_len(len)?;
                let size = u64::from(member.size());
                if len % size != 0 {
                    return Err(format!("len {len} is not a multiple of {size}").into());
                }
                let data = TensorBuffer::copy_from(
                    &manager,
                    &Tensor::from_slice(&input(seed, rank, n)),
                    Contiguity::Refuse,
                )?;
                let mut out =
                    Tensor::zeros([(len / size) as i64], (tch::Kind::Float, tch::Device::Cpu));
                let comm = self.comm(member, algorithm).await?;
                comm.reduce_scatter(&data, &mut out, op).await?;
                done(digest(&tensor_bytes(&out)?), 1)
            }
            TensorOp::SendRecv {
                len,
                seed,
                from,
                to,
            } => {
                let n = checked_len(len)?;
                if rank == from {
                    let data = TensorBuffer::copy_from(
                        &manager,
                        &Tensor::from_slice(&input(seed, rank, n)),
                        Contiguity::Refuse,
                    )?;
                    let comm = self.comm(member, Algorithm::Auto).await?;
                    comm.send(&data, to as usize).await?;
                    done(digest(&tensor_bytes(data.tensor())?), 1)
                } else if rank == to {
                    let mut data = TensorBuffer::zeros(&manager, DType::F32, &[len])?;
                    let comm = self.comm(member, Algorithm::Auto).await?;
                    comm.recv(&mut data, from as usize).await?;
                    done(digest(&tensor_bytes(data.tensor())?), 1)
                } else {
                    TensorReply::Idle
                }
            }
            TensorOp::Publish { len, seed } => {
                let n = checked_len(len)?;
                let data = TensorBuffer::copy_from(
                    &manager,
                    &Tensor::from_slice(&input(seed, rank, n)),
                    Contiguity::Refuse,
                )?;
                let handle = data.handle();
                self.published = Some(data);
                TensorReply::Handle(handle)
            }
            TensorOp::Fetch(handle) => {
                let mut data = TensorBuffer::with_layout(&manager, handle.layout().clone())?;
                data.read_from(&manager, &handle).await?;
                done(digest(&tensor_bytes(data.tensor())?), 1)
            }
            TensorOp::Release => {
                self.published = None;
                TensorReply::Idle
            }
        })
    }
}

impl MeshActor for Collectives {
    const NAME: &'static str = "e2e/collectives";
    type Args = ();
    type Msg = TensorOp;
    type Reply = TensorReply;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        tch::set_num_threads(1);
        Ok(Self {
            rank: member.rank().0,
            comm: None,
            published: None,
        })
    }

    /// Errors of collectives are answers ([`TensorReply::Failed`]), not
    /// failures of the member: its life goes on into the next generation.
    async fn handle(&mut self, member: &Member, op: TensorOp) -> Result<TensorReply, ActorError> {
        let mut completed = 0;
        match self.run(member, op, &mut completed).await {
            Ok(reply) => Ok(reply),
            Err(e) => {
                let at_unix_ns = now_ns();
                let culprit = e
                    .downcast_ref::<Error>()
                    .and_then(Error::culprit)
                    .map(|r| r as u32);
                Ok(TensorReply::Failed {
                    error: e.to_string(),
                    culprit,
                    at_unix_ns,
                    completed,
                    generation: member.generation().0,
                })
            }
        }
    }
}

regent_mesh::register_actor!(Collectives);
