//! Builders shared by the test binaries: small versions of the built-in
//! models with each optimizer, and bitwise state comparison.
#![allow(dead_code, unreachable_pub)]

use regent_train::{
    AdamWConfig, Blobs, BlobsConfig, CharData, CharDataConfig, CharGpt, Corpus, GptConfig, Mlp,
    MlpConfig, OptimizerConfig, Replica, SgdConfig, TrainState,
};
use tch::Device;
use tch::nn::VarStore;

/// One intra-op and one inter-op thread (bit-identity needs a fixed count).
/// libtorch takes the inter-op count once per process, before any parallel
/// work.
pub fn one_thread() {
    static INTEROP: std::sync::Once = std::sync::Once::new();
    INTEROP.call_once(|| tch::set_num_interop_threads(1));
    tch::set_num_threads(1);
}

/// The optimizers under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opt {
    Sgd,
    AdamW,
}

impl Opt {
    pub const ALL: [Opt; 2] = [Opt::Sgd, Opt::AdamW];

    pub fn config(self) -> OptimizerConfig {
        match self {
            Opt::Sgd => OptimizerConfig::Sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 1e-4,
                nesterov: false,
            }),
            Opt::AdamW => OptimizerConfig::AdamW(AdamWConfig {
                lr: 3e-3,
                ..AdamWConfig::default()
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Opt::Sgd => "sgd",
            Opt::AdamW => "adamw",
        }
    }

    pub fn parse(s: &str) -> Opt {
        match s {
            "sgd" => Opt::Sgd,
            "adamw" => Opt::AdamW,
            _ => panic!("unknown optimizer {s}"),
        }
    }
}

pub type MlpReplica = Replica<Mlp, Blobs>;
pub type GptReplica = Replica<CharGpt, CharData>;

/// A small MLP on blobs (global batch 32).
pub fn small_mlp(opt: Opt) -> MlpReplica {
    let vs = VarStore::new(Device::Cpu);
    let config = MlpConfig {
        input: 32,
        hidden: vec![64, 64],
        classes: 10,
        init_seed: 11,
    };
    let model = Mlp::new(&vs.root(), &config).unwrap();
    let data = Blobs::new(BlobsConfig {
        input: 32,
        classes: 10,
        global_batch: 32,
        noise: 1.5,
        seed: 12,
    })
    .unwrap();
    Replica::new(vs, model, data, &opt.config()).unwrap()
}

/// A small char GPT on the generated corpus (global batch 8 of 16 tokens).
pub fn small_gpt(opt: Opt) -> GptReplica {
    let corpus = Corpus::generated(13, 20_000).unwrap();
    let config = GptConfig {
        vocab: corpus.vocab().len(),
        context: 16,
        width: 32,
        heads: 2,
        layers: 2,
        tied_head: false,
        init_seed: 14,
    };
    let vs = VarStore::new(Device::Cpu);
    let model = CharGpt::new(&vs.root(), &config).unwrap();
    let data = CharData::new(
        corpus,
        CharDataConfig {
            context: 16,
            global_batch: 8,
            seed: 15,
        },
    )
    .unwrap();
    Replica::new(vs, model, data, &opt.config()).unwrap()
}

/// Panics with the first difference unless the states are equal bit for bit.
pub fn assert_same(a: &TrainState, b: &TrainState, what: &str) {
    if let Some(d) = a.first_difference(b).unwrap() {
        panic!("{what}: states differ: {d:?}");
    }
}

/// Whether the states differ in any bit.
pub fn differ(a: &TrainState, b: &TrainState) -> bool {
    a.first_difference(b).unwrap().is_some()
}
