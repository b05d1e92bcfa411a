//! Owners deciding failures: a coordinator member owns a mesh of workers
//! (`Member::spawn_mesh`) and decides each of its failures
//! (`MeshActor::supervise`): a worker that fails is restarted twice, and
//! the third failure stops the workers. The controller decides the
//! coordinators' own failures with an async callback
//! (`SpawnOptions::supervise`). Restarted workers know why they started
//! (`Member::start`), survivors are told (`MeshActor::peers_restarted`),
//! and stopped workers flush in their stop hook (`MeshActor::stopping`).
//!
//! ```sh
//! cargo run --release -p regent --example supervise
//! ```

use std::time::Duration;

use anyhow::bail;
use regent::mesh::{
    ActorError, ActorMesh, Decision, FailureCause, Member, MeshActor, MeshError, MeshFailure,
    MeshPolicy, MeshStatus, PeersRestarted, Rank, Runtime, RuntimeConfig, Selection, Shape,
    SpawnOptions, StartKind,
};
use serde::{Deserialize, Serialize};

/// A worker of the owned mesh.
struct Worker {
    rank: u32,
    /// Why this life started, as a line.
    started: String,
    /// Restarts of peers this life was told of.
    told: u32,
}

#[derive(Debug, Serialize, Deserialize)]
enum WorkerMsg {
    /// Do a unit of work; reply with (rank, why this life started, peer
    /// restarts it was told of).
    Work,
    /// Fail (an error from the handler).
    Crash,
}

impl MeshActor for Worker {
    const NAME: &'static str = "example/worker";
    type Args = ();
    type Msg = WorkerMsg;
    type Reply = (u32, String, u32);

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        let start = member.start();
        let started = match &start.kind {
            StartKind::First => "first start".to_owned(),
            StartKind::Restart { cause, previous } => format!(
                "restart in generation {} (after generation {}: {}), heal from {}",
                start.generation.0,
                previous.0,
                cause_line(cause),
                start
                    .source
                    .map_or("nobody".to_owned(), |r| format!("rank {}", r.0))
            ),
        };
        Ok(Self {
            rank: member.rank().0,
            started,
            told: 0,
        })
    }

    async fn handle(
        &mut self,
        _: &Member,
        msg: WorkerMsg,
    ) -> Result<(u32, String, u32), ActorError> {
        match msg {
            WorkerMsg::Work => Ok((self.rank, self.started.clone(), self.told)),
            WorkerMsg::Crash => Err(format!("worker {} was told to crash", self.rank).into()),
        }
    }

    async fn peers_restarted(
        &mut self,
        _: &Member,
        change: &PeersRestarted,
    ) -> Result<(), ActorError> {
        self.told += 1;
        let _ = change;
        Ok(())
    }

    async fn stopping(&mut self, member: &Member) {
        // Runs in the worker's proc (its output is this program's): the
        // place to flush what must not be lost.
        println!(
            "  [proc {}] worker {} stopping in generation {}: flushed",
            member.proc(),
            self.rank,
            member.generation().0
        );
    }
}

fn cause_line(cause: &FailureCause) -> String {
    match cause {
        FailureCause::Actor { message, .. } => format!("it failed: {message}"),
        other => format!("{other:?}"),
    }
}

/// A coordinator: owns the workers and decides their failures.
struct Coordinator {
    workers: Option<ActorMesh<Worker>>,
    /// Failures of the workers decided so far.
    decided: u32,
}

#[derive(Debug, Serialize, Deserialize)]
enum CoordMsg {
    /// Spawn the workers (two per proc).
    Spawn,
    /// Make every worker work; reply with what each said, and who failed.
    Work,
    /// Tell worker `rank` to crash.
    Crash(u32),
    /// Whether the workers still run.
    WorkersRunning,
    /// How many worker failures this coordinator decided.
    Decided,
    /// Fail (an error from the handler): the controller decides.
    Fail,
}

#[derive(Debug, Serialize, Deserialize)]
enum CoordReply {
    Ok,
    Work {
        done: Vec<(u32, String, u32)>,
        failed: Vec<(u32, String)>,
    },
    /// The workers have stopped (their owner decided so).
    WorkersStopped,
    Running(bool),
    Decided(u32),
}

impl MeshActor for Coordinator {
    const NAME: &'static str = "example/coordinator";
    type Args = ();
    type Msg = CoordMsg;
    type Reply = CoordReply;

    async fn new(_: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            workers: None,
            decided: 0,
        })
    }

    async fn handle(&mut self, member: &Member, msg: CoordMsg) -> Result<CoordReply, ActorError> {
        Ok(match msg {
            CoordMsg::Spawn => {
                let workers = member
                    .spawn_mesh::<Worker>("workers", 2, &(), MeshPolicy::default())
                    .await?;
                self.workers = Some(workers);
                CoordReply::Ok
            }
            CoordMsg::Work => {
                let workers = self.workers.as_ref().ok_or("no workers")?;
                match workers.call(&Selection::All, &WorkerMsg::Work).await {
                    Ok(vm) => CoordReply::Work {
                        done: vm.values().iter().map(|(_, v)| v.clone()).collect(),
                        failed: vm
                            .failed()
                            .iter()
                            .map(|(r, e)| (r.0, e.to_string()))
                            .collect(),
                    },
                    Err(MeshError::Stopped(_)) => CoordReply::WorkersStopped,
                    Err(e) => return Err(e.into()),
                }
            }
            CoordMsg::Crash(rank) => {
                let workers = self.workers.as_ref().ok_or("no workers")?;
                match workers.call_one(Rank(rank), &WorkerMsg::Crash).await {
                    // The crash is the point: its error comes back by rank.
                    Err(MeshError::Members(failed)) => println!("  coordinator: {failed}"),
                    other => return Err(format!("worker {rank} did not crash: {other:?}").into()),
                }
                CoordReply::Ok
            }
            CoordMsg::WorkersRunning => {
                CoordReply::Running(self.workers.as_ref().is_some_and(|w| !w.status().is_done()))
            }
            CoordMsg::Decided => CoordReply::Decided(self.decided),
            CoordMsg::Fail => return Err("coordinator told to fail".into()),
        })
    }

    async fn supervise(&mut self, _: &Member, failure: &MeshFailure) -> Option<Decision> {
        self.decided += 1;
        let decision = if self.decided <= 2 {
            Decision::RestartMember
        } else {
            Decision::Stop
        };
        println!(
            "  coordinator decides failure {} of {} (ranks {:?}): {decision}",
            self.decided,
            failure.mesh,
            failure.ranks.iter().map(|r| r.0).collect::<Vec<_>>()
        );
        Some(decision)
    }
}

regent::mesh::register_actor!(Worker);
regent::mesh::register_actor!(Coordinator);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // In the procs the local allocator starts (this binary again), this
    // runs the proc runtime and never returns.
    regent::bootstrap();
    let rt = Runtime::start(RuntimeConfig::default()).await?;
    let procs = rt
        .spawn_procs(rt.local_allocator()?, Shape::new([("hosts", 2)])?)
        .await?;
    // The controller decides the coordinators' failures itself, and may
    // take its time: the mesh's supervisor awaits the answer.
    let options = SpawnOptions::new().supervise(|failure: MeshFailure| async move {
        println!("controller: the coordinators failed ({failure}); restarting the member");
        Some(Decision::RestartMember)
    });
    let coordinators = procs
        .spawn_with::<Coordinator>("coordinators", 1, &(), options)
        .await?;
    let result = run(&coordinators).await;
    procs.stop(Duration::from_secs(2)).await?;
    result
}

async fn work(coordinator: &ActorMesh<Coordinator>) -> anyhow::Result<()> {
    match coordinator.call_one(Rank(0), &CoordMsg::Work).await? {
        CoordReply::Work { done, failed } => {
            for (rank, started, told) in done {
                println!("  worker {rank}: {started}; told of {told} peer restart(s)");
            }
            for (rank, why) in failed {
                println!("  worker {rank} did not work: {why}");
            }
            Ok(())
        }
        CoordReply::WorkersStopped => {
            println!("  the workers have stopped: their owner decided so");
            Ok(())
        }
        other => bail!("the coordinator answered {other:?}"),
    }
}

async fn run(coordinators: &ActorMesh<Coordinator>) -> anyhow::Result<()> {
    coordinators.call_one(Rank(0), &CoordMsg::Spawn).await?;
    println!("coordinator 0 owns 4 workers:");
    work(coordinators).await?;
    for (round, victim) in [1u32, 2, 3].into_iter().enumerate() {
        println!("worker {victim} crashes:");
        coordinators
            .call_one(Rank(0), &CoordMsg::Crash(victim))
            .await?;
        // Wait (bounded) for the coordinator's decision to take effect.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let running = match coordinators
                .call_one(Rank(0), &CoordMsg::WorkersRunning)
                .await?
            {
                CoordReply::Running(r) => r,
                other => bail!("the coordinator answered {other:?}"),
            };
            // The first two failures restart a worker, the third stops them.
            let decided = if round < 2 {
                running && work_is_complete(coordinators).await?
            } else {
                !running
            };
            if decided {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the coordinator's decision did not take effect in 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        work(coordinators).await?;
    }
    // The coordinators were not touched by their workers' failures.
    if coordinators.status() != MeshStatus::Running || coordinators.generation().0 != 0 {
        bail!(
            "the coordinators were affected: {:?}",
            coordinators.status()
        );
    }
    println!("the coordinators still run, in generation 0");
    // A coordinator fails: the controller's callback decides.
    println!("coordinator 1 fails:");
    match coordinators.call_one(Rank(1), &CoordMsg::Fail).await {
        Err(MeshError::Members(failed)) => println!("  {failed}"),
        other => bail!("coordinator 1 did not fail: {other:?}"),
    }
    coordinators
        .wait_status(Duration::from_secs(30), |s| {
            *s == MeshStatus::Running && coordinators.generation().0 >= 1
        })
        .await?;
    match coordinators.call_one(Rank(0), &CoordMsg::Decided).await? {
        CoordReply::Decided(3) => println!(
            "coordinators run in generation 1; coordinator 0 kept its life (3 decisions made)"
        ),
        other => bail!("coordinator 0 answered {other:?}"),
    }
    Ok(())
}

/// Whether every worker answers now.
async fn work_is_complete(coordinator: &ActorMesh<Coordinator>) -> anyhow::Result<bool> {
    match coordinator.call_one(Rank(0), &CoordMsg::Work).await? {
        CoordReply::Work { failed, .. } => Ok(failed.is_empty()),
        CoordReply::WorkersStopped => Ok(false),
        other => bail!("the coordinator answered {other:?}"),
    }
}
