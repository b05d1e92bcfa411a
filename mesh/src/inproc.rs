//! An allocator whose procs are tasks of the calling process, each with its
//! own QUIC endpoint: the real proc runtime and the real control plane,
//! without process boundaries. For tests of mesh logic, examples that should
//! not fork, and simulations. It cannot model process faults (a kill aborts
//! the proc's task and closes its endpoint).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use regent_net::{Endpoint, EndpointConfig, ProcCredentials, ProcId};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::alloc::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::proc::{self, ProcExit};

/// The bound on queued proc events.
const EVENTS: usize = 1024;

struct Running {
    task: JoinHandle<()>,
    endpoint: Endpoint,
}

/// Procs as tasks of this process (see the module docs).
pub struct InProcAllocator {
    config: EndpointConfig,
    procs: Mutex<HashMap<ProcId, Running>>,
    events_tx: mpsc::Sender<ProcEvent>,
    events_rx: Mutex<Option<mpsc::Receiver<ProcEvent>>>,
}

impl Default for InProcAllocator {
    fn default() -> Self {
        Self::new(EndpointConfig::default())
    }
}

impl InProcAllocator {
    /// An allocator whose procs' endpoints use `config`.
    pub fn new(config: EndpointConfig) -> Self {
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        Self {
            config,
            procs: Mutex::new(HashMap::new()),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
        }
    }

    fn start(&self, boot: ProcBoot) -> Result<AllocatedProc, AllocError> {
        let credentials = ProcCredentials::from_pem(
            boot.proc.clone(),
            &boot.cert_pem,
            &boot.key_pem,
            &boot.ca_pem,
        )?;
        let endpoint = Endpoint::bind(credentials, boot.bind, self.config.clone())?;
        endpoint.add_route(boot.owner.clone());
        let addr = endpoint.addr();
        let proc = boot.proc.clone();
        let events = self.events_tx.clone();
        let serving = endpoint.clone();
        let lease = boot.owner_lease;
        let owner = boot.owner.proc.clone();
        let task = tokio::spawn(async move {
            let status = match proc::serve(serving, owner, lease, async { Ok(()) }).await {
                Ok(ProcExit::Requested) => ProcStatus::Code(0),
                Ok(_) => ProcStatus::Code(1),
                Err(e) => {
                    tracing::error!(error = %e, "in-process proc failed");
                    ProcStatus::Code(2)
                }
            };
            let _ = events.try_send(ProcEvent::Exited {
                proc: boot.proc,
                status,
            });
        });
        self.procs
            .lock()
            .expect("procs lock")
            .insert(proc.clone(), Running { task, endpoint });
        Ok(AllocatedProc {
            proc,
            addr,
            host: "inproc".into(),
            pid: std::process::id(),
        })
    }

    fn kill(&self, proc: &ProcId) -> Result<(), AllocError> {
        let running = self
            .procs
            .lock()
            .expect("procs lock")
            .remove(proc)
            .ok_or_else(|| AllocError::UnknownProc(proc.clone()))?;
        running.task.abort();
        running.endpoint.close();
        let _ = self.events_tx.try_send(ProcEvent::Exited {
            proc: proc.clone(),
            status: ProcStatus::Signal(9),
        });
        Ok(())
    }
}

impl Allocator for InProcAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        async move {
            let mut started = Vec::with_capacity(boots.len());
            for boot in boots {
                match self.start(boot) {
                    Ok(p) => started.push(p),
                    Err(e) => {
                        for p in &started {
                            let _ = self.kill(&p.proc);
                        }
                        return Err(e);
                    }
                }
            }
            Ok(started)
        }
        .boxed()
    }

    fn stop(&self, proc: &ProcId, _grace: Duration) -> AllocFuture<'_, ProcStatus> {
        let r = self.kill(proc).map(|()| ProcStatus::Signal(9));
        async move { r }.boxed()
    }

    fn signal(&self, proc: &ProcId, signal: ProcSignal) -> AllocFuture<'_, ()> {
        let r = match signal {
            ProcSignal::Kill | ProcSignal::Term => self.kill(proc),
            ProcSignal::Stop | ProcSignal::Cont => Err(AllocError::Host {
                host: "inproc".into(),
                message: "in-process procs cannot be paused".into(),
            }),
        };
        async move { r }.boxed()
    }

    fn take_events(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        self.events_rx.lock().expect("events lock").take()
    }
}

impl Drop for InProcAllocator {
    fn drop(&mut self) {
        for (_, r) in self.procs.lock().expect("procs lock").drain() {
            r.task.abort();
            r.endpoint.close();
        }
    }
}
