//! The control plane between two OS processes: this test process runs a hub
//! endpoint and spawns `net_peer` procs (see `src/bin/net_peer.rs`), then
//! checks typed FIFO exchange, failure detection after SIGSTOP and SIGKILL,
//! resume after a reconnect, a fresh session for a restarted peer, messages
//! coming back when they cannot be delivered, certificate refusals, and the
//! oversized frame.
//!
//! Every spawned process is killed and reaped by [`Peer`]'s `Drop`, also
//! when a test fails. Deadlines are generous (2-core CI machines); the
//! failure-detection bound is the configured timeout plus a stated slack.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use regent_net::{
    ClusterCa, Endpoint, EndpointConfig, Generation, Inbox, LinkFailure, PortId, ProcCredentials,
    ProcId, RejectCause, TransportEvent, UndeliveredCause,
};
use regent_tests::peers::net::Probe;
use regent_tests::tempdir::TempDir;
use tokio::sync::mpsc;
use tokio::time::timeout;

const DEADLINE: Duration = Duration::from_secs(30);
/// Failure detection may exceed the configured timeout by the heartbeat
/// check granularity plus scheduling delay on a loaded 2-core machine.
const DETECTION_SLACK: Duration = Duration::from_millis(750);

fn pid(name: &str) -> ProcId {
    ProcId::new(name).expect("valid proc id")
}

/// Files of a peer's credentials.
struct CredFiles {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

fn write_creds(dir: &Path, tag: &str, chain: &str, key: &str, ca: &str) -> CredFiles {
    let files = CredFiles {
        cert: dir.join(format!("{tag}.crt")),
        key: dir.join(format!("{tag}.key")),
        ca: dir.join(format!("{tag}.ca.crt")),
    };
    std::fs::write(&files.cert, chain).expect("write cert");
    std::fs::write(&files.key, key).expect("write key");
    std::fs::write(&files.ca, ca).expect("write ca");
    files
}

fn issued(ca: &ClusterCa, dir: &Path, proc: &str) -> CredFiles {
    let (chain, key, ca_pem) = ca
        .issue(
            &pid(proc),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .to_pem();
    write_creds(dir, proc, &chain, &key, &ca_pem)
}

/// A spawned `net_peer`, killed and reaped on drop.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    /// Every line seen so far.
    log: Vec<String>,
    addr: String,
}

impl Peer {
    async fn spawn(proc: &str, files: &CredFiles, extra: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_net_peer"));
        cmd.args(["--proc", proc])
            .arg("--cert")
            .arg(&files.cert)
            .arg("--key")
            .arg(&files.key)
            .arg("--ca")
            .arg(&files.ca)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn net_peer");
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel(1 << 16);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        let mut peer = Self {
            child,
            stdin,
            lines,
            log: Vec::new(),
            addr: String::new(),
        };
        let ready = peer.expect("READY", |l| l.starts_with("READY ")).await;
        peer.addr = ready.split_whitespace().nth(1).expect("address").to_owned();
        peer
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits i32"))
    }

    fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).expect("signal the peer");
    }

    fn socket(&self) -> SocketAddr {
        self.addr
            .parse::<regent_net::ProcAddr>()
            .expect("peer address")
            .socket
    }

    fn command(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write a command");
        stdin.flush().expect("flush a command");
    }

    /// Waits for a line matching `pred`, keeping every line in `log`.
    async fn expect(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match timeout(left, self.lines.recv()).await {
                Ok(Some(line)) => {
                    self.log.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Ok(None) => panic!(
                    "peer exited before {what}; output:\n{}",
                    self.log.join("\n")
                ),
                Err(_) => panic!(
                    "no {what} within {DEADLINE:?}; output:\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    /// The `(stream, n, seq)` of every `GOT` line so far.
    fn got(&self) -> Vec<(u32, u64, u64)> {
        self.log
            .iter()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                match w.as_slice() {
                    ["GOT", _, s, n, seq] => {
                        Some((s.parse().ok()?, n.parse().ok()?, seq.parse().ok()?))
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// Waits until `count` messages of `stream` were recorded.
    async fn expect_got(&mut self, stream: u32, count: usize) {
        let start = Instant::now();
        while self.got().iter().filter(|g| g.0 == stream).count() < count {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match timeout(left, self.lines.recv()).await {
                Ok(Some(line)) => self.log.push(line),
                _ => panic!(
                    "{} of {count} messages of stream {stream} recorded; output:\n{}",
                    self.got().iter().filter(|g| g.0 == stream).count(),
                    self.log.join("\n")
                ),
            }
        }
    }

    /// Its endpoint's handshake stats: (in flight, pending, retried,
    /// refused).
    async fn handshake_stats(&mut self) -> (u64, u64, u64, u64) {
        self.command("stats");
        let line = self.expect("stats", |l| l.starts_with("STATS ")).await;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|w| w.parse().expect("a number"))
            .collect();
        (v[0], v[1], v[2], v[3])
    }

    /// Kills and reaps the process (idempotent).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The in-process side: an endpoint with an inbox and its events.
struct Hub {
    endpoint: Endpoint,
    events: mpsc::Receiver<TransportEvent>,
    inbox: Inbox,
    /// Events seen while waiting for others.
    seen: Vec<TransportEvent>,
}

impl Hub {
    fn new(ca: &ClusterCa, config: EndpointConfig) -> Self {
        Self::new_named(ca, "hub", config)
    }

    fn new_named(ca: &ClusterCa, name: &str, config: EndpointConfig) -> Self {
        let creds = ca
            .issue(
                &pid(name),
                regent_net::Role::Proc,
                regent_net::Validity::job(),
            )
            .expect("issue hub");
        let endpoint =
            Endpoint::bind(creds, "127.0.0.1:0".parse().expect("addr"), config).expect("bind hub");
        let events = endpoint.take_events().expect("events");
        let inbox = endpoint
            .open_port(pid(name).actor("inbox", 0).expect("actor").port(0))
            .expect("open port");
        Self {
            endpoint,
            events,
            inbox,
            seen: Vec::new(),
        }
    }

    fn route(&self, peer: &Peer) {
        self.endpoint
            .add_route(peer.addr.parse().expect("peer address"));
    }

    async fn event(
        &mut self,
        what: &str,
        pred: impl Fn(&TransportEvent) -> bool,
    ) -> TransportEvent {
        let start = Instant::now();
        loop {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match timeout(left, self.events.recv()).await {
                Ok(Some(e)) => {
                    self.seen.push(e.clone());
                    if pred(&e) {
                        return e;
                    }
                }
                _ => panic!(
                    "no {what} event within {DEADLINE:?}; seen: {:#?}",
                    self.seen
                ),
            }
        }
    }

    async fn send(&self, to: &PortId, stream: u32, ns: std::ops::Range<u64>, reply: bool) {
        let from = self.endpoint.proc().actor("sender", stream).expect("actor");
        for n in ns {
            let probe = Probe {
                stream,
                n,
                reply_to: reply.then(|| self.inbox.port().clone()),
                pad: Vec::new(),
            };
            self.endpoint
                .send(&from, to, Generation(0), probe)
                .await
                .expect("send accepted");
        }
    }
}

fn port(proc: &str, actor: &str) -> PortId {
    pid(proc).actor(actor, 0).expect("actor").port(0)
}

/// Checks that each stream's values arrived in increasing order, once each.
fn assert_fifo_once(got: &[(u32, u64, u64)]) {
    let mut last: BTreeMap<u32, u64> = BTreeMap::new();
    for &(stream, n, _) in got {
        if let Some(prev) = last.insert(stream, n) {
            assert!(n > prev, "stream {stream}: {n} after {prev}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_messages_flow_both_ways_in_fifo_order() {
    let dir = TempDir::new("net", "fifo");
    let ca = ClusterCa::generate("fifo").expect("ca");
    let mut hub = Hub::new(&ca, EndpointConfig::default());
    let mut peer = Peer::spawn("peer", &issued(&ca, &dir.0, "peer"), &[]).await;
    hub.route(&peer);

    // Hub -> peer echo -> hub, four sender actors interleaved.
    let echo = port("peer", "echo");
    for round in 0..250u64 {
        for stream in 0..4 {
            hub.send(&echo, stream, round..round + 1, true).await;
        }
    }
    let mut last: BTreeMap<u32, u64> = BTreeMap::new();
    for _ in 0..1000 {
        let d = timeout(DEADLINE, hub.inbox.recv())
            .await
            .expect("echo in time")
            .expect("inbox open");
        assert_eq!(d.sender, pid("peer").actor("echo", 0).expect("actor"));
        assert!(!d.is_local());
        let p = d.decode::<Probe>().expect("a Probe");
        if let Some(prev) = last.insert(p.stream, p.n) {
            assert_eq!(p.n, prev + 1, "stream {} out of order", p.stream);
        }
    }
    assert!(last.values().all(|&n| n == 249));

    // Peer -> hub, with no route set on the peer: it learned the hub's
    // address from the hub's Hello.
    peer.command(&format!("send {} 9 0 500 0", hub.inbox.port()));
    peer.expect("SENT", |l| l == "SENT 9 500").await;
    for n in 0..500 {
        let d = timeout(DEADLINE, hub.inbox.recv())
            .await
            .expect("message in time")
            .expect("inbox open");
        assert_eq!(d.seq.0, n + 1);
        let p = d.decode::<Probe>().expect("a Probe");
        assert_eq!((p.stream, p.n), (9, n));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_peer_is_detected_in_time_and_the_session_resumes() {
    let dir = TempDir::new("net", "stop");
    let ca = ClusterCa::generate("stop").expect("ca");
    let config = EndpointConfig::default();
    let failure_timeout = config.failure_timeout;
    let mut hub = Hub::new(&ca, config);
    let mut peer = Peer::spawn("peer", &issued(&ca, &dir.0, "peer"), &[]).await;
    hub.route(&peer);
    let record = port("peer", "record");

    hub.send(&record, 0, 0..200, false).await;
    peer.expect_got(0, 200).await;
    // A burst in flight, then the peer freezes.
    hub.send(&record, 0, 200..400, false).await;
    peer.signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    hub.event(
        "link failed",
        |e| matches!(e, TransportEvent::LinkFailed { peer, .. } if *peer == pid("peer")),
    )
    .await;
    let detected = stopped.elapsed();
    eprintln!("SIGSTOP detected after {detected:?}");
    assert!(
        detected <= failure_timeout + DETECTION_SLACK,
        "failure reported after {detected:?} (timeout {failure_timeout:?})"
    );
    // Sends while the peer is frozen are kept.
    hub.send(&record, 0, 400..600, false).await;
    peer.signal(Signal::SIGCONT);
    let up = hub
        .event("link up again", |e| {
            matches!(e, TransportEvent::LinkUp { .. })
        })
        .await;
    assert!(
        matches!(up, TransportEvent::LinkUp { resumed: true, .. }),
        "same incarnation resumes: {up:?}"
    );
    peer.expect_got(0, 600).await;
    // Let any late duplicate show up before checking there is none.
    hub.send(&record, 1, 0..1, false).await;
    peer.expect_got(1, 1).await;
    let got: Vec<_> = peer.got().into_iter().filter(|g| g.0 == 0).collect();
    assert_fifo_once(&got);
    let ns: Vec<u64> = got.iter().map(|g| g.1).collect();
    assert_eq!(
        ns,
        (0..600).collect::<Vec<_>>(),
        "each message exactly once, in order"
    );
    let seqs: Vec<u64> = got.iter().map(|g| g.2).collect();
    assert_eq!(seqs, (1..=600).collect::<Vec<_>>());
    assert!(
        !hub.seen
            .iter()
            .any(|e| matches!(e, TransportEvent::Undeliverable(_))),
        "nothing came back: {:#?}",
        hub.seen
    );
}

/// Adaptive detection (`failure_timeout_min`, `docs/semantics.md` §2.5):
/// once the hub has heard a peer's regular heartbeats, a stop of that peer
/// is found after about the minimum, far before the fixed
/// `failure_timeout` (3 s here), which bounds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_detection_finds_a_stopped_regular_peer_near_its_minimum() {
    let dir = TempDir::new("net", "adaptive");
    let ca = ClusterCa::generate("adaptive").expect("ca");
    let min = Duration::from_millis(300);
    let config = EndpointConfig::default()
        .failure_timeout(Duration::from_secs(3))
        .failure_timeout_min(Some(min));
    let mut hub = Hub::new(&ca, config);
    // The peer's QUIC idle timeout is 3 s too (a connection idles out
    // after the shorter of its two ends'), so only the detector can be
    // what finds it silent within the bound.
    let mut peer = Peer::spawn(
        "peer",
        &issued(&ca, &dir.0, "peer"),
        &["--failure-timeout-ms", "3000"],
    )
    .await;
    hub.route(&peer);
    let record = port("peer", "record");
    hub.send(&record, 0, 0..10, false).await;
    peer.expect_got(0, 10).await;
    // Twenty heartbeats and more: the detector knows the peer.
    tokio::time::sleep(Duration::from_secs(2)).await;
    peer.signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    hub.event(
        "link failed",
        |e| matches!(e, TransportEvent::LinkFailed { peer, .. } if *peer == pid("peer")),
    )
    .await;
    let detected = stopped.elapsed();
    peer.signal(Signal::SIGCONT);
    eprintln!("SIGSTOP detected after {detected:?} (minimum {min:?})");
    assert!(
        detected >= min.saturating_sub(Duration::from_millis(100)),
        "failure reported after {detected:?}, before the minimum {min:?}"
    );
    assert!(
        detected < Duration::from_millis(1500),
        "failure reported after {detected:?}: not adapted (fixed timeout 3 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_is_detected_and_its_restart_gets_a_fresh_session() {
    let dir = TempDir::new("net", "kill");
    let ca = ClusterCa::generate("kill").expect("ca");
    let config = EndpointConfig::default();
    let failure_timeout = config.failure_timeout;
    let mut hub = Hub::new(&ca, config);
    let files = issued(&ca, &dir.0, "peer");
    let mut old = Peer::spawn("peer", &files, &[]).await;
    hub.route(&old);
    let record = port("peer", "record");

    hub.send(&record, 0, 0..100, false).await;
    old.expect_got(0, 100).await;
    // The peer also sends to the hub, so the hub holds receive state for
    // the old incarnation.
    old.command(&format!("send {} 7 0 50 0", hub.inbox.port()));
    old.expect("SENT", |l| l == "SENT 7 50").await;
    for n in 0..50 {
        let d = timeout(DEADLINE, hub.inbox.recv())
            .await
            .expect("message in time")
            .expect("inbox open");
        assert_eq!(d.seq.0, n + 1);
    }
    hub.send(&record, 0, 100..300, false).await;
    old.signal(Signal::SIGKILL);
    let killed = Instant::now();
    hub.event(
        "link failed",
        |e| matches!(e, TransportEvent::LinkFailed { peer, .. } if *peer == pid("peer")),
    )
    .await;
    let detected = killed.elapsed();
    eprintln!("SIGKILL detected after {detected:?}");
    assert!(
        detected <= failure_timeout + DETECTION_SLACK,
        "failure reported after {detected:?} (timeout {failure_timeout:?})"
    );
    old.kill();
    // Everything the old process printed before it died (until its stdout
    // closes).
    while let Ok(Some(line)) = timeout(DEADLINE, old.lines.recv()).await {
        old.log.push(line);
    }
    let old_got: BTreeSet<u64> = old.got().iter().map(|g| g.1).collect();

    // Sent while the peer is down, then the peer comes back on the same
    // address as a new incarnation.
    hub.send(&record, 0, 300..400, false).await;
    let addr = old.socket().to_string();
    let mut new = Peer::spawn("peer", &files, &["--bind", &addr]).await;
    hub.event(
        "peer restarted",
        |e| matches!(e, TransportEvent::PeerRestarted { peer, .. } if *peer == pid("peer")),
    )
    .await;
    hub.send(&record, 0, 400..500, false).await;
    let returned: BTreeSet<u64> = {
        // Everything is accounted for once the new peer has the last one.
        let start = Instant::now();
        loop {
            let got: BTreeSet<u64> = new.got().iter().map(|g| g.1).collect();
            if got.contains(&499) {
                break;
            }
            assert!(start.elapsed() < DEADLINE, "no message 499 at the new peer");
            if let Ok(Some(line)) = timeout(Duration::from_millis(200), new.lines.recv()).await {
                new.log.push(line);
            }
        }
        while let Ok(e) = hub.events.try_recv() {
            hub.seen.push(e);
        }
        hub.seen
            .iter()
            .filter_map(|e| match e {
                TransportEvent::Undeliverable(u) => {
                    assert_eq!(u.cause, UndeliveredCause::PeerRestarted, "{u}");
                    regent_net::wire::decode_body::<Probe>(&u.envelope.payload)
                        .ok()
                        .map(|p| p.n)
                }
                _ => None,
            })
            .collect()
    };
    let new_got = new.got();
    assert_fifo_once(&new_got);
    assert_eq!(
        new_got.first().map(|g| g.2),
        Some(1),
        "a fresh session numbers from 1"
    );
    let new_ns: BTreeSet<u64> = new_got.iter().map(|g| g.1).collect();
    // An acknowledgement means "in the inbox", not "processed": the old
    // process may have died between the two. Such messages precede (FIFO)
    // every unacknowledged one, and follow every one it printed.
    let first_unacked = returned.iter().chain(&new_ns).min().copied().unwrap_or(500);
    let last_printed = old_got.iter().max().copied().unwrap_or(0);
    for n in 0..500u64 {
        let places = [
            old_got.contains(&n),
            new_ns.contains(&n),
            returned.contains(&n),
        ];
        assert!(
            places.iter().any(|&p| p) || (last_printed < n && n < first_unacked),
            "message {n} lost (printed up to {last_printed}, unacknowledged from {first_unacked})"
        );
        assert!(
            !(new_ns.contains(&n) && (old_got.contains(&n) || returned.contains(&n))),
            "message {n} reached the new incarnation and also the old one or came back"
        );
    }
    assert!((400..500).all(|n| new_ns.contains(&n)));

    // The restarted peer's own sends start a fresh session at the hub:
    // sequence 1 again (and the same pair epoch as its first life), not
    // taken for duplicates of the old incarnation's.
    new.command(&format!("send {} 7 50 50 0", hub.inbox.port()));
    new.expect("SENT", |l| l == "SENT 7 50").await;
    for n in 0..50u64 {
        let d = timeout(DEADLINE, hub.inbox.recv())
            .await
            .expect("message from the new incarnation in time")
            .expect("inbox open");
        assert_eq!(d.seq.0, n + 1);
        let p = d.decode::<Probe>().expect("a Probe");
        assert_eq!((p.stream, p.n), (7, 50 + n));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeliverable_messages_come_back_with_the_message() {
    let dir = TempDir::new("net", "undeliverable");
    let ca = ClusterCa::generate("undeliverable").expect("ca");
    let config = EndpointConfig::default().reconnect_timeout(Duration::from_secs(2));
    let mut hub = Hub::new(&ca, config);
    let mut peer = Peer::spawn("peer", &issued(&ca, &dir.0, "peer"), &[]).await;
    hub.route(&peer);

    // A port nobody opened on a live peer.
    hub.send(&port("peer", "nobody"), 3, 0..1, false).await;
    let TransportEvent::Undeliverable(u) = hub
        .event("rejection", |e| {
            matches!(e, TransportEvent::Undeliverable(_))
        })
        .await
    else {
        unreachable!("matched above")
    };
    assert_eq!(u.cause, UndeliveredCause::Rejected(RejectCause::NoSuchPort));
    let p: Probe = regent_net::wire::decode_body(&u.envelope.payload).expect("the message");
    assert_eq!((p.stream, p.n), (3, 0));

    // A dead peer: kept messages come back after reconnect_timeout.
    peer.expect_got(0, 0).await;
    hub.send(&port("peer", "record"), 0, 0..10, false).await;
    peer.expect_got(0, 10).await;
    // Acknowledged first, so that exactly the later ones come back.
    let start = Instant::now();
    while hub.endpoint.unacknowledged(&pid("peer")) > 0 {
        assert!(start.elapsed() < DEADLINE, "no acknowledgement");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    peer.signal(Signal::SIGKILL);
    peer.kill();
    hub.send(&port("peer", "record"), 0, 10..20, false).await;
    let mut back = BTreeSet::new();
    while back.len() < 10 {
        let TransportEvent::Undeliverable(u) = hub
            .event("undeliverable", |e| {
                matches!(e, TransportEvent::Undeliverable(_))
            })
            .await
        else {
            unreachable!("matched above")
        };
        assert!(matches!(u.cause, UndeliveredCause::LinkFailed(_)), "{u}");
        let p: Probe = regent_net::wire::decode_body(&u.envelope.payload).expect("the message");
        back.insert(p.n);
    }
    assert_eq!(back, (10..20).collect());
    assert!(
        hub.seen
            .iter()
            .any(|e| matches!(e, TransportEvent::LinkClosed { .. })),
        "the session reported giving up"
    );
}

/// A peer that presents `files` and claims `proc` dials the hub: the hub
/// refuses it and delivers nothing; the peer learns it was refused.
async fn refused(hub: &mut Hub, proc: &str, files: &CredFiles, unchecked: bool) -> String {
    let mut extra = vec!["--reconnect-timeout-ms", "1000"];
    if unchecked {
        extra.push("--unchecked");
    }
    let mut peer = Peer::spawn(proc, files, &extra).await;
    peer.command(&format!("route {}", hub.endpoint.addr()));
    peer.command(&format!("send {} 0 0 1 0", hub.inbox.port()));
    let from = peer.socket();
    let event = hub
        .event(
            "refusal",
            |e| matches!(e, TransportEvent::Refused { remote, .. } if *remote == from),
        )
        .await;
    let failed = peer
        .expect("link failure", |l| l.starts_with("EVENT LINKFAILED"))
        .await;
    assert!(failed.contains("refused"), "{failed}");
    peer.expect("message back", |l| l.starts_with("EVENT UNDELIVERABLE 0 0"))
        .await;
    assert!(hub.inbox.try_recv().is_none(), "nothing delivered");
    let TransportEvent::Refused { reason, .. } = event else {
        unreachable!("matched above")
    };
    reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_certificate_of_this_cluster_for_their_identity_are_refused() {
    let dir = TempDir::new("net", "refusal");
    let ca = ClusterCa::generate("refusal").expect("ca");
    let mut hub = Hub::new(&ca, EndpointConfig::default());

    // Self-signed, claiming the controller role, trusting our CA.
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec!["selfie".to_owned()]).expect("params");
    params.subject_alt_names.push(rcgen::SanType::URI(
        "regent-role:controller".try_into().expect("URI"),
    ));
    let cert = params.self_signed(&key).expect("self-sign");
    let selfie = write_creds(
        &dir.0,
        "selfie",
        &cert.pem(),
        &key.serialize_pem(),
        ca.cert_pem(),
    );
    let reason = refused(&mut hub, "selfie", &selfie, false).await;
    assert!(reason.contains("handshake failed"), "{reason}");

    // Issued by another CA, trusting ours.
    let other = ClusterCa::generate("other").expect("other ca");
    let (chain, key, _) = other
        .issue(
            &pid("stranger"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .to_pem();
    let files = write_creds(&dir.0, "stranger", &chain, &key, ca.cert_pem());
    let reason = refused(&mut hub, "stranger", &files, false).await;
    assert!(reason.contains("handshake failed"), "{reason}");

    // Issued by our CA to "mallory", claiming to be "alice".
    let (chain, key, ca_pem) = ca
        .issue(
            &pid("mallory"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .to_pem();
    assert!(ProcCredentials::from_pem(pid("alice"), &chain, &key, &ca_pem).is_err());
    let files = write_creds(&dir.0, "mallory", &chain, &key, &ca_pem);
    let reason = refused(&mut hub, "alice", &files, true).await;
    assert!(reason.contains("does not name"), "{reason}");

    // The other way round: the hub dials a listener whose certificate is
    // self-signed and refuses it.
    let listener = Peer::spawn("selfie", &selfie, &[]).await;
    hub.route(&listener);
    hub.send(&port("selfie", "record"), 0, 0..1, false).await;
    let failed = hub
        .event(
            "refused dial",
            |e| matches!(e, TransportEvent::LinkFailed { peer, .. } if *peer == pid("selfie")),
        )
        .await;
    assert!(
        matches!(
            failed,
            TransportEvent::LinkFailed {
                cause: LinkFailure::Refused(_),
                ..
            }
        ),
        "{failed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_is_rejected_with_a_clear_error() {
    let dir = TempDir::new("net", "oversized");
    let ca = ClusterCa::generate("oversized").expect("ca");
    let mut hub = Hub::new(&ca, EndpointConfig::default());
    let mut peer = Peer::spawn(
        "peer",
        &issued(&ca, &dir.0, "peer"),
        &["--max-frame-bytes", "1024"],
    )
    .await;
    hub.route(&peer);
    let record = port("peer", "record");
    let from = pid("hub").actor("big", 0).expect("actor");
    let big = Probe {
        stream: 5,
        n: 0,
        reply_to: None,
        pad: vec![1; 4096],
    };
    hub.endpoint
        .send(&from, &record, Generation(0), big)
        .await
        .expect("accepted by the hub (its limit is larger)");
    let violation = peer
        .expect("violation", |l| l.starts_with("EVENT VIOLATION hub"))
        .await;
    assert!(
        violation.contains("exceeds max_frame_bytes = 1024"),
        "{violation}"
    );
    let TransportEvent::Undeliverable(u) = hub
        .event("oversized back", |e| {
            matches!(e, TransportEvent::Undeliverable(_))
        })
        .await
    else {
        unreachable!("matched above")
    };
    let UndeliveredCause::StreamClosed(reason) = &u.cause else {
        panic!("unexpected cause: {u}")
    };
    assert!(
        reason.contains("exceeds max_frame_bytes = 1024"),
        "{reason}"
    );
    // The same pair goes on.
    hub.send(&record, 5, 1..3, false).await;
    peer.expect_got(5, 2).await;
}

/// A value in kB from `/proc/<pid>/status` (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Sends `count` QUIC Initials (each a new connection attempt with its own
/// TLS ClientHello) to `target` at `per_second`, from one UDP socket, and
/// never answers what comes back: half-open handshakes, as a flood makes
/// them. Returns the datagrams sent.
fn flood_initials(
    target: SocketAddr,
    server_name: &str,
    client: quinn_proto::ClientConfig,
    count: usize,
    per_second: u32,
) -> std::io::Result<usize> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let mut endpoint = quinn_proto::Endpoint::new(
        std::sync::Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let mut buf = Vec::with_capacity(1 << 16);
    let start = Instant::now();
    let mut sent = 0;
    for i in 0..count {
        // Pacing to the rate (not a wait for a condition).
        let due = start + Duration::from_secs_f64(i as f64 / f64::from(per_second));
        if let Some(early) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(early);
        }
        let (_, mut conn) = endpoint
            .connect(Instant::now(), client.clone(), target, server_name)
            .map_err(std::io::Error::other)?;
        buf.clear();
        if let Some(t) = conn.poll_transmit(Instant::now(), 1, &mut buf) {
            socket.send_to(&buf[..t.size], t.destination)?;
            sent += 1;
        }
    }
    Ok(sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_quic_initials_holds_bounded_state_and_peers_still_connect() {
    const FLOOD: usize = 6000;
    const RATE: u32 = 3000;
    let dir = TempDir::new("net", "flood");
    let ca = ClusterCa::generate("flood").expect("ca");
    let mut hub = Hub::new(&ca, EndpointConfig::default());
    let mut peer = Peer::spawn("target", &issued(&ca, &dir.0, "target"), &[]).await;
    hub.route(&peer);
    // Warm up: one real exchange, so the baseline has a link up.
    hub.send(&port("target", "echo"), 0, 0..1, true).await;
    timeout(DEADLINE, hub.inbox.recv())
        .await
        .expect("echo before the flood");
    let os_pid = peer.child.id();
    let rss_before = status_kib(os_pid, "VmRSS");

    let client = ca
        .issue(
            &pid("flooder"),
            regent_net::Role::Proc,
            regent_net::Validity::job(),
        )
        .expect("issue")
        .quic_client_config()
        .expect("client config");
    let target = peer.socket();
    let flood = std::thread::spawn(move || flood_initials(target, "target", client, FLOOD, RATE));

    // Under the flood: the target answers with Retries, its handshakes stay
    // within their bound, and a peer with a certificate still connects
    // (a new proc dials it and gets its echo back).
    let start = Instant::now();
    let mut max_in_flight = 0;
    loop {
        let (in_flight, _, retried, _) = peer.handshake_stats().await;
        max_in_flight = max_in_flight.max(in_flight);
        if retried > 0 {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "no Retry under the flood");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let late = Hub::new_named(&ca, "latecomer", EndpointConfig::default());
    late.endpoint
        .add_route(peer.addr.parse().expect("peer address"));
    let mut late = late;
    let t = Instant::now();
    late.send(&port("target", "echo"), 1, 0..1, true).await;
    timeout(DEADLINE, late.inbox.recv())
        .await
        .expect("a peer connects during the flood")
        .expect("inbox open");
    let connect_during_flood = t.elapsed();
    let flood_still_on = !flood.is_finished();
    while !flood.is_finished() {
        let (in_flight, ..) = peer.handshake_stats().await;
        max_in_flight = max_in_flight.max(in_flight);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sent = flood.join().expect("flood thread").expect("flood");
    let (_, _, retried, refused) = peer.handshake_stats().await;
    let peak = status_kib(os_pid, "VmHWM");
    let growth_mib = peak.saturating_sub(rss_before) as f64 / 1024.0;
    println!(
        "flood of {sent} Initials at {RATE}/s: target RSS {:.1} MiB before, peak {:.1} MiB (+{growth_mib:.1} MiB); \
         at most {max_in_flight} handshakes in flight; {retried} Retries, {refused} refused; \
         a new peer's echo took {:.1} ms during the flood (flood still on: {flood_still_on})",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0,
        connect_during_flood.as_secs_f64() * 1e3,
    );
    assert_eq!(sent, FLOOD);
    assert!(max_in_flight <= 64, "{max_in_flight} handshakes in flight");
    assert!(retried as usize >= FLOOD / 2, "only {retried} Retries");
    // 64 half-open handshakes at ~60 KiB are 4 MiB; allow for allocator
    // slack. Unbounded, this flood took ~384 MiB.
    assert!(
        growth_mib < 48.0,
        "RSS grew {growth_mib:.1} MiB under the flood"
    );
    // The old link still works too.
    hub.send(&port("target", "echo"), 2, 0..1, true).await;
    timeout(DEADLINE, hub.inbox.recv())
        .await
        .expect("echo after the flood")
        .expect("inbox open");
}
