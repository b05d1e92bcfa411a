//! The process table, for the invariant that no process outlives its owner.
//! Reads `/proc`; a zombie (exited, not yet reaped) counts as gone, since
//! on these machines PID 1 does not reap orphans. Thread ids share the pid
//! space and `/proc/<tid>` answers for a thread too, so a pid counts only
//! while it names a process (its thread group's leader): once a proc has
//! exited, its pid may come back as some other process's thread.

use std::time::{Duration, Instant};

/// Whether `pid` names a process (not another process's thread).
fn is_process(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:"))
            .and_then(|t| t.trim().parse::<u32>().ok())
            == Some(pid)
    })
}

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    if pid == 0 || !is_process(pid) {
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
    if !is_process(pid) {
        return false;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_id_is_not_a_live_process() {
        assert!(alive(std::process::id()));
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tx.send(nix::unistd::gettid().as_raw() as u32).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let tid = rx.recv().unwrap();
        assert!(std::path::Path::new(&format!("/proc/{tid}/stat")).exists());
        assert!(
            !alive(tid),
            "thread {tid} of this process counted as a process"
        );
        t.join().unwrap();
    }
}
