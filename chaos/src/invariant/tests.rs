use super::*;
use crate::workload::{Life, LifeReport, OrderLog, Sender};

fn life(rank: u32, born: u64, nonce: u64) -> Life {
    Life {
        rank,
        born,
        nonce,
        pid: 100 + rank,
    }
}

fn report(l: Life, ranges: Vec<(u64, u64)>, duplicates: Vec<u64>) -> LifeReport {
    LifeReport {
        life: l,
        ranges,
        duplicates,
        recorded: 0,
        truncated: false,
        order: Vec::new(),
        order_dropped: 0,
    }
}

/// A report whose life received these numbers from these senders, in this
/// order (recorded by the workload's own recorder).
fn arrivals(l: Life, seqs: &[(Sender, u64)]) -> LifeReport {
    let mut logs: BTreeMap<Sender, OrderLog> = BTreeMap::new();
    for (sender, seq) in seqs {
        logs.entry(*sender).or_default().record(*seq);
    }
    LifeReport {
        order: logs.into_iter().collect(),
        ..report(l, vec![], vec![])
    }
}

const A: Sender = Sender::CASTER;
const B: Sender = Sender::CALLER;

fn cast(seq: u64, g: u64, acked: Acked) -> SendRecord {
    SendRecord {
        seq,
        gen_lo: g,
        gen_hi: g,
        call: false,
        acked,
    }
}

#[test]
fn clean_delivery_holds() {
    let sends = vec![cast(1, 0, Acked::All), cast(2, 0, Acked::All)];
    let reps = vec![
        report(life(0, 0, 1), vec![(1, 2)], vec![]),
        report(life(1, 0, 2), vec![(1, 2)], vec![]),
    ];
    let (lost, once) = check_delivery(&sends, &reps, 1, 3);
    assert!(lost.ok() && once.ok(), "{lost}\n{once}");
    assert_eq!(lost.checked, 4);
}

#[test]
fn an_acknowledged_message_missing_from_a_live_member_is_lost() {
    let sends = vec![cast(1, 0, Acked::All), cast(2, 0, Acked::AllBut(vec![1]))];
    let reps = vec![
        report(life(0, 0, 1), vec![(1, 2)], vec![]),
        // Rank 1 missed 2 (not acknowledged: fine) and 1 (acknowledged: lost).
        report(life(1, 0, 2), vec![], vec![]),
    ];
    let (lost, once) = check_delivery(&sends, &reps, 1, 3);
    assert_eq!(lost.violations, 1, "{lost}");
    assert!(once.ok());
}

#[test]
fn a_restarted_life_owes_nothing_of_before_and_gets_nothing_of_before() {
    let sends = vec![cast(1, 0, Acked::All), cast(2, 1, Acked::All)];
    // Rank 1 was respawned in generation 1: message 1 died with its old
    // life; it must have 2 only.
    let ok = vec![report(life(1, 1, 9), vec![(2, 2)], vec![])];
    let (lost, once) = check_delivery(&sends, &ok, 1, 3);
    assert!(lost.ok() && once.ok(), "{lost}\n{once}");
    let fenced_failed = vec![report(life(1, 1, 9), vec![(1, 2)], vec![])];
    let (_, once) = check_delivery(&sends, &fenced_failed, 1, 3);
    assert_eq!(once.violations, 1, "{once}");
}

#[test]
fn duplicates_and_phantoms_break_exactly_once() {
    let sends = vec![cast(1, 0, Acked::All)];
    let reps = vec![report(life(0, 0, 1), vec![(1, 1), (5, 5)], vec![1])];
    let (_, once) = check_delivery(&sends, &reps, 1, 2);
    // The duplicate is reported from the list and from the count, the
    // phantom 5 from the range.
    assert!(once.violations >= 2, "{once}");
}

#[test]
fn calls_past_their_deadline_or_with_silent_ranks_are_violations() {
    let ok = CallRecord {
        deadline: Duration::from_secs(1),
        elapsed: Duration::from_millis(1500),
        selected: 2,
        replied: vec![0],
        failed: vec![1],
        error: None,
    };
    assert!(check_calls(std::slice::from_ref(&ok), Duration::from_secs(1)).ok());
    let late = CallRecord {
        elapsed: Duration::from_secs(5),
        ..ok.clone()
    };
    assert_eq!(check_calls(&[late], Duration::from_secs(1)).violations, 1);
    let silent = CallRecord {
        failed: vec![],
        ..ok
    };
    assert_eq!(check_calls(&[silent], Duration::from_secs(1)).violations, 1);
}

#[test]
fn two_lives_of_a_rank_in_one_generation_are_caught() {
    let t = Instant::now();
    let samples = vec![(t, 0), (t, 1), (t, 1)];
    let replies = vec![
        ReplySeen {
            rank: 0,
            generation: 1,
            life: life(0, 0, 1),
        },
        ReplySeen {
            rank: 0,
            generation: 1,
            life: life(0, 1, 2),
        },
    ];
    let r = check_generations(&samples, &replies);
    assert_eq!(r.violations, 1, "{r}");
    let back = check_generations(&[(t, 2), (t, 1)], &[]);
    assert_eq!(back.violations, 1);
}

fn log(policy: MeshPolicy) -> SupervisionLog {
    SupervisionLog {
        policy,
        initial: [(0, life(0, 0, 1)), (1, life(1, 0, 2))].into(),
        finals: [(0, life(0, 0, 1)), (1, life(1, 1, 3))].into(),
        failures: vec![(Instant::now(), vec![1])],
        failures_missed: false,
        generations: vec![(Instant::now(), 0), (Instant::now(), 1)],
        status: MeshStatus::Running,
        generation: 1,
        tolerance: Duration::from_secs(5),
    }
}

#[test]
fn restarts_follow_the_policy() {
    let good = log(MeshPolicy::new(Decision::RestartMember));
    assert!(check_restarts(&good).ok(), "{}", check_restarts(&good));
    // Rank 0 restarted too, though no failure named it.
    let mut wrong = good.clone();
    wrong.finals.insert(0, life(0, 1, 7));
    assert_eq!(check_restarts(&wrong).violations, 1);
    // A whole-mesh restart leaves no old life.
    let mesh = log(MeshPolicy::new(Decision::RestartMesh));
    assert_eq!(check_restarts(&mesh).violations, 1);
    // More restarts than the intensity allows.
    let mut many =
        log(MeshPolicy::new(Decision::RestartMember).intensity(1, Duration::from_secs(60)));
    let t = Instant::now();
    many.generations = vec![(t, 0), (t, 1), (t, 2)];
    many.failures = vec![(t, vec![1]), (t, vec![1])];
    assert!(!check_restarts(&many).ok());
}

#[test]
fn processes_that_survive_are_reported() {
    assert!(check_processes(&[1, 2], &[], "after stop").ok());
    assert_eq!(check_processes(&[1, 2], &[2], "after stop").violations, 1);
}

#[test]
fn arrivals_in_the_order_sent_hold_and_each_counts_once() {
    // Two senders interleaved: each in its own order.
    let rep = arrivals(
        life(0, 0, 1),
        &[(A, 1), (B, 2), (A, 3), (A, 5), (B, 4), (A, 6)],
    );
    let (r, progress) = check_order(std::slice::from_ref(&rep), &OrderProgress::new());
    assert!(r.ok(), "{r}");
    // A: 4 arrivals, 3 compared with the one before; B: 2, 1.
    assert_eq!(r.checked, 4, "{r}");
    assert!(r.unchecked.is_empty());
    assert_eq!(progress[&(1, A)], 4);
    assert_eq!(progress[&(1, B)], 2);
    // The next round sees the same life with nothing new: nothing counted.
    let (again, _) = check_order(&[rep], &progress);
    assert_eq!(again.checked, 0);
}

#[test]
fn a_reordered_pair_from_one_sender_is_reported() {
    // Sender A's 3 overtook its 2.
    let rep = arrivals(life(2, 0, 7), &[(A, 1), (A, 3), (A, 2), (A, 4)]);
    let (r, _) = check_order(&[rep], &OrderProgress::new());
    assert_eq!(r.violations, 1, "{r}");
    assert_eq!(r.checked, 3, "{r}");
    assert!(
        r.examples[0].contains("rank 2")
            && r.examples[0].contains("message 2 from the caster after message 3"),
        "{r}"
    );
}

#[test]
fn a_repeat_from_one_sender_breaks_the_order() {
    let rep = arrivals(life(0, 0, 1), &[(A, 1), (A, 2), (A, 2)]);
    let (r, _) = check_order(&[rep], &OrderProgress::new());
    assert_eq!(r.violations, 1, "{r}");
}

#[test]
fn a_reorder_in_a_later_round_is_reported_once() {
    let l = life(0, 0, 1);
    let first = arrivals(l, &[(A, 1), (A, 2)]);
    let (r1, progress) = check_order(&[first], &OrderProgress::new());
    assert!(r1.ok());
    // Round two: the same life has since received 5, then 4 (out of order).
    let second = arrivals(l, &[(A, 1), (A, 2), (A, 5), (A, 4)]);
    let (r2, progress) = check_order(std::slice::from_ref(&second), &progress);
    assert_eq!((r2.checked, r2.violations), (2, 1), "{r2}");
    // Round three, nothing new: the violation is not reported again.
    let (r3, _) = check_order(&[second], &progress);
    assert_eq!((r3.checked, r3.violations), (0, 0), "{r3}");
}

#[test]
fn order_not_kept_is_listed_not_counted_as_holding() {
    let mut log = OrderLog::default();
    for i in 0..(crate::workload::MAX_ORDER_RUNS as u64 + 5) {
        log.record(1_000 - i);
    }
    let rep = LifeReport {
        order: vec![(A, log)],
        ..report(life(0, 0, 1), vec![], vec![])
    };
    let (r, _) = check_order(&[rep], &OrderProgress::new());
    assert_eq!(r.violations, crate::workload::MAX_ORDER_RUNS as u64 - 1);
    assert_eq!(r.unchecked.len(), 1, "{r}");
}

#[test]
fn a_malformed_order_log_is_a_violation() {
    let log = OrderLog {
        runs: vec![crate::workload::Run {
            at: 3,
            first: 1,
            last: 2,
        }],
        covered: 2,
        arrivals: 2,
    };
    let rep = LifeReport {
        order: vec![(A, log)],
        ..report(life(0, 0, 1), vec![], vec![])
    };
    let (r, _) = check_order(&[rep], &OrderProgress::new());
    assert_eq!(r.violations, 1, "{r}");
}
