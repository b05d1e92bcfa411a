//! What every allocator keeps about its procs: where each runs, who waits
//! for its start or its stop, the event stream, and the stream of its
//! procs' output lines.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use regent_net::{ProcAddr, ProcId};
use tokio::sync::{mpsc, oneshot};

use super::{AllocError, AllocatedProc, ProcEvent, ProcStatus};
use crate::logs::LogLine;

/// Why a proc did not become ready.
#[derive(Debug, Clone)]
pub(crate) enum StartFailure {
    Exited(ProcStatus),
    HostLost(String),
}

type ReadyTx = oneshot::Sender<Result<(ProcAddr, u32), StartFailure>>;
/// Resolves when a proc is ready (its address and pid) or cannot be.
pub(crate) type ReadyRx = oneshot::Receiver<Result<(ProcAddr, u32), StartFailure>>;
type StopTx = oneshot::Sender<Result<ProcStatus, String>>;

struct Tracked {
    host: String,
    pid: Option<u32>,
    /// Set once ready; only ready procs' exits become events.
    addr: Option<ProcAddr>,
    ready: Option<ReadyTx>,
    stops: Vec<StopTx>,
}

pub(crate) struct Tracker {
    procs: Mutex<HashMap<ProcId, Tracked>>,
    events: mpsc::Sender<ProcEvent>,
    events_rx: Mutex<Option<mpsc::Receiver<ProcEvent>>>,
    dropped: AtomicU64,
    logs: mpsc::Sender<LogLine>,
    logs_rx: Mutex<Option<mpsc::Receiver<LogLine>>>,
    logs_taken: AtomicBool,
    /// Lines dropped since the last one handed on (the channel was full).
    logs_dropped: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain maps: nothing a panicking holder could leave half-done matters.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tracker {
    pub(crate) fn new(event_buffer: usize) -> Self {
        let (events, rx) = mpsc::channel(event_buffer.max(1));
        let (logs, logs_rx) = mpsc::channel(event_buffer.max(1));
        Self {
            procs: Mutex::new(HashMap::new()),
            events,
            events_rx: Mutex::new(Some(rx)),
            dropped: AtomicU64::new(0),
            logs,
            logs_rx: Mutex::new(Some(logs_rx)),
            logs_taken: AtomicBool::new(false),
            logs_dropped: AtomicU64::new(0),
        }
    }

    /// The procs' output lines from now on (once); until then they go to
    /// this process's stderr.
    pub(crate) fn take_logs(&self) -> Option<mpsc::Receiver<LogLine>> {
        let rx = lock(&self.logs_rx).take();
        self.logs_taken.store(true, Ordering::Release);
        rx
    }

    /// One line of a proc's output, from `host` (`None`: the in-process
    /// agent, trusted). A remote host's line counts only for a proc
    /// tracked there. Never waits: past the channel's capacity, lines are
    /// dropped and counted, and a line saying how many follows.
    pub(crate) fn on_log(&self, host: Option<&str>, line: LogLine) {
        if let Some(host) = host
            && lock(&self.procs)
                .get(&line.proc)
                .is_none_or(|t| t.host != host)
        {
            tracing::debug!(%line.proc, host, "a log line of a proc not running there dropped");
            return;
        }
        if !self.logs_taken.load(Ordering::Acquire) {
            let _ = writeln!(std::io::stderr().lock(), "{line}");
            return;
        }
        let dropped = self.logs_dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            let marker = LogLine::dropped(line.proc.clone(), line.stream, dropped);
            if self.logs.try_send(marker).is_err() {
                self.count_dropped(line.weight());
                return;
            }
            self.logs_dropped.fetch_sub(dropped, Ordering::Relaxed);
        }
        if let Err(mpsc::error::TrySendError::Full(line)) = self.logs.try_send(line) {
            // A count of lines dropped upstream keeps its weight.
            self.count_dropped(line.weight());
        }
    }

    /// `n` lines were dropped (here, or upstream): the next line handed on
    /// is preceded by the count.
    pub(crate) fn count_dropped(&self, n: u64) {
        self.logs_dropped.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        lock(&self.events_rx).take()
    }

    pub(crate) fn dropped_events(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn emit(&self, event: ProcEvent) {
        match self.events.try_send(event) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(event)) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(
                        dropped = n,
                        ?event,
                        "allocator event channel full; events dropped"
                    );
                }
            }
        }
    }

    /// Starts tracking a proc placed on `host`; the receiver resolves when it
    /// is ready or cannot be.
    pub(crate) fn register(&self, proc: &ProcId, host: &str) -> Result<ReadyRx, AllocError> {
        let mut procs = lock(&self.procs);
        if procs.contains_key(proc) {
            return Err(AllocError::Spawn {
                proc: proc.clone(),
                message: "a proc of that name is already allocated".into(),
            });
        }
        let (tx, rx) = oneshot::channel();
        procs.insert(
            proc.clone(),
            Tracked {
                host: host.to_owned(),
                pid: None,
                addr: None,
                ready: Some(tx),
                stops: Vec::new(),
            },
        );
        Ok(rx)
    }

    pub(crate) fn set_pid(&self, proc: &ProcId, pid: u32) {
        if let Some(t) = lock(&self.procs).get_mut(proc) {
            t.pid = Some(pid);
        }
    }

    /// Stops tracking a proc that never started.
    pub(crate) fn forget(&self, proc: &ProcId) {
        lock(&self.procs).remove(proc);
    }

    pub(crate) fn host_of(&self, proc: &ProcId) -> Option<String> {
        lock(&self.procs).get(proc).map(|t| t.host.clone())
    }

    /// The procs tracked (started or not).
    pub(crate) fn procs(&self) -> Vec<ProcId> {
        lock(&self.procs).keys().cloned().collect()
    }

    pub(crate) fn on_ready(&self, host: &str, proc: &ProcId, addr: ProcAddr, pid: u32) {
        let mut procs = lock(&self.procs);
        match procs.get_mut(proc) {
            Some(t) if t.host == host && t.addr.is_none() => {
                t.pid = Some(pid);
                t.addr = Some(addr.clone());
                if let Some(tx) = t.ready.take() {
                    let _ = tx.send(Ok((addr, pid)));
                }
            }
            _ => tracing::warn!(%proc, host, "ready report for a proc not starting there"),
        }
    }

    pub(crate) fn on_exited(
        &self,
        host: &str,
        proc: &ProcId,
        status: ProcStatus,
        last_lines: Vec<LogLine>,
    ) {
        let tracked = {
            let mut procs = lock(&self.procs);
            if procs.get(proc).is_none_or(|t| t.host != host) {
                tracing::debug!(%proc, host, %status, "exit of an untracked proc");
                return;
            }
            procs.remove(proc)
        };
        let Some(t) = tracked else { return };
        if let Some(tx) = t.ready {
            let _ = tx.send(Err(StartFailure::Exited(status)));
        }
        for s in t.stops {
            let _ = s.send(Ok(status));
        }
        if t.addr.is_some() {
            self.emit(ProcEvent::Exited {
                proc: proc.clone(),
                status,
                last_lines,
            });
        }
    }

    /// Every proc of `host` is presumed dead.
    pub(crate) fn on_host_lost(&self, host: &str, why: &str) {
        let lost: Vec<(ProcId, Tracked)> = {
            let mut procs = lock(&self.procs);
            let ids: Vec<ProcId> = procs
                .iter()
                .filter(|(_, t)| t.host == host)
                .map(|(p, _)| p.clone())
                .collect();
            ids.into_iter()
                .filter_map(|p| procs.remove(&p).map(|t| (p, t)))
                .collect()
        };
        let mut ready = Vec::new();
        for (proc, t) in lost {
            if let Some(tx) = t.ready {
                let _ = tx.send(Err(StartFailure::HostLost(why.to_owned())));
            }
            for s in t.stops {
                let _ = s.send(Err(format!("host {host} lost: {why}")));
            }
            if t.addr.is_some() {
                ready.push(proc);
            }
        }
        tracing::warn!(host, why, procs = ready.len(), "host lost");
        ready.sort();
        self.emit(ProcEvent::HostLost {
            host: host.to_owned(),
            procs: ready,
        });
    }

    /// Registers a wait for a proc's exit.
    pub(crate) fn stop_waiter(
        &self,
        proc: &ProcId,
    ) -> Result<oneshot::Receiver<Result<ProcStatus, String>>, AllocError> {
        let mut procs = lock(&self.procs);
        let t = procs
            .get_mut(proc)
            .ok_or_else(|| AllocError::UnknownProc(proc.clone()))?;
        let (tx, rx) = oneshot::channel();
        t.stops.push(tx);
        Ok(rx)
    }
}

/// Waits until every proc of a batch is ready, or the first failure.
pub(crate) async fn await_ready(
    waits: Vec<(ProcId, String, ReadyRx)>,
    timeout: Duration,
) -> Result<Vec<AllocatedProc>, AllocError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut out = Vec::with_capacity(waits.len());
    for (proc, host, rx) in waits {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Ok((addr, pid)))) => out.push(AllocatedProc {
                proc,
                addr,
                host,
                pid,
            }),
            Ok(Ok(Err(StartFailure::Exited(status)))) => {
                return Err(AllocError::ExitedEarly { proc, status });
            }
            Ok(Ok(Err(StartFailure::HostLost(why)))) => {
                return Err(AllocError::Host {
                    host,
                    message: format!("lost while proc {proc} started: {why}"),
                });
            }
            // The tracker dropped the sender: the allocator went away.
            Ok(Err(_)) => {
                return Err(AllocError::Host {
                    host,
                    message: "allocator closed".into(),
                });
            }
            Err(_) => return Err(AllocError::NotReady { proc, timeout }),
        }
    }
    Ok(out)
}
