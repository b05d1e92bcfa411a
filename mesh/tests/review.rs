//! The mesh review's guarantees over in-process procs (real proc runtimes,
//! real QUIC with mutual TLS, one process): member exits are lossless, a
//! mesh supervisor's death escalates, a slow `new` stalls nothing else on its
//! proc, gathers larger than a frame arrive whole, hostile frames are
//! refused or answered well-formed, and only a mesh's owner (or a holder of
//! its capability) reaches its members — refusals are logged. Faults that
//! need real processes are in the end-to-end suite (`tests/tests/mesh.rs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use regent_mesh::inproc::InProcAllocator;
use regent_mesh::protocol::{
    CastFrame, CastOrder, CastToken, Collect, Contribution, MAX_BATCHED_CASTS, MeshInfo,
    ProcCommand, ProcReply, ReplyBody, ReplyTo,
};
use regent_mesh::{
    ActorError, ActorMesh, Decision, FailureCause, Member, MemberError, MeshActor, MeshError,
    MeshPolicy, MeshStatus, ProcMesh, Rank, Runtime, RuntimeConfig, Selection, Shape, SpawnOptions,
};
use regent_net::{
    ActorId, ActorName, Endpoint, EndpointConfig, Generation, ProcId, Role, Validity,
};
use serde::{Deserialize, Serialize};

const DEADLINE: Duration = Duration::from_secs(30);

/// A member that remembers the marks it was sent, says who it is, fails on
/// request, answers with blobs of a given size, and may take its time to
/// start.
struct Probe {
    rank: u32,
    generation: u64,
    marks: Vec<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ProbeArgs {
    /// How long `new` blocks its thread (as tensor code does), in ms.
    new_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum P {
    Mark(u64),
    Marks,
    Whoami,
    Fail,
    /// Fail once `n` members (of this process) have been told to, all in the
    /// same instant (or after 10 s).
    FailTogether(usize),
    /// Reply with this many bytes, each the rank's low byte.
    Blob(u32),
    /// Sleep this many milliseconds (without blocking the thread), then
    /// say who you are.
    Slow(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum R {
    Ok,
    Marks(Vec<u64>),
    Me { rank: u32, generation: u64 },
    Blob(Vec<u8>),
}

impl MeshActor for Probe {
    const NAME: &'static str = "review/probe";
    type Args = ProbeArgs;
    type Msg = P;
    type Reply = R;

    async fn new(member: &Member, args: ProbeArgs) -> Result<Self, ActorError> {
        std::thread::sleep(Duration::from_millis(args.new_ms));
        Ok(Self {
            rank: member.rank().0,
            generation: member.generation().0,
            marks: Vec::new(),
        })
    }

    async fn handle(&mut self, _: &Member, msg: P) -> Result<R, ActorError> {
        Ok(match msg {
            P::Mark(m) => {
                self.marks.push(m);
                R::Ok
            }
            P::Marks => R::Marks(self.marks.clone()),
            P::Whoami => R::Me {
                rank: self.rank,
                generation: self.generation,
            },
            P::Fail => return Err(format!("rank {} told to fail", self.rank).into()),
            P::FailTogether(n) => {
                // Each member runs on a thread of its own: block it until all
                // are here.
                static WAITING: AtomicUsize = AtomicUsize::new(0);
                WAITING.fetch_add(1, Ordering::SeqCst);
                let end = Instant::now() + Duration::from_secs(10);
                while WAITING.load(Ordering::SeqCst) < n && Instant::now() < end {
                    std::thread::sleep(Duration::from_micros(200));
                }
                return Err(format!("rank {} failed with the others", self.rank).into());
            }
            P::Blob(n) => R::Blob(vec![self.rank as u8; n as usize]),
            P::Slow(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                R::Me {
                    rank: self.rank,
                    generation: self.generation,
                }
            }
        })
    }
}

regent_mesh::register_actor!(Probe);

struct Fixture {
    rt: Runtime,
    procs: ProcMesh,
}

async fn fixture(procs: usize, config: RuntimeConfig) -> Fixture {
    let rt = Runtime::start(config).await.unwrap();
    let pm = rt
        .spawn_procs(
            Arc::new(InProcAllocator::default()),
            Shape::new([("procs", procs)]).unwrap(),
        )
        .await
        .unwrap();
    Fixture { rt, procs: pm }
}

fn sel(text: &str) -> Selection {
    text.parse().unwrap()
}

fn whoami(vm: regent_mesh::ValueMesh<R>) -> Vec<(u32, u64)> {
    vm.into_result()
        .unwrap()
        .into_iter()
        .map(|(r, reply)| match reply {
            R::Me { rank, generation } => {
                assert_eq!(rank, r.0);
                (rank, generation)
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

/// The marks every member has, by rank.
async fn marks(mesh: &ActorMesh<Probe>) -> HashMap<u32, Vec<u64>> {
    let vm = mesh.call(&Selection::All, &P::Marks).await.unwrap();
    vm.into_result()
        .unwrap()
        .into_iter()
        .map(|(r, reply)| match reply {
            R::Marks(m) => (r.0, m),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// The info a mesh's procs hold, its capability included, as a reference
/// carries it (a reference serializes as the mesh's info).
fn info_of(mesh: &ActorMesh<Probe>) -> MeshInfo {
    postcard::from_bytes(&postcard::to_allocvec(&mesh.reference()).unwrap()).unwrap()
}

/// An endpoint of the cluster that is none of the mesh's: a certificate
/// from the cluster CA, with a port for answers.
struct Outsider {
    endpoint: Endpoint,
    actor: ActorId,
    replies: regent_net::Inbox,
}

impl Outsider {
    fn new(rt: &Runtime, name: &str, role: Role, procs: &[regent_net::ProcAddr]) -> Self {
        let me = ProcId::new(name).unwrap();
        let endpoint = Endpoint::bind(
            rt.ca().issue(&me, role, Validity::job()).unwrap(),
            "127.0.0.1:0".parse().unwrap(),
            EndpointConfig::default(),
        )
        .unwrap();
        for p in procs {
            endpoint.add_route(p.clone());
        }
        let actor = me.actor("outsider", 0).unwrap();
        let replies = endpoint.open_port(actor.port(1)).unwrap();
        Self {
            endpoint,
            actor,
            replies,
        }
    }

    fn reply_to(&self, call: u64) -> ReplyTo {
        ReplyTo {
            port: self.replies.port().clone(),
            call,
        }
    }

    async fn send(&self, proc: &ProcId, cmd: ProcCommand) {
        let to = ActorId {
            proc: proc.clone(),
            name: ActorName::new("regent-proc").unwrap(),
            index: 0,
        }
        .port(0);
        self.endpoint
            .send(&self.actor, &to, Generation(0), cmd)
            .await
            .unwrap();
    }

    /// The next answer, within `within`.
    async fn answer(&mut self, within: Duration) -> Option<ProcReply> {
        let delivery = tokio::time::timeout(within, self.replies.recv())
            .await
            .ok()??;
        Some(delivery.decode::<ProcReply>().unwrap())
    }
}

impl Drop for Outsider {
    fn drop(&mut self) {
        self.endpoint.close();
    }
}

/// A well-formed cast of `msg` to `selection` of the whole mesh, to the
/// subtree of proc `lo..hi`.
fn frame(info: &MeshInfo, origin: &ActorId, procs: (u32, u32), msg: &P) -> CastFrame {
    CastFrame {
        mesh: info.id,
        generation: info.generation,
        token: info.token,
        origin: origin.clone(),
        order: CastOrder::NONE,
        view: info.shape.clone(),
        selection: Selection::All,
        seed: 0,
        procs,
        per_proc: info.per_proc,
        lost: Vec::new(),
        payload: postcard::to_allocvec(msg).unwrap().into(),
        more: Vec::new(),
        reply: None,
        collect: Collect::Gather,
        budget_ms: 5000,
    }
}

/// Captures the warnings and errors of every part of this process (the
/// procs run in it), to check that refusals are logged.
mod logs {
    use std::collections::VecDeque;
    use std::fmt::Write as _;
    use std::sync::{Mutex, Once};
    use std::time::{Duration, Instant};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata};

    /// The lines kept (the oldest are dropped first).
    const KEPT: usize = 10_000;
    static LINES: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());

    struct Capture;

    struct Line(String);

    impl Visit for Line {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let _ = write!(self.0, "{}={value:?} ", field.name());
        }
    }

    impl tracing::Subscriber for Capture {
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() <= Level::WARN
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut line = Line(format!("{} ", event.metadata().level()));
            event.record(&mut line);
            let mut lines = LINES.lock().unwrap();
            lines.push_back(line.0);
            if lines.len() > KEPT {
                lines.pop_front();
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// Installs the capture (once per test binary).
    pub(super) fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| tracing::subscriber::set_global_default(Capture).unwrap());
    }

    fn matching(parts: &[&str]) -> Vec<String> {
        LINES
            .lock()
            .unwrap()
            .iter()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .cloned()
            .collect()
    }

    /// Waits until a captured line contains every one of `parts`; returns
    /// it.
    pub(super) fn wait_for(parts: &[&str], within: Duration) -> Option<String> {
        let end = Instant::now() + within;
        loop {
            let found = matching(parts).pop();
            if found.is_some() || Instant::now() >= end {
                return found;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until `n` captured lines contain every one of `parts` (or
    /// `within` passes); returns how many do.
    pub(super) fn wait_for_count(parts: &[&str], n: usize, within: Duration) -> usize {
        let end = Instant::now() + within;
        loop {
            let found = matching(parts).len();
            if found >= n || Instant::now() >= end {
                return found;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

// ---------------------------------------------------------------------------
// Member exits are lossless.

/// More members of one proc fail at once than a bounded broadcast of exits
/// would hold: every one of them is reported and restarted, none missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_members_of_one_proc_failing_at_once_are_all_restarted() {
    const PER_PROC: u32 = 96;
    let f = fixture(2, RuntimeConfig::default()).await;
    let policy = MeshPolicy::new(Decision::RestartMember).intensity(1000, Duration::from_secs(60));
    let mesh = f
        .procs
        .spawn_with::<Probe>(
            "many",
            PER_PROC,
            &ProbeArgs::default(),
            SpawnOptions::new().policy(policy),
        )
        .await
        .unwrap();
    let mut failures = mesh.failures();
    // Every member of proc 0 fails in the same instant.
    let d = mesh
        .cast(&sel("procs=0"), &P::FailTogether(PER_PROC as usize))
        .await
        .unwrap();
    assert_eq!(d.delivered(), PER_PROC);
    let mut reported = BTreeSet::new();
    let end = Instant::now() + DEADLINE;
    while reported.len() < PER_PROC as usize {
        let failure = tokio::time::timeout_at(tokio::time::Instant::from_std(end), failures.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {PER_PROC} exits reached the owner: missing {:?}",
                    reported.len(),
                    (0..PER_PROC)
                        .filter(|r| !reported.contains(r))
                        .collect::<Vec<_>>()
                )
            })
            .unwrap();
        assert!(
            matches!(failure.cause, FailureCause::Actor { .. }),
            "{failure}"
        );
        reported.extend(failure.ranks.iter().map(|r| r.0));
    }
    assert_eq!(reported, (0..PER_PROC).collect::<BTreeSet<_>>());
    // Each is restarted: every rank of proc 0 answers from a new life; those
    // of proc 1 keep their first.
    let end = Instant::now() + DEADLINE;
    loop {
        let vm = mesh.call(&Selection::All, &P::Whoami).await.unwrap();
        let stale: Vec<u32> = vm
            .values()
            .iter()
            .filter(|(r, reply)| r.0 < PER_PROC && matches!(reply, R::Me { generation: 0, .. }))
            .map(|(r, _)| r.0)
            .collect();
        if vm.is_complete() && stale.is_empty() && mesh.status() == MeshStatus::Running {
            let who = whoami(vm);
            assert!(who.iter().all(|(r, g)| *r < PER_PROC || *g == 0), "{who:?}");
            break;
        }
        assert!(
            Instant::now() < end,
            "not restarted: {stale:?}; not answering: {:?}",
            vm.failed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(f.rt.job_failure().is_none());
}

// ---------------------------------------------------------------------------
// The mesh supervisor is itself supervised.

fn panicking_hook() -> SpawnOptions {
    SpawnOptions::new().on_failure(|failure| -> Option<Decision> {
        panic!("injected supervisor panic on {}", failure.mesh)
    })
}

/// A panic in a root mesh's supervisor (here in the owner's hook, which it
/// runs) does not leave the mesh unsupervised and `Running`: it is stopped,
/// its status is final, and the failure stops the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_root_meshs_supervisor_stops_it_and_fails_the_job() {
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn_with::<Probe>("root", 1, &ProbeArgs::default(), panicking_hook())
        .await
        .unwrap();
    let _ = mesh.call(&sel("procs=1"), &P::Fail).await.unwrap();
    let report = tokio::time::timeout(DEADLINE, f.rt.wait_job_failure())
        .await
        .expect("the supervisor's death never reached the root");
    println!("job failure: {report}");
    assert_eq!(report.mesh, "root");
    assert!(
        matches!(&report.cause, FailureCause::Supervisor(m) if m.contains("injected supervisor panic on root")),
        "{report}"
    );
    let status = mesh
        .wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
    assert!(matches!(status, MeshStatus::Escalated(_)), "{status:?}");
    assert!(matches!(
        mesh.call(&Selection::All, &P::Whoami).await,
        Err(MeshError::Stopped(_))
    ));
    assert!(f.rt.live_meshes().is_empty(), "{:?}", f.rt.live_meshes());
}

/// A panic in the supervisor of a mesh owned by a member fails that member:
/// the owner's mesh restarts it (its policy), and the job goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_an_owned_meshs_supervisor_fails_its_owning_member() {
    let f = fixture(2, RuntimeConfig::default()).await;
    let top = f
        .procs
        .spawn::<Probe>("top", 1, &ProbeArgs::default())
        .await
        .unwrap();
    let mut top_failures = top.failures();
    let owned = f
        .procs
        .spawn_with::<Probe>(
            "owned",
            1,
            &ProbeArgs::default(),
            panicking_hook().owned_by(&top, Rank(1)),
        )
        .await
        .unwrap();
    let _ = owned.call(&sel("procs=0"), &P::Fail).await.unwrap();
    let status = owned
        .wait_status(DEADLINE, MeshStatus::is_done)
        .await
        .unwrap();
    let MeshStatus::Escalated(failure) = status else {
        panic!("{status:?}")
    };
    assert!(
        matches!(&failure.cause, FailureCause::Supervisor(m) if m.contains("injected supervisor panic on owned")),
        "{failure}"
    );
    let failure = tokio::time::timeout(DEADLINE, top_failures.recv())
        .await
        .expect("the owning member never failed")
        .unwrap();
    assert_eq!(failure.ranks, vec![Rank(1)]);
    let FailureCause::Escalated(inner) = &failure.cause else {
        panic!("{failure}")
    };
    assert_eq!(inner.mesh, "owned");
    assert!(
        matches!(inner.cause, FailureCause::Supervisor(_)),
        "{inner}"
    );
    top.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && top.generation().0 >= 1
    })
    .await
    .unwrap();
    assert_eq!(
        whoami(top.call(&Selection::All, &P::Whoami).await.unwrap()),
        [(0, 0), (1, 1)]
    );
    assert!(f.rt.job_failure().is_none());
}

// ---------------------------------------------------------------------------
// A slow command does not stall its proc.

/// A member whose `new` blocks for longer than the owner lease: while it
/// starts, calls to the other members of its procs go on at their usual
/// pace, the procs keep their lease, and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_start_delays_neither_casts_to_other_members_nor_lease_renewals() {
    const LEASE: Duration = Duration::from_millis(1000);
    const NEW: Duration = Duration::from_millis(4000);
    let config = RuntimeConfig::default()
        .owner_lease(LEASE)
        .call_timeout(Duration::from_secs(20));
    let Fixture { rt: _rt, procs } = fixture(2, config).await;
    let procs = Arc::new(procs);
    let fast = procs
        .spawn::<Probe>("fast", 2, &ProbeArgs::default())
        .await
        .unwrap();
    let mut failures = fast.failures();
    let slow_args = ProbeArgs {
        new_ms: NEW.as_millis() as u64,
    };
    let started = Instant::now();
    let spawning = {
        let procs = procs.clone();
        tokio::spawn(async move { procs.spawn::<Probe>("slow", 1, &slow_args).await })
    };
    let mut calls = 0;
    let mut slowest = Duration::ZERO;
    while !spawning.is_finished() {
        let t = Instant::now();
        let vm = fast.call(&Selection::All, &P::Mark(calls)).await.unwrap();
        assert_eq!(vm.len(), 4, "{:?}", vm.failed());
        slowest = slowest.max(t.elapsed());
        calls += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let slow = spawning.await.unwrap().unwrap();
    let took = started.elapsed();
    println!("{calls} calls while the slow mesh started ({took:?}); the slowest took {slowest:?}");
    assert!(took >= NEW, "the slow mesh started in {took:?}");
    assert!(calls >= 10, "only {calls} calls during the start");
    assert!(
        slowest < NEW / 4,
        "a call to the other members took {slowest:?} while a member started"
    );
    // Both meshes run, on the same procs: none was lost to a lapsed lease.
    assert_eq!(slow.procs(), fast.procs());
    assert_eq!(
        slow.call(&Selection::All, &P::Whoami).await.unwrap().len(),
        2
    );
    assert_eq!(
        fast.call(&Selection::All, &P::Whoami).await.unwrap().len(),
        4
    );
    assert!(failures.try_recv().is_err(), "a failure was reported");
    assert_eq!(fast.generation().0, 0);
}

// ---------------------------------------------------------------------------
// Large gathers.

/// A call whose replies together exceed a frame (each fits one) through a
/// tree of depth three: the replies come back whole, split into parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gather_larger_than_a_frame_arrives_whole() {
    const BLOB: u32 = 200 << 10;
    let config = RuntimeConfig::default()
        .fanout(std::num::NonZeroU32::new(2).unwrap())
        .call_timeout(Duration::from_secs(20));
    let max = config.endpoint.max_frame_bytes;
    let f = fixture(5, config).await;
    let mesh = f
        .procs
        .spawn::<Probe>("big", 4, &ProbeArgs::default())
        .await
        .unwrap();
    let members = mesh.shape().len();
    assert!(
        members * BLOB as usize > 3 * max,
        "the replies exceed a frame several times"
    );
    let t = Instant::now();
    let vm = mesh.call(&Selection::All, &P::Blob(BLOB)).await.unwrap();
    println!(
        "{members} replies of {BLOB} bytes gathered in {:?}",
        t.elapsed()
    );
    let values = vm.into_result().unwrap();
    assert_eq!(values.len(), members);
    for (rank, reply) in values {
        assert_eq!(
            reply,
            R::Blob(vec![rank.0 as u8; BLOB as usize]),
            "rank {}",
            rank.0
        );
    }
}

/// One reply larger than a frame fails at once, for its rank, with an error
/// that says so; the other members' replies arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_larger_than_a_frame_fails_at_once_with_a_clear_error() {
    let config = RuntimeConfig::default().call_timeout(Duration::from_secs(30));
    let max = config.endpoint.max_frame_bytes;
    let f = fixture(3, config).await;
    let mesh = f
        .procs
        .spawn::<Probe>("big", 2, &ProbeArgs::default())
        .await
        .unwrap();
    let t = Instant::now();
    let vm = mesh
        .call(&sel("procs=1,actors=1"), &P::Blob((2 * max) as u32))
        .await
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the call waited {:?} (its timeout is 30 s)",
        t.elapsed()
    );
    assert!(vm.is_empty());
    let [(Rank(3), MemberError::BadReply(m))] = vm.failed() else {
        panic!("{:?}", vm.failed())
    };
    assert!(
        m.contains("does not fit a frame") && m.contains(&max.to_string()),
        "{m}"
    );
    // In a call with others, only that rank fails.
    let vm = mesh
        .call(&Selection::All, &P::Blob((2 * max) as u32))
        .await
        .unwrap();
    assert_eq!(
        vm.failed().len(),
        6,
        "every reply is too large: {:?}",
        vm.failed()
    );
    let vm = mesh.call(&Selection::All, &P::Blob(1000)).await.unwrap();
    assert_eq!(vm.len(), 6, "{:?}", vm.failed());
}

// ---------------------------------------------------------------------------
// Only the owner, and holders of the capability, reach a mesh.

/// A cast from a proc of the cluster that is not one of the mesh's, without
/// the mesh's capability: no member gets it, the sender is answered that it
/// was refused, and the refusal is logged with the sender's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cast_without_the_capability_is_refused_and_logged() {
    logs::install();
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("guarded", 2, &ProbeArgs::default())
        .await
        .unwrap();
    // Another mesh's proc knows where the mesh is, not its capability.
    let mut forger = Outsider::new(&f.rt, "forger", Role::Proc, &mesh.procs());
    let info = info_of(&mesh);
    let mut forged = frame(&info, &forger.actor, (0, 2), &P::Mark(7));
    forged.token = CastToken::random();
    forged.reply = Some(forger.reply_to(1));
    forger
        .send(&mesh.procs()[0].proc, ProcCommand::Cast(forged))
        .await;
    let answer = forger
        .answer(Duration::from_secs(10))
        .await
        .expect("the forger got no answer");
    let ReplyBody::Cast(Contribution {
        values, failed, ok, ..
    }) = answer.body
    else {
        panic!("{answer:?}")
    };
    assert_eq!((values.len(), ok), (0, 0));
    assert_eq!(
        failed.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "the head answers for its whole subtree (nothing goes down the tree)"
    );
    assert!(
        failed
            .iter()
            .all(|(_, e)| matches!(e, MemberError::NotRunning(m) if m.contains("capability"))),
        "{failed:?}"
    );
    let line = logs::wait_for(&["forger", "capability"], Duration::from_secs(10))
        .expect("the refusal was not logged");
    println!("logged: {line}");
    // With the capability, the same proc's cast is delivered (the check is
    // the capability, nothing else about the frame).
    let mut genuine = frame(&info, &forger.actor, (0, 2), &P::Mark(8));
    genuine.reply = Some(forger.reply_to(2));
    forger
        .send(&mesh.procs()[0].proc, ProcCommand::Cast(genuine))
        .await;
    let answer = forger.answer(Duration::from_secs(10)).await.unwrap();
    assert!(
        matches!(&answer.body, ReplyBody::Cast(c) if c.ok == 4 && c.failed.is_empty()),
        "{answer:?}"
    );
    let got = marks(&mesh).await;
    assert!(got.values().all(|m| m == &[8]), "{got:?}");
}

/// FIFO per sender when a tree's path changes (docs/semantics.md §4.2): a
/// cast that comes after a later one of its caster is refused for its
/// whole subtree, not delivered out of order; later casts of that caster,
/// and the casts of a new caster incarnation, still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cast_after_a_later_one_of_its_caster_is_refused_not_delivered_out_of_order() {
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("ordered", 2, &ProbeArgs::default())
        .await
        .unwrap();
    let mut sender = Outsider::new(&f.rt, "sender", Role::Proc, &mesh.procs());
    let info = info_of(&mesh);
    let head = mesh.procs()[0].proc.clone();
    let mut call = 0;
    let mut cast = async |caster: u64, seq: u64, mark: u64| {
        call += 1;
        let mut fr = frame(&info, &sender.actor, (0, 2), &P::Mark(mark));
        fr.order = CastOrder { caster, seq };
        fr.reply = Some(sender.reply_to(call));
        sender.send(&head, ProcCommand::Cast(fr)).await;
        let answer = sender
            .answer(Duration::from_secs(10))
            .await
            .expect("no answer");
        match answer.body {
            ReplyBody::Cast(c) => c,
            other => panic!("{other:?}"),
        }
    };
    let delivered = |c: &Contribution| c.ok == 4 && c.failed.is_empty();
    let c = cast(9, 2, 2).await;
    assert!(delivered(&c), "{c:?}");
    let c = cast(9, 1, 1).await;
    assert_eq!(c.ok, 0, "{c:?}");
    assert_eq!(
        c.failed.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "the head refuses for its whole subtree"
    );
    assert!(
        c.failed
            .iter()
            .all(|(_, e)| matches!(e, MemberError::NotRunning(m) if m.contains("overtaken"))),
        "{c:?}"
    );
    let c = cast(9, 2, 22).await;
    assert!(!delivered(&c), "a repeated place is refused too: {c:?}");
    let c = cast(10, 1, 10).await;
    assert!(
        delivered(&c),
        "another caster incarnation has its own order: {c:?}"
    );
    let c = cast(9, 3, 3).await;
    assert!(delivered(&c), "{c:?}");
    let got = marks(&mesh).await;
    assert!(got.values().all(|m| m == &[2, 10, 3]), "{got:?}");
}

/// Commands from a proc of the cluster and from another controller of the
/// same CA (neither the owner): spawn, stop, exit. None is obeyed, each is
/// logged as refused, and the mesh runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_from_another_than_the_owner_is_refused_and_logged() {
    logs::install();
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("owned-by-rt", 1, &ProbeArgs::default())
        .await
        .unwrap();
    let info = info_of(&mesh);
    let target = mesh.procs()[1].proc.clone();
    for (name, role) in [
        ("rogue-proc", Role::Proc),
        ("rogue-controller", Role::Controller),
    ] {
        let mut rogue = Outsider::new(&f.rt, name, role, &mesh.procs());
        let mut spawn_info = info.clone();
        spawn_info.id = regent_mesh::protocol::MeshId(info.id.0 + 1000);
        spawn_info.name = format!("{name}-mesh");
        rogue
            .send(
                &target,
                ProcCommand::Spawn {
                    call: 1,
                    reply_to: rogue.replies.port().clone(),
                    info: spawn_info,
                    proc_rank: 1,
                    args: postcard::to_allocvec(&ProbeArgs::default()).unwrap().into(),
                    start: None,
                },
            )
            .await;
        rogue
            .send(
                &target,
                ProcCommand::Stop {
                    call: 2,
                    reply_to: rogue.replies.port().clone(),
                    mesh: info.id,
                },
            )
            .await;
        rogue.send(&target, ProcCommand::Exit).await;
        // A cast on the same stream: once it is answered, the proc has
        // handled the commands before it.
        let mut after = frame(&info, &rogue.actor, (1, 2), &P::Whoami);
        after.reply = Some(rogue.reply_to(3));
        rogue.send(&target, ProcCommand::Cast(after)).await;
        let answer = rogue
            .answer(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{name}: no answer: the proc obeyed the exit"));
        assert_eq!(answer.call, 3, "{name}: a command was answered: {answer:?}");
        assert!(
            matches!(&answer.body, ReplyBody::Cast(c) if c.ok == 1 && c.values.len() == 1),
            "{name}: the member is gone: {answer:?}"
        );
        let logged = logs::wait_for_count(
            &[name, "a command from another than the owner refused"],
            3,
            Duration::from_secs(10),
        );
        assert_eq!(logged, 3, "{name}: the three refusals were not logged");
        assert_eq!(f.rt.live_meshes(), ["owned-by-rt"]);
        assert_eq!(
            mesh.call(&Selection::All, &P::Whoami).await.unwrap().len(),
            2
        );
    }
}

// ---------------------------------------------------------------------------
// Hostile frames.

mod hostile {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use proptest::prelude::*;
    use regent_mesh::protocol::{MAX_BATCHED_CASTS, MAX_BUDGET_MS, MAX_PER_PROC, MAX_PROCS};

    /// Panics anywhere in this process but in this file (where other tests
    /// inject theirs on purpose): a proc that panics on a frame shows here.
    pub(super) static PANICS: AtomicUsize = AtomicUsize::new(0);

    pub(super) fn count_panics() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let here = info
                    .location()
                    .is_some_and(|l| l.file().ends_with("tests/review.rs"));
                if !here {
                    PANICS.fetch_add(1, Ordering::SeqCst);
                }
                previous(info);
            }));
        });
    }

    /// How a frame's view is made.
    #[derive(Debug, Clone)]
    pub(super) enum View {
        /// The mesh's own shape.
        Mesh,
        /// A slice of it along `procs`.
        Procs(usize, usize),
        /// Its members at one `actors` index.
        Actor(usize),
        /// A row-major shape of these sizes with the mesh's names.
        Sized(usize, usize),
        /// The mesh's layout at another offset.
        Offset(usize),
        /// A shape with other names.
        Other(usize),
    }

    #[derive(Debug, Clone)]
    pub(super) struct Hostile {
        pub(super) target: u32,
        pub(super) mesh_ok: bool,
        pub(super) generation_ok: bool,
        pub(super) token_ok: bool,
        pub(super) procs: (u32, u32),
        pub(super) per_proc: u32,
        pub(super) view: View,
        pub(super) selection: &'static str,
        pub(super) seed: u64,
        pub(super) lost: Vec<u32>,
        pub(super) budget_ms: u32,
        /// 0 ack, 1 gather, 2 a known reducer, 3 an unknown one, 4 a name
        /// over the limit.
        pub(super) collect: u8,
        pub(super) reply: bool,
        /// Casts batched behind the frame's own (the same message again).
        pub(super) more: usize,
    }

    pub(super) const SELECTIONS: &[&str] = &[
        "*",
        "none",
        "procs=0",
        "procs=1..",
        "actors=1",
        "procs=2,actors=0",
        "procs=..:2",
        "any(procs=*)",
        "first(actors:*)",
        "procs=0 | actors=1",
        "x=0",
        "procs=9",
    ];

    fn edge() -> impl Strategy<Value = u32> {
        prop_oneof![
            6 => 0u32..5,
            1 => Just(MAX_PROCS - 1),
            1 => Just(MAX_PROCS),
            1 => Just(u32::MAX),
            1 => any::<u32>(),
        ]
    }

    fn view() -> impl Strategy<Value = View> {
        prop_oneof![
            3 => Just(View::Mesh),
            2 => (0usize..4, 0usize..5).prop_map(|(a, b)| View::Procs(a, b)),
            1 => (0usize..3).prop_map(View::Actor),
            2 => (1usize..8, 1usize..5).prop_map(|(a, b)| View::Sized(a, b)),
            1 => prop_oneof![
                Just(1usize),
                Just(6),
                Just(1000),
                Just(u32::MAX as usize - 5)
            ]
            .prop_map(View::Offset),
            1 => (1usize..10).prop_map(View::Other),
        ]
    }

    pub(super) fn hostile(procs: u32) -> impl Strategy<Value = Hostile> {
        let range = prop_oneof![
            3 => (0u32..procs).prop_flat_map(move |lo| (Just(lo), lo + 1..=procs)),
            2 => (edge(), edge()),
        ];
        let per_proc = prop_oneof![
            4 => Just(2u32),
            2 => 0u32..4,
            1 => Just(MAX_PER_PROC),
            1 => Just(MAX_PER_PROC + 1),
            1 => Just(u32::MAX),
        ];
        let budget = prop_oneof![
            4 => 0u32..3000,
            1 => Just(MAX_BUDGET_MS),
            1 => Just(MAX_BUDGET_MS + 1),
            1 => Just(u32::MAX),
        ];
        let lost = proptest::collection::vec(
            prop_oneof![4 => 0u32..4, 1 => Just(MAX_PROCS), 1 => Just(u32::MAX)],
            0..3,
        );
        let ids = (
            0..procs,
            prop::bool::weighted(0.9),
            prop::bool::weighted(0.9),
            prop::bool::weighted(0.8),
        );
        (
            ids,
            range,
            per_proc,
            view(),
            proptest::sample::select(SELECTIONS),
            any::<u64>(),
            lost,
            budget,
            0u8..5,
            prop::bool::weighted(0.8),
            prop_oneof![
                6 => Just(0usize),
                3 => 1usize..4,
                1 => Just(MAX_BATCHED_CASTS - 1),
                1 => Just(MAX_BATCHED_CASTS),
            ],
        )
            .prop_map(
                |(
                    (target, mesh_ok, generation_ok, token_ok),
                    procs,
                    per_proc,
                    view,
                    selection,
                    seed,
                    lost,
                    budget_ms,
                    collect,
                    reply,
                    more,
                )| Hostile {
                    target,
                    mesh_ok,
                    generation_ok,
                    token_ok,
                    procs,
                    per_proc,
                    view,
                    selection,
                    seed,
                    lost,
                    budget_ms,
                    collect,
                    reply,
                    more,
                },
            )
    }
}

/// The view a hostile frame carries (the mesh's own shape where the
/// generated one cannot be made).
fn hostile_view(info: &MeshInfo, view: &hostile::View) -> Shape {
    use regent_mesh::shape::{DimName, Slice};
    let made = match view {
        hostile::View::Mesh => Ok(info.shape.clone()),
        hostile::View::Procs(a, b) => info.shape.slice("procs", *a..*b),
        hostile::View::Actor(i) => info.shape.at("actors", *i),
        hostile::View::Sized(a, b) => Shape::new([("procs", *a), ("actors", *b)]),
        hostile::View::Offset(offset) => {
            Slice::new(*offset, vec![3, 2], vec![2, 1]).and_then(|s| {
                Shape::from_parts(vec![DimName::new("procs")?, DimName::new("actors")?], s)
            })
        }
        hostile::View::Other(n) => Shape::new([("x", *n)]),
    };
    made.unwrap_or_else(|_| info.shape.clone())
}

/// The members a frame may reach: those of the mesh within its proc range
/// that its selection picks in its view — none unless it names the mesh,
/// its generation and its capability.
fn reachable(info: &MeshInfo, h: &hostile::Hostile, frame: &CastFrame) -> BTreeSet<u32> {
    if !(h.mesh_ok && h.generation_ok && h.token_ok) {
        return BTreeSet::new();
    }
    let Ok(selected) = frame.selection.bind(&frame.view, frame.seed) else {
        return BTreeSet::new();
    };
    let members = info.members();
    let (lo, hi) = frame.procs;
    let first = u64::from(lo) * u64::from(info.per_proc);
    let end = (u64::from(hi) * u64::from(info.per_proc)).min(u64::from(members));
    (first..end)
        .map(|r| r as u32)
        .filter(|&r| selected.contains(Rank(r)))
        .collect()
}

/// Whether the proc must take the frame (its own rules, restated): it
/// names the mesh, its generation and capability, this proc heads its
/// range, and its counts, view and selection fit the mesh.
fn must_accept(info: &MeshInfo, h: &hostile::Hostile, frame: &CastFrame) -> bool {
    use regent_mesh::protocol::{MAX_BUDGET_MS, MAX_NAME_BYTES};
    let (lo, hi) = frame.procs;
    h.mesh_ok
        && h.generation_ok
        && h.token_ok
        && lo == h.target
        && lo < hi
        && hi <= info.proc_count()
        && frame.per_proc == info.per_proc
        && frame.budget_ms <= MAX_BUDGET_MS
        && frame.lost.iter().all(|&p| p < info.proc_count())
        && frame.view.layout().max_rank() < info.members() as usize
        && !matches!(&frame.collect, Collect::Reduce(n) if n.len() > MAX_NAME_BYTES)
        && frame.more.len() < MAX_BATCHED_CASTS
        && frame.selection.bind(&frame.view, frame.seed).is_ok()
}

/// Hostile cast frames — random proc ranges, members per proc, views,
/// selections, lost procs, budgets, collections, batches, wrong meshes,
/// generations and capabilities — sent to the procs of a live mesh from another proc of
/// the cluster: no proc panics, no member outside a frame's range (or not
/// selected by it) gets it, each frame is dropped or answered, an answer
/// accounts for every member it may reach exactly once and names no other,
/// and the mesh runs on unharmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_are_refused_or_answered_and_reach_no_member_outside_them() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    const PROCS: u32 = 3;
    const SENTINEL: u64 = 1 << 40;
    hostile::count_panics();
    let f = fixture(PROCS as usize, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("target", 2, &ProbeArgs::default())
        .await
        .unwrap();
    let mut failures = mesh.failures();
    let info = info_of(&mesh);
    let procs: Vec<ProcId> = mesh.procs().iter().map(|a| a.proc.clone()).collect();
    let outsider =
        tokio::sync::Mutex::new(Outsider::new(&f.rt, "hostile", Role::Proc, &mesh.procs()));
    // The marks each member may hold (by rank), and the next case's mark.
    let allowed = std::sync::Mutex::new(HashMap::<u32, BTreeSet<u64>>::new());
    let next = std::sync::atomic::AtomicU64::new(1);
    let handle = tokio::runtime::Handle::current();
    let case = |h: hostile::Hostile| -> Result<(), TestCaseError> {
        handle.block_on(async {
            // Each case's casts answer calls from its mark on: apart.
            let mark = next.fetch_add(MAX_BATCHED_CASTS as u64, Ordering::SeqCst);
            let mut o = outsider.lock().await;
            let mut frame = frame(&info, &o.actor, h.procs, &P::Mark(mark));
            if !h.mesh_ok {
                frame.mesh = regent_mesh::protocol::MeshId(info.id.0 + 77);
            }
            if !h.generation_ok {
                frame.generation = Generation(info.generation.0 + 1);
            }
            if !h.token_ok {
                frame.token = CastToken::random();
            }
            frame.per_proc = h.per_proc;
            frame.view = hostile_view(&info, &h.view);
            frame.selection = h.selection.parse().unwrap();
            frame.seed = h.seed;
            frame.lost = h.lost.clone();
            frame.budget_ms = h.budget_ms;
            frame.collect = match h.collect {
                0 => Collect::Ack,
                1 => Collect::Gather,
                2 => Collect::Reduce("sum/u64".into()),
                3 => Collect::Reduce("review/no-such-reducer".into()),
                _ => Collect::Reduce("r".repeat(300)),
            };
            frame.reply = h.reply.then(|| o.reply_to(mark));
            frame.more = vec![frame.payload.clone(); h.more];
            let reach = reachable(&info, &h, &frame);
            let accept = must_accept(&info, &h, &frame);
            let answered = h.reply && frame.validate().is_ok();
            {
                let mut allowed = allowed.lock().unwrap();
                for &r in &reach {
                    allowed.entry(r).or_default().insert(mark);
                }
            }
            let target = &procs[h.target as usize];
            o.send(target, ProcCommand::Cast(frame.clone())).await;
            // A sentinel on the same stream: once it is answered, the proc
            // has handled the frame, and its members had it first.
            let sentinel_mark = SENTINEL + mark;
            let mut sentinel = regent_mesh_frame(&info, &o.actor, h.target, sentinel_mark);
            sentinel.reply = Some(o.reply_to(sentinel_mark));
            o.send(target, ProcCommand::Cast(sentinel)).await;
            // Each cast of the frame is answered once (several in one
            // reply, or one each), under its own call number.
            let casts = 1 + frame.more.len() as u64;
            let mut answers = std::collections::BTreeMap::new();
            let mut got_sentinel = false;
            while (answered && (answers.len() as u64) < casts) || !got_sentinel {
                let Some(reply) = o.answer(Duration::from_secs(15)).await else {
                    return Err(TestCaseError::fail(format!(
                        "no answer (casts answered: {} of {casts}, sentinel: {got_sentinel})",
                        answers.len()
                    )));
                };
                if reply.call == sentinel_mark {
                    got_sentinel = true;
                    continue;
                }
                let placed: Vec<(u64, Contribution)> = match reply.body {
                    ReplyBody::Cast(c)
                        if answered && (mark..mark + casts).contains(&reply.call) =>
                    {
                        vec![(reply.call - mark, c)]
                    }
                    ReplyBody::Casts(cs) if answered && reply.call == mark => {
                        cs.into_iter().map(|(i, c)| (u64::from(i), c)).collect()
                    }
                    body => {
                        return Err(TestCaseError::fail(format!(
                            "an unexpected answer to call {}: {body:?}",
                            reply.call
                        )));
                    }
                };
                for (i, c) in placed {
                    if i >= casts || answers.insert(i, c).is_some() {
                        return Err(TestCaseError::fail(format!(
                            "cast {i} of {casts} answered again, or outside the frame"
                        )));
                    }
                }
            }
            for c in answers.values() {
                check_answer(&info, &frame, &reach, accept, c)?;
            }
            drop(o);
            // No member outside the frame's reach got it (earlier frames'
            // marks are checked once all cases ran: a case that fails here
            // then shrinks to itself).
            let held = marks(&mesh).await;
            for (rank, marks) in &held {
                if marks.contains(&mark) && !reach.contains(rank) {
                    return Err(TestCaseError::fail(format!(
                        "rank {rank} got the frame's mark, outside its reach {reach:?}"
                    )));
                }
            }
            // A taken frame reaches every member in reach but those of the
            // procs it names lost (routed around; the head delivers to its
            // own members regardless) — within its budget.
            let routed_around = |r: u32| {
                let proc = r / info.per_proc;
                proc != h.target && frame.lost.contains(&proc)
            };
            if accept
                && h.budget_ms >= 1000
                && let Some((r, _)) = held
                    .iter()
                    .find(|(r, m)| reach.contains(r) && !routed_around(**r) && !m.contains(&mark))
            {
                return Err(TestCaseError::fail(format!(
                    "rank {r} in reach did not get mark {mark}: {held:?}"
                )));
            }
            if let Some((r, _)) = held
                .iter()
                .find(|(r, m)| routed_around(**r) && m.contains(&mark))
            {
                return Err(TestCaseError::fail(format!(
                    "rank {r} of a proc named lost got mark {mark}"
                )));
            }
            let panics = hostile::PANICS.load(Ordering::SeqCst);
            if panics > 0 {
                return Err(TestCaseError::fail(format!("{panics} panic(s)")));
            }
            Ok(())
        })
    };
    let config = Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    };
    tokio::task::block_in_place(|| {
        if let Err(e) = TestRunner::new(config).run(&hostile::hostile(PROCS), case) {
            panic!("{e}");
        }
    });
    // No member holds a mark it may not, however late it came.
    let held = marks(&mesh).await;
    let allowed = allowed.into_inner().unwrap();
    for (rank, marks) in &held {
        for m in marks.iter().filter(|&&m| m < SENTINEL) {
            assert!(
                allowed.get(rank).is_some_and(|a| a.contains(m)),
                "rank {rank} got mark {m} outside its frame"
            );
        }
    }
    // The mesh runs on: every member answers, none failed, nothing escalated.
    let vm = mesh.call(&Selection::All, &P::Whoami).await.unwrap();
    assert_eq!(whoami(vm), [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]);
    assert!(failures.try_recv().is_err(), "a member failed");
    assert!(f.rt.job_failure().is_none());
    assert_eq!(hostile::PANICS.load(Ordering::SeqCst), 0);
}

/// A valid cast of `Mark(mark)` to the subtree that `target` heads to the
/// mesh's end.
fn regent_mesh_frame(info: &MeshInfo, origin: &ActorId, target: u32, mark: u64) -> CastFrame {
    frame(info, origin, (target, info.proc_count()), &P::Mark(mark))
}

/// An answer to a hostile frame is well-formed: no rank twice; if the frame
/// was taken, it accounts for every member in reach and names no other; if
/// refused, it names only members of the frame's own claimed range that
/// the frame selects.
fn check_answer(
    info: &MeshInfo,
    frame: &CastFrame,
    reach: &BTreeSet<u32>,
    accept: bool,
    c: &Contribution,
) -> Result<(), proptest::test_runner::TestCaseError> {
    use proptest::test_runner::TestCaseError;
    let fail = |why: String| Err(TestCaseError::fail(format!("{why}: {c:?}")));
    let mut seen = BTreeSet::new();
    for r in c
        .values
        .iter()
        .map(|(r, _)| *r)
        .chain(c.failed.iter().map(|(r, _)| *r))
    {
        if !seen.insert(r) {
            return fail(format!("rank {r} answered twice"));
        }
    }
    let taken = c.ok > 0 || !c.values.is_empty();
    if taken || accept {
        if !taken && !reach.is_empty() && c.failed.iter().all(|(_, e)| {
            matches!(e, MemberError::NotRunning(m) if m.contains("refused") || m.contains("another generation"))
        }) {
            return fail("a frame the proc must take was refused".into());
        }
        // A gather names every member; an ack or a reduction names the
        // failed ones and counts the others.
        let covered = if frame.collect == Collect::Gather {
            seen == *reach
        } else {
            seen.is_subset(reach)
        };
        if !covered {
            return fail(format!(
                "the answer names {seen:?}, the frame reaches {reach:?}"
            ));
        }
        if c.ok as usize + c.failed.len() != reach.len() {
            return fail("ok and failed do not add up".into());
        }
        if frame.collect == Collect::Gather && c.values.len() != c.ok as usize {
            return fail("a gather's values do not match its count".into());
        }
        if frame.collect != Collect::Gather && !c.values.is_empty() {
            return fail("values in an answer that gathers none".into());
        }
    } else {
        let (lo, hi) = frame.procs;
        let range =
            u64::from(lo) * u64::from(frame.per_proc)..u64::from(hi) * u64::from(frame.per_proc);
        let selected = frame.selection.bind(&frame.view, frame.seed).ok();
        for &r in &seen {
            let picked = selected.as_ref().is_some_and(|s| s.contains(Rank(r)));
            if !range.contains(&u64::from(r)) || !picked {
                return fail(format!("a refusal names rank {r}, outside the frame"));
            }
        }
        let _ = info;
    }
    Ok(())
}

/// A frame for a mesh the proc does not host (or without its capability),
/// claiming the widest range the limits allow: the proc answers for it
/// without walking every rank the claim covers (or, for a claim wider than
/// it walks, not at all), and goes on serving its own meshes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_claiming_the_widest_range_does_not_stall_a_proc() {
    use regent_mesh::protocol::{MAX_PER_PROC, MAX_PROCS};
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("busy", 1, &ProbeArgs::default())
        .await
        .unwrap();
    let info = info_of(&mesh);
    let mut o = Outsider::new(&f.rt, "wide", Role::Proc, &mesh.procs());
    // A view as wide as a shape may be, too.
    let huge = Shape::new([("procs", 1 << 16), ("actors", (1 << 16) - 1)]).unwrap();
    for (i, (mesh_ok, token_ok, view)) in [
        (false, true, info.shape.clone()),
        (true, false, info.shape.clone()),
        (false, true, huge.clone()),
        (true, false, huge),
    ]
    .into_iter()
    .enumerate()
    {
        let answered = view.len() == info.shape.len();
        let mut wide = frame(&info, &o.actor, (0, MAX_PROCS), &P::Mark(1));
        wide.view = view;
        if !mesh_ok {
            wide.mesh = regent_mesh::protocol::MeshId(info.id.0 + 1);
        }
        if !token_ok {
            wide.token = CastToken::random();
        }
        wide.per_proc = MAX_PER_PROC;
        wide.reply = Some(o.reply_to(i as u64));
        let t = Instant::now();
        o.send(&mesh.procs()[0].proc, ProcCommand::Cast(wide)).await;
        // The owner's call right behind it is served at once.
        let vm = mesh.call(&Selection::All, &P::Whoami).await.unwrap();
        assert_eq!(vm.len(), 2, "case {i}: {:?}", vm.failed());
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "case {i}: the proc was stalled for {:?}",
            t.elapsed()
        );
        if answered {
            let answer = o.answer(Duration::from_secs(10)).await.unwrap();
            assert_eq!(answer.call, i as u64);
            let ReplyBody::Cast(c) = answer.body else {
                panic!("{answer:?}")
            };
            assert_eq!(
                c.failed.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
                [0, 1],
                "case {i}: only the ranks of the view are named"
            );
        }
    }
    // The unanswered ones never are: the next answer is for the next frame.
    let mut last = frame(&info, &o.actor, (0, 2), &P::Mark(2));
    last.reply = Some(o.reply_to(99));
    o.send(&mesh.procs()[0].proc, ProcCommand::Cast(last)).await;
    let answer = o.answer(Duration::from_secs(10)).await.unwrap();
    assert_eq!(answer.call, 99, "{answer:?}");
}

/// Item 17 (answers): a proc of the cluster cannot answer for another. It
/// floods the controller's reply port with forged results for every call
/// number while a real call waits; the call gets only the members' own
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_from_another_proc_than_the_one_asked_are_dropped() {
    let f = fixture(2, RuntimeConfig::default()).await;
    let mesh = f
        .procs
        .spawn::<Probe>("answered", 1, &ProbeArgs::default())
        .await
        .unwrap();
    let rogue = Outsider::new(&f.rt, "rogue-answerer", Role::Proc, &mesh.procs());
    rogue.endpoint.add_route(f.rt.addr());
    let controller_replies = ActorId {
        proc: f.rt.addr().proc.clone(),
        name: ActorName::new("regent-controller").unwrap(),
        index: 0,
    }
    .port(1);
    let call = {
        let mesh = mesh.clone();
        tokio::spawn(async move { mesh.call(&Selection::All, &P::Slow(600)).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let forged = |call: u64| ProcReply {
        call,
        body: ReplyBody::Cast(regent_mesh::protocol::Contribution {
            failed: vec![
                (0, MemberError::NotRunning("forged".into())),
                (1, MemberError::NotRunning("forged".into())),
            ],
            ..Default::default()
        }),
    };
    for n in 0..2000 {
        rogue
            .endpoint
            .send(&rogue.actor, &controller_replies, Generation(0), forged(n))
            .await
            .unwrap();
    }
    let vm = call.await.unwrap().unwrap();
    assert!(
        vm.failed()
            .iter()
            .all(|(_, e)| !e.to_string().contains("forged")),
        "a forged answer was taken: {:?}",
        vm.failed()
    );
    assert_eq!(whoami(vm).len(), 2, "both members answered themselves");
}
