//! Step time of the built-in models on one intra-op thread: one process on
//! the whole global batch (`local_step`) and the single-process data-parallel
//! reference with four simulated ranks on the same global batch.
//!
//! `cargo bench -p regent-train --bench step` (release), or
//! `cargo test -p regent-train --bench step` for a debug build. Prints one
//! line per figure, ratios against the local step of the same run.
#![forbid(unsafe_code)]

use std::time::Instant;

use regent_train::{
    AdamWConfig, Blobs, BlobsConfig, CharData, CharDataConfig, CharGpt, Corpus, DataSource,
    GptConfig, Mlp, MlpConfig, Model, OptimizerConfig, Reference, Replica,
};
use tch::Device;
use tch::nn::VarStore;

fn time_ms(steps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let start = Instant::now();
    for _ in 0..steps {
        f();
    }
    start.elapsed().as_secs_f64() * 1e3 / steps as f64
}

fn bench<M: Model, D: DataSource>(name: &str, steps: usize, build: impl Fn() -> Replica<M, D>) {
    let mut local = build();
    println!("train.{name}.params: {} parameters", local.layout().len());
    let mut step = 0;
    let data_ms = time_ms(steps, || {
        step += 1;
        local.data().batch(step, 0, 1).expect("batch");
    });
    println!("train.{name}.global_batch_data: {data_ms:.2} ms");
    let batch = local.data().batch(0, 0, 1).expect("batch");
    let fwd_ms = time_ms(steps, || {
        local.evaluate(&batch).expect("evaluate");
    });
    println!("train.{name}.forward: {fwd_ms:.2} ms");
    let local_ms = time_ms(steps, || {
        local.local_step().expect("local step");
    });
    println!("train.{name}.local_step: {local_ms:.2} ms");
    let mut dp = build();
    let mut reference = Reference::new();
    let ref_ms = time_ms(steps, || {
        reference.step(&mut dp, 4).expect("reference step");
    });
    println!(
        "train.{name}.reference_w4_step: {ref_ms:.2} ms (baseline local_step {local_ms:.2} ms, ratio {:.2})",
        ref_ms / local_ms
    );
}

fn main() {
    tch::set_num_threads(1);
    tch::set_num_interop_threads(1);
    let steps = if std::env::args().any(|a| a == "--bench") {
        30
    } else {
        10
    };
    let opt = OptimizerConfig::AdamW(AdamWConfig::default());
    bench("mlp", steps, || {
        let vs = VarStore::new(Device::Cpu);
        let model = Mlp::new(&vs.root(), &MlpConfig::default()).expect("mlp");
        let data = Blobs::new(BlobsConfig::default()).expect("blobs");
        Replica::new(vs, model, data, &opt).expect("replica")
    });
    bench("gpt", steps, || {
        let corpus = Corpus::generated(1, 200_000).expect("corpus");
        let config = GptConfig {
            vocab: corpus.vocab().len(),
            ..GptConfig::default()
        };
        let vs = VarStore::new(Device::Cpu);
        let model = CharGpt::new(&vs.root(), &config).expect("gpt");
        let data = CharData::new(corpus, CharDataConfig::default()).expect("data");
        Replica::new(vs, model, data, &opt).expect("replica")
    });
}
