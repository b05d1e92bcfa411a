//! The process table, for tests that must leave no process behind.

use std::time::{Duration, Instant};

pub use regent_chaos::process::{alive, kill};

/// Waits until none of `pids` is alive; returns those still alive at the
/// deadline.
pub fn wait_gone(pids: &[u32], deadline: Duration) -> Vec<u32> {
    let end = Instant::now() + deadline;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || Instant::now() >= end {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills every listed process still alive when dropped: a test that fails
/// halfway leaves nothing running.
#[derive(Debug, Default)]
pub struct KillOnDrop {
    pids: std::sync::Mutex<Vec<u32>>,
}

impl KillOnDrop {
    /// Watches these processes too.
    pub fn watch(&self, pids: impl IntoIterator<Item = u32>) {
        self.pids.lock().expect("pids lock").extend(pids);
    }

    /// The processes watched.
    pub fn pids(&self) -> Vec<u32> {
        self.pids.lock().expect("pids lock").clone()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in self.pids.lock().expect("pids lock").iter() {
            if alive(*pid) {
                kill(*pid);
            }
        }
    }
}
