//! The real endpoints (quinn, rustls mutual TLS, sessions, failure
//! detection) over [`SimNet`], on one thread under tokio's paused clock.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::*;
use crate::{
    ClusterCa, Direction, Endpoint, EndpointConfig, Generation, KeyAlgorithm, LinkFailure, Message,
    ProcId, Role, TransportEvent, Validity,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Num(u64);
impl Message for Num {
    const TYPE_NAME: &'static str = "regent-net-sim-test/Num";
}

/// Simulated time any one wait may take before the test gives up.
const SIM_DEADLINE: Duration = Duration::from_secs(600);

fn pid(name: &str) -> ProcId {
    ProcId::new(name).unwrap()
}

fn host(i: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i], 4433))
}

/// Runs `scenario` on a fresh current-thread runtime with a paused clock.
fn simulate<F: Future>(scenario: impl FnOnce() -> F) -> F::Output {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(scenario())
}

/// Starts one endpoint per name on `net`, at hosts 1, 2, ..., each knowing
/// the others' routes. Ed25519: fixed-length signatures (see the module
/// docs of `sim`).
fn endpoints(net: &SimNet, names: &[&str], config: &EndpointConfig) -> Vec<Endpoint> {
    let ca = ClusterCa::generate_with(
        "sim",
        Validity::for_duration(Validity::CA).unwrap(),
        KeyAlgorithm::Ed25519,
    )
    .unwrap();
    let eps: Vec<Endpoint> = names
        .iter()
        .zip(1u8..)
        .map(|(name, i)| {
            let creds = ca.issue(&pid(name), Role::Proc, Validity::job()).unwrap();
            Endpoint::bind_sim(creds, net, host(i), config.clone()).unwrap()
        })
        .collect();
    for a in &eps {
        for b in &eps {
            if a.proc() != b.proc() {
                a.add_route(b.addr());
            }
        }
    }
    eps
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(SIM_DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {SIM_DEADLINE:?} of simulated time"))
}

/// Every endpoint sends `count` numbered messages to every other, then
/// each receiver checks that every sender's messages came exactly once and
/// in order. Returns the simulated time it took.
async fn exchange(eps: &[Endpoint], count: u64) -> Duration {
    let start = tokio::time::Instant::now();
    let mut inboxes = Vec::new();
    for ep in eps {
        inboxes.push(
            ep.open_port(ep.proc().actor("rx", 0).unwrap().port(0))
                .unwrap(),
        );
    }
    let ports: Vec<_> = inboxes.iter().map(|i| i.port().clone()).collect();
    let mut senders = Vec::new();
    for ep in eps {
        let ep = ep.clone();
        let to: Vec<_> = ports
            .iter()
            .filter(|p| p.proc() != ep.proc())
            .cloned()
            .collect();
        senders.push(tokio::spawn(async move {
            let from = ep.proc().actor("tx", 0).unwrap();
            for n in 0..count {
                for port in &to {
                    ep.send(&from, port, Generation(0), Num(n)).await.unwrap();
                }
            }
        }));
    }
    for sender in senders {
        within("sends accepted", sender).await.unwrap();
    }
    for inbox in &mut inboxes {
        let mut next: BTreeMap<ProcId, u64> = eps
            .iter()
            .map(|e| e.proc().clone())
            .filter(|p| p != inbox.port().proc())
            .map(|p| (p, 0))
            .collect();
        while next.values().any(|n| *n < count) {
            let d = within("every message delivered", inbox.recv())
                .await
                .unwrap();
            let sender = d.sender.proc.clone();
            let Num(n) = d.decode::<Num>().unwrap();
            let expected = next.get_mut(&sender).expect("a known sender");
            assert_eq!(
                n,
                *expected,
                "{sender} -> {}: got {n}, expected {expected} (lost, duplicated or out of order)",
                inbox.port()
            );
            *expected += 1;
        }
    }
    let took = start.elapsed();
    // Long enough for any duplicate or retransmission still in flight.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for inbox in &mut inboxes {
        if let Some(d) = inbox.try_recv() {
            panic!(
                "{} got a message after all {count} from each sender: {:?} from {}",
                inbox.port(),
                d.seq,
                d.sender
            );
        }
    }
    took
}

fn faulty() -> LinkFaults {
    LinkFaults::default()
        .latency(Duration::from_micros(500), Duration::from_millis(5))
        .loss(0.05)
        .duplicate(0.05)
        .reorder(0.1, Duration::from_millis(20))
}

#[test]
fn messages_arrive_exactly_once_in_order_per_sender_over_loss_duplication_and_reordering() {
    let (trace, took) = simulate(|| async {
        let net = SimNet::new(7);
        net.set_default_faults(faulty()).unwrap();
        let eps = endpoints(&net, &["a", "b", "c"], &EndpointConfig::default());
        let took = exchange(&eps, 200).await;
        (net.trace(), took)
    });
    let count = |kind: TraceKind| trace.iter().filter(|e| e.kind == kind).count();
    let (sent, dropped, duplicated) = (
        count(TraceKind::Sent),
        count(TraceKind::Dropped(DropCause::Loss)),
        count(TraceKind::Duplicated),
    );
    println!(
        "1200 messages in {took:?} simulated: {sent} datagrams sent, {dropped} lost, {duplicated} duplicated"
    );
    // The faults really happened (else the test checks nothing).
    assert!(sent > 100, "{sent} datagrams sent");
    assert!(dropped > 5, "{dropped} of {sent} datagrams lost");
    assert!(
        duplicated > 5,
        "{duplicated} of {sent} datagrams duplicated"
    );
}

/// The first failure an endpoint reports about `peer` in each direction.
async fn link_failures(
    events: &mut mpsc::Receiver<TransportEvent>,
    peer: &ProcId,
) -> Vec<(Direction, LinkFailure)> {
    let mut failed: Vec<(Direction, LinkFailure)> = Vec::new();
    while failed.len() < 2 {
        match within("link failures", events.recv()).await.unwrap() {
            TransportEvent::LinkFailed {
                peer: p,
                direction,
                cause,
            } if p == *peer && failed.iter().all(|(d, _)| *d != direction) => {
                failed.push((direction, cause));
            }
            _ => {}
        }
    }
    failed
}

#[test]
fn a_partition_longer_than_the_failure_timeout_fails_the_link_on_both_sides_in_simulated_time() {
    let failure_timeout = Duration::from_secs(30);
    let wall = std::time::Instant::now();
    let (detected_after, resumed) = simulate(|| async move {
        let net = SimNet::new(11);
        let config = EndpointConfig::default()
            .failure_timeout(failure_timeout)
            .reconnect_timeout(Duration::from_secs(600));
        let eps = endpoints(&net, &["a", "b"], &config);
        let (a, b) = (&eps[0], &eps[1]);
        let mut events_a = a.take_events().unwrap();
        let mut events_b = b.take_events().unwrap();
        // Links up both ways (each side dials the other).
        exchange(&eps, 3).await;

        net.partition(host(1), host(2));
        let partitioned_at = tokio::time::Instant::now();
        let (failed_a, failed_b) = tokio::join!(
            link_failures(&mut events_a, b.proc()),
            link_failures(&mut events_b, a.proc()),
        );
        let detected_after = partitioned_at.elapsed();
        for (side, failed) in [("a", &failed_a), ("b", &failed_b)] {
            for (direction, cause) in failed {
                assert!(
                    matches!(
                        cause,
                        LinkFailure::HeartbeatTimeout { .. } | LinkFailure::IdleTimeout
                    ),
                    "{side} {direction:?}: {cause}"
                );
            }
        }

        // Sent during the partition: kept, and resumed once it heals.
        let rx = b.open_port(b.proc().actor("late", 0).unwrap().port(0));
        let mut rx = rx.unwrap();
        let from = a.proc().actor("tx", 0).unwrap();
        a.send(&from, rx.port(), Generation(0), Num(42))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        net.repair(host(1), host(2));
        let d = within("resumed delivery", rx.recv()).await.unwrap();
        (detected_after, d.decode::<Num>().unwrap())
    });
    let wall = wall.elapsed();
    println!(
        "partition detected after {detected_after:?} simulated; whole test {wall:?} of wall-clock time"
    );
    assert!(
        detected_after >= failure_timeout,
        "failed after {detected_after:?}, before the failure timeout {failure_timeout:?}"
    );
    assert!(
        detected_after < failure_timeout * 2,
        "failed only after {detected_after:?}"
    );
    assert_eq!(resumed, Num(42));
    // No real second of waiting: the clock jumped.
    assert!(
        wall < failure_timeout / 3,
        "{wall:?} of wall-clock time for {detected_after:?} of simulated time"
    );
}

/// A small scenario: two endpoints, 20 messages each way over a faulty
/// network. Returns the trace hash and the trace.
fn small_scenario(seed: u64) -> (u64, Vec<TraceEvent>) {
    simulate(|| async move {
        let net = SimNet::new(seed);
        net.set_default_faults(faulty()).unwrap();
        let eps = endpoints(&net, &["a", "b"], &EndpointConfig::default());
        exchange(&eps, 20).await;
        for ep in &eps {
            ep.close();
        }
        for ep in &eps {
            within("endpoints idle", ep.wait_idle()).await;
        }
        (net.trace_hash(), net.trace())
    })
}

#[test]
fn the_same_seed_replays_the_same_trace_and_other_seeds_differ() {
    const SEEDS: u64 = 20;
    let wall = std::time::Instant::now();
    let mut hashes = BTreeSet::new();
    for seed in 0..SEEDS {
        let (first, first_trace) = small_scenario(seed);
        let (second, second_trace) = small_scenario(seed);
        if first != second {
            let at = first_trace
                .iter()
                .zip(&second_trace)
                .position(|(x, y)| x != y)
                .unwrap_or(first_trace.len().min(second_trace.len()));
            panic!(
                "seed {seed} did not replay: traces differ from event {at} of {}/{}: {:?} vs {:?}",
                first_trace.len(),
                second_trace.len(),
                first_trace.get(at),
                second_trace.get(at)
            );
        }
        hashes.insert(first);
    }
    let wall = wall.elapsed();
    let per_second = (2 * SEEDS) as f64 / wall.as_secs_f64();
    println!(
        "{} runs of the small scenario in {wall:?}: {per_second:.1} seeds/s on this build; 10,000 seeds ≈ {:.0} s on one core",
        2 * SEEDS,
        10_000.0 / per_second
    );
    assert_eq!(
        hashes.len() as u64,
        SEEDS,
        "different seeds gave the same trace"
    );
}

fn send_numbered(tx: &SimSocket, to: SocketAddr, numbers: std::ops::Range<u32>) {
    for n in numbers {
        tx.try_send(&Transmit {
            destination: to,
            ecn: None,
            contents: &n.to_le_bytes(),
            segment_size: None,
            src_ip: None,
        })
        .unwrap();
    }
}

/// What `rx` receives until nothing arrives for `quiet` (simulated).
async fn received(rx: &SimSocket, quiet: Duration) -> Vec<(SocketAddr, u32)> {
    let mut got = Vec::new();
    loop {
        let mut buf = [0u8; 64];
        let next = tokio::time::timeout(
            quiet,
            std::future::poll_fn(|cx| {
                let mut bufs = [IoSliceMut::new(&mut buf)];
                let mut meta = [RecvMeta::default()];
                rx.poll_recv(cx, &mut bufs, &mut meta)
                    .map(|r| r.map(|n| (n, meta[0])))
            }),
        )
        .await;
        match next {
            Err(_) => return got,
            Ok(Ok((1, meta))) => {
                assert_eq!(meta.len, 4);
                got.push((
                    meta.addr,
                    u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]),
                ));
            }
            Ok(other) => panic!("unexpected receive: {other:?}"),
        }
    }
}

#[test]
fn link_faults_lose_duplicate_and_reorder_datagrams_at_their_rates() {
    simulate(|| async {
        let net = SimNet::new(3);
        let (a, b, c) = (host(1), host(2), host(3));
        let (ta, rb, tc) = (
            net.bind(a).unwrap(),
            net.bind(b).unwrap(),
            net.bind(c).unwrap(),
        );
        net.set_faults(
            a,
            b,
            LinkFaults::default()
                .loss(0.1)
                .duplicate(0.1)
                .reorder(0.2, Duration::from_millis(10)),
        )
        .unwrap();
        send_numbered(&ta, b, 0..2000);
        // c -> b keeps the default: fixed latency, nothing lost.
        send_numbered(&tc, b, 0..500);
        let got = received(&rb, Duration::from_secs(1)).await;
        let from = |src| got.iter().filter(move |(s, _)| *s == src).map(|(_, n)| *n);
        assert_eq!(from(c).collect::<Vec<_>>(), (0..500).collect::<Vec<_>>());
        let from_a: Vec<u32> = from(a).collect();
        let distinct: BTreeSet<u32> = from_a.iter().copied().collect();
        let lost = 2000 - distinct.len();
        let duplicated = from_a.len() - distinct.len();
        let inversions = from_a.windows(2).filter(|w| w[1] < w[0]).count();
        assert!((140..=260).contains(&lost), "{lost} of 2000 lost at 10%");
        assert!(
            (120..=240).contains(&duplicated),
            "{duplicated} of ~1800 duplicated at 10%"
        );
        assert!(inversions > 100, "{inversions} reorderings at 20%");
        assert!(
            net.set_faults(a, b, LinkFaults::default().loss(1.5))
                .is_err()
        );
    });
}

#[test]
fn partitions_drop_one_or_both_ways_and_held_datagrams_arrive_in_order_on_release() {
    simulate(|| async {
        let net = SimNet::new(5);
        let (a, b) = (host(1), host(2));
        let (sa, sb) = (net.bind(a).unwrap(), net.bind(b).unwrap());
        let quiet = Duration::from_millis(100);

        net.partition_oneway(a, b);
        send_numbered(&sa, b, 0..10);
        send_numbered(&sb, a, 0..10);
        assert!(received(&sb, quiet).await.is_empty(), "a -> b is cut");
        assert_eq!(received(&sa, quiet).await.len(), 10, "b -> a flows");

        net.repair(a, b);
        net.partition(a, b);
        send_numbered(&sa, b, 0..10);
        send_numbered(&sb, a, 0..10);
        assert!(received(&sb, quiet).await.is_empty());
        assert!(received(&sa, quiet).await.is_empty());

        net.repair(a, b);
        net.hold(a, b);
        send_numbered(&sa, b, 0..10);
        assert!(
            received(&sb, Duration::from_secs(10)).await.is_empty(),
            "held"
        );
        net.release(a, b);
        let got: Vec<u32> = received(&sb, quiet)
            .await
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>());

        assert!(net.bind(a).is_err(), "an address is bound once");
        drop(sa);
        send_numbered(&sb, a, 0..1);
        let trace = net.trace();
        assert_eq!(
            trace.last().map(|e| e.kind),
            Some(TraceKind::Dropped(DropCause::Unbound))
        );
        assert!(
            net.bind(a).is_ok(),
            "a closed socket's address is free again"
        );
    });
}
