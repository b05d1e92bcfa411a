//! `regent host`: a [`HostAgent`] on its own endpoint, serving owners'
//! requests over QUIC with mutual TLS and pushing events back to them.
//!
//! Started by hand (`regent host --credentials DIR --listen ADDR`), or by
//! `SlurmAllocator` through `srun` (then it announces itself
//! to its controller with [`HostHello`] and exits once idle). A user binary
//! can serve as its own host agent: when [`crate::boot::role`] is
//! [`crate::boot::Role::Host`], call [`run_from_args`] with its arguments.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regent_net::{
    ActorId, Delivery, Endpoint, EndpointConfig, Generation, Message as _, Payload, PortId,
    ProcAddr, ProcCredentials, ProcId, Role, TypeTag,
};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::host::HostError;
use crate::host::agent::{HostAgent, HostConfig, HostEvent, HostLog, SpawnSpec};
use crate::host::wire::{
    self, HostHello, HostOp, HostReply, HostRequest, MAX_STOP_GRACE, ProcExited, ProcLogs,
    ProcReady, Renew, ReplyOk, RequestId, SpawnRequest,
};
use crate::logs::MAX_LOG_BATCH;

/// Spawn requests handled at once; more wait in the port's inbox.
const MAX_SPAWNS_IN_FLIGHT: usize = 64;
/// Messages queued towards one owner; past it, events to that owner are
/// dropped (and counted) rather than held without bound.
const OWNER_QUEUE: usize = 4096;
/// How long, after the agent stopped, queued events may take to leave.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// The options of `regent host`.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The directory with the agent's credentials (`<name>.crt`,
    /// `<name>.key`, `ca.crt`, as written by `regent ca issue`).
    pub credentials: PathBuf,
    /// The agent's proc id; default: the one `<name>.key` in `credentials`
    /// (besides `ca.key`).
    pub name: Option<String>,
    /// Append `-$SLURM_PROCID` to `name` (one agent per Slurm task).
    pub name_from_slurm: bool,
    /// Where to listen. An unspecified IP (`0.0.0.0`) is replaced by the
    /// local IP that routes to `announce`, which is then required. Default
    /// `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// A controller to announce this agent to ([`HostHello`]).
    pub announce: Option<ProcAddr>,
    /// The port the announcement goes to; default
    /// `<announce proc>/regent-alloc[0]#0`.
    pub announce_port: Option<PortId>,
    /// Exit after this long with no proc and no owner with a live lease.
    pub idle_exit: Option<Duration>,
    /// The agent's configuration (default program, limits, lease stops).
    pub config: HostConfig,
    /// The endpoint's configuration.
    pub endpoint: EndpointConfig,
}

/// The usage text of [`HostOptions::from_args`].
pub const USAGE: &str = "\
regent host: a host agent that starts procs for controllers authenticated by the cluster CA
(certificates with the controller role; `regent ca issue --role host-agent` makes its own).
SIGHUP reloads its credentials from --credentials (renewal before they expire).

Options:
  --credentials DIR        credentials of this agent (<name>.crt, <name>.key, ca.crt)
  --name NAME              proc id of this agent (default: the one <name>.key in DIR)
  --name-from-slurm        append -$SLURM_PROCID to NAME
  --listen ADDR            UDP address to listen on (default 127.0.0.1:0; with an
                           unspecified IP, the local IP that routes to --announce)
  --announce ADDR          announce this agent to quic://IP:PORT/PROC
  --announce-port PORT     the port to announce to (default PROC/regent-alloc[0]#0)
  --program PATH           program run for spawns that name none (default: this executable)
  --idle-exit-ms N         exit after N ms with no proc and no live owner lease
  --lease-stop-grace-ms N  SIGTERM-to-SIGKILL grace when a lease lapses (default 5000,
                           at most 3600000)
  --max-procs N            procs at most (default 1024)
  --failure-timeout-ms N   link failure timeout of the endpoint (default 1000)";

impl HostOptions {
    /// Options with defaults and the given credentials directory.
    pub fn new(credentials: impl Into<PathBuf>) -> Self {
        Self {
            credentials: credentials.into(),
            name: None,
            name_from_slurm: false,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            announce: None,
            announce_port: None,
            idle_exit: None,
            config: HostConfig::default(),
            endpoint: EndpointConfig::default(),
        }
    }

    /// Parses the command-line options of [`USAGE`] (without the program
    /// name).
    pub fn from_args<I, S>(args: I) -> Result<Self, HostError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let bad = |m: String| HostError::Options(m);
        let mut credentials = None;
        let mut o = Self::new("");
        let mut it = args.into_iter().map(Into::into);
        while let Some(flag) = it.next() {
            if flag == "--name-from-slurm" {
                o.name_from_slurm = true;
                continue;
            }
            if flag == "--help" || flag == "-h" {
                return Err(bad(USAGE.to_owned()));
            }
            let value = it
                .next()
                .ok_or_else(|| bad(format!("{flag} needs a value")))?;
            let ms = |v: &str| {
                v.parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|_| bad(format!("{flag}: {v:?} is not a number of milliseconds")))
            };
            match flag.as_str() {
                "--credentials" => credentials = Some(PathBuf::from(value)),
                "--name" => o.name = Some(value),
                "--listen" => {
                    o.listen = value
                        .parse()
                        .map_err(|_| bad(format!("--listen: {value:?} is not IP:PORT")))?;
                }
                "--announce" => {
                    o.announce = Some(
                        value
                            .parse()
                            .map_err(|e| bad(format!("--announce {value:?}: {e}")))?,
                    );
                }
                "--announce-port" => {
                    o.announce_port = Some(
                        value
                            .parse()
                            .map_err(|e| bad(format!("--announce-port {value:?}: {e}")))?,
                    );
                }
                "--program" => o.config.program = Some(PathBuf::from(value)),
                "--idle-exit-ms" => o.idle_exit = Some(ms(&value)?),
                "--lease-stop-grace-ms" => {
                    let grace = ms(&value)?;
                    if grace > MAX_STOP_GRACE {
                        return Err(bad(format!(
                            "--lease-stop-grace-ms {value} is longer than {MAX_STOP_GRACE:?}"
                        )));
                    }
                    o.config.lease_stop_grace = grace;
                }
                "--max-procs" => {
                    o.config.max_procs = value
                        .parse::<NonZeroUsize>()
                        .map_err(|_| bad(format!("--max-procs: {value:?}")))?;
                }
                "--failure-timeout-ms" => {
                    o.endpoint = o.endpoint.failure_timeout(ms(&value)?);
                }
                other => return Err(bad(format!("unknown option {other}\n\n{USAGE}"))),
            }
        }
        o.credentials =
            credentials.ok_or_else(|| bad(format!("--credentials is required\n\n{USAGE}")))?;
        Ok(o)
    }

    /// The agent's proc id, from `name`, the credentials directory and
    /// `SLURM_PROCID`.
    pub fn proc_id(&self) -> Result<ProcId, HostError> {
        let base = match &self.name {
            Some(n) => n.clone(),
            None => single_key_name(&self.credentials)?,
        };
        let name = if self.name_from_slurm {
            let rank = std::env::var("SLURM_PROCID").map_err(|_| {
                HostError::Options(
                    "--name-from-slurm outside a Slurm task (no SLURM_PROCID)".into(),
                )
            })?;
            format!("{base}-{rank}")
        } else {
            base
        };
        ProcId::new(&name).map_err(|e| HostError::Options(format!("agent name {name:?}: {e}")))
    }
}

/// The stem of the one `*.key` file in `dir` besides `ca.key`.
fn single_key_name(dir: &Path) -> Result<String, HostError> {
    let entries = std::fs::read_dir(dir).map_err(|source| HostError::Io {
        context: "read the credentials directory",
        source,
    })?;
    let mut names = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "key")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
            && stem != "ca"
        {
            names.push(stem.to_owned());
        }
    }
    match names.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(HostError::Options(format!(
            "{} holds {} keys; name the agent with --name",
            dir.display(),
            names.len()
        ))),
    }
}

/// The local IP that routes to `target` (a connected UDP socket sends
/// nothing; it only asks the kernel for a route).
fn local_ip_towards(target: SocketAddr) -> Result<IpAddr, HostError> {
    let io = |source| HostError::Io {
        context: "find the local address towards the controller",
        source,
    };
    let unspecified: SocketAddr = if target.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let socket = UdpSocket::bind(unspecified).map_err(io)?;
    socket.connect(target).map_err(io)?;
    Ok(socket.local_addr().map_err(io)?.ip())
}

/// A running `regent host`.
pub struct HostServer {
    agent: HostAgent,
    events: mpsc::Receiver<HostEvent>,
    logs: mpsc::Receiver<HostLog>,
    requests: mpsc::Receiver<Delivery>,
    announce: Option<(ProcAddr, PortId)>,
    idle_exit: Option<Duration>,
}

impl std::fmt::Debug for HostServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostServer")
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

impl HostServer {
    /// Loads the credentials and binds the agent's endpoint. Must be called
    /// within a tokio runtime.
    pub fn bind(options: HostOptions) -> Result<Self, HostError> {
        let proc = options.proc_id()?;
        let credentials = ProcCredentials::load(&options.credentials, proc)?;
        if credentials.role() != Role::HostAgent {
            return Err(HostError::Options(format!(
                "the certificate of {} is a {}'s, not a host agent's (`regent ca issue --role host-agent`)",
                credentials.proc(),
                credentials.role()
            )));
        }
        let mut listen = options.listen;
        if listen.ip().is_unspecified() {
            let target = options.announce.as_ref().ok_or_else(|| {
                HostError::Options(
                    "--listen with an unspecified IP needs --announce (to find the IP peers reach)"
                        .into(),
                )
            })?;
            listen.set_ip(local_ip_towards(target.socket)?);
        }
        let endpoint = Endpoint::bind(credentials, listen, options.endpoint)?;
        let (requests_tx, requests) = mpsc::channel(MAX_SPAWNS_IN_FLIGHT);
        let (agent, events) = HostAgent::start_inner(endpoint, options.config, Some(requests_tx))?;
        // Invariant: the agent was just started, so its logs are not taken.
        let logs = agent.take_logs().expect("a new agent's logs are not taken");
        let announce = match options.announce {
            Some(addr) => {
                let port = match options.announce_port {
                    Some(p) => p,
                    None => wire::alloc_actor(&addr.proc, 0).port(0),
                };
                Some((addr, port))
            }
            None => None,
        };
        Ok(Self {
            agent,
            events,
            logs,
            requests,
            announce,
            idle_exit: options.idle_exit,
        })
    }

    /// The agent's address.
    pub fn addr(&self) -> ProcAddr {
        self.agent.addr()
    }

    /// The agent.
    pub fn agent(&self) -> &HostAgent {
        &self.agent
    }

    /// Serves until `shutdown` completes, the agent has been idle for
    /// `idle_exit`, or the endpoint closes; then stops every proc (with the
    /// lease-stop grace) and reports their exits before returning.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), HostError> {
        let endpoint = self.agent.endpoint().clone();
        let me = wire::host_actor(endpoint.proc());
        if let Some((addr, port)) = &self.announce {
            endpoint.add_route(addr.clone());
            let hello = HostHello {
                addr: endpoint.addr(),
                pid: std::process::id(),
                hostname: nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            };
            endpoint
                .send(&me, port, Generation(0), hello)
                .await
                .map_err(|e| {
                    HostError::Options(format!("cannot announce to {addr}: {}", e.failure))
                })?;
            tracing::info!(%addr, %port, "announced");
        }
        let mut owners = Owners::new(endpoint.clone(), me.clone());
        let mut spawns: JoinSet<(ActorId, HostReply)> = JoinSet::new();
        let idle_period = self.idle_exit.map_or(Duration::from_secs(1), |d| {
            (d / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
        });
        let mut idle_tick = tokio::time::interval(idle_period);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => {
                    tracing::info!("shutting down");
                    break;
                }
                Some(event) = self.events.recv() => owners.event(event),
                Some(log) = self.logs.recv() => owners.logs(log, &mut self.logs),
                Some(done) = spawns.join_next(), if !spawns.is_empty() => match done {
                    Ok((owner, reply)) => owners.send(&owner, Outgoing::Reply(reply)),
                    Err(e) => tracing::error!(error = %e, "spawn task failed"),
                },
                request = self.requests.recv(), if spawns.len() < MAX_SPAWNS_IN_FLIGHT => {
                    let Some(delivery) = request else {
                        tracing::info!("endpoint closed");
                        break;
                    };
                    let announce = self.announce.as_ref().map(|(addr, _)| &addr.proc);
                    if handle(&self.agent, announce, &mut owners, &mut spawns, delivery) == Next::Exit {
                        break;
                    }
                }
                _ = idle_tick.tick() => {
                    if let (Some(limit), Some(since)) = (self.idle_exit, self.agent.idle_since())
                        && since.elapsed() >= limit
                    {
                        tracing::info!(idle_for = ?since.elapsed(), "idle: exiting");
                        break;
                    }
                }
            }
        }
        spawns.shutdown().await;
        let grace = self.agent.config().lease_stop_grace;
        self.agent.shutdown(grace).await;
        while let Ok(log) = self.logs.try_recv() {
            owners.logs(log, &mut self.logs);
        }
        while let Ok(event) = self.events.try_recv() {
            owners.event(event);
        }
        owners.flush().await;
        endpoint.close();
        let _ = tokio::time::timeout(FLUSH_TIMEOUT, endpoint.wait_idle()).await;
        Ok(())
    }
}

/// Whether the server should stop after a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Serve,
    Exit,
}

/// Serves one request or renewal from an owner: only controllers may make
/// them (the refusal is logged, and a request answered with it).
fn handle(
    agent: &HostAgent,
    announce: Option<&ProcId>,
    owners: &mut Owners,
    spawns: &mut JoinSet<(ActorId, HostReply)>,
    delivery: Delivery,
) -> Next {
    const REQUEST: TypeTag = TypeTag::of::<HostRequest>();
    const RENEW: TypeTag = TypeTag::of::<Renew>();
    let owner = delivery.sender.clone();
    let role = delivery.sender_role;
    match delivery.type_tag {
        RENEW if role != Role::Controller => {
            let e = HostError::Forbidden {
                sender: owner.clone(),
                role,
                what: "hold a lease",
            };
            tracing::warn!(%owner, %role, error = %e, "renewal refused");
        }
        RENEW => match delivery.decode::<Renew>() {
            Ok(Renew { lease }) => {
                if let Err(e) = agent.renew(&owner, lease) {
                    tracing::warn!(%owner, error = %e, "renewal refused");
                }
            }
            Err(e) => tracing::warn!(%owner, error = %e, "bad {}", Renew::TYPE_NAME),
        },
        REQUEST => {
            // The id comes first on the wire: a request that does not decode
            // (or may not be made) is still answered.
            let id = match &delivery.payload {
                Payload::Wire(bytes) => postcard::take_from_bytes::<RequestId>(bytes)
                    .ok()
                    .map(|(id, _)| id),
                Payload::Local(_) => None,
            };
            let refuse = |owners: &mut Owners, e: HostError| {
                tracing::warn!(%owner, %role, error = %e, "request refused");
                if let Some(id) = id {
                    owners.send(
                        &owner,
                        Outgoing::Reply(HostReply {
                            id,
                            outcome: Err(e.to_string()),
                        }),
                    );
                }
            };
            if role != Role::Controller {
                let e = HostError::Forbidden {
                    sender: owner.clone(),
                    role,
                    what: "spawn, stop, signal or shut down procs",
                };
                refuse(owners, e);
                return Next::Serve;
            }
            let request = match delivery.decode::<HostRequest>() {
                Ok(r) => r,
                Err(e) => {
                    let e = HostError::Invalid(format!(
                        "{} does not decode (a lease is at most {:?}, a proc's owner lease at most {:?}, a stop grace at most {:?}): {e}",
                        HostRequest::TYPE_NAME,
                        wire::MAX_LEASE,
                        crate::boot::MAX_OWNER_LEASE,
                        MAX_STOP_GRACE,
                    ));
                    refuse(owners, e);
                    return Next::Serve;
                }
            };
            let id = request.id;
            let reply = move |outcome: Result<ReplyOk, HostError>| HostReply {
                id,
                outcome: outcome.map_err(|e| e.to_string()),
            };
            let owned = |proc: &ProcId| match agent.owner_of(proc) {
                Some(o) if o == owner => Ok(()),
                Some(_) => Err(HostError::NotOwner {
                    proc: proc.clone(),
                    owner: owner.clone(),
                }),
                None => Err(HostError::UnknownProc(proc.clone())),
            };
            match request.op {
                HostOp::Spawn(spawn) => {
                    let SpawnRequest {
                        boot,
                        program,
                        args,
                        env,
                        lease,
                    } = *spawn;
                    if boot.owner.proc != owner.proc {
                        let e = HostError::Invalid(format!(
                            "boot names owner {} but the request came from {}",
                            boot.owner.proc, owner.proc
                        ));
                        owners.send(&owner, Outgoing::Reply(reply(Err(e))));
                        return Next::Serve;
                    }
                    let agent = agent.clone();
                    let spec = SpawnSpec {
                        boot,
                        program: program.map(PathBuf::from),
                        args,
                        env,
                    };
                    spawns.spawn(async move {
                        let outcome = agent
                            .spawn(&owner, Some(lease), spec)
                            .await
                            .map(|pid| ReplyOk::Spawned { pid });
                        (owner, reply(outcome))
                    });
                }
                HostOp::Stop { proc, grace } => {
                    let outcome = owned(&proc)
                        .and_then(|()| agent.request_stop(&proc, grace))
                        .map(|()| ReplyOk::Done);
                    owners.send(&owner, Outgoing::Reply(reply(outcome)));
                }
                HostOp::Signal { proc, signal } => {
                    let outcome = owned(&proc)
                        .and_then(|()| agent.signal(&proc, signal))
                        .map(|()| ReplyOk::Done);
                    owners.send(&owner, Outgoing::Reply(reply(outcome)));
                }
                HostOp::Shutdown => {
                    if announce == Some(&owner.proc) {
                        tracing::info!(%owner, "shutdown requested by the controller");
                        owners.send(&owner, Outgoing::Reply(reply(Ok(ReplyOk::Done))));
                        return Next::Exit;
                    }
                    let e = HostError::Invalid(format!(
                        "only the controller this agent was started for may shut it down, not {}",
                        owner.proc
                    ));
                    owners.send(&owner, Outgoing::Reply(reply(Err(e))));
                }
            }
        }
        other => tracing::warn!(%owner, type_tag = ?other, "unknown message on the host port"),
    }
    Next::Serve
}

/// A message to an owner.
enum Outgoing {
    Reply(HostReply),
    Ready(ProcReady),
    Exited(ProcExited),
    Logs(ProcLogs),
}

/// One queue and sending task per owner, so a slow owner delays only its
/// own messages; all go from the agent's actor, so they stay in order.
struct Owners {
    endpoint: Endpoint,
    me: ActorId,
    queues: HashMap<ActorId, mpsc::Sender<Outgoing>>,
    tasks: JoinSet<()>,
    dropped: u64,
    /// Per owner, log lines dropped since its last batch.
    logs_dropped: HashMap<ActorId, u64>,
}

impl Owners {
    fn new(endpoint: Endpoint, me: ActorId) -> Self {
        Self {
            endpoint,
            me,
            queues: HashMap::new(),
            tasks: JoinSet::new(),
            dropped: 0,
            logs_dropped: HashMap::new(),
        }
    }

    fn event(&mut self, event: HostEvent) {
        match event {
            HostEvent::Ready {
                owner,
                proc,
                addr,
                pid,
            } => self.send(&owner, Outgoing::Ready(ProcReady { proc, addr, pid })),
            HostEvent::Exited {
                owner,
                proc,
                pid,
                status,
                last_lines,
            } => self.send(
                &owner,
                Outgoing::Exited(ProcExited {
                    proc,
                    pid,
                    status,
                    last_lines,
                }),
            ),
        }
    }

    /// Sends `first` and the lines queued behind it (at most
    /// [`MAX_LOG_BATCH`] in all) in one batch per owner. Batches use at
    /// most half an owner's queue, so they never crowd out its replies and
    /// events; past that they are dropped, and the next batch says how
    /// many lines were.
    fn logs(&mut self, first: HostLog, more: &mut mpsc::Receiver<HostLog>) {
        let mut batches: Vec<(ActorId, Vec<crate::logs::LogLine>)> = Vec::new();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(log) = next.take() {
            match batches.iter_mut().find(|(o, _)| *o == log.owner) {
                Some((_, lines)) => lines.push(log.line),
                None => batches.push((log.owner, vec![log.line])),
            }
            taken += 1;
            if taken < MAX_LOG_BATCH {
                next = more.try_recv().ok();
            }
        }
        for (owner, lines) in batches {
            let room = self
                .queues
                .get(&owner)
                .is_none_or(|q| q.capacity() > OWNER_QUEUE / 2);
            if !room {
                *self.logs_dropped.entry(owner).or_default() += lines.len() as u64;
                continue;
            }
            let dropped = self.logs_dropped.remove(&owner).unwrap_or(0);
            self.send(&owner, Outgoing::Logs(ProcLogs { lines, dropped }));
        }
        if self.logs_dropped.len() > 1024 {
            self.logs_dropped.clear();
        }
    }

    fn send(&mut self, owner: &ActorId, message: Outgoing) {
        // Reap the tasks of owners that went away (their senders dropped).
        while self.tasks.try_join_next().is_some() {}
        let queue = self.queues.entry(owner.clone()).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(OWNER_QUEUE);
            self.tasks.spawn(forward(
                self.endpoint.clone(),
                self.me.clone(),
                owner.port(0),
                rx,
            ));
            tx
        });
        if queue.try_send(message).is_err() {
            self.dropped += 1;
            if self.dropped.is_power_of_two() {
                tracing::warn!(%owner, dropped = self.dropped, "owner queue full: messages dropped");
            }
        }
        // Bound the map: forget owners with nothing queued once it is large.
        if self.queues.len() > 1024 {
            self.queues.retain(|_, q| q.capacity() < q.max_capacity());
        }
    }

    /// Lets queued messages leave, for at most [`FLUSH_TIMEOUT`].
    async fn flush(mut self) {
        self.queues.clear();
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        while !self.tasks.is_empty() {
            if tokio::time::timeout_at(deadline, self.tasks.join_next())
                .await
                .is_err()
            {
                tracing::warn!("events to owners not all sent before exit");
                break;
            }
        }
    }
}

async fn forward(endpoint: Endpoint, me: ActorId, to: PortId, mut rx: mpsc::Receiver<Outgoing>) {
    while let Some(message) = rx.recv().await {
        let failure = match message {
            Outgoing::Reply(m) => endpoint
                .send(&me, &to, Generation(0), m)
                .await
                .err()
                .map(|e| e.failure),
            Outgoing::Ready(m) => endpoint
                .send(&me, &to, Generation(0), m)
                .await
                .err()
                .map(|e| e.failure),
            Outgoing::Exited(m) => endpoint
                .send(&me, &to, Generation(0), m)
                .await
                .err()
                .map(|e| e.failure),
            Outgoing::Logs(m) => endpoint
                .send(&me, &to, Generation(0), m)
                .await
                .err()
                .map(|e| e.failure),
        };
        if let Some(failure) = failure {
            tracing::warn!(owner = %to, %failure, "cannot send to owner");
        }
    }
}

/// The main of a host agent process: parses `args` ([`USAGE`]), binds,
/// prints `regent-host listening on <addr>` on stdout, and serves until
/// SIGTERM or SIGINT (or idle, with `--idle-exit-ms`), then stops its
/// procs. SIGHUP reloads the agent's credentials from the credentials
/// directory (see [`regent_net::Endpoint::renew_credentials`]). Must be
/// called within a tokio runtime.
pub async fn run_from_args<I, S>(args: I) -> Result<(), HostError>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let options = HostOptions::from_args(args)?;
    let credentials = options.credentials.clone();
    let proc = options.proc_id()?;
    let server = HostServer::bind(options)?;
    println!("regent-host listening on {}", server.addr());
    let io = |source| HostError::Io {
        context: "install signal handlers",
        source,
    };
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    let mut hup = signal(SignalKind::hangup()).map_err(io)?;
    let endpoint = server.agent().endpoint().clone();
    let reload = tokio::spawn(async move {
        while hup.recv().await.is_some() {
            match ProcCredentials::load(&credentials, proc.clone())
                .and_then(|c| endpoint.renew_credentials(c))
            {
                Ok(()) => {
                    tracing::info!(not_after = ?endpoint.credentials_not_after(), "credentials reloaded");
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot reload credentials; keeping the old ones")
                }
            }
        }
    });
    let result = server
        .run(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        })
        .await;
    reload.abort();
    result
}
