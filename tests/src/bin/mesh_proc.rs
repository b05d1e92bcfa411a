//! The proc binary of the mesh suites: the test actors, then `bootstrap()`,
//! which runs the proc runtime when a host agent starts this binary. With
//! `RUST_LOG` set, the proc logs to stderr (its host agent's pipe, so the
//! controller's log sink), tagged by member (`logs::ProcStderr`).

// Linking the library registers its actors.
use regent_tests as _;

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(regent_mesh::logs::ProcStderr)
            .with_ansi(false)
            .without_time()
            .init();
    }
    regent_mesh::bootstrap();
    eprintln!("mesh_proc is started by a host agent as a proc; it has no controller role");
    std::process::exit(2);
}
