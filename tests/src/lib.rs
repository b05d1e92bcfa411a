//! End-to-end and chaos suites of regent. The suites are the test binaries
//! under `tests/tests/`; this library holds what they share.
#![forbid(unsafe_code)]

pub mod members_actors;
pub mod mesh_actors;
pub mod peers;
pub mod process;
pub mod tempdir;
pub mod tensor_actors;
