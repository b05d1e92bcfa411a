//! `regent bench recovery`: how fast failures are seen and repaired, with
//! real proc processes and real SIGKILLs.
//!
//! - `detect_sigkill_p50` / `_p99`: SIGKILL of a proc → the `MeshFailure`
//!   at the mesh's owner (pushed by the host agent, not polled), over every
//!   kill of the run: at least [`FULL_KILLS`] in a full run (`--quick` takes
//!   fewer and says so). Absolute figures: each line says its sample
//!   count.
//! - `restart_member_answer`: SIGKILL → the mesh answers a call to every
//!   member again, with the failed member respawned on a fresh proc; against
//!   the mesh's cold spawn time in the same run.
//! - `restart_mesh_answer`: the same under the restart-mesh policy.
//! - `detect_pause_p50` / `_p99`: SIGSTOP of a proc → the `MeshFailure`
//!   at the owner (a silent link: nothing is pushed), against the control
//!   plane's configured `failure_timeout`; the proc is resumed after (its
//!   zombie is fenced and told to exit) and the mesh recovers before the
//!   next pause.

use std::time::{Duration, Instant};

use regent_mesh::{
    ActorMesh, Decision, MeshPolicy, MeshStatus, ProcMesh, Runtime, RuntimeConfig, Selection,
    Shape, SpawnOptions,
};

use super::mesh::{Echo, cluster};
use super::{BenchOptions, Figure, Report, median, percentile};

const SUITE: &str = "recovery";
const DEADLINE: Duration = Duration::from_secs(30);
/// Kills of a full run under the restart-member policy (the restart-mesh
/// policy adds half as many): the detection percentiles rest on at least
/// this many.
const FULL_KILLS: usize = 200;
/// Kills of a `--quick` run under the restart-member policy.
const QUICK_KILLS: usize = 12;

fn kill(pid: u32) -> anyhow::Result<()> {
    signal(pid, nix::sys::signal::Signal::SIGKILL)
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid)?), signal)?;
    Ok(())
}

/// Pauses proc `proc_rank` of `mesh` (SIGSTOP) until the owner sees it
/// failed; resumes it and waits for the mesh to run again. Returns the
/// detection time.
async fn pause_and_recover(
    pm: &ProcMesh,
    mesh: &ActorMesh<Echo>,
    proc_rank: usize,
) -> anyhow::Result<Duration> {
    use nix::sys::signal::Signal;
    let mut failures = mesh.failures();
    let generation = mesh.generation().0;
    let pid = pid_of(pm, mesh, proc_rank)?;
    let t = Instant::now();
    signal(pid, Signal::SIGSTOP)?;
    let seen = tokio::time::timeout(DEADLINE, failures.recv()).await;
    let detected = t.elapsed();
    signal(pid, Signal::SIGCONT)?;
    seen??;
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 > generation
    })
    .await?;
    mesh.call(&Selection::All, &1).await?.into_result()?;
    Ok(detected)
}

fn pid_of(pm: &ProcMesh, mesh: &ActorMesh<Echo>, proc_rank: usize) -> anyhow::Result<u32> {
    let proc = mesh.procs()[proc_rank].proc.clone();
    pm.all_procs()
        .into_iter()
        .find(|p| p.proc == proc)
        .map(|p| p.pid)
        .ok_or_else(|| anyhow::anyhow!("no pid for {proc}"))
}

struct Kill {
    detected: Duration,
    answered: Duration,
}

/// Kills proc `proc_rank` of `mesh` and times detection and recovery.
async fn kill_and_recover(
    pm: &ProcMesh,
    mesh: &ActorMesh<Echo>,
    proc_rank: usize,
) -> anyhow::Result<Kill> {
    let mut failures = mesh.failures();
    let generation = mesh.generation().0;
    let pid = pid_of(pm, mesh, proc_rank)?;
    let t = Instant::now();
    kill(pid)?;
    tokio::time::timeout(DEADLINE, failures.recv()).await??;
    let detected = t.elapsed();
    mesh.wait_status(DEADLINE, |s| {
        *s == MeshStatus::Running && mesh.generation().0 > generation
    })
    .await?;
    mesh.call(&Selection::All, &1).await?.into_result()?;
    Ok(Kill {
        detected,
        answered: t.elapsed(),
    })
}

async fn spawn_mesh(
    rt: &Runtime,
    alloc: &std::sync::Arc<dyn regent_mesh::alloc::Allocator>,
    decision: Decision,
) -> anyhow::Result<(ProcMesh, ActorMesh<Echo>, Duration)> {
    let t = Instant::now();
    let pm = rt
        .spawn_procs(alloc.clone(), Shape::new([("procs", 4)])?)
        .await?;
    let policy = MeshPolicy::new(decision).intensity(10_000, Duration::from_secs(1));
    let mesh = pm
        .spawn_with::<Echo>("echo", 1, &(), SpawnOptions::new().policy(policy))
        .await?;
    mesh.call(&Selection::All, &1).await?.into_result()?;
    Ok((pm, mesh, t.elapsed()))
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let kills = if opts.quick { QUICK_KILLS } else { FULL_KILLS };
    let (rt, alloc) = cluster(RuntimeConfig::default()).await?;

    let mut cold = Vec::new();
    let (pm, mesh, spawn) = spawn_mesh(&rt, &alloc, Decision::RestartMember).await?;
    cold.push(spawn);
    let mut detect = Vec::with_capacity(kills);
    let mut member = Vec::with_capacity(kills);
    for i in 0..kills {
        let k = kill_and_recover(&pm, &mesh, i % 4).await?;
        detect.push(k.detected);
        member.push(k.answered);
    }
    pm.stop(Duration::from_secs(2)).await?;

    let (pm, mesh, spawn) = spawn_mesh(&rt, &alloc, Decision::RestartMesh).await?;
    cold.push(spawn);
    let mut whole = Vec::with_capacity(kills / 2);
    for i in 0..kills / 2 {
        let k = kill_and_recover(&pm, &mesh, i % 4).await?;
        detect.push(k.detected);
        whole.push(k.answered);
    }
    pm.stop(Duration::from_secs(2)).await?;

    let pauses = if opts.quick { 6 } else { 40 };
    let (pm, mesh, spawn) = spawn_mesh(&rt, &alloc, Decision::RestartMember).await?;
    cold.push(spawn);
    let mut paused = Vec::with_capacity(pauses);
    for i in 0..pauses {
        paused.push(pause_and_recover(&pm, &mesh, i % 4).await?);
    }
    pm.stop(Duration::from_secs(2)).await?;
    for _ in 0..2 {
        let (pm, _, spawn) = spawn_mesh(&rt, &alloc, Decision::RestartMember).await?;
        cold.push(spawn);
        pm.stop(Duration::from_secs(2)).await?;
    }

    detect.sort_unstable();
    if opts.quick {
        println!(
            "{SUITE}: --quick: {} kills; a full run takes at least {FULL_KILLS}",
            detect.len()
        );
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    report.push(
        Figure::new(
            SUITE,
            "detect_sigkill_p50",
            ms(percentile(&detect, 50.0)),
            "ms",
        )
        .samples(detect.len()),
    );
    report.push(
        Figure::new(
            SUITE,
            "detect_sigkill_p99",
            ms(percentile(&detect, 99.0)),
            "ms",
        )
        .samples(detect.len()),
    );
    paused.sort_unstable();
    let timeout = ms(rt.config().endpoint.failure_timeout);
    for p in [50.0, 99.0] {
        report.push(
            Figure::new(
                SUITE,
                &format!("detect_pause_p{p}"),
                ms(percentile(&paused, p)),
                "ms",
            )
            .samples(paused.len())
            .against("failure_timeout", timeout, "ms"),
        );
    }
    let cold = ms(median(&mut cold));
    report.push(
        Figure::new(
            SUITE,
            "restart_member_answer",
            ms(median(&mut member)),
            "ms",
        )
        .samples(member.len())
        .against("cold_spawn_4_procs", cold, "ms"),
    );
    report.push(
        Figure::new(SUITE, "restart_mesh_answer", ms(median(&mut whole)), "ms")
            .samples(whole.len())
            .against("cold_spawn_4_procs", cold, "ms"),
    );
    Ok(())
}
