//! Spawn a 2×4 mesh of a user-defined actor on the local allocator (two proc
//! processes of this very binary, four actors each), cast to it, gather
//! replies, and reduce them inside the cast tree — checking, each time,
//! which members did not answer (users copy examples: the failures show).
//!
//! ```sh
//! cargo run --release -p regent --example mesh
//! ```

use anyhow::{Context, bail};
use regent::mesh::{
    ActorError, ActorMesh, Member, MeshActor, ProcMesh, Runtime, RuntimeConfig, Selection, Shape,
    Sum,
};
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
    // the proc runtime and never returns. (`#[tokio::main]` works too: see
    // the other examples.)
    regent::bootstrap();
    tokio::runtime::Runtime::new()?.block_on(async {
        let rt = Runtime::start(RuntimeConfig::default()).await?;
        let procs = rt
            .spawn_procs(rt.local_allocator()?, Shape::new([("hosts", 2)])?)
            .await?;
        let result = run(&procs).await;
        procs.stop(std::time::Duration::from_secs(2)).await?;
        result
    })
}

/// The total loss, reduced inside the cast tree; an error naming the
/// members that did not contribute, if any did not.
async fn total_loss(mesh: &ActorMesh<Trainer>) -> anyhow::Result<(f64, u32)> {
    let total = mesh.reduce::<Sum<f64>>(&Selection::All, &Msg::Loss).await?;
    if !total.is_complete() {
        for (rank, why) in total.failed() {
            eprintln!("rank {} did not report its loss: {why}", rank.0);
        }
    }
    let contributors = total.contributors;
    // `into_result` fails if any member did not contribute: a partial sum
    // is not the total.
    let value = total.into_result()?.context("no member reported a loss")?;
    Ok((value, contributors))
}

async fn run(procs: &ProcMesh) -> anyhow::Result<()> {
    let mesh = procs.spawn::<Trainer>("trainers", 4, &0.1).await?;
    let procs_list: Vec<String> = mesh.procs().iter().map(ToString::to_string).collect();
    println!("spawned {} on {procs_list:?}", mesh.shape());

    let (before, _) = total_loss(&mesh).await?;
    println!("total loss before training: {before:.3}");

    // One cast reaches all eight members through the cast tree; it returns
    // once every member has it, or says which could not be reached.
    let delivered = mesh.cast(&Selection::All, &Msg::Train(5)).await?;
    if !delivered.is_complete() {
        for (rank, why) in delivered.failed() {
            eprintln!("rank {} did not get the training step: {why}", rank.0);
        }
        bail!("{} members missed a step", delivered.failed().len());
    }
    // Train the second host's members a little more.
    let second: Selection = "hosts=1".parse()?;
    let n = mesh.cast(&second, &Msg::Train(20)).await?.into_result()?;
    println!("the second host's {n} members trained 20 more steps");

    let losses = mesh.call(&Selection::All, &Msg::Loss).await?;
    for (rank, loss) in losses.values() {
        let point = mesh.shape().point_of(*rank).context("a rank of the mesh")?;
        println!("  {point}: loss {loss:.5}");
    }
    for (rank, why) in losses.failed() {
        println!("  rank {}: no loss ({why})", rank.0);
    }
    if !losses.is_complete() {
        bail!(
            "{} members did not report their loss",
            losses.failed().len()
        );
    }
    let (after, contributors) = total_loss(&mesh).await?;
    println!(
        "total loss after training: {after:.5} ({contributors} members, reduced inside the tree)"
    );
    Ok(())
}
