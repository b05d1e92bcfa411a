//! The harness of `scripts/callgrind-calls.sh`: pipelined calls (or
//! fire-and-forget casts) from this controller to one member of one proc
//! process, as `regent bench mesh`'s `pipelined_calls` makes them, or
//! gathers (a call to every member of `REGENT_COST_PROCS` procs of one
//! member each, one gather at a time, as `call_gather_<P>x1` makes them).
//! Run under callgrind at two counts, the difference between the runs is
//! the instructions each operation costs the controller and each proc,
//! which, unlike time, repeats on a noisy machine.
//!
//! ```sh
//! REGENT_COST_OPS=20000 cargo run --release -p regent --example call_cost
//! REGENT_COST_MODE=gather REGENT_COST_PROCS=16 REGENT_COST_SPIN=1 \
//!     cargo run --release -p regent --example call_cost   # gathers/s
//! scripts/callgrind-calls.sh call   # instructions per call, by function
//! scripts/callgrind-calls.sh gather # per gather over 4 procs
//! ```

use std::time::Duration;

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
    let mode = match std::env::var("REGENT_COST_MODE").as_deref() {
        Ok("cast") => Mode::Cast,
        Ok("call") | Err(_) => Mode::Call,
        Ok("gather") => Mode::Gather,
        Ok(other) => anyhow::bail!("REGENT_COST_MODE is call, cast or gather, not {other}"),
    };
    let procs_n: usize = match (mode, std::env::var("REGENT_COST_PROCS")) {
        (Mode::Gather, Ok(v)) => v.parse()?,
        (Mode::Gather, Err(_)) => 4,
        (_, _) => 1,
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        // Under callgrind every process runs some fifty times slower, and
        // a proc whose heartbeats came later than the default 1 s was now
        // and then declared lost while the mesh spawned (or could outlive
        // its lease between renewals). A long silence allowed changes
        // nothing while links carry traffic; a long lease also keeps the
        // renewals (signed, verified at every proc) out of the counts.
        let mut config = RuntimeConfig {
            owner_lease: Duration::from_secs(300),
            ..RuntimeConfig::default()
        };
        let endpoint = config
            .endpoint
            .clone()
            .failure_timeout(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(60));
        config = config.endpoint(endpoint);
        if mode == Mode::Gather && std::env::var_os("REGENT_COST_SPIN").is_none() {
            // One round trip at a time: a control thread would spin between
            // them for a time (and so a count of instructions) that follows
            // callgrind's pace, not the code's. `REGENT_COST_SPIN` (any
            // value) keeps the spin, to time gathers or profile them with
            // `perf` as the runtime runs them.
            let endpoint = config.endpoint.clone().control_spin(Duration::ZERO);
            config = config.endpoint(endpoint);
        }
        let rt = Runtime::start(config).await?;
        // Under callgrind a proc takes far longer than the default 30 s to
        // start (libtorch's static set-up alone is minutes of simulation).
        let config = LocalConfig {
            start_timeout: Duration::from_secs(900),
            ..LocalConfig::default()
        };
        let local = LocalAllocator::with_config(rt.endpoint().clone(), config)?;
        let procs = rt
            .spawn_procs(
                std::sync::Arc::new(local),
                Shape::new([("procs", procs_n)])?,
            )
            .await?;
        let result = run(&procs.spawn("counters", 1, &()).await?, ops, mode, procs_n).await;
        procs.stop(Duration::from_secs(5)).await?;
        result
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Call,
    Cast,
    Gather,
}

async fn run(
    mesh: &ActorMesh<Counter>,
    ops: usize,
    mode: Mode,
    members: usize,
) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    if mode == Mode::Gather {
        for i in 0..ops {
            let replies = mesh.call(&Selection::All, &0).await?.into_result()?;
            anyhow::ensure!(
                replies.len() == members && replies.iter().all(|(_, count)| *count == i as u64 + 1),
                "gather {i} answered {replies:?}"
            );
        }
    } else if mode == Mode::Cast {
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
        match mode {
            Mode::Call => "calls",
            Mode::Cast => "casts",
            Mode::Gather => "gathers",
        },
        ops as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
