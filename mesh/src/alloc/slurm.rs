//! [`SlurmAllocator`]: host agents started by `srun`, one per node, that
//! announce themselves to the controller; then placement as with
//! [`HostAllocator`].
//!
//! # How it runs
//!
//! Inside a Slurm allocation (`salloc`, `sbatch`: `SLURM_JOB_ID` is set),
//! `srun` runs the host agents as a job step of that allocation. Outside
//! one (a test, a login shell), the same `srun` first asks Slurm for a new
//! allocation of the requested nodes and waits until it is granted; nothing
//! else changes.
//!
//! The command is
//!
//! ```text
//! srun --nodes=N --ntasks-per-node=T --ntasks=N*T --job-name=regent-hosts-TAG
//!      --kill-on-bad-exit=0 [srun_args] PROGRAM [host_args]
//!      --credentials DIR --name rh-TAG --name-from-slurm --listen 0.0.0.0:0
//!      --announce <controller addr> --announce-port <allocator port>
//!      --idle-exit-ms MS
//! ```
//!
//! with `REGENT_ROLE=host` in the environment (srun passes the environment
//! on), so `PROGRAM` can be the controller's own binary (the default) or
//! `regent host`-like program. Each agent names itself
//! `rh-TAG-$SLURM_PROCID`, binds the local IP that routes to the controller,
//! and sends a [`crate::host::wire::HostHello`] to the allocator's port.
//!
//! # Credentials
//!
//! Each agent gets its own certificate from the cluster CA. They are passed
//! through a fresh directory `DIR = <shared_dir>/hosts-TAG` of mode 0700
//! (files 0600), on a file system every node sees (the default is
//! `.regent/` under the current directory, which Slurm jobs share by
//! convention). Not stdin: `srun` would copy the same stdin to every task,
//! and each agent needs its own key. Once every agent has announced itself
//! (each loads its files before it binds), the directory is removed.
//!
//! # Lifetime
//!
//! [`SlurmAllocator::shutdown`] stops the procs, then asks each agent to
//! exit ([`crate::host::wire::HostOp::Shutdown`], obeyed only from the
//! controller an agent announced itself to), and `srun` ends with its
//! tasks. (A signal would not do: `srun` answers SIGTERM by killing the
//! step.) Should the controller die, the agents stop its procs when its
//! lease lapses and exit after `host_idle_exit` without owners, which ends
//! the job step.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher as _, Hasher as _};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use regent_net::{ClusterCa, Endpoint, ProcId};
use tokio::sync::mpsc;

use super::host::{HostAllocator, HostAllocatorConfig, HostInfo};
use super::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::boot::{ROLE_ENV, ROLE_HOST};

/// How long `srun` may take to end after SIGTERM before SIGKILL (Slurm's
/// own KillWait is commonly 30 s at most).
const SRUN_STOP_TIMEOUT: Duration = Duration::from_secs(40);
/// How long the agents may take to exit after a shutdown request (their
/// procs are stopped already).
const AGENTS_EXIT_TIMEOUT: Duration = Duration::from_secs(15);

/// Configuration of a [`SlurmAllocator`], with documented defaults. Fields
/// are public; the same-named methods set them builder-style.
#[derive(Debug, Clone)]
pub struct SlurmConfig {
    /// Nodes to run host agents on. Default 1.
    pub nodes: NonZeroU32,
    /// Host agents per node. Default 1 (more only to test several agents on
    /// a one-node cluster).
    pub tasks_per_node: NonZeroU32,
    /// The host agent program. Default: `None`, this process's own
    /// executable (run with `REGENT_ROLE=host`).
    pub host_program: Option<PathBuf>,
    /// Arguments given to the host program before the host options.
    /// Default none (`regent` itself needs `host`).
    pub host_args: Vec<String>,
    /// Environment variables for `srun` and the agents. Default none.
    pub env: Vec<(String, String)>,
    /// The `srun` command. Default `srun` (from `PATH`).
    pub srun: PathBuf,
    /// Extra `srun` arguments (partition, account, time...). Default none.
    pub srun_args: Vec<String>,
    /// A directory on a file system every node sees, for the agents'
    /// credentials. Default: `.regent` under the current directory.
    pub shared_dir: Option<PathBuf>,
    /// How long the agents may take to announce themselves (including the
    /// wait for an allocation outside one). Default 120 s.
    pub start_timeout: Duration,
    /// Agents exit after this long without procs or an owner's live lease.
    /// Default 60 s.
    pub host_idle_exit: Duration,
    /// How procs are placed and started on the agents.
    pub hosts: HostAllocatorConfig,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            nodes: NonZeroU32::MIN,
            tasks_per_node: NonZeroU32::MIN,
            host_program: None,
            host_args: Vec::new(),
            env: Vec::new(),
            srun: PathBuf::from("srun"),
            srun_args: Vec::new(),
            shared_dir: None,
            start_timeout: Duration::from_secs(120),
            host_idle_exit: Duration::from_secs(60),
            hosts: HostAllocatorConfig::default(),
        }
    }
}

impl SlurmConfig {
    /// Sets the node count.
    pub fn nodes(mut self, nodes: NonZeroU32) -> Self {
        self.nodes = nodes;
        self
    }

    /// Sets the agents per node.
    pub fn tasks_per_node(mut self, tasks: NonZeroU32) -> Self {
        self.tasks_per_node = tasks;
        self
    }

    /// Sets the host agent program and its leading arguments.
    pub fn host_program<I, S>(mut self, path: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.host_program = Some(path.into());
        self.host_args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Adds an environment variable for `srun` and the agents.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the `srun` command.
    pub fn srun(mut self, path: impl Into<PathBuf>) -> Self {
        self.srun = path.into();
        self
    }

    /// Adds `srun` arguments.
    pub fn srun_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.srun_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets the shared directory for credentials.
    pub fn shared_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.shared_dir = Some(dir.into());
        self
    }

    /// Sets the start timeout.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Sets the agents' idle exit.
    pub fn host_idle_exit(mut self, idle: Duration) -> Self {
        self.host_idle_exit = idle;
        self
    }

    /// Sets the placement configuration.
    pub fn hosts(mut self, hosts: HostAllocatorConfig) -> Self {
        self.hosts = hosts;
        self
    }
}

/// Whether this process runs inside a Slurm allocation (`SLURM_JOB_ID` is
/// set).
pub fn in_allocation() -> bool {
    std::env::var_os("SLURM_JOB_ID").is_some_and(|v| !v.is_empty())
}

/// Host agents started by `srun` (see the module docs), then placement as
/// with [`HostAllocator`], whose transport-event handling applies too.
pub struct SlurmAllocator {
    hosts: HostAllocator,
    srun: Mutex<Option<tokio::process::Child>>,
    job_name: String,
}

impl std::fmt::Debug for SlurmAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlurmAllocator")
            .field("job_name", &self.job_name)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // An Option<Child>: nothing a panicking holder could leave half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes a directory on drop.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.0.display(), error = %e, "cannot remove the host credentials");
        }
    }
}

fn random_tag() -> String {
    // std's hasher keys are drawn from the OS's random source.
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

fn io(context: &'static str) -> impl Fn(std::io::Error) -> AllocError {
    move |e| AllocError::Io(std::io::Error::new(e.kind(), format!("{context}: {e}")))
}

/// Makes `dir` (mode 0700) and writes one set of credentials per agent.
fn write_credentials(dir: &Path, ca: &ClusterCa, names: &[ProcId]) -> Result<(), AllocError> {
    use std::os::unix::fs::DirBuilderExt as _;
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(io("create the shared directory"))?;
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .map_err(io("create the host credentials directory"))?;
    for name in names {
        ca.issue(
            name,
            regent_net::Role::HostAgent,
            regent_net::Validity::job(),
        )?
        .save(dir)?;
    }
    Ok(())
}

impl SlurmAllocator {
    /// Starts the host agents with `srun`, waits until each has announced
    /// itself to `endpoint` (the controller's), and returns the allocator.
    /// `ca` issues the agents' certificates. Must be called within a tokio
    /// runtime; the controller's endpoint must be reachable from the nodes.
    pub async fn start(
        endpoint: Endpoint,
        ca: &ClusterCa,
        config: SlurmConfig,
    ) -> Result<Self, AllocError> {
        let tag = random_tag();
        let prefix = format!("rh-{tag}");
        let job_name = format!("regent-hosts-{tag}");
        let count = config.nodes.get() * config.tasks_per_node.get();
        let names = (0..count)
            .map(|i| ProcId::new(&format!("{prefix}-{i}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(regent_net::Error::from)?;
        let shared = match &config.shared_dir {
            Some(d) => d.clone(),
            None => std::env::current_dir()
                .map_err(io("current directory"))?
                .join(".regent"),
        };
        let dir = RemoveDir(shared.join(format!("hosts-{tag}")));
        write_credentials(&dir.0, ca, &names)?;

        let controller = endpoint.addr();
        let hosts = HostAllocator::with_config(endpoint, Vec::new(), config.hosts.clone())?;
        let program = match &config.host_program {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(io("current executable"))?,
        };
        let mut command = tokio::process::Command::new(&config.srun);
        command
            .arg(format!("--nodes={}", config.nodes))
            .arg(format!("--ntasks-per-node={}", config.tasks_per_node))
            .arg(format!("--ntasks={count}"))
            .arg(format!("--job-name={job_name}"))
            .arg("--kill-on-bad-exit=0")
            .args(&config.srun_args)
            .arg(&program)
            .args(&config.host_args)
            .arg("--credentials")
            .arg(&dir.0)
            .args([
                "--name",
                &prefix,
                "--name-from-slurm",
                "--listen",
                "0.0.0.0:0",
            ])
            .args(["--announce", &controller.to_string()])
            .args(["--announce-port", &hosts.actor().port(0).to_string()])
            .arg("--idle-exit-ms")
            .arg(config.host_idle_exit.as_millis().to_string())
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .env(ROLE_ENV, ROLE_HOST)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        tracing::info!(job = job_name, nodes = %config.nodes, tasks_per_node = %config.tasks_per_node, program = %program.display(), "starting host agents with srun");
        let child = command
            .spawn()
            .map_err(|e| AllocError::Slurm(format!("cannot run {}: {e}", config.srun.display())))?;
        let this = Self {
            hosts,
            srun: Mutex::new(Some(child)),
            job_name,
        };
        let announced = this
            .hosts
            .await_hellos(&names, config.start_timeout, || {
                let mut srun = lock(&this.srun);
                match srun.as_mut().map(tokio::process::Child::try_wait) {
                    Some(Ok(Some(status))) => Some(format!(
                        "srun ended ({status}) before every host agent announced itself"
                    )),
                    _ => None,
                }
            })
            .await;
        drop(dir);
        match announced {
            Ok(hellos) => {
                tracing::info!(job = this.job_name, hosts = hellos.len(), "host agents up");
                Ok(this)
            }
            Err(e) => {
                this.stop_srun().await;
                Err(match e {
                    AllocError::Capacity(why) => AllocError::Slurm(why),
                    other => other,
                })
            }
        }
    }

    /// Takes the endpoint's transport event stream and watches it for lost
    /// host agents (see [`HostAllocator::watch_transport_events`]).
    pub fn watch_transport_events(self) -> Result<Self, AllocError> {
        self.hosts.watch_events()?;
        Ok(self)
    }

    /// Reacts to a transport event (see
    /// [`HostAllocator::handle_transport_event`]).
    pub fn handle_transport_event(&self, event: &regent_net::TransportEvent) {
        self.hosts.handle_transport_event(event);
    }

    /// The placement over the announced agents.
    pub fn hosts(&self) -> &HostAllocator {
        &self.hosts
    }

    /// The agents.
    pub fn host_info(&self) -> Vec<HostInfo> {
        self.hosts.hosts()
    }

    /// The Slurm job name of the agents' step (`regent-hosts-TAG`).
    pub fn job_name(&self) -> &str {
        &self.job_name
    }

    /// The pid of the `srun` process, while it runs.
    pub fn srun_pid(&self) -> Option<u32> {
        lock(&self.srun)
            .as_ref()
            .and_then(tokio::process::Child::id)
    }

    /// Stops every proc (SIGTERM, then SIGKILL after `grace`), then asks
    /// the agents to exit ([`crate::host::wire::HostOp::Shutdown`]) and
    /// waits for `srun` to end with them. Should `srun` not end in time, it
    /// gets SIGTERM (Slurm then kills the step), then SIGKILL.
    pub async fn shutdown(&self, grace: Duration) {
        self.hosts.shutdown(grace).await;
        for (host, e) in self.hosts.shutdown_hosts().await {
            tracing::warn!(%host, error = %e, "host agent did not accept the shutdown");
        }
        let Some(mut child) = lock(&self.srun).take() else {
            return;
        };
        match tokio::time::timeout(AGENTS_EXIT_TIMEOUT, child.wait()).await {
            Ok(Ok(status)) => {
                tracing::info!(job = self.job_name, %status, "srun ended");
                return;
            }
            Ok(Err(e)) => tracing::warn!(job = self.job_name, error = %e, "cannot wait for srun"),
            Err(_) => tracing::warn!(
                job = self.job_name,
                "srun did not end after the agents' shutdown"
            ),
        }
        *lock(&self.srun) = Some(child);
        self.stop_srun().await;
    }

    /// SIGTERM to `srun` (Slurm kills the step), SIGKILL if it lingers.
    async fn stop_srun(&self) {
        let Some(mut child) = lock(&self.srun).take() else {
            return;
        };
        if let Some(pid) = child.id()
            && let Ok(pid) = i32::try_from(pid)
        {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        match tokio::time::timeout(SRUN_STOP_TIMEOUT, child.wait()).await {
            Ok(Ok(status)) => tracing::info!(job = self.job_name, %status, "srun ended"),
            Ok(Err(e)) => tracing::warn!(job = self.job_name, error = %e, "cannot wait for srun"),
            Err(_) => {
                tracing::warn!(job = self.job_name, "srun ignored SIGTERM; killing it");
                let _ = child.kill().await;
            }
        }
    }
}

impl Drop for SlurmAllocator {
    fn drop(&mut self) {
        let Some(mut child) = lock(&self.srun).take() else {
            return;
        };
        // SIGTERM lets srun end the step; a task reaps it if a runtime is
        // still there (kill_on_drop kills it otherwise).
        if let Some(pid) = child.id()
            && let Ok(pid) = i32::try_from(pid)
        {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if tokio::time::timeout(SRUN_STOP_TIMEOUT, child.wait())
                    .await
                    .is_err()
                {
                    let _ = child.kill().await;
                }
            });
        }
    }
}

impl Allocator for SlurmAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        self.hosts.allocate(boots)
    }

    fn stop(&self, proc: &ProcId, grace: Duration) -> AllocFuture<'_, ProcStatus> {
        self.hosts.stop(proc, grace)
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        self.hosts.signal(proc, signal)
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        self.hosts.take_events()
    }

    fn take_logs(&self) -> Option<mpsc::Receiver<crate::logs::LogLine>> {
        self.hosts.take_logs()
    }
    fn transport_event(&self, event: &regent_net::TransportEvent) {
        self.handle_transport_event(event);
    }
}
