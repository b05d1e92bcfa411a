//! `regent bench mesh`: meshes of real proc processes (this binary, started
//! by the local allocator).
//!
//! - `call_gather_<N>`: a call to every member of an N-member mesh, replies
//!   gathered through the tree, against N concurrent calls to one member
//!   each (`call_one`, joined: what gathering by hand costs); and
//!   `call_gather_<N>_vs_call_one`, the same against one call to one member
//!   (a raw round trip). The three are timed in turn in every round, on the
//!   same members.
//! - `cold_spawn_4_procs`: four procs started and a mesh spawned on them and
//!   answering, against starting four bare processes of this binary.
//! - `controller_frames_<P>_procs`: messages the controller sends per cast,
//!   as the number of procs grows, averaged over its casts (no baseline:
//!   the claim is that it stays at most the fan-out).
//! - `sim_*`: the in-memory simulation (no sockets) of casts to 10,000 and
//!   100,000 members: the tree depth measured from the hops the frames took
//!   beside the formula's, the frames the controller and all nodes sent for
//!   one cast (deterministic: one cast is the sample), the gather time.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use regent_mesh::alloc::{Allocator, LocalAllocator};
use regent_mesh::{
    ActorError, ActorMesh, Member, MeshActor, ProcMesh, Rank, Runtime, RuntimeConfig, Selection,
    Shape,
};

use super::{BenchOptions, Figure, Report, median, micros};

const SUITE: &str = "mesh";

/// The benchmarks' mesh actor: answers with its rank.
pub(crate) struct Echo {
    rank: u32,
}

impl MeshActor for Echo {
    const NAME: &'static str = "regent-bench/echo";
    type Args = ();
    type Msg = u64;
    type Reply = u64;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            rank: member.rank().0,
        })
    }

    async fn handle(&mut self, _: &Member, x: u64) -> Result<u64, ActorError> {
        Ok(x + u64::from(self.rank))
    }
}

regent_mesh::register_actor!(Echo);

/// A runtime with a local allocator running this binary as procs.
pub(crate) async fn cluster(
    config: RuntimeConfig,
) -> anyhow::Result<(Runtime, Arc<dyn Allocator>)> {
    let rt = Runtime::start(config).await?;
    let alloc: Arc<dyn Allocator> = Arc::new(LocalAllocator::new(rt.endpoint().clone())?);
    Ok((rt, alloc))
}

async fn procs(rt: &Runtime, alloc: &Arc<dyn Allocator>, n: usize) -> anyhow::Result<ProcMesh> {
    Ok(rt
        .spawn_procs(alloc.clone(), Shape::new([("procs", n)])?)
        .await?)
}

async fn call_gather(
    report: &mut Report,
    pm: &ProcMesh,
    per_proc: u32,
    rounds: usize,
) -> anyhow::Result<()> {
    let mesh: ActorMesh<Echo> = pm.spawn("echo", per_proc, &()).await?;
    let n = mesh.shape().len();
    let all = Selection::All;
    for _ in 0..10 {
        mesh.call(&all, &1).await?.into_result()?;
    }
    let mut gathers = Vec::with_capacity(rounds);
    let mut concurrent = Vec::with_capacity(rounds);
    let mut single = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        let replies = mesh.call(&all, &1).await?.into_result()?;
        gathers.push(t.elapsed());
        anyhow::ensure!(replies.len() == n, "{} of {n} replied", replies.len());
        let t = Instant::now();
        let each =
            futures::future::join_all((0..n).map(|r| mesh.call_one(Rank(r as u32), &1))).await;
        concurrent.push(t.elapsed());
        for r in each {
            r?;
        }
        let t = Instant::now();
        mesh.call_one(Rank(0), &1).await?;
        single.push(t.elapsed());
    }
    mesh.stop().await.unwrap();
    let gather = micros(median(&mut gathers));
    report.push(
        Figure::new(SUITE, &format!("call_gather_{n}"), gather, "us")
            .samples(rounds)
            .against(
                &format!("concurrent_call_one_{n}"),
                micros(median(&mut concurrent)),
                "us",
            ),
    );
    report.push(
        Figure::new(SUITE, &format!("call_gather_{n}_vs_call_one"), gather, "us")
            .samples(rounds)
            .against("call_one", micros(median(&mut single)), "us"),
    );
    Ok(())
}

async fn cold_spawn(report: &mut Report, rounds: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut spawns = Vec::with_capacity(rounds);
    let mut bare = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
        let t = Instant::now();
        let pm = procs(&rt, &alloc, 4).await?;
        let mesh: ActorMesh<Echo> = pm.spawn("echo", 1, &()).await?;
        mesh.call(&Selection::All, &1).await?.into_result()?;
        spawns.push(t.elapsed());
        pm.stop(Duration::from_secs(2)).await?;
        let t = Instant::now();
        let mut children = Vec::new();
        for _ in 0..4 {
            children.push(
                tokio::process::Command::new(&exe)
                    .arg("--version")
                    .stdout(std::process::Stdio::null())
                    .spawn()?,
            );
        }
        for mut c in children {
            c.wait().await?;
        }
        bare.push(t.elapsed());
    }
    report.push(
        Figure::new(
            SUITE,
            "cold_spawn_4_procs",
            median(&mut spawns).as_secs_f64() * 1e3,
            "ms",
        )
        .samples(rounds)
        .against(
            "bare_process_4",
            median(&mut bare).as_secs_f64() * 1e3,
            "ms",
        ),
    );
    Ok(())
}

async fn controller_frames(report: &mut Report, proc_counts: &[usize]) -> anyhow::Result<()> {
    for &p in proc_counts {
        let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
        let pm = procs(&rt, &alloc, p).await?;
        let mesh: ActorMesh<Echo> = pm.spawn("echo", 1, &()).await?;
        let before = rt.frames_sent();
        let casts = 10;
        for _ in 0..casts {
            mesh.cast(&Selection::All, &1).await?.into_result()?;
        }
        let per_cast = (rt.frames_sent() - before) as f64 / f64::from(casts);
        report.push(
            Figure::new(
                SUITE,
                &format!("controller_frames_{p}_procs"),
                per_cast,
                "msg/cast",
            )
            .samples(casts as usize),
        );
        pm.stop(Duration::from_secs(2)).await?;
    }
    Ok(())
}

async fn simulation(report: &mut Report, members: &[(u32, u32)]) -> anyhow::Result<()> {
    let fanout = NonZeroU32::new(16).expect("non-zero");
    for &(procs, per_proc) in members {
        let r = regent_mesh::sim::simulate(procs, per_proc, fanout).await?;
        let n = r.members;
        // One cast is the sample of the counts: the tree is deterministic.
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_depth_measured"),
                f64::from(r.depth),
                "hops",
            )
            .samples(1),
        );
        report.push(Figure::new(
            SUITE,
            &format!("sim_{n}_depth_formula"),
            f64::from(r.depth_formula),
            "hops",
        ));
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_controller_frames"),
                r.controller_frames as f64,
                "msg/cast",
            )
            .samples(1),
        );
        // Each proc receives a cast once: the claim is frames = procs.
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_frames"),
                r.frames as f64,
                "msg/cast",
            )
            .samples(1),
        );
        report.push(Figure::new(
            SUITE,
            &format!("sim_{n}_procs"),
            f64::from(r.procs),
            "procs",
        ));
        report.push(
            Figure::new(
                SUITE,
                &format!("sim_{n}_gather"),
                r.gather.as_secs_f64() * 1e3,
                "ms",
            )
            .samples(1),
        );
    }
    Ok(())
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let rounds = if opts.quick { 20 } else { 200 };
    let (rt, alloc) = cluster(RuntimeConfig::default()).await?;
    for (p, per_proc) in [(1usize, 1u32), (2, 4), (4, 4), (4, 16), (4, 64)] {
        let pm = procs(&rt, &alloc, p).await?;
        call_gather(
            report,
            &pm,
            per_proc,
            if per_proc >= 16 { rounds / 4 } else { rounds },
        )
        .await?;
        pm.stop(Duration::from_secs(2)).await?;
    }
    drop(rt);
    cold_spawn(report, if opts.quick { 3 } else { 10 }).await?;
    controller_frames(report, if opts.quick { &[1, 4] } else { &[1, 4, 16] }).await?;
    let sims: &[(u32, u32)] = if opts.quick {
        &[(625, 16)]
    } else {
        &[(625, 16), (3125, 32)]
    };
    simulation(report, sims).await?;
    Ok(())
}
