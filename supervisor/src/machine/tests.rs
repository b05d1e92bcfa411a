//! Unit tests of the machine.

fn _placeholder() {}
