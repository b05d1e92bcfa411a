//! The owner's signing key and its public half: a controller signs the
//! commands it relays down trees of procs (the relay module), and a proc
//! checks them with the key its boot names. Ed25519 (ring, the control
//! plane's crypto provider). A leaf: it knows bytes, not commands.

use std::fmt;

use bytes::Bytes;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

use crate::entropy::Entropy;

/// Put before the signed bytes: an owner's signature signs nothing else.
const DOMAIN: &[u8] = b"regent/relayed-command/v1\0";

/// The owner's public key (Ed25519), as a proc's boot carries it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerKey(pub [u8; 32]);

impl fmt::Debug for OwnerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerKey(")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

impl OwnerKey {
    /// Checks the owner's `signature` over `signed`.
    pub fn verify(&self, signed: &[u8], signature: &[u8]) -> Result<(), String> {
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(&[DOMAIN, signed].concat(), signature)
            .map_err(|_| "the owner's signature does not verify".to_owned())
    }
}

/// The controller's signing key.
pub(crate) struct OwnerSigner {
    pair: Ed25519KeyPair,
}

impl OwnerSigner {
    /// A fresh key from `entropy` (the OS's cryptographic source; the seed
    /// in a simulation).
    pub(crate) fn new(entropy: &Entropy) -> Self {
        let mut seed = [0u8; 32];
        entropy.fill_secret(&mut seed);
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).expect("any 32 bytes seed a key");
        Self { pair }
    }

    /// The key procs check signatures with.
    pub(crate) fn public(&self) -> OwnerKey {
        let mut key = [0u8; 32];
        key.copy_from_slice(self.pair.public_key().as_ref());
        OwnerKey(key)
    }

    /// The signature of `signed`.
    pub(crate) fn sign(&self, signed: &[u8]) -> Bytes {
        Bytes::copy_from_slice(self.pair.sign(&[DOMAIN, signed].concat()).as_ref())
    }
}
