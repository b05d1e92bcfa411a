//! Fault injection for regent: process and link faults, seeded fault
//! schedules, invariant checkers and the scenario runner.
//!
//! This crate is being built (see `ARCHITECTURE.md`); today it holds no API.
#![forbid(unsafe_code)]
