//! Members talking to each other, with the controller out of the data path:
//! a token passed round a ring of members with fire-and-forget casts over
//! their own mesh (`Member::peers`), a member calling a peer with a
//! deadline and handling its failure, a member reading a peer's buffer one
//! sidedly through the payload plane (`Member::buffers`), and the
//! controller's own fire-and-forget casts, ordered before its next call.
//!
//! ```sh
//! cargo run --release -p regent --example peers
//! ```

use std::time::Duration;

use anyhow::{Context, bail};
use regent::mesh::selection::DimSpec;
use regent::mesh::{
    ActorError, ActorMesh, Member, MemberError, MeshActor, Rank, Runtime, RuntimeConfig, Selection,
    Shape,
};
use regent::rdma::{LocalBuffer, RemoteBuffer};
use serde::{Deserialize, Serialize};

/// Bytes of the "weights" each member shares.
const WEIGHTS_BYTES: usize = 16 << 20;

/// One member of the ring.
struct Node {
    rank: u32,
    /// Where the token went, once it is back at rank 0.
    trail: Option<Vec<u32>>,
    /// This member's weights, registered on the payload plane.
    weights: Option<LocalBuffer>,
    /// The sum of the nudges the controller sent.
    nudges: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    /// (rank 0) Send a token round the ring `laps` times.
    StartRing { laps: u32 },
    /// Pass the token on; it has `hops_left` hops to go (none: it is
    /// home, at rank 0).
    Token { hops_left: u32, trail: Vec<u32> },
    /// (rank 0) The trail, once the token is back.
    Trail,
    /// Register this member's weights and reply with their handle.
    Publish,
    /// Fetch the weights of rank `from`: ask it for the handle, then read
    /// them one-sidedly.
    Pull { from: u32 },
    /// Ask rank `to` to `Sleep(sleep_ms)`, waiting at most `within_ms`.
    Ask {
        to: u32,
        sleep_ms: u64,
        within_ms: u64,
    },
    /// Sleep, yielding.
    Sleep(u64),
    /// Add to the nudges.
    Nudge(u64),
    /// The sum of the nudges.
    Nudges,
}

#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    Ok,
    Trail(Option<Vec<u32>>),
    Handle(RemoteBuffer),
    Pulled {
        bytes: usize,
        backend: String,
        checksum: u64,
        expected: u64,
    },
    /// A call to a peer did not complete: who failed, and why.
    PeerFailed(Vec<(u32, MemberError)>),
    Count(u64),
}

/// The selection of exactly one rank: a point-to-point send.
fn only(mesh: &ActorMesh<Node>, rank: Rank) -> Result<Selection, ActorError> {
    let point = mesh.mesh_shape().point_of(rank).ok_or("no such rank")?;
    let dims = point
        .names()
        .iter()
        .zip(point.coords())
        .map(|(name, c)| (name.as_str().to_owned(), DimSpec::Index(*c)));
    Ok(Selection::dims(dims)?)
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn weights_of(rank: u32) -> Vec<u8> {
    (0..WEIGHTS_BYTES)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(rank) as u8)
        .collect()
}

impl MeshActor for Node {
    const NAME: &'static str = "example/node";
    type Args = ();
    type Msg = Msg;
    type Reply = Reply;

    async fn new(member: &Member, (): ()) -> Result<Self, ActorError> {
        Ok(Self {
            rank: member.rank().0,
            trail: None,
            weights: None,
            nudges: 0,
        })
    }

    async fn handle(&mut self, member: &Member, msg: Msg) -> Result<Reply, ActorError> {
        // This member's own mesh: casts and calls to its peers go from its
        // proc straight to theirs.
        let peers = member.peers::<Node>()?;
        let size = member.size();
        Ok(match msg {
            Msg::StartRing { laps } => {
                self.trail = None;
                let token = Msg::Token {
                    hops_left: laps * size - 1,
                    trail: vec![self.rank],
                };
                peers
                    .cast_nowait(&only(&peers, Rank(1 % size))?, &token)
                    .await?;
                Reply::Ok
            }
            Msg::Token {
                hops_left,
                mut trail,
            } => {
                trail.push(self.rank);
                if hops_left == 0 {
                    self.trail = Some(trail);
                    return Ok(Reply::Ok);
                }
                let next = Rank((self.rank + 1) % size);
                let token = Msg::Token {
                    hops_left: hops_left - 1,
                    trail,
                };
                // Fire and forget: a token lost with a failed member would
                // show as a trail that never comes home (the controller
                // waits with a deadline).
                peers.cast_nowait(&only(&peers, next)?, &token).await?;
                Reply::Ok
            }
            Msg::Trail => Reply::Trail(self.trail.clone()),
            Msg::Publish => {
                let buffers = member.buffers()?;
                // Peers only read it.
                let memory = regent::rdma::Memory::copy_from(&weights_of(self.rank))?;
                let weights = buffers.register_with(memory, regent::rdma::Access::ReadOnly)?;
                let handle = weights.handle().clone();
                self.weights = Some(weights);
                Reply::Handle(handle)
            }
            Msg::Pull { from } => {
                let handle = match peers.call_one(Rank(from), &Msg::Publish).await? {
                    Reply::Handle(h) => h,
                    other => return Err(format!("rank {from} answered {other:?}").into()),
                };
                let buffers = member.buffers()?;
                let backend = buffers.backend_for(&handle)?.to_string();
                let mut local = vec![0u8; handle.len_bytes() as usize];
                buffers.read_into(&handle, 0, &mut local).await?;
                Reply::Pulled {
                    bytes: local.len(),
                    backend,
                    checksum: checksum(&local),
                    expected: checksum(&weights_of(from)),
                }
            }
            Msg::Ask {
                to,
                sleep_ms,
                within_ms,
            } => {
                let vm = peers
                    .call_within(
                        &only(&peers, Rank(to))?,
                        &Msg::Sleep(sleep_ms),
                        Duration::from_millis(within_ms),
                    )
                    .await?;
                if vm.is_complete() {
                    Reply::Ok
                } else {
                    Reply::PeerFailed(vm.failed().iter().map(|(r, e)| (r.0, e.clone())).collect())
                }
            }
            Msg::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Reply::Ok
            }
            Msg::Nudge(n) => {
                self.nudges += n;
                Reply::Ok
            }
            Msg::Nudges => Reply::Count(self.nudges),
        })
    }
}

regent::mesh::register_actor!(Node);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // In the procs the local allocator starts (this binary again), this
    // runs the proc runtime and never returns.
    regent::bootstrap();
    let rt = Runtime::start(RuntimeConfig::default()).await?;
    let procs = rt
        .spawn_procs(rt.local_allocator()?, Shape::new([("hosts", 2)])?)
        .await?;
    let ring = procs.spawn::<Node>("ring", 3, &()).await?;
    let result = run(&rt, &ring).await;
    procs.stop(Duration::from_secs(2)).await?;
    result
}

async fn run(rt: &Runtime, ring: &ActorMesh<Node>) -> anyhow::Result<()> {
    println!(
        "a ring of {} members on {} procs",
        ring.shape().len(),
        ring.procs().len()
    );

    // 1. A token round the ring, twice, member to member.
    let frames = rt.frames_sent();
    match ring.call_one(Rank(0), &Msg::StartRing { laps: 2 }).await? {
        Reply::Ok => {}
        other => bail!("rank 0 did not start the ring: {other:?}"),
    }
    let trail = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match ring.call_one(Rank(0), &Msg::Trail).await? {
                Reply::Trail(Some(trail)) => return Ok::<_, anyhow::Error>(trail),
                Reply::Trail(None) => tokio::time::sleep(Duration::from_millis(10)).await,
                other => bail!("rank 0 answered {other:?}"),
            }
        }
    })
    .await
    .context("the token did not come home within 30 s (a member on its way failed?)")??;
    println!(
        "the token went {} (the controller sent {} frames meanwhile: its own polls)",
        trail
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" -> "),
        rt.frames_sent() - frames
    );

    // 2. A member asks a peer with a deadline too short: it sees the
    //    failure by rank, and says so.
    match ring
        .call_one(
            Rank(2),
            &Msg::Ask {
                to: 3,
                sleep_ms: 500,
                within_ms: 50,
            },
        )
        .await?
    {
        Reply::PeerFailed(failed) => {
            for (rank, why) in failed {
                println!("rank 2 asked rank {rank}, which failed: {why}");
            }
        }
        Reply::Ok => println!("rank 3 answered rank 2 within 50 ms"),
        other => bail!("rank 2 answered {other:?}"),
    }

    // 3. Rank 4 (on the second proc) reads rank 0's weights one-sidedly.
    match ring.call_one(Rank(4), &Msg::Pull { from: 0 }).await? {
        Reply::Pulled {
            bytes,
            backend,
            checksum,
            expected,
        } => {
            if checksum != expected {
                bail!("rank 4 read other bytes than rank 0 shared");
            }
            println!(
                "rank 4 read rank 0's {} MiB of weights through {backend}",
                bytes >> 20
            );
        }
        other => bail!("rank 4 answered {other:?}"),
    }

    // 4. Fire-and-forget casts from the controller: no answer is awaited,
    //    and the call after them sees all of them (one sender's casts keep
    //    their order).
    for n in 1..=10 {
        ring.cast_nowait(&Selection::All, &Msg::Nudge(n)).await?;
    }
    let nudges = ring.call(&Selection::All, &Msg::Nudges).await?;
    if !nudges.is_complete() {
        for (rank, why) in nudges.failed() {
            eprintln!("rank {} did not answer: {why}", rank.0);
        }
        bail!("{} members did not answer", nudges.failed().len());
    }
    for (rank, reply) in nudges.values() {
        match reply {
            Reply::Count(55) => {}
            other => bail!("rank {} saw {other:?} of the nudges, not 55", rank.0),
        }
    }
    println!("every member saw the ten nudges before the call");
    Ok(())
}
