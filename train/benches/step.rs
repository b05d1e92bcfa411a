//! Step time of the built-in models on one intra-op thread: one process on
//! the whole global batch (`local_step`) and the single-process data-parallel
//! reference with four simulated ranks on the same global batch.
//!
//! `cargo bench -p regent-train --bench step` (release), or
//! `cargo test -p regent-train --bench step` for a debug build. Prints one
//! line per figure (medians), ratios against the local step of the same
//! run.
#![forbid(unsafe_code)]

use std::time::Instant;

use regent_train::{
    AdamWConfig, Blobs, BlobsConfig, CharData, CharDataConfig, CharGpt, Corpus, DataSource,
    GptConfig, Mlp, MlpConfig, Model, OptimizerConfig, Reference, Replica,
};
use tch::Device;
use tch::nn::VarStore;

/// Seconds of CPU the process has used (user + system, from
/// `/proc/self/stat`, in the kernel's fixed USER_HZ of 100).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses: utime and
    // stime are the 12th and 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Per call, after three untimed ones: the median wall time of `steps`
/// calls (the median, not the mean: the machines are shared) and the mean
/// CPU time (what the call costs without waiting for a core), in ms.
fn time_ms(steps: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..3 {
        f();
    }
    let cpu = cpu_seconds();
    let mut times: Vec<f64> = (0..steps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let cpu_ms = (cpu_seconds() - cpu) * 1e3 / steps as f64;
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], cpu_ms)
}

fn print(name: &str, figure: &str, (wall, cpu): (f64, f64)) {
    println!("train.{name}.{figure}: {wall:.2} ms");
    println!("train.{name}.{figure}_cpu: {cpu:.2} ms");
}

fn bench<M: Model, D: DataSource>(name: &str, steps: usize, build: impl Fn() -> Replica<M, D>) {
    let mut local = build();
    println!("train.{name}.params: {} parameters", local.layout().len());
    let mut step = 0;
    let data = time_ms(steps, || {
        step += 1;
        local.data().batch(step, 0, 1).expect("batch");
    });
    print(name, "global_batch_data", data);
    let batch = local.data().batch(0, 0, 1).expect("batch");
    let forward = time_ms(steps, || {
        local.evaluate(&batch).expect("evaluate");
    });
    print(name, "forward", forward);
    let step = time_ms(steps, || {
        local.local_step().expect("local step");
    });
    print(name, "local_step", step);
    let mut dp = build();
    let mut reference = Reference::new();
    let (ref_wall, ref_cpu) = time_ms(steps, || {
        reference.step(&mut dp, 4).expect("reference step");
    });
    println!(
        "train.{name}.reference_w4_step: {ref_wall:.2} ms (baseline local_step {:.2} ms, ratio {:.2})",
        step.0,
        ref_wall / step.0
    );
    println!(
        "train.{name}.reference_w4_step_cpu: {ref_cpu:.2} ms (baseline local_step_cpu {:.2} ms, ratio {:.2})",
        step.1,
        ref_cpu / step.1
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
    let sgd = OptimizerConfig::Sgd(regent_train::SgdConfig::default());
    bench("mlp_sgd", steps, || {
        let vs = VarStore::new(Device::Cpu);
        let model = Mlp::new(&vs.root(), &MlpConfig::default()).expect("mlp");
        let data = Blobs::new(BlobsConfig::default()).expect("blobs");
        Replica::new(vs, model, data, &sgd).expect("replica")
    });
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
