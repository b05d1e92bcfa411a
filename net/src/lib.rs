//! The control plane of regent: identity and addressing, the wire envelope and
//! its codec, and the QUIC transport with mutual TLS.
//!
//! This crate is being built (see `ARCHITECTURE.md`); today it holds no API.
#![forbid(unsafe_code)]
