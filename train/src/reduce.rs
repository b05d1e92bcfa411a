//! The reduction that defines a data-parallel step: the mean of the ranks'
//! flat gradients is their elementwise `f32` sum **in rank order**, divided
//! by the world size.
//!
//! For every element `i`: `mean[i] = (((g0[i] + g1[i]) + g2[i]) + ...) /
//! (world as f32)`, each operation rounded to `f32` (IEEE 754, round to
//! nearest even). Floating-point addition commutes but is not associative,
//! so any other grouping (arrival order, a tree `(g0 + g1) + (g2 + g3)`) or a
//! multiplication by `1 / world` gives different bits (only ranks 0 and 1
//! may trade places); a collective that claims to match the
//! single-process reference must compute exactly this, e.g. by calling
//! [`accumulate`] on the parts in rank order.

use crate::Error;

/// `acc[i] += part[i]` for every element, in `f32`.
pub fn accumulate(acc: &mut [f32], part: &[f32]) -> Result<(), Error> {
    if acc.len() != part.len() {
        return Err(Error::BufferLength {
            got: part.len(),
            want: acc.len(),
        });
    }
    for (a, p) in acc.iter_mut().zip(part) {
        *a += *p;
    }
    Ok(())
}

/// `buf[i] /= world`, in `f32` (a division, not a multiplication by the
/// reciprocal: the two differ in the last bit for worlds that are not powers
/// of two).
pub fn divide_by_world(buf: &mut [f32], world: usize) -> Result<(), Error> {
    if world == 0 {
        return Err(Error::Rank { rank: 0, world });
    }
    let w = world as f32;
    for x in buf.iter_mut() {
        *x /= w;
    }
    Ok(())
}

/// The mean of `parts` (rank 0 first) into `out`: the rank-order sum divided
/// by `parts.len()`.
pub fn mean_in_rank_order(parts: &[&[f32]], out: &mut [f32]) -> Result<(), Error> {
    let Some((first, rest)) = parts.split_first() else {
        return Err(Error::Rank { rank: 0, world: 0 });
    };
    if first.len() != out.len() {
        return Err(Error::BufferLength {
            got: first.len(),
            want: out.len(),
        });
    }
    out.copy_from_slice(first);
    for part in rest {
        accumulate(out, part)?;
    }
    divide_by_world(out, parts.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_is_the_left_to_right_sum_divided() {
        // Values chosen so that the order of the sum shows in the result:
        // (1e8 + 1) - 1e8 + 1 = 1 in f32 left to right, 2 right to left.
        let g = [[1.0e8f32], [1.0], [-1.0e8], [1.0]];
        let parts: Vec<&[f32]> = g.iter().map(|p| p.as_slice()).collect();
        let mut out = [0.0f32];
        mean_in_rank_order(&parts, &mut out).unwrap();
        assert_eq!(out[0], 1.0 / 4.0);
        let reversed: Vec<&[f32]> = g.iter().rev().map(|p| p.as_slice()).collect();
        mean_in_rank_order(&reversed, &mut out).unwrap();
        assert_eq!(out[0], 0.0, "right to left loses the 1s differently");
    }

    #[test]
    fn division_is_not_a_reciprocal_multiplication() {
        let mut found = false;
        for i in 1..10_000u32 {
            let x = i as f32 * 0.37;
            let mut d = [x];
            divide_by_world(&mut d, 3).unwrap();
            assert_eq!(d[0], x / 3.0);
            found |= d[0].to_bits() != (x * (1.0 / 3.0)).to_bits();
        }
        assert!(
            found,
            "division and reciprocal multiplication agree everywhere?"
        );
    }

    #[test]
    fn lengths_and_worlds_are_checked() {
        let mut out = [0.0f32; 2];
        assert!(matches!(
            mean_in_rank_order(&[&[1.0, 2.0], &[1.0]], &mut out),
            Err(Error::BufferLength { .. })
        ));
        assert!(mean_in_rank_order(&[], &mut out).is_err());
        assert!(divide_by_world(&mut out, 0).is_err());
    }
}
