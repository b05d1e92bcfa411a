//! A fast hasher for the maps a send looks up every message (the sessions
//! by peer, the pairs of sender and receiver): the Firefox/rustc hash, a
//! multiply and a rotate per eight bytes. The standard `SipHash` took
//! about 900 instructions per message over those names on the reference
//! machine, most of a send's lookups. Their keys are names this process
//! sends from and to, not values a peer chooses, so the flooding
//! `SipHash` guards against does not apply. Public for the same use in the
//! crates above (keys of this process's own choosing, or bounded maps).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` hashed with [`FxHasher`].
pub type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// The multiplier of rustc's `FxHasher` (64-bit).
const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// rustc's `FxHasher`: not resistant to chosen keys, fast on short ones.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash + ?Sized>(value: &T) -> u64 {
        BuildHasherDefault::<FxHasher>::default().hash_one(value)
    }

    /// Names that differ anywhere (in a byte, a trailing zero, their
    /// split into two strings) hash apart, and equal ones alike: the map
    /// relies on the first for speed and on the second for correctness.
    #[test]
    fn names_that_differ_hash_apart() {
        let names = [
            "",
            "a",
            "a\0",
            "b",
            "controller",
            "controllea",
            "p0-0",
            "p0-1",
            "p1-0",
            "proc-0123456789abcdef",
            "proc-0123456789abcdeg",
        ];
        let mut seen = std::collections::HashSet::new();
        for n in names {
            assert_eq!(hash(n), hash(&n.to_owned()), "{n:?} hashes alike twice");
            assert!(seen.insert(hash(n)), "{n:?} collides");
        }
        assert_ne!(hash(&("ab", "c")), hash(&("a", "bc")));
        // A map of them finds each.
        let map: FxHashMap<String, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_owned(), i))
            .collect();
        for (i, n) in names.iter().enumerate() {
            assert_eq!(map.get(*n), Some(&i));
        }
    }
}
