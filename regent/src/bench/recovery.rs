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
//! - `restart_member_spare_answer`: `restart_member_answer` with
//!   [`SPARES`] warm spares kept (`ProcMesh::keep_spares`): the lost proc
//!   is replaced by a spare, checked at each kill; against the cold
//!   restart; and `restart_member_spare_after_failure_p50` / `_p99`: from
//!   the owner's `MeshFailure` to the member answering again (the kernel's
//!   teardown of the killed process, before anyone can know of the death,
//!   left out).
//! - `detect_pause_p50` / `_p99`: SIGSTOP of a proc → the `MeshFailure`
//!   at the owner (a silent link: nothing is pushed), against the control
//!   plane's configured `failure_timeout`; the proc is resumed after (its
//!   zombie is fenced and told to exit) and the mesh recovers before the
//!   next pause.
//! - `detect_pause_adaptive_p50` / `_p99`: the same with the adaptive
//!   detector (`failure_timeout_min` [`ADAPTIVE_MIN`], heartbeats every
//!   [`ADAPTIVE_HEARTBEAT`]), against that minimum; and
//!   `false_failures_busy_<S>s`: failures the owner saw in S seconds while
//!   every member spun on its core (four procs, each with a member
//!   spinning, on the machine's cores) with that detector, nothing
//!   injected (the claim is 0; S is 60, 5 with `--quick`, or
//!   `REGENT_BENCH_BUSY_SECS`).

use std::time::{Duration, Instant};

use regent_mesh::{
    ActorMesh, Decision, MeshPolicy, MeshStatus, ProcMesh, Runtime, RuntimeConfig, Selection,
    Shape, SpawnOptions,
};

use super::mesh::{Bench, BenchOp, Echo, cluster};
use super::{BenchOptions, Figure, Report, median, percentile};

const SUITE: &str = "recovery";
const DEADLINE: Duration = Duration::from_secs(30);
/// Kills of a full run under the restart-member policy (the restart-mesh
/// policy adds half as many): the detection percentiles rest on at least
/// this many.
const FULL_KILLS: usize = 200;
/// Kills of a `--quick` run under the restart-member policy.
const QUICK_KILLS: usize = 12;
/// The adaptive detector's minimum in the `_adaptive` figures.
const ADAPTIVE_MIN: Duration = Duration::from_millis(200);
/// The heartbeat interval in the `_adaptive` figures.
const ADAPTIVE_HEARTBEAT: Duration = Duration::from_millis(50);
/// Warm spares kept in the `_spare` figures.
const SPARES: usize = 2;

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

    // Warm spares: the same kills, each lost proc replaced by a spare.
    let (pm, mesh, spawn) = spawn_mesh(&rt, &alloc, Decision::RestartMember).await?;
    cold.push(spawn);
    pm.keep_spares(SPARES).await?;
    let mut spared = Vec::with_capacity(kills);
    let mut spared_after = Vec::with_capacity(kills);
    for i in 0..kills {
        // Each kill finds its spares refilled (started in the background
        // after the last one was taken).
        let until = Instant::now() + DEADLINE;
        while pm.spares().len() < SPARES {
            anyhow::ensure!(Instant::now() < until, "spares not refilled in time");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ready: Vec<_> = pm.spares().into_iter().map(|p| p.proc).collect();
        let k = kill_and_recover(&pm, &mesh, i % 4).await?;
        let now = mesh.procs()[i % 4].proc.clone();
        anyhow::ensure!(
            ready.contains(&now),
            "kill {i}: proc rank {} was replaced by {now}, not a spare",
            i % 4
        );
        spared.push(k.answered);
        spared_after.push(k.answered.saturating_sub(k.detected));
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
    drop(rt);

    // The adaptive detector: pauses, then a busy machine with no fault.
    let adaptive = RuntimeConfig::default().endpoint(
        regent_net::EndpointConfig::default()
            .heartbeat_interval(ADAPTIVE_HEARTBEAT)
            .failure_timeout_min(Some(ADAPTIVE_MIN)),
    );
    let (rt2, alloc2) = cluster(adaptive).await?;
    let (pm, mesh, _) = spawn_mesh(&rt2, &alloc2, Decision::RestartMember).await?;
    // Let the detectors learn the heartbeats.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // A soak of the claim: REGENT_BENCH_BUSY_SECS=1800 for 30 minutes (at
    // most a day, so that the spin's and the call's arithmetic holds).
    let busy_secs: u64 = std::env::var("REGENT_BENCH_BUSY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if opts.quick { 5 } else { 60 })
        .min(24 * 3600);
    let spinners: ActorMesh<Bench> = pm.spawn("spin", 1, &()).await?;
    let mut failures = mesh.failures();
    spinners
        .call_within(
            &Selection::All,
            &BenchOp::Spin(busy_secs * 1000),
            // A tree node gives its children 0.8 of its budget: twice the
            // spin leaves every level room to answer.
            Duration::from_secs(2 * busy_secs + 30),
        )
        .await?
        .into_result()?;
    let mut false_failures = 0u64;
    while failures.try_recv().is_ok() {
        false_failures += 1;
    }
    spinners.stop().await?;
    let mut adaptive_paused = Vec::with_capacity(pauses);
    for i in 0..pauses {
        adaptive_paused.push(pause_and_recover(&pm, &mesh, i % 4).await?);
    }
    pm.stop(Duration::from_secs(2)).await?;
    drop(rt2);
    let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
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
    adaptive_paused.sort_unstable();
    for p in [50.0, 99.0] {
        report.push(
            Figure::new(
                SUITE,
                &format!("detect_pause_adaptive_p{p}"),
                ms(percentile(&adaptive_paused, p)),
                "ms",
            )
            .samples(adaptive_paused.len())
            .against("failure_timeout_min", ms(ADAPTIVE_MIN), "ms"),
        );
    }
    report.push(Figure::new(
        SUITE,
        &format!("false_failures_busy_{busy_secs}s"),
        false_failures as f64,
        "failures",
    ));
    let cold = ms(median(&mut cold));
    let member_cold = ms(median(&mut member));
    report.push(
        Figure::new(SUITE, "restart_member_answer", member_cold, "ms")
            .samples(member.len())
            .against("cold_spawn_4_procs", cold, "ms"),
    );
    report.push(
        Figure::new(
            SUITE,
            "restart_member_spare_answer",
            ms(median(&mut spared)),
            "ms",
        )
        .samples(spared.len())
        .against("restart_member_answer", member_cold, "ms"),
    );
    spared_after.sort_unstable();
    for p in [50.0, 99.0] {
        report.push(
            Figure::new(
                SUITE,
                &format!("restart_member_spare_after_failure_p{p}"),
                ms(percentile(&spared_after, p)),
                "ms",
            )
            .samples(spared_after.len()),
        );
    }
    report.push(
        Figure::new(SUITE, "restart_mesh_answer", ms(median(&mut whole)), "ms")
            .samples(whole.len())
            .against("cold_spawn_4_procs", cold, "ms"),
    );
    Ok(())
}
