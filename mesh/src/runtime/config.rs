//! How a controller is set up.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use regent_net::EndpointConfig;

use crate::logs::LogConfig;
use crate::tree::DEFAULT_FANOUT;

/// How a [`Runtime`](super::Runtime) is set up. Its endpoint settings reach
/// every proc it starts (through their boot), so that both sides agree on
/// frame sizes and timeouts.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The controller's proc name (its certificate's identity).
    pub name: String,
    /// Where the controller's endpoint listens (default `127.0.0.1:0`).
    pub bind: SocketAddr,
    /// Where procs bind their endpoints (default `127.0.0.1:0`).
    pub proc_bind: SocketAddr,
    /// How long procs keep running without hearing from the controller
    /// (default 10 s); the controller renews every third of it.
    pub owner_lease: Duration,
    /// How long spawns, stops and calls wait by default (default 30 s).
    pub call_timeout: Duration,
    /// The cast trees' fan-out (default 16).
    pub fanout: NonZeroU32,
    /// The control plane's settings, the controller's and its procs' (its
    /// `failure_timeout` bounds how fast a silent proc is declared failed).
    pub endpoint: EndpointConfig,
    /// What becomes of procs' output lines (default: printed to stderr
    /// with their prefix, identical lines across ranks folded).
    pub logs: LogConfig,
    /// Whether the controller's tasks (its endpoint, caster, supervisors,
    /// lease renewals) run on a thread of their own, a current-thread
    /// runtime, rather than on the runtime of whoever starts it (default
    /// true; see `docs/semantics.md` §4.1). Off, they run where
    /// [`Runtime::start`](super::Runtime::start) is awaited, spread over
    /// that runtime's workers.
    pub control_thread: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            name: "controller".into(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            proc_bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            owner_lease: Duration::from_secs(10),
            call_timeout: Duration::from_secs(30),
            fanout: DEFAULT_FANOUT,
            endpoint: EndpointConfig::default(),
            logs: LogConfig::default(),
            control_thread: true,
        }
    }
}

impl RuntimeConfig {
    /// Sets the cast trees' fan-out.
    pub fn fanout(mut self, fanout: NonZeroU32) -> Self {
        self.fanout = fanout;
        self
    }

    /// Sets the default call timeout.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Sets the owner lease given to procs.
    pub fn owner_lease(mut self, lease: Duration) -> Self {
        self.owner_lease = lease;
        self
    }

    /// Sets whether the controller's tasks run on a thread of their own.
    pub fn control_thread(mut self, on: bool) -> Self {
        self.control_thread = on;
        self
    }

    /// Sets what becomes of procs' output lines.
    pub fn logs(mut self, logs: LogConfig) -> Self {
        self.logs = logs;
        self
    }

    /// Sets the control plane's settings.
    pub fn endpoint(mut self, endpoint: EndpointConfig) -> Self {
        self.endpoint = endpoint;
        self
    }

    /// The endpoint settings a proc boots with: the controller's, but for
    /// its own advertised address (a proc's is its own).
    pub(crate) fn proc_endpoint(&self) -> EndpointConfig {
        EndpointConfig {
            advertised_addr: None,
            ..self.endpoint.clone()
        }
    }
}
