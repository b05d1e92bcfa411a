//! Rule tests of the mesh policy machine, and a property test over random
//! failure sequences.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

fn boom() -> FailureCause {
    FailureCause::Actor {
        message: "boom".into(),
        panicked: false,
    }
}

fn fail(ranks: &[u32], generation: u64) -> MeshEvent {
    MeshEvent::Failed {
        failure: MeshFailure {
            mesh: "m".into(),
            ranks: ranks.iter().copied().map(Rank).collect(),
            cause: boom(),
            generation: Generation(generation),
        },
        lost: Vec::new(),
        decision: None,
    }
}

fn exited() -> FailureCause {
    FailureCause::ProcExited {
        proc: ProcId::new("p0-1").unwrap(),
        status: ProcStatus::Signal(9),
        last_lines: Vec::new(),
    }
}

fn pid(rank: u32, life: u32) -> ProcId {
    ProcId::new(&format!("p{life}-{rank}")).unwrap()
}

/// The procs of a fresh mesh: `p0-0`, `p0-1`, ...
fn procs(n: u32) -> Vec<ProcId> {
    (0..n).map(|r| pid(r, 0)).collect()
}

/// The procs a machine has now (its restarts replaced none).
fn m_procs(m: &MeshMachine) -> Vec<ProcId> {
    m.procs().to_vec()
}

fn restarted(ok: bool, procs: Vec<ProcId>) -> MeshEvent {
    MeshEvent::Restarted {
        result: if ok { Ok(()) } else { Err("no proc".into()) },
        procs,
    }
}

/// The loss of the first life of proc `proc` (with `per_proc` members each).
fn proc_exit(proc: u32, per_proc: u32, generation: u64) -> MeshEvent {
    proc_exit_of(pid(proc, 0), proc, per_proc, generation)
}

fn proc_exit_of(id: ProcId, proc: u32, per_proc: u32, generation: u64) -> MeshEvent {
    let first = proc * per_proc;
    MeshEvent::Failed {
        failure: MeshFailure {
            mesh: "m".into(),
            ranks: (first..first + per_proc).map(Rank).collect(),
            cause: exited(),
            generation: Generation(generation),
        },
        lost: vec![(proc, id)],
        decision: None,
    }
}

/// A machine of `members` members, one per proc.
fn machine(policy: MeshPolicy, members: u32) -> MeshMachine {
    MeshMachine::new(policy, procs(members), 1)
}

#[test]
fn restart_member_respawns_only_the_failed_ranks_in_a_new_generation() {
    let t = Instant::now();
    // 4 procs of 2 members; proc 1 (ranks 2, 3) is lost.
    let mut m = MeshMachine::new(MeshPolicy::default(), procs(4), 2);
    let a = m.handle(t, proc_exit(1, 2, 0));
    assert_eq!(
        a,
        vec![MeshAction::RestartMembers {
            ranks: vec![Rank(2), Rank(3)],
            replace: vec![1],
            generation: Generation(1),
            delay: Duration::ZERO,
            // Survivors 0, 1, 4, 5, 6, 7, round robin.
            sources: vec![(Rank(2), Rank(0)), (Rank(3), Rank(1))],
            cause: exited(),
        }]
    );
    assert_eq!(m.rank_generation(Rank(2)), Some(Generation(1)));
    assert_eq!(m.rank_generation(Rank(4)), Some(Generation(0)));
    // While restarting, failures wait.
    assert!(m.handle(t, fail(&[5], 0)).is_empty());
    let replaced = vec![pid(0, 0), pid(1, 1), pid(2, 0), pid(3, 0)];
    let a = m.handle(t, restarted(true, replaced));
    assert!(
        matches!(&a[..], [MeshAction::RestartMembers { ranks, generation: Generation(2), replace, .. }] if ranks == &[Rank(5)] && replace.is_empty())
    );
}

#[test]
fn a_lost_proc_reported_twice_restarts_once_and_is_replaced_once() {
    let t = Instant::now();
    let mut m = MeshMachine::new(MeshPolicy::default(), procs(3), 2);
    // Its exit from the host agent, then its link from the control plane.
    assert_eq!(m.handle(t, proc_exit(2, 2, 0)).len(), 1);
    assert_eq!(m.lost_procs(), vec![2]);
    assert!(
        m.handle(t, proc_exit(2, 2, 0)).is_empty(),
        "the second report of one loss"
    );
    let replaced = vec![pid(0, 0), pid(1, 0), pid(2, 1)];
    m.handle(t, restarted(true, replaced));
    assert!(m.lost_procs().is_empty(), "replaced by the restart");
    // A late report about the replaced proc: ignored.
    assert!(
        m.handle(t, proc_exit(2, 2, 0)).is_empty(),
        "a proc already replaced"
    );
    // The replacement dies: a new loss.
    let a = m.handle(t, proc_exit_of(pid(2, 1), 2, 2, 1));
    assert!(
        matches!(&a[..], [MeshAction::RestartMembers { replace, .. }] if replace == &[2]),
        "{a:?}"
    );
}

#[test]
fn a_proc_lost_during_a_restart_is_replaced_by_the_next_one_with_all_its_members() {
    let t = Instant::now();
    let mut m = MeshMachine::new(MeshPolicy::default(), procs(3), 2);
    m.handle(t, fail(&[0], 0));
    // While restarting rank 0, proc 1 dies; the restart fails (its request
    // to proc 1 found it lost).
    assert!(m.handle(t, proc_exit(1, 2, 1)).is_empty());
    let a = m.handle(t, restarted(false, procs(3)));
    assert!(
        matches!(&a[..], [MeshAction::RestartMembers { ranks, replace, .. }] if ranks == &[Rank(2), Rank(3)] && replace == &[1]),
        "{a:?}"
    );
}

#[test]
fn a_proc_lost_during_a_gang_restart_is_replaced_though_its_lives_were_already_renewed() {
    let t = Instant::now();
    let mut m = MeshMachine::new(MeshPolicy::new(Decision::RestartMesh), procs(3), 2);
    assert!(matches!(
        &m.handle(t, fail(&[0], 0))[..],
        [MeshAction::RestartMesh { .. }]
    ));
    // Every rank is in generation 1 now; proc 2's loss was reported in
    // generation 0 (before the restart) and waited: it still counts.
    assert!(m.handle(t, proc_exit(2, 2, 0)).is_empty());
    let a = m.handle(t, restarted(false, procs(3)));
    assert!(
        matches!(&a[..], [MeshAction::RestartMesh { replace, generation: Generation(2), .. }] if replace == &[2]),
        "{a:?}"
    );
}

#[test]
fn heal_sources_spread_round_robin_over_the_survivors() {
    let restarted = [Rank(1), Rank(2), Rank(5)];
    assert_eq!(
        heal_sources(&restarted, 6),
        vec![(Rank(1), Rank(0)), (Rank(2), Rank(3)), (Rank(5), Rank(4))]
    );
    assert_eq!(
        heal_sources(&[Rank(0), Rank(1), Rank(2)], 4),
        vec![(Rank(0), Rank(3)), (Rank(1), Rank(3)), (Rank(2), Rank(3))]
    );
    assert!(
        heal_sources(&[Rank(0), Rank(1)], 2).is_empty(),
        "no survivor"
    );
}

#[test]
fn reports_of_replaced_lives_are_stale() {
    let t = Instant::now();
    let mut m = machine(MeshPolicy::default(), 4);
    m.handle(t, fail(&[1], 0));
    m.handle(t, restarted(true, m_procs(&m)));
    // The old life of rank 1 (a zombie) reports again: ignored.
    assert!(m.handle(t, fail(&[1], 0)).is_empty());
    // Rank 0 never restarted: its generation-0 life still counts.
    assert_eq!(m.handle(t, fail(&[0, 1], 0)).len(), 1);
}

#[test]
fn restart_mesh_replaces_every_life() {
    let t = Instant::now();
    let mut m = machine(MeshPolicy::new(Decision::RestartMesh), 4);
    assert_eq!(
        m.handle(t, fail(&[3], 0)),
        vec![MeshAction::RestartMesh {
            replace: Vec::new(),
            generation: Generation(1),
            delay: Duration::ZERO,
            cause: boom(),
        }]
    );
    m.handle(t, restarted(true, m_procs(&m)));
    assert!(
        m.handle(t, fail(&[0], 0)).is_empty(),
        "every old life is gone"
    );
    assert_eq!(m.rank_generation(Rank(0)), Some(Generation(1)));
}

#[test]
fn exceeding_the_intensity_escalates() {
    let t = Instant::now();
    let policy = MeshPolicy::default().intensity(2, Duration::from_secs(10));
    let mut m = machine(policy, 2);
    for g in 0..2 {
        assert_eq!(m.handle(t, fail(&[0], g)).len(), 1);
        m.handle(t, restarted(true, m_procs(&m)));
    }
    let a = m.handle(t + Duration::from_secs(1), fail(&[0], 2));
    assert!(matches!(
        &a[..],
        [MeshAction::Escalate {
            exhausted: true,
            ..
        }]
    ));
    assert!(m.is_done());
    assert!(
        m.handle(t, fail(&[1], 0)).is_empty(),
        "a done mesh is inert"
    );
    // Outside the period the count starts over.
    let mut m = machine(policy, 1);
    for g in 0..10 {
        assert_eq!(
            m.handle(t + Duration::from_secs(11 * g), fail(&[0], g))
                .len(),
            1
        );
        m.handle(t, restarted(true, m_procs(&m)));
    }
}

#[test]
fn stop_escalate_and_the_owners_override() {
    let t = Instant::now();
    let mut m = machine(MeshPolicy::new(Decision::Stop), 2);
    assert!(matches!(
        &m.handle(t, fail(&[0], 0))[..],
        [MeshAction::Stop { .. }]
    ));
    let mut m = machine(MeshPolicy::new(Decision::Escalate), 2);
    assert!(matches!(
        &m.handle(t, fail(&[0], 0))[..],
        [MeshAction::Escalate {
            exhausted: false,
            ..
        }]
    ));
    // The owner's hook overrides the policy for one failure.
    let mut m = machine(MeshPolicy::new(Decision::Stop), 2);
    let MeshEvent::Failed { failure, .. } = fail(&[1], 0) else {
        unreachable!()
    };
    let a = m.handle(
        t,
        MeshEvent::Failed {
            failure,
            lost: Vec::new(),
            decision: Some(Decision::RestartMesh),
        },
    );
    assert!(matches!(&a[..], [MeshAction::RestartMesh { .. }]));
}

#[test]
fn a_failed_restart_reported_as_a_failure_counts_toward_the_intensity() {
    let t = Instant::now();
    let policy = MeshPolicy::default().intensity(1, Duration::from_secs(60));
    let mut m = machine(policy, 2);
    m.handle(t, fail(&[0], 0));
    assert!(m.handle(t, restarted(false, m_procs(&m))).is_empty());
    let a = m.handle(
        t,
        MeshEvent::Failed {
            failure: MeshFailure {
                mesh: "m".into(),
                ranks: vec![Rank(0)],
                cause: FailureCause::StartFailed("no proc".into()),
                generation: m.generation(),
            },
            lost: Vec::new(),
            decision: None,
        },
    );
    assert!(
        matches!(&a[..], [MeshAction::Escalate { exhausted: true, failure }] if matches!(failure.cause, FailureCause::StartFailed(_))),
        "{a:?}"
    );
}

#[test]
fn backoff_grows_and_resets() {
    let t = Instant::now();
    let backoff = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(25),
        reset_after: Duration::from_secs(5),
    };
    let policy = MeshPolicy::default()
        .intensity(100, Duration::from_secs(1))
        .backoff(backoff);
    let mut m = machine(policy, 1);
    let mut delays = Vec::new();
    for g in 0..4 {
        let a = m.handle(t, fail(&[0], g));
        let MeshAction::RestartMembers { delay, .. } = a[0] else {
            panic!("{a:?}")
        };
        delays.push(delay.as_millis());
        m.handle(t, restarted(true, m_procs(&m)));
    }
    assert_eq!(delays, vec![10, 20, 25, 25]);
    let a = m.handle(t + Duration::from_secs(6), fail(&[0], 4));
    assert!(
        matches!(a[0], MeshAction::RestartMembers { delay, .. } if delay == Duration::from_millis(10))
    );
}

#[derive(Debug, Clone)]
enum Step {
    Fail { ranks: Vec<u32>, age: u64 },
    Restarted(bool),
    Advance(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (proptest::collection::vec(0u32..6, 1..4), 0u64..3)
            .prop_map(|(ranks, age)| Step::Fail { ranks, age }),
        3 => any::<bool>().prop_map(Step::Restarted),
        1 => (0u64..20_000).prop_map(Step::Advance),
    ]
}

proptest! {
    /// Whatever happens: at most one restart in flight, generations only
    /// grow (one per restart), no rank is ever ahead of the mesh, stale lives
    /// never cause an action, and a done mesh does nothing.
    #[test]
    fn invariants_hold_over_random_failures(
        decision in prop_oneof![Just(Decision::RestartMember), Just(Decision::RestartMesh)],
        max in 0u32..4,
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let policy = MeshPolicy::new(decision).intensity(max, Duration::from_secs(10));
        let mut m = machine(policy, 6);
        let mut in_flight = false;
        let mut last_generation = 0;
        for s in steps {
            let done_before = m.is_done();
            let actions = match s {
                Step::Advance(ms) => { now += Duration::from_millis(ms); Vec::new() }
                Step::Restarted(ok) => {
                    let procs = m_procs(&m);
                    let a = m.handle(now, restarted(ok, procs));
                    in_flight = false;
                    a
                }
                Step::Fail { ranks, age } => {
                    // Report lives of the current or an older generation.
                    let g = m.generation().0.saturating_sub(age);
                    let stale = ranks.iter().all(|r| m.rank_generation(Rank(*r)).unwrap() > Generation(g));
                    let a = m.handle(now, fail(&ranks, g));
                    if stale && !in_flight {
                        prop_assert!(a.is_empty(), "stale report acted on: {:?}", a);
                    }
                    a
                }
            };
            if done_before {
                prop_assert!(actions.is_empty());
            }
            for a in &actions {
                match a {
                    MeshAction::RestartMembers { generation, .. } | MeshAction::RestartMesh { generation, .. } => {
                        prop_assert!(!in_flight, "two restarts in flight");
                        prop_assert_eq!(generation.0, last_generation + 1);
                        last_generation = generation.0;
                        in_flight = true;
                    }
                    MeshAction::Stop { .. } | MeshAction::Escalate { .. } => prop_assert!(m.is_done()),
                }
            }
            for r in 0..6 {
                prop_assert!(m.rank_generation(Rank(r)).unwrap() <= m.generation());
            }
        }
    }
}

#[test]
fn an_escalation_chain_deeper_than_the_bound_does_not_decode_and_does_not_overflow() {
    fn chain(depth: u32) -> MeshFailure {
        let mut f = MeshFailure {
            mesh: "m".into(),
            ranks: vec![Rank(0)],
            cause: boom(),
            generation: Generation(0),
        };
        for _ in 0..depth {
            let inner = f.clone();
            f.cause = FailureCause::Escalated(Box::new(inner));
        }
        f
    }
    let ok = postcard::to_allocvec(&chain(MAX_ESCALATION_DEPTH)).unwrap();
    assert_eq!(
        postcard::from_bytes::<MeshFailure>(&ok).unwrap(),
        chain(MAX_ESCALATION_DEPTH)
    );
    let deep = postcard::to_allocvec(&chain(MAX_ESCALATION_DEPTH + 1)).unwrap();
    assert!(postcard::from_bytes::<MeshFailure>(&deep).is_err());
    // The fuzzer's input: 5000 levels in 20 kB, on a small stack.
    let mut bytes = vec![1u8, b'm', 1, 0, 6];
    for _ in 0..5000 {
        bytes.extend([1, b'm', 1, 0, 6]);
    }
    let t = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || postcard::from_bytes::<MeshFailure>(&bytes).is_err())
        .unwrap();
    assert!(t.join().unwrap(), "a 5000-level chain decoded");
}
