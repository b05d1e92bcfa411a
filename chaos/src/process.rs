//! The process table, for the invariant that no process outlives its owner.
//! Reads `/proc`; a zombie (exited, not yet reaped) counts as gone, since
//! on these machines PID 1 does not reap orphans.

use std::time::{Duration, Instant};

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Whether process `pid` is stopped (SIGSTOP).
pub fn stopped(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "T"),
        Err(_) => false,
    }
}

/// Waits (asynchronously, polling every 20 ms) until none of `pids` is
/// alive or `deadline` passes; returns those still alive.
pub async fn wait_gone(pids: &[u32], deadline: Duration) -> Vec<u32> {
    let end = Instant::now() + deadline;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || Instant::now() >= end {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILLs `pid` (for cleanup guards; faults go through the allocator).
pub fn kill(pid: u32) {
    if let Ok(raw) = i32::try_from(pid)
        && raw > 0
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(raw),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}
