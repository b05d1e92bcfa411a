//! A controller process for the orphan tests: it starts procs (the
//! `mesh_proc` binary named by its first argument) with a short owner lease,
//! spawns a mesh on them, prints `PIDS <pid>,<pid>,...`, and waits forever —
//! until the test kills or pauses it.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use regent_mesh::alloc::LocalAllocator;
use regent_mesh::{Runtime, RuntimeConfig, Shape};
use regent_tests::mesh_actors::{Worker, WorkerArgs};

fn main() -> anyhow::Result<()> {
    regent_mesh::bootstrap();
    let proc_bin = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: mesh_controller <proc binary>"))?;
    tokio::runtime::Runtime::new()?.block_on(async move {
        let config = RuntimeConfig::default().owner_lease(Duration::from_secs(2));
        let rt = Runtime::start(config).await?;
        let alloc = Arc::new(LocalAllocator::new(rt.endpoint().clone())?.program(proc_bin));
        let procs = rt.spawn_procs(alloc, Shape::new([("procs", 3)])?).await?;
        let _mesh = procs
            .spawn::<Worker>("w", 2, &WorkerArgs::default())
            .await?;
        let pids: Vec<String> = procs.procs().iter().map(|p| p.pid.to_string()).collect();
        println!("PIDS {}", pids.join(","));
        std::io::stdout().flush()?;
        std::future::pending::<()>().await;
        Ok(())
    })
}
