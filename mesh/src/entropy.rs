//! Where the random numbers of a controller or a proc come from: cast
//! tokens (a mesh's capability) and cast seeds (which member `any` picks).
//! In production they are drawn from the OS (std's hasher keys, as
//! before); in a simulation from a seed, so that a run replays. Their
//! values show on the wire, and postcard writes integers as varints: a
//! random value changes the size of the frames that carry it.

use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A source of random `u64`s (see the module docs). Shared by reference.
#[derive(Debug)]
pub(crate) enum Entropy {
    /// Draws from the OS; cast seeds from a SplitMix64 generator whose
    /// state (this) started at an OS draw ([`Entropy::next_seed`]).
    Os(AtomicU64),
    /// Every number from one SplitMix64 generator's state.
    Seeded(Mutex<u64>),
}

impl Entropy {
    /// Numbers from the OS: unpredictable, not replayable.
    pub(crate) fn os() -> Self {
        Self::Os(AtomicU64::new(os_draw()))
    }

    /// Numbers from `seed`: the same seed gives the same sequence.
    pub(crate) fn seeded(seed: u64) -> Self {
        Self::Seeded(Mutex::new(seed))
    }

    /// `Some(seed)` seeds, `None` draws from the OS.
    pub(crate) fn from_seed(seed: Option<u64>) -> Self {
        seed.map_or_else(Self::os, Self::seeded)
    }

    /// Fills `out` with secret bytes (a signing key's seed): from the OS's
    /// cryptographic source, or from the seed in a simulation.
    pub(crate) fn fill_secret(&self, out: &mut [u8]) {
        use ring::rand::SecureRandom;
        match self {
            Self::Os(_) => ring::rand::SystemRandom::new()
                .fill(out)
                .expect("the OS's random source"),
            Self::Seeded(_) => {
                for chunk in out.chunks_mut(8) {
                    let n = self.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&n[..chunk.len()]);
                }
            }
        }
    }

    /// The next number: unpredictable from the OS (a cast token, a
    /// signing key's seed).
    pub(crate) fn next_u64(&self) -> u64 {
        match self {
            Self::Os(_) => os_draw(),
            Self::Seeded(state) => {
                // The lock is held for arithmetic only: never poisoned.
                let mut s = state.lock().expect("entropy lock");
                *s = s.wrapping_add(GAMMA);
                mix(*s)
            }
        }
    }

    /// The next cast seed (which members `any` picks): a number no one
    /// needs to be unable to predict (seeds travel in the clear in every
    /// cast frame), drawn for every cast. From the OS's entropy, a
    /// SplitMix64 step from a state drawn once, without the OS draw's
    /// clock read and keyed hash (about 350 instructions per cast); seeded,
    /// the same sequence as [`Entropy::next_u64`], so a simulation replays.
    pub(crate) fn next_seed(&self) -> u64 {
        match self {
            Self::Os(seeds) => mix(seeds
                .fetch_add(GAMMA, Ordering::Relaxed)
                .wrapping_add(GAMMA)),
            Self::Seeded(_) => self.next_u64(),
        }
    }
}

/// SplitMix64's increment.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number from the OS: each `RandomState` has fresh keys from the OS's
/// random source.
fn os_draw() -> u64 {
    RandomState::new().hash_one(std::time::Instant::now())
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

    /// Seeded, cast seeds are the same sequence as every other draw (a
    /// simulation replays); from the OS, they differ from draw to draw and
    /// between two sources, and spread over the whole range.
    #[test]
    fn cast_seeds_replay_when_seeded_and_spread_from_the_os() {
        let (a, b) = (Entropy::seeded(7), Entropy::seeded(7));
        let seeds: Vec<u64> = (0..8).map(|_| a.next_seed()).collect();
        let draws: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(seeds, draws);
        let seeds = |e: &Entropy| (0..1000).map(|_| e.next_seed()).collect::<Vec<_>>();
        let (x, y) = (seeds(&Entropy::os()), seeds(&Entropy::os()));
        assert_ne!(x, y);
        let distinct: std::collections::HashSet<u64> = x.iter().copied().collect();
        assert_eq!(distinct.len(), x.len(), "a seed repeated");
        // Each bit is set in about half the seeds (1000 draws: a bit that
        // never or always flips is far outside 350..650).
        for bit in 0..64 {
            let ones = x.iter().filter(|s| *s >> bit & 1 == 1).count();
            assert!(
                (350..650).contains(&ones),
                "bit {bit} set in {ones} of 1000"
            );
        }
    }
}
