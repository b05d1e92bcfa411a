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

/// Plain element types the kernels load and store (native byte order,
/// any alignment).
trait Elem: Copy {
    const N: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const N: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                // Callers pass chunks of exactly N bytes.
                <$t>::from_ne_bytes(b.try_into().expect("N bytes"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
elem!(f32, f64, u16, i64, i32, i16, i8, u8);

/// `acc = acc op x`.
#[inline(always)]
fn apply_acc<T: Elem>(acc: &mut [u8], x: &[u8], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.chunks_exact_mut(T::N).zip(x.chunks_exact(T::N)) {
        f(T::load(a), T::load(b)).store(a);
    }
}

/// `dst = x op dst` (the left operand from `x`).
#[inline(always)]
fn apply_rev<T: Elem>(x: &[u8], dst: &mut [u8], f: impl Fn(T, T) -> T) {
    for (b, a) in dst.chunks_exact_mut(T::N).zip(x.chunks_exact(T::N)) {
        f(T::load(a), T::load(b)).store(b);
    }
}

/// `dst = x op y`.
#[inline(always)]
fn apply3<T: Elem>(dst: &mut [u8], x: &[u8], y: &[u8], f: impl Fn(T, T) -> T) {
    for ((d, a), b) in dst
        .chunks_exact_mut(T::N)
        .zip(x.chunks_exact(T::N))
        .zip(y.chunks_exact(T::N))
    {
        f(T::load(a), T::load(b)).store(d);
    }
}

fn f16_op(a: u16, b: u16, f: fn(f32, f32) -> f32) -> u16 {
    f16::from_f32(f(f16::from_bits(a).to_f32(), f16::from_bits(b).to_f32())).to_bits()
}

fn bf16_op(a: u16, b: u16, f: fn(f32, f32) -> f32) -> u16 {
    bf16::from_f32(f(bf16::from_bits(a).to_f32(), bf16::from_bits(b).to_f32())).to_bits()
}

fn f16_pick(a: u16, b: u16, f: fn(f32, f32) -> f32) -> u16 {
    let to = |v: u16| f16::from_bits(v).to_f32();
    pick(f(to(a), to(b)), a, b, to)
}

fn bf16_pick(a: u16, b: u16, f: fn(f32, f32) -> f32) -> u16 {
    let to = |v: u16| bf16::from_bits(v).to_f32();
    pick(f(to(a), to(b)), a, b, to)
}

/// Runs `$apply!(type, element function)` for the kernel of `op` on
/// `dtype` (the mean folds as a sum; [`finish`] divides).
macro_rules! dispatch {
    ($op:expr, $dtype:expr, $apply:ident) => {{
        use ReduceOp::*;
        match ($dtype, $op) {
            (DType::F32, Sum | Mean) => $apply!(f32, |a: f32, b: f32| a + b),
            (DType::F32, Min) => $apply!(f32, min_f32),
            (DType::F32, Max) => $apply!(f32, max_f32),
            (DType::F64, Sum | Mean) => $apply!(f64, |a: f64, b: f64| a + b),
            (DType::F64, Min) => $apply!(f64, min_f64),
            (DType::F64, Max) => $apply!(f64, max_f64),
            // Half types compute in f32 and round once, as torch's CPU
            // kernels do.
            (DType::F16, Sum | Mean) => $apply!(u16, |a, b| f16_op(a, b, |x, y| x + y)),
            (DType::F16, Min) => $apply!(u16, |a, b| f16_pick(a, b, min_f32)),
            (DType::F16, Max) => $apply!(u16, |a, b| f16_pick(a, b, max_f32)),
            (DType::BF16, Sum | Mean) => $apply!(u16, |a, b| bf16_op(a, b, |x, y| x + y)),
            (DType::BF16, Min) => $apply!(u16, |a, b| bf16_pick(a, b, min_f32)),
            (DType::BF16, Max) => $apply!(u16, |a, b| bf16_pick(a, b, max_f32)),
            (DType::I64, Sum | Mean) => $apply!(i64, i64::wrapping_add),
            (DType::I64, Min) => $apply!(i64, Ord::min),
            (DType::I64, Max) => $apply!(i64, Ord::max),
            (DType::I32, Sum | Mean) => $apply!(i32, i32::wrapping_add),
            (DType::I32, Min) => $apply!(i32, Ord::min),
            (DType::I32, Max) => $apply!(i32, Ord::max),
            (DType::I16, Sum | Mean) => $apply!(i16, i16::wrapping_add),
            (DType::I16, Min) => $apply!(i16, Ord::min),
            (DType::I16, Max) => $apply!(i16, Ord::max),
            (DType::I8, Sum | Mean) => $apply!(i8, i8::wrapping_add),
            (DType::I8, Min) => $apply!(i8, Ord::min),
            (DType::I8, Max) => $apply!(i8, Ord::max),
            (DType::U8 | DType::Bool, Sum | Mean) => $apply!(u8, u8::wrapping_add),
            (DType::U8 | DType::Bool, Min) => $apply!(u8, Ord::min),
            (DType::U8 | DType::Bool, Max) => $apply!(u8, Ord::max),
        }
    }};
}

fn check_lens(dtype: DType, lens: &[usize]) {
    assert!(
        lens.windows(2).all(|w| w[0] == w[1]),
        "fold of unequal lengths"
    );
    assert!(
        lens[0].is_multiple_of(dtype.size_bytes()),
        "fold of partial elements"
    );
}

/// `acc[i] = acc[i] op x[i]` for every element. Both slices hold whole
/// elements of `dtype` and are equally long.
pub(crate) fn fold(op: ReduceOp, dtype: DType, acc: &mut [u8], x: &[u8]) {
    check_lens(dtype, &[acc.len(), x.len()]);
    macro_rules! go {
        ($t:ty, $f:expr) => {
            apply_acc::<$t>(acc, x, $f)
        };
    }
    dispatch!(op, dtype, go)
}

/// `dst[i] = x[i] op dst[i]`: a fold whose running value is `x` and whose
/// next operand is `dst`, written over `dst`.
pub(crate) fn fold_rev(op: ReduceOp, dtype: DType, x: &[u8], dst: &mut [u8]) {
    check_lens(dtype, &[x.len(), dst.len()]);
    macro_rules! go {
        ($t:ty, $f:expr) => {
            apply_rev::<$t>(x, dst, $f)
        };
    }
    dispatch!(op, dtype, go)
}

/// `dst[i] = x[i] op y[i]`.
pub(crate) fn fold_into(op: ReduceOp, dtype: DType, dst: &mut [u8], x: &[u8], y: &[u8]) {
    check_lens(dtype, &[dst.len(), x.len(), y.len()]);
    macro_rules! go {
        ($t:ty, $f:expr) => {
            apply3::<$t>(dst, x, y, $f)
        };
    }
    dispatch!(op, dtype, go)
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
    let nf = n as f32;
    fn each<T: Elem>(acc: &mut [u8], f: impl Fn(T) -> T) {
        for a in acc.chunks_exact_mut(T::N) {
            f(T::load(a)).store(a);
        }
    }
    match dtype {
        DType::F32 => each::<f32>(acc, |v| v / nf),
        DType::F64 => each::<f64>(acc, |v| v / n),
        DType::F16 => each::<u16>(acc, |v| {
            f16::from_f32(f16::from_bits(v).to_f32() / nf).to_bits()
        }),
        DType::BF16 => each::<u16>(acc, |v| {
            bf16::from_f32(bf16::from_bits(v).to_f32() / nf).to_bits()
        }),
        // `ReduceOp::check` refuses the mean of other types.
        _ => unreachable!("mean of a non-float type passed ReduceOp::check"),
    }
}

/// `acc = acc op x`, elementwise, checked: the kernel the collectives
/// fold with (the mean folds as a sum).
pub fn fold_bytes(op: ReduceOp, dtype: DType, acc: &mut [u8], x: &[u8]) -> Result<(), Error> {
    op.check(dtype)?;
    if acc.len() != x.len() || !acc.len().is_multiple_of(dtype.size_bytes()) {
        return Err(Error::Invalid(
            "operands of unequal lengths or partial elements".into(),
        ));
    }
    fold(op, dtype, acc, x);
    Ok(())
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
    fn the_three_fold_forms_agree() {
        let x = f32s(&[1.0, -0.0, 3.0, f32::INFINITY]);
        let y = f32s(&[2.0, 0.0, -3.0, 1.0]);
        for op in ReduceOp::ALL {
            let mut a = x.clone();
            fold(op, DType::F32, &mut a, &y);
            let mut b = y.clone();
            fold_rev(op, DType::F32, &x, &mut b);
            let mut c = vec![0u8; x.len()];
            fold_into(op, DType::F32, &mut c, &x, &y);
            assert_eq!(a, b, "{op:?}");
            assert_eq!(a, c, "{op:?}");
        }
        // Ties keep the left operand: max(-0, +0) is -0 whichever form.
        let mut b = f32s(&[0.0]);
        fold_rev(ReduceOp::Max, DType::F32, &f32s(&[-0.0]), &mut b);
        assert_eq!(to_f32s(&b)[0].to_bits(), (-0.0f32).to_bits());
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
