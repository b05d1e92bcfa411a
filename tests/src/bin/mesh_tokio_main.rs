//! A controller whose `main` is `#[tokio::main]`: `bootstrap()` runs inside
//! the async runtime, in the controller and in its procs (this same binary,
//! started by the local allocator). It spawns a mesh of 2 procs × 2
//! members, calls every member, prints `OK <replies> <pid>,<pid>,...` (the
//! members' processes), stops the procs and exits.

use std::time::Duration;

use regent_mesh::{Runtime, RuntimeConfig, Selection, Shape};
use regent_tests::mesh_actors::{Op, Reply, Worker, WorkerArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    regent_mesh::bootstrap();
    let rt = Runtime::start(RuntimeConfig::default()).await?;
    let procs = rt
        .spawn_procs(rt.local_allocator()?, Shape::new([("procs", 2)])?)
        .await?;
    let mesh = procs
        .spawn::<Worker>("w", 2, &WorkerArgs::default())
        .await?;
    let replies = mesh
        .call(&Selection::All, &Op::Whoami)
        .await?
        .into_result()?;
    let mut pids: Vec<u32> = replies
        .iter()
        .filter_map(|(_, r)| match r {
            Reply::Me { pid, .. } => Some(*pid),
            _ => None,
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    println!("OK {} {}", replies.len(), pids.join(","));
    procs.stop(Duration::from_secs(2)).await?;
    Ok(())
}
