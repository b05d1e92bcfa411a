//! The mesh runtime over in-process procs: real proc runtimes, real QUIC with
//! mutual TLS, one process. Casts, calls, reductions, FIFO through the cast
//! tree, the controller's fan-out, failures reported by rank.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use regent_mesh::inproc::InProcAllocator;
use regent_mesh::{
    ActorError, ActorMesh, Max, Member, MemberError, MeshActor, MeshError, ProcMesh, Rank, Runtime,
    RuntimeConfig, Selection, Shape, Sum,
};
use serde::{Deserialize, Serialize};

/// A counter that remembers its rank and every value it was told, in order.
struct Counter {
    total: u64,
    seen: Vec<u64>,
    rank: u32,
}

#[derive(Debug, Serialize, Deserialize)]
enum Op {
    Add(u64),
    Total,
    Rank,
    /// The values added so far folded into one number that depends on their
    /// order.
    OrderHash,
    Fail,
    Sleep(u64),
}

impl MeshActor for Counter {
    const NAME: &'static str = "test/counter";
    type Args = u64;
    type Msg = Op;
    type Reply = u64;

    async fn new(member: &Member, start: u64) -> Result<Self, ActorError> {
        Ok(Self {
            total: start,
            seen: Vec::new(),
            rank: member.rank().0,
        })
    }

    async fn handle(&mut self, _: &Member, op: Op) -> Result<u64, ActorError> {
        Ok(match op {
            Op::Add(n) => {
                self.total += n;
                self.seen.push(n);
                self.total
            }
            Op::Total => self.total,
            Op::Rank => u64::from(self.rank),
            Op::OrderHash => order_hash(&self.seen),
            Op::Fail => return Err("told to fail".into()),
            Op::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                0
            }
        })
    }
}

fn order_hash(values: &[u64]) -> u64 {
    values
        .iter()
        .fold(17u64, |h, v| h.wrapping_mul(31).wrapping_add(*v))
}

regent_mesh::register_actor!(Counter);

async fn setup(
    procs: usize,
    per_proc: u32,
    config: RuntimeConfig,
) -> (Runtime, ProcMesh, ActorMesh<Counter>) {
    // These tests count and order casts; none needs a silent link noticed
    // fast, and on two shared cores (six tests and hundreds of casts at
    // once) a heartbeat may come late.
    let endpoint = regent_net::EndpointConfig {
        failure_timeout: Duration::from_secs(5),
        ..config.endpoint.clone()
    };
    let rt = Runtime::start(config.endpoint(endpoint)).await.unwrap();
    let pm = rt
        .spawn_procs(
            Arc::new(InProcAllocator::default()),
            Shape::new([("procs", procs)]).unwrap(),
        )
        .await
        .unwrap();
    let mesh = pm.spawn::<Counter>("counter", per_proc, &10).await.unwrap();
    (rt, pm, mesh)
}

/// Every member of `mesh` (started at 10) got the values of `expected`
/// (by rank) added, each once and in that order. A call is one more cast
/// of the same sender, so it reaches each member after every cast before
/// it, fire-and-forget ones included.
async fn assert_each_got_its_casts_once_in_order(mesh: &ActorMesh<Counter>, expected: &[Vec<u64>]) {
    let hashes = mesh.call(&Selection::All, &Op::OrderHash).await.unwrap();
    assert_eq!(hashes.len(), expected.len(), "{:?}", hashes.failed());
    let totals = mesh.call(&Selection::All, &Op::Total).await.unwrap();
    for ((r, h), (_, total)) in hashes.values().iter().zip(totals.values()) {
        let mine = &expected[r.index()];
        assert_eq!(
            *total,
            10 + mine.iter().sum::<u64>(),
            "rank {} did not get each of its {} casts exactly once",
            r.0,
            mine.len()
        );
        assert_eq!(
            *h,
            order_hash(mine),
            "rank {} saw its casts out of order",
            r.0
        );
    }
}

fn sel(text: &str) -> Selection {
    text.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cast_call_and_reduce_over_a_mesh() {
    let (rt, _pm, mesh) = setup(4, 4, RuntimeConfig::default()).await;
    assert_eq!(mesh.shape().to_string(), "{procs=4, actors=4}");
    mesh.cast(&Selection::All, &Op::Add(1))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let vm = mesh.call(&sel("procs=0..2"), &Op::Total).await.unwrap();
    assert!(vm.failed().is_empty());
    assert_eq!(
        vm.values().iter().map(|(r, _)| r.0).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert!(vm.values().iter().all(|(_, v)| *v == 11));
    let ranks = mesh.call(&Selection::All, &Op::Rank).await.unwrap();
    assert_eq!(ranks.len(), 16);
    for (r, v) in ranks.values() {
        assert_eq!(u64::from(r.0), *v, "each member answers for its own rank");
    }
    let sum = mesh
        .reduce::<Sum<u64>>(&Selection::All, &Op::Total)
        .await
        .unwrap();
    assert_eq!(sum.value, Some(16 * 11));
    assert_eq!(sum.contributors, 16);
    let max = mesh
        .reduce::<Max<u64>>(&Selection::All, &Op::Rank)
        .await
        .unwrap();
    assert_eq!(max.value, Some(15));
    assert_eq!(mesh.call_one(Rank(5), &Op::Rank).await.unwrap(), 5);
    // A slice touches nothing and addresses only its members.
    let second = mesh.at("procs", 1).unwrap();
    assert_eq!(second.shape().len(), 4);
    // `call_one` takes a rank of the whole mesh, from any view of it.
    assert_eq!(second.call_one(Rank(2), &Op::Rank).await.unwrap(), 2);
    assert_eq!(second.call_one(Rank(5), &Op::Rank).await.unwrap(), 5);
    assert!(matches!(
        mesh.call_one(Rank(16), &Op::Rank).await,
        Err(regent_mesh::MeshError::NoSuchRank(Rank(16)))
    ));
    let vm = second.call(&Selection::All, &Op::Rank).await.unwrap();
    assert_eq!(
        vm.values().iter().map(|(_, v)| *v).collect::<Vec<_>>(),
        vec![4, 5, 6, 7]
    );
    assert!(rt.frames_sent() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_sends_at_most_fanout_messages_per_cast() {
    let fanout = NonZeroU32::new(4).unwrap();
    let (rt, _pm, mesh) = setup(20, 2, RuntimeConfig::default().fanout(fanout)).await;
    for _ in 0..5 {
        let before = rt.frames_sent();
        mesh.cast(&Selection::All, &Op::Add(1))
            .await
            .unwrap()
            .into_result()
            .unwrap();
        let sent = rt.frames_sent() - before;
        assert!(sent <= 4, "the controller sent {sent} frames for one cast");
        assert!(sent > 0);
    }
    let all = mesh.call(&Selection::All, &Op::Total).await.unwrap();
    assert_eq!(all.len(), 40, "every member got every cast exactly once");
    assert!(all.values().iter().all(|(_, v)| *v == 15));
    // A cast to one member sends one frame down one path.
    let before = rt.frames_sent();
    mesh.cast(&sel("procs=19,actors=1"), &Op::Add(100))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(rt.frames_sent() - before, 1);
    assert_eq!(mesh.call_one(Rank(39), &Op::Total).await.unwrap(), 115);
}

/// One sender with hundreds of casts in flight at once (awaited casts and
/// fire-and-forget ones, handed over in order and only then awaited) through
/// a four-level tree (9 procs, fan-out 2): every member sees its casts in
/// the order they were sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn casts_from_one_sender_arrive_in_order_through_the_tree() {
    let fanout = NonZeroU32::new(2).unwrap();
    let (_rt, _pm, mesh) = setup(9, 2, RuntimeConfig::default().fanout(fanout)).await;
    assert!(
        regent_mesh::tree::depth(9, fanout) >= 3,
        "the tree has at least three levels below the sender"
    );
    let selections = [
        Selection::All,
        sel("procs=4..9"),
        sel("procs=8"),
        sel("procs=1..7,actors=1"),
        sel("procs=0"),
    ];
    const CASTS: u64 = 400;
    let mut expected = vec![Vec::new(); 18];
    let mut in_flight = Vec::new();
    for i in 0..CASTS {
        let s = &selections[(i % selections.len() as u64) as usize];
        for r in s.eval(&mesh.shape(), 0).unwrap() {
            expected[r.index()].push(i);
        }
        let mesh = &mesh;
        let op = Op::Add(i);
        // Every third cast does not wait for its members at all.
        let cast: futures::future::BoxFuture<'_, Result<(), String>> = if i % 3 == 2 {
            Box::pin(async move { mesh.cast_nowait(s, &op).await.map_err(|e| e.to_string()) })
        } else {
            Box::pin(async move {
                match mesh.cast(s, &op).await {
                    Ok(d) => d.into_result().map(|_| ()).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            })
        };
        in_flight.push(cast);
    }
    // Polled in the order they were made: each is handed to the caster on
    // its first poll, and only then does any of them wait.
    for (i, r) in futures::future::join_all(in_flight)
        .await
        .into_iter()
        .enumerate()
    {
        r.unwrap_or_else(|e| panic!("cast {i} failed: {e}"));
    }
    assert_each_got_its_casts_once_in_order(&mesh, &expected).await;
}

/// Nine procs of two members each, in a tree of fanout 2: four levels;
/// the controller's control plane on the test's runtime (see
/// [`on_the_tests_runtime`]).
async fn four_level_tree() -> (Runtime, ProcMesh, ActorMesh<Counter>) {
    let fanout = NonZeroU32::new(2).unwrap();
    setup(9, 2, on_the_tests_runtime().fanout(fanout)).await
}

/// The controller's control plane (its caster among it) on the runtime of
/// the test, not a thread of its own: on a current-thread runtime, what
/// the test hands over without yielding is all queued before the caster
/// runs, so it queues behind each other whatever the machine's load.
fn on_the_tests_runtime() -> RuntimeConfig {
    RuntimeConfig::default().control_thread(false)
}

/// `n` selections from `selections` in turn, in runs of 1 to `longest` of
/// each (of uneven lengths).
fn runs(selections: &[Selection], n: usize, longest: u64) -> Vec<&Selection> {
    (0u64..)
        .flat_map(|run| {
            let s = &selections[(run % selections.len() as u64) as usize];
            std::iter::repeat_n(s, 1 + (run * 37 % longest) as usize)
        })
        .take(n)
        .collect()
}

/// A flood of fire-and-forget casts from one sender, in runs to the same
/// members, through a four-level tree: casts queued behind each other go
/// down it as shared frames (the controller sends far fewer frames than
/// casts), and every member still gets each of its casts once, in the
/// order sent.
///
/// On a current-thread runtime with the caster on it, the sender hands
/// over casts until the caster's queue is full before the caster runs.
#[tokio::test(flavor = "current_thread")]
async fn fire_and_forget_casts_share_frames_and_arrive_once_in_order() {
    let (rt, _pm, mesh) = four_level_tree().await;
    let selections = [
        Selection::All,
        sel("procs=4..9"),
        sel("procs=1..7,actors=1"),
        sel("first(procs: *)"),
    ];
    const CASTS: u64 = 3_000;
    let mut expected = vec![Vec::new(); 18];
    let plan = runs(&selections, CASTS as usize, 150);
    let before = rt.frames_sent();
    for (i, s) in (0..CASTS).zip(plan) {
        for r in s.eval(&mesh.shape(), 0).unwrap() {
            expected[r.index()].push(i);
        }
        mesh.cast_nowait(s, &Op::Add(i)).await.unwrap();
    }
    let sent = rt.frames_sent() - before;
    assert_each_got_its_casts_once_in_order(&mesh, &expected).await;
    assert!(
        sent < CASTS / 4,
        "the controller sent {sent} frames for {CASTS} casts queued behind each other"
    );
}

/// Calls from one sender handed over together, in runs to the same
/// members, through a four-level tree: calls queued behind each other go
/// down it as shared frames, and each call gets its own replies — every
/// selected member's total right after that call's addition, so a reply
/// answered to a neighbour's call, or a call served out of order, shows.
///
/// On a current-thread runtime with the caster on it, every call is
/// handed over before the caster runs (`join_all` polls them all first).
#[tokio::test(flavor = "current_thread")]
async fn calls_queued_together_share_frames_and_each_gets_its_own_replies() {
    let (rt, _pm, mesh) = four_level_tree().await;
    let selections = [
        Selection::All,
        sel("procs=4..9"),
        sel("procs=1..7,actors=1"),
        sel("procs=8,actors=0"),
    ];
    const CALLS: u64 = 600;
    let plan = runs(&selections, CALLS as usize, 90);
    // What each call's members answer: their running totals (from 10).
    let mut totals = [10u64; 18];
    let mut expected = Vec::new();
    for (i, s) in (0..CALLS).zip(&plan) {
        let mut answers = Vec::new();
        for r in s.eval(&mesh.shape(), 0).unwrap() {
            totals[r.index()] += i;
            answers.push((r, totals[r.index()]));
        }
        expected.push(answers);
    }
    let before = rt.frames_sent();
    let ops: Vec<Op> = (0..CALLS).map(Op::Add).collect();
    let calls = ops.iter().zip(&plan).map(|(op, s)| mesh.call(s, op));
    let replies = futures::future::join_all(calls).await;
    let sent = rt.frames_sent() - before;
    for (i, (reply, expected)) in replies.into_iter().zip(expected).enumerate() {
        let reply = reply.unwrap().into_result().unwrap();
        assert_eq!(reply, expected, "the replies to call {i}");
    }
    assert!(
        sent < CALLS / 4,
        "the controller sent {sent} frames for {CALLS} calls queued behind each other"
    );
}

/// A member that fails in the middle of a batch of calls to it fails only
/// its own call and those queued behind it in its mailbox, each with its
/// own error, within the budget; the calls before it are answered.
#[tokio::test(flavor = "current_thread")]
async fn a_member_failing_inside_a_batch_of_calls_fails_its_call_and_those_behind_it() {
    let config = on_the_tests_runtime().call_timeout(Duration::from_secs(5));
    let (rt, _pm, mesh) = setup(2, 1, config).await;
    let at = sel("procs=1");
    let ops = [Op::Add(1), Op::Add(2), Op::Fail, Op::Add(3), Op::Add(4)];
    let before = rt.frames_sent();
    let t = std::time::Instant::now();
    let mut all = std::pin::pin!(futures::future::join_all(
        ops.iter().map(|op| mesh.call(&at, op))
    ));
    // The first poll hands every call over; the caster, on this thread,
    // then sends what it sends for them at once, before anything can come
    // back (and the member's restart send more).
    assert!(futures::poll!(&mut all).is_pending());
    while rt.frames_sent() == before {
        tokio::task::yield_now().await;
    }
    assert_eq!(rt.frames_sent() - before, 1, "the five calls share a frame");
    let replies = all.await;
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    let replies: Vec<_> = replies.into_iter().map(Result::unwrap).collect();
    assert_eq!(replies[0].values(), [(Rank(1), 11)]);
    assert_eq!(replies[1].values(), [(Rank(1), 13)]);
    assert!(
        matches!(replies[2].failed(), [(Rank(1), MemberError::Failed(m))] if m.contains("told to fail")),
        "{:?}",
        replies[2].failed()
    );
    for later in &replies[3..] {
        assert!(
            matches!(later.failed(), [(Rank(1), MemberError::NotRunning(_))]),
            "{:?}",
            later.failed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_reported_by_rank_and_nothing_hangs() {
    let config = RuntimeConfig::default().call_timeout(Duration::from_millis(1500));
    let (_rt, _pm, mesh) = setup(3, 2, config).await;
    // A handler error fails that member; the caller gets the error.
    let vm = mesh
        .call(&sel("procs=1,actors=0"), &Op::Fail)
        .await
        .unwrap();
    assert!(
        matches!(vm.failed(), [(Rank(2), MemberError::Failed(m))] if m.contains("told to fail")),
        "{:?}",
        vm.failed()
    );
    // Its mesh's supervisor (default policy: restart the member) brings it
    // back in a new generation; then every member answers.
    mesh.wait_status(Duration::from_secs(10), |_| mesh.generation().0 == 1)
        .await
        .unwrap();
    mesh.wait_status(Duration::from_secs(10), |s| {
        *s == regent_mesh::MeshStatus::Running
    })
    .await
    .unwrap();
    let vm = mesh.call(&Selection::All, &Op::Rank).await.unwrap();
    assert_eq!(vm.len(), 6, "{:?}", vm.failed());
    mesh.cast(&Selection::All, &Op::Add(1))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    // A member slower than the deadline is reported as timed out, in time.
    let t = std::time::Instant::now();
    let vm = mesh
        .call_within(
            &sel("procs=0,actors=1"),
            &Op::Sleep(5_000),
            Duration::from_millis(300),
        )
        .await
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        matches!(vm.failed(), [(Rank(1), MemberError::Timeout)]),
        "{:?}",
        vm.failed()
    );
    // A selection that does not fit is refused before anything is sent.
    assert!(matches!(
        mesh.cast(&sel("gpus=0"), &Op::Add(1)).await,
        Err(MeshError::Selection(_))
    ));
}

/// Others of the cluster tell a proc to exit and to stop the mesh's
/// members: another proc, and another controller of the same CA. The proc
/// obeys neither. Each then
/// casts (with the mesh's capability, which anyone handed a reference may
/// use) on the same (sender, receiver) stream, so once that cast has reached
/// the member, the proc has handled the commands before it: the test waits
/// for that outcome instead of sleeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_controls_a_proc() {
    use regent_mesh::protocol::{CastFrame, CastOrder, Collect, MeshInfo, ProcCommand};
    use regent_net::{
        ActorId, ActorName, Endpoint, EndpointConfig, Generation, ProcId, Role, Validity,
    };
    let (rt, _pm, mesh) = setup(2, 1, RuntimeConfig::default()).await;
    // A reference carries the mesh's info, capability included.
    let info: MeshInfo =
        postcard::from_bytes(&postcard::to_allocvec(&mesh.reference()).unwrap()).unwrap();
    let target = mesh.procs()[1].clone();
    let to = ActorId {
        proc: target.proc.clone(),
        name: ActorName::new("regent-proc").unwrap(),
        index: 0,
    }
    .port(0);
    let mut total = 10;
    for (i, (name, role)) in [
        ("intruder", Role::Proc),
        ("other-controller", Role::Controller),
    ]
    .into_iter()
    .enumerate()
    {
        let me = ProcId::new(name).unwrap();
        let endpoint = Endpoint::bind(
            rt.ca().issue(&me, role, Validity::job()).unwrap(),
            "127.0.0.1:0".parse().unwrap(),
            EndpointConfig::default(),
        )
        .unwrap();
        endpoint.add_route(target.clone());
        let actor = me.actor("x", 0).unwrap();
        let mut replies = endpoint.open_port(actor.port(1)).unwrap();
        let send = |cmd: ProcCommand| endpoint.send(&actor, &to, Generation(0), cmd);
        send(ProcCommand::Exit).await.unwrap();
        send(ProcCommand::Stop {
            call: 1,
            reply_to: replies.port().clone(),
            mesh: mesh.id(),
        })
        .await
        .unwrap();
        let add = 1000 * (i as u64 + 1);
        send(ProcCommand::Cast(CastFrame {
            mesh: info.id,
            generation: info.generation,
            token: info.token,
            origin: actor.clone(),
            order: CastOrder::NONE,
            view: info.shape.clone(),
            selection: Selection::All,
            seed: 0,
            procs: (1, 2),
            per_proc: 1,
            lost: Vec::new(),
            payload: postcard::to_allocvec(&Op::Add(add)).unwrap().into(),
            more: Vec::new(),
            reply: None,
            collect: Collect::Ack,
            budget_ms: 1000,
        }))
        .await
        .unwrap();
        total += add;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match mesh.call_one(Rank(1), &Op::Total).await {
                Ok(t) if t == total => break,
                Ok(t) => assert!(t < total, "{name}: total {t}"),
                Err(e) => panic!("{name}: the proc obeyed: {e}"),
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the cast after the commands never arrived (the proc obeyed the exit?)"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            replies.try_recv().is_none(),
            "{name}: the stop was answered"
        );
        let vm = mesh.call(&Selection::All, &Op::Rank).await.unwrap();
        assert_eq!(vm.len(), 2, "{name}: the proc obeyed: {:?}", vm.failed());
        endpoint.close();
    }
}

/// A mesh actor type this binary never registers.
struct Unregistered;

impl MeshActor for Unregistered {
    const NAME: &'static str = "test/never-registered";
    type Args = ();
    type Msg = ();
    type Reply = ();

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self)
    }

    async fn handle(&mut self, _: &Member, (): ()) -> Result<(), ActorError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawning_an_unknown_actor_type_is_a_clear_error() {
    let (_rt, pm, _mesh) = setup(1, 1, RuntimeConfig::default()).await;
    let err = pm.spawn::<Unregistered>("nope", 1, &()).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("test/never-registered") && text.contains("test/counter"),
        "the error names the type and what is registered: {text}"
    );
}
