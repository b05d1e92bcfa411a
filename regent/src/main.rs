//! The `regent` command: the supervision demo, benchmarks, host agents
//! (`regent host`), the cluster CA (`regent ca`), and (later) training jobs
//! and chaos runs.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

// The command's own modules: not part of the `regent` library, so that no
// user binary links their actors.
mod admin;
mod args;
mod bench;
mod chaos;
mod demo;
mod train;

use bench::{BenchOptions, Report};

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
    /// The peer process of `bench rdma`: it owns the buffers (started by
    /// it, not by hand).
    #[command(hide = true)]
    BenchRdmaPeer {
        /// Directory with the peer's credentials.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Run a host agent: it starts procs for owners authenticated by the
    /// cluster CA (`regent host --help` lists its options).
    #[command(disable_help_flag = true)]
    Host {
        /// The host agent's options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Print a running job's tree of meshes and members (owner, policy,
    /// generation, state per rank, restarts, last failures), from its
    /// admin endpoint.
    Status(admin::StatusOptions),
    /// A supervised data-parallel training job on procs of this binary,
    /// with faults injected on a seeded schedule, then its report.
    Train(Box<train::TrainOptions>),
    /// Chaos runs (`regent chaos soak --duration 1h --seed S`).
    Chaos {
        #[command(subcommand)]
        command: ChaosCommand,
    },
    /// Deterministic simulation: the chaos scenario (the real controller
    /// runtime, procs, cast trees and sessions on a simulated network and
    /// clock) for many seeds, every invariant checked on each; a failing
    /// seed prints how to replay it. Exits non-zero on any violation.
    Sim(regent_chaos::sim::runner::SimArgs),
    /// Make the cluster CA and issue credentials from it.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
}

#[derive(Debug, Subcommand)]
enum CaCommand {
    /// Make a new cluster CA: writes ca.crt and ca.key (mode 0600) into a
    /// directory (made with mode 0700).
    Init {
        /// The directory.
        #[arg(long)]
        dir: PathBuf,
        /// The CA's name (its certificate's subject).
        #[arg(long, default_value = "regent cluster")]
        name: String,
        /// Replace an existing CA.
        #[arg(long)]
        force: bool,
        /// How many days the CA is valid; it issues nothing valid longer.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
        valid_days: u32,
    },
    /// Issue the credentials of a host agent, a controller or a proc:
    /// writes NAME.crt, NAME.key (mode 0600) and ca.crt. Renew by issuing
    /// again before they expire (a running `regent host` reloads its
    /// credentials on SIGHUP).
    Issue {
        /// The proc id (a DNS label: a-z, 0-9, -).
        name: String,
        /// What the holder may do: `host-agent` (starts procs for
        /// controllers), `controller` (may spawn, renew, signal and stop
        /// procs on every host agent of the cluster) or `proc`.
        #[arg(long, value_parser = parse_role)]
        role: regent_net::Role,
        /// How many days the certificate is valid (default 7, a job's
        /// lifetime).
        #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=36500))]
        valid_days: u32,
        /// The directory of the CA.
        #[arg(long)]
        dir: PathBuf,
        /// Where to write the credentials (default: the CA's directory).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum ChaosCommand {
    /// Rounds of seeded faults on a mesh of this binary's procs, every
    /// invariant checked after each; a progress bar, then a report. Exits
    /// non-zero on any violation.
    Soak {
        /// How long (e.g. 1h, 30m, 90s).
        #[arg(long, default_value = "1h", value_parser = args::parse_duration)]
        duration: std::time::Duration,
        /// The seed (decimal or 0x hex); the same seed replays the same
        /// fault timelines. Default: a fresh one, printed.
        #[arg(long)]
        seed: Option<regent_chaos::Seed>,
        /// Procs in the mesh.
        #[arg(long, default_value_t = 4)]
        procs: u32,
        /// Members per proc.
        #[arg(long, default_value_t = 2)]
        per_proc: u32,
        /// Only these kinds of fault, comma-separated (e.g.
        /// kill,pause,loss). Default: all.
        #[arg(long)]
        faults: Option<String>,
        /// Procs' output: `fold` (prefixed, identical lines across ranks
        /// once), `all`, `json` (one object a line) or `off`.
        #[arg(long, default_value = "fold")]
        logs: regent_mesh::logs::LogMode,
        /// Each round's fault phase.
        #[arg(long, default_value = "60s", value_parser = args::parse_duration)]
        round: std::time::Duration,
        /// The admin endpoint (the live dashboard: the mesh, the timeline of
        /// failures and recoveries; status; metrics) and the HTML report
        /// (the same page, with the report in words).
        #[command(flatten)]
        admin: admin::AdminOptions,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Suite {
    Supervision,
    Net,
    Mesh,
    Recovery,
    Rdma,
    Tensor,
    Train,
}

/// mimalloc for the controller and the procs (the same binary): the
/// control plane allocates small buffers per message on several threads,
/// and glibc's malloc measured 20-38% fewer pipelined calls per second
/// (`docs/semantics.md` §4.1). libtorch's tensors keep their own allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // Procs log too: their stderr is their host agent's pipe to the
    // controller, each event on a member's thread tagged with the member
    // (`[train r2 g3]`, read back by the controller's log sink).
    // A proc's lines carry no time: the same event on several ranks folds
    // into one line at the controller.
    use std::io::IsTerminal as _;
    let proc = std::env::var(regent_mesh::boot::ROLE_ENV)
        .is_ok_and(|role| role == regent_mesh::boot::ROLE_PROC);
    // A simulation's runtimes log the failures its faults cause by the
    // thousand (escalations are errors): its history is its record, so it
    // logs nothing unless RUST_LOG asks.
    let simulating = std::env::args().nth(1).as_deref() == Some("sim");
    let default_filter = if simulating { "off" } else { "error" };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(regent_mesh::logs::ProcStderr)
        .with_ansi(std::io::stderr().is_terminal());
    if proc {
        logs.without_time().init();
    } else {
        logs.init();
    }
    // When a host agent started this binary as a proc or host agent, that
    // role runs here and the process exits; the controller continues.
    regent_mesh::bootstrap();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Demo => rt.block_on(demo::run()),
        Command::Bench { suite, quick, json } => {
            let opts = BenchOptions { quick };
            let mut report = Report::default();
            rt.block_on(async {
                match suite {
                    Suite::Supervision => bench::supervision::run(opts, &mut report).await,
                    Suite::Net => bench::net::run(opts, &mut report).await,
                    Suite::Rdma => bench::rdma::run(opts, &mut report).await,
                    Suite::Mesh => bench::mesh::run(opts, &mut report).await,
                    Suite::Recovery => bench::recovery::run(opts, &mut report).await,
                    Suite::Tensor => bench::tensor::run(opts, &mut report).await,
                    Suite::Train => bench::train::run(opts, &mut report).await,
                }
            })?;
            if let Some(path) = json {
                report.write_json(&path)?;
            }
            Ok(())
        }
        Command::BenchPeer { dir } => rt.block_on(bench::net::serve_peer(&dir)),
        Command::BenchRdmaPeer { dir } => rt.block_on(bench::rdma::serve_peer(&dir)),
        Command::Host { args } => {
            if args.iter().any(|a| a == "--help" || a == "-h") {
                println!("{}", regent_mesh::host::server::USAGE);
                return Ok(());
            }
            rt.block_on(regent_mesh::host::run_from_args(args))?;
            Ok(())
        }
        Command::Chaos {
            command:
                ChaosCommand::Soak {
                    duration,
                    seed,
                    procs,
                    per_proc,
                    faults,
                    logs,
                    round,
                    admin,
                },
        } => {
            let opts = chaos::SoakOptions {
                duration,
                seed,
                procs,
                per_proc,
                faults: faults
                    .map(|f| chaos::parse_real_faults(&f))
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                logs,
                round,
                admin,
            };
            let report = rt.block_on(chaos::soak(opts))?;
            if report.violations() > 0 {
                anyhow::bail!("{} invariant violation(s)", report.violations());
            }
            Ok(())
        }
        Command::Status(opts) => rt.block_on(admin::status(opts)),
        Command::Train(opts) => {
            if !rt.block_on(train::train(*opts))? {
                anyhow::bail!("the final weights differ from the fault-free reference");
            }
            Ok(())
        }
        Command::Sim(args) => regent_chaos::sim::runner::main(&args)
            .map(drop)
            .map_err(anyhow::Error::msg),
        Command::Ca { command } => ca(command),
    }
}

/// `regent ca init` and `regent ca issue`.
fn parse_role(s: &str) -> Result<regent_net::Role, String> {
    s.parse().map_err(|e: regent_net::Error| e.to_string())
}

fn days(n: u32) -> std::time::Duration {
    std::time::Duration::from_secs(u64::from(n) * 24 * 3600)
}

fn ca(command: CaCommand) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let private_dir = |dir: &std::path::Path| {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))
    };
    match command {
        CaCommand::Init {
            dir,
            name,
            force,
            valid_days,
        } => {
            if dir.join("ca.key").exists() && !force {
                anyhow::bail!(
                    "{} already holds a CA (ca.key); --force replaces it",
                    dir.display()
                );
            }
            private_dir(&dir)?;
            let validity = regent_net::Validity::for_duration(days(valid_days))?;
            regent_net::ClusterCa::generate_with_validity(&name, validity)?.save(&dir)?;
            println!(
                "cluster CA {name:?} written to {}, valid for {valid_days} days",
                dir.display()
            );
        }
        CaCommand::Issue {
            name,
            role,
            valid_days,
            dir,
            out,
        } => {
            let proc = regent_net::ProcId::new(&name)?;
            let ca = regent_net::ClusterCa::load(&dir)?;
            let out = out.unwrap_or(dir);
            private_dir(&out)?;
            let validity = regent_net::Validity::for_duration(days(valid_days))?;
            ca.issue(&proc, role, validity)?.save(&out)?;
            println!(
                "credentials of {proc} ({role}, valid for {valid_days} days) written to {}: {proc}.crt, {proc}.key, ca.crt",
                out.display()
            );
        }
    }
    Ok(())
}
