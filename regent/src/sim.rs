//! `regent sim`: the chaos scenario under deterministic simulation
//! (`regent_chaos::sim`), seed after seed, on worker threads (each seed on
//! a paused current-thread runtime of its own), with a progress bar and a
//! summary; a failing seed prints the command that replays it with its
//! history.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use regent_chaos::sim::{SimConfig, SimOutcome, run_seed};
use regent_chaos::{FaultKind, FaultMix};

/// What to simulate.
#[derive(Debug, Clone)]
pub(crate) struct SimOptions {
    /// The first seed.
    pub(crate) from: u64,
    /// How many seeds.
    pub(crate) seeds: u64,
    /// Worker threads.
    pub(crate) jobs: usize,
    /// Print each seed's history.
    pub(crate) trace: bool,
    /// Procs and members per proc.
    pub(crate) procs: u32,
    pub(crate) per_proc: u32,
    /// Known bugs to plant.
    pub(crate) plant: Vec<regent_mesh::bugs::PlantedBug>,
    /// Only these kinds of fault (`None`: every simulated kind).
    pub(crate) faults: Option<Vec<FaultKind>>,
}

/// What a run of seeds came to.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    pub(crate) seeds: u64,
    pub(crate) failed: Vec<SimOutcome>,
    pub(crate) faults: BTreeMap<FaultKind, u64>,
    pub(crate) checked: BTreeMap<&'static str, u64>,
    pub(crate) simulated_secs: f64,
    pub(crate) wall_secs: f64,
}

/// Runs the seeds; prints progress, failing seeds and (with `trace`) every
/// history as they end.
pub(crate) fn run(opts: &SimOptions) -> anyhow::Result<Summary> {
    anyhow::ensure!(opts.seeds > 0, "no seeds to run");
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
        )?
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
        if !msg.starts_with(regent_chaos::workload::INJECTED_PANIC) {
            default_hook(info);
        }
    }));
    let started = Instant::now();
    let next = AtomicU64::new(0);
    let summary = Mutex::new(Summary::default());
    let violations = AtomicU64::new(0);
    let jobs = opts.jobs.clamp(1, 64).min(opts.seeds as usize);
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
pub(crate) fn default_jobs() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
