//! The peer process of a two-process suite: this binary again, run with a
//! hidden subcommand, talking over its stdin and stdout.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};

/// A running peer; killed and reaped on drop, and its directory removed.
pub(super) struct Peer {
    child: Child,
    dir: PathBuf,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    deadline: Duration,
}

impl Peer {
    /// The peer process's id.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Makes a fresh directory for `suite`, lets `setup` put the peer's
    /// credentials there, starts `regent <command> --dir <dir>`, and waits
    /// (up to `deadline`) for its first line, which it returns.
    pub(super) async fn start(
        suite: &str,
        command: &str,
        deadline: Duration,
        setup: impl FnOnce(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<(Self, String)> {
        let dir = std::env::temp_dir().join(format!("regent-bench-{suite}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let started = Self::spawn(&dir, command, deadline, setup);
        let mut peer = match started {
            Ok(peer) => peer,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let ready = peer.line().await.context("the peer did not start")?;
        Ok((peer, ready))
    }

    fn spawn(
        dir: &Path,
        command: &str,
        deadline: Duration,
        setup: impl FnOnce(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        setup(dir)?;
        let mut child = Command::new(std::env::current_exe()?)
            .arg(command)
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn the bench peer")?;
        let io = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = io else {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the peer's stdin and stdout are not piped");
        };
        Ok(Self {
            child,
            dir: dir.to_owned(),
            stdin: ChildStdin::from_std(stdin)?,
            lines: BufReader::new(ChildStdout::from_std(stdout)?).lines(),
            deadline,
        })
    }

    /// The peer's next line.
    pub(super) async fn line(&mut self) -> anyhow::Result<String> {
        tokio::time::timeout(self.deadline, self.lines.next_line())
            .await
            .context("the peer did not answer")??
            .context("the peer exited")
    }

    /// Sends the peer a line and returns its answer.
    pub(super) async fn ask(&mut self, cmd: &str) -> anyhow::Result<String> {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        self.line().await
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
