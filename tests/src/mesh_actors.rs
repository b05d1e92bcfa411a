//! The mesh actors of the end-to-end suites, registered in both the proc
//! binary (`mesh_proc`) and the test binaries that drive it.

use std::time::Duration;

use regent_mesh::{ActorError, Member, MeshActor};
use serde::{Deserialize, Serialize};

/// A worker that counts, reports who and where it is, and fails, panics or
/// stalls on request.
pub struct Worker {
    rank: u32,
    generation: u64,
    count: u64,
}

/// What a [`Worker`] is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Op {
    /// Count one more; reply with the count (a fresh life starts at 0).
    Bump,
    /// Reply with this member's identity.
    Whoami,
    /// Return an error from the handler.
    Fail,
    /// Panic in the handler.
    Panic,
    /// Sleep this many milliseconds, then reply.
    Sleep(u64),
}

/// A [`Worker`]'s reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// A count.
    Count(u64),
    /// Who answered.
    Me {
        /// Its rank.
        rank: u32,
        /// Its generation.
        generation: u64,
        /// Its OS process.
        pid: u32,
    },
    /// Done.
    Ok,
}

/// How a [`Worker`] starts: it refuses to while `fail_start_if` names an
/// existing file (so a test can make restarts fail).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerArgs {
    /// A path whose existence makes starts fail.
    pub fail_start_if: Option<String>,
}

impl MeshActor for Worker {
    const NAME: &'static str = "e2e/worker";
    type Args = WorkerArgs;
    type Msg = Op;
    type Reply = Reply;

    async fn new(member: &Member, args: WorkerArgs) -> Result<Self, ActorError> {
        if let Some(path) = &args.fail_start_if
            && std::path::Path::new(path).exists()
        {
            return Err(format!("cannot start: {path} exists").into());
        }
        Ok(Self {
            rank: member.rank().0,
            generation: member.generation().0,
            count: 0,
        })
    }

    async fn handle(&mut self, _: &Member, op: Op) -> Result<Reply, ActorError> {
        Ok(match op {
            Op::Bump => {
                self.count += 1;
                Reply::Count(self.count)
            }
            Op::Whoami => Reply::Me {
                rank: self.rank,
                generation: self.generation,
                pid: std::process::id(),
            },
            Op::Fail => return Err("injected failure".into()),
            Op::Panic => panic!("injected panic in rank {}", self.rank),
            Op::Sleep(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Reply::Ok
            }
        })
    }
}

regent_mesh::register_actor!(Worker);
