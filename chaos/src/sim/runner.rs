//! `regent sim`'s runner: many seeds of the simulated chaos scenario
//! ([`run_seed`]) on worker threads (each seed on a paused current-thread
//! runtime of its own), with a progress bar and a summary; a failing seed
//! prints the command that replays it with its history.
//!
//! Both `regent sim` and this crate's `regent-sim` binary (the same
//! command, built without the training stack: CI builds it in about half
//! the time) parse [`SimArgs`] and call [`main`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use regent_mesh::bugs::PlantedBug;

use super::{SimConfig, SimOutcome, run_seed};
use crate::schedule::{FaultKind, FaultMix, parse_fault_kinds};

/// The command line of `regent sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// How many seeds, from `--from`.
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Run just this seed (the same as `--from S --seeds 1`).
    #[arg(long, conflicts_with_all = ["seeds", "from"])]
    pub seed: Option<u64>,
    /// Print each seed's history (timeline, failures, generations,
    /// verdicts, with simulated times) and hash.
    #[arg(long)]
    pub trace: bool,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Procs in the mesh.
    #[arg(long, default_value_t = 3)]
    pub procs: u32,
    /// Members per proc.
    #[arg(long, default_value_t = 2)]
    pub per_proc: u32,
    /// Plant a known bug in the runtime (duplicate-delivery,
    /// no-fencing, drop-member-exit, unordered-casts), to see the checkers
    /// catch it.
    #[arg(long)]
    pub plant: Vec<PlantedBug>,
    /// Only these kinds of fault, comma-separated (e.g.
    /// pause,actor-panic). Default: all that are simulated.
    #[arg(long)]
    pub faults: Option<String>,
}

/// Runs what `args` say, prints the summary; `Err` names the failing seeds'
/// count (each was printed with its replay command as it ended).
pub fn main(args: &SimArgs) -> Result<Summary, String> {
    let opts = SimOptions {
        from: args.seed.unwrap_or(args.from),
        seeds: if args.seed.is_some() { 1 } else { args.seeds },
        jobs: args.jobs.unwrap_or_else(default_jobs),
        trace: args.trace,
        procs: args.procs,
        per_proc: args.per_proc,
        plant: args.plant.clone(),
        faults: args.faults.as_deref().map(parse_fault_kinds).transpose()?,
    };
    let summary = run(&opts)?;
    println!("{summary}");
    if summary.failed.is_empty() {
        Ok(summary)
    } else {
        Err(format!(
            "{} seed(s) violated an invariant",
            summary.failed.len()
        ))
    }
}

/// What to simulate: [`SimArgs`] with its defaults resolved and its fault
/// list parsed.
#[derive(Debug, Clone)]
struct SimOptions {
    from: u64,
    seeds: u64,
    jobs: usize,
    trace: bool,
    procs: u32,
    per_proc: u32,
    plant: Vec<PlantedBug>,
    faults: Option<Vec<FaultKind>>,
}

/// What a run of seeds came to.
#[derive(Debug, Default)]
pub struct Summary {
    /// Seeds run.
    pub seeds: u64,
    /// The seeds that violated an invariant, by seed.
    pub failed: Vec<SimOutcome>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Facts checked, by invariant.
    pub checked: BTreeMap<&'static str, u64>,
    /// Simulated time over all seeds.
    pub simulated_secs: f64,
    /// Wall time of the run.
    pub wall_secs: f64,
}

/// Runs the seeds; prints progress, failing seeds and (with `trace`) every
/// history as they end.
fn run(opts: &SimOptions) -> Result<Summary, String> {
    if opts.seeds == 0 {
        return Err("no seeds to run".into());
    }
    let mut config = SimConfig {
        procs: opts.procs,
        per_proc: opts.per_proc,
        bugs: opts.plant.clone(),
        ..SimConfig::default()
    };
    if let Some(kinds) = &opts.faults {
        config.schedule = config.schedule.mix(FaultMix::only(kinds));
    }
    let bar = indicatif::ProgressBar::new(opts.seeds);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} seeds ({per_sec}) {msg}",
        )
        .map_err(|e| e.to_string())?
        .progress_chars("=> "),
    );
    if opts.trace {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    // The timelines make members panic on purpose: those panics are caught
    // and reported by the mesh, so their messages are not printed; any
    // other panic still is.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !msg.starts_with(crate::workload::INJECTED_PANIC) {
            default_hook(info);
        }
    }));
    let started = Instant::now();
    let next = AtomicU64::new(0);
    let summary = Mutex::new(Summary::default());
    let violations = AtomicU64::new(0);
    let jobs = opts
        .jobs
        .clamp(1, 64)
        .min(usize::try_from(opts.seeds).unwrap_or(usize::MAX));
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= opts.seeds {
                        return;
                    }
                    let seed = opts.from.wrapping_add(i);
                    let o = run_seed(seed, &config);
                    if opts.trace {
                        bar.suspend(|| print_trace(&o));
                    }
                    let bad = o.violations() > 0;
                    if bad {
                        let v = violations.fetch_add(1, Ordering::Relaxed) + 1;
                        bar.set_message(format!("{v} failing seed(s)"));
                        bar.suspend(|| {
                            eprintln!("seed {seed} fails:");
                            for line in o.failures() {
                                eprintln!("  {line}");
                            }
                            eprintln!("  replay: regent sim --seed {seed} --trace");
                        });
                    }
                    {
                        // Held for bookkeeping only.
                        let mut sum = summary.lock().unwrap_or_else(|p| p.into_inner());
                        sum.seeds += 1;
                        sum.simulated_secs += o.simulated.as_secs_f64();
                        for (k, n) in &o.faults {
                            *sum.faults.entry(*k).or_insert(0) += n;
                        }
                        for i in &o.invariants {
                            *sum.checked.entry(i.name).or_insert(0) += i.checked;
                        }
                        if bad {
                            sum.failed.push(o);
                        }
                    }
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    let mut sum = summary.into_inner().unwrap_or_else(|p| p.into_inner());
    sum.wall_secs = started.elapsed().as_secs_f64();
    sum.failed.sort_by_key(|o| o.seed);
    Ok(sum)
}

fn print_trace(o: &SimOutcome) {
    println!(
        "seed {}: hash {:016x}, {} trace events, {:.3}s simulated, generation {}",
        o.seed,
        o.hash,
        o.trace_events,
        o.simulated.as_secs_f64(),
        o.generation
    );
    for line in &o.history {
        println!("  {line}");
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation report")?;
        writeln!(
            f,
            "  seeds: {} in {:.1}s ({:.1} seeds/s), {:.0}s simulated",
            self.seeds,
            self.wall_secs,
            self.seeds as f64 / self.wall_secs.max(1e-9),
            self.simulated_secs
        )?;
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{} {n}", k.name()))
            .collect();
        writeln!(
            f,
            "  faults: {} ({})",
            self.faults.values().sum::<u64>(),
            faults.join(", ")
        )?;
        for (name, n) in &self.checked {
            if *n == 0 {
                writeln!(f, "  {name}: not checked in simulation")?;
            } else {
                writeln!(f, "  {name}: {n} facts checked")?;
            }
        }
        if self.failed.is_empty() {
            write!(f, "  every seed kept every invariant")
        } else {
            let seeds: Vec<String> = self.failed.iter().map(|o| o.seed.to_string()).collect();
            write!(
                f,
                "  {} failing seed(s): {} (replay one: regent sim --seed {} --trace)",
                self.failed.len(),
                seeds.join(", "),
                self.failed[0].seed
            )
        }
    }
}

/// The worker threads by default: one per core.
fn default_jobs() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
