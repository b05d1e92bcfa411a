//! Spawn a 2×4 mesh of a user-defined actor on the local allocator (two proc
//! processes of this very binary, four actors each), cast to it, gather
//! replies, and reduce them inside the cast tree.
//!
//! ```sh
//! cargo run --release -p regent --example mesh
//! ```

use std::sync::Arc;

use regent::mesh::alloc::LocalAllocator;
use regent::mesh::{ActorError, Member, MeshActor, Runtime, RuntimeConfig, Selection, Shape, Sum};
use serde::{Deserialize, Serialize};

/// A toy trainer: holds a weight, takes gradient steps, reports its loss.
struct Trainer {
    weight: f64,
    learning_rate: f64,
    target: f64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    /// Take this many gradient steps towards the target.
    Train(u32),
    /// Report the squared error.
    Loss,
}

impl MeshActor for Trainer {
    const NAME: &'static str = "example/trainer";
    type Args = f64;
    type Msg = Msg;
    type Reply = f64;

    async fn new(member: &Member, learning_rate: f64) -> Result<Self, ActorError> {
        Ok(Self {
            weight: 0.0,
            learning_rate,
            // Each member fits a different target: its rank.
            target: f64::from(member.rank().0),
        })
    }

    async fn handle(&mut self, _: &Member, msg: Msg) -> Result<f64, ActorError> {
        match msg {
            Msg::Train(steps) => {
                for _ in 0..steps {
                    let gradient = 2.0 * (self.weight - self.target);
                    self.weight -= self.learning_rate * gradient;
                }
                Ok(self.weight)
            }
            Msg::Loss => Ok((self.weight - self.target).powi(2)),
        }
    }
}

regent::mesh::register_actor!(Trainer);

fn main() -> anyhow::Result<()> {
    // In the procs the local allocator starts (this binary again), this runs
    // the proc runtime and never returns.
    regent::bootstrap();
    tokio::runtime::Runtime::new()?.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let rt = Runtime::start(RuntimeConfig::default()).await?;
    let allocator = Arc::new(LocalAllocator::new(rt.endpoint().clone())?);
    let procs = rt
        .spawn_procs(allocator, Shape::new([("hosts", 2)])?)
        .await?;
    let mesh = procs.spawn::<Trainer>("trainers", 4, &0.1).await?;
    let procs_list: Vec<String> = mesh.procs().iter().map(ToString::to_string).collect();
    println!("spawned {} on {procs_list:?}", mesh.shape());

    let before = mesh.reduce::<Sum<f64>>(&Selection::All, &Msg::Loss).await?;
    println!(
        "total loss before training: {:.3}",
        before.value.unwrap_or(0.0)
    );

    // One cast reaches all eight members through the cast tree.
    mesh.cast(&Selection::All, &Msg::Train(5))
        .await?
        .into_result()?;
    // Train the second host's members a little more.
    let second: Selection = "hosts=1".parse()?;
    mesh.cast(&second, &Msg::Train(20)).await?.into_result()?;

    let losses = mesh.call(&Selection::All, &Msg::Loss).await?;
    for (rank, loss) in losses.values() {
        let point = mesh.shape().point_of(*rank).expect("a rank of the mesh");
        println!("  {point}: loss {loss:.5}");
    }
    let after = mesh.reduce::<Sum<f64>>(&Selection::All, &Msg::Loss).await?;
    println!(
        "total loss after training: {:.5} ({} members, reduced inside the tree)",
        after.value.unwrap_or(0.0),
        after.contributors
    );
    procs.stop(std::time::Duration::from_secs(2)).await?;
    Ok(())
}
