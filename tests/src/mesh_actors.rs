//! The mesh actors of the end-to-end suites, registered in both the proc
//! binary (`mesh_proc`) and the test binaries that drive it.

use std::io::Write as _;
use std::time::{Duration, Instant};

use regent_mesh::{ActorError, Member, MemberThread, MeshActor, Selection};
use serde::{Deserialize, Serialize};

/// A worker that counts, reports who and where it is, and fails, panics,
/// stalls or blocks its thread on request; with a journal, every life
/// records its start, the marks it gets and its heartbeats while blocked.
pub struct Worker {
    rank: u32,
    generation: u64,
    count: u64,
    journal: Option<String>,
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
    /// Block the member's thread this many milliseconds (as tensor code
    /// does: no await, so nothing can stop it), with a journal heartbeat
    /// every 20 ms.
    Block(u64),
    /// Journal the mark.
    Mark(u64),
    /// After `after_ms`, cast `Mark(mark)` to every peer (within 2 s) and
    /// write what the cast did to the file `out`.
    CastPeersLater {
        /// How long to wait first.
        after_ms: u64,
        /// The mark to cast.
        mark: u64,
        /// Where to write the outcome.
        out: String,
    },
    /// Reply with the length of the bytes.
    Echo(Vec<u8>),
    /// Reply with this many bytes.
    Blob(u32),
    /// Write `text` to stdout (stderr with `stderr`), with a newline
    /// unless `partial` (then flushed, so the pipe has it).
    Print {
        /// What to write.
        text: String,
        /// To stderr instead of stdout.
        stderr: bool,
        /// Without the newline.
        partial: bool,
    },
    /// Log `text` with `tracing::info!` (the proc's stderr, with the
    /// member's tag when the proc logs through `logs::ProcStderr`).
    Trace(String),
    /// Reply with the thread the handler runs on.
    Thread,
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
    /// Bytes.
    Bytes(Vec<u8>),
    /// The thread a handler ran on.
    Thread {
        /// Its name.
        name: Option<String>,
        /// Its id in its process (`ThreadId`'s debug form).
        id: String,
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
    /// A file every life appends its events to, one line each:
    /// `start <rank> <generation> <pid>`, `mark <rank> <generation> <pid>
    /// <mark>`, `beat <rank> <generation> <pid>`.
    pub journal: Option<String>,
    /// How long a restarted life's `new` takes, in milliseconds.
    pub restart_new_ms: u64,
}

/// Appends one line to the journal, if there is one (one `write` on a file
/// opened to append: lines of several processes do not interleave).
fn journal(path: Option<&str>, line: &str) {
    let Some(path) = path else { return };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

impl Worker {
    /// Journals `<event> <rank> <generation> <pid>[ <detail>]`.
    fn journal(&self, event: &str, detail: Option<u64>) {
        let mut line = format!(
            "{event} {} {} {}",
            self.rank,
            self.generation,
            std::process::id()
        );
        if let Some(d) = detail {
            line.push_str(&format!(" {d}"));
        }
        journal(self.journal.as_deref(), &line);
    }
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
        if member.start().is_restart() {
            tokio::time::sleep(Duration::from_millis(args.restart_new_ms)).await;
        }
        let worker = Self {
            rank: member.rank().0,
            generation: member.generation().0,
            count: 0,
            journal: args.journal,
        };
        worker.journal("start", None);
        Ok(worker)
    }

    async fn handle(&mut self, member: &Member, op: Op) -> Result<Reply, ActorError> {
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
            Op::Block(ms) => {
                let end = Instant::now() + Duration::from_millis(ms);
                while Instant::now() < end {
                    self.journal("beat", None);
                    std::thread::sleep(Duration::from_millis(20));
                }
                Reply::Ok
            }
            Op::Mark(mark) => {
                self.journal("mark", Some(mark));
                Reply::Ok
            }
            Op::CastPeersLater {
                after_ms,
                mark,
                out,
            } => {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                let outcome = match member.peers::<Worker>() {
                    Ok(peers) => format!(
                        "{:?}",
                        peers
                            .cast_within(&Selection::All, &Op::Mark(mark), Duration::from_secs(2))
                            .await
                    ),
                    Err(e) => format!("no peers: {e}"),
                };
                std::fs::write(&out, outcome)?;
                Reply::Ok
            }
            Op::Echo(bytes) => Reply::Count(bytes.len() as u64),
            Op::Blob(n) => Reply::Bytes(vec![self.rank as u8; n as usize]),
            Op::Print {
                text,
                stderr,
                partial,
            } => {
                use std::io::Write as _;
                let end = if partial { "" } else { "\n" };
                if stderr {
                    let mut err = std::io::stderr().lock();
                    write!(err, "{text}{end}")?;
                    err.flush()?;
                } else {
                    let mut out = std::io::stdout().lock();
                    write!(out, "{text}{end}")?;
                    out.flush()?;
                }
                Reply::Ok
            }
            Op::Trace(text) => {
                tracing::info!("{text}");
                Reply::Ok
            }
            Op::Thread => Reply::Thread {
                name: std::thread::current().name().map(str::to_owned),
                id: format!("{:?}", std::thread::current().id()),
                pid: std::process::id(),
            },
        })
    }
}

regent_mesh::register_actor!(Worker);

/// A [`Worker`] whose members run on their proc's control thread
/// ([`MemberThread::Proc`]); tests give it nothing that blocks.
pub struct ProcThreadWorker(Worker);

impl MeshActor for ProcThreadWorker {
    const NAME: &'static str = "e2e/worker-on-proc-thread";
    type Args = WorkerArgs;
    type Msg = Op;
    type Reply = Reply;
    const THREAD: MemberThread = MemberThread::Proc;

    async fn new(member: &Member, args: WorkerArgs) -> Result<Self, ActorError> {
        Worker::new(member, args).await.map(Self)
    }

    async fn handle(&mut self, member: &Member, op: Op) -> Result<Reply, ActorError> {
        self.0.handle(member, op).await
    }
}

regent_mesh::register_actor!(ProcThreadWorker);
