//! The `regent` command.
fn main() {}
