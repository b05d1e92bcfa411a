//! Allocators with real processes, real QUIC with mutual TLS and a real
//! Slurm: the procs are `alloc_proc` processes (`src/bin/alloc_proc.rs`),
//! the host agents are `alloc_proc` processes in the host role, and the
//! Slurm test goes through `srun` of the local cluster that
//! `scripts/slurm-setup.sh` starts (CI does; elsewhere the test says it
//! skipped).
//!
//! Every process a test starts carries an environment marker unique to the
//! test, and every test ends by checking the process table: no process with
//! its marker may be left (procs inherit it from their host agent). Host
//! agents run under a guard that stops and reaps them on drop, also when a
//! test fails; procs of an in-process agent are killed and reaped when its
//! allocator drops.
//!
//! Exit reports are asserted within a generous bound (the machines are
//! shared 2-core ones); the measured latencies are printed.

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader};
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use regent_mesh::alloc::{
    AllocError, AllocatedProc, Allocator, HostAllocator, HostAllocatorConfig, LOCAL_HOST,
    LocalAllocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus, SlurmAllocator, SlurmConfig,
};
use regent_mesh::boot::{PARENT_PID_ENV, ROLE_ENV};
use regent_mesh::host::wire::{
    HostOp, HostReply, HostRequest, MAX_LEASE, MAX_STOP_GRACE, ProcExited, ProcLogs, ProcReady,
    Renew, ReplyOk, RequestId, SpawnRequest, alloc_actor, host_port,
};
use regent_net::{
    ActorId, ClusterCa, Endpoint, EndpointConfig, Generation, Inbox, Message, ProcAddr, ProcId,
    Role, TypeTag, Validity,
};
use tokio::sync::mpsc;

const PROC_BIN: &str = env!("CARGO_BIN_EXE_alloc_proc");
const MARKER_ENV: &str = "REGENT_ALLOC_TEST_MARKER";
const DEADLINE: Duration = Duration::from_secs(30);
/// The bound asserted on an exit report (the goal is well under 50 ms; the
/// bound allows for a loaded 2-core machine).
const EXIT_REPORT_BOUND: Duration = Duration::from_secs(2);
/// The controller's link failure timeout (heartbeats). QUIC's idle timeout
/// is the smaller of both sides' (the agents keep the default 1 s), so a
/// SIGKILLed agent is noticed after about 1 s.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(3);

use regent_tests::peers::alloc::{Burst, Exit, Panic, Ping, Pong};
use regent_tests::tempdir::TempDir;

fn pid_of(name: &str) -> ProcId {
    ProcId::new(name).expect("valid proc id")
}

fn nix_pid(pid: u32) -> Pid {
    Pid::from_raw(i32::try_from(pid).expect("pid fits"))
}

/// The marker of one test's processes.
fn marker(test: &str) -> String {
    format!("{}-{test}", std::process::id())
}

/// Live processes (not zombies) whose environment holds `marker`.
fn marked_processes(marker: &str) -> Vec<(u32, String)> {
    let needle = format!("{MARKER_ENV}={marker}");
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if !environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?");
        if state != "Z" {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            found.push((pid, format!("{state} {cmd}")));
        }
    }
    found
}

/// The process-table check: nothing with the test's marker outlives it.
async fn assert_no_marked_processes(marker: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = marked_processes(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes of this test outlived it: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The test's controller: a cluster CA, an endpoint, and a port for pongs.
struct Controller {
    ca: ClusterCa,
    endpoint: Endpoint,
    me: ActorId,
    inbox: Inbox,
    next: u64,
}

impl Controller {
    fn new(name: &str) -> Self {
        let ca = ClusterCa::generate("regent alloc tests").expect("CA");
        let proc = pid_of(name);
        let config = EndpointConfig::default().failure_timeout(FAILURE_TIMEOUT);
        let endpoint = Endpoint::bind(
            ca.issue(&proc, Role::Controller, Validity::job())
                .expect("issue"),
            "127.0.0.1:0".parse().expect("addr"),
            config,
        )
        .expect("bind controller");
        let me = proc.actor("test", 0).expect("actor");
        let inbox = endpoint.open_port(me.port(0)).expect("port");
        Self {
            ca,
            endpoint,
            me,
            inbox,
            next: 0,
        }
    }

    /// Boots for procs named `names`, owned by this controller.
    fn boots(&self, names: &[String]) -> Vec<ProcBoot> {
        names
            .iter()
            .map(|name| {
                let proc = pid_of(name);
                let (cert_pem, key_pem, ca_pem) = self
                    .ca
                    .issue(&proc, Role::Proc, Validity::job())
                    .expect("issue")
                    .to_pem();
                ProcBoot {
                    proc,
                    ca_pem,
                    cert_pem,
                    key_pem,
                    bind: "127.0.0.1:0".parse().expect("addr"),
                    parent: self.endpoint.addr(),
                    owner: self.endpoint.addr(),
                    owner_lease: Duration::from_secs(10),
                    endpoint: Default::default(),
                    placement: Default::default(),
                    owner_key: None,
                }
            })
            .collect()
    }

    async fn send<M: Message>(&self, proc: &AllocatedProc, message: M) {
        self.endpoint.add_route(proc.addr.clone());
        let to = proc.proc.actor("ctl", 0).expect("actor").port(0);
        self.endpoint
            .send(&self.me, &to, Generation(0), message)
            .await
            .unwrap_or_else(|e| panic!("send to proc: {}", e.failure));
    }

    /// Pings a proc over QUIC and waits up to `within` for its pong.
    async fn ping(&mut self, proc: &AllocatedProc, within: Duration) -> Option<Pong> {
        self.next += 1;
        let n = self.next;
        let reply_to = self.inbox.port().clone();
        self.send(proc, Ping { n, reply_to }).await;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let delivery = tokio::time::timeout_at(deadline, self.inbox.recv())
                .await
                .ok()??;
            let pong = delivery.decode::<Pong>().expect("a pong");
            if pong.n == n {
                return Some(pong);
            }
        }
    }
}

/// An allocator's event stream, with the events not yet asked for.
struct Events {
    rx: mpsc::Receiver<ProcEvent>,
    seen: Vec<ProcEvent>,
}

impl Events {
    fn new(rx: mpsc::Receiver<ProcEvent>) -> Self {
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first event (seen or coming within `within`) that `pick` takes.
    async fn find<T>(
        &mut self,
        within: Duration,
        mut pick: impl FnMut(&ProcEvent) -> Option<T>,
    ) -> T {
        if let Some(i) = self.seen.iter().position(|e| pick(e).is_some()) {
            let e = self.seen.remove(i);
            return pick(&e).expect("picked before");
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let event = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("no such event in time; seen {:?}", self.seen))
                .expect("event stream open");
            if let Some(t) = pick(&event) {
                return t;
            }
            self.seen.push(event);
        }
    }

    /// The exit of `proc` and its last lines.
    async fn exit_with_lines(
        &mut self,
        proc: &ProcId,
        within: Duration,
    ) -> (ProcStatus, Vec<regent_mesh::logs::LogLine>) {
        self.find(within, |e| match e {
            ProcEvent::Exited {
                proc: p,
                status,
                last_lines,
            } if p == proc => Some((*status, last_lines.clone())),
            _ => None,
        })
        .await
    }

    /// The exit of `proc`.
    async fn exit_of(&mut self, proc: &ProcId, within: Duration) -> ProcStatus {
        self.find(within, |e| match e {
            ProcEvent::Exited {
                proc: p, status, ..
            } if p == proc => Some(*status),
            _ => None,
        })
        .await
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

fn local_allocator(ctl: &Controller, marker: &str) -> LocalAllocator {
    LocalAllocator::new(ctl.endpoint.clone())
        .expect("local allocator")
        .program(PROC_BIN)
        .env(MARKER_ENV, marker)
        .start_timeout(DEADLINE)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_procs_answer_pings_and_stop() {
    let marker = marker("local-ping");
    let mut ctl = Controller::new("ctl-ping");
    let alloc = local_allocator(&ctl, &marker);
    let mut events = Events::new(alloc.take_events().expect("events"));
    assert!(alloc.take_events().is_none(), "events can be taken once");

    let procs = alloc
        .allocate(ctl.boots(&names("ping", 3)))
        .await
        .expect("allocate");
    assert_eq!(procs.len(), 3);
    let pids: BTreeSet<u32> = procs.iter().map(|p| p.pid).collect();
    assert_eq!(pids.len(), 3, "distinct processes: {procs:?}");
    for p in &procs {
        assert_eq!(p.host, LOCAL_HOST);
        assert_eq!(p.addr.proc, p.proc);
        let pong = ctl.ping(p, DEADLINE).await.expect("pong");
        assert_eq!((pong.proc.clone(), pong.pid), (p.proc.clone(), p.pid));
    }

    // A stop of a proc that keeps SIGTERM's default action: it dies of it.
    let status = alloc
        .stop(&procs[0].proc, Duration::from_secs(10))
        .await
        .expect("stop");
    assert_eq!(status, ProcStatus::Signal(Signal::SIGTERM as i32));
    assert_eq!(events.exit_of(&procs[0].proc, DEADLINE).await, status);
    assert!(matches!(
        alloc.stop(&procs[0].proc, Duration::ZERO).await,
        Err(AllocError::UnknownProc(_))
    ));

    alloc.shutdown(Duration::from_secs(10)).await;
    for p in &procs[1..] {
        let status = events.exit_of(&p.proc, DEADLINE).await;
        assert_eq!(status, ProcStatus::Signal(Signal::SIGTERM as i32));
    }
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

/// A proc that writes far more than its pipe holds while nobody reads its
/// lines is never blocked (it answers a ping); what could not be queued is
/// dropped and counted, and the count arrives: every line is either
/// delivered or counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_output_never_blocks_the_proc_and_drops_are_counted() {
    const LINES: u32 = 30_000; // about 330 kB: five times a pipe's buffer
    let marker = marker("log-flood");
    let mut ctl = Controller::new("ctl-flood");
    let small = std::num::NonZeroUsize::new(8).unwrap();
    let alloc = LocalAllocator::with_config(
        ctl.endpoint.clone(),
        regent_mesh::alloc::LocalConfig::default()
            .host(regent_mesh::host::HostConfig::default().log_buffer(small))
            .event_buffer(small),
    )
    .expect("local allocator")
    .program(PROC_BIN)
    .env(MARKER_ENV, &marker)
    .start_timeout(DEADLINE);
    let mut logs = alloc.take_logs().expect("logs");
    let procs = alloc
        .allocate(ctl.boots(&names("flood", 1)))
        .await
        .expect("allocate");
    let p = &procs[0];
    ctl.send(
        p,
        Burst {
            lines: LINES,
            label: "flood".into(),
        },
    )
    .await;
    // Nobody reads the lines, yet the proc gets past its burst.
    assert!(ctl.ping(p, DEADLINE).await.is_some(), "the proc is blocked");
    let (mut delivered, mut counted) = (0u64, 0u64);
    let mut tally = |text: &str| {
        if text.starts_with("flood ") {
            delivered += 1;
        } else if let Some(n) = text
            .strip_prefix("regent: ")
            .and_then(|t| t.split(' ').next())
        {
            counted += n.parse::<u64>().expect("a count");
        }
    };
    // Take what was queued, until the agent has read the whole burst.
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(1), logs.recv()).await {
        tally(&line.text);
    }
    // One more line: it gets through, after the count of what was dropped.
    ctl.send(
        p,
        Burst {
            lines: 1,
            label: "after".into(),
        },
    )
    .await;
    loop {
        let line = tokio::time::timeout(DEADLINE, logs.recv())
            .await
            .expect("a line in time")
            .expect("log stream open");
        if line.text.starts_with("after ") {
            break;
        }
        tally(&line.text);
    }
    println!("flood of {LINES} lines: {delivered} delivered, {counted} dropped and counted");
    assert!(
        counted > 0,
        "nothing dropped: the test did not fill the queues"
    );
    assert_eq!(delivered + counted, u64::from(LINES));
    alloc.shutdown(Duration::from_secs(5)).await;
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_exits_are_reported_at_once() {
    let marker = marker("local-exit");
    let ctl = Controller::new("ctl-exit");
    let alloc = local_allocator(&ctl, &marker);
    let mut events = Events::new(alloc.take_events().expect("events"));
    let procs = alloc
        .allocate(ctl.boots(&names("exit", 3)))
        .await
        .expect("allocate");

    // SIGKILL from outside (as the OOM killer would): kill -> event.
    let t = Instant::now();
    kill(nix_pid(procs[0].pid), Signal::SIGKILL).expect("kill");
    let status = events.exit_of(&procs[0].proc, DEADLINE).await;
    let sigkill_latency = t.elapsed();
    assert_eq!(status, ProcStatus::Signal(Signal::SIGKILL as i32));

    // An exit code, told over QUIC: send -> event.
    let t = Instant::now();
    ctl.send(&procs[1], Exit { code: 7 }).await;
    let status = events.exit_of(&procs[1].proc, DEADLINE).await;
    let code_latency = t.elapsed();
    assert_eq!(status, ProcStatus::Code(7));

    // A panic of the proc's main thread: exit code 101.
    let t = Instant::now();
    ctl.send(&procs[2], Panic).await;
    let status = events.exit_of(&procs[2].proc, DEADLINE).await;
    let panic_latency = t.elapsed();
    assert_eq!(status, ProcStatus::Code(101));

    println!(
        "local exit reports: SIGKILL -> event {:.2} ms; exit(7) message -> event {:.2} ms; panic message -> event {:.2} ms",
        sigkill_latency.as_secs_f64() * 1e3,
        code_latency.as_secs_f64() * 1e3,
        panic_latency.as_secs_f64() * 1e3,
    );
    assert!(
        sigkill_latency < EXIT_REPORT_BOUND,
        "SIGKILL reported after {sigkill_latency:?}"
    );
    assert!(code_latency < EXIT_REPORT_BOUND);
    assert!(panic_latency < EXIT_REPORT_BOUND);
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_stop_escalates_and_signals_pause() {
    let marker = marker("local-stop");
    let mut ctl = Controller::new("ctl-stop");
    let alloc = local_allocator(&ctl, &marker).args(["--ignore-term"]);
    let mut events = Events::new(alloc.take_events().expect("events"));
    let procs = alloc
        .allocate(ctl.boots(&names("stop", 2)))
        .await
        .expect("allocate");

    // SIGSTOP pauses a proc (no pong), SIGCONT resumes it.
    alloc
        .signal(&procs[1].proc, ProcSignal::Stop)
        .await
        .expect("SIGSTOP");
    assert!(
        ctl.ping(&procs[1], Duration::from_millis(500))
            .await
            .is_none(),
        "a stopped proc answered"
    );
    alloc
        .signal(&procs[1].proc, ProcSignal::Cont)
        .await
        .expect("SIGCONT");
    // The pending ping's pong may come first; then ours.
    assert!(
        ctl.ping(&procs[1], DEADLINE).await.is_some(),
        "no pong after SIGCONT"
    );

    // A proc that ignores SIGTERM is killed after the grace.
    let grace = Duration::from_millis(500);
    let t = Instant::now();
    let status = alloc.stop(&procs[0].proc, grace).await.expect("stop");
    let took = t.elapsed();
    assert_eq!(status, ProcStatus::Signal(Signal::SIGKILL as i32));
    assert!(took >= grace, "killed before the grace: {took:?}");
    println!("stop of a proc ignoring SIGTERM: SIGKILL after {took:?} (grace {grace:?})");
    assert_eq!(events.exit_of(&procs[0].proc, DEADLINE).await, status);

    alloc.shutdown(Duration::from_millis(200)).await;
    assert_eq!(
        events.exit_of(&procs[1].proc, DEADLINE).await,
        ProcStatus::Signal(Signal::SIGKILL as i32)
    );
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_allocation_failures_leave_nothing_running() {
    let marker = marker("local-fail");
    let ctl = Controller::new("ctl-fail");

    // A program that exits at once.
    let alloc = LocalAllocator::new(ctl.endpoint.clone())
        .expect("allocator")
        .program("/bin/false")
        .env(MARKER_ENV, &marker);
    let err = alloc
        .allocate(ctl.boots(&names("false", 1)))
        .await
        .expect_err("a proc that exits cannot be ready");
    assert!(
        matches!(
            err,
            AllocError::ExitedEarly { .. } | AllocError::Spawn { .. }
        ),
        "{err}"
    );
    drop(alloc);

    // A program that never reports ready: killed after the start timeout,
    // with the procs of the batch that did start.
    let ctl = Controller::new("ctl-fail-2");
    let alloc = LocalAllocator::new(ctl.endpoint.clone())
        .expect("allocator")
        .program("/bin/sleep")
        .args(["600"])
        .env(MARKER_ENV, &marker)
        .start_timeout(Duration::from_secs(1));
    let err = alloc
        .allocate(ctl.boots(&names("sleep", 2)))
        .await
        .expect_err("sleep never reports ready");
    assert!(matches!(err, AllocError::NotReady { .. }), "{err}");
    assert!(
        alloc.agent().procs().is_empty(),
        "procs left after a failed allocation"
    );

    // A program that does not exist.
    let ctl3 = Controller::new("ctl-fail-3");
    let missing = LocalAllocator::new(ctl3.endpoint.clone())
        .expect("allocator")
        .program("/nonexistent/regent-proc");
    let err = missing
        .allocate(ctl3.boots(&names("missing", 1)))
        .await
        .expect_err("no such program");
    assert!(matches!(err, AllocError::Spawn { .. }), "{err}");

    // One in-process host agent per endpoint: its port is taken.
    assert!(
        LocalAllocator::new(ctl.endpoint.clone()).is_err(),
        "a second local allocator on the same endpoint"
    );
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_refuses_bad_input_and_lost_parents() {
    let run = |parent: Option<String>, stdin: &'static [u8]| {
        let mut cmd = Command::new(PROC_BIN);
        cmd.env(ROLE_ENV, "proc")
            .env_remove(PARENT_PID_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(p) = parent {
            cmd.env(PARENT_PID_ENV, p);
        }
        let mut child = cmd.spawn().expect("spawn alloc_proc");
        {
            use std::io::Write as _;
            let mut input = child.stdin.take().expect("stdin");
            let _ = input.write_all(stdin);
        }
        let out = child.wait_with_output().expect("wait");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let me = std::process::id().to_string();
    let (code, err) = run(Some(me.clone()), b"{\"proc\": \"p\", \"key_pem\": 5}");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("does not decode"), "{err}");
    let (code, err) = run(Some(me), &[b' '; 70 * 1024]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("larger than"), "{err}");
    let (code, err) = run(Some("1".into()), b"");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is gone"), "{err}");
    let (code, err) = run(None, b"");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(PARENT_PID_ENV), "{err}");
}

/// A host agent process (`alloc_proc` as `REGENT_ROLE=host`), stopped
/// (SIGTERM, then SIGKILL) and reaped on drop.
struct HostProcess {
    child: Option<Child>,
    addr: ProcAddr,
    _dir: TempDir,
}

impl HostProcess {
    fn start(ca: &ClusterCa, name: &str, marker: &str, extra: &[&str]) -> Self {
        let dir = TempDir::new("alloc", name);
        ca.issue(&pid_of(name), Role::HostAgent, Validity::job())
            .expect("issue")
            .save(&dir.0)
            .expect("save credentials");
        let mut child = Command::new(PROC_BIN)
            .env(ROLE_ENV, "host")
            .env(MARKER_ENV, marker)
            .arg("--credentials")
            .arg(&dir.0)
            .args([
                "--name",
                name,
                "--listen",
                "127.0.0.1:0",
                "--program",
                PROC_BIN,
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn host agent");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut host = Self {
            child: Some(child),
            addr: "quic://127.0.0.1:1/unset".parse().expect("addr"),
            _dir: dir,
        };
        let line = rx
            .recv_timeout(DEADLINE)
            .expect("host agent announces its address");
        let addr = line
            .strip_prefix("regent-host listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        host.addr = addr.parse().expect("host address");
        host
    }

    fn pid(&self) -> Pid {
        nix_pid(self.child.as_ref().expect("running").id())
    }

    /// SIGKILLs the agent and reaps it.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix_pid(child.id());
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits until `pid` is gone; reaps it if it became this process's child
/// (this process is a subreaper in the tests that need it).
async fn await_gone(pid: u32, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        match waitpid(nix_pid(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(_) => return Ok(()),
            // Not our child (yet): gone once /proc forgets it.
            Err(_) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => return Ok(()),
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("pid {pid} still there after {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_allocator_places_procs_on_two_host_agents() {
    let marker = marker("two-hosts");
    let mut ctl = Controller::new("ctl-hosts");
    let a = HostProcess::start(&ctl.ca, "host-a", &marker, &[]);
    let b = HostProcess::start(&ctl.ca, "host-b", &marker, &[]);
    let alloc = HostAllocator::with_config(
        ctl.endpoint.clone(),
        vec![a.addr.clone(), b.addr.clone()],
        HostAllocatorConfig::default()
            .env(MARKER_ENV, &marker)
            .start_timeout(DEADLINE),
    )
    .expect("host allocator")
    .watch_transport_events()
    .expect("transport events");
    let mut events = Events::new(alloc.take_events().expect("events"));
    let mut logs = alloc.take_logs().expect("logs");

    let procs = alloc
        .allocate(ctl.boots(&names("remote", 4)))
        .await
        .expect("allocate");
    // Each proc's first line crossed the wire from its host agent.
    let mut ready: Vec<String> = Vec::new();
    while ready.len() < procs.len() {
        let line = tokio::time::timeout(DEADLINE, logs.recv())
            .await
            .expect("a log line in time")
            .expect("log stream open");
        assert_eq!(
            line.text,
            format!("alloc_proc {} ready", line.proc),
            "{line:?}"
        );
        assert_eq!(line.stream, regent_mesh::logs::LogStream::Stdout);
        ready.push(line.proc.to_string());
    }
    ready.sort();
    let mut want: Vec<String> = procs.iter().map(|p| p.proc.to_string()).collect();
    want.sort();
    assert_eq!(ready, want);
    let on = |host: &ProcAddr| {
        procs
            .iter()
            .filter(|p| p.host == host.proc.as_str())
            .count()
    };
    assert_eq!((on(&a.addr), on(&b.addr)), (2, 2), "round-robin: {procs:?}");
    for p in &procs {
        let pong = ctl.ping(p, DEADLINE).await.expect("pong");
        assert_eq!(pong.pid, p.pid);
    }

    // SIGKILL a remote proc: the host agent reaps it and pushes the exit.
    let t = Instant::now();
    kill(nix_pid(procs[0].pid), Signal::SIGKILL).expect("kill");
    let status = events.exit_of(&procs[0].proc, DEADLINE).await;
    let latency = t.elapsed();
    assert_eq!(status, ProcStatus::Signal(Signal::SIGKILL as i32));
    println!(
        "host agent exit report: SIGKILL -> event at the owner {:.2} ms (waitpid on the host, QUIC to the owner)",
        latency.as_secs_f64() * 1e3
    );
    assert!(latency < EXIT_REPORT_BOUND, "reported after {latency:?}");

    // Exit codes and signals through the host agent; the exit carries the
    // proc's last lines, the partial one on stderr included.
    ctl.send(&procs[1], Exit { code: 3 }).await;
    let (status, last) = events.exit_with_lines(&procs[1].proc, DEADLINE).await;
    assert_eq!(status, ProcStatus::Code(3));
    let texts: Vec<&str> = last.iter().map(|l| l.text.as_str()).collect();
    let exits = format!("alloc_proc {} exits", procs[1].proc);
    assert!(texts.contains(&exits.as_str()), "{last:?}");
    assert!(texts.contains(&"half a lin"), "{last:?}");
    alloc
        .signal(&procs[2].proc, ProcSignal::Kill)
        .await
        .expect("signal");
    assert_eq!(
        events.exit_of(&procs[2].proc, DEADLINE).await,
        ProcStatus::Signal(Signal::SIGKILL as i32)
    );
    let status = alloc
        .stop(&procs[3].proc, Duration::from_secs(10))
        .await
        .expect("stop");
    assert_eq!(status, ProcStatus::Signal(Signal::SIGTERM as i32));

    // More procs after some exited; then stop them all.
    let more = alloc
        .allocate(ctl.boots(&names("again", 2)))
        .await
        .expect("allocate again");
    for p in &more {
        assert!(ctl.ping(p, DEADLINE).await.is_some());
    }
    alloc.shutdown(Duration::from_secs(10)).await;
    drop(alloc);
    drop((a, b));
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn procs_die_with_their_host_agent() {
    // Orphaned procs are reparented to this process, which reaps them.
    nix::sys::prctl::set_child_subreaper(true).expect("subreaper");
    let marker = marker("host-death");
    let ctl = Controller::new("ctl-death");
    let mut host = HostProcess::start(&ctl.ca, "host-doomed", &marker, &[]);
    let alloc = HostAllocator::with_config(
        ctl.endpoint.clone(),
        vec![host.addr.clone()],
        HostAllocatorConfig::default()
            .env(MARKER_ENV, &marker)
            .start_timeout(DEADLINE),
    )
    .expect("host allocator")
    .watch_transport_events()
    .expect("transport events");
    let mut events = Events::new(alloc.take_events().expect("events"));
    let procs = alloc
        .allocate(ctl.boots(&names("orphan", 2)))
        .await
        .expect("allocate");

    let t = Instant::now();
    kill(host.pid(), Signal::SIGKILL).expect("kill host agent");
    host.kill();
    for p in &procs {
        await_gone(p.pid, DEADLINE)
            .await
            .expect("procs die with their host agent (parent-death signal)");
    }
    let died = t.elapsed();
    let lost = events
        .find(DEADLINE, |e| match e {
            ProcEvent::HostLost { host: h, procs } if h == "host-doomed" => Some(procs.clone()),
            _ => None,
        })
        .await;
    let detected = t.elapsed();
    let expected: Vec<ProcId> = {
        let mut v: Vec<_> = procs.iter().map(|p| p.proc.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(lost, expected);
    println!(
        "host agent SIGKILL: its procs gone after {:.1} ms; HostLost at the owner after {:.0} ms (QUIC idle timeout 1 s)",
        died.as_secs_f64() * 1e3,
        detected.as_secs_f64() * 1e3
    );
    assert!(detected < FAILURE_TIMEOUT + Duration::from_secs(3));
    assert!(alloc.hosts()[0].lost.is_some());
    assert!(matches!(
        alloc.allocate(ctl.boots(&names("nowhere", 1))).await,
        Err(AllocError::Capacity(_))
    ));
    drop(alloc);
    assert_no_marked_processes(&marker).await;
}

/// Receives the next message on `inbox` of type `M`, skipping others.
async fn recv_as<M: Message>(inbox: &mut Inbox, within: Duration) -> M {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let d = tokio::time::timeout_at(deadline, inbox.recv())
            .await
            .unwrap_or_else(|_| panic!("no {} in time", M::TYPE_NAME))
            .expect("inbox open");
        if d.type_tag == TypeTag::of::<M>() {
            return d.decode::<M>().expect("decode");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_lease_lapse_stops_procs() {
    let marker = marker("lease");
    let ctl = Controller::new("ctl-lease");
    let host = HostProcess::start(
        &ctl.ca,
        "host-lease",
        &marker,
        &["--lease-stop-grace-ms", "500"],
    );
    ctl.endpoint.add_route(host.addr.clone());
    // Speak the host protocol directly, as an owner that then goes silent.
    let owner = alloc_actor(ctl.endpoint.proc(), 0);
    let mut inbox = ctl.endpoint.open_port(owner.port(0)).expect("owner port");
    let lease = Duration::from_millis(1500);
    let boots = ctl.boots(&names("leased", 2));
    for (i, boot) in boots.into_iter().enumerate() {
        let mut boot = boot;
        boot.parent = host.addr.clone();
        let request = HostRequest {
            id: RequestId(i as u64 + 1),
            op: HostOp::Spawn(Box::new(SpawnRequest {
                boot,
                program: None,
                args: Vec::new(),
                env: vec![(MARKER_ENV.into(), marker.clone())],
                lease,
            })),
        };
        ctl.endpoint
            .send(&owner, &host_port(&host.addr.proc), Generation(0), request)
            .await
            .expect("send spawn");
    }
    // The owner's last message: its lease runs from here (the procs may
    // take long to report ready on a loaded machine).
    let last_contact = Instant::now();
    let mut pids = Vec::new();
    let mut ready = BTreeSet::new();
    let mut replies = 0;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while replies < 2 || ready.len() < 2 {
        let d = tokio::time::timeout_at(deadline, inbox.recv())
            .await
            .expect("spawn replies and ready reports in time")
            .expect("inbox open");
        if d.type_tag == TypeTag::of::<HostReply>() {
            let reply = d.decode::<HostReply>().expect("reply");
            match reply.outcome {
                Ok(ReplyOk::Spawned { pid }) => pids.push(pid),
                other => panic!("spawn refused: {other:?}"),
            }
            replies += 1;
        } else if d.type_tag == TypeTag::of::<ProcReady>() {
            ready.insert(d.decode::<ProcReady>().expect("ready").proc);
        }
    }

    // Another owner (another controller of the same cluster) may not touch
    // them.
    let intruder_id = pid_of("intruder");
    let intruder = Endpoint::bind(
        ctl.ca
            .issue(&intruder_id, Role::Controller, Validity::job())
            .expect("issue"),
        "127.0.0.1:0".parse().expect("addr"),
        EndpointConfig::default(),
    )
    .expect("bind");
    intruder.add_route(host.addr.clone());
    let intruder_actor = alloc_actor(&intruder_id, 0);
    let mut intruder_inbox = intruder.open_port(intruder_actor.port(0)).expect("port");
    let victim = ready.iter().next().expect("a proc").clone();
    intruder
        .send(
            &intruder_actor,
            &host_port(&host.addr.proc),
            Generation(0),
            HostRequest {
                id: RequestId(1),
                op: HostOp::Signal {
                    proc: victim,
                    signal: ProcSignal::Kill,
                },
            },
        )
        .await
        .expect("send");
    let refused = recv_as::<HostReply>(&mut intruder_inbox, DEADLINE).await;
    assert!(
        matches!(&refused.outcome, Err(why) if why.contains("does not own")),
        "{refused:?}"
    );

    // No renewal: the lease lapses and the host agent stops both procs.
    let mut exited = BTreeSet::new();
    while exited.len() < 2 {
        let m = recv_as::<ProcExited>(&mut inbox, DEADLINE).await;
        assert_eq!(m.status, ProcStatus::Signal(Signal::SIGTERM as i32));
        exited.insert(m.proc);
    }
    let after = last_contact.elapsed();
    println!("lease {lease:?} lapsed: procs stopped {after:?} after the owner's last message");
    assert_eq!(exited, ready);
    assert!(after + Duration::from_millis(100) >= lease.saturating_sub(Duration::from_millis(500)));
    for pid in pids {
        await_gone(pid, DEADLINE).await.expect("proc gone");
    }
    drop(host);
    assert_no_marked_processes(&marker).await;
}

/// Whether a local Slurm answers (`SLURM_CONF` set and `sinfo` works).
fn slurm_available() -> Result<(), String> {
    if std::env::var_os("SLURM_CONF").is_none() {
        return Err("SLURM_CONF is not set".into());
    }
    match Command::new("sinfo").arg("-h").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "sinfo failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("no sinfo: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_allocator_starts_host_agents_with_srun() {
    if let Err(why) = slurm_available() {
        assert!(
            std::env::var_os("REGENT_REQUIRE_SLURM").is_none(),
            "REGENT_REQUIRE_SLURM is set but Slurm is unavailable: {why}"
        );
        println!(
            "skipped: no local Slurm ({why}); run scripts/slurm-setup.sh and export SLURM_CONF"
        );
        return;
    }
    let marker = marker("slurm");
    let mut ctl = Controller::new("ctl-slurm");
    let shared = TempDir::new("alloc", "slurm-shared");
    let config = SlurmConfig::default()
        .tasks_per_node(NonZeroU32::new(2).expect("2"))
        .host_program(PROC_BIN, Vec::<String>::new())
        .env(MARKER_ENV, &marker)
        .shared_dir(&shared.0)
        .start_timeout(Duration::from_secs(60))
        .host_idle_exit(Duration::from_secs(30))
        .hosts(
            HostAllocatorConfig::default()
                .program(PROC_BIN)
                .env(MARKER_ENV, &marker)
                .start_timeout(DEADLINE),
        );
    let t = Instant::now();
    let slurm = SlurmAllocator::start(ctl.endpoint.clone(), &ctl.ca, config)
        .await
        .expect("host agents through srun")
        .watch_transport_events()
        .expect("transport events");
    println!(
        "slurm: {} host agents announced {:.0} ms after srun started (job {})",
        slurm.host_info().len(),
        t.elapsed().as_secs_f64() * 1e3,
        slurm.job_name()
    );
    let hosts = slurm.host_info();
    assert_eq!(hosts.len(), 2, "{hosts:?}");
    let squeue = Command::new("squeue")
        .args(["-h", "-n", slurm.job_name(), "-o", "%T"])
        .output()
        .expect("squeue");
    assert_eq!(
        String::from_utf8_lossy(&squeue.stdout).trim(),
        "RUNNING",
        "the agents run as a Slurm job"
    );
    let credentials_left = std::fs::read_dir(&shared.0).map(|d| d.count()).unwrap_or(0);
    assert_eq!(credentials_left, 0, "host credentials removed once loaded");

    let mut events = Events::new(slurm.take_events().expect("events"));
    let procs = slurm
        .allocate(ctl.boots(&names("slurmed", 2)))
        .await
        .expect("allocate through srun's agents");
    let on: BTreeSet<&str> = procs.iter().map(|p| p.host.as_str()).collect();
    assert_eq!(on.len(), 2, "one proc per agent: {procs:?}");
    for p in &procs {
        assert_eq!(ctl.ping(p, DEADLINE).await.expect("pong").pid, p.pid);
    }
    let t = Instant::now();
    kill(nix_pid(procs[0].pid), Signal::SIGKILL).expect("kill");
    let status = events.exit_of(&procs[0].proc, DEADLINE).await;
    let latency = t.elapsed();
    assert_eq!(status, ProcStatus::Signal(Signal::SIGKILL as i32));
    println!(
        "slurm host agent exit report: SIGKILL -> event at the owner {:.2} ms",
        latency.as_secs_f64() * 1e3
    );
    assert!(latency < EXIT_REPORT_BOUND);

    slurm.shutdown(Duration::from_secs(10)).await;
    assert!(slurm.srun_pid().is_none(), "srun ended");
    let job = slurm.job_name().to_owned();
    drop(slurm);
    assert_no_marked_processes(&marker).await;
    // The job leaves the queue once its step ended.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let out = Command::new("squeue")
            .args(["-h", "-n", &job, "-o", "%T"])
            .output()
            .expect("squeue");
        let state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if state.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "job {job} still {state}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a host agent sent an owner.
#[derive(Debug)]
enum FromHost {
    Reply(HostReply),
    Ready(ProcReady),
    Exited(ProcExited),
}

/// Speaks the host protocol directly, as the owner actor `regent-alloc[0]`
/// of `endpoint`'s proc, to one host agent.
struct RawOwner {
    endpoint: Endpoint,
    actor: ActorId,
    host: ProcAddr,
    inbox: Inbox,
    next: u64,
    seen: Vec<FromHost>,
}

impl RawOwner {
    fn new(endpoint: &Endpoint, host: &ProcAddr) -> Self {
        endpoint.add_route(host.clone());
        let actor = alloc_actor(endpoint.proc(), 0);
        let inbox = endpoint.open_port(actor.port(0)).expect("owner port");
        Self {
            endpoint: endpoint.clone(),
            actor,
            host: host.clone(),
            inbox,
            next: 0,
            seen: Vec::new(),
        }
    }

    async fn send<M: Message>(&self, message: M) {
        self.endpoint
            .send(
                &self.actor,
                &host_port(&self.host.proc),
                Generation(0),
                message,
            )
            .await
            .unwrap_or_else(|e| panic!("send to the host agent: {}", e.failure));
    }

    /// The next message from the host (seen before, or coming within
    /// `within`) that `pick` takes; `None` if none came.
    async fn find<T>(
        &mut self,
        within: Duration,
        mut pick: impl FnMut(&FromHost) -> Option<T>,
    ) -> Option<T> {
        if let Some(i) = self.seen.iter().position(|m| pick(m).is_some()) {
            return pick(&self.seen.remove(i));
        }
        let deadline = tokio::time::Instant::now() + within;
        while let Ok(Some(d)) = tokio::time::timeout_at(deadline, self.inbox.recv()).await {
            let m = if d.type_tag == TypeTag::of::<HostReply>() {
                FromHost::Reply(d.decode().expect("reply"))
            } else if d.type_tag == TypeTag::of::<ProcReady>() {
                FromHost::Ready(d.decode().expect("ready"))
            } else if d.type_tag == TypeTag::of::<ProcLogs>() {
                // Its procs' output lines: not what these tests look at.
                continue;
            } else {
                FromHost::Exited(d.decode().expect("a host message"))
            };
            if let Some(t) = pick(&m) {
                return Some(t);
            }
            self.seen.push(m);
        }
        None
    }

    /// Sends a request and waits for its reply.
    async fn request(&mut self, op: HostOp) -> Result<ReplyOk, String> {
        self.next += 1;
        let id = RequestId(self.next);
        self.send(HostRequest { id, op }).await;
        self.find(DEADLINE, |m| match m {
            FromHost::Reply(r) if r.id == id => Some(r.outcome.clone()),
            _ => None,
        })
        .await
        .unwrap_or_else(|| panic!("no reply to request {id} in time; seen {:?}", self.seen))
    }

    /// A spawn request for `boot` (its parent set to the host agent).
    fn spawn_op(&self, mut boot: ProcBoot, lease: Duration, marker: &str) -> HostOp {
        boot.parent = self.host.clone();
        HostOp::Spawn(Box::new(SpawnRequest {
            boot,
            program: None,
            args: Vec::new(),
            env: vec![(MARKER_ENV.into(), marker.into())],
            lease,
        }))
    }

    /// Spawns a proc from `boot` with `lease` and waits until it is ready.
    async fn spawn_ready(
        &mut self,
        boot: ProcBoot,
        lease: Duration,
        marker: &str,
    ) -> AllocatedProc {
        let proc = boot.proc.clone();
        let outcome = self.request(self.spawn_op(boot, lease, marker)).await;
        assert!(
            matches!(outcome, Ok(ReplyOk::Spawned { .. })),
            "{outcome:?}"
        );
        let ready = self
            .find(DEADLINE, |m| match m {
                FromHost::Ready(r) if r.proc == proc => Some(r.clone()),
                _ => None,
            })
            .await
            .expect("the proc reports ready");
        AllocatedProc {
            proc: ready.proc,
            addr: ready.addr,
            pid: ready.pid,
            host: self.host.proc.to_string(),
        }
    }

    /// The exit of `proc` reported so far or within `within`.
    async fn exit_of(&mut self, proc: &ProcId, within: Duration) -> Option<ProcStatus> {
        self.find(within, |m| match m {
            FromHost::Exited(e) if e.proc == *proc => Some(e.status),
            _ => None,
        })
        .await
    }
}

impl HostProcess {
    /// Whether the agent process still runs (reaps it if it ended).
    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The agent's exit status, waiting up to `within`.
    async fn exit_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An endpoint of `name` with a certificate of `role` from `ca`.
fn endpoint_as(ca: &ClusterCa, name: &str, role: Role) -> Endpoint {
    Endpoint::bind(
        ca.issue(&pid_of(name), role, Validity::job())
            .expect("issue"),
        "127.0.0.1:0".parse().expect("addr"),
        EndpointConfig::default(),
    )
    .expect("bind")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_agents_obey_only_controllers() {
    let marker = marker("roles");
    let mut ctl = Controller::new("ctl-roles");
    let mut host = HostProcess::start(&ctl.ca, "host-roles", &marker, &[]);
    let mut owner = RawOwner::new(&ctl.endpoint, &host.addr);
    let boot = ctl.boots(&names("ruled", 1)).remove(0);
    let victim = owner
        .spawn_ready(boot, Duration::from_secs(30), &marker)
        .await;

    // A proc of the cluster (a real QUIC client with a proc certificate),
    // and another host agent, ask for everything: all refused.
    for (name, role) in [("rogue-proc", Role::Proc), ("rogue-host", Role::HostAgent)] {
        let rogue = endpoint_as(&ctl.ca, name, role);
        let mut as_owner = RawOwner::new(&rogue, &host.addr);
        // A spawn that would start (its boot is of this CA, owned by the
        // rogue) if the agent took requests from any certificate.
        let mut boot = ctl.boots(&[format!("{name}-child")]).remove(0);
        boot.owner = rogue.addr();
        let ops = [
            as_owner.spawn_op(boot, Duration::from_secs(30), &marker),
            HostOp::Stop {
                proc: victim.proc.clone(),
                grace: Duration::ZERO,
            },
            HostOp::Signal {
                proc: victim.proc.clone(),
                signal: ProcSignal::Kill,
            },
            HostOp::Shutdown,
        ];
        for op in ops {
            let what = format!("{op:?}").chars().take(40).collect::<String>();
            let outcome = as_owner.request(op).await;
            assert!(
                matches!(&outcome, Err(why) if why.contains("only a controller may")),
                "{role} {what}: {outcome:?}"
            );
        }
        assert!(
            as_owner
                .exit_of(&pid_of(&format!("{name}-child")), Duration::ZERO)
                .await
                .is_none()
        );
    }
    // The victim lives on, the agent too, and the controller still rules.
    assert!(host.running(), "the host agent died");
    assert_eq!(
        ctl.ping(&victim, DEADLINE).await.expect("pong").pid,
        victim.pid
    );
    assert_eq!(
        owner
            .request(HostOp::Signal {
                proc: victim.proc.clone(),
                signal: ProcSignal::Cont,
            })
            .await,
        Ok(ReplyOk::Done)
    );
    assert!(owner.exit_of(&victim.proc, Duration::ZERO).await.is_none());
    assert_eq!(
        owner
            .request(HostOp::Stop {
                proc: victim.proc.clone(),
                grace: Duration::from_secs(10),
            })
            .await,
        Ok(ReplyOk::Done)
    );
    assert_eq!(
        owner.exit_of(&victim.proc, DEADLINE).await,
        Some(ProcStatus::Signal(Signal::SIGTERM as i32))
    );
    drop(host);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_from_procs_do_not_keep_a_host_agent() {
    // An agent exits after 1.5 s with no proc and no live lease. Only a
    // controller's lease keeps it: a proc's renewals are refused, so they
    // hold no lease.
    let marker = marker("renew-roles");
    let ctl = Controller::new("ctl-renew");
    let mut host = HostProcess::start(&ctl.ca, "host-renew", &marker, &["--idle-exit-ms", "1500"]);
    let owner = RawOwner::new(&ctl.endpoint, &host.addr);
    let rogue = endpoint_as(&ctl.ca, "renewing-proc", Role::Proc);
    let rogue = RawOwner::new(&rogue, &host.addr);
    let start = Instant::now();
    // The controller renews a 1 s lease for 3 s; the proc renews 60 s
    // leases all along.
    while start.elapsed() < Duration::from_secs(3) {
        owner
            .send(Renew {
                lease: Duration::from_secs(1),
            })
            .await;
        rogue
            .send(Renew {
                lease: Duration::from_secs(60),
            })
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(host.running(), "exited while a controller held a lease");
    }
    let renewing = tokio::spawn(async move {
        loop {
            rogue
                .send(Renew {
                    lease: Duration::from_secs(60),
                })
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let status = host.exit_within(DEADLINE).await;
    let after = start.elapsed();
    renewing.abort();
    assert!(
        status.is_some_and(|s| s.success()),
        "a proc's renewals kept the agent: {status:?}"
    );
    println!("agent idle-exited {after:?} after start (controller lease stopped at 3 s)");
    assert!(after >= Duration::from_secs(3) + Duration::from_millis(1500));
    drop(host);
    assert_no_marked_processes(&marker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_durations_do_not_harm_a_host_agent_or_its_procs() {
    let marker = marker("extremes");
    let mut ctl = Controller::new("ctl-extremes");
    let mut host = HostProcess::start(&ctl.ca, "host-extremes", &marker, &[]);
    let mut owner = RawOwner::new(&ctl.endpoint, &host.addr);
    let mut boots = ctl.boots(&names("extreme", 3));
    let a = owner
        .spawn_ready(boots.remove(0), Duration::from_secs(30), &marker)
        .await;
    let b = owner
        .spawn_ready(boots.remove(0), Duration::from_secs(30), &marker)
        .await;
    let huge = [
        Duration::MAX,
        Duration::from_secs(u64::MAX),
        Duration::from_secs(u64::MAX - 1),
        MAX_LEASE + Duration::from_nanos(1),
    ];

    // Renew: a lease past MAX_LEASE does not decode (before, `Instant +
    // Duration` overflowed on the agent's main task: exit 101).
    for lease in huge {
        owner.send(Renew { lease }).await;
    }
    // Spawn: its lease, and the proc's owner lease, are bounded too.
    let spare = boots.remove(0);
    for lease in huge {
        let outcome = owner
            .request(owner.spawn_op(spare.clone(), lease, &marker))
            .await;
        assert!(
            matches!(&outcome, Err(why) if why.contains("does not decode")),
            "{outcome:?}"
        );
    }
    for owner_lease in huge {
        let mut long_owned = spare.clone();
        long_owned.owner_lease = owner_lease;
        let outcome = owner
            .request(owner.spawn_op(long_owned, Duration::from_secs(30), &marker))
            .await;
        assert!(
            matches!(&outcome, Err(why) if why.contains("does not decode")),
            "{outcome:?}"
        );
    }
    // Stop: a grace past MAX_STOP_GRACE does not decode (before, it killed
    // the proc's watcher: the exit was never reported, the name stayed
    // taken).
    for grace in huge
        .into_iter()
        .chain([MAX_STOP_GRACE + Duration::from_nanos(1)])
    {
        let outcome = owner
            .request(HostOp::Stop {
                proc: a.proc.clone(),
                grace,
            })
            .await;
        assert!(
            matches!(&outcome, Err(why) if why.contains("does not decode")),
            "{outcome:?}"
        );
    }

    // The agent and both procs are up and answer.
    assert!(host.running(), "the host agent died");
    for p in [&a, &b] {
        assert_eq!(ctl.ping(p, DEADLINE).await.expect("pong").pid, p.pid);
        assert!(owner.exit_of(&p.proc, Duration::ZERO).await.is_none());
    }

    // At the bounds everything works: a stop with the longest grace
    // (SIGTERM kills this proc at once), a renewal of the longest lease.
    owner.send(Renew { lease: MAX_LEASE }).await;
    let outcome = owner
        .request(HostOp::Stop {
            proc: a.proc.clone(),
            grace: MAX_STOP_GRACE,
        })
        .await;
    assert_eq!(outcome, Ok(ReplyOk::Done));
    assert_eq!(
        owner.exit_of(&a.proc, DEADLINE).await,
        Some(ProcStatus::Signal(Signal::SIGTERM as i32))
    );
    // The stopped proc's name is free again.
    let again = owner
        .spawn_ready(
            ctl.boots(&[a.proc.to_string()]).remove(0),
            MAX_LEASE,
            &marker,
        )
        .await;
    // A lease of zero lapses at once: the owner's procs are stopped, as
    // documented, and the agent stays up.
    owner
        .send(Renew {
            lease: Duration::ZERO,
        })
        .await;
    for p in [&b, &again] {
        assert_eq!(
            owner.exit_of(&p.proc, DEADLINE).await,
            Some(ProcStatus::Signal(Signal::SIGTERM as i32))
        );
    }
    assert!(host.running(), "the host agent died");
    drop(host);
    assert_no_marked_processes(&marker).await;
}
