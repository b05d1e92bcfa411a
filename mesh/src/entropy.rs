//! Where the random numbers of a controller or a proc come from: cast
//! tokens (a mesh's capability) and cast seeds (which member `any` picks).
//! In production they are drawn from the OS (std's hasher keys, as
//! before); in a simulation from a seed, so that a run replays. Their
//! values show on the wire, and postcard writes integers as varints: a
//! random value changes the size of the frames that carry it.

use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

/// A source of random `u64`s (see the module docs). Shared by reference.
#[derive(Debug)]
pub(crate) struct Entropy {
    /// The state of a SplitMix64 generator; `None` draws from the OS.
    seeded: Option<Mutex<u64>>,
}

impl Entropy {
    /// Numbers from the OS: unpredictable, not replayable.
    pub(crate) fn os() -> Self {
        Self { seeded: None }
    }

    /// Numbers from `seed`: the same seed gives the same sequence.
    pub(crate) fn seeded(seed: u64) -> Self {
        Self {
            seeded: Some(Mutex::new(seed)),
        }
    }

    /// `Some(seed)` seeds, `None` draws from the OS.
    pub(crate) fn from_seed(seed: Option<u64>) -> Self {
        seed.map_or_else(Self::os, Self::seeded)
    }

    /// Fills `out` with secret bytes (a signing key's seed): from the OS's
    /// cryptographic source, or from the seed in a simulation.
    pub(crate) fn fill_secret(&self, out: &mut [u8]) {
        use ring::rand::SecureRandom;
        match &self.seeded {
            None => ring::rand::SystemRandom::new()
                .fill(out)
                .expect("the OS's random source"),
            Some(_) => {
                for chunk in out.chunks_mut(8) {
                    let n = self.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&n[..chunk.len()]);
                }
            }
        }
    }

    /// The next number.
    pub(crate) fn next_u64(&self) -> u64 {
        match &self.seeded {
            // Each `RandomState` has fresh keys from the OS's random source.
            None => RandomState::new().hash_one(std::time::Instant::now()),
            Some(state) => {
                // The lock is held for arithmetic only: never poisoned.
                let mut s = state.lock().expect("entropy lock");
                *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = *s;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Entropy;

    #[test]
    fn a_seed_gives_the_same_numbers_and_another_seed_others() {
        let draw = |e: &Entropy| (0..8).map(|_| e.next_u64()).collect::<Vec<_>>();
        let (a, b, c) = (
            draw(&Entropy::seeded(1)),
            draw(&Entropy::seeded(1)),
            draw(&Entropy::seeded(2)),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(draw(&Entropy::os()), draw(&Entropy::os()));
    }
}
