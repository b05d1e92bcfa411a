//! Tensors (tch) on regent's buffer plane: send and receive, collectives and
//! checkpoints.
//!
//! This crate is being built (see `ARCHITECTURE.md`); today it holds no API.
//! It is one of the two crates allowed `unsafe` (FFI); every block carries a
//! `// SAFETY:` note.
#![deny(unsafe_op_in_unsafe_fn)]
