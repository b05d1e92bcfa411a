//! The `regent-sim` binary (what CI runs its 10,000 seeds with) as a user
//! runs it: a seed that meets a planted bug fails the run, names the seed
//! and prints its replay command; the same seed passes with the bug
//! unplanted; a bad fault list is refused.

use std::process::{Command, Output};

fn regent_sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_regent-sim"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("regent-sim runs")
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_planted_bug_fails_its_seed_with_the_replay_and_the_seed_passes_without_it() {
    // Seed 531 breaks FIFO with unordered casts planted (the chaos crate's
    // regression seeds, `sim::tests::REGRESSIONS`).
    let bad = regent_sim(&["--seed", "531", "--plant", "unordered-casts"]);
    let said = text(&bad);
    assert!(
        !bad.status.success(),
        "a violated invariant must fail: {said}"
    );
    assert!(said.contains("seed 531 fails:"), "{said}");
    assert!(
        said.contains("replay: regent sim --seed 531 --trace"),
        "{said}"
    );
    assert!(said.contains("1 failing seed(s): 531"), "{said}");

    let good = regent_sim(&["--seed", "531"]);
    let said = text(&good);
    assert!(good.status.success(), "{said}");
    assert!(said.contains("seeds: 1 in"), "{said}");
    assert!(said.contains("every seed kept every invariant"), "{said}");
}

#[test]
fn an_unknown_fault_kind_is_refused() {
    let out = regent_sim(&["--seeds", "1", "--faults", "kill,meteor"]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("unknown fault kind \"meteor\""), "{said}");
}
