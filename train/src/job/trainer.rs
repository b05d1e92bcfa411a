//! The member of a training job: one data-parallel replica.
//!
//! The controller drives it step by step (see [`super::run`]):
//! - `Compute { step, epoch, poison }`: this rank's gradients of step `step`, the
//!   all-reduce over the mesh (exact: the sum in rank order, then divided by
//!   the world), kept as pending; the answer is this rank's share of the
//!   loss and whether the loss and the mean gradient are finite (every rank
//!   reduces to the same mean, so every rank agrees). A collective that
//!   fails (a peer died, paused, was cut off) is an answer, not a failure of
//!   this member: nothing is pending then. The collectives run on a
//!   communicator of the current generation and `epoch` (a channel of its
//!   own, `collective_tag`: the controller moves to a new epoch after a
//!   failed step, so a message of an abandoned communicator finds its port
//!   closed instead of confusing the next one). `poison` names a rank that puts a NaN into
//!   its gradient before the all-reduce (fault injection).
//! - `Commit { step }` applies the pending mean (one optimizer step); the
//!   controller sends it only when every rank computed a finite step, so
//!   every replica takes the same step or none does (torchft's
//!   should-commit). `Skip { step }` drops it and advances the step counter
//!   (a non-finite step under the skip policy).
//! - `Expose` puts the whole state in registered memory and answers its
//!   handle; `Heal { from }` reads a peer's exposed state one-sidedly and
//!   takes it (a restarted rank heals from a live peer, not from disk).
//! - `Restore` takes the run directory's newest checkpoint (a gang restart,
//!   or a new controller); `Checkpoint { step }` writes one, and `Final {
//!   step }` the final state, each refused (nothing written) by a member
//!   not at `step` or a new life that has taken no state yet.

use std::path::PathBuf;
use std::time::Instant;

use regent_mesh::{ActorError, Member, MeshActor, Rank};
use regent_rdma::{LocalBuffer, RemoteBuffer};
use regent_tensor::dtype::DType;
use regent_tensor::{CollectiveConfig, Communicator, ReduceOp, TensorBuffer};
use serde::{Deserialize, Serialize};

use super::spec::{AnyReplica, JobSpec};
use super::store;
use regent_tensor::transport::mesh::MeshTransport;

/// The data channels the job's collectives use: see [`collective_tag`].
const COLLECTIVE_TAG_BASE: u16 = 1;
/// How many channel tags the communicators cycle through.
const COLLECTIVE_TAGS: u64 = 4096;

/// The data channel of the communicator of `generation` and `epoch`:
/// `COLLECTIVE_TAG_BASE + (generation + epoch) % COLLECTIVE_TAGS`. Every
/// member of a generation computes the same tag for an epoch; and since
/// neither number goes back and a new communicator is opened only when one
/// of them grew, each new communicator of a member gets another tag than
/// the one it replaces, whose port may not have closed yet (it closes when
/// that transport's tasks end, at the runtime's next turn). A tag of the
/// epoch alone clashed so when a warm spare made the restart faster than a
/// failed step's answer: the survivors, moved to a new generation in the
/// same epoch, found the old port still open.
fn collective_tag(generation: regent_net::Generation, epoch: u32) -> u16 {
    let r = generation.0.wrapping_add(u64::from(epoch)) % COLLECTIVE_TAGS;
    // Invariant: the remainder is below 4096, and 1 + 4095 fits a u16.
    COLLECTIVE_TAG_BASE + u16::try_from(r).expect("a remainder below 4096")
}

/// Whether every value is finite: in blocks, each folded without a branch
/// (so that it vectorizes), stopping at the first block with a NaN or an
/// infinity.
fn all_finite(values: &[f32]) -> bool {
    values
        .chunks(4096)
        .all(|block| block.iter().fold(true, |all, v| all & v.is_finite()))
}

/// Why a member that is `fresh` (a new life that has taken no state: it
/// holds the initial one) and `at` a step cannot write the state of
/// `step`, if it cannot.
fn refusal(fresh: bool, at: u64, step: u64) -> Option<String> {
    if fresh {
        return Some("a new life holds no state yet (it heals or restores first)".into());
    }
    (at != step).then(|| format!("at step {at}, not {step}"))
}

/// What a trainer is created from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerArgs {
    /// The job.
    pub spec: JobSpec,
    /// Where checkpoints live.
    pub run_dir: PathBuf,
    /// Intra-op threads of libtorch in each member (1 on 2-core machines).
    pub threads: i32,
    /// How long one collective may take before it fails (a backstop behind
    /// the mesh's failure detection).
    pub collective_timeout_ms: u64,
}

/// A message to a trainer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TrainerMsg {
    /// Where this replica stands.
    Status,
    /// Compute step `step`'s gradients and all-reduce them.
    Compute {
        /// The step.
        step: u64,
        /// The controller's epoch: the communicator (and its channel) to
        /// use.
        epoch: u32,
        /// The mesh's generation as the controller sent the step: a member
        /// that has moved on (a restart overtook the step) answers at once
        /// that the step is broken, rather than wait out the collective's
        /// timeout on a communicator of the new generation that its peers,
        /// still on the old one, never join.
        generation: regent_net::Generation,
        /// The rank that puts a NaN into its gradient before the
        /// all-reduce (fault injection), if any.
        poison: Option<u32>,
    },
    /// Drop step `step` (pending or not) and advance past it: its batch is
    /// skipped, nothing is applied.
    Skip {
        /// The step.
        step: u64,
    },
    /// Apply the pending mean of step `step`.
    Commit {
        /// The step.
        step: u64,
    },
    /// Drop any pending mean.
    Abort,
    /// Expose the state for a peer to heal from.
    Expose,
    /// Take a peer's exposed state.
    Heal {
        /// Its handle.
        from: RemoteBuffer,
        /// Its length in bytes.
        len: u64,
    },
    /// Take the run directory's newest checkpoint (or the initial state
    /// when there is none).
    Restore,
    /// Write a checkpoint of the state at `step`.
    Checkpoint {
        /// The step the controller committed last. A member at another
        /// step, or a new life that has taken no state yet, writes
        /// nothing and answers [`TrainerReply::Broken`].
        step: u64,
    },
    /// Write the final state, at `step`, to the run directory's
    /// `final.safetensors` (for the controller to compare runs, and for
    /// the user); refused as a checkpoint is.
    Final {
        /// The job's last step.
        step: u64,
    },
}

/// A trainer's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TrainerReply {
    /// Where the replica stands.
    Status {
        /// Steps applied.
        step: u64,
        /// The step whose mean is pending, if any.
        pending: Option<u64>,
        /// Whether this life has not taken any state since it started (a
        /// restarted member that still needs to heal or restore).
        fresh: bool,
    },
    /// Step computed: this rank's share of the global mean loss.
    Computed {
        /// The step.
        step: u64,
        /// Its share of the loss.
        loss: f64,
        /// Time in forward and backward, and in the all-reduce.
        compute_ms: f64,
        /// Time in the all-reduce.
        reduce_ms: f64,
        /// Whether this rank's loss and the mean gradient are finite.
        finite: bool,
    },
    /// The collective failed (a peer is gone; nothing is pending), or
    /// this member does not hold the state asked for.
    Broken(String),
    /// The replica's step now.
    Step(u64),
    /// The state is exposed.
    Exposed {
        /// Its handle.
        buffer: RemoteBuffer,
        /// Its length.
        len: u64,
        /// Its step.
        step: u64,
    },
    /// A checkpoint was written.
    Checkpointed {
        /// Its step.
        step: u64,
        /// Its size.
        bytes: u64,
        /// How long it took.
        ms: f64,
    },
    /// The final state was written.
    Final {
        /// Its step.
        step: u64,
        /// Where.
        path: PathBuf,
    },
}

/// One data-parallel replica (see the module docs).
pub struct Trainer {
    replica: AnyReplica,
    args: TrainerArgs,
    world: usize,
    /// The communicator of a generation and epoch.
    comm: Option<(regent_net::Generation, u32, Communicator<MeshTransport>)>,
    /// The step whose mean is in `grads`, waiting for its commit.
    pending: Option<u64>,
    /// This rank's gradients, then (reduced in place, in registered memory:
    /// no staging copy) the pending mean, which the optimizer reads through
    /// views (no unflattening copy).
    grads: TensorBuffer,
    /// The exposed state, kept registered until replaced.
    exposed: Option<LocalBuffer>,
    fresh: bool,
}

impl Trainer {
    /// The communicator of `generation` (the step's) and `epoch` in
    /// `comm`: the one in use, or a new one on their channel; refused when
    /// the member has moved to another generation. (A function of the
    /// field, so that the caller can hand it the gradient buffer, another
    /// field, at the same time.)
    async fn communicator<'c>(
        comm: &'c mut Option<(regent_net::Generation, u32, Communicator<MeshTransport>)>,
        member: &Member,
        generation: regent_net::Generation,
        epoch: u32,
        args: &TrainerArgs,
        world: usize,
    ) -> Result<&'c mut Communicator<MeshTransport>, String> {
        let now = member.generation();
        if now != generation {
            return Err(format!(
                "the mesh moved from generation {} to {} before the step's collective",
                generation.0, now.0
            ));
        }
        if comm
            .as_ref()
            .is_none_or(|(g, e, c)| *g != generation || *e != epoch || c.broken().is_some())
        {
            // The old one (and its channel's port) goes before the new one
            // opens.
            *comm = None;
            let group: Vec<Rank> = (0..world as u32).map(Rank).collect();
            let tag = collective_tag(generation, epoch);
            let transport = MeshTransport::new(member, group, tag).map_err(|e| e.to_string())?;
            let config = CollectiveConfig::default()
                .timeout(std::time::Duration::from_millis(args.collective_timeout_ms));
            let built = Communicator::new(transport, config)
                .await
                .map_err(|e| e.to_string())?;
            *comm = Some((generation, epoch, built));
        }
        Ok(&mut comm.as_mut().expect("set above").2)
    }

    async fn compute(
        &mut self,
        member: &Member,
        step: u64,
        epoch: u32,
        generation: regent_net::Generation,
        poison: Option<u32>,
    ) -> Result<TrainerReply, ActorError> {
        self.pending = None;
        if self.replica.step() != step {
            return Ok(TrainerReply::Broken(format!(
                "rank {} is at step {}, not {step}",
                member.rank().0,
                self.replica.step()
            )));
        }
        let t = Instant::now();
        let rank = member.rank().0 as usize;
        let loss = self
            .replica
            .rank_gradients(rank, self.world, self.grads.as_f32_mut()?)?;
        if poison == Some(member.rank().0)
            && let Some(g) = self.grads.as_f32_mut()?.first_mut()
        {
            // A real NaN in the real gradient: the all-reduce carries it to
            // every rank's mean.
            *g = f32::NAN;
        }
        let share = loss * crate::loss_scale(self.replica.global_batch(), rank, self.world)?
            / self.world as f64;
        let reduce_start = Instant::now();
        // Reduced in place where it lies (registered memory: no copy in or
        // out, no allocation) to the pending mean: the exact collective's
        // mean is the rank-order sum divided by the world in f32, as
        // `crate::reduce::mean_in_rank_order` (the reference) computes it,
        // and each member divides only the chunk it reduced, while it is
        // in cache.
        let reduced = match Self::communicator(
            &mut self.comm,
            member,
            generation,
            epoch,
            &self.args,
            self.world,
        )
        .await
        {
            Ok(comm) => comm
                .all_reduce(&mut self.grads, ReduceOp::Mean)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        if let Err(e) = reduced {
            self.comm = None;
            if let Some(why) = self.grads.poisoned() {
                // A peer stopped inside a write into it may finish that
                // write whenever it resumes: the next step's gradient goes
                // into fresh memory.
                tracing::info!(rank, %why, "replacing the gradient buffer");
                let len = self.replica.gradient_len() as u64;
                self.grads = TensorBuffer::zeros(member.buffers()?, DType::F32, &[len])?;
            }
            return Ok(TrainerReply::Broken(e));
        }
        let reduce_ms = reduce_start.elapsed().as_secs_f64() * 1e3;
        let mean = self.grads.as_f32()?;
        // One pass over the mean, not libtorch's `isfinite().all()` (five
        // passes and three temporary tensors: a fifth of the 4-proc MLP
        // job's CPU per step).
        let finite = share.is_finite() && all_finite(mean);
        self.pending = Some(step);
        Ok(TrainerReply::Computed {
            step,
            loss: share,
            compute_ms: t.elapsed().as_secs_f64() * 1e3,
            reduce_ms,
            finite,
        })
    }

    /// Why this member cannot write the state of `step`, if it cannot.
    fn refuse_to_write(&self, step: u64) -> Option<TrainerReply> {
        refusal(self.fresh, self.replica.step(), step).map(TrainerReply::Broken)
    }

    fn taken(&mut self, state: &crate::TrainState) -> Result<(), ActorError> {
        self.replica.restore(state)?;
        self.pending = None;
        self.fresh = false;
        Ok(())
    }
}

impl MeshActor for Trainer {
    const NAME: &'static str = "regent-train/trainer";
    type Args = TrainerArgs;
    type Msg = TrainerMsg;
    type Reply = TrainerReply;

    async fn new(member: &Member, args: TrainerArgs) -> Result<Self, ActorError> {
        tch::set_num_threads(args.threads.max(1));
        // libtorch refuses a second call in a process, and once anything
        // parallel has run (tch panics then); a restarted member runs `new`
        // again in the same proc. Inter-op threads change no result (the
        // models run no inter-op parallel work), so a refusal is only
        // logged.
        static INTEROP: std::sync::Once = std::sync::Once::new();
        INTEROP.call_once(|| {
            if std::panic::catch_unwind(|| tch::set_num_interop_threads(1)).is_err() {
                tracing::warn!("libtorch kept its inter-op thread count");
            }
        });
        let replica = args.spec.build()?;
        let world = member.size() as usize;
        if world != args.spec.world as usize {
            return Err(
                format!("the mesh has {world} members, the job {}", args.spec.world).into(),
            );
        }
        let len = replica.gradient_len() as u64;
        let grads = TensorBuffer::zeros(member.buffers()?, DType::F32, &[len])?;
        // A first start begins at the initial state; a restarted life takes
        // a peer's state or a checkpoint when the controller says which.
        let fresh = member.start().is_restart();
        Ok(Self {
            replica,
            args,
            world,
            comm: None,
            pending: None,
            grads,
            exposed: None,
            fresh,
        })
    }

    async fn handle(
        &mut self,
        member: &Member,
        msg: TrainerMsg,
    ) -> Result<TrainerReply, ActorError> {
        Ok(match msg {
            TrainerMsg::Status => TrainerReply::Status {
                step: self.replica.step(),
                pending: self.pending,
                fresh: self.fresh,
            },
            TrainerMsg::Compute {
                step,
                epoch,
                generation,
                poison,
            } => {
                self.compute(member, step, epoch, generation, poison)
                    .await?
            }
            TrainerMsg::Skip { step } => {
                if self.replica.step() == step {
                    self.pending = None;
                    self.replica.skip_step()?;
                }
                TrainerReply::Step(self.replica.step())
            }
            TrainerMsg::Commit { step } => {
                match self.pending.take() {
                    Some(s) if s == step => self.replica.apply_mean_tensor(self.grads.tensor())?,
                    other => self.pending = other,
                }
                TrainerReply::Step(self.replica.step())
            }
            TrainerMsg::Abort => {
                self.pending = None;
                TrainerReply::Step(self.replica.step())
            }
            TrainerMsg::Expose => {
                let bytes = store::to_bytes(&self.replica.state()?)?;
                // The buffer of the last exposure when the state fits it
                // (the same model's state, but for its header's length):
                // taken back from peers (reads under way finish first,
                // new ones are refused until it is read-only again), so
                // that a new one's pages need not be faulted in and
                // registered at every recovery.
                let mut buffer = match self.exposed.take() {
                    Some(mut b) if b.len() >= bytes.len() => {
                        b.set_access(regent_rdma::Access::Local).await?;
                        b
                    }
                    _ => {
                        let memory = regent_rdma::Memory::allocate(bytes.len().max(1))?;
                        member
                            .buffers()?
                            .register_with(memory, regent_rdma::Access::Local)?
                    }
                };
                buffer.as_mut_slice()?[..bytes.len()].copy_from_slice(&bytes);
                // Peers read it; nobody writes it.
                buffer.set_access(regent_rdma::Access::ReadOnly).await?;
                let reply = TrainerReply::Exposed {
                    buffer: buffer.handle().clone(),
                    len: bytes.len() as u64,
                    step: self.replica.step(),
                };
                self.exposed = Some(buffer);
                reply
            }
            TrainerMsg::Heal { from, len } => {
                let mut bytes = vec![0u8; len as usize];
                member.buffers()?.read_into(&from, 0, &mut bytes).await?;
                let state = store::from_bytes(&bytes)?;
                self.taken(&state)?;
                TrainerReply::Step(self.replica.step())
            }
            TrainerMsg::Restore => {
                match store::latest_checkpoint(&self.args.run_dir)? {
                    Some((_, state)) => self.taken(&state)?,
                    None => {
                        let initial = self.args.spec.build()?.state()?;
                        self.taken(&initial)?;
                    }
                }
                TrainerReply::Step(self.replica.step())
            }
            TrainerMsg::Checkpoint { step } => {
                if let Some(refused) = self.refuse_to_write(step) {
                    return Ok(refused);
                }
                let t = Instant::now();
                let state = self.replica.state()?;
                let (_, bytes) = store::save_checkpoint(&self.args.run_dir, &state)?;
                TrainerReply::Checkpointed {
                    step: state.step,
                    bytes,
                    ms: t.elapsed().as_secs_f64() * 1e3,
                }
            }
            TrainerMsg::Final { step } => {
                if let Some(refused) = self.refuse_to_write(step) {
                    return Ok(refused);
                }
                let state = self.replica.state()?;
                let path = store::save_final(&self.args.run_dir, &state)?;
                TrainerReply::Final {
                    step: state.step,
                    path,
                }
            }
        })
    }
}

regent_mesh::register_actor!(Trainer);

#[cfg(test)]
mod tests {
    use super::{all_finite, collective_tag, refusal};
    use regent_net::Generation;

    /// A member's communicators follow (generation, epoch) pairs where
    /// neither goes back and one grows at each new communicator: each new
    /// one must be on another tag than the one before.
    #[test]
    fn a_new_communicator_never_takes_the_tag_of_the_one_it_replaces() {
        // The clash that was: a restart moves the generation, the epoch
        // stays.
        assert_ne!(
            collective_tag(Generation(1), 1),
            collective_tag(Generation(2), 1)
        );
        let (mut g, mut e) = (0u64, 0u32);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let before = collective_tag(Generation(g), e);
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 3 {
                0 => g += 1 + (x >> 8) % 3,
                1 => e = e.wrapping_add(1),
                _ => {
                    g += 1;
                    e = e.wrapping_add(1);
                }
            }
            let after = collective_tag(Generation(g), e);
            assert_ne!(before, after, "generation {g}, epoch {e}");
            assert!((1..=4096).contains(&after));
        }
    }

    #[test]
    fn all_finite_finds_a_nan_or_an_infinity_anywhere() {
        assert!(all_finite(&[]));
        let mut v: Vec<f32> = (0..10_000).map(|i| i as f32 * 1e30).collect();
        v.push(f32::MAX);
        v.push(f32::MIN_POSITIVE / 2.0);
        assert!(all_finite(&v));
        // First, inside the first block, on a block's edges, the last.
        for at in [0, 17, 4095, 4096, 8191, v.len() - 1] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut w = v.clone();
                w[at] = bad;
                assert!(!all_finite(&w), "{bad} at {at} was not found");
            }
        }
    }

    /// A checkpoint or final state comes only from a member that holds the
    /// committed step: not from a new life (which holds the initial state,
    /// whatever its step counter says), nor from one at another step.
    #[test]
    fn only_a_member_at_the_committed_step_writes_its_state() {
        assert_eq!(refusal(false, 50, 50), None);
        let fresh = refusal(true, 0, 0).expect("a new life refuses");
        assert!(fresh.contains("no state yet"), "{fresh}");
        assert!(refusal(true, 50, 50).is_some());
        assert_eq!(
            refusal(false, 49, 50).as_deref(),
            Some("at step 49, not 50")
        );
        assert!(refusal(false, 51, 50).is_some());
    }
}
