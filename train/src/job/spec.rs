//! What every member of a training job is built from: a serializable job
//! spec (model, data, optimizer, seeds, world), and the replica it builds.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::corpus::{CharData, CharDataConfig, Corpus};
use crate::data::Batch;
use crate::gpt::{CharGpt, GptConfig};
use crate::mlp::{Blobs, BlobsConfig, Mlp, MlpConfig};
use crate::optim::{AdamWConfig, OptimizerConfig, SgdConfig};
use crate::replica::Replica;
use crate::state::TrainState;
use crate::{Error, GENERATED_CORPUS_CHARS};

/// A built-in model and its data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelSpec {
    /// The MLP on seeded blobs.
    Mlp {
        /// Input features.
        input: usize,
        /// Hidden widths.
        hidden: Vec<usize>,
        /// Classes.
        classes: usize,
        /// Samples per global batch.
        global_batch: usize,
    },
    /// The char-level GPT on a text (a file, or generated from the seed).
    Gpt {
        /// Embedding width.
        width: usize,
        /// Attention heads.
        heads: usize,
        /// Blocks.
        layers: usize,
        /// Tokens per sample.
        context: usize,
        /// Samples per global batch.
        global_batch: usize,
        /// The text; `None`: a corpus generated from the job's seed.
        text: Option<PathBuf>,
    },
}

impl ModelSpec {
    /// The default MLP (1.8M parameters).
    pub fn mlp() -> Self {
        let m = MlpConfig::default();
        Self::Mlp {
            input: m.input,
            hidden: m.hidden,
            classes: m.classes,
            global_batch: BlobsConfig::default().global_batch,
        }
    }

    /// A small MLP (64 → 128 → 128 → 16, 26,896 parameters, global batch
    /// 64): a step costs little more than the control plane's work, so a
    /// test can run many steps and faults on loaded cores.
    pub fn mlp_small() -> Self {
        Self::Mlp {
            input: 64,
            hidden: vec![128, 128],
            classes: 16,
            global_batch: 64,
        }
    }

    /// The default char GPT.
    pub fn gpt(text: Option<PathBuf>) -> Self {
        let g = GptConfig::default();
        let d = CharDataConfig::default();
        Self::Gpt {
            width: g.width,
            heads: g.heads,
            layers: g.layers,
            context: d.context,
            global_batch: d.global_batch,
            text,
        }
    }

    /// The short name (`mlp`, `gpt`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Mlp { .. } => "mlp",
            Self::Gpt { .. } => "gpt",
        }
    }
}

/// A built-in optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum OptimSpec {
    /// SGD with momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum.
        momentum: f64,
    },
    /// AdamW.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl OptimSpec {
    fn config(&self) -> OptimizerConfig {
        match *self {
            Self::Sgd { lr, momentum } => OptimizerConfig::Sgd(SgdConfig {
                lr,
                momentum,
                ..SgdConfig::default()
            }),
            Self::AdamW { lr, weight_decay } => OptimizerConfig::AdamW(AdamWConfig {
                lr,
                weight_decay,
                ..AdamWConfig::default()
            }),
        }
    }
}

/// Everything a member of a training job is built from; every member of a
/// job (and a fault-free reference run) builds the same replica from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The model and its data.
    pub model: ModelSpec,
    /// The optimizer.
    pub optimizer: OptimSpec,
    /// The seed of the initial weights, the data and a generated corpus.
    pub seed: u64,
    /// Members (data-parallel ranks).
    pub world: u32,
}

impl JobSpec {
    /// Builds a replica at step 0.
    pub fn build(&self) -> Result<AnyReplica, Error> {
        let optimizer = self.optimizer.config();
        match &self.model {
            ModelSpec::Mlp {
                input,
                hidden,
                classes,
                global_batch,
            } => {
                let model = MlpConfig {
                    input: *input,
                    hidden: hidden.clone(),
                    classes: *classes,
                    init_seed: self.seed,
                };
                let data = BlobsConfig {
                    input: *input,
                    classes: *classes,
                    global_batch: *global_batch,
                    seed: self.seed.wrapping_add(1),
                    ..BlobsConfig::default()
                };
                crate::mlp_replica(&model, data, &optimizer).map(AnyReplica::Mlp)
            }
            ModelSpec::Gpt {
                width,
                heads,
                layers,
                context,
                global_batch,
                text,
            } => {
                let corpus = match text {
                    Some(path) => Corpus::from_file(path)?,
                    None => Corpus::generated(self.seed, GENERATED_CORPUS_CHARS)?,
                };
                let model = GptConfig {
                    width: *width,
                    heads: *heads,
                    layers: *layers,
                    init_seed: self.seed,
                    ..GptConfig::default()
                };
                let data = CharDataConfig {
                    context: *context,
                    global_batch: *global_batch,
                    seed: self.seed.wrapping_add(1),
                };
                crate::gpt_replica(&model, corpus, data, &optimizer).map(AnyReplica::Gpt)
            }
        }
    }
}

/// A replica of either built-in model.
#[derive(Debug)]
pub enum AnyReplica {
    /// The MLP.
    Mlp(Replica<Mlp, Blobs>),
    /// The char GPT.
    Gpt(Replica<CharGpt, CharData>),
}

macro_rules! each {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            AnyReplica::Mlp($r) => $e,
            AnyReplica::Gpt($r) => $e,
        }
    };
}

impl AnyReplica {
    /// The steps applied.
    pub fn step(&self) -> u64 {
        each!(self, r => r.step())
    }

    /// Gradient elements (the flat layout's length).
    pub fn gradient_len(&self) -> usize {
        each!(self, r => r.layout().len())
    }

    /// Parameters (trainable elements).
    pub fn parameters(&self) -> usize {
        self.gradient_len()
    }

    /// Samples per global batch.
    pub fn global_batch(&self) -> usize {
        use crate::data::DataSource;
        each!(self, r => r.data().global_batch())
    }

    /// Rank `rank`'s gradients of the current step into `out`; its batch's
    /// mean loss.
    pub fn rank_gradients(&self, rank: usize, world: usize, out: &mut [f32]) -> Result<f64, Error> {
        each!(self, r => r.rank_gradients(rank, world, out))
    }

    /// Applies the mean gradients: one optimizer step.
    pub fn apply_mean(&mut self, mean: &[f32]) -> Result<(), Error> {
        each!(self, r => r.apply_mean(mean))
    }

    /// Applies the mean gradients of a flat tensor, without a copy.
    pub fn apply_mean_tensor(&mut self, mean: &tch::Tensor) -> Result<(), Error> {
        each!(self, r => r.apply_mean_tensor(mean))
    }

    /// Drops the current step (the counter advances, nothing is applied).
    pub fn skip_step(&mut self) -> Result<(), Error> {
        each!(self, r => r.skip_step())
    }

    /// One step on the whole global batch in this process.
    pub fn local_step(&mut self) -> Result<f64, Error> {
        each!(self, r => r.local_step())
    }

    /// One step of the single-process reference over `world` simulated
    /// ranks (the oracle the distributed job matches bit for bit).
    pub fn reference_step(
        &mut self,
        reference: &mut crate::Reference,
        world: usize,
    ) -> Result<f64, Error> {
        each!(self, r => reference.step(r, world))
    }

    /// The loss on a batch, without gradients.
    pub fn evaluate(&self, batch: &Batch) -> Result<f64, Error> {
        each!(self, r => r.evaluate(batch))
    }

    /// Everything a replica resumes or heals from.
    pub fn state(&self) -> Result<TrainState, Error> {
        each!(self, r => r.state())
    }

    /// Takes `state` in place.
    pub fn restore(&mut self, state: &TrainState) -> Result<(), Error> {
        each!(self, r => r.restore(state))
    }
}
