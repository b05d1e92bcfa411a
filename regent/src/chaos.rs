//! `regent chaos soak`: the chaos runner for a long time — rounds of seeded
//! faults (kills, pauses, graceful stops, actor panics, partitions,
//! blackholes, loss, delay, duplication, reordering, bandwidth caps) on a
//! mesh of this binary's procs behind chaos proxies, each round healed and
//! checked against every invariant; a progress bar while it runs and a
//! final report: faults injected by type, recoveries, detection and
//! recovery latency p50/p99, invariant results. Its controller serves the
//! admin endpoint (the live dashboard's link is printed as the run starts)
//! as `regent train`'s does.
//!
//! Every run prints its seed; `--seed` replays the same fault timelines.

use std::time::Duration;

use regent_chaos::scenario::run_with;
use regent_chaos::{
    ClusterConfig, FaultKind, FaultMix, Length, Report, Scenario, ScheduleConfig, Seed,
};

/// What `regent chaos soak` was asked.
#[derive(Debug, Clone)]
pub(crate) struct SoakOptions {
    /// How long to run (the last round completes).
    pub(crate) duration: Duration,
    /// The seed (`None`: a fresh one, printed).
    pub(crate) seed: Option<Seed>,
    /// Procs in the mesh.
    pub(crate) procs: u32,
    /// Members per proc.
    pub(crate) per_proc: u32,
    /// Each round's fault phase.
    pub(crate) round: Duration,
    /// The kinds of fault to inject (`None`: all).
    pub(crate) faults: Option<Vec<FaultKind>>,
    /// What becomes of procs' output.
    pub(crate) logs: regent_mesh::logs::LogMode,
    /// The admin endpoint, and the HTML report (the timeline of failures
    /// and recoveries, the mesh, the report in words).
    pub(crate) admin: crate::admin::AdminOptions,
}

impl Default for SoakOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(3600),
            seed: None,
            procs: 4,
            per_proc: 2,
            round: Duration::from_secs(60),
            faults: None,
            logs: regent_mesh::logs::LogMode::Fold,
            admin: crate::admin::AdminOptions::default(),
        }
    }
}

/// Parses a comma-separated list of fault kinds
/// ([`regent_chaos::schedule::parse_fault_kinds`]) for real processes: the
/// kinds only a simulation can inject are refused.
pub(crate) fn parse_real_faults(text: &str) -> Result<Vec<FaultKind>, String> {
    let kinds = regent_chaos::schedule::parse_fault_kinds(text)?;
    match kinds.iter().find(|k| k.is_simulated_only()) {
        Some(k) => Err(format!(
            "{k} is injected only in simulation (regent sim --faults {k})"
        )),
        None => Ok(kinds),
    }
}

/// The soak's scenario for these options and seed.
pub(crate) fn scenario(opts: &SoakOptions, seed: Seed) -> Scenario {
    let mix = match &opts.faults {
        Some(kinds) => FaultMix::only(kinds),
        None => FaultMix::default(),
    };
    let schedule = ScheduleConfig::default()
        .duration(opts.round)
        .mean_gap(Duration::from_secs(3))
        .lasting(Duration::from_millis(300), Duration::from_secs(4))
        .max_concurrent(2)
        .mix(mix);
    Scenario::new("soak", seed)
        .mesh(opts.procs, opts.per_proc)
        .schedule(schedule)
}

/// Runs the soak: prints the seed and the dashboard's link, shows
/// progress, prints the report and returns it (the caller fails on
/// violations).
pub(crate) async fn soak(opts: SoakOptions) -> anyhow::Result<Report> {
    let seed = opts.seed.unwrap_or_else(Seed::from_entropy);
    let kinds: Vec<&str> = match &opts.faults {
        Some(k) => k.iter().map(|k| k.name()).collect(),
        None => vec!["all"],
    };
    println!(
        "regent chaos soak: seed {seed} (replay: regent chaos soak --seed {seed}), {} procs x {} members, {:?}, faults: {}",
        opts.procs,
        opts.per_proc,
        opts.duration,
        kinds.join(",")
    );
    let scenario = scenario(&opts, seed);
    let bar = indicatif::ProgressBar::new(opts.duration.as_secs().max(1));
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {percent:>3}% {msg}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message("starting");
    let ticker = {
        let bar = bar.clone();
        let start = std::time::Instant::now();
        tokio::spawn(async move {
            loop {
                bar.set_position(start.elapsed().as_secs());
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let cluster = ClusterConfig::default().runtime(
        regent_mesh::RuntimeConfig::default()
            .owner_lease(Duration::from_secs(5))
            .call_timeout(Duration::from_secs(8))
            .logs(regent_mesh::logs::LogConfig::default().mode(opts.logs)),
    );
    // The controller, as soon as it runs: its admin endpoint serves the
    // whole run.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let serve = async {
        let rt: regent_mesh::Runtime = started_rx.await.ok()?;
        match opts.admin.start(&rt, None).await {
            Ok(admin) => Some((rt, admin)),
            Err(e) => {
                // The soak runs on without it.
                eprintln!("regent chaos soak: no admin endpoint: {e}");
                Some((rt, None))
            }
        }
    };
    let soak = run_with(
        &scenario,
        cluster,
        Length::Duration(opts.duration),
        |rt| {
            let _ = started_tx.send(rt.clone());
        },
        |p| {
            bar.set_message(format!(
                "round {}, {} faults, generation {}, {} violation(s)",
                p.rounds, p.faults, p.generation, p.violations
            ));
            if p.violations > 0 {
                bar.println(format!(
                    "violations by round {} — its timeline:\n{}",
                    p.rounds, p.schedule
                ));
            }
        },
    );
    let (report, served) = tokio::join!(soak, serve);
    ticker.abort();
    bar.finish_and_clear();
    let report = report?;
    println!("{report}");
    let (runtime, admin) = served.unzip();
    let admin = admin.flatten();
    if let (Some(path), Some(rt)) = (&opts.admin.report_html, &runtime) {
        let title = format!("regent chaos soak: seed {seed}, {:?}", opts.duration);
        let text = report.to_string();
        let data = crate::admin::report_data(rt, &title, None, Some(&text));
        crate::admin::write_report(path, &data)?;
        println!("  report: {}", path.display());
    }
    if let Some(a) = &admin
        && !opts.admin.linger.is_zero()
    {
        println!(
            "  the dashboard stays up for {:?}: {}",
            opts.admin.linger,
            a.url()
        );
        tokio::time::sleep(opts.admin.linger).await;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_lists_parse() {
        assert!(parse_real_faults("kill,clock-jump").is_err());
        assert!(parse_real_faults("host-loss").is_err());
        assert_eq!(parse_real_faults("pause").unwrap(), vec![FaultKind::Pause]);
    }

    #[test]
    fn the_soak_replays_its_timelines_from_the_seed() {
        let opts = SoakOptions::default();
        let a = scenario(&opts, Seed(5));
        let b = scenario(&opts, Seed(5));
        for round in 0..3 {
            assert_eq!(a.round_schedule(round), b.round_schedule(round));
        }
        assert_ne!(a.round_schedule(0), a.round_schedule(1));
    }
}
