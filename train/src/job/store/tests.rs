//! Checkpoints in a run directory: what a kill during a write, a torn
//! file or a damaged `latest` leave, and what loading makes of it. Real
//! files in a fresh directory per test.

use std::path::{Path, PathBuf};

use super::*;
use crate::job::{JobSpec, ModelSpec, OptimSpec};

/// A fresh, empty directory under the system's temporary one.
fn fresh_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("regent-train-store-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir
}

/// Removes the directory when the test ends, passed or not.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The small MLP's state after `steps` local steps (each step changes every
/// weight, so states of different steps differ in their tensors too).
fn state_at(steps: u64) -> TrainState {
    let spec = JobSpec {
        model: ModelSpec::mlp_small(),
        optimizer: OptimSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
        },
        seed: 3,
        world: 1,
    };
    let mut replica = spec.build().expect("build the small MLP");
    for _ in 0..steps {
        replica.local_step().expect("a local step");
    }
    replica.state().expect("capture the state")
}

fn same(a: &TrainState, b: &TrainState) -> bool {
    a.first_difference(b).expect("comparable states").is_none()
}

/// Writes checkpoints at steps 1, 2 and 3; returns them.
fn three_checkpoints(dir: &Path) -> Vec<TrainState> {
    (1..=3)
        .map(|s| {
            let state = state_at(s);
            save_checkpoint(dir, &state).expect("save a checkpoint");
            state
        })
        .collect()
}

fn loaded_step(dir: &Path) -> u64 {
    latest_checkpoint(dir)
        .expect("a checkpoint loads")
        .expect("there is a checkpoint")
        .1
        .step
}

#[test]
fn latest_names_the_newest_and_loads_it_whole() {
    let dir = fresh_dir("newest");
    let _c = Cleanup(dir.clone());
    let states = three_checkpoints(&dir);
    assert_eq!(
        std::fs::read_to_string(dir.join("latest")).expect("latest"),
        ckpt_name(3)
    );
    let (path, state) = latest_checkpoint(&dir).expect("load").expect("one");
    assert_eq!(path, dir.join(ckpt_name(3)));
    assert!(
        same(&state, &states[2]),
        "the loaded state is not the saved one"
    );
}

#[test]
fn an_empty_run_directory_has_no_checkpoint() {
    let dir = fresh_dir("empty");
    let _c = Cleanup(dir.clone());
    assert!(latest_checkpoint(&dir).expect("load").is_none());
    assert!(
        latest_checkpoint(&dir.join("missing"))
            .expect("load")
            .is_none()
    );
}

#[test]
fn a_torn_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = fresh_dir("torn");
    let _c = Cleanup(dir.clone());
    let states = three_checkpoints(&dir);
    // The file `latest` names loses its second half (as if it had been
    // written in place and the writer killed: the store never does that,
    // but a disk or a copy can).
    let newest = dir.join(ckpt_name(3));
    let len = std::fs::metadata(&newest).expect("stat").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .expect("open");
    f.set_len(len / 2).expect("truncate");
    drop(f);
    let (path, state) = latest_checkpoint(&dir).expect("load").expect("one");
    assert_eq!(path, dir.join(ckpt_name(2)));
    assert!(same(&state, &states[1]));
}

#[test]
fn a_flipped_byte_in_the_newest_checkpoint_falls_back() {
    let dir = fresh_dir("flip");
    let _c = Cleanup(dir.clone());
    three_checkpoints(&dir);
    let newest = dir.join(ckpt_name(3));
    let mut bytes = std::fs::read(&newest).expect("read");
    let i = bytes.len() - 17; // in the tensor data, past the header
    bytes[i] ^= 0x40;
    std::fs::write(&newest, &bytes).expect("write");
    assert_eq!(loaded_step(&dir), 2);
}

#[test]
fn latest_naming_a_missing_file_falls_back_to_the_newest_that_exists() {
    let dir = fresh_dir("missing");
    let _c = Cleanup(dir.clone());
    three_checkpoints(&dir);
    std::fs::remove_file(dir.join(ckpt_name(3))).expect("remove");
    assert_eq!(loaded_step(&dir), 2);
    // A `latest` that names nothing the store could write, or is empty.
    std::fs::write(dir.join("latest"), b"ckpt-../../etc/passwd").expect("write");
    assert_eq!(loaded_step(&dir), 2);
    std::fs::write(dir.join("latest"), b"").expect("write");
    assert_eq!(loaded_step(&dir), 2);
    std::fs::remove_file(dir.join("latest")).expect("remove");
    assert_eq!(loaded_step(&dir), 2);
}

#[test]
fn latest_is_preferred_over_a_newer_file_it_does_not_name() {
    // A kill between the checkpoint's rename and `latest`'s: the newer file
    // is whole, but `latest` still names the older one, which is in force.
    let dir = fresh_dir("order");
    let _c = Cleanup(dir.clone());
    three_checkpoints(&dir);
    std::fs::write(dir.join("latest"), ckpt_name(2)).expect("write");
    assert_eq!(loaded_step(&dir), 2);
}

#[test]
fn checkpoints_of_which_none_verifies_are_an_error_not_a_fresh_start() {
    let dir = fresh_dir("none");
    let _c = Cleanup(dir.clone());
    three_checkpoints(&dir);
    for s in 1..=3 {
        std::fs::write(dir.join(ckpt_name(s)), b"not a checkpoint").expect("write");
    }
    match latest_checkpoint(&dir) {
        Err(Error::RunDir { message, .. }) => {
            assert!(message.contains("none of its 3 checkpoints"), "{message}")
        }
        other => panic!("damaged checkpoints loaded as {other:?}"),
    }
}

#[test]
fn a_write_killed_before_its_rename_leaves_the_previous_checkpoint_in_force() {
    let dir = fresh_dir("killed");
    let _c = Cleanup(dir.clone());
    let states = three_checkpoints(&dir);
    // What a writer killed mid-write leaves: a partial temporary under the
    // tensor layer's name for it, of another (dead) process.
    let whole = std::fs::read(dir.join(ckpt_name(3))).expect("read");
    let dead = dir.join(format!(".{}.tmp-999999999-0", ckpt_name(4)));
    std::fs::write(&dead, &whole[..whole.len() / 3]).expect("write");
    let dead_final = dir.join(format!(".{FINAL_NAME}.tmp-999999999-1"));
    std::fs::write(&dead_final, b"partial").expect("write");
    let (_, state) = latest_checkpoint(&dir).expect("load").expect("one");
    assert!(same(&state, &states[2]));
    // The next checkpoint removes the dead writer's temporaries (they would
    // pile up, one per kill) and keeps the newest three checkpoints.
    save_checkpoint(&dir, &state_at(4)).expect("save");
    assert!(!dead.exists(), "a dead writer's temporary is left");
    assert!(!dead_final.exists(), "a dead writer's temporary is left");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ckpt_name(2),
            ckpt_name(3),
            ckpt_name(4),
            "latest".to_string()
        ]
    );
    assert_eq!(loaded_step(&dir), 4);
}

#[test]
fn only_other_processes_temporaries_are_stale() {
    let me = std::process::id();
    assert!(stale_temporary(".ckpt-000000000004.safetensors.tmp-1-0"));
    assert!(stale_temporary(".final.safetensors.tmp-1-7"));
    assert!(!stale_temporary(&format!(
        ".ckpt-000000000004.safetensors.tmp-{me}-0"
    )));
    assert!(!stale_temporary("ckpt-000000000004.safetensors"));
    assert!(!stale_temporary(".latest.tmp"));
    assert!(!stale_temporary(".ckpt-4.tmp-x-0"));
    assert!(!stale_temporary(".other.tmp-1-0"));
}
