//! `regent train` as a user runs it, with real processes and real faults:
//! every run ends with final weights equal bit for bit to the fault-free
//! single-process reference (`docs/semantics.md` §9). Each case runs the
//! built binary (its procs are re-executions of it), reads the report it
//! writes with `--report-json`, checks that its faults were injected and
//! had effect, then loads `final.safetensors` and compares it with the
//! reference tensor by tensor (`TrainState::first_difference`), never by
//! file hashes.
//!
//! Every controller runs in a process group of its own, and its procs
//! inherit it; a guard kills the group and reaps it when a case ends,
//! passed or failed. This process is a child subreaper, so procs whose
//! controller was killed become its children and are reaped, not left as
//! zombies.
//!
//! Sizes: the small MLP (27K parameters: a step costs about what the
//! control plane's work does) on 3 procs with one libtorch thread each; the
//! default MLP (14.7 MB checkpoints) where a checkpoint must take long
//! enough to be killed in the middle.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use regent_train::TrainState;
use regent_train::job::store;
use regent_train::job::{JobSpec, reference_with_skips};
use serde_json::Value;

/// The longest one run of the command may take here (debug build, two
/// loaded cores); a run past it is killed and the case fails with its
/// output.
const RUN_DEADLINE: Duration = Duration::from_secs(150);

fn subreaper() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| nix::sys::prctl::set_child_subreaper(true).expect("become a subreaper"));
}

/// A fresh run directory, which also holds the command's log and report
/// (removed when the case passes; kept when it fails, for a look).
struct RunDir(PathBuf);

impl RunDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("regent-train-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the run directory");
        RunDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A running `regent train` in a process group of its own (its pid is the
/// group's id). Dropping it kills the group and reaps it.
struct Controller {
    child: Child,
    log: PathBuf,
}

impl Controller {
    /// Starts `regent train ARGS` with its run directory `dir`; stdout and
    /// stderr go to `dir/NAME.log` (a file: a full pipe would stall it).
    fn start(dir: &Path, name: &str, args: &[&str]) -> Controller {
        use std::os::unix::process::CommandExt as _;
        subreaper();
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("create the log");
        let err = out.try_clone().expect("clone the log");
        let child = Command::new(env!("CARGO_BIN_EXE_regent"))
            .arg("train")
            .arg("--run-dir")
            .arg(dir)
            .args(args)
            .env("RUST_LOG", "warn,regent_train=info")
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start regent train");
        Controller { child, log }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("a pid fits an i32")
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the command to end (at most [`RUN_DEADLINE`]); its exit
    /// status and output.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + RUN_DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for regent train") {
                return (status, self.output());
            }
            if Instant::now() > deadline {
                panic!(
                    "regent train ran past {RUN_DEADLINE:?}; its output:\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The controller's child processes now (its procs).
    fn children(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).expect("list tasks");
        for t in tasks.filter_map(Result::ok) {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let group = Pid::from_raw(self.pid());
        let _ = killpg(group, Signal::SIGKILL);
        let _ = self.child.wait();
        reap_group(group);
    }
}

/// Reaps the children of this process in process group `group` (procs
/// whose controller died were re-parented here), for at most two seconds.
fn reap_group(group: Pid) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match waitpid(Pid::from_raw(-group.as_raw()), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(20)),
            Ok(_) => {}
            Err(_) => return, // none left
        }
    }
}

/// Runs `regent train` to its end; asserts it succeeded; its JSON report.
fn run_ok(dir: &RunDir, name: &str, args: &[&str]) -> Value {
    let report = dir.path().join(format!("{name}.json"));
    let mut all: Vec<&str> = args.to_vec();
    let report_arg = report.to_str().expect("a UTF-8 path");
    all.extend(["--report-json", report_arg]);
    let (status, output) = Controller::start(dir.path(), name, &all).finish();
    assert!(
        status.success(),
        "regent train {args:?} failed ({status}):\n{output}"
    );
    let text = std::fs::read_to_string(&report).expect("the JSON report");
    let r: Value = serde_json::from_str(&text).expect("a JSON report");
    summary(name, &r);
    r
}

/// One line of figures per run (`cargo test -- --nocapture` shows them).
fn summary(name: &str, r: &Value) {
    let ms = |k: &str| r[k].as_f64().map_or("-".into(), |v| format!("{v:.0} ms"));
    eprintln!(
        "{name}: {} steps from {} in {:.1} s, faults {}, failures {}, hung {}, heals {}, \
         restores {}, nan restores {}, skipped {}, replayed {}, recovery p50 {} p99 {}, goodput {:.2}",
        r["steps"],
        r["start_step"],
        r["wall_s"].as_f64().unwrap_or(0.0),
        r["faults"],
        r["failures"],
        r["hung"],
        r["heals"],
        r["restores"],
        r["nan_restores"],
        r["skipped"],
        r["replayed"],
        ms("recovery_p50_ms"),
        ms("recovery_p99_ms"),
        r["goodput"].as_f64().unwrap_or(0.0),
    );
}

fn count(v: &Value, path: &[&str]) -> u64 {
    let mut at = v;
    for p in path {
        at = &at[*p];
    }
    at.as_u64().unwrap_or(0)
}

fn steps_of(v: &Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// The job spec the run directory holds (`job.json`, written by the
/// command).
fn spec_of(dir: &Path) -> JobSpec {
    let bytes = std::fs::read(dir.join("job.json")).expect("job.json");
    serde_json::from_slice(&bytes).expect("a job spec")
}

/// The run's final state compared with the reference of `steps` steps
/// (skipping `skipped`), tensor by tensor.
fn assert_bit_identical(dir: &Path, steps: u64, skipped: &[u64], report: &Value) {
    let got = store::load(&dir.join(store::FINAL_NAME)).expect("load final.safetensors");
    let expected: TrainState =
        reference_with_skips(&spec_of(dir), steps, 1, skipped).expect("the reference");
    let difference = expected.first_difference(&got).expect("comparable states");
    assert!(
        difference.is_none(),
        "the final weights differ from the fault-free reference: {difference:?}\nreport: {report:#}"
    );
}

/// Common flags: the small MLP on `procs` procs, one thread each.
fn small(procs: &str, steps: &str, every: &str) -> Vec<String> {
    [
        "--model",
        "mlp-small",
        "--procs",
        procs,
        "--steps",
        steps,
        "--checkpoint-every",
        every,
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn with<'a>(base: &'a [String], more: &[&'a str]) -> Vec<&'a str> {
    base.iter()
        .map(String::as_str)
        .chain(more.iter().copied())
        .collect()
}

#[test]
fn kills_under_restart_member_heal_from_peers_bit_identical() {
    let dir = RunDir::new("kills");
    let base = small("3", "300", "25");
    let r = run_ok(
        &dir,
        "run",
        &with(
            &base,
            &[
                "--chaos",
                "kill:75steps",
                "--step-timeout",
                "10s",
                "--spares",
                "1",
            ],
        ),
    );
    // Steps 75, 150 and 225: the same three on any machine.
    let kills = count(&r, &["faults", "kill"]);
    assert_eq!(kills, 3, "kills at 75, 150, 225: {r:#}");
    // A warm spare replaced the killed proc (refilled between kills).
    assert!(count(&r, &["spares_taken"]) >= 1, "no spare taken: {r:#}");
    assert!(count(&r, &["failures"]) >= kills, "kills unseen: {r:#}");
    assert!(count(&r, &["heals"]) >= 3, "too few heals: {r:#}");
    assert!(count(&r, &["generation"]) >= 3, "{r:#}");
    assert_eq!(count(&r, &["steps"]), 300);
    assert_bit_identical(dir.path(), 300, &[], &r);
}

/// Kills at checkpoint steps, while rank 0 writes a checkpoint of the full
/// MLP (14.7 MB: far longer than a kill takes to be seen and a warm spare
/// to take the rank), so that each restart completes between two steps. No
/// step may go to the new life before it heals: it holds no state, refuses
/// the step, and its peers waited out their collective's timeout (22.5 s
/// here) for it. (That a new life writes no checkpoint or final state is
/// `only_a_member_at_the_committed_step_writes_its_state`, in the
/// trainer.)
#[test]
fn a_rank_replaced_between_steps_heals_before_the_next_step_bit_identical() {
    let dir = RunDir::new("between");
    let r = run_ok(
        &dir,
        "run",
        &[
            "--model",
            "mlp",
            "--procs",
            "3",
            "--steps",
            "40",
            "--checkpoint-every",
            "10",
            "--threads",
            "1",
            "--chaos",
            "kill:10steps",
            "--step-timeout",
            "30s",
            "--spares",
            "1",
        ],
    );
    assert_eq!(
        count(&r, &["faults", "kill"]),
        3,
        "kills at 10, 20, 30: {r:#}"
    );
    assert!(count(&r, &["failures"]) >= 3, "kills unseen: {r:#}");
    assert!(count(&r, &["heals"]) >= 3, "too few heals: {r:#}");
    assert_eq!(
        count(&r, &["failed_steps"]),
        0,
        "a step went to a rank that held no state: {r:#}"
    );
    let recoveries = r["recovery_ms"].as_array().expect("recovery_ms");
    assert!(
        recoveries
            .iter()
            .all(|ms| ms.as_f64().is_some_and(|ms| ms < 22_500.0)),
        "a recovery waited out a collective's timeout: {r:#}"
    );
    assert_bit_identical(dir.path(), 40, &[], &r);
}

/// Three procs: two survive each kill, and their new lives must reach each
/// other after the gang restart (they did not while links died with the
/// runtime of the member that opened them).
#[test]
fn gang_restarts_resume_from_the_checkpoint_bit_identical() {
    let dir = RunDir::new("gang");
    let base = small("3", "400", "10");
    let r = run_ok(
        &dir,
        "run",
        &with(
            &base,
            &[
                "--policy",
                "mesh",
                "--chaos",
                // Steps 95, 190 and 285: past a checkpoint (every 10), so
                // that restores replay steps.
                "kill:95steps",
                "--step-timeout",
                "5s",
            ],
        ),
    );
    assert!(count(&r, &["faults", "kill"]) >= 2, "{r:#}");
    assert!(count(&r, &["restores"]) >= 2, "too few restores: {r:#}");
    assert!(count(&r, &["replayed"]) >= 1, "nothing replayed: {r:#}");
    assert_eq!(count(&r, &["heals"]), 0, "a gang restart healed: {r:#}");
    assert_bit_identical(dir.path(), 400, &[], &r);
}

/// A run of the small MLP on three procs for 300 steps (a checkpoint
/// every 25) with `more` flags, in a run directory of its own.
fn three_procs_300_steps(name: &str, more: &[&str]) -> (RunDir, Value) {
    let dir = RunDir::new(name);
    let r = run_ok(&dir, "run", &with(&small("3", "300", "25"), more));
    (dir, r)
}

#[test]
fn paused_ranks_are_caught_by_the_step_deadline_bit_identical() {
    // A pause lasts 2.5 s; the step deadline is 1.5 s, under the job's
    // fixed 3 s failure timeout (the adaptive detector off): only the
    // deadline can catch it.
    let (dir, r) = three_procs_300_steps(
        "pause",
        &[
            "--chaos",
            "pause:75steps",
            "--step-timeout",
            "1500ms",
            "--failure-timeout-min",
            "off",
        ],
    );
    assert!(count(&r, &["faults", "pause"]) >= 2, "{r:#}");
    assert!(count(&r, &["hung"]) >= 2, "no hung rank caught: {r:#}");
    assert!(count(&r, &["heals"]) >= 2, "{r:#}");
    assert_bit_identical(dir.path(), 300, &[], &r);
}

#[test]
fn paused_ranks_are_found_by_the_adaptive_detector_bit_identical() {
    // A pause lasts 2.5 s, the step deadline is 20 s: the fixed 3 s
    // failure timeout would see no pause at all (the proc resumes first)
    // and the deadline none either; the adaptive detector (on by default,
    // at least 200 ms on a quiet link) must find every one while it lasts.
    let (dir, r) = three_procs_300_steps(
        "pause-detected",
        &["--chaos", "pause:75steps", "--step-timeout", "20s"],
    );
    let pauses = count(&r, &["faults", "pause"]);
    assert!(pauses >= 2, "{r:#}");
    assert_eq!(count(&r, &["undetected"]), 0, "a pause unseen: {r:#}");
    assert!(count(&r, &["failures"]) >= pauses, "{r:#}");
    assert_eq!(count(&r, &["hung"]), 0, "the deadline caught one: {r:#}");
    assert!(count(&r, &["heals"]) >= 2, "{r:#}");
    assert_bit_identical(dir.path(), 300, &[], &r);
}

#[test]
fn a_partitioned_rank_is_replaced_bit_identical() {
    let (dir, r) = three_procs_300_steps(
        "partition",
        &["--chaos", "partition:75steps", "--step-timeout", "1500ms"],
    );
    assert!(count(&r, &["faults", "partition"]) >= 2, "{r:#}");
    assert!(
        count(&r, &["failures"]) >= 1,
        "no partition had effect: {r:#}"
    );
    assert!(count(&r, &["heals"]) >= 1, "{r:#}");
    assert_bit_identical(dir.path(), 300, &[], &r);
}

/// Whether process `pid` is gone: no such process, or a zombie (reaped
/// here when it is this process's child).
fn gone(pid: i32) -> bool {
    let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
    if kill(Pid::from_raw(pid), None).is_err() {
        return true;
    }
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

fn latest_step(dir: &Path) -> Option<u64> {
    let name = std::fs::read_to_string(dir.join("latest")).ok()?;
    name.trim()
        .strip_prefix("ckpt-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// Runs `regent train ARGS` until its `latest` checkpoint is at `step` or
/// past it; the controller and its live procs (REGENT_ROLE=proc children).
fn run_until_checkpoint(
    dir: &Path,
    name: &str,
    args: &[&str],
    step: u64,
) -> (Controller, Vec<i32>) {
    let c = Controller::start(dir, name, args);
    let deadline = Instant::now() + Duration::from_secs(90);
    while latest_step(dir).is_none_or(|s| s < step) {
        assert!(
            Instant::now() < deadline,
            "no checkpoint at step {step} in time:\n{}",
            c.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let procs: Vec<i32> = c
        .children()
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == b"REGENT_ROLE=proc"))
        })
        .collect();
    // Three procs, but for one being replaced after a kill.
    assert!(procs.len() >= 2, "the controller's procs: {procs:?}");
    (c, procs)
}

/// Waits until every proc of `procs` is gone, at most `limit`; how long
/// it took.
fn wait_gone(procs: &[i32], limit: Duration, what: &str) -> Duration {
    let start = Instant::now();
    while !procs.iter().all(|p| gone(*p)) {
        let left: Vec<&i32> = procs.iter().filter(|p| !gone(**p)).collect();
        assert!(
            start.elapsed() < limit,
            "procs {left:?} outlived their controller ({what}) by {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

#[test]
fn a_killed_controller_leaves_no_proc_and_the_same_command_resumes_bit_identical() {
    let dir = RunDir::new("controller");
    let base = small("3", "600", "20");
    let args = with(&base, &["--chaos", "kill:1500ms", "--step-timeout", "10s"]);
    // SIGKILL: the procs die with their controller.
    let (first, procs) = run_until_checkpoint(dir.path(), "first", &args, 40);
    kill(Pid::from_raw(first.pid()), Signal::SIGKILL).expect("kill the controller");
    let after_kill = wait_gone(&procs, Duration::from_secs(10), "SIGKILL");
    drop(first);
    let resumed = latest_step(dir.path()).expect("a checkpoint");
    // SIGSTOP: the controller is silent but alive (as one cut off or hung
    // would be): its procs stop when their owner lease (5 s) lapses, with
    // no help from the parent-death signal. Then it is killed too.
    let (second, procs) = run_until_checkpoint(dir.path(), "second", &args, resumed + 40);
    kill(Pid::from_raw(second.pid()), Signal::SIGSTOP).expect("stop the controller");
    let after_stop = wait_gone(&procs, Duration::from_secs(9), "SIGSTOP, lease 5 s");
    kill(Pid::from_raw(second.pid()), Signal::SIGKILL).expect("kill the controller");
    drop(second);
    let resumed_again = latest_step(dir.path()).expect("a checkpoint");
    assert!(
        resumed_again > resumed,
        "the second controller made no checkpoint"
    );
    // The same command again runs to the end from the latest checkpoint.
    let r = run_ok(&dir, "third", &args);
    assert_eq!(
        count(&r, &["start_step"]),
        resumed_again,
        "the third controller did not resume from the latest checkpoint: {r:#}"
    );
    assert_eq!(count(&r, &["steps"]), 600);
    eprintln!(
        "procs gone {after_kill:?} after the controller's SIGKILL, {after_stop:?} after its SIGSTOP; \
         resumed at steps {resumed} and {resumed_again}"
    );
    assert_bit_identical(dir.path(), 600, &[], &r);
}

#[test]
fn non_finite_steps_are_skipped_on_every_rank_and_in_the_reference() {
    let dir = RunDir::new("nan-skip");
    let base = small("3", "200", "20");
    let r = run_ok(
        &dir,
        "run",
        &with(&base, &["--chaos", "nan:50steps", "--on-nan", "skip"]),
    );
    let nans = count(&r, &["faults", "nan"]);
    let skipped = steps_of(&r, "skipped");
    assert!(nans >= 2, "{r:#}");
    assert_eq!(
        skipped.len() as u64,
        nans,
        "one skip per poisoned step: {r:#}"
    );
    assert_eq!(steps_of(&r, "nonfinite"), skipped, "{r:#}");
    assert_bit_identical(dir.path(), 200, &skipped, &r);
    // The skips mattered: the reference that takes those steps differs.
    let got = store::load(&dir.path().join(store::FINAL_NAME)).expect("load");
    let unskipped = reference_with_skips(&spec_of(dir.path()), 200, 1, &[]).expect("reference");
    assert!(
        unskipped
            .first_difference(&got)
            .expect("comparable")
            .is_some(),
        "skipping changed nothing"
    );
}

#[test]
fn non_finite_steps_restore_the_checkpoint_and_replay_bit_identical() {
    let dir = RunDir::new("nan-restore");
    let base = small("3", "200", "10");
    let r = run_ok(
        &dir,
        "run",
        // Steps 45, 90 and 135: past a checkpoint (every 10), so that
        // restores replay steps.
        &with(&base, &["--chaos", "nan:45steps", "--on-nan", "restore"]),
    );
    let nans = count(&r, &["faults", "nan"]);
    assert!(nans >= 2, "{r:#}");
    assert_eq!(
        count(&r, &["nan_restores"]),
        nans,
        "one restore per poisoned step: {r:#}"
    );
    assert!(count(&r, &["replayed"]) >= 1, "{r:#}");
    assert!(steps_of(&r, "skipped").is_empty(), "{r:#}");
    assert_bit_identical(dir.path(), 200, &[], &r);
}

#[test]
fn a_bad_batch_is_skipped_or_fails_the_restore_policy_naming_its_step() {
    // Skip: steps 17 and 18 are dropped, everywhere.
    let dir = RunDir::new("bad-batch");
    let base = small("3", "40", "10");
    let r = run_ok(
        &dir,
        "skip",
        &with(&base, &["--nan-at", "17,18", "--on-nan", "skip"]),
    );
    assert_eq!(steps_of(&r, "skipped"), vec![17, 18], "{r:#}");
    assert_bit_identical(dir.path(), 40, &[17, 18], &r);
    // Restore: step 17 is non-finite again after the restore to step 10,
    // and the job stops with that, not in a loop.
    let dir = RunDir::new("bad-batch-restore");
    let started = Instant::now();
    let (status, output) = Controller::start(
        dir.path(),
        "restore",
        &with(&base, &["--nan-at", "17", "--on-nan", "restore"]),
    )
    .finish();
    assert!(
        !status.success(),
        "a deterministic NaN did not fail the job:\n{output}"
    );
    assert!(
        output.contains("step 17 is not finite again after restoring the checkpoint at step 10"),
        "the error does not name the step:\n{output}"
    );
    assert!(started.elapsed() < Duration::from_secs(120));
}

/// The checkpoint temporaries in the run directory (one being written, or
/// left by a killed writer), with their writers' pids (the tensor layer
/// names them `.<name>.tmp-<pid>-<n>`).
fn temporaries(dir: &Path) -> Vec<(PathBuf, i32)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let (_, tail) = name.strip_prefix(".ckpt-")?.split_once(".tmp-")?;
            let pid = tail.split('-').next()?.parse().ok()?;
            Some((e.path(), pid))
        })
        .collect()
}

#[test]
fn a_kill_while_rank_0_writes_a_checkpoint_leaves_the_previous_one_in_force() {
    let dir = RunDir::new("torn");
    // The default MLP: a 14.7 MB checkpoint takes long enough to be killed
    // in the middle. Two procs: rank 0 heals from rank 1.
    let args = [
        "--model",
        "mlp",
        "--procs",
        "2",
        "--steps",
        "12",
        "--checkpoint-every",
        "3",
        "--threads",
        "1",
        "--step-timeout",
        "60s",
    ];
    let report = dir.path().join("run.json");
    let mut all = args.to_vec();
    all.extend(["--report-json", report.to_str().expect("UTF-8")]);
    let mut job = Controller::start(dir.path(), "run", &all);
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut torn = 0;
    // Temporaries already dealt with (a dead writer's stays until the next
    // checkpoint removes it).
    let mut seen = std::collections::HashSet::new();
    let status = loop {
        if let Some(s) = job.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not end:\n{}",
            job.output()
        );
        if torn < 2
            && let Some((temp, pid)) = temporaries(dir.path())
                .into_iter()
                .find(|(t, _)| !seen.contains(t))
        {
            seen.insert(temp.clone());
            kill(Pid::from_raw(pid), Signal::SIGKILL).expect("kill rank 0's proc");
            // Landed before the rename: the temporary is still there, torn.
            if temp.exists() {
                torn += 1;
                // `latest` names a checkpoint that loads whole (checked, not
                // the fallback past damaged ones), or none is written yet.
                if let Ok(name) = std::fs::read_to_string(dir.path().join("latest")) {
                    let named = dir.path().join(name.trim());
                    store::load(&named).unwrap_or_else(|e| {
                        panic!("latest names {} which does not load: {e}", named.display())
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let output = job.output();
    drop(job);
    assert!(status.success(), "the run failed ({status}):\n{output}");
    assert!(
        torn >= 1,
        "no kill landed while a checkpoint was written:\n{output}"
    );
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    summary("torn", &r);
    assert!(count(&r, &["failures"]) >= torn, "{r:#}");
    assert!(count(&r, &["heals"]) >= 1, "rank 0 did not heal: {r:#}");
    // The dead writers' temporaries were removed by later checkpoints, and
    // the last one, due at the last step, was written after all.
    assert!(
        temporaries(dir.path()).is_empty(),
        "a torn temporary is left"
    );
    assert_eq!(latest_step(dir.path()), Some(12), "{r:#}");
    store::load(&dir.path().join(format!("ckpt-{:012}.safetensors", 12))).expect("whole");
    assert_bit_identical(dir.path(), 12, &[], &r);
}
