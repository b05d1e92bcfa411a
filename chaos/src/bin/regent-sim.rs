//! `regent sim` on its own: the same command line and runner
//! ([`regent_chaos::sim::runner`]), built without the training stack that
//! the `regent` binary links (libtorch, the admin endpoint), so that CI
//! builds it in about half the time. `regent sim` is the command for users
//! (and logs what `RUST_LOG` asks; this binary sets no tracing subscriber).

use std::process::ExitCode;

use clap::Parser;

// The `regent` binary's allocator, so that seeds run here as fast as there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Deterministic simulation: the chaos scenario (the real controller
/// runtime, procs, cast trees and sessions on a simulated network and
/// clock) for many seeds, every invariant checked on each; a failing seed
/// prints how to replay it. Exits non-zero on any violation.
#[derive(Debug, Parser)]
#[command(name = "regent-sim", version)]
struct Cli {
    #[command(flatten)]
    args: regent_chaos::sim::runner::SimArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match regent_chaos::sim::runner::main(&cli.args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("regent-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
