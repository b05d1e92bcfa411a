//! Seeded randomness. Every random choice of a schedule, of a proxy's packet
//! fates and of a workload comes from a [`SimRng`] built from a [`Seed`], so
//! a run's fault timeline replays from its seed (as TigerBeetle's VOPR
//! replays a simulation). The generator is written here, not taken from a
//! crate, so that a seed means the same timeline in every future version.

use std::fmt;
use std::str::FromStr;

/// The seed of a run: printed by every run, parsed back to replay it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Seed(pub u64);

impl Seed {
    /// A seed from the clock and the process id, for runs not given one.
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, RandomState};
        let hasher = RandomState::new();
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Self(hasher.hash_one((t, std::process::id())))
    }

    /// An independent seed for one named part of a run (the schedule, a
    /// proxy, a round), so that adding a part does not shift the others.
    pub fn derive(self, stream: &str) -> Self {
        // FNV-1a of the name, mixed with the seed by SplitMix64.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in stream.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let mut state = self.0 ^ h;
        Self(splitmix64(&mut state))
    }

    /// [`Seed::derive`] for a numbered part.
    pub fn derive_n(self, stream: &str, n: u64) -> Self {
        let mut state = self.derive(stream).0 ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Self(splitmix64(&mut state))
    }
}

impl fmt::Display for Seed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A seed that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a seed (a decimal or 0x-prefixed hex u64): {0:?}")]
pub struct BadSeed(pub String);

impl FromStr for Seed {
    type Err = BadSeed;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
            None => t.replace('_', "").parse::<u64>(),
        };
        parsed.map(Seed).map_err(|_| BadSeed(s.to_owned()))
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256** seeded through SplitMix64: small, fast, and fixed forever.
#[derive(Debug, Clone)]
pub struct SimRng {
    s: [u64; 4],
}

impl SimRng {
    /// A generator whose whole output is decided by `seed`.
    pub fn new(seed: Seed) -> Self {
        let mut state = seed.0;
        let s = [
            splitmix64(&mut state),
            splitmix64(&mut state),
            splitmix64(&mut state),
            splitmix64(&mut state),
        ];
        Self { s }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A number in `0..n` (0 when `n` is 0), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift with rejection.
        loop {
            let x = self.next_u64();
            let m = u128::from(x) * u128::from(n);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }

    /// A number in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// A float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p` (clamped to `[0, 1]`).
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        self.unit() < p
    }

    /// A duration in `lo..=hi`, to the microsecond.
    pub fn duration(
        &mut self,
        lo: std::time::Duration,
        hi: std::time::Duration,
    ) -> std::time::Duration {
        let lo_us = u64::try_from(lo.as_micros()).unwrap_or(u64::MAX);
        let hi_us = u64::try_from(hi.as_micros()).unwrap_or(u64::MAX);
        std::time::Duration::from_micros(self.between(lo_us, hi_us))
    }

    /// An index chosen with the given weights (`None` when all are 0).
    pub fn weighted(&mut self, weights: &[u32]) -> Option<usize> {
        let total: u64 = weights.iter().map(|w| u64::from(*w)).sum();
        if total == 0 {
            return None;
        }
        let mut x = self.below(total);
        for (i, w) in weights.iter().enumerate() {
            let w = u64::from(*w);
            if x < w {
                return Some(i);
            }
            x -= w;
        }
        None
    }

    /// `k` distinct indices of `0..n`, in increasing order (all of them when
    /// `k >= n`).
    pub fn subset(&mut self, n: u32, k: u32) -> Vec<u32> {
        let mut all: Vec<u32> = (0..n).collect();
        let k = k.min(n) as usize;
        for i in 0..k {
            let j = i + self.below((all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        let mut picked = all[..k].to_vec();
        picked.sort_unstable();
        picked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_numbers() {
        let a: Vec<u64> = {
            let mut r = SimRng::new(Seed(42));
            (0..100).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SimRng::new(Seed(42));
            (0..100).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let mut c = SimRng::new(Seed(43));
        assert_ne!(a[0], c.next_u64());
    }

    #[test]
    fn the_generator_is_fixed_forever() {
        // A seed must mean the same timeline in every version: these values
        // may never change.
        let mut r = SimRng::new(Seed(1));
        let first: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        let mut again = SimRng::new(Seed(1));
        assert_eq!(first, (0..3).map(|_| again.next_u64()).collect::<Vec<_>>());
        assert_eq!(Seed(7).derive("schedule"), Seed(7).derive("schedule"));
        assert_ne!(Seed(7).derive("schedule"), Seed(7).derive("proxy"));
        assert_ne!(Seed(7).derive_n("round", 1), Seed(7).derive_n("round", 2));
    }

    #[test]
    fn ranges_and_choices_stay_in_bounds() {
        let mut r = SimRng::new(Seed(9));
        for _ in 0..10_000 {
            assert!(r.below(7) < 7);
            let x = r.between(3, 5);
            assert!((3..=5).contains(&x));
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            assert_eq!(r.weighted(&[0, 5, 0]), Some(1));
        }
        assert_eq!(r.weighted(&[0, 0]), None);
        let s = r.subset(8, 3);
        assert_eq!(s.len(), 3);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(r.subset(2, 5), vec![0, 1]);
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!("42".parse::<Seed>().unwrap(), Seed(42));
        assert_eq!("0x2a".parse::<Seed>().unwrap(), Seed(42));
        assert_eq!("1_000".parse::<Seed>().unwrap(), Seed(1000));
        assert!("x".parse::<Seed>().is_err());
        assert_eq!(Seed(5).to_string().parse::<Seed>().unwrap(), Seed(5));
    }
}
