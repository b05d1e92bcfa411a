//! The admin endpoint of a running `regent train` (real processes, real
//! SIGKILLs): `regent status` shows each killed proc's failure with its
//! cause and the mesh's new generation, the metrics count the failures by
//! cause and the restarts, the HTML report holds the series; and, in a
//! real headless browser (Debian's chromium through chromedriver's
//! WebDriver API), the dashboard's own script sees a killed rank turn
//! failed and then healthy again.
//!
//! Without chromium and chromedriver the browser case says it skipped;
//! with `REGENT_REQUIRE_CHROMIUM=1` (CI) it fails instead.
//!
//! Every controller and chromedriver runs in a process group of its own; a
//! guard kills the group and reaps it, passed or failed (this process is a
//! child subreaper, so orphaned procs and browsers are reaped here).

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde_json::{Value, json};

/// How long a case may take before it fails with the controller's output.
const DEADLINE: Duration = Duration::from_secs(120);

fn subreaper() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| nix::sys::prctl::set_child_subreaper(true).expect("become a subreaper"));
}

fn run_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regent-admin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the run directory");
    dir
}

/// A child in a process group of its own, killed with its group and
/// reaped when dropped.
struct Group {
    child: Child,
    log: PathBuf,
}

impl Group {
    fn start(mut cmd: Command, log: PathBuf) -> Group {
        use std::os::unix::process::CommandExt as _;
        subreaper();
        let out = std::fs::File::create(&log).expect("create the log");
        let err = out.try_clone().expect("clone the log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start the child");
        Group { child, log }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the output has a line starting with `prefix`; the rest
    /// of it.
    fn line(&self, prefix: &str) -> String {
        let until = Instant::now() + DEADLINE;
        loop {
            if let Some(l) = self.output().lines().find_map(|l| l.strip_prefix(prefix)) {
                return l.trim().to_owned();
            }
            assert!(
                Instant::now() < until,
                "no line {prefix:?}; output:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let group = Pid::from_raw(i32::try_from(self.child.id()).expect("a pid"));
        let _ = killpg(group, Signal::SIGKILL);
        let _ = self.child.wait();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match waitpid(Pid::from_raw(-group.as_raw()), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(20)),
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}

/// `regent train` with a SIGKILL every `every` on 2 procs of the small MLP,
/// its dashboard kept up 30 s after the report.
fn train(dir: &Path, every: &str, extra: &[&str]) -> Group {
    train_steps(dir, 300, every, extra)
}

/// `train` for `steps` steps.
fn train_steps(dir: &Path, steps: u64, every: &str, extra: &[&str]) -> Group {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_regent"));
    cmd.args(["train", "--procs", "2", "--model", "mlp-small", "--steps"])
        .arg(steps.to_string())
        .args(["--step-timeout", "1s", "--checkpoint-every", "50"])
        .arg("--chaos")
        .arg(format!("kill:{every}"))
        .args(["--linger", "30s", "--fresh", "--run-dir"])
        .arg(dir.join("run"))
        .args(extra)
        .env("RUST_LOG", "warn")
        .env("RUST_BACKTRACE", "0");
    Group::start(cmd, dir.join("train.log"))
}

/// `regent status ARGS`: its stdout, or its error.
fn try_status(args: &[&str]) -> Result<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_regent"))
        .arg("status")
        .args(args)
        .env_remove("REGENT_ADMIN_TOKEN")
        .output()
        .expect("run regent status");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `regent status ARGS`: its stdout (asserting success).
fn status(args: &[&str]) -> String {
    try_status(args).unwrap_or_else(|e| panic!("regent status {args:?}: {e}"))
}

/// The value of a metric line `name` (exactly, labels included).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn status_and_metrics_of_a_job_whose_procs_are_killed() {
    let dir = run_dir("status");
    let report = dir.join("report.html");
    let job = train(&dir, "2s", &["--report-html", report.to_str().unwrap()]);
    let url = job.line("dashboard: ");
    let addr = url
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix('/'))
        .expect("a loopback link without a token")
        .to_owned();
    // The run directory records the address: `regent status` finds it.
    let run = dir.join("run");
    let until = Instant::now() + DEADLINE;
    let tree = loop {
        // (Before the job records its address, `regent status` fails.)
        let tree = try_status(&["--run-dir", run.to_str().unwrap()]).unwrap_or_default();
        // A failure caused by a SIGKILL of the proc, and the mesh in a
        // later generation than the failed lives'.
        let failed_in = tree
            .lines()
            .filter(|l| l.contains("(killed, generation "))
            .filter_map(|l| {
                l.split("(killed, generation ")
                    .nth(1)?
                    .split(')')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        let now = tree
            .lines()
            .find(|l| l.contains("mesh trainers"))
            .and_then(|l| {
                l.split("generation ")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            });
        if let (Some(f), Some(g)) = (failed_in, now)
            && g > f
            && tree.contains("exited (signal 9)")
        {
            break tree;
        }
        assert!(
            Instant::now() < until,
            "no killed failure and newer generation in the status:\n{tree}\ncontroller:\n{}",
            job.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(tree.contains("owner the controller"), "{tree}");
    assert!(tree.contains("policy MeshPolicy"), "{tree}");
    assert!(tree.contains("rank 1"), "{tree}");
    // The same through the address given on the command line.
    assert!(status(&[&addr]).contains("mesh trainers"));
    let metrics = status(&[&addr, "--metrics"]);
    let killed = metric(&metrics, "regent_failures_total{cause=\"killed\"}");
    assert!(killed.is_some_and(|k| k >= 1.0), "{metrics}");
    // Each happened at least once in this job.
    for name in [
        "regent_restarts_total",
        "regent_recovery_seconds_count",
        "regent_calls_total",
        "regent_casts_total",
        "regent_cast_frames_sent_total",
        "regent_control_frames_sent_total{side=\"controller\"}",
        "regent_train_step",
    ] {
        assert!(
            metric(&metrics, name).is_some_and(|v| v >= 1.0),
            "{name}: {metrics}"
        );
    }
    assert!(metrics.contains("regent_train_loss "), "{metrics}");
    assert!(
        metrics.contains("regent_train_step_seconds_count "),
        "{metrics}"
    );
    assert!(metrics.contains("regent_train_goodput "), "{metrics}");
    // The report: written at the end, every committed step in it.
    job.line("  report: ");
    let html = std::fs::read_to_string(&report).expect("the HTML report");
    let data = html
        .split("window.REGENT_DATA = ")
        .nth(1)
        .and_then(|d| d.split(";\n").next())
        .expect("the embedded data");
    let data: Value = serde_json::from_str(data).expect("JSON data");
    let steps = data["train"]["steps"].as_array().expect("the step series");
    assert!(steps.len() >= 300, "{} steps", steps.len());
    assert!(
        steps
            .iter()
            .all(|s| s["loss"].is_number() && s["time_ms"].is_number())
    );
    let failures = data["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "failure")
        .count();
    assert!(failures >= 1, "the report's timeline has the failures");
    assert_eq!(data["report"]["steps"], 300);
    // After the report the detection latencies are in the metrics too.
    let metrics = status(&[&addr, "--metrics"]);
    assert!(
        metric(&metrics, "regent_detection_seconds_count").is_some_and(|c| c >= 1.0),
        "{metrics}"
    );
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sum of the lines of metric `prefix` (a name, and the start of its
/// labels if any: `name{a="x"` sums every series with that label first).
fn metric_sum(text: &str, prefix: &str) -> f64 {
    let name_of = |l: &str| l.split(['{', ' ']).next().unwrap_or("").to_owned();
    let name = name_of(prefix);
    text.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(prefix) && name_of(l) == name)
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// The small MLP's gradient: 26,896 f32 parameters.
const MLP_SMALL_GRADIENT_BYTES: f64 = 26_896.0 * 4.0;

/// Scrapes `addr`'s metrics until `done` says so (with the text).
fn scrape_until(job: &Group, addr: &str, what: &str, mut done: impl FnMut(&str) -> bool) -> String {
    let until = Instant::now() + DEADLINE;
    loop {
        let text = try_status(&[addr, "--metrics"]).unwrap_or_default();
        if done(&text) {
            return text;
        }
        assert!(
            Instant::now() < until,
            "{what}; metrics:\n{text}\ncontroller:\n{}",
            job.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn traffic_per_plane_and_detections_are_counted_while_the_job_runs() {
    let dir = run_dir("traffic");
    // Long enough that the job is still running when every check is done
    // (it is killed then).
    let steps = 100_000.0;
    let job = train_steps(&dir, 100_000, "3s", &[]);
    let url = job.line("dashboard: ");
    let addr = url
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix('/'))
        .expect("a loopback link")
        .to_owned();
    let step = |t: &str| metric(t, "regent_train_step").unwrap_or(0.0);
    // A fault's detection is observed when it happens, not at the job's
    // end.
    let live = scrape_until(&job, &addr, "no detection while the job runs", |t| {
        metric(t, "regent_detection_seconds_count").is_some_and(|c| c >= 1.0) && step(t) < steps
    });
    assert!(
        metric_sum(&live, "regent_detection_seconds_sum") > 0.0,
        "{live}"
    );
    // The payload plane: the procs' reports (every lease / 3) of their
    // one-sided reads and writes. Two procs on one host: shm.
    let first = scrape_until(&job, &addr, "no 100 steps", |t| step(t) >= 100.0);
    let steps_then = step(&first);
    // Two renewals later every live proc has reported the work of those
    // steps.
    std::thread::sleep(Duration::from_secs(4));
    let later = try_status(&[&addr, "--metrics"]).expect("metrics");
    let payload = metric_sum(&later, "regent_payload_bytes_total");
    let shm = metric_sum(&later, "regent_payload_bytes_total{backend=\"shm\"");
    assert_eq!(payload, shm, "only shm between procs of one host: {later}");
    // Each step each rank reads and writes its half of the other's
    // gradient: 2 gradients a step in all. A proc killed before its next
    // report takes at most a lease / 3 of its counts with it; half of
    // that is a wide margin.
    assert!(
        payload >= MLP_SMALL_GRADIENT_BYTES * steps_then,
        "{payload} bytes after {steps_then} steps: {later}"
    );
    // And not wildly more: the steps so far (and some redone), the heals
    // (a few states of 3 gradients each), 2 gradients a step.
    let steps_now = step(&later);
    assert!(
        payload <= 16.0 * MLP_SMALL_GRADIENT_BYTES * (steps_now + 200.0),
        "{payload} bytes after {steps_now} steps: {later}"
    );
    assert!(
        metric_sum(
            &later,
            "regent_payload_ops_total{backend=\"shm\",op=\"read\"}"
        ) >= 1.0,
        "{later}"
    );
    assert!(
        metric_sum(&later, "regent_proc_payload_bytes_total{") > 0.0,
        "per live proc: {later}"
    );
    // The control plane, both sides, growing.
    for name in [
        "regent_control_frames_sent_total",
        "regent_control_bytes_sent_total",
        "regent_control_frames_received_total",
        "regent_control_bytes_received_total",
    ] {
        for side in ["controller", "procs"] {
            let series = format!("{name}{{side=\"{side}\"}}");
            let (a, b) = (metric(&first, &series), metric(&later, &series));
            assert!(
                a.is_some_and(|a| a > 0.0) && b > a,
                "{series}: {a:?} then {b:?}: {later}"
            );
        }
    }
    // A frame is at least its length prefix and envelope.
    let frames = metric(
        &later,
        "regent_control_frames_sent_total{side=\"controller\"}",
    )
    .unwrap();
    let bytes = metric(
        &later,
        "regent_control_bytes_sent_total{side=\"controller\"}",
    )
    .unwrap();
    assert!(bytes >= 20.0 * frames, "{bytes} bytes in {frames} frames");
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn off_loopback_the_endpoint_wants_the_token_from_its_private_file() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = run_dir("token");
    let job = train(&dir, "5s", &["--admin", "0.0.0.0:0"]);
    let url = job.line("dashboard: ");
    let port = url
        .strip_prefix("http://0.0.0.0:")
        .and_then(|u| u.split('/').next())
        .expect("the port in the link")
        .to_owned();
    let token_file = dir.join("run").join("admin.token");
    let token = std::fs::read_to_string(&token_file).expect("the token file");
    assert!(url.ends_with(&format!("?token={}", token.trim())), "{url}");
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "only its user reads the token");
    let addr = format!("127.0.0.1:{port}");
    let nowhere = dir.join("nowhere");
    let refused = try_status(&[&addr, "--run-dir", nowhere.to_str().unwrap()]).unwrap_err();
    assert!(refused.contains("401"), "{refused}");
    let wrong = dir.join("wrong.token");
    std::fs::write(&wrong, "0".repeat(64)).unwrap();
    let refused = try_status(&[&addr, "--token-file", wrong.to_str().unwrap()]).unwrap_err();
    assert!(refused.contains("401"), "{refused}");
    let tree = status(&[&addr, "--token-file", token_file.to_str().unwrap()]);
    assert!(tree.contains("controller quic://"), "{tree}");
    // The run directory's token is found without a flag.
    let run = dir.join("run");
    let metrics = status(&["--run-dir", run.to_str().unwrap(), "--metrics"]);
    assert!(metrics.contains("regent_casts_total"), "{metrics}");
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One HTTP/1.1 exchange (the connection closed after it) with a local
/// server (chromedriver, which answers with a length): its status and JSON
/// body.
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read by the length it gives (it need not close the connection).
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).expect("read the answer");
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            });
            if n == 0 || length.is_some_and(|len| rest.len() >= len) {
                let code = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|c| c.parse().ok())
                    .expect("a status code");
                return (code, serde_json::from_str(rest).unwrap_or(Value::Null));
            }
        }
        assert!(n > 0, "the connection closed before an answer");
    }
}

fn chromium_tools() -> Option<(PathBuf, PathBuf)> {
    let find = |names: &[&str]| {
        names.iter().find_map(|n| {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(n))
                    .find(|f| f.is_file())
            })
        })
    };
    Some((
        find(&["chromium", "chromium-browser"])?,
        find(&["chromedriver"])?,
    ))
}

/// A WebDriver session of chromium; ended when dropped (before the
/// driver's group is killed).
struct Browser {
    driver: String,
    session: String,
    _group: Group,
}

impl Browser {
    fn start(dir: &Path, chromium: &Path, chromedriver: &Path) -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut cmd = Command::new(chromedriver);
        cmd.arg(format!("--port={port}"));
        let group = Group::start(cmd, dir.join("chromedriver.log"));
        let driver = format!("127.0.0.1:{port}");
        let until = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&driver).is_err() {
            assert!(
                Instant::now() < until,
                "chromedriver did not listen: {}",
                group.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = dir.join("profile");
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     format!("--user-data-dir={}", profile.display())],
        }}}});
        let (code, v) = http(&driver, "POST", "/session", Some(&caps));
        assert_eq!(code, 200, "no browser session: {v}");
        let session = v["value"]["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        Browser {
            driver,
            session,
            _group: group,
        }
    }

    fn go(&self, url: &str) {
        let (code, v) = http(
            &self.driver,
            "POST",
            &format!("/session/{}/url", self.session),
            Some(&json!({ "url": url })),
        );
        assert_eq!(code, 200, "navigate to {url}: {v}");
    }

    fn eval(&self, script: &str) -> Value {
        let (code, v) = http(
            &self.driver,
            "POST",
            &format!("/session/{}/execute/sync", self.session),
            Some(&json!({ "script": script, "args": [] })),
        );
        assert_eq!(code, 200, "{script}: {v}");
        v["value"].clone()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::net::TcpStream::connect(&self.driver).map(|_| {
            http(
                &self.driver,
                "DELETE",
                &format!("/session/{}", self.session),
                None,
            )
        });
    }
}

/// The rank whose transitions (as the page wrote them) show it failed and
/// later running again, if one does.
fn failed_then_healthy(transitions: &str) -> Option<u32> {
    (0..2).find(|r| {
        let lines: Vec<&str> = transitions.lines().collect();
        let key = format!("trainers[{r}]: ");
        let failed = lines
            .iter()
            .position(|l| *l == format!("{key}running -> failed"));
        failed.is_some_and(|i| {
            lines[i + 1..].iter().any(|l| {
                l.starts_with(&key) && l.ends_with("-> running") && !l.contains("running ->")
            })
        })
    })
}

#[test]
fn the_dashboard_shows_a_killed_rank_fail_and_recover_in_a_real_browser() {
    let Some((chromium, chromedriver)) = chromium_tools() else {
        assert!(
            std::env::var("REGENT_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "REGENT_REQUIRE_CHROMIUM=1 but chromium or chromedriver is missing"
        );
        eprintln!(
            "skipped: no chromium and chromedriver (apt-get install chromium chromium-driver)"
        );
        return;
    };
    let dir = run_dir("browser");
    let report = dir.join("report.html");
    let job = train(&dir, "3s", &["--report-html", report.to_str().unwrap()]);
    let url = job.line("dashboard: ");
    let browser = Browser::start(&dir, &chromium, &chromedriver);
    browser.go(&url);
    let until = Instant::now() + DEADLINE;
    let (rank, states) = loop {
        let t = browser.eval("return document.getElementById('transitions').textContent");
        let t = t.as_str().unwrap_or_default().to_owned();
        if let Some(r) = failed_then_healthy(&t) {
            let shown = browser.eval(&format!(
                "return document.querySelector('[data-mesh=trainers] [data-rank=\"{r}\"]').dataset.state"
            ));
            break (r, (t, shown));
        }
        assert!(
            Instant::now() < until,
            "the page saw no rank fail and recover; its transitions:\n{t}\ncontroller:\n{}",
            job.output()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    eprintln!("rank {rank}; the page's transitions:\n{}", states.0);
    // The page draws the ranks from what it observed: a rank is shown in a
    // state it is in now (the mesh keeps being killed; any is valid).
    assert!(
        ["running", "failed", "restarting"].contains(&states.1.as_str().unwrap_or("")),
        "{}",
        states.1
    );
    // The loss curve is drawn with fault markers.
    let chart = browser.eval(
        "return [document.querySelectorAll('#loss polyline').length, \
         document.querySelectorAll('#loss line.fault').length]",
    );
    assert_eq!(chart[0], 1, "a loss curve: {chart}");
    // The report, once written, draws the same page from its own data.
    job.line("  report: ");
    browser.go(&format!("file://{}", report.display()));
    let drawn = browser.eval(
        "return [document.querySelectorAll('#loss polyline').length, \
         document.querySelector('#loss polyline').getAttribute('points').split(' ').length, \
         document.querySelectorAll('#loss line.fault').length, \
         document.getElementById('title').textContent]",
    );
    assert_eq!(drawn[0], 1, "{drawn}");
    assert!(drawn[1].as_u64().is_some_and(|n| n >= 300), "{drawn}");
    assert!(
        drawn[2].as_u64().is_some_and(|n| n >= 1),
        "fault markers: {drawn}"
    );
    assert!(
        drawn[3]
            .as_str()
            .is_some_and(|t| t.starts_with("regent train")),
        "{drawn}"
    );
    drop(browser);
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_chaos_soak_serves_its_dashboard_and_writes_its_report_as_html() {
    let dir = run_dir("soak");
    let report = dir.join("soak.html");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_regent"));
    cmd.args([
        "chaos",
        "soak",
        "--duration",
        "1s",
        "--round",
        "4s",
        "--seed",
        "7",
    ])
    .args([
        "--procs",
        "2",
        "--per-proc",
        "1",
        "--faults",
        "kill",
        "--linger",
        "30s",
        "--report-html",
    ])
    .arg(&report)
    .env("RUST_LOG", "error")
    .env("RUST_BACKTRACE", "0");
    let soak = Group::start(cmd, dir.join("soak.log"));
    // The live dashboard's link, printed as the run starts (before the
    // report), and its status shows the soak's mesh.
    let url = soak.line("dashboard: ");
    let addr = url
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix('/'))
        .expect("a loopback link without a token")
        .to_owned();
    let until = Instant::now() + DEADLINE;
    let tree = loop {
        let tree = try_status(&[&addr]).unwrap_or_default();
        if tree.contains("mesh tally") {
            break tree;
        }
        assert!(
            Instant::now() < until,
            "no mesh tally in the soak's status:\n{tree}\n{}",
            soak.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(tree.contains("owner the controller"), "{tree}");
    soak.line("  report: ");
    let out = soak.output();
    assert!(
        out.find("dashboard: ") < out.find("  report: "),
        "the link comes first: {out}"
    );
    // Lingering, the endpoint still answers: the kill is in its metrics,
    // and so is its detection (observed by the soak as it matched it).
    let metrics = status(&[&addr, "--metrics"]);
    assert!(
        metric(&metrics, "regent_failures_total{cause=\"killed\"}").is_some_and(|k| k >= 1.0),
        "{metrics}"
    );
    assert!(
        metric(&metrics, "regent_detection_seconds_count").is_some_and(|c| c >= 1.0),
        "{metrics}"
    );
    let html = std::fs::read_to_string(&report).expect("the HTML report");
    let data = html
        .split("window.REGENT_DATA = ")
        .nth(1)
        .and_then(|d| d.split(";\n").next())
        .expect("the embedded data");
    let data: Value = serde_json::from_str(data).expect("JSON data");
    assert!(
        data["title"]
            .as_str()
            .unwrap()
            .starts_with("regent chaos soak: seed 7")
    );
    let events = data["events"].as_array().expect("the journal");
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "failure" && e["detail"].as_str().unwrap().starts_with("killed")),
        "a killed failure in the timeline: {events:?}\n{}",
        soak.output()
    );
    assert!(
        events.iter().any(|e| e["kind"] == "recovered"),
        "{events:?}"
    );
    assert!(
        data["text"].as_str().unwrap().contains("seed 7"),
        "{}",
        data["text"]
    );
    drop(soak);
    let _ = std::fs::remove_dir_all(&dir);
}
