//! Resume in a fresh process: train to step K, save the `TrainState` as
//! named tensors to a file, let a new process (this binary again, in its
//! child role) build a fresh replica with fresh variables, load the file into
//! it, train to step N and save; its final state must equal the
//! uninterrupted run's bit for bit. For both built-in models, both
//! optimizers, and both the local step and the four-rank reference.
//!
//! A test binary without libtest (`harness = false`): `main` is the parent
//! unless `REGENT_TRAIN_RESUME_CHILD` names a child's task.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{Opt, assert_same, differ, one_thread, small_gpt, small_mlp};
use regent_train::{DataSource, Model, Reference, Replica, TrainState};
use tch::Tensor;

const CHILD_ENV: &str = "REGENT_TRAIN_RESUME_CHILD";
const STOP_AT: u64 = 7;
const STEPS: u64 = 16;
const CHILD_DEADLINE: Duration = Duration::from_secs(300);

/// How steps are taken.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Local,
    Reference4,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Reference4 => "w4",
        }
    }

    fn parse(s: &str) -> Mode {
        match s {
            "local" => Mode::Local,
            "w4" => Mode::Reference4,
            _ => panic!("unknown mode {s}"),
        }
    }
}

fn advance<M: Model, D: DataSource>(r: &mut Replica<M, D>, mode: Mode, to: u64) {
    let mut reference = Reference::new();
    while r.step() < to {
        match mode {
            Mode::Local => r.local_step().map(drop),
            Mode::Reference4 => reference.step(r, 4).map(drop),
        }
        .unwrap();
    }
}

fn save(state: &TrainState, path: &Path) {
    Tensor::save_multi(&state.to_named_tensors(), path).unwrap();
}

fn load(path: &Path) -> TrainState {
    TrainState::from_named_tensors(Tensor::load_multi(path).unwrap()).unwrap()
}

/// The child: fresh replica, load, continue, save.
fn child<M: Model, D: DataSource>(mut fresh: Replica<M, D>, mode: Mode, dir: &Path) {
    let at = load(&dir.join("at_k.pt"));
    // The fresh replica really is fresh: its variables differ from the state's.
    assert!(differ(&fresh.state().unwrap(), &at));
    fresh.restore(&at).unwrap();
    advance(&mut fresh, mode, STEPS);
    save(&fresh.state().unwrap(), &dir.join("final.pt"));
}

/// Kills and reaps the child unless it was waited for.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run_child(task: &str) {
    let exe = std::env::current_exe().unwrap();
    let mut guard = ChildGuard(Some(
        Command::new(exe).env(CHILD_ENV, task).spawn().unwrap(),
    ));
    let deadline = Instant::now() + CHILD_DEADLINE;
    let status = loop {
        let child = guard.0.as_mut().expect("child present until reaped");
        if let Some(status) = child.try_wait().unwrap() {
            guard.0 = None;
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "child {task} did not finish within {CHILD_DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "child {task} failed: {status}");
}

fn parent<M: Model, D: DataSource>(
    build: impl Fn() -> Replica<M, D>,
    model: &str,
    opt: Opt,
    mode: Mode,
) {
    let name = format!("{model}-{}-{}", opt.name(), mode.name());
    let dir = TempDir(
        std::env::temp_dir().join(format!("regent-train-resume-{}-{name}", std::process::id())),
    );
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut r = build();
    advance(&mut r, mode, STOP_AT);
    save(&r.state().unwrap(), &dir.0.join("at_k.pt"));
    advance(&mut r, mode, STEPS);
    let uninterrupted = r.state().unwrap();

    run_child(&format!(
        "{model}:{}:{}:{}",
        opt.name(),
        mode.name(),
        dir.0.display()
    ));
    let resumed = load(&dir.0.join("final.pt"));
    assert_eq!(resumed.step, STEPS);
    assert_same(&uninterrupted, &resumed, &name);
    println!("test resume {name} ... ok");
}

fn main() {
    one_thread();
    if let Ok(task) = std::env::var(CHILD_ENV) {
        let mut parts = task.splitn(4, ':');
        let (model, opt, mode, dir) = (
            parts.next().unwrap(),
            Opt::parse(parts.next().unwrap()),
            Mode::parse(parts.next().unwrap()),
            PathBuf::from(parts.next().unwrap()),
        );
        match model {
            "mlp" => child(small_mlp(opt), mode, &dir),
            "gpt" => child(small_gpt(opt), mode, &dir),
            _ => panic!("unknown model {model}"),
        }
        return;
    }
    for opt in Opt::ALL {
        for mode in [Mode::Local, Mode::Reference4] {
            parent(|| small_mlp(opt), "mlp", opt, mode);
            parent(|| small_gpt(opt), "gpt", opt, mode);
        }
    }
}
