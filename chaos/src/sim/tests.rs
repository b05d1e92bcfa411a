//! The simulated chaos scenario: clean seeds pass every checker, and a
//! seed replays exactly.

use super::*;

#[test]
fn a_seed_replays_exactly_and_seeds_differ() {
    let config = SimConfig::default();
    let mut hashes = std::collections::BTreeSet::new();
    for seed in 0..4 {
        let a = run_seed(seed, &config);
        let b = run_seed(seed, &config);
        if a.hash != b.hash {
            let at = a
                .history
                .iter()
                .zip(&b.history)
                .position(|(x, y)| x != y)
                .unwrap_or(a.history.len().min(b.history.len()));
            panic!(
                "seed {seed}: two runs differ (first at history line {at}: {:?} / {:?}; {} / {} trace events)",
                a.history.get(at),
                b.history.get(at),
                a.trace_events,
                b.trace_events
            );
        }
        hashes.insert(a.hash);
    }
    assert_eq!(hashes.len(), 4, "distinct seeds gave equal hashes");
}

#[test]
fn seeded_fault_histories_keep_every_invariant() {
    let config = SimConfig::default();
    let started = std::time::Instant::now();
    let mut faults = 0;
    for seed in 100..106 {
        let o = run_seed(seed, &config);
        faults += o.faults.values().sum::<u64>();
        assert_eq!(
            o.violations(),
            0,
            "seed {seed}: {:#?}\n{}",
            o.failures(),
            o.history.join("\n")
        );
        let checked: u64 = o.invariants.iter().map(|i| i.checked).sum();
        assert!(checked > 0, "seed {seed}: nothing was checked");
    }
    assert!(faults > 0, "no fault applied in 6 seeds");
    println!(
        "6 seeds, {faults} faults, in {:?} of wall time",
        started.elapsed()
    );
}
