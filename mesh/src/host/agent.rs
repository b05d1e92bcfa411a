//! The host agent's core: starts proc processes, watches them, reports each
//! exit at once, stops and signals them, and enforces owners' leases.
//!
//! The same [`HostAgent`] runs inside the controller (for
//! `LocalAllocator`, on the controller's own endpoint) and
//! inside `regent host` ([`crate::host::HostServer`], on the host agent's
//! endpoint, taking requests from owners over QUIC).
//!
//! Each proc is watched by one task that owns its `tokio::process::Child`:
//! it awaits the child (`waitpid` through tokio's reaper, woken by the
//! kernel, not polled), delivers signals (so no signal can reach a reused
//! pid: the pid is only signalled before the same task reaps it), escalates
//! a stop from SIGTERM to SIGKILL after the grace period, and reports the
//! proc's ready and exit events in that order.
//!
//! Each proc's stdout and stderr are pipes read by two tasks that cut them
//! into lines ([`crate::logs::LineSplitter`]), keep the last ones (they
//! come with the exit) and hand them on without ever waiting: past
//! [`HostConfig::log_buffer`] lines are dropped and counted (a
//! `regent: N lines dropped` line follows). Until [`HostAgent::take_logs`]
//! is called, lines go to the agent's own stderr, prefixed with the proc.
//!
//! Procs are started from one dedicated thread ("regent-spawner") that lives
//! as long as the agent: the parent-death signal a proc sets fires when the
//! *thread* that forked it ends, so forking from a runtime worker (which can
//! be retired) could kill procs at random. Dropping the agent ends that
//! thread, and every proc gets SIGKILL; the drop also kills and reaps what
//! is left, so no zombie outlives the agent.

use std::collections::HashMap;
use std::io::Write as _;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::sys::wait::{WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use regent_net::{ActorId, Delivery, Endpoint, Message as _, ProcAddr, ProcId, Role, TypeTag};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::boot::{self, PARENT_PID_ENV, ROLE_ENV, ROLE_PROC};
use crate::boot::{ProcBoot, ProcSignal};
use crate::host::HostError;
use crate::host::wire::{self, MAX_LEASE, MAX_SPAWN_ARGS, MAX_SPAWN_ENV, MAX_STOP_GRACE, Ready};
use crate::logs::{LineSplitter, LogLine, LogStream, Tail};
use crate::policy::ProcStatus;

/// Configuration of a host agent, with documented defaults. Fields are
/// public; the same-named methods set them builder-style.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The program run for a spawn that names none. Default: `None`, this
    /// process's own executable (`std::env::current_exe()`).
    pub program: Option<PathBuf>,
    /// The most procs running at once. Default 1024.
    pub max_procs: NonZeroUsize,
    /// The most owners (with procs or a lease) at once. Default 256.
    pub max_owners: NonZeroUsize,
    /// Capacity of the event channel ([`HostEvent`]s). A full channel makes
    /// the watching tasks wait (one per proc, so it stays bounded); events
    /// are never dropped. Default 4096.
    pub event_buffer: NonZeroUsize,
    /// How long a proc whose owner's lease lapsed may take to exit after
    /// SIGTERM before SIGKILL. Default 5 s; at most
    /// [`wire::MAX_STOP_GRACE`].
    pub lease_stop_grace: Duration,
    /// How often leases are checked. Default 50 ms.
    pub lease_check_interval: Duration,
    /// How long writing a proc's boot to its stdin may take before the proc
    /// is killed. Default 5 s.
    pub boot_write_timeout: Duration,
    /// Capacity of the channel of procs' output lines ([`HostLog`]s); past
    /// it, lines are dropped and counted (procs never wait). Default 4096.
    pub log_buffer: NonZeroUsize,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            program: None,
            max_procs: NonZeroUsize::new(1024).expect("1024 is not zero"),
            max_owners: NonZeroUsize::new(256).expect("256 is not zero"),
            event_buffer: NonZeroUsize::new(4096).expect("4096 is not zero"),
            lease_stop_grace: Duration::from_secs(5),
            lease_check_interval: Duration::from_millis(50),
            boot_write_timeout: Duration::from_secs(5),
            log_buffer: NonZeroUsize::new(4096).expect("4096 is not zero"),
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Self {
                self.$name = value;
                self
            }
        )*
    };
}

impl HostConfig {
    setters! {
        /// Sets the default program.
        program: Option<PathBuf>;
        /// Sets the proc limit.
        max_procs: NonZeroUsize;
        /// Sets the owner limit.
        max_owners: NonZeroUsize;
        /// Sets the event channel capacity.
        event_buffer: NonZeroUsize;
        /// Sets the grace of a lease stop.
        lease_stop_grace: Duration;
        /// Sets the lease check period.
        lease_check_interval: Duration;
        /// Sets the boot write timeout.
        boot_write_timeout: Duration;
        /// Sets the capacity of the log line channel.
        log_buffer: NonZeroUsize;
    }
}

/// How to start one proc.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    /// Its boot (`parent` should be the agent's endpoint).
    pub boot: ProcBoot,
    /// The program; `None` runs [`HostConfig::program`].
    pub program: Option<PathBuf>,
    /// Its arguments (at most [`MAX_SPAWN_ARGS`]).
    pub args: Vec<String>,
    /// Environment variables on top of the agent's own (at most
    /// [`MAX_SPAWN_ENV`]); [`ROLE_ENV`] and [`PARENT_PID_ENV`] are always
    /// set by the agent.
    pub env: Vec<(String, String)>,
}

/// What a host agent reports about its procs, in order per proc: at most
/// one `Ready`, then one `Exited`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEvent {
    /// A proc reported ready.
    Ready {
        /// Its owner.
        owner: ActorId,
        /// The proc.
        proc: ProcId,
        /// Its endpoint.
        addr: ProcAddr,
        /// Its pid.
        pid: u32,
    },
    /// A proc process ended.
    Exited {
        /// Its owner.
        owner: ActorId,
        /// The proc.
        proc: ProcId,
        /// Its pid.
        pid: u32,
        /// How it ended.
        status: ProcStatus,
        /// Its last lines of output (at most
        /// [`crate::logs::MAX_TAIL_LINES`], both streams, the partial last
        /// line included).
        last_lines: Vec<LogLine>,
    },
}

/// One line of a proc's output, for its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLog {
    /// The proc's owner.
    pub owner: ActorId,
    /// The line.
    pub line: LogLine,
}

/// A proc as the agent knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostedProc {
    /// The proc.
    pub proc: ProcId,
    /// Its owner.
    pub owner: ActorId,
    /// Its pid (0 while it is being started).
    pub pid: u32,
    /// Whether it reported ready.
    pub ready: bool,
}

/// Commands to the task that watches one proc.
enum Cmd {
    Ready(ProcAddr),
    Signal(Signal),
    Stop {
        grace: Duration,
        done: Option<oneshot::Sender<ProcStatus>>,
    },
}

struct Entry {
    owner: ActorId,
    pid: u32,
    ready: bool,
    cmds: mpsc::Sender<Cmd>,
}

struct OwnerState {
    lease: Option<Duration>,
    deadline: Option<Instant>,
    lapsed: bool,
    procs: usize,
}

impl OwnerState {
    fn live_lease(&self) -> bool {
        self.lease.is_some() && !self.lapsed
    }
}

#[derive(Default)]
struct State {
    procs: HashMap<ProcId, Entry>,
    owners: HashMap<ActorId, OwnerState>,
    /// Since when the agent has had no proc and no live lease.
    idle_since: Option<Instant>,
    closed: bool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state holds no invariant a panicking holder could break half-way
    // that a later holder relies on (maps of plain values).
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Inner {
    endpoint: Endpoint,
    config: HostConfig,
    state: Mutex<State>,
    events: mpsc::Sender<HostEvent>,
    spawner: Spawner,
    tasks: Mutex<Vec<AbortHandle>>,
    logs: mpsc::Sender<HostLog>,
    logs_rx: Mutex<Option<mpsc::Receiver<HostLog>>>,
    logs_taken: AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in self
            .tasks
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
        let pids: Vec<Pid> = lock(&self.state)
            .procs
            .values()
            .filter(|e| e.pid != 0)
            .map(|e| Pid::from_raw(pid_i32(e.pid)))
            .collect();
        kill_and_reap(&pids);
    }
}

/// SIGKILLs `pids` and reaps them, waiting up to 2 s in all. The watching
/// tasks may reap some first; either way none is left a zombie.
fn kill_and_reap(pids: &[Pid]) {
    for &pid in pids {
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut left: Vec<Pid> = pids.to_vec();
    while !left.is_empty() && std::time::Instant::now() < deadline {
        left.retain(
            |&pid| match nix::sys::wait::waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => true,
                // Reaped now, or already reaped by its watcher (ECHILD).
                Ok(_) | Err(_) => false,
            },
        );
        if !left.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    if !left.is_empty() {
        tracing::warn!(?left, "procs not reaped within 2 s of SIGKILL");
    }
}

/// The deadline `lease` from now, if the lease is within [`MAX_LEASE`].
fn lease_deadline(lease: Duration) -> Result<Instant, HostError> {
    if lease > MAX_LEASE {
        return Err(HostError::Invalid(format!(
            "a lease of {lease:?} is longer than {MAX_LEASE:?}"
        )));
    }
    Instant::now()
        .checked_add(lease)
        .ok_or_else(|| HostError::Invalid(format!("a lease of {lease:?} ends past the clock")))
}

/// Checks a stop's grace against [`MAX_STOP_GRACE`].
fn check_grace(grace: Duration) -> Result<(), HostError> {
    if grace > MAX_STOP_GRACE {
        return Err(HostError::Invalid(format!(
            "a stop grace of {grace:?} is longer than {MAX_STOP_GRACE:?}"
        )));
    }
    Ok(())
}

fn pid_i32(pid: u32) -> i32 {
    // Invariant: Linux pids are at most 2^22 (pid_max), so they fit.
    i32::try_from(pid).expect("a pid fits in i32")
}

/// A host agent. Cheap to clone; dropping the last clone kills its procs.
#[derive(Clone)]
pub struct HostAgent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAgent")
            .field("addr", &self.inner.endpoint.addr())
            .field("procs", &lock(&self.inner.state).procs.len())
            .finish()
    }
}

impl HostAgent {
    /// Starts a host agent on `endpoint`: opens its port
    /// ([`wire::host_port`]) for procs' [`Ready`] reports and returns the
    /// agent with its event stream. Requests from other procs on that port
    /// are refused (only [`crate::host::HostServer`] serves them). Must be
    /// called within a tokio runtime.
    pub fn start(
        endpoint: Endpoint,
        config: HostConfig,
    ) -> Result<(Self, mpsc::Receiver<HostEvent>), HostError> {
        Self::start_inner(endpoint, config, None)
    }

    /// Starts the agent; deliveries on its port other than [`Ready`] go to
    /// `requests` if given.
    pub(crate) fn start_inner(
        endpoint: Endpoint,
        config: HostConfig,
        requests: Option<mpsc::Sender<Delivery>>,
    ) -> Result<(Self, mpsc::Receiver<HostEvent>), HostError> {
        check_grace(config.lease_stop_grace)?;
        if config.lease_check_interval.is_zero() || config.lease_check_interval > MAX_LEASE {
            return Err(HostError::Invalid(format!(
                "lease_check_interval {:?} is not in (0, {MAX_LEASE:?}]",
                config.lease_check_interval
            )));
        }
        let inbox = endpoint.open_port(wire::host_port(endpoint.proc()))?;
        let spawner = Spawner::start(tokio::runtime::Handle::current(), config.max_procs.get())?;
        let (events, events_rx) = mpsc::channel(config.event_buffer.get());
        let check = config.lease_check_interval;
        let (logs, logs_rx) = mpsc::channel(config.log_buffer.get());
        let inner = Arc::new(Inner {
            endpoint,
            config,
            state: Mutex::new(State {
                idle_since: Some(Instant::now()),
                ..State::default()
            }),
            events,
            spawner,
            tasks: Mutex::new(Vec::new()),
            logs,
            logs_rx: Mutex::new(Some(logs_rx)),
            logs_taken: AtomicBool::new(false),
        });
        let dispatcher = tokio::spawn(dispatch(Arc::downgrade(&inner), inbox, requests));
        let leases = tokio::spawn(check_leases(Arc::downgrade(&inner), check));
        inner
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([dispatcher.abort_handle(), leases.abort_handle()]);
        Ok((Self { inner }, events_rx))
    }

    /// The agent's endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The agent's address (procs' `boot.parent`).
    pub fn addr(&self) -> ProcAddr {
        self.inner.endpoint.addr()
    }

    /// The configuration.
    pub fn config(&self) -> &HostConfig {
        &self.inner.config
    }

    /// The lines of every proc's output from now on (can be taken once).
    /// Until then they go to this process's stderr.
    pub fn take_logs(&self) -> Option<mpsc::Receiver<HostLog>> {
        let rx = self
            .inner
            .logs_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.inner.logs_taken.store(true, Ordering::Release);
        rx
    }

    /// Starts a proc for `owner` and returns its pid once its boot is
    /// written. With `lease`, the spawn also renews the owner's lease: if
    /// [`Self::renew`] is not called for `lease`, every proc of the owner
    /// is stopped. Its ready report and exit come as [`HostEvent`]s. The
    /// lease and the boot's `owner_lease` are at most [`MAX_LEASE`].
    pub async fn spawn(
        &self,
        owner: &ActorId,
        lease: Option<Duration>,
        spec: SpawnSpec,
    ) -> Result<u32, HostError> {
        let inner = &self.inner;
        let proc = spec.boot.proc.clone();
        let deadline = lease.map(lease_deadline).transpose()?;
        // The proc computes its own lease deadline from this one.
        lease_deadline(spec.boot.owner_lease)?;
        if spec.args.len() > MAX_SPAWN_ARGS {
            return Err(HostError::Invalid(format!(
                "{} arguments (at most {MAX_SPAWN_ARGS})",
                spec.args.len()
            )));
        }
        if spec.env.len() > MAX_SPAWN_ENV {
            return Err(HostError::Invalid(format!(
                "{} environment variables (at most {MAX_SPAWN_ENV})",
                spec.env.len()
            )));
        }
        if let Some((k, _)) = spec
            .env
            .iter()
            .find(|(k, _)| k.is_empty() || k.contains('=') || k.contains('\0'))
        {
            return Err(HostError::Invalid(format!(
                "bad environment variable name {k:?}"
            )));
        }
        let line = boot::encode_boot(&spec.boot).map_err(|e| HostError::Boot {
            proc: proc.clone(),
            message: e.to_string(),
        })?;
        let program = match spec.program.or_else(|| inner.config.program.clone()) {
            Some(p) => p,
            None => std::env::current_exe().map_err(|source| HostError::Io {
                context: "current executable",
                source,
            })?,
        };

        // Reserve the proc's entry (duplicates and limits are checked under
        // the same lock).
        let (cmds, cmd_rx) = mpsc::channel(16);
        {
            let mut st = lock(&inner.state);
            if st.closed {
                return Err(HostError::Closed);
            }
            if st.procs.contains_key(&proc) {
                return Err(HostError::Duplicate(proc));
            }
            if st.procs.len() >= inner.config.max_procs.get() {
                return Err(HostError::TooManyProcs {
                    limit: inner.config.max_procs.get(),
                });
            }
            let owners = st.owners.len();
            let o = match st.owners.get_mut(owner) {
                Some(o) => o,
                None if owners >= inner.config.max_owners.get() => {
                    return Err(HostError::TooManyOwners {
                        limit: inner.config.max_owners.get(),
                    });
                }
                None => st.owners.entry(owner.clone()).or_insert(OwnerState {
                    lease: None,
                    deadline: None,
                    lapsed: false,
                    procs: 0,
                }),
            };
            if let (Some(lease), Some(deadline)) = (lease, deadline) {
                o.lease = Some(lease);
                o.deadline = Some(deadline);
                o.lapsed = false;
            }
            o.procs += 1;
            st.idle_since = None;
            st.procs.insert(
                proc.clone(),
                Entry {
                    owner: owner.clone(),
                    pid: 0,
                    ready: false,
                    cmds: cmds.clone(),
                },
            );
        }

        let mut command = std::process::Command::new(&program);
        command
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env(ROLE_ENV, ROLE_PROC)
            .env(PARENT_PID_ENV, std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match self.inner.spawner.spawn(command).await {
            Ok(child) => child,
            Err(source) => {
                self.forget(&proc);
                return Err(HostError::Spawn {
                    proc,
                    program,
                    source,
                });
            }
        };
        // Invariant: a child that was just spawned and not yet awaited has
        // an id.
        let pid = child.id().expect("a running child has a pid");
        let stdin = child.stdin.take();
        let tail = Arc::new(Mutex::new(Tail::default()));
        let readers = [
            (child.stdout.take().map(boxed), LogStream::Stdout),
            (child.stderr.take().map(boxed), LogStream::Stderr),
        ]
        .into_iter()
        .filter_map(|(pipe, stream)| {
            let out = LogOut {
                proc: proc.clone(),
                owner: owner.clone(),
                stream,
                inner: Arc::downgrade(inner),
                tail: tail.clone(),
                dropped: 0,
            };
            pipe.map(|pipe| tokio::spawn(read_lines(pipe, out)))
        })
        .collect();
        {
            let mut st = lock(&inner.state);
            if let Some(e) = st.procs.get_mut(&proc) {
                e.pid = pid;
            }
        }
        tracing::debug!(%proc, pid, program = %program.display(), %owner, "proc spawned");
        tokio::spawn(watch(
            child,
            (pid, proc.clone(), owner.clone()),
            cmd_rx,
            Arc::downgrade(inner),
            inner.events.clone(),
            Output { readers, tail },
        ));

        // The boot goes to stdin, then stdin closes (EOF ends the proc's
        // read).
        let write = async move {
            let mut stdin = stdin.ok_or_else(|| std::io::Error::other("stdin not piped"))?;
            stdin.write_all(&line).await?;
            stdin.shutdown().await
        };
        let result = tokio::time::timeout(inner.config.boot_write_timeout, write).await;
        let message = match result {
            Ok(Ok(())) => return Ok(pid),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("not read within {:?}", inner.config.boot_write_timeout),
        };
        let _ = cmds.try_send(Cmd::Stop {
            grace: Duration::ZERO,
            done: None,
        });
        Err(HostError::Boot { proc, message })
    }

    /// Removes a reserved entry whose process never started.
    fn forget(&self, proc: &ProcId) {
        let mut st = lock(&self.inner.state);
        if let Some(e) = st.procs.remove(proc) {
            release_owner(&mut st, &e.owner);
        }
    }

    /// Asks a proc to stop (SIGTERM, SIGKILL after `grace`, at most
    /// [`MAX_STOP_GRACE`]) without waiting.
    pub fn request_stop(&self, proc: &ProcId, grace: Duration) -> Result<(), HostError> {
        check_grace(grace)?;
        self.command(proc, Cmd::Stop { grace, done: None })
    }

    /// Stops a proc (SIGTERM, then SIGKILL after `grace`, at most
    /// [`MAX_STOP_GRACE`]) and returns how it ended.
    pub async fn stop(&self, proc: &ProcId, grace: Duration) -> Result<ProcStatus, HostError> {
        check_grace(grace)?;
        let (done, rx) = oneshot::channel();
        self.command(
            proc,
            Cmd::Stop {
                grace,
                done: Some(done),
            },
        )?;
        rx.await.map_err(|_| HostError::Closed)
    }

    /// Delivers a signal to a proc.
    pub fn signal(&self, proc: &ProcId, signal: ProcSignal) -> Result<(), HostError> {
        self.command(proc, Cmd::Signal(to_signal(signal)))
    }

    fn command(&self, proc: &ProcId, cmd: Cmd) -> Result<(), HostError> {
        let cmds = lock(&self.inner.state)
            .procs
            .get(proc)
            .map(|e| e.cmds.clone())
            .ok_or_else(|| HostError::UnknownProc(proc.clone()))?;
        cmds.try_send(cmd).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => HostError::Busy(proc.clone()),
            // The watcher ended: the proc just exited.
            mpsc::error::TrySendError::Closed(_) => HostError::UnknownProc(proc.clone()),
        })
    }

    /// The owner of a proc, if the agent runs it.
    pub fn owner_of(&self, proc: &ProcId) -> Option<ActorId> {
        lock(&self.inner.state)
            .procs
            .get(proc)
            .map(|e| e.owner.clone())
    }

    /// Renews `owner`'s lease for `lease` (at most [`MAX_LEASE`]) from now
    /// (creating the owner if new).
    pub fn renew(&self, owner: &ActorId, lease: Duration) -> Result<(), HostError> {
        let deadline = lease_deadline(lease)?;
        let mut st = lock(&self.inner.state);
        let owners = st.owners.len();
        match st.owners.get_mut(owner) {
            Some(o) => {
                o.lease = Some(lease);
                o.deadline = Some(deadline);
                o.lapsed = false;
            }
            None if owners >= self.inner.config.max_owners.get() => {
                return Err(HostError::TooManyOwners {
                    limit: self.inner.config.max_owners.get(),
                });
            }
            None => {
                st.owners.insert(
                    owner.clone(),
                    OwnerState {
                        lease: Some(lease),
                        deadline: Some(deadline),
                        lapsed: false,
                        procs: 0,
                    },
                );
            }
        }
        st.idle_since = None;
        Ok(())
    }

    /// Whether `owner` has procs here or a live lease.
    pub fn knows_owner(&self, owner: &ActorId) -> bool {
        lock(&self.inner.state).owners.contains_key(owner)
    }

    /// The procs the agent runs.
    pub fn procs(&self) -> Vec<HostedProc> {
        lock(&self.inner.state)
            .procs
            .iter()
            .map(|(proc, e)| HostedProc {
                proc: proc.clone(),
                owner: e.owner.clone(),
                pid: e.pid,
                ready: e.ready,
            })
            .collect()
    }

    /// Since when the agent has had no proc and no owner with a live lease
    /// (`None` while it has either).
    pub fn idle_since(&self) -> Option<Instant> {
        lock(&self.inner.state).idle_since
    }

    /// Refuses new procs, stops every proc (SIGTERM, then SIGKILL after
    /// `grace`, cut to [`MAX_STOP_GRACE`]) and waits until all have exited.
    pub async fn shutdown(&self, grace: Duration) {
        let grace = grace.min(MAX_STOP_GRACE);
        let cmds: Vec<_> = {
            let mut st = lock(&self.inner.state);
            st.closed = true;
            st.procs.values().map(|e| e.cmds.clone()).collect()
        };
        let mut waits = Vec::with_capacity(cmds.len());
        for c in cmds {
            let (done, rx) = oneshot::channel();
            // A full queue: wait for room (bounded: the watcher drains it).
            if c.send(Cmd::Stop {
                grace,
                done: Some(done),
            })
            .await
            .is_ok()
            {
                waits.push(rx);
            }
        }
        for rx in waits {
            let _ = rx.await;
        }
    }
}

fn release_owner(st: &mut State, owner: &ActorId) {
    if let Some(o) = st.owners.get_mut(owner) {
        o.procs = o.procs.saturating_sub(1);
        if o.procs == 0 && !o.live_lease() {
            st.owners.remove(owner);
        }
    }
    if st.procs.is_empty() && !st.owners.values().any(OwnerState::live_lease) {
        st.idle_since.get_or_insert_with(Instant::now);
    }
}

pub(crate) fn to_signal(signal: ProcSignal) -> Signal {
    match signal {
        ProcSignal::Term => Signal::SIGTERM,
        ProcSignal::Kill => Signal::SIGKILL,
        ProcSignal::Stop => Signal::SIGSTOP,
        ProcSignal::Cont => Signal::SIGCONT,
    }
}

fn send_signal(proc: &ProcId, pid: u32, signal: Signal) {
    if let Err(e) = nix::sys::signal::kill(Pid::from_raw(pid_i32(pid)), signal) {
        tracing::warn!(%proc, pid, ?signal, error = %e, "cannot signal proc");
    }
}

/// Watches one proc: the only place that reaps it, so signals never reach a
/// reused pid.
async fn watch(
    mut child: tokio::process::Child,
    (pid, proc, owner): (u32, ProcId, ActorId),
    mut cmds: mpsc::Receiver<Cmd>,
    inner: Weak<Inner>,
    events: mpsc::Sender<HostEvent>,
    output: Output,
) {
    let mut kill_at: Option<Instant> = None;
    let mut stopping = false;
    let mut cmds_open = true;
    let mut waiters: Vec<oneshot::Sender<ProcStatus>> = Vec::new();
    let result = loop {
        tokio::select! {
            // Commands first: a ready report already queued is reported
            // before the exit that follows it.
            biased;
            cmd = cmds.recv(), if cmds_open => match cmd {
                Some(Cmd::Ready(addr)) => {
                    let event = HostEvent::Ready { owner: owner.clone(), proc: proc.clone(), addr, pid };
                    let _ = events.send(event).await;
                }
                Some(Cmd::Signal(signal)) => send_signal(&proc, pid, signal),
                Some(Cmd::Stop { grace, done }) => {
                    waiters.extend(done);
                    // Graces are bounded (MAX_STOP_GRACE) where commands are
                    // made; one past the clock would kill at once.
                    let at = Instant::now().checked_add(grace);
                    if !stopping {
                        stopping = true;
                        if grace.is_zero() || at.is_none() {
                            send_signal(&proc, pid, Signal::SIGKILL);
                        } else {
                            send_signal(&proc, pid, Signal::SIGTERM);
                            // A stopped (SIGSTOP) proc could not act on it.
                            send_signal(&proc, pid, Signal::SIGCONT);
                            kill_at = at;
                        }
                    } else if let (Some(k), Some(at)) = (kill_at, at) {
                        kill_at = Some(k.min(at));
                    }
                }
                None => cmds_open = false,
            },
            () = sleep_until_opt(kill_at) => {
                tracing::debug!(%proc, pid, "stop grace over: SIGKILL");
                send_signal(&proc, pid, Signal::SIGKILL);
                kill_at = None;
            }
            r = child.wait() => break r,
        }
    };
    let status = match result {
        Ok(status) => exit_status(status),
        Err(e) => {
            // Reaped elsewhere (the agent's drop): the status is lost.
            tracing::warn!(%proc, pid, error = %e, "cannot wait for proc");
            ProcStatus::Signal(Signal::SIGKILL as i32)
        }
    };
    tracing::debug!(%proc, pid, %status, "proc exited");
    if let Some(inner) = inner.upgrade() {
        let mut st = lock(&inner.state);
        if st.procs.get(&proc).is_some_and(|e| e.pid == pid) {
            st.procs.remove(&proc);
            release_owner(&mut st, &owner);
        }
    }
    for w in waiters {
        let _ = w.send(status);
    }
    let last_lines = output.finish().await;
    let _ = events
        .send(HostEvent::Exited {
            owner,
            proc,
            pid,
            status,
            last_lines,
        })
        .await;
}

/// How long, after a proc exited, its pipes may take to reach EOF (a
/// process it started may hold them open) before its last lines are taken
/// as they are.
const OUTPUT_EOF_GRACE: Duration = Duration::from_millis(500);

/// The readers of one proc's pipes and the lines they keep.
struct Output {
    readers: Vec<tokio::task::JoinHandle<()>>,
    tail: Arc<Mutex<Tail>>,
}

impl Output {
    /// The last lines, once the readers reached EOF (or after
    /// [`OUTPUT_EOF_GRACE`]).
    async fn finish(self) -> Vec<LogLine> {
        let all = futures::future::join_all(self.readers);
        if tokio::time::timeout(OUTPUT_EOF_GRACE, all).await.is_err() {
            tracing::debug!("a proc's pipes stayed open past its exit");
        }
        self.tail.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

fn boxed(pipe: impl AsyncRead + Send + Unpin + 'static) -> Box<dyn AsyncRead + Send + Unpin> {
    Box::new(pipe)
}

/// Where one pipe's lines go.
struct LogOut {
    proc: ProcId,
    owner: ActorId,
    stream: LogStream,
    inner: Weak<Inner>,
    tail: Arc<Mutex<Tail>>,
    /// Lines dropped since the last one handed on.
    dropped: u64,
}

impl LogOut {
    fn line(&mut self, text: String) {
        let line = LogLine {
            proc: self.proc.clone(),
            stream: self.stream,
            text,
        };
        self.tail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line.clone());
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        if !inner.logs_taken.load(Ordering::Acquire) {
            let _ = writeln!(std::io::stderr().lock(), "{line}");
            return;
        }
        if self.dropped > 0 {
            let marker = LogLine::dropped(self.proc.clone(), self.stream, self.dropped);
            if !self.hand_on(&inner, marker) {
                self.dropped += line.weight();
                return;
            }
            self.dropped = 0;
        }
        let weight = line.weight();
        if !self.hand_on(&inner, line) {
            self.dropped += weight;
        }
    }

    /// Hands a line on without waiting; whether there was room.
    fn hand_on(&self, inner: &Inner, line: LogLine) -> bool {
        let log = HostLog {
            owner: self.owner.clone(),
            line,
        };
        match inner.logs.try_send(log) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => false,
            // Nobody reads any more: nothing to count.
            Err(mpsc::error::TrySendError::Closed(_)) => true,
        }
    }
}

/// Reads one pipe to EOF, line by line.
async fn read_lines(mut pipe: Box<dyn AsyncRead + Send + Unpin>, mut out: LogOut) {
    let mut splitter = LineSplitter::default();
    let mut buf = vec![0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                for text in splitter.push(&buf[..n]) {
                    out.line(text);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(proc = %out.proc, error = %e, "cannot read a proc's output");
                break;
            }
        }
    }
    if let Some(text) = splitter.finish() {
        out.line(text);
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn exit_status(status: std::process::ExitStatus) -> ProcStatus {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => ProcStatus::Code(code),
        (None, Some(signal)) => ProcStatus::Signal(signal),
        // Neither: only for stopped/continued statuses, which wait() does
        // not return.
        (None, None) => ProcStatus::Code(-1),
    }
}

/// Reads the agent's port: procs' ready reports here, anything else to
/// `requests` (the server) or refused.
async fn dispatch(
    inner: Weak<Inner>,
    mut inbox: regent_net::Inbox,
    requests: Option<mpsc::Sender<Delivery>>,
) {
    const READY: TypeTag = TypeTag::of::<Ready>();
    while let Some(delivery) = inbox.recv().await {
        if delivery.type_tag == READY {
            let Some(inner) = inner.upgrade() else { break };
            on_ready(&inner, delivery);
        } else if let Some(requests) = &requests {
            if requests.send(delivery).await.is_err() {
                break;
            }
        } else {
            tracing::warn!(sender = %delivery.sender, type_tag = ?delivery.type_tag, "host port of an in-process agent refuses requests");
        }
    }
}

fn on_ready(inner: &Inner, delivery: Delivery) {
    let sender = delivery.sender.clone();
    if delivery.sender_role != Role::Proc {
        tracing::warn!(%sender, role = %delivery.sender_role, "ready report refused: only procs report ready");
        return;
    }
    let ready = match delivery.decode::<Ready>() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(%sender, error = %e, "bad {}", Ready::TYPE_NAME);
            return;
        }
    };
    let proc = ready.addr.proc.clone();
    if sender.proc != proc {
        tracing::warn!(%sender, claimed = %proc, "ready report for another proc refused");
        return;
    }
    let cmds = {
        let mut st = lock(&inner.state);
        match st.procs.get_mut(&proc) {
            Some(e) if e.pid == ready.pid && !e.ready => {
                e.ready = true;
                e.cmds.clone()
            }
            Some(e) => {
                tracing::warn!(%proc, pid = ready.pid, expected = e.pid, ready = e.ready, "unexpected ready report");
                return;
            }
            None => {
                tracing::debug!(%proc, "ready report of a proc that is gone");
                return;
            }
        }
    };
    if cmds.try_send(Cmd::Ready(ready.addr)).is_err() {
        tracing::warn!(%proc, "proc watcher busy or gone; ready report dropped");
    }
}

/// Stops the procs of owners whose lease lapsed; tracks idleness.
async fn check_leases(inner: Weak<Inner>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { break };
        let now = Instant::now();
        let mut stops = Vec::new();
        {
            let mut st = lock(&inner.state);
            let mut lapsed = Vec::new();
            for (owner, o) in &mut st.owners {
                if !o.lapsed && o.deadline.is_some_and(|d| d <= now) {
                    o.lapsed = true;
                    lapsed.push(owner.clone());
                }
            }
            for owner in &lapsed {
                let procs: Vec<_> = st
                    .procs
                    .iter()
                    .filter(|(_, e)| &e.owner == owner)
                    .map(|(p, e)| (p.clone(), e.cmds.clone()))
                    .collect();
                tracing::warn!(%owner, procs = procs.len(), "owner lease lapsed: stopping its procs");
                stops.extend(procs);
            }
            st.owners.retain(|_, o| o.procs > 0 || o.live_lease());
            if st.procs.is_empty() && !st.owners.values().any(OwnerState::live_lease) {
                st.idle_since.get_or_insert(now);
            }
        }
        for (proc, cmds) in stops {
            let stop = Cmd::Stop {
                grace: inner.config.lease_stop_grace,
                done: None,
            };
            if cmds.send(stop).await.is_err() {
                tracing::debug!(%proc, "proc exited before its lease stop");
            }
        }
    }
}

/// Forks procs from one long-lived thread (see the module docs).
struct Spawner {
    jobs: std::sync::mpsc::SyncSender<SpawnJob>,
}

struct SpawnJob {
    command: std::process::Command,
    reply: oneshot::Sender<std::io::Result<tokio::process::Child>>,
}

impl Spawner {
    fn start(runtime: tokio::runtime::Handle, queue: usize) -> Result<Self, HostError> {
        let (jobs, rx) = std::sync::mpsc::sync_channel::<SpawnJob>(queue);
        std::thread::Builder::new()
            .name("regent-spawner".into())
            .spawn(move || {
                // tokio's child reaper registers with the runtime that is
                // current at spawn time.
                let _runtime = runtime.enter();
                while let Ok(job) = rx.recv() {
                    let mut command = tokio::process::Command::from(job.command);
                    command.kill_on_drop(true);
                    let _ = job.reply.send(command.spawn());
                }
            })
            .map_err(|source| HostError::Io {
                context: "start the spawner thread",
                source,
            })?;
        Ok(Self { jobs })
    }

    async fn spawn(
        &self,
        command: std::process::Command,
    ) -> std::io::Result<tokio::process::Child> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .try_send(SpawnJob { command, reply })
            .map_err(|e| match e {
                std::sync::mpsc::TrySendError::Full(_) => std::io::Error::other("spawn queue full"),
                std::sync::mpsc::TrySendError::Disconnected(_) => {
                    std::io::Error::other("spawner thread gone")
                }
            })?;
        rx.await
            .map_err(|_| std::io::Error::other("spawner thread gone"))?
    }
}
