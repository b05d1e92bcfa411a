//! `regent train`: a supervised data-parallel training job on procs of this
//! binary (the local allocator), with faults injected on a seeded schedule,
//! a progress bar, and a report at the end (also as JSON with
//! `--report-json`); `--verify` also computes the fault-free result and
//! compares the final weights bit for bit.

use std::path::PathBuf;
use std::time::Duration;

use regent_mesh::Decision;
use std::sync::Arc;

use regent_train::job::run::{FaultKind, FaultPlan, FaultSpacing, Isolate, percentile};
use regent_train::job::{
    JobCluster, JobConfig, JobEvent, JobSpec, ModelSpec, NanPolicy, OptimSpec, Report,
    reference_with_skips, run_job,
};

/// What `regent train` was asked (its command line).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TrainOptions {
    /// Procs (data-parallel ranks).
    #[arg(long, default_value_t = 4)]
    pub(crate) procs: u32,
    /// The model: `gpt` (a char-level transformer), `mlp` (1.8M
    /// parameters) or `mlp-small` (27K parameters, for tests).
    #[arg(long, default_value = "gpt")]
    pub(crate) model: String,
    /// A text file for the gpt (default: a corpus generated from the
    /// seed).
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Steps to reach.
    #[arg(long, default_value_t = 300)]
    pub(crate) steps: u64,
    /// A checkpoint every this many steps (0: never).
    #[arg(long, default_value_t = 50)]
    pub(crate) checkpoint_every: u64,
    /// Where checkpoints live; the same directory resumes a job.
    #[arg(long, default_value = "regent-run")]
    pub(crate) run_dir: PathBuf,
    /// Start from step 0: clear the run directory's job first (its
    /// checkpoints, final state and job record; refused while another
    /// controller runs in it, or if it holds anything else).
    #[arg(long)]
    pub(crate) fresh: bool,
    /// Faults to inject: `KIND[,KIND...][:EVERY]`, kinds `kill`,
    /// `pause` (SIGSTOP, then SIGCONT 2.5 s later), `partition` (a proc
    /// cut off for 2.5 s, through UDP proxies) and `nan` (a NaN in one
    /// rank's gradient of a step), taken in turn, every so long or every
    /// so many committed steps (e.g. `kill:15s`, `kill,pause:5s`,
    /// `kill:75steps`).
    #[arg(long)]
    pub(crate) chaos: Option<String>,
    /// Also compute the fault-free result and compare the final weights
    /// bit for bit (exits non-zero if they differ).
    #[arg(long)]
    pub(crate) verify: bool,
    /// What a failure restarts: `member` (heal from a live peer) or
    /// `mesh` (resume from the checkpoint).
    #[arg(long, default_value = "member")]
    pub(crate) policy: String,
    /// The seed of weights, data and faults.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// A step that takes longer fails (its hung ranks are replaced).
    #[arg(long, default_value = "20s", value_parser = crate::args::parse_duration)]
    pub(crate) step_timeout: Duration,
    /// The shortest silence after which a proc's control link is declared
    /// failed: the adaptive detector holds a quiet link to it and gives a
    /// link whose heartbeats come late (loaded cores) more, up to 3 s; a
    /// paused or cut-off proc is found after about this long. `off`: a
    /// fixed 3 s, which leaves a paused proc to the step deadline.
    #[arg(long, default_value = "200ms", value_parser = parse_detect_min)]
    pub(crate) failure_timeout_min: DetectMin,
    /// What a step with a non-finite loss or mean gradient does: `skip`
    /// (every rank drops it; the report lists it) or `restore` (every
    /// rank restores the last checkpoint and replays; the same step
    /// non-finite again fails the job).
    #[arg(long, default_value = "skip")]
    pub(crate) on_nan: String,
    /// Fault injection: steps (comma-separated) whose gradient on one
    /// rank is poisoned with a NaN every time they are computed (a bad
    /// batch).
    #[arg(long, value_delimiter = ',')]
    pub(crate) nan_at: Vec<u64>,
    /// Warm spare procs to keep: a killed or hung rank restarts in a
    /// waiting process (an idle proc each) instead of a newly started one.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=regent_mesh::MAX_SPARES as i64))]
    pub(crate) spares: u16,
    /// libtorch intra-op threads per proc (the same in every proc and
    /// the reference, for bit-identical results).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=256))]
    pub(crate) threads: i32,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub(crate) report_json: Option<PathBuf>,
    /// Procs' output: `fold` (prefixed `[train r2 g3]`, identical lines
    /// across ranks once), `all`, `json` (one object a line) or `off`. A
    /// proc that dies shows its last lines in its failure either way.
    #[arg(long, default_value = "fold")]
    pub(crate) logs: regent_mesh::logs::LogMode,
    /// The admin endpoint, the dashboard and the HTML report.
    #[command(flatten)]
    pub(crate) admin: crate::admin::AdminOptions,
}

/// `--failure-timeout-min`: the adaptive detector's minimum, or `None`
/// (off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DetectMin(pub(crate) Option<Duration>);

/// `--failure-timeout-min`: `off`, or a duration the job's links take
/// (from twice their heartbeat interval to their failure timeout, as the
/// endpoint's own check says).
fn parse_detect_min(text: &str) -> Result<DetectMin, String> {
    if text.trim() == "off" {
        return Ok(DetectMin(None));
    }
    let d = crate::args::parse_duration(text)?;
    JobCluster::runtime_config_detecting(Some(d))
        .endpoint
        .validate()
        .map_err(|e| format!("{text:?}: {e} (or off)"))?;
    Ok(DetectMin(Some(d)))
}

/// Parses `--chaos`: `KIND[,KIND...][:EVERY]` (kinds `kill`, `pause`,
/// `partition`, `nan`; `EVERY` a time like `15s`, `500ms`, or a number of
/// committed steps like `75steps`; default 15 s).
pub(crate) fn parse_chaos(text: &str, seed: u64, until_step: u64) -> Result<FaultPlan, String> {
    let (kinds, every) = match text.split_once(':') {
        Some((k, e)) => (k, parse_spacing(e)?),
        None => (text, FaultSpacing::Time(Duration::from_secs(15))),
    };
    let kinds = kinds
        .split(',')
        .map(|k| match k.trim() {
            "kill" => Ok(FaultKind::Kill),
            "pause" => Ok(FaultKind::Pause),
            "partition" => Ok(FaultKind::Partition),
            "nan" => Ok(FaultKind::Nan),
            other => Err(format!(
                "unknown fault kind {other:?} (kill, pause, partition, nan)"
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(FaultPlan {
        every,
        kinds,
        pause: Duration::from_millis(2500),
        seed,
        until_step,
    })
}

/// `75steps` or a duration of at least 100 ms.
fn parse_spacing(text: &str) -> Result<FaultSpacing, String> {
    let text = text.trim();
    if let Some(n) = text.strip_suffix("steps") {
        return match n.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(FaultSpacing::Steps(n)),
            _ => Err(format!("faults every {text:?}: a positive number of steps")),
        };
    }
    let every = crate::args::parse_duration(text)?;
    if every < Duration::from_millis(100) {
        return Err(format!("faults every {every:?}: at least 100 ms apart"));
    }
    Ok(FaultSpacing::Time(every))
}

fn spec(opts: &TrainOptions) -> anyhow::Result<JobSpec> {
    let (model, optimizer) = match opts.model.as_str() {
        "mlp" => (
            ModelSpec::mlp(),
            OptimSpec::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
        ),
        "mlp-small" => (
            ModelSpec::mlp_small(),
            OptimSpec::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
        ),
        "gpt" => (
            ModelSpec::gpt(opts.data.clone()),
            OptimSpec::AdamW {
                lr: 3e-3,
                weight_decay: 0.01,
            },
        ),
        other => anyhow::bail!("unknown model {other:?} (gpt, mlp, mlp-small)"),
    };
    Ok(JobSpec {
        model,
        optimizer,
        seed: opts.seed,
        world: opts.procs,
    })
}

/// The file of a run directory that records its job's spec.
pub(crate) const JOB_FILE: &str = "job.json";

/// Records the job's spec in its run directory (`job.json`), or checks it
/// against the one there: a run directory resumes only the job it holds
/// (another model, seed or world would load a checkpoint that does not fit,
/// or silently train a different job on from it).
fn check_run_dir(dir: &std::path::Path, spec: &JobSpec) -> anyhow::Result<()> {
    let path = dir.join(JOB_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let held: JobSpec = serde_json::from_slice(&bytes)
                .map_err(|e| anyhow::anyhow!("{} is not a job spec: {e}", path.display()))?;
            if held != *spec {
                anyhow::bail!(
                    "{} holds another job ({held:?}) than this one ({spec:?}): use another --run-dir",
                    dir.display()
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
            let tmp = dir.join(format!(".{JOB_FILE}.tmp"));
            std::fs::write(&tmp, serde_json::to_vec_pretty(spec)?)
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            Ok(())
        }
        Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
    }
}

/// What a run directory may hold: the job's own files (`regent_train::job`
/// writes checkpoints `ckpt-*`, `latest`, `final.safetensors`, their
/// temporaries `.*`, and `lock`; this command writes [`JOB_FILE`] and the
/// admin endpoint's address and token).
fn is_job_file(name: &str) -> bool {
    name == JOB_FILE
        || name == crate::admin::ADDR_FILE
        || name == crate::admin::TOKEN_FILE
        || name == "latest"
        || name == "lock"
        || name == "final.safetensors"
        || name.starts_with("ckpt-")
        || name.starts_with('.')
}

/// `--fresh`: clears a run directory of its job, under its lock (so not
/// while another controller runs in it). A directory holding anything but
/// a job's files is refused, never cleared.
fn clear_run_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => anyhow::bail!("cannot read {}: {e}", dir.display()),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_job_file(&name) || !entry.file_type()?.is_file() {
            anyhow::bail!(
                "--fresh: {} holds {name:?}, which is not a job's file: not clearing it",
                dir.display()
            );
        }
        names.push(name);
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))?;
    if lock.try_lock().is_err() {
        anyhow::bail!(
            "--fresh: another controller runs a job in {}",
            dir.display()
        );
    }
    for name in names.iter().filter(|n| *n != "lock") {
        std::fs::remove_file(dir.join(name))?;
    }
    Ok(())
}

/// Runs the job; returns whether `--verify` (if asked) found the weights
/// equal.
pub(crate) async fn train(opts: TrainOptions) -> anyhow::Result<bool> {
    let spec = spec(&opts)?;
    if opts.fresh {
        clear_run_dir(&opts.run_dir)?;
    }
    check_run_dir(&opts.run_dir, &spec)?;
    let mut config = JobConfig::new(spec.clone(), opts.steps, opts.run_dir.clone());
    config.checkpoint_every = opts.checkpoint_every;
    config.step_timeout = opts.step_timeout;
    config.on_failure = match opts.policy.as_str() {
        "member" => Decision::RestartMember,
        "mesh" => Decision::RestartMesh,
        other => anyhow::bail!("unknown policy {other:?} (member, mesh)"),
    };
    config.on_nan = match opts.on_nan.as_str() {
        "skip" => NanPolicy::Skip,
        "restore" => NanPolicy::Restore,
        other => anyhow::bail!("unknown non-finite policy {other:?} (skip, restore)"),
    };
    config.nan_at = opts.nan_at.clone();
    config.threads = opts.threads;
    config.spares = usize::from(opts.spares);
    // Faults stop a few steps before the end, so the run ends.
    let until = opts.steps.saturating_sub(opts.steps / 10);
    config.faults = opts
        .chaos
        .as_deref()
        .map(|c| parse_chaos(c, opts.seed, until))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    println!(
        "regent train: {} on {} procs, {} steps, checkpoints every {} in {}, faults: {}",
        opts.model,
        opts.procs,
        opts.steps,
        opts.checkpoint_every,
        opts.run_dir.display(),
        opts.chaos.as_deref().unwrap_or("none")
    );
    let bar = indicatif::ProgressBar::new(opts.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let mut faults = 0;
    let mut steps_seen: Vec<std::time::Instant> = Vec::new();
    // Partitions need UDP proxies in front of every endpoint: the chaos
    // crate's cluster; otherwise the plain local allocator.
    let partitions = config
        .faults
        .as_ref()
        .is_some_and(|f| f.kinds.contains(&FaultKind::Partition));
    let mut chaos_cluster = None;
    let runtime = JobCluster::runtime_config_detecting(opts.failure_timeout_min.0)
        .logs(regent_mesh::logs::LogConfig::default().mode(opts.logs));
    let cluster = if partitions {
        let c = regent_chaos::ClusterConfig {
            runtime: runtime.clone(),
            ..regent_chaos::ClusterConfig::default()
        };
        let c = regent_chaos::ChaosCluster::start(c, regent_chaos::Seed(opts.seed)).await?;
        let network = c.network().clone();
        let chaos_alloc = c.allocator().clone();
        let isolate: Isolate = Arc::new(move |proc, cut| {
            if let Some(node) = chaos_alloc.node_of(proc) {
                network.update(|r| {
                    if cut {
                        r.isolated.insert(node);
                    } else {
                        r.isolated.remove(&node);
                    }
                });
            }
        });
        let allocator: Arc<dyn regent_mesh::alloc::Allocator> = c.allocator().clone();
        let cluster = JobCluster {
            runtime: c.runtime().clone(),
            allocator,
            isolate: Some(isolate),
        };
        chaos_cluster = Some(c);
        cluster
    } else {
        JobCluster::local(runtime).await?
    };
    let runtime = cluster.runtime.clone();
    let admin = opts.admin.start(&runtime, Some(&opts.run_dir)).await?;
    if opts.admin.report_html.is_some() && admin.is_none() {
        anyhow::bail!("--report-html draws from the admin endpoint: not with --admin off");
    }
    if let Some(a) = &admin {
        a.train_started(opts.steps);
    }
    let mut best = 0;
    let report = run_job(config, cluster, |e| match e {
        JobEvent::Started { step, parameters } => {
            bar.set_position(step);
            bar.println(format!(
                "  {parameters} parameters; starting at step {step}"
            ));
        }
        JobEvent::Step {
            step,
            loss,
            generation,
            time,
        } => {
            if let Some(a) = &admin {
                a.step(
                    crate::admin::StepPoint {
                        step,
                        loss,
                        time_ms: time.as_secs_f64() * 1e3,
                        at_ms: a.now_ms(),
                        generation,
                    },
                    step > best,
                );
            }
            best = best.max(step);
            let now = std::time::Instant::now();
            steps_seen.push(now);
            steps_seen.retain(|t| now.duration_since(*t) < Duration::from_secs(5));
            let rate = steps_seen.len() as f64 / 5.0;
            bar.set_position(step);
            bar.set_message(format!(
                "loss {loss:.4}, {rate:.1} steps/s, generation {generation}, {faults} faults"
            ));
        }
        JobEvent::Failure(what) => {
            faults += 1;
            // A dead proc's last lines come with it (`--logs` aside).
            bar.println(format!("  {what}"));
        }
        JobEvent::Recovered { step, how } => bar.println(format!("  step {step}: {how}")),
        JobEvent::Checkpoint { step, bytes } => bar.set_message(format!(
            "checkpoint at step {step} ({:.1} MB)",
            bytes as f64 / 1e6
        )),
        JobEvent::NonFinite { step, policy } => bar.println(format!(
            "  step {step}: the loss or the mean gradient is not finite ({})",
            policy.name()
        )),
    })
    .await;
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            bar.abandon();
            if let Some(c) = chaos_cluster {
                c.shutdown(Duration::from_secs(5)).await;
            }
            return Err(e.into());
        }
    };
    bar.finish_and_clear();
    if let Some(a) = &admin {
        a.done();
    }
    if let Some(c) = chaos_cluster {
        c.shutdown(Duration::from_secs(5)).await;
    }
    println!("{report}");
    let verdict = if opts.verify {
        let skipped = report.skipped.clone();
        let (steps, threads) = (opts.steps, opts.threads);
        let expected = tokio::task::spawn_blocking(move || {
            reference_with_skips(&spec, steps, threads, &skipped)
        })
        .await??;
        let got = report.state()?;
        let difference = expected.first_difference(&got)?;
        match &difference {
            None => println!(
                "  verify: the final weights equal the fault-free reference's bit for bit ({} steps{})",
                opts.steps,
                if report.skipped.is_empty() {
                    String::new()
                } else {
                    format!(", skipping {:?}", report.skipped)
                }
            ),
            Some(d) => {
                println!("  verify: the final weights DIFFER from the fault-free reference: {d:?}")
            }
        }
        Some(difference.map(|d| format!("{d:?}")))
    } else {
        None
    };
    if let Some(path) = &opts.report_json {
        let json = report_json(&opts, &report, verdict.as_ref());
        let text = serde_json::to_string_pretty(&json)?;
        std::fs::write(path, text + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    if let (Some(path), Some(a)) = (&opts.admin.report_html, &admin) {
        let title = format!(
            "regent train: {} on {} procs, {} steps, faults {}",
            opts.model,
            opts.procs,
            opts.steps,
            opts.chaos.as_deref().unwrap_or("none")
        );
        let mut data = a.data(&title);
        data["report"] = report_json(&opts, &report, verdict.as_ref());
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
    Ok(!matches!(verdict, Some(Some(_))))
}

/// The report as JSON (`--report-json`); durations in milliseconds.
/// `verify` is `null` without `--verify`, else `{"equal": bool,
/// "difference": null | "where the first bits differ"}`.
fn report_json(
    opts: &TrainOptions,
    report: &Report,
    verdict: Option<&Option<String>>,
) -> serde_json::Value {
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let list = |v: &[Duration]| v.iter().map(ms).collect::<Vec<f64>>();
    let p = |v: &[Duration], q: f64| percentile(v, q).map(|d| ms(&d));
    let faults: serde_json::Map<String, serde_json::Value> = report
        .faults
        .iter()
        .map(|(k, n)| (k.name().to_string(), serde_json::Value::from(*n)))
        .collect();
    serde_json::json!({
        "model": opts.model,
        "procs": opts.procs,
        "policy": opts.policy,
        "on_nan": opts.on_nan,
        "seed": opts.seed,
        "steps": report.steps,
        "start_step": report.start_step,
        "committed": report.steps - report.start_step,
        "failed_steps": report.failed_steps,
        "replayed": report.replayed,
        "faults": faults,
        "failures": report.failures,
        "generation": report.generation,
        "spares_taken": report.spares_taken,
        "hung": report.hung,
        "heals": report.heals.len(),
        "heal_bytes": report.heals.iter().map(|(b, _)| b).sum::<u64>(),
        "heal_ms": report.heals.iter().map(|(_, d)| ms(d)).collect::<Vec<_>>(),
        "restores": report.restores,
        "nonfinite": report.nonfinite,
        "skipped": report.skipped,
        "nan_restores": report.nan_restores,
        "checkpoints": report.checkpoints.len(),
        "checkpoint_bytes": report.checkpoints.iter().map(|(b, _)| b).sum::<u64>(),
        "checkpoint_ms": report.checkpoints.iter().map(|(_, d)| ms(d)).collect::<Vec<_>>(),
        "detection_ms": list(&report.detection),
        "undetected": report.undetected,
        "recovery_ms": list(&report.recovery),
        "recovery_p50_ms": p(&report.recovery, 50.0),
        "recovery_p99_ms": p(&report.recovery, 99.0),
        "useful_s": report.useful.as_secs_f64(),
        "wall_s": report.wall.as_secs_f64(),
        "goodput": report.goodput(),
        "final_loss": report.final_loss,
        "final_state": report.final_state,
        "verify": verdict.map(|d| serde_json::json!({
            "equal": d.is_none(),
            "difference": d,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use regent_train::job::{JOB_FAILURE_TIMEOUT, JOB_FAILURE_TIMEOUT_MIN, JOB_HEARTBEAT};

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("regent-fresh-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn fresh_clears_a_jobs_files_and_nothing_else() {
        let d = dir("job");
        for f in [
            JOB_FILE,
            "latest",
            "ckpt-00000050.safetensors",
            "final.safetensors",
            ".ckpt.tmp-1-2",
        ] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        clear_run_dir(&d).unwrap();
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["lock"], "only the lock is left");
        // A missing directory is already clear.
        std::fs::remove_dir_all(&d).unwrap();
        clear_run_dir(&d).unwrap();
    }

    #[test]
    fn fresh_refuses_a_directory_that_holds_other_files_or_a_live_job() {
        let d = dir("other");
        std::fs::write(d.join("latest"), b"x").unwrap();
        std::fs::write(d.join("notes.txt"), b"mine").unwrap();
        let e = clear_run_dir(&d).unwrap_err().to_string();
        assert!(e.contains("notes.txt"), "{e}");
        assert!(d.join("latest").exists() && d.join("notes.txt").exists());
        // Another controller holds the lock.
        std::fs::remove_file(d.join("notes.txt")).unwrap();
        let held = std::fs::File::create(d.join("lock")).unwrap();
        held.lock().unwrap();
        let e = clear_run_dir(&d).unwrap_err().to_string();
        assert!(e.contains("another controller"), "{e}");
        assert!(d.join("latest").exists());
        drop(held);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn chaos_takes_kinds_and_a_time_or_a_step_spacing() {
        let p = parse_chaos("kill,pause:75steps", 3, 270).unwrap();
        assert_eq!(p.kinds, [FaultKind::Kill, FaultKind::Pause]);
        assert_eq!(p.every, FaultSpacing::Steps(75));
        assert_eq!(p.until_step, 270);
        let p = parse_chaos("nan:700ms", 3, 270).unwrap();
        assert_eq!(p.every, FaultSpacing::Time(Duration::from_millis(700)));
        let p = parse_chaos("partition", 3, 270).unwrap();
        assert_eq!(p.every, FaultSpacing::Time(Duration::from_secs(15)));
        for bad in [
            "kill:0steps",
            "kill:-3steps",
            "kill:xsteps",
            "kill:50ms",
            "boom:1s",
            ":1s",
        ] {
            assert!(parse_chaos(bad, 3, 270).is_err(), "{bad} was taken");
        }
    }

    #[test]
    fn the_detectors_minimum_is_off_or_within_the_job_links_bounds() {
        let min = |d| Ok(DetectMin(Some(d)));
        assert_eq!(parse_detect_min("off"), Ok(DetectMin(None)));
        // The flag's default is the job's.
        assert_eq!(parse_detect_min("200ms"), min(JOB_FAILURE_TIMEOUT_MIN));
        assert_eq!(parse_detect_min("100ms"), min(2 * JOB_HEARTBEAT));
        assert_eq!(parse_detect_min("3s"), min(JOB_FAILURE_TIMEOUT));
        for bad in ["99ms", "3001ms", "0s", "100000h", "", "on", "fast"] {
            assert!(parse_detect_min(bad).is_err(), "{bad:?} was taken");
        }
    }
}
