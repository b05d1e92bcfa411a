//! `TrainState`: everything a replica needs to resume from a checkpoint or
//! to heal from a live peer, as a list of named tensors.

use std::collections::HashMap;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::Error;

/// Name of the step counter in [`TrainState::to_named_tensors`].
pub const STEP_NAME: &str = "train.step";
/// Name of the data seed in [`TrainState::to_named_tensors`].
pub const DATA_SEED_NAME: &str = "train.data_seed";

/// Most variables a state may hold (a bound on what a decoder accepts).
pub const MAX_STATE_VARIABLES: usize = 1 << 20;

/// A replica's training state at a step boundary: the number of steps done
/// (the next step to run is `step`), the data cursor (for a pure data source,
/// its seed: with `step` it names the next batch), and every variable of the
/// `VarStore` — parameters and optimizer state — sorted by name.
///
/// The tensors are copies: a captured state does not change when training
/// goes on.
#[derive(Debug)]
pub struct TrainState {
    /// Steps done.
    pub step: u64,
    /// The data source's seed.
    pub data_seed: u64,
    /// `(name, tensor)` for every variable, sorted by name.
    pub variables: Vec<(String, Tensor)>,
}

/// Where two states first differ (see [`TrainState::first_difference`]).
#[derive(Debug, Clone, PartialEq)]
pub enum StateDifference {
    /// The steps differ.
    Step(u64, u64),
    /// The data seeds differ.
    DataSeed(u64, u64),
    /// The variable names differ (first differing position).
    Names(Option<String>, Option<String>),
    /// A variable's shape or kind differs.
    Shape(String),
    /// A variable's elements differ: how many, and the first one's flat
    /// index and the two values (as `f64`).
    Values {
        /// Variable name.
        name: String,
        /// Elements that differ in their bits.
        count: usize,
        /// Flat index of the first.
        first: usize,
        /// Its value on the left.
        left: f64,
        /// Its value on the right.
        right: f64,
    },
}

fn deep_copy(t: &Tensor) -> Result<Tensor, Error> {
    let mut c = t.f_zeros_like()?;
    tch::no_grad(|| c.f_copy_(t))?;
    Ok(c)
}

/// The bits of a tensor's elements (for `f32` the `to_bits`, for `i64` the
/// value), for bitwise comparison.
fn element_bits(t: &Tensor) -> Result<Vec<u64>, Error> {
    let n = t.numel();
    let flat = t.f_contiguous()?;
    match flat.f_kind()? {
        Kind::Float => {
            let mut v = vec![0f32; n];
            flat.f_copy_data(&mut v, n)?;
            Ok(v.into_iter().map(|x| u64::from(x.to_bits())).collect())
        }
        Kind::Int64 => {
            let mut v = vec![0i64; n];
            flat.f_copy_data(&mut v, n)?;
            Ok(v.into_iter().map(|x| x as u64).collect())
        }
        Kind::Double => {
            let mut v = vec![0f64; n];
            flat.f_copy_data(&mut v, n)?;
            Ok(v.into_iter().map(f64::to_bits).collect())
        }
        k => Err(Error::State(format!(
            "cannot compare tensors of kind {k:?}"
        ))),
    }
}

fn scalar_u64(t: &Tensor, name: &str) -> Result<u64, Error> {
    if t.f_kind()? != Kind::Int64 || t.numel() != 1 {
        return Err(Error::State(format!(
            "{name} must be one i64, is {:?} {:?}",
            t.kind(),
            t.size()
        )));
    }
    Ok(t.f_int64_value(&[0])? as u64)
}

impl TrainState {
    /// Copies every variable of `vs` (sorted by name).
    pub fn capture(vs: &VarStore, step: u64, data_seed: u64) -> Result<TrainState, Error> {
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        let variables = variables
            .into_iter()
            .map(|(n, t)| Ok((n, deep_copy(&t)?)))
            .collect::<Result<_, Error>>()?;
        Ok(TrainState {
            step,
            data_seed,
            variables,
        })
    }

    /// The state as named tensors, in a fixed order: `train.step` and
    /// `train.data_seed` (each a one-element `i64` tensor holding the `u64`'s
    /// bits), then the variables by name. Shallow: the tensors are the
    /// state's own.
    pub fn to_named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(self.variables.len() + 2);
        out.push((
            STEP_NAME.to_string(),
            Tensor::from_slice(&[self.step as i64]),
        ));
        out.push((
            DATA_SEED_NAME.to_string(),
            Tensor::from_slice(&[self.data_seed as i64]),
        ));
        out.extend(
            self.variables
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone())),
        );
        out
    }

    /// The state from named tensors in any order (as a checkpoint file or a
    /// peer gives them): `train.step` and `train.data_seed` must be present
    /// once, every other name once; at most [`MAX_STATE_VARIABLES`].
    pub fn from_named_tensors(named: Vec<(String, Tensor)>) -> Result<TrainState, Error> {
        if named.len() > MAX_STATE_VARIABLES + 2 {
            return Err(Error::State(format!(
                "{} tensors exceed the bound",
                named.len()
            )));
        }
        let mut step = None;
        let mut data_seed = None;
        let mut variables = Vec::with_capacity(named.len());
        for (name, t) in named {
            match name.as_str() {
                STEP_NAME if step.is_none() => step = Some(scalar_u64(&t, STEP_NAME)?),
                DATA_SEED_NAME if data_seed.is_none() => {
                    data_seed = Some(scalar_u64(&t, DATA_SEED_NAME)?)
                }
                STEP_NAME | DATA_SEED_NAME => {
                    return Err(Error::State(format!("{name} appears twice")));
                }
                _ => variables.push((name, t)),
            }
        }
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = variables.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::State(format!("{} appears twice", w[0].0)));
        }
        Ok(TrainState {
            step: step.ok_or_else(|| Error::State(format!("{STEP_NAME} is missing")))?,
            data_seed: data_seed
                .ok_or_else(|| Error::State(format!("{DATA_SEED_NAME} is missing")))?,
            variables,
        })
    }

    /// Copies the variables into `vs`'s existing tensors, in place (handles
    /// that models and optimizers hold see the new values). The state must
    /// name exactly `vs`'s variables, each with its shape and kind; it is all
    /// checked before anything is copied, so on error `vs` is unchanged.
    pub fn load_into(&self, vs: &VarStore) -> Result<(), Error> {
        let mut live: HashMap<String, Tensor> = vs.variables();
        if live.len() != self.variables.len() {
            let mut ours: Vec<&String> = live.keys().collect();
            ours.sort();
            let theirs: Vec<&String> = self.variables.iter().map(|(n, _)| n).collect();
            let missing: Vec<&&String> = ours
                .iter()
                .filter(|n| !theirs.contains(n))
                .take(3)
                .collect();
            let extra: Vec<&&String> = theirs
                .iter()
                .filter(|n| !ours.contains(n))
                .take(3)
                .collect();
            return Err(Error::State(format!(
                "the store has {} variables, the state {} (missing {missing:?}, extra {extra:?})",
                live.len(),
                self.variables.len()
            )));
        }
        let mut pairs = Vec::with_capacity(self.variables.len());
        for (name, src) in &self.variables {
            let Some(dst) = live.remove(name) else {
                return Err(Error::State(format!("the store has no variable {name}")));
            };
            if dst.size() != src.size() || dst.f_kind()? != src.f_kind()? {
                return Err(Error::State(format!(
                    "{name}: the store has {:?} {:?}, the state {:?} {:?}",
                    dst.kind(),
                    dst.size(),
                    src.kind(),
                    src.size()
                )));
            }
            pairs.push((dst, src));
        }
        tch::no_grad(|| {
            for (mut dst, src) in pairs {
                dst.f_copy_(&src.f_to_device(dst.device())?)?;
            }
            Ok(())
        })
    }

    /// Where `self` and `other` first differ bit for bit, or `None` when
    /// they are equal in every bit (steps, seeds, names, shapes, kinds and
    /// every element, `f32` compared with `to_bits`).
    pub fn first_difference(&self, other: &TrainState) -> Result<Option<StateDifference>, Error> {
        if self.step != other.step {
            return Ok(Some(StateDifference::Step(self.step, other.step)));
        }
        if self.data_seed != other.data_seed {
            return Ok(Some(StateDifference::DataSeed(
                self.data_seed,
                other.data_seed,
            )));
        }
        for i in 0..self.variables.len().max(other.variables.len()) {
            let (l, r) = (self.variables.get(i), other.variables.get(i));
            let (Some((ln, lt)), Some((rn, rt))) = (l, r) else {
                return Ok(Some(StateDifference::Names(
                    l.map(|(n, _)| n.clone()),
                    r.map(|(n, _)| n.clone()),
                )));
            };
            if ln != rn {
                return Ok(Some(StateDifference::Names(
                    Some(ln.clone()),
                    Some(rn.clone()),
                )));
            }
            if lt.size() != rt.size() || lt.f_kind()? != rt.f_kind()? {
                return Ok(Some(StateDifference::Shape(ln.clone())));
            }
            let (lb, rb) = (element_bits(lt)?, element_bits(rt)?);
            let differing: Vec<usize> = (0..lb.len()).filter(|&j| lb[j] != rb[j]).collect();
            if let Some(&first) = differing.first() {
                let value = |t: &Tensor| -> Result<f64, Error> {
                    Ok(t.f_reshape([-1])?
                        .f_to_device(Device::Cpu)?
                        .f_double_value(&[first as i64])?)
                };
                return Ok(Some(StateDifference::Values {
                    name: ln.clone(),
                    count: differing.len(),
                    first,
                    left: value(lt)?,
                    right: value(rt)?,
                }));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::Init;

    use super::*;

    fn store(fill: f64) -> VarStore {
        let vs = VarStore::new(Device::Cpu);
        let _ = vs
            .root()
            .sub("layer")
            .var("weight", &[2, 3], Init::Const(fill));
        let _ = vs.root().var("bias", &[3], Init::Const(fill + 1.0));
        let _ = vs.root().add("count", Tensor::from_slice(&[7i64]), false);
        vs
    }

    #[test]
    fn named_tensors_round_trip_and_load_in_place() {
        let state = TrainState::capture(&store(0.5), 12, u64::MAX).unwrap();
        let names: Vec<String> = state
            .to_named_tensors()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "train.step",
                "train.data_seed",
                "bias",
                "count",
                "layer.weight"
            ]
        );
        let mut named = state.to_named_tensors();
        named.reverse();
        let back = TrainState::from_named_tensors(named).unwrap();
        assert_eq!(back.first_difference(&state).unwrap(), None);
        assert_eq!((back.step, back.data_seed), (12, u64::MAX));

        let other = store(-2.0);
        let handle = other.variables()["layer.weight"].shallow_clone();
        back.load_into(&other).unwrap();
        // In place: a handle taken before the load sees the loaded values.
        assert_eq!(handle.double_value(&[1, 2]), 0.5);
        let reloaded = TrainState::capture(&other, 12, u64::MAX).unwrap();
        assert_eq!(reloaded.first_difference(&state).unwrap(), None);
    }

    #[test]
    fn a_capture_is_a_copy() {
        let vs = store(0.5);
        let state = TrainState::capture(&vs, 0, 0).unwrap();
        let _ = tch::no_grad(|| vs.variables()["bias"].shallow_clone().fill_(9.0));
        assert_eq!(state.variables[0].1.double_value(&[0]), 1.5);
    }

    #[test]
    fn mismatches_are_refused_and_change_nothing() {
        let state = TrainState::capture(&store(0.5), 1, 1).unwrap();
        // A store with one more variable.
        let bigger = store(3.0);
        let _ = bigger.root().var("extra", &[1], Init::Const(0.0));
        assert!(matches!(state.load_into(&bigger), Err(Error::State(_))));
        assert_eq!(bigger.variables()["bias"].double_value(&[0]), 4.0);
        // A store whose variable has another shape.
        let other = VarStore::new(Device::Cpu);
        let _ = other
            .root()
            .sub("layer")
            .var("weight", &[3, 2], Init::Const(3.0));
        let _ = other.root().var("bias", &[3], Init::Const(4.0));
        let _ = other
            .root()
            .add("count", Tensor::from_slice(&[7i64]), false);
        assert!(matches!(state.load_into(&other), Err(Error::State(_))));
        assert_eq!(
            other.variables()["bias"].double_value(&[0]),
            4.0,
            "nothing was copied"
        );
    }

    #[test]
    fn malformed_lists_are_refused() {
        let good = TrainState::capture(&store(0.5), 1, 1)
            .unwrap()
            .to_named_tensors();
        let without_step: Vec<_> = good
            .iter()
            .skip(1)
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        assert!(TrainState::from_named_tensors(without_step).is_err());
        let mut twice: Vec<_> = good
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        twice.push(("bias".into(), Tensor::from_slice(&[0f32; 3])));
        assert!(TrainState::from_named_tensors(twice).is_err());
        let mut bad_step: Vec<_> = good
            .iter()
            .skip(1)
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        bad_step.push((STEP_NAME.into(), Tensor::from_slice(&[1.0f32])));
        assert!(TrainState::from_named_tensors(bad_step).is_err());
    }

    #[test]
    fn a_single_bit_is_a_difference() {
        let a = TrainState::capture(&store(0.0), 1, 1).unwrap();
        let b = TrainState::capture(&store(0.0), 1, 1).unwrap();
        assert_eq!(a.first_difference(&b).unwrap(), None);
        // -0.0 == 0.0 as numbers, not as bits.
        let _ = tch::no_grad(|| b.variables[2].1.shallow_clone().narrow(1, 2, 1).fill_(-0.0));
        match a.first_difference(&b).unwrap() {
            Some(StateDifference::Values {
                name, count, first, ..
            }) => {
                assert_eq!((name.as_str(), count, first), ("layer.weight", 2, 2));
            }
            d => panic!("expected a value difference, got {d:?}"),
        }
        let c = TrainState::capture(&store(0.0), 2, 1).unwrap();
        assert_eq!(
            a.first_difference(&c).unwrap(),
            Some(StateDifference::Step(1, 2))
        );
    }
}
