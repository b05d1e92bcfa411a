//! Meshes: shapes and selections, procs and allocators, actor meshes with cast
//! trees and reducers, and mesh-granular supervision.
//!
//! This crate is being built (see `ARCHITECTURE.md`); today it holds no API.
#![forbid(unsafe_code)]
