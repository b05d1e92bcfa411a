//! Counter-based randomness: every random number of this crate is a pure
//! function of a seed and a key (a parameter's name, a step and a sample
//! index), computed with integer and `f32` arithmetic only (no libm, no
//! libtorch generator), so that it is the same in every process, thread and
//! order of calls. The generator is SplitMix64 (Steele, Lea, Flood 2014).
//! Fixed forever: changing it changes every built-in model and data set.

/// A SplitMix64 stream.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finalizer: a bijection of `u64` that mixes every bit.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a string: the key of a named thing (a parameter).
pub fn name_key(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Rng {
    /// The stream of `seed` under `key`: streams of distinct keys are
    /// independent for all practical purposes.
    pub fn keyed(seed: u64, key: &[u64]) -> Rng {
        let mut state = mix(seed.wrapping_add(GOLDEN));
        for k in key {
            state = mix(state ^ mix(k.wrapping_add(GOLDEN)));
        }
        Rng { state }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix(self.state)
    }

    /// Uniform in `[0, 1)`, on a grid of 2^-24.
    pub fn uniform(&mut self) -> f32 {
        // The top 24 bits are exact in an f32 mantissa.
        (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
    }

    /// Uniform in `[-bound, bound)`.
    pub fn symmetric(&mut self, bound: f32) -> f32 {
        (2.0 * self.uniform() - 1.0) * bound
    }

    /// Uniform in `0..n` (`n > 0`), by the multiply-high method (a bias of
    /// at most n / 2^64, irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Approximately standard normal: the Irwin–Hall sum of four uniforms,
    /// centred and scaled to unit variance (support ±2√3).
    pub fn normal(&mut self) -> f32 {
        let s = self.uniform() + self.uniform() + self.uniform() + self.uniform();
        (s - 2.0) * 1.732_050_8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(seed: u64, key: &[u64]) -> Vec<u64> {
        let mut r = Rng::keyed(seed, key);
        (0..8).map(|_| r.next_u64()).collect()
    }

    #[test]
    fn streams_are_pure_functions_of_seed_and_key() {
        assert_eq!(draws(7, &[1, 2]), draws(7, &[1, 2]));
        assert_ne!(
            draws(7, &[1, 2]),
            draws(7, &[2, 1]),
            "the key's order matters"
        );
        assert_ne!(draws(7, &[]), draws(8, &[]));
    }

    #[test]
    fn known_values_never_change() {
        // SplitMix64 from state 0: the published first output.
        let mut r = Rng { state: 0 };
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn ranges_hold() {
        let mut r = Rng::keyed(1, &[]);
        let mut sum = 0.0f64;
        let mut sq = 0.0f64;
        for _ in 0..100_000 {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            let b = r.below(10);
            assert!(b < 10);
            let n = r.normal();
            assert!(n.abs() <= 3.5);
            sum += f64::from(n);
            sq += f64::from(n) * f64::from(n);
        }
        let mean = sum / 100_000.0;
        let var = sq / 100_000.0 - mean * mean;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }
}
