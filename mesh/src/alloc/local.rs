//! [`LocalAllocator`]: procs as child processes of the controller, on this
//! machine. The default: no setup.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use regent_net::{ActorId, Endpoint, ProcId};
use tokio::sync::mpsc;

use super::tracker::{Tracker, await_ready};
use super::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::host::wire;
use crate::host::{HostAgent, HostConfig, HostError, HostEvent, SpawnSpec};

/// The `host` of every proc a [`LocalAllocator`] starts.
pub const LOCAL_HOST: &str = "local";

/// Configuration of a [`LocalAllocator`], with documented defaults. Fields
/// are public; the same-named methods set them builder-style.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The executable run as procs. Default: `None`, this process's own
    /// (`std::env::current_exe()`), so user actor types exist in procs.
    pub program: Option<PathBuf>,
    /// Arguments of every proc. Default none.
    pub args: Vec<String>,
    /// Environment variables of every proc, on top of this process's own.
    /// Default none.
    pub env: Vec<(String, String)>,
    /// How long a proc may take to report ready. Default 30 s.
    pub start_timeout: Duration,
    /// The IP procs bind (port 0). Default 127.0.0.1.
    pub bind_ip: IpAddr,
    /// Capacity of the [`ProcEvent`] channel; events past it are dropped
    /// and counted ([`LocalAllocator::dropped_events`]). Default 4096.
    pub event_buffer: NonZeroUsize,
    /// The in-process host agent's configuration.
    pub host: HostConfig,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            program: None,
            args: Vec::new(),
            env: Vec::new(),
            start_timeout: Duration::from_secs(30),
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            event_buffer: NonZeroUsize::new(4096).expect("4096 is not zero"),
            host: HostConfig::default(),
        }
    }
}

impl LocalConfig {
    /// Sets the proc executable.
    pub fn program(mut self, path: impl Into<PathBuf>) -> Self {
        self.program = Some(path.into());
        self
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the start timeout.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Sets the IP procs bind.
    pub fn bind_ip(mut self, ip: IpAddr) -> Self {
        self.bind_ip = ip;
        self
    }

    /// Sets the event channel capacity.
    pub fn event_buffer(mut self, capacity: NonZeroUsize) -> Self {
        self.event_buffer = capacity;
        self
    }

    /// Sets the host agent's configuration.
    pub fn host(mut self, host: HostConfig) -> Self {
        self.host = host;
        self
    }
}

/// Starts procs as child processes of this process, through a
/// [`HostAgent`] running in-process on the controller's endpoint (procs
/// report ready to its port there). Procs die with this process
/// (parent-death signal) and when the allocator is dropped.
pub struct LocalAllocator {
    agent: HostAgent,
    tracker: Arc<Tracker>,
    owner: ActorId,
    config: LocalConfig,
    pump: tokio::task::AbortHandle,
    logs: tokio::task::AbortHandle,
}

impl std::fmt::Debug for LocalAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalAllocator")
            .field("agent", &self.agent)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Drop for LocalAllocator {
    fn drop(&mut self) {
        self.pump.abort();
        self.logs.abort();
    }
}

impl LocalAllocator {
    /// An allocator with the default configuration on the controller's
    /// endpoint. Opens the host agent's port on it. Must be called within a
    /// tokio runtime.
    pub fn new(endpoint: Endpoint) -> Result<Self, AllocError> {
        Self::with_config(endpoint, LocalConfig::default())
    }

    /// An allocator with `config`.
    pub fn with_config(endpoint: Endpoint, config: LocalConfig) -> Result<Self, AllocError> {
        let owner = wire::alloc_actor(endpoint.proc(), 0);
        let (agent, events) =
            HostAgent::start(endpoint, config.host.clone()).map_err(host_error)?;
        let tracker = Arc::new(Tracker::new(config.event_buffer.get()));
        let pump = tokio::spawn(pump(events, tracker.clone())).abort_handle();
        let logs = agent.take_logs().map_or_else(
            || tokio::spawn(async {}).abort_handle(),
            |mut lines| {
                let tracker = tracker.clone();
                tokio::spawn(async move {
                    while let Some(log) = lines.recv().await {
                        tracker.on_log(None, log.line);
                    }
                })
                .abort_handle()
            },
        );
        Ok(Self {
            agent,
            tracker,
            owner,
            config,
            pump,
            logs,
        })
    }

    /// Sets the proc executable (builder-style).
    pub fn program(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.program = Some(path.into());
        self
    }

    /// Adds proc arguments (builder-style).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.config.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds a proc environment variable (builder-style).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.env.push((key.into(), value.into()));
        self
    }

    /// Sets the start timeout (builder-style).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.config.start_timeout = timeout;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &LocalConfig {
        &self.config
    }

    /// The in-process host agent.
    pub fn agent(&self) -> &HostAgent {
        &self.agent
    }

    /// Events dropped because the event channel was full.
    pub fn dropped_events(&self) -> u64 {
        self.tracker.dropped_events()
    }

    /// Stops every proc (SIGTERM, then SIGKILL after `grace`) and waits
    /// until all have exited.
    pub async fn shutdown(&self, grace: Duration) {
        self.agent.shutdown(grace).await;
    }

    async fn allocate_inner(&self, boots: Vec<ProcBoot>) -> Result<Vec<AllocatedProc>, AllocError> {
        let mut waits = Vec::with_capacity(boots.len());
        let mut started: Vec<ProcId> = Vec::new();
        let result = async {
            for mut boot in boots {
                boot.parent = self.agent.addr();
                boot.bind = SocketAddr::new(self.config.bind_ip, 0);
                let proc = boot.proc.clone();
                let ready = self.tracker.register(&proc, LOCAL_HOST)?;
                let mut args = self.config.args.clone();
                args.extend(boot.placement.args.iter().cloned());
                let mut env = self.config.env.clone();
                env.extend(boot.placement.env.iter().cloned());
                let spec = SpawnSpec {
                    boot,
                    program: self.config.program.clone(),
                    args,
                    env,
                };
                match self.agent.spawn(&self.owner, None, spec).await {
                    Ok(pid) => {
                        self.tracker.set_pid(&proc, pid);
                        started.push(proc.clone());
                        waits.push((proc, LOCAL_HOST.to_owned(), ready));
                    }
                    Err(e) => {
                        self.tracker.forget(&proc);
                        return Err(AllocError::Spawn {
                            proc,
                            message: e.to_string(),
                        });
                    }
                }
            }
            await_ready(std::mem::take(&mut waits), self.config.start_timeout).await
        }
        .await;
        if result.is_err() {
            for proc in &started {
                // Killed at once: it never served anything.
                if let Ok(status) = self.agent.stop(proc, Duration::ZERO).await {
                    tracing::debug!(%proc, %status, "stopped after a failed allocation");
                }
                self.tracker.forget(proc);
            }
        }
        result
    }
}

fn host_error(e: HostError) -> AllocError {
    match e {
        HostError::UnknownProc(p) => AllocError::UnknownProc(p),
        HostError::Net(e) => AllocError::Net(e),
        other => AllocError::Host {
            host: LOCAL_HOST.into(),
            message: other.to_string(),
        },
    }
}

async fn pump(mut events: mpsc::Receiver<HostEvent>, tracker: Arc<Tracker>) {
    while let Some(event) = events.recv().await {
        match event {
            HostEvent::Ready {
                proc, addr, pid, ..
            } => tracker.on_ready(LOCAL_HOST, &proc, addr, pid),
            HostEvent::Exited {
                proc,
                status,
                last_lines,
                ..
            } => tracker.on_exited(LOCAL_HOST, &proc, status, last_lines),
        }
    }
}

impl Allocator for LocalAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        Box::pin(self.allocate_inner(boots))
    }

    fn stop(&self, proc: &ProcId, grace: Duration) -> AllocFuture<'_, ProcStatus> {
        let proc = proc.clone();
        Box::pin(async move {
            let exited = self.tracker.stop_waiter(&proc)?;
            match self.agent.request_stop(&proc, grace) {
                // Exited just now: its exit event is on its way.
                Ok(()) | Err(HostError::UnknownProc(_)) => {}
                Err(e) => return Err(host_error(e)),
            }
            match exited.await {
                Ok(Ok(status)) => Ok(status),
                Ok(Err(message)) => Err(AllocError::Host {
                    host: LOCAL_HOST.into(),
                    message,
                }),
                Err(_) => Err(AllocError::UnknownProc(proc)),
            }
        })
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        let result = self.agent.signal(proc, signal).map_err(host_error);
        Box::pin(async move { result })
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        self.tracker.take_events()
    }

    fn take_logs(&self) -> Option<mpsc::Receiver<crate::logs::LogLine>> {
        self.tracker.take_logs()
    }
}
