//! Endpoint tests over real QUIC and mutual TLS on loopback, two endpoints in
//! one process (the two-process suites live in the `tests/` crate).

use std::num::NonZeroUsize;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::timeout;

use crate::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Num(u64);
impl Message for Num {
    const TYPE_NAME: &'static str = "regent-net-test/Num";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Blob(Vec<u8>);
impl Message for Blob {
    const TYPE_NAME: &'static str = "regent-net-test/Blob";
}

const DEADLINE: Duration = Duration::from_secs(20);

fn pid(name: &str) -> ProcId {
    ProcId::new(name).unwrap()
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn bind(ca: &ClusterCa, name: &str, config: EndpointConfig) -> Endpoint {
    bind_as(ca, name, Role::Proc, config)
}

fn bind_as(ca: &ClusterCa, name: &str, role: Role, config: EndpointConfig) -> Endpoint {
    init_tracing();
    bind_with(ca.issue(&pid(name), role, Validity::job()).unwrap(), config)
}

fn bind_with(credentials: ProcCredentials, config: EndpointConfig) -> Endpoint {
    init_tracing();
    Endpoint::bind(credentials, "127.0.0.1:0".parse().unwrap(), config).unwrap()
}

async fn next_event(
    events: &mut mpsc::Receiver<TransportEvent>,
    what: &str,
    mut pred: impl FnMut(&TransportEvent) -> bool,
) -> TransportEvent {
    timeout(DEADLINE, async {
        loop {
            let e = events.recv().await.expect("event channel open");
            if pred(&e) {
                return e;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {what} event within {DEADLINE:?}"))
}

async fn recv(inbox: &mut Inbox) -> Delivery {
    timeout(DEADLINE, inbox.recv())
        .await
        .expect("a delivery in time")
        .expect("inbox open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_message_frame_is_counted_once_by_its_sender_and_its_receiver() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    a.add_route(b.addr());
    let to = pid("b").actor("sink", 0).unwrap().port(0);
    let mut inbox = b.open_port(to.clone()).unwrap();
    let from = pid("a").actor("src", 0).unwrap();
    assert_eq!(a.traffic(), ControlTraffic::default());
    let sizes = [0usize, 10, 100_000];
    for (i, n) in sizes.iter().enumerate() {
        a.send(&from, &to, Generation(0), Blob(vec![i as u8; *n]))
            .await
            .unwrap();
    }
    for _ in sizes {
        recv(&mut inbox).await;
    }
    let sent = a.traffic();
    assert_eq!(sent.frames_sent, 3);
    // Each frame holds its payload (and a little more: prefix, envelope).
    let payload: usize = sizes.iter().sum();
    assert!(sent.bytes_sent as usize > payload, "{sent:?}");
    assert!((sent.bytes_sent as usize) < payload + 3 * 512, "{sent:?}");
    let got = b.traffic();
    assert_eq!(got.frames_received, 3);
    assert_eq!(got.bytes_received, sent.bytes_sent, "the same frames");
    assert_eq!((got.frames_sent, sent.frames_received), (0, 0));
    // A local delivery is not on the network.
    let local = pid("a").actor("local", 0).unwrap().port(0);
    let mut local_inbox = a.open_port(local.clone()).unwrap();
    a.send(&from, &local, Generation(0), Num(1)).await.unwrap();
    recv(&mut local_inbox).await;
    assert_eq!(a.traffic(), sent);
    assert!(a.traffic().covers(&ControlTraffic::default()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_messages_arrive_in_order_per_pair_and_locally_without_encoding() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    a.add_route(b.addr());
    let mut inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let senders: Vec<ActorId> = (0..3).map(|i| pid("a").actor("src", i).unwrap()).collect();
    for n in 0..300u64 {
        let from = &senders[(n % 3) as usize];
        a.send(from, inbox.port(), Generation(1), Num(n))
            .await
            .unwrap();
    }
    let mut last = [None::<u64>; 3];
    for _ in 0..300 {
        let d = recv(&mut inbox).await;
        assert!(!d.is_local());
        assert_eq!(d.generation, Generation(1));
        let i = d.sender.index as usize;
        let seq = d.seq;
        let Num(n) = d.decode::<Num>().unwrap();
        assert_eq!(n % 3, i as u64);
        assert!(last[i].is_none_or(|l| l < n), "FIFO per pair");
        assert_eq!(seq.0, n / 3 + 1, "sequences count from 1 per pair");
        last[i] = Some(n);
    }
    // The reply path needs no route: b learned a's address from its Hello.
    let mut back = a.open_port(senders[0].port(0)).unwrap();
    b.send(
        &pid("b").actor("sink", 0).unwrap(),
        back.port(),
        Generation(0),
        Num(7),
    )
    .await
    .unwrap();
    assert_eq!(recv(&mut back).await.decode::<Num>().unwrap(), Num(7));
    // Local: the value itself.
    let local_to = pid("a").actor("local", 0).unwrap().port(1);
    let mut local = a.open_port(local_to.clone()).unwrap();
    a.send(&senders[1], &local_to, Generation(0), Num(5))
        .await
        .unwrap();
    let d = recv(&mut local).await;
    assert!(d.is_local());
    assert_eq!(d.decode::<Num>().unwrap(), Num(5));
    // A wrong type is a typed error, not a panic.
    a.send(&senders[1], &local_to, Generation(0), Num(6))
        .await
        .unwrap();
    assert!(matches!(
        recv(&mut local).await.decode::<Blob>(),
        Err(WireError::TypeMismatch { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_sends_give_the_message_back() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    let mut events = a.take_events().unwrap();
    let from = pid("a").actor("src", 0).unwrap();
    // No route.
    let to = pid("b").actor("nobody", 0).unwrap().port(0);
    let e = a.send(&from, &to, Generation(0), Num(1)).await.unwrap_err();
    assert_eq!(e.message, Num(1));
    assert_eq!(e.failure, SendFailure::NoRoute(pid("b")));
    // No such local port.
    let e = a
        .send(
            &from,
            &pid("a").actor("x", 0).unwrap().port(0),
            Generation(0),
            Num(2),
        )
        .await
        .unwrap_err();
    assert_eq!(e.message, Num(2));
    // No such remote port: comes back as an event carrying the message.
    a.add_route(b.addr());
    a.send(&from, &to, Generation(0), Num(3)).await.unwrap();
    let TransportEvent::Undeliverable(u) = next_event(&mut events, "undeliverable", |e| {
        matches!(e, TransportEvent::Undeliverable(_))
    })
    .await
    else {
        unreachable!()
    };
    assert_eq!(u.cause, UndeliveredCause::Rejected(RejectCause::NoSuchPort));
    assert_eq!(u.envelope.receiver, to);
    assert_eq!(
        crate::wire::decode_body::<Num>(&u.envelope.payload).unwrap(),
        Num(3)
    );
    // Fenced: an old generation is refused by a fenced port.
    let inbox = b.open_port(to.clone()).unwrap();
    inbox.set_fence(Generation(5));
    a.send(&from, &to, Generation(4), Num(4)).await.unwrap();
    let TransportEvent::Undeliverable(u) = next_event(&mut events, "fenced", |e| {
        matches!(e, TransportEvent::Undeliverable(_))
    })
    .await
    else {
        unreachable!()
    };
    assert_eq!(
        u.cause,
        UndeliveredCause::Rejected(RejectCause::Fenced {
            fence: Generation(5)
        })
    );
    // Too large to frame.
    let big = Blob(vec![0; 2 << 20]);
    let e = a.send(&from, &to, Generation(5), big).await.unwrap_err();
    assert!(matches!(
        e.failure,
        SendFailure::Wire(WireError::FrameTooLarge { .. })
    ));
    assert_eq!(e.message.0.len(), 2 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_closes_its_stream_with_a_clear_error() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default().max_frame_bytes(1 << 20));
    let b = bind(&ca, "b", EndpointConfig::default().max_frame_bytes(1024));
    let mut a_events = a.take_events().unwrap();
    let mut b_events = b.take_events().unwrap();
    a.add_route(b.addr());
    let mut inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let from = pid("a").actor("src", 0).unwrap();
    a.send(&from, inbox.port(), Generation(0), Blob(vec![1; 10]))
        .await
        .unwrap();
    assert_eq!(recv(&mut inbox).await.decode::<Blob>().unwrap().0.len(), 10);
    a.send(&from, inbox.port(), Generation(0), Blob(vec![2; 4000]))
        .await
        .unwrap();
    let TransportEvent::ProtocolViolation { peer, error } =
        next_event(&mut b_events, "violation", |e| {
            matches!(e, TransportEvent::ProtocolViolation { .. })
        })
        .await
    else {
        unreachable!()
    };
    assert_eq!(peer, pid("a"));
    assert!(
        matches!(error, WireError::FrameTooLarge { max: 1024, .. }),
        "{error:?}"
    );
    let TransportEvent::Undeliverable(u) = next_event(&mut a_events, "undeliverable", |e| {
        matches!(e, TransportEvent::Undeliverable(_))
    })
    .await
    else {
        unreachable!()
    };
    let UndeliveredCause::StreamClosed(reason) = &u.cause else {
        panic!("{u}")
    };
    assert!(
        reason.contains("exceeds max_frame_bytes = 1024"),
        "{reason}"
    );
    assert!(u.envelope.payload.len() >= 4000);
    // The pair goes on with a new stream.
    a.send(&from, inbox.port(), Generation(0), Blob(vec![3; 10]))
        .await
        .unwrap();
    assert_eq!(
        recv(&mut inbox).await.decode::<Blob>().unwrap(),
        Blob(vec![3; 10])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_receiver_backs_up_only_its_own_pair() {
    let ca = ClusterCa::generate("test").unwrap();
    let small = EndpointConfig::default()
        .send_buffer_messages(NonZeroUsize::new(16).unwrap())
        .inbox_messages(NonZeroUsize::new(16).unwrap())
        .stream_window_bytes(64 << 10);
    let a = bind(&ca, "a", small.clone());
    let b = bind(&ca, "b", small);
    a.add_route(b.addr());
    let _blocked = b
        .open_port(pid("b").actor("stuck", 0).unwrap().port(0))
        .unwrap();
    let mut live = b
        .open_port(pid("b").actor("live", 0).unwrap().port(0))
        .unwrap();
    let hog = pid("a").actor("hog", 0).unwrap();
    let to_stuck = pid("b").actor("stuck", 0).unwrap().port(0);
    // Fill the stuck pair until try_send reports Full: inbox, stream window
    // and send buffer are all full.
    let blob = Blob(vec![7; 4096]);
    let full = timeout(DEADLINE, async {
        loop {
            match a.try_send(&hog, &to_stuck, Generation(0), blob.clone()) {
                Ok(()) => tokio::task::yield_now().await,
                Err(e) => break e,
            }
        }
    })
    .await
    .expect("the stuck pair fills up");
    assert_eq!(full.failure, SendFailure::Full);
    assert_eq!(full.message, blob);
    // Another pair to the same proc still flows.
    let pinger = pid("a").actor("ping", 0).unwrap();
    for n in 0..100 {
        a.send(&pinger, live.port(), Generation(0), Num(n))
            .await
            .unwrap();
        assert_eq!(recv(&mut live).await.decode::<Num>().unwrap(), Num(n));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_this_clusters_certificate_are_refused() {
    let ca = ClusterCa::generate("test").unwrap();
    let other_ca = ClusterCa::generate("other").unwrap();
    let config = EndpointConfig::default().reconnect_timeout(Duration::from_millis(500));
    let b = bind(&ca, "b", config.clone());
    let mut b_events = b.take_events().unwrap();
    let _inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let to = pid("b").actor("sink", 0).unwrap().port(0);

    // A certificate from another CA that trusts ours.
    let foreign = other_ca
        .issue(&pid("a"), Role::Proc, Validity::job())
        .unwrap();
    let (chain, key, _) = foreign.to_pem();
    let creds = ProcCredentials::from_pem(pid("a"), &chain, &key, ca.cert_pem()).unwrap();
    let a = Endpoint::bind(creds, "127.0.0.1:0".parse().unwrap(), config.clone()).unwrap();
    let mut a_events = a.take_events().unwrap();
    a.add_route(b.addr());
    a.send(&pid("a").actor("x", 0).unwrap(), &to, Generation(0), Num(1))
        .await
        .unwrap();
    let refused = next_event(&mut b_events, "refused", |e| {
        matches!(e, TransportEvent::Refused { .. })
    })
    .await;
    tracing::debug!(?refused);
    let TransportEvent::Undeliverable(u) = next_event(&mut a_events, "undeliverable", |e| {
        matches!(e, TransportEvent::Undeliverable(_))
    })
    .await
    else {
        unreachable!()
    };
    assert!(
        matches!(
            u.cause,
            UndeliveredCause::LinkFailed(LinkFailure::Refused(_))
        ),
        "{u}"
    );

    // A certificate from our CA for another identity ("mallory" claiming
    // to be "c").
    let mallory = ca
        .issue(&pid("mallory"), Role::Proc, Validity::job())
        .unwrap();
    let (chain, key, ca_pem) = mallory.to_pem();
    assert!(ProcCredentials::from_pem(pid("c"), &chain, &key, &ca_pem).is_err());
    let liar = ProcCredentials::danger_unchecked_from_pem(pid("c"), &chain, &key, &ca_pem).unwrap();
    let c = Endpoint::bind(liar, "127.0.0.1:0".parse().unwrap(), config).unwrap();
    let mut c_events = c.take_events().unwrap();
    c.add_route(b.addr());
    c.send(&pid("c").actor("x", 0).unwrap(), &to, Generation(0), Num(2))
        .await
        .unwrap();
    let TransportEvent::Refused {
        claimed, reason, ..
    } = next_event(&mut b_events, "refused identity", |e| {
        matches!(
            e,
            TransportEvent::Refused {
                claimed: Some(_),
                ..
            }
        )
    })
    .await
    else {
        unreachable!()
    };
    assert_eq!(claimed, Some(pid("c")));
    assert!(reason.contains("does not name"), "{reason}");
    let TransportEvent::LinkFailed { cause, .. } = next_event(&mut c_events, "link failed", |e| {
        matches!(e, TransportEvent::LinkFailed { .. })
    })
    .await
    else {
        unreachable!()
    };
    assert!(matches!(cause, LinkFailure::Refused(_)), "{cause:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pairs_close_and_a_new_pair_starts_fresh() {
    let ca = ClusterCa::generate("test").unwrap();
    let config = EndpointConfig::default().pair_idle_timeout(Duration::from_millis(200));
    let a = bind(&ca, "a", config.clone());
    let b = bind(&ca, "b", config);
    a.add_route(b.addr());
    let mut inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let from = pid("a").actor("src", 0).unwrap();
    for n in 0..3 {
        a.send(&from, inbox.port(), Generation(0), Num(n))
            .await
            .unwrap();
        assert_eq!(recv(&mut inbox).await.seq, Seq(n + 1));
    }
    assert_eq!(a.open_pairs(&pid("b")), 1);
    timeout(DEADLINE, async {
        while a.open_pairs(&pid("b")) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the idle pair closes");
    // A new pair (new epoch): sequence 1 again, and not taken for a
    // duplicate by the receiver.
    a.send(&from, inbox.port(), Generation(0), Num(9))
        .await
        .unwrap();
    let d = recv(&mut inbox).await;
    assert_eq!(d.seq, Seq(1));
    assert_eq!(d.decode::<Num>().unwrap(), Num(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_carry_the_verified_role_of_their_sender() {
    let ca = ClusterCa::generate("test").unwrap();
    let sink = bind_as(&ca, "sink", Role::Proc, EndpointConfig::default());
    assert_eq!(sink.role(), Role::Proc);
    let port = pid("sink").actor("rx", 0).unwrap().port(0);
    let mut inbox = sink.open_port(port.clone()).unwrap();
    for (name, role) in [
        ("ctl", Role::Controller),
        ("host", Role::HostAgent),
        ("worker", Role::Proc),
    ] {
        let from = bind_as(&ca, name, role, EndpointConfig::default());
        from.add_route(sink.addr());
        let actor = pid(name).actor("tx", 0).unwrap();
        from.send(&actor, &port, Generation(0), Num(1))
            .await
            .unwrap();
        let d = recv(&mut inbox).await;
        assert_eq!((d.sender.proc.clone(), d.sender_role), (pid(name), role));
        assert_eq!(sink.peer_role(&pid(name)), Some(role));
        // The dialer learned the listener's role from its certificate too.
        assert_eq!(from.peer_role(&pid("sink")), Some(Role::Proc));
    }
    // Local: this endpoint's own role.
    let me = pid("sink").actor("self", 0).unwrap();
    sink.send(&me, &port, Generation(0), Num(2)).await.unwrap();
    assert_eq!(recv(&mut inbox).await.sender_role, Role::Proc);
    assert_eq!(sink.peer_role(&pid("nobody")), None);
}

/// Waits for the first undeliverable event and returns its cause.
async fn undeliverable(events: &mut mpsc::Receiver<TransportEvent>) -> UndeliveredCause {
    match next_event(events, "undeliverable", |e| {
        matches!(e, TransportEvent::Undeliverable(_))
    })
    .await
    {
        TransportEvent::Undeliverable(u) => u.cause,
        _ => unreachable!("matched above"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_roleless_certificates_are_refused_both_ways() {
    let ca = ClusterCa::generate("test").unwrap();
    let config = EndpointConfig::default().reconnect_timeout(Duration::from_millis(500));
    let good = bind(&ca, "good", config.clone());
    let mut good_events = good.take_events().unwrap();
    let good_port = pid("good").actor("rx", 0).unwrap().port(0);
    let _good_inbox = good.open_port(good_port.clone()).unwrap();
    let now = std::time::SystemTime::now();
    let past = Validity::between(
        now - Duration::from_secs(7200),
        now - Duration::from_secs(3600),
    )
    .unwrap();
    let future = Validity::between(
        now + Duration::from_secs(3600),
        now + Duration::from_secs(7200),
    )
    .unwrap();
    let odd = [
        (
            "expired",
            ca.issue(&pid("expired"), Role::Controller, past).unwrap(),
            "expired",
        ),
        (
            "early",
            ca.issue(&pid("early"), Role::Controller, future).unwrap(),
            "not valid yet",
        ),
        (
            "roleless",
            ca.danger_issue_with_role_uris(&pid("roleless"), &[])
                .unwrap(),
            "no role",
        ),
    ];
    for (name, creds, why) in odd {
        let odd = bind_with(creds, config.clone());
        let mut odd_events = odd.take_events().unwrap();
        let odd_port = pid(name).actor("rx", 0).unwrap().port(0);
        let _odd_inbox = odd.open_port(odd_port.clone()).unwrap();

        // It dials: refused by the listener (TLS for a bad date, Hello for
        // no role), and its message comes back.
        odd.add_route(good.addr());
        let from = pid(name).actor("tx", 0).unwrap();
        odd.send(&from, &good_port, Generation(0), Num(1))
            .await
            .unwrap();
        let cause = undeliverable(&mut odd_events).await;
        assert!(
            matches!(cause, UndeliveredCause::LinkFailed(LinkFailure::Refused(_))),
            "{name}: {cause}"
        );
        let refused = next_event(&mut good_events, "refused", |e| {
            matches!(e, TransportEvent::Refused { .. })
        })
        .await;
        let TransportEvent::Refused { reason, .. } = refused else {
            unreachable!("matched above")
        };
        assert!(
            reason.contains(why) || reason.contains("handshake failed"),
            "{name}: {reason}"
        );

        // It is dialed: the dialer refuses its server certificate.
        good.add_route(odd.addr());
        let from = pid("good").actor("tx", 0).unwrap();
        good.send(&from, &odd_port, Generation(0), Num(2))
            .await
            .unwrap();
        let cause = undeliverable(&mut good_events).await;
        assert!(
            matches!(cause, UndeliveredCause::LinkFailed(LinkFailure::Refused(ref r)) if r.contains(why) || r.contains("invalid peer certificate")),
            "{name}: {cause}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_close_when_the_peers_certificate_expires_and_renewal_restores_them() {
    let ca = ClusterCa::generate("test").unwrap();
    let config = EndpointConfig::default().reconnect_timeout(Duration::from_secs(20));
    let b = bind(&ca, "b", config.clone());
    let mut b_events = b.take_events().unwrap();
    let mut inbox = b
        .open_port(pid("b").actor("rx", 0).unwrap().port(0))
        .unwrap();
    // a's certificate expires within a few seconds.
    let now = std::time::SystemTime::now();
    let short =
        Validity::between(now - Duration::from_secs(60), now + Duration::from_secs(3)).unwrap();
    let a = bind_with(ca.issue(&pid("a"), Role::Proc, short).unwrap(), config);
    let mut a_events = a.take_events().unwrap();
    // Certificates carry whole seconds.
    let whole =
        |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(whole(a.credentials_not_after()), whole(short.not_after()));
    a.add_route(b.addr());
    let from = pid("a").actor("tx", 0).unwrap();
    a.send(&from, inbox.port(), Generation(0), Num(1))
        .await
        .unwrap();
    assert_eq!(recv(&mut inbox).await.decode::<Num>().unwrap(), Num(1));

    // At expiry the listener closes the link, and the redial is refused.
    let failed = next_event(&mut b_events, "inbound link closed at expiry", |e| {
        matches!(
            e,
            TransportEvent::LinkFailed {
                direction: Direction::Inbound,
                ..
            }
        )
    })
    .await;
    let TransportEvent::LinkFailed { cause, .. } = failed else {
        unreachable!("matched above")
    };
    assert!(
        matches!(&cause, LinkFailure::Refused(r) if r.contains("expired")),
        "{cause:?}"
    );
    assert!(std::time::SystemTime::now() >= a.credentials_not_after());
    next_event(&mut b_events, "redial refused", |e| {
        matches!(e, TransportEvent::Refused { .. })
    })
    .await;
    a.send(&from, inbox.port(), Generation(0), Num(2))
        .await
        .unwrap();
    assert!(
        timeout(Duration::from_millis(500), inbox.recv())
            .await
            .is_err(),
        "delivered with an expired certificate"
    );

    // A renewed certificate: the kept message goes through on the next dial.
    let wrong = ca
        .issue(&pid("a"), Role::Controller, Validity::job())
        .unwrap();
    assert!(
        a.renew_credentials(wrong).is_err(),
        "a renewal may not change the role"
    );
    let renewed = ca.issue(&pid("a"), Role::Proc, Validity::job()).unwrap();
    let not_after = renewed.not_after();
    a.renew_credentials(renewed).unwrap();
    assert_eq!(a.credentials_not_after(), not_after);
    let d = recv(&mut inbox).await;
    assert_eq!(d.decode::<Num>().unwrap(), Num(2));
    while let Ok(e) = a_events.try_recv() {
        assert!(!matches!(e, TransportEvent::Undeliverable(_)), "{e:?}");
    }
}

#[test]
fn handshake_admission_retries_unvalidated_dialers_under_load_and_bounds_waiting() {
    use crate::endpoint::inbound::{Admission, admission};
    // (validated, in flight, pending) with 64 slots and 4 waiting at most.
    let decide = |validated, in_flight, pending| admission(validated, in_flight, pending, 64, 4);
    assert_eq!(decide(false, 0, 0), Admission::Accept);
    assert_eq!(decide(false, 31, 0), Admission::Accept);
    assert_eq!(decide(false, 32, 0), Admission::Retry);
    assert_eq!(decide(false, 64, 4), Admission::Retry);
    assert_eq!(decide(true, 32, 0), Admission::Accept);
    assert_eq!(decide(true, 63, 0), Admission::Accept);
    assert_eq!(decide(true, 64, 0), Admission::Wait);
    assert_eq!(decide(true, 64, 3), Admission::Wait);
    assert_eq!(decide(true, 64, 4), Admission::Refuse);
    // One slot: every unvalidated dialer is sent a Retry.
    assert_eq!(admission(false, 0, 0, 1, 1), Admission::Retry);
    assert_eq!(admission(true, 0, 0, 1, 1), Admission::Accept);
}

#[test]
fn config_durations_are_bounded() {
    let too_long = config::MAX_CONFIG_DURATION + Duration::from_secs(1);
    for config in [
        EndpointConfig::default().reconnect_timeout(too_long),
        EndpointConfig::default().pair_idle_timeout(Duration::MAX),
        EndpointConfig::default().connect_timeout(too_long),
        EndpointConfig::default()
            .failure_timeout(too_long)
            .heartbeat_interval(Duration::from_secs(1)),
        EndpointConfig::default().control_spin(config::MAX_CONTROL_SPIN + Duration::from_nanos(1)),
    ] {
        assert!(
            matches!(config.validate(), Err(Error::Config(_))),
            "{config:?}"
        );
    }
    EndpointConfig::default()
        .reconnect_timeout(config::MAX_CONFIG_DURATION)
        .control_spin(config::MAX_CONTROL_SPIN)
        .validate()
        .unwrap();
    EndpointConfig::default()
        .control_spin(Duration::ZERO)
        .validate()
        .unwrap();
}

/// A proc's members run on runtimes of their own, which end with the
/// member; the first send to a peer may come from one of them. The link it
/// opens belongs to the endpoint: it outlives that runtime, and later sends
/// to the peer, from anywhere, still arrive (they hung on a link whose
/// tasks had died with the member's runtime, and the peer saw it go silent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_opened_from_a_runtime_that_ends_outlives_it() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    a.add_route(b.addr());
    let mut inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let mut events = b.take_events().unwrap();
    let to = inbox.port().clone();
    // The first send, from a runtime that ends right after.
    let (a2, to2) = (a.clone(), to.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let from = pid("a").actor("member", 0).unwrap();
            a2.send(&from, &to2, Generation(0), Num(1)).await.unwrap();
        });
    })
    .join()
    .unwrap();
    assert_eq!(recv(&mut inbox).await.decode::<Num>().unwrap(), Num(1));
    // Longer than the failure timeout: a link without its tasks fails.
    let silent = EndpointConfig::default().failure_timeout * 2;
    tokio::time::sleep(silent).await;
    let from = pid("a").actor("other", 0).unwrap();
    timeout(DEADLINE, a.send(&from, &to, Generation(0), Num(2)))
        .await
        .expect("the send finished")
        .unwrap();
    assert_eq!(recv(&mut inbox).await.decode::<Num>().unwrap(), Num(2));
    while let Ok(e) = events.try_recv() {
        assert!(
            !matches!(e, TransportEvent::LinkFailed { .. }),
            "the link failed: {e:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_closes_its_endpoint_is_reported_shut_down_not_lost() {
    // Whoever tracks the peer's process waits for its exit report on this
    // cause (mesh routing), rather than taking the link's failure as why the
    // proc ended.
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    let mut a_events = a.take_events().unwrap();
    a.add_route(b.addr());
    let mut inbox = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let from = pid("a").actor("src", 0).unwrap();
    a.send(&from, inbox.port(), Generation(0), Num(1))
        .await
        .unwrap();
    recv(&mut inbox).await;
    b.close();
    let failed = next_event(&mut a_events, "link failed", |e| {
        matches!(
            e,
            TransportEvent::LinkFailed { .. } | TransportEvent::LinkClosed { .. }
        )
    })
    .await;
    let (TransportEvent::LinkFailed { cause, .. } | TransportEvent::LinkClosed { cause, .. }) =
        failed
    else {
        unreachable!()
    };
    assert_eq!(cause, LinkFailure::PeerShutdown);
}

/// A send that finds its pair's buffer full waits for room, then goes out
/// after what filled it, in order; one to a full local inbox the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_to_a_full_buffer_waits_for_room_and_keeps_its_place() {
    let ca = ClusterCa::generate("test").unwrap();
    let small = EndpointConfig::default()
        .send_buffer_messages(NonZeroUsize::new(16).unwrap())
        .inbox_messages(NonZeroUsize::new(16).unwrap())
        .stream_window_bytes(64 << 10);
    let a = bind(&ca, "a", small.clone());
    let b = bind(&ca, "b", small);
    a.add_route(b.addr());
    let from = pid("a").actor("src", 0).unwrap();
    let remote = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let local = a
        .open_port(pid("a").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let remote_ref = b
        .open_port(pid("b").actor("sink", 1).unwrap().port(0))
        .unwrap();
    let local_ref = a
        .open_port(pid("a").actor("sink", 1).unwrap().port(0))
        .unwrap();
    // The waiting send is a `send` to the first two, a `send_ref` (which
    // keeps only the encoded bytes while it waits) to the other two.
    for (mut inbox, by_ref) in [
        (remote, false),
        (local, false),
        (remote_ref, true),
        (local_ref, true),
    ] {
        let to = inbox.port().clone();
        // Fill the way to `to` (buffer, stream window, inbox) until a send
        // would wait, and still would at three looks 100 ms apart (acks
        // in flight free room for a while after the first refusal).
        let blob = |n: u8| Blob(vec![n; 4096]);
        let mut sent = 0u8;
        timeout(DEADLINE, async {
            let mut full_looks = 0;
            while full_looks < 3 {
                if a.try_send(&from, &to, Generation(0), blob(sent)).is_ok() {
                    sent += 1;
                    full_looks = 0;
                } else {
                    full_looks += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        })
        .await
        .expect("the way fills up");
        let last = {
            let (a, from, to) = (a.clone(), from.clone(), to.clone());
            tokio::spawn(async move {
                if by_ref {
                    a.send_ref(&from, &to, Generation(0), &blob(sent)).await
                } else {
                    a.send(&from, &to, Generation(0), blob(sent))
                        .await
                        .map_err(|e| e.failure)
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!last.is_finished(), "a send to a full buffer waits");
        // Taking what filled it makes room, and the waiting send goes last.
        for n in 0..=sent {
            let got = recv(&mut inbox).await.decode::<Blob>().unwrap();
            assert_eq!(got.0[0], n, "to {to}");
        }
        timeout(DEADLINE, last)
            .await
            .expect("the waiting send ends")
            .unwrap()
            .unwrap();
    }
}

/// The size of what `make` returns (a future, here), never called.
fn returned_size<R>(_make: impl FnOnce() -> R) -> usize {
    std::mem::size_of::<R>()
}

/// A send's future does not carry the state of a wait for room (a
/// kilobyte, on the heap only when a send must wait): callers box and move
/// it for every message.
#[test]
#[allow(unreachable_code, clippy::diverging_sub_expression)]
fn a_send_future_is_its_message_and_little_more() {
    let send = returned_size(|| {
        Endpoint::send::<Num>(
            unreachable!(),
            unreachable!(),
            unreachable!(),
            unreachable!(),
            unreachable!(),
        )
    });
    assert!(send <= 256, "a send of a Num is a {send}-byte future");
}

/// A message far larger than a send's own state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Wide(Vec<u64>, [u64; 32], [u64; 32]);
impl Message for Wide {
    const TYPE_NAME: &'static str = "regent-net-test/Wide";
}

/// `send_ref`'s future holds the message's bytes, never the message: it is
/// smaller than the message, however large that is (`send`'s must hold it,
/// to give it back on failure).
#[test]
#[allow(unreachable_code, clippy::diverging_sub_expression)]
fn a_send_ref_future_does_not_hold_its_message() {
    let by_ref = returned_size(|| {
        Endpoint::send_ref::<Wide>(
            unreachable!(),
            unreachable!(),
            unreachable!(),
            unreachable!(),
            unreachable!(),
        )
    });
    let wide = std::mem::size_of::<Wide>();
    assert!(
        by_ref < wide,
        "a send_ref of a {wide}-byte message is a {by_ref}-byte future"
    );
}

/// `send_ref` delivers what `send` does, in the same order on the same
/// pair (remote or local: a local receiver gets the encoded bytes), and
/// fails the same way, without the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_ref_delivers_and_fails_as_send_does() {
    let ca = ClusterCa::generate("test").unwrap();
    let a = bind(&ca, "a", EndpointConfig::default());
    let b = bind(&ca, "b", EndpointConfig::default());
    a.add_route(b.addr());
    let from = pid("a").actor("src", 0).unwrap();
    let mut remote = b
        .open_port(pid("b").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let mut local = a
        .open_port(pid("a").actor("sink", 0).unwrap().port(0))
        .unwrap();
    let wide = |n: u64| Wide(vec![n; 3], [n; 32], [n; 32]);
    for inbox in [&mut remote, &mut local] {
        let to = inbox.port().clone();
        for n in 0..40u64 {
            if n % 2 == 0 {
                a.send_ref(&from, &to, Generation(3), &wide(n))
                    .await
                    .unwrap();
            } else {
                a.send(&from, &to, Generation(3), wide(n)).await.unwrap();
            }
        }
        for n in 0..40u64 {
            let d = recv(inbox).await;
            assert_eq!(d.generation, Generation(3));
            assert_eq!(d.sender, from);
            if *to.proc() == pid("a") && n % 2 == 0 {
                assert!(!d.is_local(), "a local send_ref delivers bytes");
            }
            assert_eq!(d.decode::<Wide>().unwrap(), wide(n), "to {to}");
        }
    }
    // Failures: a sender of another proc, no route, no such local port, a
    // message too large to frame, a fenced local port.
    let foreign = pid("b").actor("src", 0).unwrap();
    assert_eq!(
        a.send_ref(&foreign, remote.port(), Generation(0), &Num(1))
            .await,
        Err(SendFailure::ForeignSender(pid("b")))
    );
    let nowhere = pid("c").actor("sink", 0).unwrap().port(0);
    assert_eq!(
        a.send_ref(&from, &nowhere, Generation(0), &Num(1)).await,
        Err(SendFailure::NoRoute(pid("c")))
    );
    let missing = pid("a").actor("x", 0).unwrap().port(0);
    assert_eq!(
        a.send_ref(&from, &missing, Generation(0), &Num(1)).await,
        Err(SendFailure::NoSuchPort(missing.clone()))
    );
    assert!(matches!(
        a.send_ref(&from, remote.port(), Generation(0), &Blob(vec![0; 2 << 20]))
            .await,
        Err(SendFailure::Wire(WireError::FrameTooLarge { .. }))
    ));
    local.set_fence(Generation(5));
    assert_eq!(
        a.send_ref(&from, local.port(), Generation(4), &Num(1))
            .await,
        Err(SendFailure::Fenced {
            fence: Generation(5)
        })
    );
}
