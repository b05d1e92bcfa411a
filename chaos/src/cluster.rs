//! [`ChaosCluster`]: a controller and its procs with a chaos proxy in front
//! of every one of them, the controller included.
//!
//! The controller's proxy must be known before the controller binds (it is
//! the address the controller advertises, so that procs dial it), so the
//! proxy starts first and learns its upstream once the controller's
//! endpoint is bound. Every proc is started by a [`LocalAllocator`] wrapped
//! in a [`ChaosAllocator`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use regent_mesh::alloc::{Allocator, LocalAllocator, LocalConfig};
use regent_mesh::{ProcMesh, Runtime, RuntimeConfig, Shape};

use crate::ChaosError;
use crate::alloc::ChaosAllocator;
use crate::network::{Network, NodeId};
use crate::process;
use crate::proxy::{Proxy, ProxyConfig, ProxyCounts};
use crate::rng::Seed;

/// How a [`ChaosCluster`] is set up, with documented defaults.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The proc program (it must call `regent_mesh::bootstrap()` first and
    /// link `regent-chaos`, which registers the workload actor). Default:
    /// this executable.
    pub program: Option<PathBuf>,
    /// The controller's configuration (its endpoint's advertised address
    /// is replaced by its proxy's). Default: 3 s owner lease, 8 s call
    /// timeout.
    pub runtime: RuntimeConfig,
    /// Every proxy's configuration. Default [`ProxyConfig::default`].
    pub proxy: ProxyConfig,
    /// Arguments of the proc program. Default none. (To start procs in a
    /// network namespace: program `ip`, arguments `netns exec NS PROGRAM`.)
    pub proc_args: Vec<String>,
    /// The IP procs bind. Default 127.0.0.1.
    pub proc_bind_ip: std::net::IpAddr,
    /// How long a proc may take to report ready. Default 30 s.
    pub start_timeout: Duration,
    /// SIGTERM-to-SIGKILL grace when the cluster stops. Default 2 s.
    pub stop_grace: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            program: None,
            runtime: RuntimeConfig::default()
                .owner_lease(Duration::from_secs(3))
                .call_timeout(Duration::from_secs(8)),
            proxy: ProxyConfig::default(),
            proc_args: Vec::new(),
            proc_bind_ip: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            start_timeout: Duration::from_secs(30),
            stop_grace: Duration::from_secs(2),
        }
    }
}

impl ClusterConfig {
    /// Sets the proc program.
    pub fn program(mut self, path: impl Into<PathBuf>) -> Self {
        self.program = Some(path.into());
        self
    }

    /// Sets the controller's configuration.
    pub fn runtime(mut self, runtime: RuntimeConfig) -> Self {
        self.runtime = runtime;
        self
    }

    /// Sets the proc program's arguments.
    pub fn proc_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.proc_args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the IP procs bind.
    pub fn proc_bind_ip(mut self, ip: std::net::IpAddr) -> Self {
        self.proc_bind_ip = ip;
        self
    }

    /// Sets the start timeout of procs.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Sets the proxies' configuration.
    pub fn proxy(mut self, proxy: ProxyConfig) -> Self {
        self.proxy = proxy;
        self
    }
}

/// A controller and procs behind chaos proxies. Dropping it kills every
/// proc it started that is still alive (a test that fails halfway leaves
/// nothing running); [`ChaosCluster::shutdown`] stops them in order and
/// says which survived.
pub struct ChaosCluster {
    rt: Runtime,
    network: Network,
    controller_proxy: Proxy,
    local: Arc<LocalAllocator>,
    alloc: Arc<ChaosAllocator>,
    config: ClusterConfig,
}

impl std::fmt::Debug for ChaosCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChaosCluster")
            .field("controller", &self.rt.addr())
            .field("controller_proxy", &self.controller_proxy.addr())
            .finish_non_exhaustive()
    }
}

impl Drop for ChaosCluster {
    fn drop(&mut self) {
        for r in self.alloc.history() {
            if r.exited.is_none() && process::alive(r.pid) {
                process::kill(r.pid);
            }
        }
    }
}

impl ChaosCluster {
    /// Starts the controller behind its proxy, and the allocator. Proxies
    /// draw their packet fates from `seed`.
    pub async fn start(config: ClusterConfig, seed: Seed) -> Result<Self, ChaosError> {
        let network = Network::new();
        let controller_proxy = Proxy::start(
            network.clone(),
            NodeId::CONTROLLER,
            None,
            config.proxy.clone(),
            seed.derive("controller-proxy"),
        )
        .await?;
        let mut runtime = config.runtime.clone();
        runtime.endpoint.advertised_addr = Some(controller_proxy.addr());
        let rt = Runtime::start(runtime).await?;
        let real = rt.endpoint().local_addr();
        controller_proxy.set_upstream(real);
        network.register(NodeId::CONTROLLER, "controller", real);
        let program = match &config.program {
            Some(p) => p.clone(),
            None => {
                std::env::current_exe().map_err(|e| ChaosError::io("finding this executable", e))?
            }
        };
        let local_config = LocalConfig::default()
            .program(program)
            .args(config.proc_args.clone())
            .bind_ip(config.proc_bind_ip)
            .start_timeout(config.start_timeout);
        let local = Arc::new(
            LocalAllocator::with_config(rt.endpoint().clone(), local_config)
                .map_err(regent_mesh::MeshError::from)?,
        );
        let inner: Arc<dyn Allocator> = local.clone();
        let alloc = Arc::new(ChaosAllocator::new(
            inner,
            network.clone(),
            config.proxy.clone(),
            seed.derive("proc-proxies"),
        ));
        Ok(Self {
            rt,
            network,
            controller_proxy,
            local,
            alloc,
            config,
        })
    }

    /// The controller.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The chaos network.
    pub fn network(&self) -> &Network {
        &self.network
    }

    /// The allocator (procs behind proxies).
    pub fn allocator(&self) -> &Arc<ChaosAllocator> {
        &self.alloc
    }

    /// The controller's proxy.
    pub fn controller_proxy(&self) -> &Proxy {
        &self.controller_proxy
    }

    /// What every proxy did so far.
    pub fn proxy_counts(&self) -> ProxyCounts {
        self.controller_proxy.counts() + self.alloc.proxy_counts()
    }

    /// Starts `procs` procs in one dimension `procs`.
    pub async fn spawn_procs(&self, procs: usize) -> Result<ProcMesh, ChaosError> {
        let shape = Shape::new([("procs", procs)]).map_err(regent_mesh::MeshError::from)?;
        let alloc: Arc<dyn Allocator> = self.alloc.clone();
        Ok(self.rt.spawn_procs(alloc, shape).await?)
    }

    /// Stops every proc ever started (SIGTERM, SIGKILL after the grace),
    /// waits up to `deadline` for all to be gone, and returns the pids of
    /// those still alive (each is a violation of "no process outlives its
    /// owner"); they are then killed.
    pub async fn shutdown(self, deadline: Duration) -> Vec<u32> {
        self.network.heal();
        let history = self.alloc.history();
        // Resume paused ones, or SIGTERM cannot act on them.
        for r in &history {
            if r.exited.is_none() && process::stopped(r.pid) {
                let _ = self
                    .alloc
                    .signal(&r.proc, regent_mesh::alloc::ProcSignal::Cont)
                    .await;
            }
        }
        self.local.shutdown(self.config.stop_grace).await;
        let pids: Vec<u32> = history.iter().map(|r| r.pid).filter(|p| *p != 0).collect();
        process::wait_gone(&pids, deadline).await
    }
}
