//! The `regent` command: the supervision demo, benchmarks, and (later) host
//! agents, training jobs and chaos runs.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use regent::bench::{self, BenchOptions, Report};

#[derive(Debug, Parser)]
#[command(
    name = "regent",
    version,
    about = "A fault-tolerant supervisor runtime for distributed ML training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a tree of supervisors, inject child failures, and print how it
    /// recovers.
    Demo,
    /// Run a benchmark suite; each figure prints with its same-run baseline.
    Bench {
        /// The suite.
        suite: Suite,
        /// A short run.
        #[arg(long)]
        quick: bool,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The peer process of `bench net` (started by it, not by hand).
    #[command(hide = true)]
    BenchPeer {
        /// Directory with the peer's credentials.
        #[arg(long)]
        dir: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Suite {
    Supervision,
    Net,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Demo => rt.block_on(regent::demo::run()),
        Command::Bench { suite, quick, json } => {
            let opts = BenchOptions { quick };
            let mut report = Report::default();
            rt.block_on(async {
                match suite {
                    Suite::Supervision => bench::supervision::run(opts, &mut report).await,
                    Suite::Net => bench::net::run(opts, &mut report).await,
                }
            })?;
            if let Some(path) = json {
                report.write_json(&path)?;
            }
            Ok(())
        }
        Command::BenchPeer { dir } => rt.block_on(bench::net::serve_peer(&dir)),
    }
}
