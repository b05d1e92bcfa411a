//! `regent sim` as a user runs it: a seed replays exactly in another
//! process (the replay command a failing seed prints), and seeds pass the
//! checkers.

use std::process::Command;

/// Runs `regent sim` with `args`; returns its standard output.
fn sim(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_regent"))
        .arg("sim")
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("regent sim runs");
    assert!(
        out.status.success(),
        "regent sim {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// A traced run's seed line and history (what comes before the summary,
/// whose wall times differ from run to run).
fn traced(out: &str) -> &str {
    out.split("simulation report").next().unwrap_or(out)
}

/// The line `seed S: hash H, ...` of a traced run.
fn hash_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("seed ") && l.contains(": hash "))
        .expect("a traced run prints its hash")
}

#[test]
fn a_seed_replays_exactly_in_another_process() {
    let first = sim(&["--seed", "7", "--trace"]);
    let again = sim(&["--seed", "7", "--trace"]);
    assert_eq!(hash_line(&first), hash_line(&again));
    assert!(traced(&first) == traced(&again), "the two histories differ");
    let other = sim(&["--seed", "8", "--trace"]);
    assert_ne!(hash_line(&first), hash_line(&other));
    assert!(first.contains("planned "), "the history shows the timeline");
}

#[test]
fn seeds_pass_every_checker_and_the_summary_says_so() {
    let out = sim(&["--seeds", "4", "--from", "40"]);
    assert!(out.contains("seeds: 4 in"), "{out}");
    assert!(out.contains("every seed kept every invariant"), "{out}");
}
