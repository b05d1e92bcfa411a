//! Data: batches, the rule that splits a global batch over ranks, and the
//! `DataSource` trait.
//!
//! A data source is a pure function: the samples of step `s` depend on the
//! source's seed, `s` and the sample's index in the step's global batch,
//! nothing else. A rank's batch is a contiguous range of the global batch
//! ([`rank_range`]), so the rank batches of a step, concatenated in rank
//! order, are exactly its global batch for every world size: whatever the
//! world is at step `s`, every sample of step `s` is used exactly once.

use std::ops::Range;

use tch::Tensor;

use crate::Error;

/// Most samples in a global batch of the built-in sources.
pub const MAX_GLOBAL_BATCH: usize = 1 << 20;
/// Most elements a built-in source puts in one tensor (a global batch's
/// inputs, the blobs' centres): 1 GiB of `f32`.
pub const MAX_SOURCE_ELEMENTS: usize = 1 << 28;

/// Refuses a tensor of `a * b` elements above [`MAX_SOURCE_ELEMENTS`].
pub(crate) fn check_elements(a: usize, b: usize, what: &str) -> Result<(), Error> {
    match a.checked_mul(b) {
        Some(n) if n <= MAX_SOURCE_ELEMENTS => Ok(()),
        _ => Err(Error::Config(format!(
            "{what}: {a} x {b} elements exceed {MAX_SOURCE_ELEMENTS}"
        ))),
    }
}

/// Samples: `inputs` and `targets` with the samples along dimension 0.
#[derive(Debug)]
pub struct Batch {
    /// Model inputs, `[n, ...]`.
    pub inputs: Tensor,
    /// Training targets, `[n, ...]`.
    pub targets: Tensor,
}

impl Batch {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.inputs.size().first().map_or(0, |&n| n.max(0) as usize)
    }

    /// Whether the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batches one after the other (rank order gives the global batch).
    pub fn concat(parts: &[Batch]) -> Result<Batch, Error> {
        let inputs: Vec<&Tensor> = parts.iter().map(|b| &b.inputs).collect();
        let targets: Vec<&Tensor> = parts.iter().map(|b| &b.targets).collect();
        Ok(Batch {
            inputs: Tensor::f_cat(&inputs, 0)?,
            targets: Tensor::f_cat(&targets, 0)?,
        })
    }
}

/// The samples of a global batch of `global` samples that rank `rank` of a
/// world of `world` ranks trains on: `floor(rank * global / world) ..
/// floor((rank + 1) * global / world)`.
///
/// The ranges of ranks `0..world` are contiguous, in rank order, disjoint and
/// cover `0..global`; their sizes differ by at most one (all equal when
/// `world` divides `global`). Errors: `world == 0` or `rank >= world`
/// ([`Error::Rank`]), `global < world` ([`Error::BatchTooSmall`]).
pub fn rank_range(global: usize, rank: usize, world: usize) -> Result<Range<usize>, Error> {
    if world == 0 || rank >= world {
        return Err(Error::Rank { rank, world });
    }
    if global < world {
        return Err(Error::BatchTooSmall { global, world });
    }
    // u128: `rank * global` cannot overflow.
    let at = |r: usize| (r as u128 * global as u128 / world as u128) as usize;
    Ok(at(rank)..at(rank + 1))
}

/// The factor a rank's mean loss is multiplied by before its backward pass,
/// `world * n / global` for a rank batch of `n` samples, so that the mean of
/// the ranks' gradients over the world is the gradient of the global batch's
/// mean loss. Exactly 1 (and then not applied) when `world` divides `global`.
pub fn loss_scale(global: usize, rank: usize, world: usize) -> Result<f64, Error> {
    let range = rank_range(global, rank, world)?;
    let n = range.len();
    if n * world == global {
        return Ok(1.0);
    }
    Ok((world as f64 * n as f64) / global as f64)
}

/// A resumable source of training data: a pure function of its seed, the
/// step and the sample index.
///
/// Implementations must return, for `samples(step, range)`, the samples
/// `range` of the global batch of `step`, such that the samples of one
/// `(step, index)` are the same bits whichever range they are asked in
/// (a sample never depends on its neighbours). The tests of the built-in
/// sources check exactly this against [`Batch::concat`].
pub trait DataSource {
    /// Samples in the global batch of every step.
    fn global_batch(&self) -> usize;

    /// The seed the samples are a function of (recorded in a
    /// [`TrainState`](crate::TrainState) so a resume can check it).
    fn seed(&self) -> u64;

    /// The samples `range` (within `0..global_batch()`) of step `step`'s
    /// global batch.
    fn samples(&self, step: u64, range: Range<usize>) -> Result<Batch, Error>;

    /// Rank `rank`'s batch of step `step` in a world of `world` ranks (the
    /// samples [`rank_range`] names).
    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<Batch, Error> {
        self.samples(step, rank_range(self.global_batch(), rank, world)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ranges_partition_the_global_batch_in_rank_order() {
        for global in 1..=70 {
            for world in 1..=global.min(17) {
                let mut next = 0;
                for rank in 0..world {
                    let r = rank_range(global, rank, world).unwrap();
                    assert_eq!(r.start, next, "global {global} world {world} rank {rank}");
                    assert!(!r.is_empty());
                    assert!(r.len() == global / world || r.len() == global / world + 1);
                    next = r.end;
                }
                assert_eq!(next, global, "global {global} world {world}");
            }
        }
    }

    #[test]
    fn bad_worlds_are_refused() {
        assert!(matches!(rank_range(8, 0, 0), Err(Error::Rank { .. })));
        assert!(matches!(rank_range(8, 4, 4), Err(Error::Rank { .. })));
        assert!(matches!(
            rank_range(3, 0, 4),
            Err(Error::BatchTooSmall { .. })
        ));
        assert_eq!(rank_range(usize::MAX, 1, 2).unwrap().end, usize::MAX);
    }

    #[test]
    fn loss_scales_average_to_the_global_mean() {
        assert_eq!(loss_scale(64, 3, 4).unwrap(), 1.0);
        for (global, world) in [(10, 3), (7, 2), (65, 4)] {
            // The mean over the world of scale * (rank mean) weighs every
            // sample scale / (world * n), which must be 1 / global.
            for rank in 0..world {
                let n = rank_range(global, rank, world).unwrap().len() as f64;
                let weight = loss_scale(global, rank, world).unwrap() / (world as f64 * n);
                assert!(
                    (weight * global as f64 - 1.0).abs() < 1e-12,
                    "{global} {world} {rank}"
                );
            }
        }
    }
}

/// Test helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use tch::{Kind, Tensor};

    use super::*;

    /// Every element's bits (`f32` by `to_bits`, `i64` by value).
    pub(crate) fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.contiguous().view([-1]);
        match t.kind() {
            Kind::Float => Vec::<f32>::try_from(&t)
                .unwrap()
                .iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
            Kind::Int64 => Vec::<i64>::try_from(&t)
                .unwrap()
                .iter()
                .map(|&x| x as u64)
                .collect(),
            k => panic!("no bits for {k:?}"),
        }
    }

    /// Checks that the rank batches of several steps, concatenated in rank
    /// order, are the global batch bit for bit, for every world size up to
    /// `max_world`.
    pub(crate) fn check_rank_batches_concatenate(data: &impl DataSource, max_world: usize) {
        for step in [0, 1, 77, u64::MAX] {
            let global = data.batch(step, 0, 1).unwrap();
            assert_eq!(global.len(), data.global_batch());
            for world in 1..=max_world {
                let parts: Vec<Batch> = (0..world)
                    .map(|r| data.batch(step, r, world).unwrap())
                    .collect();
                let joined = Batch::concat(&parts).unwrap();
                assert_eq!(
                    bits(&joined.inputs),
                    bits(&global.inputs),
                    "step {step} world {world}"
                );
                assert_eq!(
                    bits(&joined.targets),
                    bits(&global.targets),
                    "step {step} world {world}"
                );
                assert_eq!(joined.inputs.size(), global.inputs.size());
            }
            let next = data.batch(step.wrapping_add(1), 0, 1).unwrap();
            assert_ne!(
                bits(&next.inputs),
                bits(&global.inputs),
                "steps must differ"
            );
        }
        assert!(data.samples(0, 0..data.global_batch() + 1).is_err());
    }
}
