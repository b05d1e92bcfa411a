//! The proc binary of the chaos suite: links `regent-chaos` (whose
//! workload actor, `Tally`, registers itself), then `bootstrap()`, which
//! runs the proc runtime when a host agent starts this binary.

// Linking the crate registers its actor.
use regent_chaos as _;

fn main() {
    regent_mesh::bootstrap();
    eprintln!("chaos_proc is started by a host agent as a proc; it has no controller role");
    std::process::exit(2);
}
