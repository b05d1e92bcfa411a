//! The proc binary of the mesh suites: the test actors, then `bootstrap()`,
//! which runs the proc runtime when a host agent starts this binary.

// Linking the library registers its actors.
use regent_tests as _;

fn main() {
    regent_mesh::bootstrap();
    eprintln!("mesh_proc is started by a host agent as a proc; it has no controller role");
    std::process::exit(2);
}
