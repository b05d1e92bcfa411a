//! The `regent` command and the facade, as a user meets them.
//!
//! - The main job of README.md's first command, `regent demo`, runs as the
//!   real binary: a tree of supervisors recovers from injected panics,
//!   errors, kills and a hung child, then escalates a permanent fault to the
//!   root. The demo checks each claim it prints and exits non-zero
//!   otherwise.
//! - The facade carries nothing of the command: a binary that links only the
//!   `regent` library (this test) registers none of the benchmarks', demo's
//!   or chaos runs' actor types.

use std::process::Command;

#[test]
fn supervision_demo_recovers_and_escalates_as_documented() {
    let out = Command::new(env!("CARGO_BIN_EXE_regent"))
        .arg("demo")
        .output()
        .expect("run regent demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "regent demo failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("escalat"),
        "the demo's report does not show the escalation:\n{stdout}"
    );
}

#[test]
fn the_facade_registers_no_actor_of_the_command() {
    let types = regent::mesh::registry::actor_types();
    let internal: Vec<&str> = types
        .iter()
        .copied()
        .filter(|name| {
            ["regent-bench/", "regent-chaos/", "regent-demo/", "regent/"]
                .iter()
                .any(|prefix| name.starts_with(prefix))
        })
        .collect();
    assert!(
        internal.is_empty(),
        "a binary linking only the regent library registers the project's own actors: {internal:?}"
    );
}
