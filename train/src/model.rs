//! The `Model` trait and seeded parameter creation.

use tch::nn::{Init, Path};
use tch::{Kind, Reduction, Tensor};

use crate::Error;
use crate::data::Batch;
use crate::rng::{Rng, name_key};

/// A module whose variables live in a `tch::nn::VarStore`.
///
/// Both methods must be deterministic functions of the variables and the
/// batch (no dropout, no libtorch random generator), and every sample's
/// contribution to [`loss`](Model::loss) must be a mean over the batch, so
/// that the data-parallel mean of rank gradients is the global batch's
/// gradient.
pub trait Model {
    /// The model's output (logits for the built-in models) on `inputs`.
    fn forward(&self, inputs: &Tensor) -> Result<Tensor, Error>;

    /// The mean loss over the batch's samples: a scalar `f32` tensor that
    /// autograd differentiates with respect to the trainable variables.
    fn loss(&self, batch: &Batch) -> Result<Tensor, Error>;
}

/// Mean cross-entropy of `logits` `[n, classes]` against `targets` `[n]`.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor, Error> {
    Ok(logits.f_log_softmax(-1, Kind::Float)?.f_nll_loss(
        targets,
        None::<Tensor>,
        Reduction::Mean,
        -100,
    )?)
}

/// A trainable `f32` variable `name` under `path`, uniform in
/// `[-bound, bound)`, drawn from the stream of `seed` keyed by the
/// variable's full name: its values depend on nothing else (not on the order
/// variables are created in, not on libtorch's generator).
pub(crate) fn uniform_var(
    path: &Path<'_>,
    name: &str,
    shape: &[i64],
    bound: f32,
    seed: u64,
) -> Result<Tensor, Error> {
    let full = path.path(name);
    let mut rng = Rng::keyed(seed, &[name_key(&full)]);
    let n: i64 = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.symmetric(bound)).collect();
    let init = Tensor::f_from_slice(&values)?.f_reshape(shape)?;
    Ok(path.f_var_copy(name, &init)?)
}

/// A trainable `f32` variable filled with `value`.
pub(crate) fn const_var(
    path: &Path<'_>,
    name: &str,
    shape: &[i64],
    value: f64,
) -> Result<Tensor, Error> {
    Ok(path.f_var(name, shape, Init::Const(value))?)
}

/// `x @ w^T + b`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor, Error> {
    Ok(x.f_linear(w, Some(b))?)
}

/// Checks a dimension of a user's configuration: `1..=max`.
pub(crate) fn dim(value: usize, max: usize, what: &str) -> Result<i64, Error> {
    if value == 0 || value > max {
        return Err(Error::Config(format!(
            "{what} is {value}; it must be in 1..={max}"
        )));
    }
    // max is far below i64::MAX.
    Ok(value as i64)
}
