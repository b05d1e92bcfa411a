//! Writes the seed corpus of every fuzz target (`fuzz/seeds/<target>/`):
//! representative valid messages, encoded by the real encoders, each checked
//! to be accepted by the decoder its target drives. Regenerate after a wire
//! format changes:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example seeds
//! ```
//!
//! It replaces every seed of a target except regression inputs (files named
//! `regress-*`, kept from crashes the fuzzer found), and prints what it
//! wrote.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use regent_mesh::alloc::{Placement, ProcBoot, ProcSignal, ProcStatus};
use regent_mesh::host::wire::{
    HostHello, HostOp, HostReply, HostRequest, ProcExited, ProcLogs, ProcReady, Ready, Renew,
    ReplyOk, RequestId, SpawnRequest,
};
use regent_mesh::protocol::{
    self, CastFrame, CastOrder, CastToken, Collect, Contribution, MemberExited, MeshChange, MeshId,
    MeshInfo, ProcCommand, ProcReply, ProcStats, ReplyBody, ReplyTo, Restart, SpawnChild,
};
use regent_mesh::relay::{Hop, RelayBody, RelayFrame, RelayOutcome, Relayed};
use regent_mesh::{Decision, FailureCause, MemberError, MeshFailure, MeshPolicy, Rank, Shape};
use regent_net::wire::{
    self, Control, Envelope, Hello, RejectCause, ToReceiver, ToSender, Welcome,
};
use regent_net::{ActorId, Generation, Incarnation, PortId, ProcAddr, ProcId, Seq, TypeTag};
use regent_rdma::RemoteBuffer;
use serde::Serialize;

/// Seeds are kept under this prefix through regeneration.
const REGRESSION_PREFIX: &str = "regress-";

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    let mut out = Seeds { root, written: 0 };
    net(&mut out);
    mesh(&mut out);
    host(&mut out);
    rdma(&mut out);
    println!("wrote {} seeds under {}", out.written, out.root.display());
}

struct Seeds {
    root: PathBuf,
    written: usize,
}

impl Seeds {
    /// Writes (or rewrites) the regression input `regress-NAME` of
    /// `target`: a crash found before, made by the encoders.
    fn regression(&mut self, target: &str, (name, bytes): (&str, Vec<u8>)) {
        let path = self
            .root
            .join(target)
            .join(format!("{REGRESSION_PREFIX}{name}"));
        std::fs::write(&path, bytes).expect("write a regression seed");
        self.written += 1;
    }

    /// Replaces the generated seeds of `target` with `seeds`.
    fn target(&mut self, target: &str, seeds: Vec<(String, Vec<u8>)>) {
        let dir = self.root.join(target);
        std::fs::create_dir_all(&dir).expect("create the seed folder");
        for entry in std::fs::read_dir(&dir).expect("list the seed folder") {
            let path = entry.expect("list the seed folder").path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if !name.starts_with(REGRESSION_PREFIX) {
                std::fs::remove_file(&path).expect("remove an old seed");
            }
        }
        for (name, bytes) in &seeds {
            assert!(!name.starts_with(REGRESSION_PREFIX));
            std::fs::write(dir.join(name), bytes).expect("write a seed");
        }
        println!("{target}: {} seeds", seeds.len());
        self.written += seeds.len();
    }
}

fn enc<T: Serialize>(value: &T) -> Vec<u8> {
    wire::encode_payload(value)
        .expect("a seed encodes")
        .to_vec()
}

fn proc(name: &str) -> ProcId {
    ProcId::new(name).expect("a valid proc id")
}

fn actor(s: &str) -> ActorId {
    s.parse().expect("a valid actor id")
}

fn port(s: &str) -> PortId {
    s.parse().expect("a valid port id")
}

fn addr(s: &str) -> ProcAddr {
    s.parse().expect("a valid proc address")
}

// --- net ----------------------------------------------------------------

fn envelope(payload: &[u8]) -> Envelope {
    Envelope {
        sender: actor("trainer-0/worker[3]"),
        receiver: port("trainer-1/worker[0]#1"),
        seq: Seq(42),
        generation: Generation(2),
        type_tag: TypeTag::from_name("regent/example/Step"),
        payload: Bytes::copy_from_slice(payload),
    }
}

fn controls() -> Vec<(&'static str, Control)> {
    vec![
        (
            "hello",
            Control::Hello(Hello {
                version: wire::PROTOCOL_VERSION,
                proc: proc("trainer-0"),
                incarnation: Incarnation(0x1234_5678_9abc_def0),
                peer: proc("trainer-1"),
                listen: Some("10.0.0.7:4433".parse().expect("an address")),
            }),
        ),
        (
            "hello-no-listen",
            Control::Hello(Hello {
                version: wire::PROTOCOL_VERSION,
                proc: proc("a"),
                incarnation: Incarnation(1),
                peer: proc("b"),
                listen: None,
            }),
        ),
        (
            "welcome",
            Control::Welcome(Welcome {
                proc: proc("trainer-1"),
                incarnation: Incarnation(7),
            }),
        ),
        (
            "refuse",
            Control::Refuse {
                reason: "protocol version 2 is not 1".into(),
            },
        ),
        ("heartbeat", Control::Heartbeat),
    ]
}

fn to_receivers() -> Vec<(&'static str, ToReceiver)> {
    vec![
        (
            "open",
            ToReceiver::Open {
                sender: actor("trainer-0/worker[3]"),
                receiver: actor("trainer-1/worker[0]"),
                pair_epoch: 9,
                first_seq: Seq(1),
            },
        ),
        ("message", ToReceiver::Message(envelope(b"step 17"))),
        ("message-empty", ToReceiver::Message(envelope(b""))),
    ]
}

fn to_senders() -> Vec<(&'static str, ToSender)> {
    vec![
        ("ack", ToSender::Ack { up_to: Seq(41) }),
        (
            "close",
            ToSender::Close {
                reason: "sequence gap".into(),
            },
        ),
        (
            "reject-no-port",
            ToSender::Reject {
                seq: Seq(3),
                cause: RejectCause::NoSuchPort,
            },
        ),
        (
            "reject-fenced",
            ToSender::Reject {
                seq: Seq(4),
                cause: RejectCause::Fenced {
                    fence: Generation(5),
                },
            },
        ),
    ]
}

/// A frame_decoder input: its limit, its chunk size, then the stream.
fn stream(max_frame_bytes: u16, chunk: u8, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut b = max_frame_bytes.to_le_bytes().to_vec();
    b.push(chunk);
    for f in frames {
        b.extend_from_slice(f);
    }
    b
}

fn net(out: &mut Seeds) {
    let controls = controls();
    let receivers = to_receivers();
    let senders = to_senders();

    let mut seeds = Vec::new();
    for (name, v) in &controls {
        seeds.push((format!("control-{name}"), enc(v)));
    }
    for (name, v) in &receivers {
        seeds.push((format!("to-receiver-{name}"), enc(v)));
    }
    for (name, v) in &senders {
        seeds.push((format!("to-sender-{name}"), enc(v)));
    }
    for (name, bytes) in &seeds {
        let ok = wire::decode_body::<Control>(bytes).is_ok()
            || wire::decode_body::<ToReceiver>(bytes).is_ok()
            || wire::decode_body::<ToSender>(bytes).is_ok();
        assert!(ok, "seed {name} does not decode");
    }
    out.target("net_protocol", seeds);

    let mut seeds = Vec::new();
    for (name, payload) in [
        ("small", &b"step 17"[..]),
        ("empty", b""),
        ("binary", &[0, 0xff, 0x80, 1]),
    ] {
        let e = envelope(payload);
        seeds.push((format!("envelope-{name}"), enc(&e)));
        assert_eq!(wire::decode_envelope(&enc(&e)), Ok(e));
    }
    for (name, v) in &receivers {
        seeds.push((format!("to-receiver-{name}"), enc(v)));
    }
    out.target("envelope_codec", seeds);

    let control_stream: Vec<Vec<u8>> = controls.iter().map(|(_, v)| frame(v)).collect();
    let data_stream: Vec<Vec<u8>> = receivers.iter().map(|(_, v)| frame(v)).collect();
    let ack_stream: Vec<Vec<u8>> = senders.iter().map(|(_, v)| frame(v)).collect();
    let mut truncated = data_stream.clone();
    if let Some(last) = truncated.last_mut() {
        last.truncate(last.len() / 2);
    }
    let oversized = vec![frame(&controls[4].1), (u32::MAX).to_le_bytes().to_vec()];
    out.target(
        "frame_decoder",
        vec![
            (
                "control-stream-whole".into(),
                stream(4096, 0, &control_stream),
            ),
            (
                "control-stream-bytewise".into(),
                stream(4096, 1, &control_stream),
            ),
            ("data-stream-chunks".into(), stream(4096, 7, &data_stream)),
            ("ack-stream".into(), stream(64, 3, &ack_stream)),
            ("data-stream-truncated".into(), stream(4096, 5, &truncated)),
            ("oversized-prefix".into(), stream(1024, 2, &oversized)),
            ("tight-limit".into(), stream(8, 0, &data_stream)),
        ],
    );
}

/// One frame (prefix included) of `value`.
fn frame<T: Serialize>(value: &T) -> Vec<u8> {
    wire::encode_frame(value, usize::MAX)
        .expect("a seed frame encodes")
        .to_vec()
}

// --- mesh ---------------------------------------------------------------

fn mesh_info(generation: u64) -> MeshInfo {
    MeshInfo {
        id: MeshId(3),
        name: "trainers".into(),
        actor_type: "regent/example/Trainer".into(),
        shape: Shape::new([("hosts", 2), ("actors", 2)]).expect("a valid shape"),
        per_proc: 2,
        procs: vec![
            addr("quic://10.0.0.1:4433/trainer-0"),
            addr("quic://10.0.0.2:4433/trainer-1"),
        ],
        fanout: NonZeroU32::new(8).expect("non-zero"),
        owner: port("controller/regent-controller[0]#2"),
        generation: Generation(generation),
        token: CastToken(0x5eed_0000_0000_0000_0000_0000_0000_0001),
    }
}

fn cast(collect: Collect, selection: &str, reply: bool) -> CastFrame {
    let info = mesh_info(1);
    CastFrame {
        mesh: info.id,
        generation: info.generation,
        origin: actor("controller/main[0]"),
        order: CastOrder {
            caster: 0x0123_4567_89ab_cdef,
            seq: 42,
        },
        view: info.shape.clone(),
        selection: selection.parse().expect("a valid selection"),
        seed: 0xdead_beef,
        procs: (0, 2),
        per_proc: info.per_proc,
        payload: Bytes::from_static(b"\x01\x02step"),
        more: Vec::new(),
        reply: reply.then(|| ReplyTo {
            port: port("controller/regent-controller[0]#1"),
            call: 11,
        }),
        collect,
        budget_ms: 5000,
        token: info.token,
        lost: vec![],
    }
}

fn change(from: u64, generation: u64) -> MeshChange {
    MeshChange {
        from: Generation(from),
        generation: Generation(generation),
        moved: vec![(1, addr("quic://10.0.0.3:4433/trainer-1b"))],
    }
}

fn restart(generation: u64) -> Restart {
    Restart {
        generation: Generation(generation),
        ranks: vec![2, 3],
        cause: FailureCause::Stopped,
        sources: vec![(2, 0), (3, 1)],
    }
}

/// A relayed command as a proc receives it (the signature is not the
/// owner's: the fuzzer reaches the checks before and after it).
fn relay(body: RelayBody) -> ProcCommand {
    let signed = wire::encode_payload(&Relayed { seq: 7, body }).expect("encodes");
    ProcCommand::Relay(RelayFrame {
        signed,
        signature: Bytes::from(vec![0u8; 64]),
        route: (0..3)
            .map(|rank| Hop {
                rank,
                addr: ProcAddr {
                    socket: "127.0.0.1:4000".parse().expect("an address"),
                    proc: proc(&format!("trainer-{rank}")),
                },
            })
            .collect(),
        fanout: 16,
        reply: Some(ReplyTo {
            port: port("controller/regent-controller[0]#1"),
            call: 9,
        }),
        budget_ms: 30_000,
    })
}

fn mesh(out: &mut Seeds) {
    let reply_to = || port("controller/regent-controller[0]#1");
    let commands = [
        (
            "spawn",
            ProcCommand::Spawn {
                call: 1,
                reply_to: reply_to(),
                info: mesh_info(0),
                proc_rank: 1,
                args: Bytes::from_static(b"args"),
                start: None,
            },
        ),
        (
            "stop",
            ProcCommand::Stop {
                call: 2,
                reply_to: reply_to(),
                mesh: MeshId(3),
            },
        ),
        (
            "respawn",
            ProcCommand::Respawn {
                call: 3,
                reply_to: reply_to(),
                mesh: MeshId(3),
                change: change(0, 1),
                ranks: vec![2, 3],
                args: Bytes::new(),
                restart: restart(1),
            },
        ),
        (
            "update",
            ProcCommand::Update {
                call: 4,
                reply_to: reply_to(),
                mesh: MeshId(3),
                change: change(1, 2),
                restart: Some(restart(2)),
            },
        ),
        (
            "cast-ack",
            ProcCommand::Cast(cast(Collect::Ack, "*", false)),
        ),
        (
            // Fire-and-forget casts batched into one frame.
            "cast-batch",
            ProcCommand::Cast(CastFrame {
                more: vec![
                    Bytes::from_static(b"\x01\x03next"),
                    Bytes::from_static(b"\x01\x04last"),
                ],
                ..cast(Collect::Ack, "hosts=1", false)
            }),
        ),
        (
            "cast-gather",
            ProcCommand::Cast(cast(Collect::Gather, "hosts=0..2, actors=1", true)),
        ),
        (
            // Calls batched into one frame: each answers its own number.
            "cast-call-batch",
            ProcCommand::Cast(CastFrame {
                more: vec![Bytes::from_static(b"\x01\x03next")],
                ..cast(Collect::Gather, "hosts=1", true)
            }),
        ),
        (
            "cast-reduce",
            ProcCommand::Cast(cast(
                Collect::Reduce("regent/sum".into()),
                "first(actors: *) | any",
                true,
            )),
        ),
        ("child-info", ProcCommand::ChildInfo { info: mesh_info(0) }),
        (
            // The most members a proc may host, on two procs: values at
            // the bounds, for mutations to push past them.
            "child-info-largest",
            ProcCommand::ChildInfo {
                info: MeshInfo {
                    shape: Shape::new([("hosts", 2), ("actors", protocol::MAX_PER_PROC as usize)])
                        .expect("a valid shape"),
                    per_proc: protocol::MAX_PER_PROC,
                    fanout: NonZeroU32::MAX,
                    generation: Generation(u64::MAX),
                    ..mesh_info(0)
                },
            },
        ),
        ("child-gone", ProcCommand::ChildGone { mesh: MeshId(4) }),
        ("renew", ProcCommand::Renew),
        ("exit", ProcCommand::Exit),
        ("relay-spawn", relay(RelayBody::Spawn {
            info: Box::new(mesh_info(0)),
            args: Bytes::from_static(b"args"),
            start: None,
        })),
        ("relay-update", relay(RelayBody::Update {
            mesh: MeshId(3),
            change: change(1, 2),
            restart: Some(restart(2)),
        })),
        ("relay-renew", relay(RelayBody::Renew)),
    ];
    let replies = [
        ("spawned", ReplyBody::Spawned(Ok(()))),
        (
            "spawn-failed",
            ReplyBody::Spawned(Err("no such actor type".into())),
        ),
        ("stopped", ReplyBody::Stopped),
        ("updated", ReplyBody::Updated),
        (
            "relayed",
            ReplyBody::Relayed(RelayOutcome {
                done: 2,
                failed: vec![(proc("trainer-2"), "proc lost".into())],
                more_failed: 0,
            }),
        ),
        ("child-spawned", ReplyBody::ChildSpawned(Ok(mesh_info(0)))),
        (
            "child-refused",
            ReplyBody::ChildSpawned(Err("no procs".into())),
        ),
        (
            "contribution",
            ReplyBody::Cast(Contribution {
                values: vec![
                    (0, Bytes::from_static(b"a")),
                    (3, Bytes::from_static(b"bc")),
                ],
                reduced: Some(Bytes::from_static(b"\x07")),
                failed: vec![
                    (1, MemberError::Timeout),
                    (2, MemberError::Panicked("index out of bounds".into())),
                ],
                ok: 2,
            }),
        ),
        (
            // The results of two calls of one batch, together.
            "contributions",
            ReplyBody::Casts(vec![
                (
                    0,
                    Contribution {
                        values: vec![(4, Bytes::from_static(b"a"))],
                        ok: 1,
                        ..Contribution::default()
                    },
                ),
                (
                    2,
                    Contribution {
                        failed: vec![(4, MemberError::Timeout)],
                        ..Contribution::default()
                    },
                ),
            ]),
        ),
    ];
    let failure = MeshFailure {
        mesh: "inner".into(),
        ranks: vec![Rank(0), Rank(5)],
        cause: FailureCause::ProcExited {
            proc: proc("trainer-1"),
            status: ProcStatus::Signal(9),
            last_lines: Vec::new(),
        },
        generation: Generation(4),
    };
    let causes = [
        (
            "actor-panicked",
            FailureCause::Actor {
                message: "boom".into(),
                panicked: true,
            },
        ),
        ("stopped", FailureCause::Stopped),
        ("start-failed", FailureCause::StartFailed("bad args".into())),
        (
            "proc-exited",
            FailureCause::ProcExited {
                proc: proc("trainer-1"),
                status: ProcStatus::Code(1),
                last_lines: vec![regent_mesh::logs::LogLine {
                    proc: proc("trainer-1"),
                    stream: regent_mesh::logs::LogStream::Stderr,
                    text: "thread 'main' panicked".into(),
                }],
            },
        ),
        (
            "host-lost",
            FailureCause::HostLost {
                host: "node-7".into(),
                proc: proc("trainer-1"),
            },
        ),
        (
            "link-failed",
            FailureCause::LinkFailed {
                proc: proc("trainer-0"),
                detail: "silent for 3 s".into(),
            },
        ),
        ("escalated", FailureCause::Escalated(Box::new(failure))),
    ];
    let policies = [
        ("restart-member", MeshPolicy::default()),
        (
            "restart-mesh-backoff",
            MeshPolicy::new(Decision::RestartMesh).backoff(regent_supervisor::Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(5),
                reset_after: Duration::from_secs(30),
            }),
        ),
        (
            "escalate",
            MeshPolicy::new(Decision::Escalate).intensity(0, Duration::from_secs(1)),
        ),
    ];

    let mut seeds = Vec::new();
    for (name, c) in &commands {
        let bytes = enc(c);
        assert!(
            protocol::fuzz_decode_command(&bytes).is_some(),
            "command {name}"
        );
        seeds.push((format!("command-{name}"), bytes));
    }
    for (i, (name, body)) in replies.into_iter().enumerate() {
        let bytes = enc(&ProcReply {
            call: 100 + i as u64,
            body,
        });
        assert!(
            protocol::fuzz_decode_reply(&bytes).is_some(),
            "reply {name}"
        );
        seeds.push((format!("reply-{name}"), bytes));
    }
    for (i, (name, cause)) in causes.into_iter().enumerate() {
        let bytes = enc(&MemberExited {
            mesh: MeshId(3),
            rank: i as u32,
            generation: Generation(1),
            cause,
        });
        assert!(
            protocol::fuzz_decode_member_exited(&bytes).is_some(),
            "exit {name}"
        );
        seeds.push((format!("member-exited-{name}"), bytes));
    }
    for (name, policy) in policies {
        let bytes = enc(&SpawnChild {
            call: 7,
            reply_to: port("trainer-0/regent-proc[0]#1"),
            parent: MeshId(3),
            rank: 2,
            born: Generation(1),
            name: "inner".into(),
            actor_type: "regent/example/Worker".into(),
            per_proc: 4,
            args: Bytes::from_static(b"{}"),
            policy: policy.into(),
        });
        assert!(
            protocol::fuzz_decode_spawn_child(&bytes).is_some(),
            "spawn child {name}"
        );
        seeds.push((format!("spawn-child-{name}"), bytes));
    }
    for (name, stats) in proc_stats_seeds() {
        let bytes = enc(&stats);
        assert_eq!(
            protocol::fuzz_decode_proc_stats(&bytes),
            Some(stats),
            "proc stats {name}"
        );
        seeds.push((format!("proc-stats-{name}"), bytes));
    }
    out.target("mesh_protocol", seeds);
}

/// A proc's traffic report: nothing moved yet, and a busy proc (counts of
/// every width a varint takes).
fn proc_stats_seeds() -> [(&'static str, ProcStats); 2] {
    let busy = ProcStats {
        control: regent_net::ControlTraffic {
            frames_sent: 1,
            bytes_sent: 300,
            frames_received: 70_000,
            bytes_received: 1 << 40,
        },
        payload: regent_rdma::Traffic {
            shm: regent_rdma::BackendTraffic {
                read_bytes: 108_000 * 300,
                reads: 600,
                written_bytes: 0,
                writes: 0,
            },
            tcp: regent_rdma::BackendTraffic {
                read_bytes: u64::MAX,
                reads: 1,
                written_bytes: 4 << 20,
                writes: 2,
            },
            ibverbs: regent_rdma::BackendTraffic::default(),
        },
    };
    [("none", ProcStats::default()), ("busy", busy)]
}

// --- host agent ---------------------------------------------------------

fn host(out: &mut Seeds) {
    let owner_proc = proc("controller");
    // The PEM fields are opaque strings to the decoder; short ones keep the
    // seeds small.
    let boot = ProcBoot {
        proc: proc("trainer-0"),
        ca_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
        cert_pem: "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n".into(),
        key_pem: "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n".into(),
        bind: "0.0.0.0:0".parse().expect("an address"),
        parent: addr("quic://10.0.0.1:5000/host-0"),
        owner: ProcAddr {
            socket: "10.0.0.9:4433".parse().expect("an address"),
            proc: owner_proc.clone(),
        },
        owner_lease: Duration::from_secs(30),
        endpoint: regent_net::EndpointConfig::default(),
        placement: Placement::default().env("CUDA_VISIBLE_DEVICES", "1"),
        owner_key: None,
    };
    let requests = [
        (
            "spawn",
            HostOp::Spawn(Box::new(SpawnRequest {
                boot: boot.clone(),
                program: Some("/usr/bin/regent".into()),
                args: vec!["proc".into(), "--verbose".into()],
                env: vec![("RUST_LOG".into(), "info".into())],
                lease: Duration::from_millis(10_500),
            })),
        ),
        (
            "spawn-default-program",
            HostOp::Spawn(Box::new(SpawnRequest {
                boot: boot.clone(),
                program: None,
                args: vec![],
                env: vec![],
                lease: Duration::from_secs(60),
            })),
        ),
        (
            "stop",
            HostOp::Stop {
                proc: proc("trainer-0"),
                grace: Duration::from_secs(5),
            },
        ),
        (
            "signal",
            HostOp::Signal {
                proc: proc("trainer-0"),
                signal: ProcSignal::Kill,
            },
        ),
        ("shutdown", HostOp::Shutdown),
    ];
    let mut seeds = Vec::new();
    for (i, (name, op)) in requests.into_iter().enumerate() {
        let bytes = enc(&HostRequest {
            id: RequestId(i as u64 + 1),
            op,
        });
        assert!(
            wire::decode_body::<HostRequest>(&bytes).is_ok(),
            "request {name}"
        );
        seeds.push((format!("request-{name}"), bytes));
    }
    // A crash CI's fuzzing found: a boot whose owner lease overflowed a
    // deadline decoded. It must not decode.
    let mut long_boot = boot.clone();
    long_boot.owner_lease = Duration::from_secs(8_061_518_342);
    let bytes = enc(&HostRequest {
        id: RequestId(9),
        op: HostOp::Spawn(Box::new(SpawnRequest {
            boot: long_boot,
            program: None,
            args: vec![],
            env: vec![],
            lease: Duration::from_secs(60),
        })),
    });
    assert!(wire::decode_body::<HostRequest>(&bytes).is_err());
    let regression = ("owner-lease-overflows-deadline", bytes);
    let endpoint = addr("quic://10.0.0.2:4433/trainer-0");
    seeds.extend([
        (
            "ready".to_owned(),
            enc(&Ready {
                addr: endpoint.clone(),
                pid: 4242,
            }),
        ),
        (
            "renew".to_owned(),
            enc(&Renew {
                lease: Duration::from_millis(2500),
            }),
        ),
        (
            "reply-spawned".to_owned(),
            enc(&HostReply {
                id: RequestId(1),
                outcome: Ok(ReplyOk::Spawned { pid: 4242 }),
            }),
        ),
        (
            "reply-done".to_owned(),
            enc(&HostReply {
                id: RequestId(3),
                outcome: Ok(ReplyOk::Done),
            }),
        ),
        (
            "reply-refused".to_owned(),
            enc(&HostReply {
                id: RequestId(2),
                outcome: Err("proc trainer-0 belongs to another owner".into()),
            }),
        ),
        (
            "proc-ready".to_owned(),
            enc(&ProcReady {
                proc: proc("trainer-0"),
                addr: endpoint.clone(),
                pid: 4242,
            }),
        ),
        (
            "proc-exited".to_owned(),
            enc(&ProcExited {
                proc: proc("trainer-0"),
                pid: 4242,
                status: ProcStatus::Code(0),
                last_lines: Vec::new(),
            }),
        ),
        (
            "proc-logs".to_owned(),
            enc(&ProcLogs {
                lines: vec![regent_mesh::logs::LogLine {
                    proc: proc("trainer-0"),
                    stream: regent_mesh::logs::LogStream::Stdout,
                    text: "[train r0 g1] loss 1.23".into(),
                }],
                dropped: 2,
            }),
        ),
        (
            "hello".to_owned(),
            enc(&HostHello {
                addr: addr("quic://[fd00::1]:5000/host-3"),
                pid: 77,
                hostname: "node-3".into(),
            }),
        ),
    ]);
    out.target("host_wire", seeds);
    out.regression("host_wire", regression);
}

// --- rdma ---------------------------------------------------------------

/// A handle built through its validating deserializer, from JSON text (its
/// constructor is the crate's own; ids deserialize from borrowed text only).
fn handle(fields: serde_json::Value) -> RemoteBuffer {
    serde_json::from_str(&fields.to_string()).expect("a valid handle")
}

fn rdma(out: &mut Seeds) {
    let base = |shm: serde_json::Value, tcp: serde_json::Value, verbs: serde_json::Value| {
        serde_json::json!({
            "owner": "trainer-0",
            "id": 7,
            "len_bytes": 4096,
            "host": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            "token": [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
            "shm": shm,
            "tcp": tcp,
            "verbs": verbs,
        })
    };
    let null = serde_json::Value::Null;
    let shm = serde_json::json!({"pid": 4242, "fd": 5});
    let tcp4 = serde_json::json!({"addr": "10.0.0.1:7000"});
    let tcp6 = serde_json::json!({"addr": "[fd00::1]:7000"});
    let verbs = serde_json::json!({"addr": 0x7f00_0000_0000u64, "rkey": 0x1234});
    let handles = [
        ("shm-tcp", base(shm.clone(), tcp4.clone(), null.clone())),
        ("shm", base(shm.clone(), null.clone(), null.clone())),
        ("tcp6", base(null.clone(), tcp6, null.clone())),
        ("tcp-verbs", base(null.clone(), tcp4.clone(), verbs.clone())),
        ("all", base(shm, tcp4.clone(), verbs)),
    ];
    // A handle at the bounds (the largest buffer, pid and fd; a verbs
    // region ending at the top of the address space), for mutations to push
    // past them.
    let mut largest = base(
        serde_json::json!({"pid": 1 << 22, "fd": 1 << 24}),
        tcp4,
        serde_json::json!({"addr": u64::MAX - (1u64 << 40), "rkey": u32::MAX}),
    );
    largest["len_bytes"] = (1u64 << 40).into();
    largest["id"] = u64::MAX.into();
    let handles = handles.into_iter().chain([("largest", largest)]);
    let mut seeds = Vec::new();
    for (name, fields) in handles {
        let h = handle(fields);
        let bytes = h.encode();
        assert_eq!(RemoteBuffer::decode(&bytes).ok(), Some(h), "handle {name}");
        seeds.push((format!("handle-{name}"), bytes));
    }
    out.target("rdma_handle", seeds);

    // The headers' layout (rdma/src/tcp/wire.rs): each seed is checked to
    // decode and encode back to itself.
    let request = |op: u8, len: u32, buffer: u64, offset: u64, window: u32| {
        let mut b = [0u8; 44];
        b[0] = op;
        b[4..8].copy_from_slice(&len.to_le_bytes());
        b[8..16].copy_from_slice(&buffer.to_le_bytes());
        b[16..24].copy_from_slice(&offset.to_le_bytes());
        b[24..40].copy_from_slice(&[9; 16]);
        b[40..44].copy_from_slice(&window.to_le_bytes());
        b
    };
    let response = |status: u8, len: u32| {
        let mut b = [0u8; 8];
        b[0] = status;
        b[4..8].copy_from_slice(&len.to_le_bytes());
        b
    };
    let mut seeds = Vec::new();
    for (name, b) in [
        ("request-read", request(1, 4096, 7, 0, 0)),
        ("request-write", request(2, 1 << 20, 7, 1 << 30, 0)),
        (
            "request-write-windowed",
            request(2, 4096, 7, 64, 0x0102_0304),
        ),
        ("request-verbs-connect", request(3, 32, 0, 0, 0)),
    ] {
        assert_eq!(regent_rdma::fuzz_tcp_request(&b), Some(b), "{name}");
        seeds.push((name.to_owned(), b.to_vec()));
    }
    for (name, b) in [
        ("response-ok", response(0, 4096)),
        ("response-unknown-buffer", response(1, 0)),
        ("response-failed", response(5, 0)),
    ] {
        assert_eq!(regent_rdma::fuzz_tcp_response(&b), Some(b), "{name}");
        seeds.push((name.to_owned(), b.to_vec()));
    }
    out.target("rdma_tcp_headers", seeds);

    // Sealed frames (rdma/src/tcp/sealed.rs) of the fuzzing key: a request
    // and a response header as their connections send them, and a piece of
    // data; each is checked to open to its payload.
    let mut seeds = Vec::new();
    for (name, payload) in [
        ("frame-request", request(1, 4096, 7, 0, 0).to_vec()),
        ("frame-response", response(0, 4096).to_vec()),
        (
            "frame-data",
            (0..4096u32).map(|i| i as u8).collect::<Vec<u8>>(),
        ),
    ] {
        let wire = regent_rdma::fuzz_tcp_seal(&payload).expect("a frame");
        assert_eq!(regent_rdma::fuzz_tcp_open(&wire), Some(payload), "{name}");
        seeds.push((name.to_owned(), wire));
    }
    out.target("rdma_tcp_frames", seeds);
}
