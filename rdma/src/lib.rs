//! The payload plane: registered buffers that a peer reads and writes
//! one-sidedly, through ibverbs, shared memory or an authenticated TCP
//! fallback.
//!
//! This crate is being built (see `ARCHITECTURE.md`); today it holds no API.
//! It is one of the two crates allowed `unsafe`; every block carries a
//! `// SAFETY:` note.
#![deny(unsafe_op_in_unsafe_fn)]
