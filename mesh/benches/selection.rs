//! Micro-benchmarks of selections on a 100,000-member shape
//! (`{hosts=12500, gpus=8}`): evaluating `*`, a strided box, a non-box
//! selection (bitset path) and a box restricted to one host's region, and
//! parsing and printing a typical selection.
//!
//! The baseline, measured in the same run, is collecting 100,000 ranks into a
//! `Vec` (what any evaluation of `*` must at least do); compare the
//! `eval_*_100k` times against it.
//!
//! Run: `cargo bench -p regent-mesh --bench selection`.

use std::hint::black_box;

use criterion::{Criterion, criterion_main};
use regent_mesh::{Rank, Selection, Shape};

const TYPICAL: &str = "hosts=0..2,gpus=* | first(gpus: hosts=4..) & gpus=0..8:2";

fn selections(c: &mut Criterion) {
    let shape = Shape::new([("hosts", 12_500), ("gpus", 8)]).expect("a valid shape");
    assert_eq!(shape.len(), 100_000);
    let parse = |text: &str| -> Selection { text.parse().expect("a valid selection") };
    let all = parse("*");
    let strided = parse("hosts=0..12500:3,gpus=1..8:2");
    let mixed = parse("hosts=0..100 | first(gpus: hosts=5000..) & gpus=0..4");
    let region = shape.slice("hosts", 6000..6001).expect("a valid slice");

    let mut group = c.benchmark_group("selection");
    group.bench_function("baseline_collect_100k_ranks", |b| {
        b.iter(|| (0..black_box(100_000u32)).map(Rank).collect::<Vec<_>>())
    });
    group.bench_function("eval_all_100k", |b| {
        b.iter(|| black_box(&all).eval(&shape, 0).expect("evaluates"))
    });
    group.bench_function("eval_strided_100k", |b| {
        b.iter(|| black_box(&strided).eval(&shape, 0).expect("evaluates"))
    });
    group.bench_function("eval_union_first_100k", |b| {
        b.iter(|| black_box(&mixed).eval(&shape, 0).expect("evaluates"))
    });
    group.bench_function("eval_in_one_host_strided_100k", |b| {
        b.iter(|| {
            black_box(&strided)
                .eval_in(&shape, &region, 0)
                .expect("evaluates")
        })
    });
    group.bench_function("parse_typical", |b| {
        b.iter(|| black_box(TYPICAL).parse::<Selection>().expect("parses"))
    });
    let typical = parse(TYPICAL);
    group.bench_function("print_typical", |b| {
        b.iter(|| black_box(&typical).to_string())
    });
    group.finish();
}

/// `criterion_group!` makes an undocumented `pub fn`; keep it private here.
#[allow(unreachable_pub, reason = "criterion_group! declares a pub fn")]
mod group {
    criterion::criterion_group!(benches, super::selections);
}

criterion_main!(group::benches);
