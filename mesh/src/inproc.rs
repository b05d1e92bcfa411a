//! An allocator whose procs are tasks of the calling process, each with its
//! own QUIC endpoint: the real proc runtime and the real control plane,
//! without process boundaries. For tests of mesh logic, examples that should
//! not fork, and simulations. It cannot model process faults (a kill aborts
//! the proc's task and closes its endpoint).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use regent_net::{Endpoint, ProcCredentials, ProcId};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::alloc::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::proc::{self, ProcExit, ProcSetup};

/// The bound on queued proc events.
const EVENTS: usize = 1024;

struct Running {
    task: JoinHandle<()>,
    endpoint: Endpoint,
}

/// Procs as tasks of this process (see the module docs).
pub struct InProcAllocator {
    procs: Mutex<HashMap<ProcId, Running>>,
    events_tx: mpsc::Sender<ProcEvent>,
    events_rx: Mutex<Option<mpsc::Receiver<ProcEvent>>>,
}

impl Default for InProcAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcAllocator {
    /// An allocator of in-process procs; their endpoints take the settings
    /// of their boot (the controller's).
    pub fn new() -> Self {
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        Self {
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
        let endpoint = Endpoint::bind(credentials, boot.bind, boot.endpoint.clone())?;
        endpoint.add_route(boot.owner.clone());
        let addr = endpoint.addr();
        let proc = boot.proc.clone();
        let events = self.events_tx.clone();
        let serving = endpoint.clone();
        let lease = boot.owner_lease;
        let owner = boot.owner.proc.clone();
        let creds = ProcCredentials::from_pem(
            boot.proc.clone(),
            &boot.cert_pem,
            &boot.key_pem,
            &boot.ca_pem,
        )?;
        let task = tokio::spawn(async move {
            let buffers = match regent_rdma::BufferManager::start(
                regent_rdma::ManagerConfig::default(),
                creds,
            )
            .await
            {
                Ok(b) => Some(std::sync::Arc::new(b)),
                Err(e) => {
                    tracing::warn!(error = %e, "an in-process proc runs without a payload plane");
                    None
                }
            };
            let setup = ProcSetup {
                endpoint: serving,
                owner,
                owner_lease: lease,
                buffers,
            };
            let status = match proc::serve(setup, async { Ok(()) }).await {
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
