//! The proc boot protocol: how one binary knows what it is, and how a proc
//! learns who it is from its host agent.
//!
//! A controller's binary is also its procs' and (optionally) its host
//! agents' binary, so that user-defined actor types exist in every proc. The
//! role comes from the environment ([`ROLE_ENV`]): unset for the
//! controller, [`ROLE_HOST`] for a host agent, [`ROLE_PROC`] for a proc.
//!
//! A host agent starts a proc with `REGENT_ROLE=proc` and its own pid in
//! [`PARENT_PID_ENV`], writes the proc's [`ProcBoot`] to the proc's stdin as
//! one line of JSON (at most [`MAX_BOOT_BYTES`]) and closes stdin. The boot
//! holds the proc's private key: it never goes on the command line, in the
//! environment or in a log. [`start_proc`] then:
//!
//! 1. sets the parent-death signal to SIGKILL (`prctl(PR_SET_PDEATHSIG)`),
//!    and checks that the parent is still the host agent named in
//!    [`PARENT_PID_ENV`], which closes the race with a parent that died
//!    before the signal was set: the proc dies with its host agent;
//! 2. reads and checks the boot;
//! 3. binds its QUIC endpoint on `boot.bind` with the credentials of the
//!    boot, and adds routes to its parent and its owner.
//!
//! Once the proc runtime has opened its ports, it calls
//! [`ProcStart::report_ready`], which sends [`Ready`] (the proc's address
//! and pid) to the host agent's port ([`host_port`]).

use std::fmt;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::net::SocketAddr;
use std::time::Duration;

use regent_net::{
    ActorId, Endpoint, EndpointConfig, Generation, Message, PortId, ProcAddr, ProcCredentials,
    ProcId, SendFailure,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt as _};

/// The environment variable that names a process's role.
pub const ROLE_ENV: &str = "REGENT_ROLE";
/// The value of [`ROLE_ENV`] for a proc.
pub const ROLE_PROC: &str = "proc";
/// The value of [`ROLE_ENV`] for a host agent.
pub const ROLE_HOST: &str = "host";
/// The environment variable with the pid of a proc's host agent (its
/// parent), set by the host agent.
pub const PARENT_PID_ENV: &str = "REGENT_PARENT_PID";
/// The largest boot a proc reads from its stdin, in bytes.
pub const MAX_BOOT_BYTES: usize = 64 * 1024;
/// The longest owner lease a boot may carry ([`ProcBoot::owner_lease`]):
/// one day. A longer one does not decode, so a deadline that far from now
/// always exists.
pub const MAX_OWNER_LEASE: Duration = Duration::from_secs(24 * 3600);

/// Decodes an owner lease of at most [`MAX_OWNER_LEASE`].
fn owner_lease<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    use serde::de::Error as _;
    let value = Duration::deserialize(d)?;
    if value > MAX_OWNER_LEASE {
        return Err(D::Error::custom(format!(
            "owner lease of {value:?} is longer than {MAX_OWNER_LEASE:?}"
        )));
    }
    Ok(value)
}

/// What this process is, from [`ROLE_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The user's program (the variable is unset or empty).
    Controller,
    /// A host agent (`REGENT_ROLE=host`).
    Host,
    /// A proc (`REGENT_ROLE=proc`).
    Proc,
}

impl Role {
    /// The role a value of [`ROLE_ENV`] names (`None`: unset).
    pub fn from_env_value(value: Option<&str>) -> Result<Self, BootError> {
        match value {
            None | Some("") => Ok(Self::Controller),
            Some(ROLE_HOST) => Ok(Self::Host),
            Some(ROLE_PROC) => Ok(Self::Proc),
            Some(other) => Err(BootError::UnknownRole(other.to_owned())),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Controller => "controller",
            Self::Host => ROLE_HOST,
            Self::Proc => ROLE_PROC,
        })
    }
}

/// The actor name of a host agent's port (index 0, port 0).
pub const HOST_ACTOR: &str = "regent-host";
/// The actor name a proc sends its [`Ready`] from (index 0).
pub const PROC_ACTOR: &str = "regent-proc";

/// The actor that holds a host agent's port in proc `host`.
pub fn host_actor(host: &ProcId) -> ActorId {
    // Invariant: HOST_ACTOR is a valid actor name (checked by a unit test).
    host.actor(HOST_ACTOR, 0)
        .expect("HOST_ACTOR is a valid actor name")
}

/// The port of the host agent in proc `host`: procs report [`Ready`] there,
/// owners send host requests and renewals there.
pub fn host_port(host: &ProcId) -> PortId {
    host_actor(host).port(0)
}

/// The actor a proc sends its [`Ready`] from.
pub fn proc_actor(proc: &ProcId) -> ActorId {
    // Invariant: PROC_ACTOR is a valid actor name (checked by a unit test).
    proc.actor(PROC_ACTOR, 0)
        .expect("PROC_ACTOR is a valid actor name")
}

/// Tells the host agent that a proc is up: its endpoint is bound and its
/// runtime serves. Sent once by the proc (see
/// [`crate::boot::ProcStart::report_ready`]) to its parent's [`host_port`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// The proc's endpoint.
    pub addr: ProcAddr,
    /// Its OS process id (checked against the spawned child's).
    pub pid: u32,
}

impl Message for Ready {
    const TYPE_NAME: &'static str = "regent/host/Ready";
}

/// Everything a proc needs to start, from its host agent over stdin. Holds a
/// private key: its `Debug` shows no secret, and it is never logged.
#[derive(Clone, Serialize, Deserialize)]
pub struct ProcBoot {
    /// The proc's identity (named by its certificate).
    pub proc: ProcId,
    /// The cluster CA certificate (PEM).
    pub ca_pem: String,
    /// The proc's certificate chain (PEM).
    pub cert_pem: String,
    /// The proc's private key (PEM). Secret.
    pub key_pem: String,
    /// Where to bind the proc's QUIC endpoint (port 0 for any).
    pub bind: SocketAddr,
    /// The endpoint the proc reports readiness to (its host agent), and
    /// whose control messages it accepts.
    pub parent: ProcAddr,
    /// The controller that owns this proc and the meshes on it.
    pub owner: ProcAddr,
    /// How long the proc keeps running without hearing from its owner
    /// before it stops itself (at most [`MAX_OWNER_LEASE`]).
    #[serde(deserialize_with = "owner_lease")]
    pub owner_lease: Duration,
    /// The control plane's settings (the owner's: both sides agree on frame
    /// sizes and timeouts).
    #[serde(default)]
    pub endpoint: regent_net::EndpointConfig,
    /// What this proc rank gets beyond what every proc gets.
    #[serde(default)]
    pub placement: Placement,
    /// The owner's public key: the proc takes commands relayed by other
    /// procs only with the owner's signature (`docs/semantics.md` §4.1,
    /// relayed commands). `None`: it takes none.
    #[serde(default)]
    pub owner_key: Option<crate::owner::OwnerKey>,
}

/// Where a proc rank runs beyond what all procs share: its own environment
/// and arguments (e.g. the device it owns). A replacement proc of the rank
/// gets the same.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Environment variables, set after the allocator's own.
    pub env: Vec<(String, String)>,
    /// Arguments, after the allocator's own.
    pub args: Vec<String>,
}

impl Placement {
    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }
}

impl fmt::Debug for ProcBoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcBoot")
            .field("proc", &self.proc)
            .field("bind", &self.bind)
            .field("parent", &self.parent)
            .field("owner", &self.owner)
            .field("owner_lease", &self.owner_lease)
            .field("placement", &self.placement)
            .finish_non_exhaustive()
    }
}

/// A signal an allocator can deliver to a proc (for chaos tests and stops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcSignal {
    /// SIGTERM.
    Term,
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
    /// SIGCONT.
    Cont,
}

/// This process's role, or an error for a value of [`ROLE_ENV`] that names
/// none.
pub fn try_role() -> Result<Role, BootError> {
    match std::env::var(ROLE_ENV) {
        Ok(value) => Role::from_env_value(Some(&value)),
        Err(std::env::VarError::NotPresent) => Role::from_env_value(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(BootError::UnknownRole("<not unicode>".into()))
        }
    }
}

/// This process's role. A value of [`ROLE_ENV`] that names no role counts
/// as [`Role::Controller`] (with a warning); see [`try_role`].
pub fn role() -> Role {
    try_role().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "treating this process as the controller");
        Role::Controller
    })
}

/// Why a proc could not start or report.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// [`ROLE_ENV`] names no role.
    #[error("{ROLE_ENV}={0:?} names no role (expected unset, {ROLE_HOST:?} or {ROLE_PROC:?})")]
    UnknownRole(String),
    /// [`start_proc`] was called in a process whose role is not a proc.
    #[error("not a proc: this process's role is {0}")]
    NotAProc(Role),
    /// [`PARENT_PID_ENV`] is missing or not a pid.
    #[error("{PARENT_PID_ENV} is missing or not a pid: {0:?}")]
    ParentPid(Option<String>),
    /// The host agent died before the parent-death signal was set.
    #[error("the host agent (pid {expected}) is gone: the parent is now pid {actual}")]
    ParentGone {
        /// The host agent's pid.
        expected: u32,
        /// The parent now.
        actual: u32,
    },
    /// Setting the parent-death signal failed.
    #[error("cannot set the parent-death signal: {0}")]
    DeathSignal(nix::Error),
    /// Reading the boot from stdin failed.
    #[error("cannot read the boot from stdin: {0}")]
    Stdin(#[source] std::io::Error),
    /// The boot is larger than [`MAX_BOOT_BYTES`].
    #[error("the boot is larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The boot is not valid JSON of a [`ProcBoot`]. (Only the position
    /// and kind of the error are kept: the text could hold the key.)
    #[error("the boot does not decode: {0}")]
    Decode(String),
    /// The boot's credentials or endpoint are unusable.
    #[error(transparent)]
    Net(#[from] regent_net::Error),
    /// The ready report could not be sent.
    #[error("cannot report ready: {0}")]
    Report(SendFailure),
}

/// Encodes a boot as the host agent writes it to a proc's stdin: one line
/// of JSON.
pub fn encode_boot(boot: &ProcBoot) -> Result<Vec<u8>, BootError> {
    let mut line = serde_json::to_vec(boot).map_err(|e| BootError::Decode(describe_json(&e)))?;
    line.push(b'\n');
    if line.len() > MAX_BOOT_BYTES {
        return Err(BootError::TooLarge {
            limit: MAX_BOOT_BYTES,
        });
    }
    Ok(line)
}

/// Reads a boot (one JSON value, at most [`MAX_BOOT_BYTES`]) until the end
/// of `reader`.
pub async fn read_boot<R: AsyncRead + Unpin>(reader: R) -> Result<ProcBoot, BootError> {
    let mut bytes = Vec::with_capacity(4096);
    // One byte past the limit tells "exactly at the limit" from "over it".
    let limit = u64::try_from(MAX_BOOT_BYTES).unwrap_or(u64::MAX) + 1;
    reader
        .take(limit)
        .read_to_end(&mut bytes)
        .await
        .map_err(BootError::Stdin)?;
    if bytes.len() > MAX_BOOT_BYTES {
        return Err(BootError::TooLarge {
            limit: MAX_BOOT_BYTES,
        });
    }
    serde_json::from_slice(&bytes).map_err(|e| BootError::Decode(describe_json(&e)))
}

/// A JSON error without its text (which may quote a secret).
fn describe_json(e: &serde_json::Error) -> String {
    format!(
        "{:?} error at line {} column {}",
        e.classify(),
        e.line(),
        e.column()
    )
}

/// A started proc: its boot and its bound endpoint.
pub struct ProcStart {
    /// The boot the host agent gave. Holds the proc's private key (see
    /// [`ProcBoot`]).
    pub boot: ProcBoot,
    /// The proc's endpoint, with routes to its parent and owner.
    pub endpoint: Endpoint,
}

impl fmt::Debug for ProcStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcStart")
            .field("boot", &self.boot)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl ProcStart {
    /// Starts this proc's payload plane with its credentials.
    pub async fn buffer_manager(&self) -> Result<regent_rdma::BufferManager, regent_rdma::Error> {
        let credentials = ProcCredentials::from_pem(
            self.boot.proc.clone(),
            &self.boot.cert_pem,
            &self.boot.key_pem,
            &self.boot.ca_pem,
        )
        .map_err(|e| regent_rdma::Error::Config(e.to_string()))?;
        regent_rdma::BufferManager::start(regent_rdma::ManagerConfig::default(), credentials).await
    }

    /// Tells the host agent that this proc is ready: sends [`Ready`] with
    /// the endpoint's address and this process's pid to the parent's host
    /// port. Call it once the proc runtime serves. `Ok` means accepted by
    /// the transport.
    pub async fn report_ready(&self) -> Result<(), BootError> {
        let ready = Ready {
            addr: self.endpoint.addr(),
            pid: std::process::id(),
        };
        self.endpoint
            .send(
                &proc_actor(&self.boot.proc),
                &host_port(&self.boot.parent.proc),
                Generation(0),
                ready,
            )
            .await
            .map_err(|e| BootError::Report(e.failure))
    }
}

/// Starts this process as a proc with the endpoint settings its boot
/// carries (its owner's); see [`start_proc_with`].
pub async fn start_proc() -> Result<ProcStart, BootError> {
    start_proc_with(None).await
}

/// Starts this process as a proc: parent-death signal, boot from stdin,
/// credentials, endpoint bound on `boot.bind` with `config` (or the boot's
/// settings), routes to the parent and owner. The caller then opens its
/// ports and calls [`ProcStart::report_ready`]. Must be called within a
/// tokio runtime.
pub async fn start_proc_with(config: Option<EndpointConfig>) -> Result<ProcStart, BootError> {
    let role = try_role()?;
    if role != Role::Proc {
        return Err(BootError::NotAProc(role));
    }
    let parent = parent_pid_from_env()?;
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(BootError::DeathSignal)?;
    // The parent may have died before the signal was set: then we were
    // reparented and no signal will ever come.
    let actual = nix::unistd::getppid();
    if actual != parent {
        return Err(BootError::ParentGone {
            expected: parent.as_raw().unsigned_abs(),
            actual: actual.as_raw().unsigned_abs(),
        });
    }
    let boot = read_boot(tokio::io::stdin()).await?;
    let credentials = ProcCredentials::from_pem(
        boot.proc.clone(),
        &boot.cert_pem,
        &boot.key_pem,
        &boot.ca_pem,
    )?;
    let config = config.unwrap_or_else(|| boot.endpoint.clone());
    let endpoint = Endpoint::bind(credentials, boot.bind, config)?;
    endpoint.add_route(boot.parent.clone());
    if boot.owner.proc != boot.parent.proc {
        endpoint.add_route(boot.owner.clone());
    }
    tracing::info!(proc = %boot.proc, addr = %endpoint.addr(), parent = %boot.parent, owner = %boot.owner, "proc started");
    Ok(ProcStart { boot, endpoint })
}

fn parent_pid_from_env() -> Result<Pid, BootError> {
    let value = std::env::var(PARENT_PID_ENV).ok();
    match value.as_deref().map(str::parse::<i32>) {
        Some(Ok(pid)) if pid > 0 => Ok(Pid::from_raw(pid)),
        _ => Err(BootError::ParentPid(value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regent_net::{ClusterCa, ProcAddr, ProcId};
    use std::time::Duration;

    fn boot() -> ProcBoot {
        let ca = ClusterCa::generate("test").unwrap();
        let proc = ProcId::new("p-0").unwrap();
        let (cert_pem, key_pem, ca_pem) = ca
            .issue(&proc, regent_net::Role::Proc, regent_net::Validity::job())
            .unwrap()
            .to_pem();
        ProcBoot {
            proc,
            ca_pem,
            cert_pem,
            key_pem,
            bind: "127.0.0.1:0".parse().unwrap(),
            parent: "quic://127.0.0.1:1/host".parse::<ProcAddr>().unwrap(),
            owner: "quic://127.0.0.1:2/ctl".parse::<ProcAddr>().unwrap(),
            owner_lease: Duration::from_secs(3),
            endpoint: regent_net::EndpointConfig::default(),
            placement: Placement::default(),
            owner_key: Some(crate::owner::OwnerKey([7; 32])),
        }
    }

    #[test]
    fn roles_parse() {
        assert_eq!(Role::from_env_value(None).unwrap(), Role::Controller);
        assert_eq!(Role::from_env_value(Some("")).unwrap(), Role::Controller);
        assert_eq!(Role::from_env_value(Some("host")).unwrap(), Role::Host);
        assert_eq!(Role::from_env_value(Some("proc")).unwrap(), Role::Proc);
        assert!(matches!(
            Role::from_env_value(Some("Proc")),
            Err(BootError::UnknownRole(_))
        ));
    }

    #[tokio::test]
    async fn boot_round_trips_as_one_json_line() {
        let b = boot();
        let line = encode_boot(&b).unwrap();
        assert_eq!(line.iter().filter(|&&c| c == b'\n').count(), 1);
        let back = read_boot(&line[..]).await.unwrap();
        assert_eq!(back.proc, b.proc);
        assert_eq!(back.key_pem, b.key_pem);
        assert_eq!(back.owner, b.owner);
        assert_eq!(back.owner_lease, b.owner_lease);
    }

    #[tokio::test]
    async fn bad_boots_get_typed_errors_without_secrets() {
        let big = vec![b' '; MAX_BOOT_BYTES + 10];
        assert!(matches!(
            read_boot(&big[..]).await,
            Err(BootError::TooLarge { .. })
        ));
        // A secret-looking string where a number belongs is not echoed.
        let text = br#"{"proc": "p", "ca_pem": 5, "cert_pem": "SECRET-KEY"}"#;
        let err = read_boot(&text[..]).await.unwrap_err();
        assert!(matches!(err, BootError::Decode(_)));
        assert!(!err.to_string().contains("SECRET"), "{err}");
        // The Debug of a boot shows no key.
        let b = boot();
        assert!(!format!("{b:?}").contains("PRIVATE KEY"));
    }

    #[tokio::test]
    async fn an_owner_lease_longer_than_the_bound_does_not_decode() {
        let mut b = boot();
        b.owner_lease = MAX_OWNER_LEASE;
        let line = encode_boot(&b).unwrap();
        assert_eq!(
            read_boot(&line[..]).await.unwrap().owner_lease,
            MAX_OWNER_LEASE
        );
        // One past the bound, and one so long that now + it overflows.
        for lease in [
            MAX_OWNER_LEASE + Duration::from_nanos(1),
            Duration::from_secs(u64::MAX / 2),
        ] {
            b.owner_lease = lease;
            let line = encode_boot(&b).unwrap();
            assert!(matches!(
                read_boot(&line[..]).await,
                Err(BootError::Decode(_))
            ));
        }
    }
}
