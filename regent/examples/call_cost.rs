//! The harness of `scripts/callgrind-calls.sh`: pipelined calls (or
//! fire-and-forget casts) from this controller to one member of one proc
//! process, as `regent bench mesh`'s `pipelined_calls` makes them. Run
//! under callgrind at two counts, the difference between the runs is the
//! instructions each call costs the controller and the proc, which, unlike
//! time, repeats on a noisy machine.
//!
//! ```sh
//! REGENT_COST_OPS=20000 cargo run --release -p regent --example call_cost
//! scripts/callgrind-calls.sh call   # instructions per call, by function
//! ```

use futures::StreamExt;
use regent::mesh::alloc::{LocalAllocator, LocalConfig};
use regent::mesh::{
    ActorError, ActorMesh, Member, MeshActor, Rank, Runtime, RuntimeConfig, Selection, Shape,
};

// The allocator of the `regent` binary, so that allocations cost here
// what they cost there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Calls in flight, as `regent bench mesh`'s.
const IN_FLIGHT: usize = 1000;

/// Counts what it is sent and answers each number with it plus the count.
struct Counter(u64);

impl MeshActor for Counter {
    const NAME: &'static str = "example/call-cost-counter";
    type Args = ();
    type Msg = u64;
    type Reply = u64;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self(0))
    }

    async fn handle(&mut self, _: &Member, x: u64) -> Result<u64, ActorError> {
        self.0 += 1;
        Ok(x.wrapping_add(self.0))
    }
}

regent::mesh::register_actor!(Counter);

fn main() -> anyhow::Result<()> {
    regent::bootstrap();
    let ops: usize = match std::env::var("REGENT_COST_OPS") {
        Ok(v) => v.parse()?,
        Err(_) => 10_000,
    };
    let casts = match std::env::var("REGENT_COST_MODE").as_deref() {
        Ok("cast") => true,
        Ok("call") | Err(_) => false,
        Ok(other) => anyhow::bail!("REGENT_COST_MODE is call or cast, not {other}"),
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        let rt = Runtime::start(RuntimeConfig::default()).await?;
        // Under callgrind a proc takes far longer than the default 30 s to
        // start (libtorch's static set-up alone is minutes of simulation).
        let config = LocalConfig {
            start_timeout: std::time::Duration::from_secs(900),
            ..LocalConfig::default()
        };
        let local = LocalAllocator::with_config(rt.endpoint().clone(), config)?;
        let procs = rt
            .spawn_procs(std::sync::Arc::new(local), Shape::new([("procs", 1)])?)
            .await?;
        let result = run(&procs.spawn("counters", 1, &()).await?, ops, casts).await;
        procs.stop(std::time::Duration::from_secs(5)).await?;
        result
    })
}

async fn run(mesh: &ActorMesh<Counter>, ops: usize, casts: bool) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    if casts {
        let member: Selection = "procs=0".parse()?;
        for i in 0..ops {
            mesh.cast_nowait(&member, &(i as u64)).await?;
        }
        // FIFO per sender: the member has every cast once this returns.
        let count = mesh.call_one(Rank(0), &0).await?;
        anyhow::ensure!(
            count == ops as u64 + 1,
            "the member counted {count} of {ops} casts and a call"
        );
    } else {
        let mut answers = futures::stream::iter(0..ops)
            .map(|i| async move { mesh.call_one(Rank(0), &(i as u64)).await })
            .buffer_unordered(IN_FLIGHT);
        let mut done = 0;
        while let Some(r) = answers.next().await {
            r?;
            done += 1;
        }
        anyhow::ensure!(done == ops, "{done} of {ops} calls answered");
    }
    let elapsed = t.elapsed();
    println!(
        "{ops} {}: {elapsed:?} ({:.0}/s)",
        if casts { "casts" } else { "calls" },
        ops as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
