//! Data-parallel supervised training whose replicas stay identical bit for
//! bit: models built in a `tch::nn::VarStore`, data sources that are pure
//! functions of (seed, step, sample), optimizers whose state lives in the
//! store, the flat gradient layout the all-reduce runs over, the training
//! state that checkpoints and heals, and the single-process data-parallel
//! reference the distributed job must match. Rules: `docs/semantics.md` §9.
//!
//! ```text
//! Replica = VarStore (parameters + optim.* state) + Model + DataSource
//!           + Optimizer + step
//! step s, rank r of w:  rank_gradients(r, w, buf_r)     forward/backward
//!                       mean = (buf_0 + buf_1 + ...) / w  rank order, f32
//!                       apply_mean(mean)                 optimizer, s += 1
//! ```
//!
//! Bit-identity holds for replicas on the same libtorch build, the same
//! intra-op thread count (or `MKL_CBWR` pinned) and the same CPU kind.
#![forbid(unsafe_code)]

mod builtin;
mod corpus;
mod data;
mod error;
mod gpt;
pub mod job;
mod layout;
mod mlp;
mod model;
mod optim;
pub mod reduce;
mod reference;
mod replica;
pub mod rng;
mod state;

pub use builtin::{GENERATED_CORPUS_CHARS, gpt_replica, mlp_replica};
pub use corpus::{
    CharData, CharDataConfig, Corpus, MAX_CONTEXT, MAX_CORPUS_BYTES, MAX_VOCAB, Vocab,
};
pub use data::{Batch, DataSource, MAX_GLOBAL_BATCH, MAX_SOURCE_ELEMENTS, loss_scale, rank_range};
pub use error::Error;
pub use gpt::{CharGpt, GptConfig, MAX_GPT_DIM, MAX_GPT_LAYERS};
pub use layout::{Layout, LayoutEntry};
pub use mlp::{Blobs, BlobsConfig, MAX_MLP_DIM, MAX_MLP_LAYERS, Mlp, MlpConfig};
pub use model::Model;
pub use optim::{AdamW, AdamWConfig, Optimizer, OptimizerConfig, Sgd, SgdConfig};
pub use reference::{MAX_REFERENCE_WORLD, Reference};
pub use replica::Replica;
pub use state::{DATA_SEED_NAME, MAX_STATE_VARIABLES, STEP_NAME, StateDifference, TrainState};
