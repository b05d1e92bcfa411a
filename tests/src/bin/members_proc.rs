//! The proc binary of the members suite (`tests/members.rs`): links the
//! suite's actors (`members_actors`), then `bootstrap()`, which runs the
//! proc runtime when a host agent starts this binary.

// Linking the library registers its actors.
use regent_tests as _;

fn main() {
    regent_mesh::bootstrap();
    eprintln!("members_proc is started by a host agent as a proc; it has no controller role");
    std::process::exit(2);
}
