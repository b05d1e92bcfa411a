//! The built-in jobs of the command line: the MLP on blobs and the char GPT
//! on a text, each a replica built from configurations that agree.

use tch::Device;
use tch::nn::VarStore;

use crate::Error;
use crate::corpus::{CharData, CharDataConfig, Corpus};
use crate::gpt::{CharGpt, GptConfig};
use crate::mlp::{Blobs, BlobsConfig, Mlp, MlpConfig};
use crate::optim::OptimizerConfig;
use crate::replica::Replica;

/// Characters of the generated corpus used when no text file is given.
pub const GENERATED_CORPUS_CHARS: usize = 1 << 20;

/// The MLP replica of `model` on blobs of `data`; the data's input and class
/// counts must be the model's.
pub fn mlp_replica(
    model: &MlpConfig,
    data: BlobsConfig,
    optimizer: &OptimizerConfig,
) -> Result<Replica<Mlp, Blobs>, Error> {
    if model.input != data.input || model.classes != data.classes {
        return Err(Error::Config(format!(
            "the mlp takes {} features into {} classes, the blobs have {} and {}",
            model.input, model.classes, data.input, data.classes
        )));
    }
    let vs = VarStore::new(Device::Cpu);
    let mlp = Mlp::new(&vs.root(), model)?;
    Replica::new(vs, mlp, Blobs::new(data)?, optimizer)
}

/// The char GPT replica over `corpus`: the model's vocabulary is the
/// corpus's and its context the data's (both overwrite `model`'s).
pub fn gpt_replica(
    model: &GptConfig,
    corpus: Corpus,
    data: CharDataConfig,
    optimizer: &OptimizerConfig,
) -> Result<Replica<CharGpt, CharData>, Error> {
    let config = GptConfig {
        vocab: corpus.vocab().len(),
        context: data.context,
        ..model.clone()
    };
    let vs = VarStore::new(Device::Cpu);
    let gpt = CharGpt::new(&vs.root(), &config)?;
    Replica::new(vs, gpt, CharData::new(corpus, data)?, optimizer)
}
