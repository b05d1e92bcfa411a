//! A training loop that survives a SIGKILL: trainers (each proc rank with
//! its own "device", given by per-rank placement) take steps; a data loader
//! mesh shares their procs. Mid-step, one proc is killed: the step is
//! redone in the next generation (`retry_in_next_generation`), the killed
//! proc's meshes move together to one fresh proc with the same placement,
//! and the restarted trainer heals from the live peer its start context
//! names, reading that peer's weights one-sidedly.
//!
//! ```sh
//! cargo run --release -p regent --example train
//! ```

use std::time::Duration;

use anyhow::{bail, ensure};
use regent::mesh::alloc::{Placement, ProcSignal};
use regent::mesh::{
    ActorError, ActorMesh, Member, MeshActor, MeshError, PeersRestarted, Retry, Runtime,
    RuntimeConfig, Selection, Shape, StartKind,
};
use regent::rdma::{LocalBuffer, RemoteBuffer};
use serde::{Deserialize, Serialize};

/// The environment variable each proc rank's placement sets.
const DEVICE_ENV: &str = "REGENT_EXAMPLE_DEVICE";
const WEIGHTS_BYTES: usize = 4 << 20;
const STEPS: u64 = 6;

fn device() -> String {
    std::env::var(DEVICE_ENV).unwrap_or_else(|_| "cpu".into())
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

struct Trainer {
    rank: u32,
    /// The last step applied.
    step: u64,
    /// The weights, on the payload plane (peers heal from them).
    weights: LocalBuffer,
}

#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    /// Apply step `n` (idempotent: a step already applied is not applied
    /// again, so a retried step is safe).
    Step(u64),
    /// The weights' handle and the step they hold.
    Weights,
    /// Where this trainer runs.
    Where,
}

#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// The step the weights hold, and their checksum.
    Stepped {
        step: u64,
        checksum: u64,
    },
    Weights {
        handle: RemoteBuffer,
        step: u64,
    },
    Where {
        pid: u32,
        device: String,
    },
}

impl MeshActor for Trainer {
    const NAME: &'static str = "example/train/trainer";
    type Args = ();
    type Msg = Msg;
    type Reply = Reply;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        // The weights are this member's own while it writes them, and
        // read-only to peers (who heal from them) between steps.
        let mut weights = member.buffers()?.register_with(
            regent::rdma::Memory::allocate(WEIGHTS_BYTES)?,
            regent::rdma::Access::Local,
        )?;
        let mut step = 0;
        let start = member.start();
        if let (StartKind::Restart { cause, .. }, Some(source)) = (&start.kind, start.source) {
            // Heal: ask the live source for its weights, read them.
            let peers = member.peers::<Trainer>()?;
            let (handle, at) = match peers.call_one(source, &Msg::Weights).await? {
                Reply::Weights { handle, step } => (handle, step),
                other => return Err(format!("rank {} answered {other:?}", source.0).into()),
            };
            member
                .buffers()?
                .read_into(&handle, 0, weights.as_mut_slice()?)
                .await?;
            step = at;
            println!(
                "  [{}] trainer {} restarted in generation {} ({cause}); healed step {step} from rank {}",
                device(),
                member.rank().0,
                start.generation.0,
                source.0
            );
        }
        weights.set_access(regent::rdma::Access::ReadOnly).await?;
        Ok(Self {
            rank: member.rank().0,
            step,
            weights,
        })
    }

    async fn handle(&mut self, _: &Member, msg: Msg) -> Result<Reply, ActorError> {
        Ok(match msg {
            Msg::Step(n) => {
                if n == self.step + 1 {
                    // "Compute": a few hundred milliseconds on this core.
                    std::thread::sleep(Duration::from_millis(300));
                    self.weights.set_access(regent::rdma::Access::Local).await?;
                    for (i, w) in self.weights.as_mut_slice()?.iter_mut().enumerate() {
                        *w = w.wrapping_mul(31).wrapping_add((n as u8) ^ (i as u8));
                    }
                    self.weights
                        .set_access(regent::rdma::Access::ReadOnly)
                        .await?;
                    self.step = n;
                } else if n > self.step + 1 {
                    return Err(format!(
                        "trainer {} is at step {}, asked for step {n}",
                        self.rank, self.step
                    )
                    .into());
                }
                Reply::Stepped {
                    step: self.step,
                    checksum: checksum(self.weights.as_slice()?),
                }
            }
            Msg::Weights => Reply::Weights {
                handle: self.weights.handle().clone(),
                step: self.step,
            },
            Msg::Where => Reply::Where {
                pid: std::process::id(),
                device: device(),
            },
        })
    }

    async fn peers_restarted(
        &mut self,
        _: &Member,
        change: &PeersRestarted,
    ) -> Result<(), ActorError> {
        println!(
            "  [{}] trainer {} told: ranks {:?} restarted in generation {}",
            device(),
            self.rank,
            change.ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
            change.generation.0
        );
        Ok(())
    }
}

/// A data loader beside each trainer.
struct Loader;

impl MeshActor for Loader {
    const NAME: &'static str = "example/train/loader";
    type Args = ();
    type Msg = ();
    type Reply = u32;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self)
    }

    async fn handle(&mut self, _: &Member, (): ()) -> Result<u32, ActorError> {
        Ok(std::process::id())
    }
}

regent::mesh::register_actor!(Trainer);
regent::mesh::register_actor!(Loader);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // In the procs the local allocator starts (this binary again), this
    // runs the proc runtime and never returns.
    regent::bootstrap();
    let rt = Runtime::start(RuntimeConfig::default()).await?;
    let procs = rt
        .spawn_procs_placed(rt.local_allocator()?, Shape::new([("hosts", 3)])?, |rank| {
            Placement::default().env(DEVICE_ENV, format!("cuda:{rank}"))
        })
        .await?;
    let trainers = procs.spawn::<Trainer>("trainers", 1, &()).await?;
    let loaders = procs.spawn::<Loader>("loaders", 1, &()).await?;
    let result = run(&procs, &trainers, &loaders).await;
    procs.stop(Duration::from_secs(2)).await?;
    result
}

async fn placement(
    trainers: &ActorMesh<Trainer>,
    loaders: &ActorMesh<Loader>,
) -> anyhow::Result<Vec<(u32, String)>> {
    let here = trainers
        .call(&Selection::All, &Msg::Where)
        .await?
        .into_result()?;
    let loader_pids = loaders.call(&Selection::All, &()).await?.into_result()?;
    let mut out = Vec::new();
    for ((rank, reply), (_, loader_pid)) in here.into_iter().zip(loader_pids) {
        let Reply::Where { pid, device } = reply else {
            bail!("trainer {} answered {reply:?}", rank.0);
        };
        ensure!(
            pid == loader_pid,
            "trainer {} (pid {pid}) and its loader (pid {loader_pid}) are apart",
            rank.0
        );
        out.push((pid, device));
    }
    Ok(out)
}

async fn run(
    procs: &regent::mesh::ProcMesh,
    trainers: &ActorMesh<Trainer>,
    loaders: &ActorMesh<Loader>,
) -> anyhow::Result<()> {
    let before = placement(trainers, loaders).await?;
    for (rank, (pid, device)) in before.iter().enumerate() {
        println!("trainer {rank} and its loader: pid {pid}, {device}");
    }
    let retry = Retry::new(2, Duration::from_secs(60));
    for step in 1..=STEPS {
        // Step 3 is cut short: proc 1 is killed while it computes.
        let killer = (step == 3).then(|| {
            let proc = trainers.procs()[1].proc.clone();
            let allocator = procs.allocator().clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                allocator.signal(&proc, ProcSignal::Kill).await
            })
        });
        let mut tries = 0;
        let values = trainers
            .retry_in_next_generation(retry, || {
                tries += 1;
                async move {
                    let vm = trainers.call(&Selection::All, &Msg::Step(step)).await?;
                    if !vm.is_complete() {
                        for (rank, why) in vm.failed() {
                            println!("  step {step}: trainer {} failed: {why}", rank.0);
                        }
                    }
                    Ok::<_, MeshError>(vm.into_result()?)
                }
            })
            .await?;
        if let Some(k) = killer {
            k.await??;
            println!("  (proc 1 was SIGKILLed during step {step})");
        }
        let sums: std::collections::BTreeSet<u64> = values
            .iter()
            .map(|(_, r)| match r {
                Reply::Stepped { step: s, checksum } if *s == step => Ok(*checksum),
                other => Err(anyhow::anyhow!(
                    "a trainer answered {other:?} to step {step}"
                )),
            })
            .collect::<anyhow::Result<_>>()?;
        ensure!(
            sums.len() == 1,
            "the trainers' weights differ after step {step}"
        );
        println!(
            "step {step}: {} trainers agree (generation {}, {tries} tr{})",
            values.len(),
            trainers.generation().0,
            if tries == 1 { "y" } else { "ies" }
        );
    }
    let after = placement(trainers, loaders).await?;
    ensure!(
        after[1].0 != before[1].0 && after[1].1 == before[1].1,
        "proc rank 1 was not replaced with the same placement"
    );
    println!(
        "trainer 1 and its loader moved together from pid {} to pid {}, still on {}",
        before[1].0, after[1].0, after[1].1
    );
    Ok(())
}
