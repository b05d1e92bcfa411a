//! An allocator whose procs are tasks of the calling process, each with its
//! own QUIC endpoint: the real proc runtime and the real control plane,
//! without process boundaries. For tests of mesh logic, examples that should
//! not fork, and simulations (feature `sim`: the endpoints bind on a
//! simulated network, which the simulation of a cluster builds on). It
//! cannot model process faults (a kill aborts the proc's task and closes
//! its endpoint).
//!
//! Like every allocator, it returns a proc only once the proc is ready: its
//! ports are open and its runtime takes commands. The endpoint accepts
//! connections from the moment it is bound, so a command that came before
//! the proc opened its command port would be refused (`NoSuchPort`) and
//! given back to a sender that expected an answer.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use regent_net::{Endpoint, ProcCredentials, ProcId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::alloc::{
    AllocError, AllocFuture, AllocatedProc, Allocator, ProcBoot, ProcEvent, ProcSignal, ProcStatus,
};
use crate::proc::{self, ProcExit, ProcSetup};

/// The bound on queued proc events.
const EVENTS: usize = 1024;

/// How long a proc may take to be ready (its payload plane started and its
/// ports open), as the other allocators' default `start_timeout`.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Resolves when a started proc is ready, or with how its task ended first.
type ReadyRx = oneshot::Receiver<Result<(), ProcStatus>>;

struct Running {
    task: JoinHandle<()>,
    endpoint: Endpoint,
}

/// Where the procs' endpoints bind.
#[derive(Clone)]
enum Network {
    /// UDP sockets, and each proc has a payload plane.
    Udp,
    /// A simulated network: no payload plane, members as tasks, and the
    /// procs' random numbers from the network's seed.
    #[cfg(feature = "sim")]
    Sim(regent_net::sim::SimNet),
}

/// Procs as tasks of this process (see the module docs).
pub struct InProcAllocator {
    network: Network,
    /// Ordered: dropping the allocator closes the endpoints in a fixed order.
    procs: Mutex<BTreeMap<ProcId, Running>>,
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
        Self::on(Network::Udp)
    }

    /// An allocator of in-process procs whose endpoints bind on a simulated
    /// network (at their boot's `bind` address), deterministically: no
    /// payload plane (`Member::buffers` is `None`), every member life a
    /// task of the current runtime (no thread of its own), and each proc's
    /// random numbers drawn from the network's seed.
    #[cfg(feature = "sim")]
    pub fn on_simnet(net: &regent_net::sim::SimNet) -> Self {
        Self::on(Network::Sim(net.clone()))
    }

    fn on(network: Network) -> Self {
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        Self {
            network,
            procs: Mutex::new(BTreeMap::new()),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
        }
    }

    /// The proc's endpoint, and what its runtime runs with beside it:
    /// whether members get threads of their own, and its seed.
    fn bind(&self, boot: &ProcBoot) -> Result<(Endpoint, bool, Option<u64>), AllocError> {
        let credentials = ProcCredentials::from_pem(
            boot.proc.clone(),
            &boot.cert_pem,
            &boot.key_pem,
            &boot.ca_pem,
        )?;
        Ok(match &self.network {
            Network::Udp => (
                Endpoint::bind(credentials, boot.bind, boot.endpoint.clone())?,
                true,
                None,
            ),
            #[cfg(feature = "sim")]
            Network::Sim(net) => (
                Endpoint::bind_sim(credentials, net, boot.bind, boot.endpoint.clone())?,
                false,
                Some(net.random_u64()),
            ),
        })
    }

    /// Binds the proc's endpoint and starts its task; the proc is ready
    /// when the returned receiver says so.
    fn start(&self, boot: ProcBoot) -> Result<(AllocatedProc, ReadyRx), AllocError> {
        let (endpoint, member_threads, seed) = self.bind(&boot)?;
        endpoint.add_route(boot.owner.clone());
        let addr = endpoint.addr();
        let proc = boot.proc.clone();
        let events = self.events_tx.clone();
        let serving = endpoint.clone();
        let lease = boot.owner_lease;
        let owner = boot.owner.proc.clone();
        let owner_key = boot.owner_key;
        // The payload plane's credentials (none in a simulation).
        let creds = match self.network {
            Network::Udp => Some(ProcCredentials::from_pem(
                boot.proc.clone(),
                &boot.cert_pem,
                &boot.key_pem,
                &boot.ca_pem,
            )?),
            #[cfg(feature = "sim")]
            Network::Sim(_) => None,
        };
        // Taken by whichever comes first: `serve` saying its ports are open,
        // or the task ending without that. (The lock is held only for a
        // `take`, which cannot panic, so it is never poisoned.)
        let (ready_tx, ready_rx) = oneshot::channel();
        let ready_tx = std::sync::Arc::new(Mutex::new(Some(ready_tx)));
        let on_ready = ready_tx.clone();
        let task = tokio::spawn(async move {
            let buffers = match creds {
                None => None,
                Some(creds) => {
                    match regent_rdma::BufferManager::start(
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
                    }
                }
            };
            let setup = ProcSetup {
                endpoint: serving,
                owner,
                owner_lease: lease,
                owner_key,
                buffers,
                member_threads,
                seed,
                // In the controller's process: nothing may exit it.
                lease_clock: None,
            };
            let ready = async move {
                if let Some(tx) = on_ready.lock().expect("ready lock").take() {
                    let _ = tx.send(Ok(()));
                }
                Ok(())
            };
            let status = match proc::serve(setup, ready).await {
                Ok(ProcExit::Requested) => ProcStatus::Code(0),
                Ok(_) => ProcStatus::Code(1),
                Err(e) => {
                    tracing::error!(error = %e, "in-process proc failed");
                    ProcStatus::Code(2)
                }
            };
            if let Some(tx) = ready_tx.lock().expect("ready lock").take() {
                let _ = tx.send(Err(status));
            }
            let _ = events.try_send(ProcEvent::Exited {
                proc: boot.proc,
                status,
                // In-process procs share the controller's stdout and stderr.
                last_lines: Vec::new(),
            });
        });
        self.procs
            .lock()
            .expect("procs lock")
            .insert(proc.clone(), Running { task, endpoint });
        let allocated = AllocatedProc {
            proc,
            addr,
            host: "inproc".into(),
            pid: std::process::id(),
        };
        Ok((allocated, ready_rx))
    }

    /// Aborts a proc's task, closes its endpoint and reports its exit.
    pub(crate) fn kill(&self, proc: &ProcId) -> Result<(), AllocError> {
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
            last_lines: Vec::new(),
        });
        Ok(())
    }
}

/// Waits until every started proc is ready, at most `timeout` in all.
async fn await_ready(
    started: &mut [(AllocatedProc, ReadyRx)],
    timeout: Duration,
) -> Result<(), AllocError> {
    let deadline = tokio::time::Instant::now() + timeout;
    for (p, ready) in started.iter_mut() {
        match tokio::time::timeout_at(deadline, ready).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(status))) => {
                return Err(AllocError::ExitedEarly {
                    proc: p.proc.clone(),
                    status,
                });
            }
            // The task was aborted (a kill) before it was ready.
            Ok(Err(_)) => {
                return Err(AllocError::ExitedEarly {
                    proc: p.proc.clone(),
                    status: ProcStatus::Signal(9),
                });
            }
            Err(_) => {
                return Err(AllocError::NotReady {
                    proc: p.proc.clone(),
                    timeout,
                });
            }
        }
    }
    Ok(())
}

impl Allocator for InProcAllocator {
    fn allocate(&self, boots: Vec<ProcBoot>) -> AllocFuture<'_, Vec<AllocatedProc>> {
        async move {
            let mut started = Vec::with_capacity(boots.len());
            let mut failure = None;
            for boot in boots {
                match self.start(boot) {
                    Ok(p) => started.push(p),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            if failure.is_none() {
                failure = await_ready(&mut started, START_TIMEOUT).await.err();
            }
            if let Some(e) = failure {
                for (p, _) in &started {
                    let _ = self.kill(&p.proc);
                }
                return Err(e);
            }
            Ok(started.into_iter().map(|(p, _)| p).collect())
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
        let procs = std::mem::take(&mut *self.procs.lock().expect("procs lock"));
        for r in procs.into_values() {
            r.task.abort();
            r.endpoint.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use regent_net::{ClusterCa, Endpoint, EndpointConfig, Generation, ProcId, Role, Validity};

    use super::InProcAllocator;
    use crate::alloc::{Allocator, ProcBoot};
    use crate::fabric::{proc_actor, proc_port};
    use crate::protocol::{MeshId, ProcCommand, ProcReply, ReplyBody, names};

    /// A cluster CA and a controller's endpoint on loopback.
    fn controller(ca_name: &str) -> (ClusterCa, ProcId, Endpoint) {
        let ca = ClusterCa::generate(ca_name).unwrap();
        let me = ProcId::new("controller").unwrap();
        let controller = Endpoint::bind(
            ca.issue(&me, Role::Controller, Validity::job()).unwrap(),
            "127.0.0.1:0".parse().unwrap(),
            EndpointConfig::default(),
        )
        .unwrap();
        (ca, me, controller)
    }

    /// The next answer at `replies`, within 20 s.
    async fn answer(replies: &mut regent_net::Inbox) -> ProcReply {
        let answer = tokio::time::timeout(Duration::from_secs(20), replies.recv())
            .await
            .expect("an answer within 20 s")
            .expect("the reply port is open");
        answer.decode().unwrap()
    }

    /// The boot of `proc`, owned by `controller`, trusting `owner_key`.
    fn boot(
        ca: &ClusterCa,
        proc: &ProcId,
        controller: &Endpoint,
        owner_key: Option<crate::relay::OwnerKey>,
    ) -> ProcBoot {
        let (cert_pem, key_pem, ca_pem) = ca
            .issue(proc, Role::Proc, Validity::job())
            .unwrap()
            .to_pem();
        ProcBoot {
            proc: proc.clone(),
            ca_pem,
            cert_pem,
            key_pem,
            bind: "127.0.0.1:0".parse().unwrap(),
            parent: controller.addr(),
            owner: controller.addr(),
            owner_lease: Duration::from_secs(30),
            endpoint: EndpointConfig::default(),
            placement: Default::default(),
            owner_key,
        }
    }

    /// The moment `allocate` returns, the proc takes commands. On a
    /// one-thread runtime nothing else runs until this test yields, so a
    /// port the proc's task would open only later is not open yet: the
    /// proc's endpoint would refuse the command (`NoSuchPort`), as it
    /// refused a controller's `Spawn` that came too early, and the
    /// controller waited out its call timeout for the answer.
    #[tokio::test(flavor = "current_thread")]
    async fn a_proc_takes_commands_once_allocate_returns() {
        let (ca, me, controller) = controller("inproc test");
        let asker = me.actor(names::CONTROLLER, 0).unwrap();
        let mut replies = controller.open_port(asker.port(names::REPLY_PORT)).unwrap();
        let proc = ProcId::new("p0-0").unwrap();
        let boot = boot(&ca, &proc, &controller, None);
        let alloc = InProcAllocator::new();
        let allocated = alloc.allocate(vec![boot]).await.unwrap();
        let commands = proc_port(&proc, names::COMMAND_PORT);
        // No await since `allocate` returned: the proc's task has had a turn
        // only if `allocate` waited for it.
        let endpoint = alloc.procs.lock().unwrap()[&proc].endpoint.clone();
        endpoint
            .try_send(
                &proc_actor(&proc),
                &commands,
                Generation(0),
                ProcCommand::Renew,
            )
            .expect("the command port is open when allocate returns");
        // And the owner's request, over QUIC, is answered.
        controller.add_route(allocated[0].addr.clone());
        let stop = ProcCommand::Stop {
            call: 7,
            reply_to: replies.port().clone(),
            mesh: MeshId(1),
        };
        controller
            .send(&asker, &commands, Generation(0), stop)
            .await
            .unwrap();
        let reply = answer(&mut replies).await;
        assert_eq!(reply.call, 7);
        assert!(matches!(reply.body, ReplyBody::Stopped), "{:?}", reply.body);
    }

    /// Relayed commands over the real control plane: a proc certificate
    /// (not the owner's) hands a proc relays. The proc carries out one its
    /// owner signed and answers for it; it refuses one signed with another
    /// key, and the owner's own once it was taken (a replay); each refusal
    /// is answered for the route, naming the proc.
    #[tokio::test(flavor = "current_thread")]
    async fn a_proc_takes_relays_its_owner_signed_once_and_no_others() {
        use crate::relay::{Hop, RelayBody, RelayFrame, RelaySigner};
        let (ca, _, controller) = controller("relay test");
        let signer = RelaySigner::new(&crate::entropy::Entropy::os());
        let proc = ProcId::new("p0-0").unwrap();
        let boot = boot(&ca, &proc, &controller, Some(signer.public()));
        let local = "127.0.0.1:0".parse().unwrap();
        let alloc = InProcAllocator::new();
        let allocated = alloc.allocate(vec![boot]).await.unwrap();
        // Another proc of the cluster relays.
        let peer = ProcId::new("p0-1").unwrap();
        let relayer = Endpoint::bind(
            ca.issue(&peer, Role::Proc, Validity::job()).unwrap(),
            local,
            EndpointConfig::default(),
        )
        .unwrap();
        relayer.add_route(allocated[0].addr.clone());
        let from = proc_actor(&peer);
        let mut replies = relayer.open_port(from.port(names::REPLY_PORT)).unwrap();
        let route = vec![Hop {
            rank: 0,
            addr: allocated[0].addr.clone(),
        }];
        let fanout = crate::tree::DEFAULT_FANOUT;
        let budget = Duration::from_secs(5);
        let commands = proc_port(&proc, names::COMMAND_PORT);
        let mut call = 0;
        let mut relay = async |mut frame: RelayFrame| {
            call += 1;
            frame.reply = Some(crate::protocol::ReplyTo {
                port: replies.port().clone(),
                call,
            });
            relayer
                .send(&from, &commands, Generation(0), ProcCommand::Relay(frame))
                .await
                .unwrap();
            let reply = answer(&mut replies).await;
            assert_eq!(reply.call, call);
            match reply.body {
                ReplyBody::Relayed(outcome) => outcome,
                other => panic!("{other:?}"),
            }
        };
        let renew = signer
            .frame(RelayBody::Renew, route.clone(), fanout, budget)
            .unwrap();
        let taken = relay(renew.clone()).await;
        assert_eq!((taken.done, taken.failed.len()), (1, 0), "{taken:?}");
        let forger = RelaySigner::new(&crate::entropy::Entropy::os());
        let forged = forger
            .frame(RelayBody::Renew, route.clone(), fanout, budget)
            .unwrap();
        let refused = relay(forged).await;
        assert_eq!(refused.done, 0, "{refused:?}");
        assert_eq!(refused.failed[0].0, proc);
        assert!(refused.failed[0].1.contains("signature"), "{refused:?}");
        let replayed = relay(renew).await;
        assert_eq!(replayed.done, 0, "{replayed:?}");
        assert!(replayed.failed[0].1.contains("replay"), "{replayed:?}");
        // Still serving what the owner signs.
        let update = signer
            .frame(
                RelayBody::Update {
                    mesh: MeshId(9),
                    change: crate::protocol::MeshChange {
                        from: Generation(0),
                        generation: Generation(1),
                        moved: Vec::new(),
                    },
                    restart: None,
                },
                route,
                fanout,
                budget,
            )
            .unwrap();
        let answered = relay(update).await;
        // Carried out, and answered for: this proc hosts no mesh 9.
        assert_eq!(answered.done, 0, "{answered:?}");
        assert!(
            answered.failed[0].1.contains("no members here"),
            "{answered:?}"
        );
    }
}
