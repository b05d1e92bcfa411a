//! Reductions on dtype-typed byte buffers: plain loops over elements, each
//! element folded on its own (no reassociation, so vectorizing them does
//! not change a bit), and the serial reference that defines what every
//! exact collective returns.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::Error;

/// How a reduction combines the members' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum (integers wrap, as in torch).
    Sum,
    /// The sum divided by the group size (floating-point types only).
    Mean,
    /// The least element; a NaN wins (as `torch.minimum`).
    Min,
    /// The greatest element; a NaN wins (as `torch.maximum`).
    Max,
}

impl ReduceOp {
    /// Every reduction.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max];

    /// Refuses combinations without a meaning: the mean of integers and
    /// bools, the sum of bools.
    pub fn check(self, dtype: DType) -> Result<(), Error> {
        match (self, dtype) {
            (ReduceOp::Mean, d) if !d.is_float() => Err(Error::Unsupported(format!(
                "the mean of {d} tensors (floating-point types only)"
            ))),
            (ReduceOp::Sum, DType::Bool) => Err(Error::Unsupported(
                "the sum of bool tensors (use max for any, min for all)".into(),
            )),
            _ => Ok(()),
        }
    }
}

macro_rules! fold_with {
    ($acc:expr, $x:expr, $t:ty, $f:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(N).zip($x.chunks_exact(N)) {
            // chunks_exact yields slices of exactly N bytes.
            let va = <$t>::from_ne_bytes(a.try_into().expect("N bytes"));
            let vb = <$t>::from_ne_bytes(b.try_into().expect("N bytes"));
            let f: fn($t, $t) -> $t = $f;
            a.copy_from_slice(&f(va, vb).to_ne_bytes());
        }
    }};
}

fn max_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || (!b.is_nan() && a >= b) {
        a
    } else {
        b
    }
}

fn min_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || (!b.is_nan() && a <= b) {
        a
    } else {
        b
    }
}

fn max_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || (!b.is_nan() && a >= b) {
        a
    } else {
        b
    }
}

fn min_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || (!b.is_nan() && a <= b) {
        a
    } else {
        b
    }
}

/// `acc[i] = acc[i] op x[i]` for every element (the mean folds as a sum;
/// [`finish`] divides). Both slices hold whole elements of `dtype` and are
/// equally long.
pub(crate) fn fold(op: ReduceOp, dtype: DType, acc: &mut [u8], x: &[u8]) {
    assert_eq!(acc.len(), x.len(), "fold of unequal lengths");
    assert_eq!(
        acc.len() % dtype.size_bytes(),
        0,
        "fold of partial elements"
    );
    use ReduceOp::*;
    match (dtype, op) {
        (DType::F32, Sum | Mean) => fold_with!(acc, x, f32, |a, b| a + b),
        (DType::F32, Min) => fold_with!(acc, x, f32, min_f32),
        (DType::F32, Max) => fold_with!(acc, x, f32, max_f32),
        (DType::F64, Sum | Mean) => fold_with!(acc, x, f64, |a, b| a + b),
        (DType::F64, Min) => fold_with!(acc, x, f64, min_f64),
        (DType::F64, Max) => fold_with!(acc, x, f64, max_f64),
        // Half types compute in f32 and round once, as torch's CPU kernels.
        (DType::F16, Sum | Mean) => fold_with!(acc, x, u16, |a, b| {
            f16::from_f32(f16::from_bits(a).to_f32() + f16::from_bits(b).to_f32()).to_bits()
        }),
        (DType::F16, Min) => fold_with!(acc, x, u16, |a, b| {
            pick(
                min_f32(f16::from_bits(a).to_f32(), f16::from_bits(b).to_f32()),
                a,
                b,
                |v| f16::from_bits(v).to_f32(),
            )
        }),
        (DType::F16, Max) => fold_with!(acc, x, u16, |a, b| {
            pick(
                max_f32(f16::from_bits(a).to_f32(), f16::from_bits(b).to_f32()),
                a,
                b,
                |v| f16::from_bits(v).to_f32(),
            )
        }),
        (DType::BF16, Sum | Mean) => fold_with!(acc, x, u16, |a, b| {
            bf16::from_f32(bf16::from_bits(a).to_f32() + bf16::from_bits(b).to_f32()).to_bits()
        }),
        (DType::BF16, Min) => fold_with!(acc, x, u16, |a, b| {
            pick(
                min_f32(bf16::from_bits(a).to_f32(), bf16::from_bits(b).to_f32()),
                a,
                b,
                |v| bf16::from_bits(v).to_f32(),
            )
        }),
        (DType::BF16, Max) => fold_with!(acc, x, u16, |a, b| {
            pick(
                max_f32(bf16::from_bits(a).to_f32(), bf16::from_bits(b).to_f32()),
                a,
                b,
                |v| bf16::from_bits(v).to_f32(),
            )
        }),
        (DType::I64, Sum | Mean) => fold_with!(acc, x, i64, i64::wrapping_add),
        (DType::I64, Min) => fold_with!(acc, x, i64, Ord::min),
        (DType::I64, Max) => fold_with!(acc, x, i64, Ord::max),
        (DType::I32, Sum | Mean) => fold_with!(acc, x, i32, i32::wrapping_add),
        (DType::I32, Min) => fold_with!(acc, x, i32, Ord::min),
        (DType::I32, Max) => fold_with!(acc, x, i32, Ord::max),
        (DType::I16, Sum | Mean) => fold_with!(acc, x, i16, i16::wrapping_add),
        (DType::I16, Min) => fold_with!(acc, x, i16, Ord::min),
        (DType::I16, Max) => fold_with!(acc, x, i16, Ord::max),
        (DType::I8, Sum | Mean) => fold_with!(acc, x, i8, i8::wrapping_add),
        (DType::I8, Min) => fold_with!(acc, x, i8, Ord::min),
        (DType::I8, Max) => fold_with!(acc, x, i8, Ord::max),
        (DType::U8 | DType::Bool, Sum | Mean) => fold_with!(acc, x, u8, u8::wrapping_add),
        (DType::U8 | DType::Bool, Min) => fold_with!(acc, x, u8, Ord::min),
        (DType::U8 | DType::Bool, Max) => fold_with!(acc, x, u8, Ord::max),
    }
}

/// The one of `a` and `b` whose value is `v` (min and max return an input
/// exactly, NaN payload included).
fn pick(v: f32, a: u16, b: u16, to_f32: fn(u16) -> f32) -> u16 {
    let va = to_f32(a);
    if v.to_bits() == va.to_bits() || (v.is_nan() && va.is_nan()) {
        a
    } else {
        b
    }
}

/// Completes a reduction over `count` members: the mean divides each
/// element by `count` (in f32 for half types); the others do nothing.
pub(crate) fn finish(op: ReduceOp, dtype: DType, acc: &mut [u8], count: usize) {
    if op != ReduceOp::Mean {
        return;
    }
    let n = count as f64;
    match dtype {
        DType::F32 => {
            let n = n as f32;
            for a in acc.chunks_exact_mut(4) {
                let v = f32::from_ne_bytes(a.try_into().expect("4 bytes")) / n;
                a.copy_from_slice(&v.to_ne_bytes());
            }
        }
        DType::F64 => {
            for a in acc.chunks_exact_mut(8) {
                let v = f64::from_ne_bytes(a.try_into().expect("8 bytes")) / n;
                a.copy_from_slice(&v.to_ne_bytes());
            }
        }
        DType::F16 => {
            let n = n as f32;
            for a in acc.chunks_exact_mut(2) {
                let v = f16::from_bits(u16::from_ne_bytes(a.try_into().expect("2 bytes")));
                a.copy_from_slice(&f16::from_f32(v.to_f32() / n).to_bits().to_ne_bytes());
            }
        }
        DType::BF16 => {
            let n = n as f32;
            for a in acc.chunks_exact_mut(2) {
                let v = bf16::from_bits(u16::from_ne_bytes(a.try_into().expect("2 bytes")));
                a.copy_from_slice(&bf16::from_f32(v.to_f32() / n).to_bits().to_ne_bytes());
            }
        }
        // `ReduceOp::check` refuses the mean of other types.
        _ => unreachable!("mean of a non-float type passed ReduceOp::check"),
    }
}

/// The serial reference: the left fold of `inputs` in the order given
/// (`((x0 op x1) op x2) ...`), then [`ReduceOp::Mean`]'s division. Every
/// exact collective (the inline and direct algorithms) returns exactly
/// these bits for inputs in rank order.
pub fn serial_fold(op: ReduceOp, dtype: DType, inputs: &[&[u8]]) -> Result<Vec<u8>, Error> {
    op.check(dtype)?;
    let Some((first, rest)) = inputs.split_first() else {
        return Err(Error::Invalid("a reduction of no inputs".into()));
    };
    if first.len() % dtype.size_bytes() != 0 || rest.iter().any(|x| x.len() != first.len()) {
        return Err(Error::Invalid(
            "inputs of unequal lengths or partial elements".into(),
        ));
    }
    let mut acc = first.to_vec();
    for x in rest {
        fold(op, dtype, &mut acc, x);
    }
    finish(op, dtype, &mut acc, inputs.len());
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn to_f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn the_fold_is_left_to_right_in_input_order() {
        // (1e8 + 1) + -1e8 = 0 in f32, while 1 + (1e8 + -1e8) = 1.
        let (a, b, c) = (f32s(&[1e8]), f32s(&[1.0]), f32s(&[-1e8]));
        let r = serial_fold(ReduceOp::Sum, DType::F32, &[&a, &b, &c]).unwrap();
        assert_eq!(to_f32s(&r), [0.0]);
        let r = serial_fold(ReduceOp::Sum, DType::F32, &[&b, &a, &c]).unwrap();
        assert_eq!(to_f32s(&r), [0.0]);
        let r = serial_fold(ReduceOp::Sum, DType::F32, &[&a, &c, &b]).unwrap();
        assert_eq!(to_f32s(&r), [1.0]);
    }

    #[test]
    fn reductions_agree_with_torch_elementwise() {
        crate::testing::init_torch();
        let xs: Vec<tch::Tensor> = (0..4)
            .map(|i| {
                tch::Tensor::randn([257], (tch::Kind::Float, tch::Device::Cpu)) * (i as f64 + 1.0)
            })
            .collect();
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let ts: Vec<tch::Tensor> = xs.iter().map(|t| t.to_kind(dtype.kind())).collect();
            let bytes: Vec<Vec<u8>> = ts
                .iter()
                .map(|t| {
                    let mut v = vec![0u8; 257 * dtype.size_bytes()];
                    t.copy_data_u8(&mut v, 257);
                    v
                })
                .collect();
            let refs: Vec<&[u8]> = bytes.iter().map(|b| &b[..]).collect();
            let torch = |t: tch::Tensor| {
                let mut v = vec![0u8; 257 * dtype.size_bytes()];
                t.copy_data_u8(&mut v, 257);
                v
            };
            let sum = ts[1..].iter().fold(ts[0].shallow_clone(), |a, b| a + b);
            assert_eq!(
                serial_fold(ReduceOp::Sum, dtype, &refs).unwrap(),
                torch(sum.shallow_clone()),
                "{dtype} sum"
            );
            let max = ts[1..]
                .iter()
                .fold(ts[0].shallow_clone(), |a, b| a.maximum(b));
            assert_eq!(
                serial_fold(ReduceOp::Max, dtype, &refs).unwrap(),
                torch(max),
                "{dtype} max"
            );
            let min = ts[1..]
                .iter()
                .fold(ts[0].shallow_clone(), |a, b| a.minimum(b));
            assert_eq!(
                serial_fold(ReduceOp::Min, dtype, &refs).unwrap(),
                torch(min),
                "{dtype} min"
            );
            if dtype == DType::F32 || dtype == DType::F64 {
                assert_eq!(
                    serial_fold(ReduceOp::Mean, dtype, &refs).unwrap(),
                    torch(sum / 4.0),
                    "{dtype} mean"
                );
            }
        }
    }

    #[test]
    fn nan_wins_min_and_max_and_integers_wrap() {
        let nan = f32s(&[f32::NAN, 1.0]);
        let one = f32s(&[2.0, f32::NAN]);
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let r = to_f32s(&serial_fold(op, DType::F32, &[&nan, &one]).unwrap());
            assert!(r[0].is_nan() && r[1].is_nan(), "{op:?}: {r:?}");
        }
        let big = i32::MAX.to_ne_bytes();
        let r = serial_fold(ReduceOp::Sum, DType::I32, &[&big, &1i32.to_ne_bytes()]).unwrap();
        assert_eq!(i32::from_ne_bytes(r.try_into().unwrap()), i32::MIN);
    }

    #[test]
    fn meaningless_reductions_are_refused() {
        assert!(ReduceOp::Mean.check(DType::I32).is_err());
        assert!(ReduceOp::Sum.check(DType::Bool).is_err());
        assert!(ReduceOp::Max.check(DType::Bool).is_ok());
        assert!(serial_fold(ReduceOp::Sum, DType::F32, &[]).is_err());
        assert!(serial_fold(ReduceOp::Sum, DType::F32, &[&[0; 4], &[0; 8]]).is_err());
    }
}
