//! The one error of the crate boundary.

use std::path::PathBuf;

/// What can go wrong while building, stepping, saving or restoring a replica.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libtorch refused an operation (a shape it cannot broadcast, memory).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A configuration value is outside its documented range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A rank outside `0..world`, or a world of zero ranks.
    #[error("rank {rank} is not a rank of a world of {world}")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// The world size asked for.
        world: usize,
    },
    /// The global batch has fewer samples than the world has ranks, so some
    /// rank would get an empty batch.
    #[error("a global batch of {global} samples cannot be split over {world} ranks")]
    BatchTooSmall {
        /// Samples per global batch.
        global: usize,
        /// Ranks in the world.
        world: usize,
    },
    /// A batch handed to a model has the wrong shape or element kind.
    #[error("bad batch: {0}")]
    Batch(String),
    /// A trainable variable is not `f32` (the gradient layout is `f32`).
    #[error("trainable variable {name:?} has kind {kind:?}; only f32 is supported")]
    NotF32 {
        /// The variable's name in its `VarStore`.
        name: String,
        /// Its element kind.
        kind: tch::Kind,
    },
    /// A model variable uses a name the crate reserves (`optim.*`, `train.*`).
    #[error("variable name {0:?} is reserved (prefixes optim. and train. belong to regent-train)")]
    ReservedName(String),
    /// A flat gradient buffer, or a list of gradients, does not match the
    /// layout.
    #[error("gradient buffer holds {got} values; the layout needs {want}")]
    BufferLength {
        /// Length handed in.
        got: usize,
        /// Length the layout needs.
        want: usize,
    },
    /// A training state does not fit the replica it is loaded into (nothing
    /// is loaded then).
    #[error("training state does not fit: {0}")]
    State(String),
    /// A corpus file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A corpus is not valid UTF-8, is too large, too short for one window,
    /// or has too many distinct characters.
    #[error("corpus: {0}")]
    Corpus(String),
    /// The tensor layer (collectives, checkpoints) failed.
    #[error(transparent)]
    Tensor(#[from] regent_tensor::Error),
    /// The mesh runtime failed (spawning, calling, supervising members).
    #[error(transparent)]
    Mesh(#[from] regent_mesh::MeshError),
    /// A checkpoint directory or run directory could not be used.
    #[error("run directory {path}: {message}")]
    RunDir {
        /// The directory or file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The job could not go on (its mesh stopped, a step could not complete
    /// within its retries).
    #[error("the job stopped: {0}")]
    Job(String),
    /// A step's loss or mean gradient was not finite again after the job
    /// restored the last checkpoint and replayed up to it (the `restore`
    /// policy): the divergence is deterministic (the data or the model, not
    /// a transient fault), and restoring again would loop.
    #[error(
        "step {step} is not finite again after restoring the checkpoint at step {restored_from} \
         and replaying: the divergence is deterministic, so the job stops rather than loop \
         (the skip policy drops the step instead)"
    )]
    NonFinite {
        /// The step.
        step: u64,
        /// The step of the checkpoint that was restored.
        restored_from: u64,
    },
}
