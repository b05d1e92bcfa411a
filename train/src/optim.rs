//! Optimizers whose state lives in the `VarStore`.
//!
//! tch's built-in optimizers keep their state (momentum, Adam's moments) in
//! libtorch where it can be neither read nor written, so a resumed or healed
//! replica would restart it from zero and drift away from the uninterrupted
//! run. These keep every piece of state as a non-trainable variable of the
//! model's `VarStore`, under the reserved prefix `optim.`, updated in place
//! under `no_grad` (replacing a state tensor would detach it from the store
//! and a checkpoint would carry a stale copy). Checkpointing or healing the
//! store's variables carries the optimizer.
//!
//! State variables (for a parameter named `P`):
//! - SGD with momentum: `optim.momentum.P` (zeros at first);
//! - AdamW: `optim.m.P`, `optim.v.P` (zeros at first) and `optim.step` (an
//!   `i64` scalar, the number of updates so far).

use tch::nn::{Path, VarStore};
use tch::{Kind, Tensor};

use crate::Error;
use crate::layout::Layout;

/// Updates parameters from their gradients.
pub trait Optimizer: Send {
    /// One update of every parameter, in place: `grads` holds one gradient
    /// per parameter of the layout the optimizer was built for, in layout
    /// order (an undefined tensor counts as a zero gradient).
    fn step(&mut self, grads: &[Tensor]) -> Result<(), Error>;
}

/// SGD with momentum, as PyTorch's `torch.optim.SGD` with `dampening = 0`,
/// except that the momentum buffer starts at zero rather than at the first
/// gradient (the same update but for the sign of zero):
///
/// ```text
/// d = g + weight_decay * p
/// buf = momentum * buf + d
/// d = nesterov ? d + momentum * buf : buf      (d itself if momentum == 0)
/// p = p - lr * d
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SgdConfig {
    /// Learning rate, `>= 0`. Default 0.05.
    pub lr: f64,
    /// Momentum in `[0, 1)`. Default 0.9.
    pub momentum: f64,
    /// L2 penalty added to the gradient, `>= 0`. Default 0.
    pub weight_decay: f64,
    /// Nesterov momentum. Default false.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// AdamW (Loshchilov and Hutter): Adam with decoupled weight decay and bias
/// correction, as PyTorch's `torch.optim.AdamW` (`amsgrad = false`):
///
/// ```text
/// t = t + 1
/// p = p * (1 - lr * weight_decay)
/// m = m + (1 - beta1) * (g - m)          (lerp: beta1 * m + (1 - beta1) * g)
/// v = beta2 * v + g * ((1 - beta2) * g)
/// p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate, `>= 0`. Default 1e-3.
    pub lr: f64,
    /// First-moment decay in `[0, 1)`. Default 0.9.
    pub beta1: f64,
    /// Second-moment decay in `[0, 1)`. Default 0.999.
    pub beta2: f64,
    /// Added to the denominator, `> 0`. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, `>= 0` with `lr * weight_decay <= 1`.
    /// Default 0.01.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// One of the built-in optimizers.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// SGD with momentum.
    Sgd(SgdConfig),
    /// AdamW.
    AdamW(AdamWConfig),
}

impl OptimizerConfig {
    /// Builds the optimizer over `layout`'s parameters, adding its state
    /// variables to `vs`.
    pub fn build(&self, vs: &VarStore, layout: &Layout) -> Result<Box<dyn Optimizer>, Error> {
        Ok(match self {
            OptimizerConfig::Sgd(c) => Box::new(Sgd::new(vs, layout, c.clone())?),
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(vs, layout, c.clone())?),
        })
    }
}

fn check(ok: bool, what: &str) -> Result<(), Error> {
    if ok {
        Ok(())
    } else {
        Err(Error::Config(what.to_string()))
    }
}

/// Refuses a store that already has `optim.` variables (a second optimizer
/// or a model using the prefix): tch would silently rename ours.
fn check_prefix_free(vs: &VarStore) -> Result<(), Error> {
    match vs.variables().into_keys().find(|n| n.starts_with("optim.")) {
        Some(name) => Err(Error::ReservedName(name)),
        None => Ok(()),
    }
}

/// A zero state variable named `group.<param name>`, shaped like the
/// parameter.
fn state_like(optim: &Path<'_>, group: &str, name: &str, shape: &[i64]) -> Result<Tensor, Error> {
    let mut path = optim.sub(group);
    let mut parts: Vec<&str> = name.split('.').collect();
    // Names come from a VarStore, so they are non-empty dot-joined parts.
    let last = parts.pop().unwrap_or(name);
    for p in parts {
        path = path.sub(p);
    }
    Ok(path.f_zeros_no_train(last, shape)?)
}

fn zero_if_undefined(g: &Tensor, p: &Tensor) -> Result<Tensor, Error> {
    Ok(if g.defined() {
        g.shallow_clone()
    } else {
        p.f_zeros_like()?
    })
}

fn check_count(grads: &[Tensor], params: &[Tensor]) -> Result<(), Error> {
    if grads.len() != params.len() {
        return Err(Error::BufferLength {
            got: grads.len(),
            want: params.len(),
        });
    }
    Ok(())
}

/// SGD with momentum (see [`SgdConfig`]).
#[derive(Debug)]
pub struct Sgd {
    config: SgdConfig,
    params: Vec<Tensor>,
    momentum: Vec<Tensor>,
}

impl Sgd {
    /// The optimizer of `layout`'s parameters; adds `optim.momentum.*` to
    /// `vs` when `momentum > 0`.
    pub fn new(vs: &VarStore, layout: &Layout, config: SgdConfig) -> Result<Sgd, Error> {
        check(
            config.lr.is_finite() && config.lr >= 0.0,
            "sgd lr must be finite and >= 0",
        )?;
        check(
            (0.0..1.0).contains(&config.momentum),
            "sgd momentum must be in [0, 1)",
        )?;
        check(
            config.weight_decay.is_finite() && config.weight_decay >= 0.0,
            "sgd weight_decay must be finite and >= 0",
        )?;
        check_prefix_free(vs)?;
        let optim = vs.root().sub("optim");
        let mut momentum = Vec::new();
        if config.momentum > 0.0 {
            for e in layout.entries() {
                momentum.push(state_like(&optim, "momentum", &e.name, &e.shape)?);
            }
        }
        Ok(Sgd {
            config,
            params: layout.params().iter().map(Tensor::shallow_clone).collect(),
            momentum,
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, grads: &[Tensor]) -> Result<(), Error> {
        check_count(grads, &self.params)?;
        let c = &self.config;
        tch::no_grad(|| {
            for (i, (p, g)) in self.params.iter_mut().zip(grads).enumerate() {
                let mut d = zero_if_undefined(g, p)?;
                if c.weight_decay != 0.0 {
                    d = d.f_add(&p.f_mul_scalar(c.weight_decay)?)?;
                }
                if let Some(buf) = self.momentum.get_mut(i) {
                    let _ = buf.f_mul_scalar_(c.momentum)?;
                    let _ = buf.f_add_(&d)?;
                    d = if c.nesterov {
                        d.f_add(&buf.f_mul_scalar(c.momentum)?)?
                    } else {
                        buf.shallow_clone()
                    };
                }
                let _ = p.f_sub_(&d.f_mul_scalar(c.lr)?)?;
            }
            Ok(())
        })
    }
}

/// AdamW (see [`AdamWConfig`]).
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: Tensor,
}

impl AdamW {
    /// The optimizer of `layout`'s parameters; adds `optim.m.*`,
    /// `optim.v.*` and `optim.step` to `vs`.
    pub fn new(vs: &VarStore, layout: &Layout, config: AdamWConfig) -> Result<AdamW, Error> {
        check(
            config.lr.is_finite() && config.lr >= 0.0,
            "adamw lr must be finite and >= 0",
        )?;
        check(
            (0.0..1.0).contains(&config.beta1),
            "adamw beta1 must be in [0, 1)",
        )?;
        check(
            (0.0..1.0).contains(&config.beta2),
            "adamw beta2 must be in [0, 1)",
        )?;
        check(
            config.eps.is_finite() && config.eps > 0.0,
            "adamw eps must be finite and > 0",
        )?;
        check(
            config.weight_decay.is_finite()
                && config.weight_decay >= 0.0
                && config.lr * config.weight_decay <= 1.0,
            "adamw weight_decay must be finite, >= 0, and lr * weight_decay <= 1",
        )?;
        check_prefix_free(vs)?;
        let optim = vs.root().sub("optim");
        let mut m = Vec::with_capacity(layout.entries().len());
        let mut v = Vec::with_capacity(layout.entries().len());
        for e in layout.entries() {
            m.push(state_like(&optim, "m", &e.name, &e.shape)?);
            v.push(state_like(&optim, "v", &e.name, &e.shape)?);
        }
        let t = optim.add(
            "step",
            Tensor::f_zeros([], (Kind::Int64, vs.device()))?,
            false,
        );
        Ok(AdamW {
            config,
            params: layout.params().iter().map(Tensor::shallow_clone).collect(),
            m,
            v,
            t,
        })
    }

    /// Updates made so far (the `optim.step` variable).
    pub fn steps(&self) -> Result<i64, Error> {
        Ok(self.t.f_int64_value(&[])?)
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, grads: &[Tensor]) -> Result<(), Error> {
        check_count(grads, &self.params)?;
        let c = &self.config;
        tch::no_grad(|| {
            let _ = self.t.f_add_scalar_(1)?;
            let t = self.t.f_int64_value(&[])?;
            if t <= 0 {
                return Err(Error::State(format!("optim.step is {t} after an update")));
            }
            let t = i32::try_from(t).unwrap_or(i32::MAX);
            let bias1 = 1.0 - c.beta1.powi(t);
            let bias2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
            let step_size = c.lr / bias1;
            for (i, (p, g)) in self.params.iter_mut().zip(grads).enumerate() {
                let g = zero_if_undefined(g, p)?;
                if c.weight_decay != 0.0 {
                    let _ = p.f_mul_scalar_(1.0 - c.lr * c.weight_decay)?;
                }
                // Three temporaries per parameter; the rest is in place.
                let m = &mut self.m[i];
                let _ = m.f_lerp_(&g, 1.0 - c.beta1)?;
                let v = &mut self.v[i];
                let _ = v.f_mul_scalar_(c.beta2)?;
                let _ = v.f_addcmul_(&g, &g.f_mul_scalar(1.0 - c.beta2)?)?;
                let mut denom = v.f_sqrt()?;
                let _ = denom.f_div_scalar_(bias2_sqrt)?;
                let _ = denom.f_add_scalar_(c.eps)?;
                let mut update = m.f_div(&denom)?;
                let _ = update.f_mul_scalar_(step_size)?;
                let _ = p.f_sub_(&update)?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use tch::nn;
    use tch::{Device, Tensor};

    use super::*;
    use crate::rng::Rng;

    fn weights(vs: &VarStore) -> Tensor {
        let mut rng = Rng::keyed(3, &[]);
        let init: Vec<f32> = (0..16).map(|_| rng.symmetric(1.0)).collect();
        vs.root().var_copy("w", &Tensor::from_slice(&init))
    }

    fn loss(w: &Tensor, step: u64) -> Tensor {
        let mut rng = Rng::keyed(4, &[step]);
        let x: Vec<f32> = (0..16).map(|_| rng.normal()).collect();
        let x = Tensor::from_slice(&x);
        ((w * &x).sum(tch::Kind::Float) - 1.0).square() + (w * w).sum(tch::Kind::Float) * 0.01
    }

    /// Ours against libtorch's own `torch::optim` on the same gradients.
    fn against_libtorch(ours: OptimizerConfig, theirs: impl nn::OptimizerConfig, lr: f64) {
        tch::set_num_threads(1);
        let vs_a = VarStore::new(Device::Cpu);
        let w_a = weights(&vs_a);
        let mut opt_a = theirs.build(&vs_a, lr).unwrap();
        let vs_b = VarStore::new(Device::Cpu);
        let w_b = weights(&vs_b);
        let layout = Layout::of(&vs_b).unwrap();
        let mut opt_b = ours.build(&vs_b, &layout).unwrap();
        for step in 0..40 {
            opt_a.backward_step(&loss(&w_a, step));
            let g = Tensor::run_backward(&[loss(&w_b, step)], &[&w_b], false, false);
            opt_b.step(&g).unwrap();
            let a = Vec::<f32>::try_from(&w_a).unwrap();
            let b = Vec::<f32>::try_from(&w_b).unwrap();
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "step {step}: {x} vs {y}"
                );
            }
        }
        assert!(
            !Vec::<f32>::try_from(&w_b)
                .unwrap()
                .iter()
                .any(|x| x.is_nan())
        );
    }

    #[test]
    fn sgd_matches_torch_optim_sgd() {
        let ours = SgdConfig {
            lr: 0.02,
            momentum: 0.9,
            weight_decay: 0.001,
            nesterov: false,
        };
        against_libtorch(
            OptimizerConfig::Sgd(ours),
            nn::Sgd {
                momentum: 0.9,
                dampening: 0.0,
                wd: 0.001,
                nesterov: false,
            },
            0.02,
        );
        let nesterov = SgdConfig {
            lr: 0.02,
            momentum: 0.8,
            weight_decay: 0.0,
            nesterov: true,
        };
        against_libtorch(
            OptimizerConfig::Sgd(nesterov),
            nn::Sgd {
                momentum: 0.8,
                dampening: 0.0,
                wd: 0.0,
                nesterov: true,
            },
            0.02,
        );
        let plain = SgdConfig {
            lr: 0.02,
            momentum: 0.0,
            ..SgdConfig::default()
        };
        against_libtorch(OptimizerConfig::Sgd(plain), nn::Sgd::default(), 0.02);
    }

    #[test]
    fn adamw_matches_torch_optim_adamw() {
        let ours = AdamWConfig {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let theirs = nn::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            wd: 0.1,
            eps: 1e-8,
            amsgrad: false,
        };
        against_libtorch(OptimizerConfig::AdamW(ours), theirs, 0.01);
    }

    #[test]
    fn state_lives_in_the_store_and_is_updated_in_place() {
        let vs = VarStore::new(Device::Cpu);
        let w = weights(&vs);
        let layout = Layout::of(&vs).unwrap();
        let mut opt = AdamW::new(&vs, &layout, AdamWConfig::default()).unwrap();
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        assert_eq!(names, ["optim.m.w", "optim.step", "optim.v.w", "w"]);
        for step in 0..3 {
            let g = Tensor::run_backward(&[loss(&w, step)], &[&w], false, false);
            opt.step(&g).unwrap();
        }
        // The store's tensors are the ones the optimizer updated.
        let vars = vs.variables();
        assert_eq!(vars["optim.step"].int64_value(&[]), 3);
        assert_eq!(opt.steps().unwrap(), 3);
        assert!(
            vars["optim.m.w"]
                .abs()
                .sum(tch::Kind::Float)
                .double_value(&[])
                > 0.0
        );
        assert!(
            vars["optim.v.w"]
                .abs()
                .sum(tch::Kind::Float)
                .double_value(&[])
                > 0.0
        );
    }

    #[test]
    fn names_nest_like_the_parameters_and_collisions_are_refused() {
        let vs = VarStore::new(Device::Cpu);
        let _ = vs
            .root()
            .sub("a")
            .sub("b")
            .var("w", &[2], nn::Init::Const(0.0));
        let layout = Layout::of(&vs).unwrap();
        Sgd::new(&vs, &layout, SgdConfig::default()).unwrap();
        assert!(vs.variables().contains_key("optim.momentum.a.b.w"));
        assert!(matches!(
            Sgd::new(&vs, &layout, SgdConfig::default()),
            Err(Error::ReservedName(_))
        ));
    }

    #[test]
    fn bad_configurations_are_refused() {
        let vs = VarStore::new(Device::Cpu);
        let _ = weights(&vs);
        let layout = Layout::of(&vs).unwrap();
        for c in [
            SgdConfig {
                lr: f64::NAN,
                ..SgdConfig::default()
            },
            SgdConfig {
                momentum: 1.0,
                ..SgdConfig::default()
            },
            SgdConfig {
                weight_decay: -1.0,
                ..SgdConfig::default()
            },
        ] {
            assert!(matches!(Sgd::new(&vs, &layout, c), Err(Error::Config(_))));
        }
        for c in [
            AdamWConfig {
                beta1: 1.0,
                ..AdamWConfig::default()
            },
            AdamWConfig {
                beta2: -0.1,
                ..AdamWConfig::default()
            },
            AdamWConfig {
                eps: 0.0,
                ..AdamWConfig::default()
            },
            AdamWConfig {
                lr: 1.0,
                weight_decay: 2.0,
                ..AdamWConfig::default()
            },
        ] {
            assert!(matches!(AdamW::new(&vs, &layout, c), Err(Error::Config(_))));
        }
        let mut opt = Sgd::new(&vs, &layout, SgdConfig::default()).unwrap();
        assert!(matches!(opt.step(&[]), Err(Error::BufferLength { .. })));
    }
}
