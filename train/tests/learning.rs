//! The built-in models, at their default sizes, learn: the loss on a batch
//! never trained on falls well below its initial value within a few hundred
//! steps on one thread.

mod common;

use common::one_thread;
use regent_train::{
    AdamWConfig, BlobsConfig, CharDataConfig, Corpus, DataSource, GptConfig, MlpConfig, Model,
    OptimizerConfig, Replica, SgdConfig, gpt_replica, mlp_replica,
};

/// Trains `steps` local steps; returns the held-out loss before and after.
fn held_out<M: Model, D: DataSource>(mut r: Replica<M, D>, steps: u64) -> (f64, f64) {
    // A step index training never reaches.
    let held = r.data().batch(u64::MAX, 0, 1).unwrap();
    let before = r.evaluate(&held).unwrap();
    for _ in 0..steps {
        r.local_step().unwrap();
    }
    (before, r.evaluate(&held).unwrap())
}

#[test]
fn the_mlp_learns_with_sgd_and_adamw() {
    one_thread();
    for opt in [
        OptimizerConfig::Sgd(SgdConfig::default()),
        OptimizerConfig::AdamW(AdamWConfig::default()),
    ] {
        let r = mlp_replica(&MlpConfig::default(), BlobsConfig::default(), &opt).unwrap();
        let (before, after) = held_out(r, 150);
        println!("mlp {opt:?}: held-out loss {before:.3} -> {after:.3}");
        assert!(after < 0.5 * before, "mlp {opt:?}: {before} -> {after}");
    }
}

#[test]
fn the_char_gpt_learns_the_generated_corpus() {
    one_thread();
    let corpus = Corpus::generated(1, 200_000).unwrap();
    let opt = OptimizerConfig::AdamW(AdamWConfig {
        lr: 3e-3,
        ..AdamWConfig::default()
    });
    let r = gpt_replica(
        &GptConfig::default(),
        corpus,
        CharDataConfig::default(),
        &opt,
    )
    .unwrap();
    let (before, after) = held_out(r, 200);
    println!("gpt: held-out loss {before:.3} -> {after:.3}");
    assert!(after < 0.6 * before, "gpt: {before} -> {after}");
}
