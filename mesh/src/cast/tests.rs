//! The caster's credit for fire-and-forget casts, against a fabric that
//! records the frames a caster sends and answers only when the test says.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use regent_net::{ActorId, ActorName, Generation, PortId, ProcAddr, ProcId};

use super::{Caster, NOWAIT_PROBE_EVERY, NOWAIT_PROBES, frame, node};
use crate::entropy::Entropy;
use crate::fabric::{Fabric, LostProcs, Pending, SendProblem, proc_port};
use crate::protocol::{
    CastFrame, CastToken, Collect, Contribution, MeshId, MeshInfo, ProcCommand, ProcReply,
    ReplyBody, names,
};
use crate::selection::Selection;
use crate::shape::Shape;

/// A proc that takes every frame at once and answers none by itself.
struct Recorder {
    me: ProcId,
    /// The one proc of the mesh.
    peer: ProcId,
    lost: LostProcs,
    frames: Mutex<Vec<CastFrame>>,
}

impl Fabric for Recorder {
    fn command(
        &self,
        _: &MeshInfo,
        _: u32,
        cmd: ProcCommand,
        _: tokio::time::Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        if let ProcCommand::Cast(frame) = cmd {
            self.frames.lock().unwrap().push(frame);
        }
        async { Ok(()) }.boxed()
    }

    fn send_to(
        &self,
        _: &ProcAddr,
        _: ProcCommand,
        _: tokio::time::Instant,
    ) -> BoxFuture<'_, Result<(), SendProblem>> {
        async { Err(SendProblem::Other("no relays here".into())) }.boxed()
    }

    fn reply(&self, _: PortId, _: ProcReply) -> BoxFuture<'_, ()> {
        async {}.boxed()
    }

    fn reply_port(&self) -> PortId {
        proc_port(&self.me, names::REPLY_PORT)
    }

    fn proc(&self) -> &ProcId {
        &self.me
    }

    fn lost(&self) -> &LostProcs {
        &self.lost
    }
}

fn info(proc: &ProcId) -> Arc<MeshInfo> {
    Arc::new(MeshInfo {
        id: MeshId(1),
        name: "m".into(),
        actor_type: "t".into(),
        shape: Shape::new([("procs", 1)]).unwrap(),
        per_proc: 1,
        procs: vec![ProcAddr {
            socket: SocketAddr::from(([127, 0, 0, 1], 0)),
            proc: proc.clone(),
        }],
        fanout: NonZeroU32::new(16).unwrap(),
        owner: ActorId {
            proc: ProcId::new("controller").unwrap(),
            name: ActorName::new("controller").unwrap(),
            index: 0,
        }
        .port(1),
        generation: Generation(0),
        token: CastToken::random(),
    })
}

/// A caster (its casts' seeds from `seed`) sending through a recording
/// fabric to a mesh of one proc, and the calls it waits on.
fn recorded_caster(seed: u64) -> (Arc<Recorder>, Arc<Pending>, Caster) {
    let me = ProcId::new("controller").unwrap();
    let fabric = Arc::new(Recorder {
        me: me.clone(),
        peer: ProcId::new("p0").unwrap(),
        lost: LostProcs::default(),
        frames: Mutex::new(Vec::new()),
    });
    let pending = Arc::new(Pending::default());
    let origin = ActorId {
        proc: me,
        name: ActorName::new("controller").unwrap(),
        index: 0,
    };
    let caster = Caster::start(
        fabric.clone(),
        pending.clone(),
        origin,
        Arc::new(Entropy::seeded(seed)),
    );
    (fabric, pending, caster)
}

/// A call of `i` to every member of the mesh of `info`, from `caster`.
fn gather(info: &MeshInfo, caster: &Caster, i: u64) -> node::Bound {
    frame(
        info,
        None,
        caster,
        &Selection::All,
        &i,
        Collect::Gather,
        Duration::from_secs(60),
    )
    .unwrap()
}

/// Lets the caster's task run until it waits for something.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A proc that falls behind cannot make a sender's fire-and-forget casts
/// pile up past what it queues for a mesh: every 256th goes out
/// acknowledged, and with two of those unanswered the caster sends no more
/// until the older is answered; then the next batch goes, and every cast
/// goes out once, in order.
#[tokio::test(start_paused = true)]
async fn fire_and_forget_casts_wait_for_credit_from_the_slowest_proc() {
    let (fabric, pending, caster) = recorded_caster(7);
    let proc = fabric.peer.clone();
    let caster = Arc::new(caster);
    let info = info(&fabric.peer);
    let casts = 2_000u64;
    let sender = {
        let caster = caster.clone();
        let info = info.clone();
        tokio::spawn(async move {
            for i in 0..casts {
                let f = frame(
                    &info,
                    None,
                    &caster,
                    &Selection::All,
                    &i,
                    Collect::Ack,
                    Duration::from_secs(60),
                )
                .unwrap();
                caster.cast(info.clone(), f, false).await.unwrap();
            }
        })
    };
    let window = (NOWAIT_PROBES as u64 + 1) * NOWAIT_PROBE_EVERY;
    // Casts, not frames: casts queued behind each other share a frame.
    let sent = || {
        fabric
            .frames
            .lock()
            .unwrap()
            .iter()
            .map(|f| 1 + f.more.len() as u64)
            .sum::<u64>()
    };
    settle().await;
    assert_eq!(
        sent(),
        window - 1,
        "the caster stops before the probe that would be the third unanswered"
    );
    // Answer the probes one by one: each answer lets one more batch go.
    let mut answered = 0;
    while sent() < casts {
        let frames = fabric.frames.lock().unwrap().clone();
        let probes: Vec<&CastFrame> = frames.iter().filter(|f| f.reply.is_some()).collect();
        let probe = probes[answered];
        let before = sent();
        pending.resolve(
            probe.reply.as_ref().unwrap().call,
            ReplyBody::Cast(Contribution {
                ok: 1,
                ..Contribution::default()
            }),
            &proc,
        );
        answered += 1;
        settle().await;
        let now = sent();
        assert!(
            now == casts || now == before + NOWAIT_PROBE_EVERY,
            "after answering probe {answered}, {before} -> {now} casts"
        );
        assert!(
            now <= (answered as u64 + NOWAIT_PROBES as u64 + 1) * NOWAIT_PROBE_EVERY,
            "never more than {window} past the last answered probe"
        );
    }
    sender.await.unwrap();
    let frames = fabric.frames.lock().unwrap();
    // Every cast went out once, in order, each 256th as a probe (alone).
    let mut n = 0;
    for f in frames.iter() {
        assert_eq!(f.order.seq, n + 1, "a frame numbered out of order");
        for payload in f.payloads() {
            n += 1;
            assert_eq!(payload, &crate::protocol::encode(&(n - 1)).unwrap());
        }
        assert_eq!(f.last_seq(), n);
        let probe = n.is_multiple_of(NOWAIT_PROBE_EVERY);
        assert_eq!(f.reply.is_some(), probe, "cast {n}");
        assert!(!probe || f.more.is_empty(), "probe {n} went in a batch");
    }
    assert_eq!(n, casts);
    assert!(
        frames.len() < casts as usize / 4,
        "{} frames for {casts} casts queued behind each other",
        frames.len()
    );
}

/// Casts queued behind each other travel as one frame only where the
/// frame says the same of each but its message: the same members (a
/// selection the seed does not decide) and mesh info, all fire-and-forget
/// or all waiting for results, up to the 64 jobs the caster takes at once;
/// a cast that goes to other members, picks them by `any`, or waits for
/// results where the others do not (or the other way round) goes in
/// another frame, and every cast goes out once, numbered in the order
/// handed over. The calls of a batch wait under consecutive numbers, one
/// per call.
#[tokio::test(start_paused = true)]
async fn only_casts_to_the_same_members_share_a_frame() {
    let (fabric, pending, caster) = recorded_caster(3);
    let info = info(&fabric.peer);
    let all = Selection::All;
    let any: Selection = "any".parse().unwrap();
    let first: Selection = "first".parse().unwrap();
    // (selection, waits for results) of each cast, in order.
    let mut plan: Vec<(&Selection, bool)> = Vec::new();
    plan.extend(std::iter::repeat_n((&all, false), 100)); // two batches: 64 + 36
    plan.extend(std::iter::repeat_n((&all, true), 3)); // calls: a batch of their own
    plan.extend(std::iter::repeat_n((&all, false), 3));
    plan.extend(std::iter::repeat_n((&first, false), 2)); // other members
    plan.push((&first, true)); // a call to other members: alone
    plan.extend(std::iter::repeat_n((&any, false), 3)); // one frame each
    plan.extend(std::iter::repeat_n((&any, true), 2)); // one frame each
    plan.extend(std::iter::repeat_n((&all, false), 2));
    // All handed over before the caster's task runs: it takes them as they
    // queued (in batches of its own of 64).
    let mut waiting = Vec::new();
    for (i, (selection, wait)) in plan.iter().enumerate() {
        let f = frame(
            &info,
            None,
            &caster,
            selection,
            &(i as u64),
            Collect::Ack,
            Duration::from_secs(60),
        )
        .unwrap();
        let cast = caster.cast(info.clone(), f, *wait);
        if *wait {
            // Handed over already; nobody answers it here.
            waiting.push(cast);
        } else {
            cast.await.unwrap();
        }
    }
    settle().await;
    let frames = fabric.frames.lock().unwrap().clone();
    let sizes: Vec<usize> = frames.iter().map(|f| 1 + f.more.len()).collect();
    // The caster takes its queue 64 at a time, and joins only what it took.
    assert_eq!(
        sizes,
        [64, 36, 3, 3, 2, 1, 1, 1, 1, 1, 1, 2],
        "casts per frame"
    );
    let mut n = 0u64;
    let mut calls = Vec::new();
    for f in &frames {
        assert_eq!(f.order.seq, n + 1);
        for payload in f.payloads() {
            assert_eq!(payload, &crate::protocol::encode(&n).unwrap());
            n += 1;
        }
        let (selection, wait) = plan[n as usize - 1];
        assert_eq!(&f.selection, selection, "frame ending at cast {n}");
        assert_eq!(f.reply.is_some(), wait);
        if let Some(reply) = &f.reply {
            calls.extend((reply.call..).take(1 + f.more.len()));
        }
        f.validate().unwrap();
    }
    assert_eq!(n as usize, plan.len());
    assert_eq!(calls.len(), 6);
    assert_eq!(calls[..3], [calls[0], calls[0] + 1, calls[0] + 2]);
    drop(waiting);
    assert_eq!(pending.len(), 6, "each call waits for its answer");
}

/// The calls of a batch each get their own results, whether they come in
/// one reply for several ([`ReplyBody::Casts`]) or one each; an answer for
/// a place outside the batch, or from another proc, reaches no one.
#[tokio::test(start_paused = true)]
async fn each_call_of_a_batch_gets_its_own_answer() {
    let (fabric, pending, caster) = recorded_caster(9);
    let info = info(&fabric.peer);
    let calls: Vec<_> = (0..4u64)
        .map(|i| caster.cast(info.clone(), gather(&info, &caster, i), true))
        .collect();
    let answers = async {
        settle().await;
        let frames = fabric.frames.lock().unwrap().clone();
        assert_eq!(
            frames.len(),
            1,
            "four calls handed over together: one frame"
        );
        assert_eq!(frames[0].more.len(), 3);
        let reply = frames[0].reply.clone().expect("calls");
        let value = |i: u8| Contribution {
            ok: 1,
            values: vec![(0, bytes::Bytes::from(vec![i]))],
            ..Contribution::default()
        };
        // From another proc: dropped.
        let stranger = ProcId::new("p9").unwrap();
        pending.resolve(reply.call, ReplyBody::Casts(vec![(0, value(9))]), &stranger);
        // The third and first together, a place past the batch (ignored: no
        // call waits there), then the fourth alone and the second.
        pending.resolve(
            reply.call,
            ReplyBody::Casts(vec![(2, value(2)), (0, value(0)), (7, value(7))]),
            &fabric.peer,
        );
        pending.resolve(reply.call + 3, ReplyBody::Cast(value(3)), &fabric.peer);
        pending.resolve(
            reply.call,
            ReplyBody::Casts(vec![(1, value(1))]),
            &fabric.peer,
        );
    };
    let (got, ()) = tokio::join!(futures::future::join_all(calls), answers);
    for (i, got) in got.into_iter().enumerate() {
        let got = got.unwrap().expect("results");
        assert_eq!(
            got.values,
            vec![(0, bytes::Bytes::from(vec![i as u8]))],
            "call {i}"
        );
    }
    assert_eq!(pending.len(), 0);
}

/// The sender binds each frame once, with the seed the frame carries: what
/// the caster dispatches from is what a proc that binds the frame alone
/// gets, for a selection that the seed decides.
#[tokio::test]
async fn a_frame_is_bound_with_the_seed_it_carries() {
    let (fabric, _, caster) = recorded_caster(11);
    let info = info(&fabric.peer);
    let view = Shape::new([("hosts", 4), ("gpus", 8)]).unwrap();
    let one_gpu_each: Selection = "any(gpus: *)".parse().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..64u64 {
        let cast = frame(
            &info,
            Some(&view),
            &caster,
            &one_gpu_each,
            &i,
            Collect::Ack,
            Duration::from_secs(60),
        )
        .unwrap();
        let f = &cast.frame;
        let again = f.selection.bind(&f.view, f.seed).unwrap();
        assert_eq!(cast.selected.ranks(), again.ranks(), "frame {i}");
        assert_eq!(cast.selected.ranks().len(), 4);
        seen.insert(cast.selected.ranks());
    }
    assert!(seen.len() > 1, "the seeds chose the same members each time");
}

/// A call to one member is collected on the caller's task: a caller that
/// gives up before the answer leaves no waiter behind for it, and one that
/// waits gets what its member answered.
#[tokio::test(start_paused = true)]
async fn a_call_given_up_leaves_no_waiter_behind() {
    let (fabric, pending, caster) = recorded_caster(5);
    let info = info(&fabric.peer);
    let call = |i: u64| gather(&info, &caster, i);
    // Given up long before its budget: nobody answered.
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        caster.cast(info.clone(), call(1), true),
    )
    .await;
    assert!(gave_up.is_err(), "nobody answered, yet the call ended");
    settle().await;
    assert_eq!(pending.len(), 0, "the call given up is still waited on");
    // One that waits gets the answer its member gave.
    let waits = {
        let caster = &caster;
        let info = info.clone();
        async move { caster.cast(info, call(2), true).await }
    };
    let answer = async {
        settle().await;
        let frames = fabric.frames.lock().unwrap().clone();
        let reply = frames.last().and_then(|f| f.reply.clone()).expect("a call");
        pending.resolve(
            reply.call,
            ReplyBody::Cast(Contribution {
                ok: 1,
                values: vec![(0, bytes::Bytes::from_static(b"v"))],
                ..Contribution::default()
            }),
            &fabric.peer,
        );
    };
    let (got, ()) = tokio::join!(waits, answer);
    let got = got.unwrap().expect("results");
    assert_eq!(got.values, vec![(0, bytes::Bytes::from_static(b"v"))]);
    assert_eq!(pending.len(), 0);
}

/// A cast's future (and so every call's: the caller's mesh call holds it)
/// carries neither its frame (handed over before the future is made), nor
/// the wait for room in the caster's queue, nor the collection of its
/// results (both on the heap when they are needed), since the state of a
/// future is copied whole each time it is built into its caller's. (The
/// wait itself: every cast still goes out once and in order past a full
/// queue, which `fire_and_forget_casts_wait_for_credit_from_the_slowest_proc`
/// fills.)
#[test]
#[allow(unreachable_code, clippy::diverging_sub_expression)]
fn a_cast_future_carries_neither_its_frame_nor_its_wait_nor_its_collection() {
    let cast = crate::returned_size(|| {
        Caster::cast(
            unreachable!(),
            unreachable!(),
            unreachable!(),
            unreachable!(),
        )
    });
    let collection = crate::returned_size(|| node::collect(unreachable!(), unreachable!()));
    let frame = std::mem::size_of::<crate::protocol::CastFrame>();
    assert!(
        cast < frame.min(collection),
        "a cast is a {cast}-byte future ({collection} bytes of collection, {frame} of frame)"
    );
}

/// A bound cast moves through channels and futures on its way to dispatch
/// (the caster's queue, a proc's mesh dispatcher, its held casts), each a
/// copy of what it is given: it holds its frame on the heap, so a move
/// copies a pointer and the bound selection, not the frame.
#[test]
fn a_bound_cast_holds_its_frame_on_the_heap() {
    let bound = std::mem::size_of::<node::Bound>();
    let frame = std::mem::size_of::<crate::protocol::CastFrame>();
    assert!(
        bound < frame / 2,
        "a bound cast is {bound} bytes, its frame {frame}"
    );
}

/// What a proc refuses of a batch before it acts on one: more than
/// [`MAX_BATCHED_CASTS`] casts, or casts or calls numbered past the last
/// number.
#[tokio::test]
async fn a_batch_is_refused_with_too_many_casts_or_no_numbers_left() {
    use crate::protocol::{CastOrder, MAX_BATCHED_CASTS, ReplyTo};
    let (fabric, _, caster) = recorded_caster(1);
    let info = info(&fabric.peer);
    let cast = frame(
        &info,
        None,
        &caster,
        &Selection::All,
        &1u64,
        Collect::Ack,
        Duration::from_secs(1),
    )
    .unwrap();
    // `casts` casts numbered from `seq`, answering calls from `call`.
    let batch = |casts: usize, seq: u64, call: Option<u64>| {
        let mut f = CastFrame::clone(&cast.frame);
        f.more = vec![f.payload.clone(); casts - 1];
        f.order = CastOrder { caster: 9, seq };
        f.reply = call.map(|call| ReplyTo {
            port: fabric.reply_port(),
            call,
        });
        f.validate()
    };
    assert_eq!(batch(1, 1, Some(u64::MAX)), Ok(()));
    assert_eq!(batch(2, 1, None), Ok(()));
    assert_eq!(batch(2, 1, Some(1)), Ok(()), "a batch of calls");
    assert_eq!(batch(MAX_BATCHED_CASTS, u64::MAX - 63, None), Ok(()));
    assert_eq!(
        batch(MAX_BATCHED_CASTS, 1, Some(u64::MAX - 63)),
        Ok(()),
        "its last call answers the last number"
    );
    for (casts, seq, call) in [
        (MAX_BATCHED_CASTS + 1, 1, None),
        (MAX_BATCHED_CASTS + 1, 1, Some(1)),
        (3, u64::MAX - 1, None),
        (2, 1, Some(u64::MAX)),
        (MAX_BATCHED_CASTS, 1, Some(u64::MAX - 62)),
    ] {
        assert!(
            batch(casts, seq, call).is_err(),
            "{casts} casts from {seq}, calls from {call:?}"
        );
    }
}
