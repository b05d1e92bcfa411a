//! Bit-identity of training in one process: same seed, same result; the
//! data-parallel reference is the rank-order mean and the order matters; a
//! restored state continues exactly; the built-in models learn.

mod common;

use common::{Opt, assert_same, differ, one_thread, small_gpt, small_mlp};
use regent_train::reduce::mean_in_rank_order;
use regent_train::{
    Blobs, DataSource, Error, Mlp, MlpConfig, Model, OptimizerConfig, Reference, Replica,
    SgdConfig, TrainState,
};
use tch::Device;
use tch::nn::{Init, VarStore};

const STEPS: u64 = 12;

fn run_reference<M: Model, D: DataSource>(
    mut r: Replica<M, D>,
    world: usize,
    steps: u64,
) -> TrainState {
    let mut reference = Reference::new();
    for _ in 0..steps {
        reference.step(&mut r, world).unwrap();
    }
    r.state().unwrap()
}

fn run_local<M: Model, D: DataSource>(mut r: Replica<M, D>, steps: u64) -> TrainState {
    for _ in 0..steps {
        r.local_step().unwrap();
    }
    r.state().unwrap()
}

/// The steps of the reference written out with the public pieces, the ranks'
/// buffers reduced in `order`.
fn run_ordered<M: Model, D: DataSource>(
    mut r: Replica<M, D>,
    order: &[usize],
    steps: u64,
) -> TrainState {
    let world = order.len();
    let len = r.layout().len();
    for _ in 0..steps {
        let mut parts = vec![vec![0f32; len]; world];
        for (rank, part) in parts.iter_mut().enumerate() {
            r.rank_gradients(rank, world, part).unwrap();
        }
        let ordered: Vec<&[f32]> = order.iter().map(|&i| parts[i].as_slice()).collect();
        let mut mean = vec![0f32; len];
        mean_in_rank_order(&ordered, &mut mean).unwrap();
        r.apply_mean(&mean).unwrap();
    }
    r.state().unwrap()
}

#[test]
fn two_runs_with_the_same_seed_are_equal() {
    one_thread();
    for opt in Opt::ALL {
        let a = run_local(small_mlp(opt), STEPS);
        assert_same(
            &a,
            &run_local(small_mlp(opt), STEPS),
            &format!("mlp {opt:?} local"),
        );
        assert_eq!(a.step, STEPS);
        let a = run_local(small_gpt(opt), STEPS);
        assert_same(
            &a,
            &run_local(small_gpt(opt), STEPS),
            &format!("gpt {opt:?} local"),
        );
        // The run moved: a state differs from the initial one.
        assert!(differ(&a, &small_gpt(opt).state().unwrap()) || a.step != 0);
    }
}

#[test]
fn the_four_rank_reference_is_equal_across_runs() {
    one_thread();
    for opt in Opt::ALL {
        let a = run_reference(small_mlp(opt), 4, STEPS);
        assert_same(
            &a,
            &run_reference(small_mlp(opt), 4, STEPS),
            &format!("mlp {opt:?} w4"),
        );
        let a = run_reference(small_gpt(opt), 4, STEPS);
        assert_same(
            &a,
            &run_reference(small_gpt(opt), 4, STEPS),
            &format!("gpt {opt:?} w4"),
        );
    }
}

#[test]
fn the_reference_is_the_rank_order_mean_and_another_order_differs() {
    one_thread();
    let a = run_reference(small_mlp(Opt::Sgd), 4, STEPS);
    assert_same(
        &a,
        &run_ordered(small_mlp(Opt::Sgd), &[0, 1, 2, 3], STEPS),
        "mlp rank order",
    );
    let reversed = run_ordered(small_mlp(Opt::Sgd), &[3, 2, 1, 0], STEPS);
    assert!(
        differ(&a, &reversed),
        "summing in reverse rank order gave the same bits"
    );

    let a = run_reference(small_gpt(Opt::AdamW), 4, STEPS);
    assert_same(
        &a,
        &run_ordered(small_gpt(Opt::AdamW), &[0, 1, 2, 3], STEPS),
        "gpt rank order",
    );
    // Addition commutes, so ranks 0 and 1 may trade places; 1 and 2 may not.
    let commuted = run_ordered(small_gpt(Opt::AdamW), &[1, 0, 2, 3], STEPS);
    assert_same(&a, &commuted, "gpt ranks 0 and 1 swapped");
    let swapped = run_ordered(small_gpt(Opt::AdamW), &[0, 2, 1, 3], STEPS);
    assert!(
        differ(&a, &swapped),
        "swapping ranks 1 and 2 in the sum gave the same bits"
    );
}

#[test]
fn a_world_of_one_is_the_local_step() {
    one_thread();
    for opt in Opt::ALL {
        let a = run_reference(small_mlp(opt), 1, STEPS);
        assert_same(
            &a,
            &run_local(small_mlp(opt), STEPS),
            &format!("mlp {opt:?}"),
        );
        let a = run_reference(small_gpt(opt), 1, STEPS);
        assert_same(
            &a,
            &run_local(small_gpt(opt), STEPS),
            &format!("gpt {opt:?}"),
        );
    }
}

/// The mean of the rank gradients is the global batch's gradient for worlds
/// that divide the batch and for worlds that do not (the loss scale).
#[test]
fn every_world_averages_to_the_global_gradient() {
    one_thread();
    let r = small_mlp(Opt::Sgd);
    let len = r.layout().len();
    let mut global = vec![0f32; len];
    r.rank_gradients(0, 1, &mut global).unwrap();
    let norm: f64 = global
        .iter()
        .map(|&g| f64::from(g).powi(2))
        .sum::<f64>()
        .sqrt();
    for world in [2, 3, 4, 5, 7] {
        let mut parts = vec![vec![0f32; len]; world];
        for (rank, part) in parts.iter_mut().enumerate() {
            r.rank_gradients(rank, world, part).unwrap();
        }
        let parts: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let mut mean = vec![0f32; len];
        mean_in_rank_order(&parts, &mut mean).unwrap();
        let err: f64 = mean
            .iter()
            .zip(&global)
            .map(|(&m, &g)| f64::from(m - g).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            err <= 1e-5 * norm,
            "world {world}: |mean - global| = {err}, |global| = {norm}"
        );
    }
}

#[test]
fn a_restored_state_continues_like_the_uninterrupted_run() {
    one_thread();
    for opt in Opt::ALL {
        let mut first = small_mlp(opt);
        let mut reference = Reference::new();
        for _ in 0..5 {
            reference.step(&mut first, 4).unwrap();
        }
        let at_five =
            TrainState::from_named_tensors(first.state().unwrap().to_named_tensors()).unwrap();
        for _ in 5..STEPS {
            reference.step(&mut first, 4).unwrap();
        }
        let mut resumed = small_mlp(opt);
        resumed.restore(&at_five).unwrap();
        assert_eq!(resumed.step(), 5);
        let resumed = run_reference(resumed, 4, STEPS - 5);
        assert_same(
            &first.state().unwrap(),
            &resumed,
            &format!("mlp {opt:?} resumed"),
        );
    }
}

#[test]
fn reserved_names_and_foreign_states_are_refused() {
    one_thread();
    let vs = VarStore::new(Device::Cpu);
    let config = MlpConfig {
        input: 32,
        hidden: vec![8],
        classes: 10,
        init_seed: 0,
    };
    let model = Mlp::new(&vs.root(), &config).unwrap();
    let _ = vs.root().sub("train").var("x", &[1], Init::Const(0.0));
    let data = Blobs::new(regent_train::BlobsConfig {
        input: 32,
        classes: 10,
        ..Default::default()
    })
    .unwrap();
    let opt = OptimizerConfig::Sgd(SgdConfig::default());
    assert!(matches!(
        Replica::new(vs, model, data, &opt),
        Err(Error::ReservedName(_))
    ));

    let mut mlp = small_mlp(Opt::Sgd);
    let mut state = small_mlp(Opt::Sgd).state().unwrap();
    state.data_seed ^= 1;
    assert!(matches!(mlp.restore(&state), Err(Error::State(_))));
    let other = small_mlp(Opt::AdamW).state().unwrap();
    assert!(
        matches!(mlp.restore(&other), Err(Error::State(_))),
        "adamw state into an sgd replica"
    );
    assert_eq!(mlp.step(), 0);

    // A state at the last step cannot take another.
    let mut last = small_mlp(Opt::Sgd).state().unwrap();
    last.step = u64::MAX;
    mlp.restore(&last).unwrap();
    assert!(matches!(mlp.local_step(), Err(Error::State(_))));
    let mut reference = Reference::new();
    assert!(matches!(reference.step(&mut mlp, 2), Err(Error::State(_))));
    assert_eq!(mlp.step(), u64::MAX);
}
