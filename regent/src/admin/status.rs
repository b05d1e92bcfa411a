//! `regent status [ADDR]`: asks a running controller's admin endpoint for
//! its snapshot and prints the tree of meshes and members (or its metrics
//! with `--metrics`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use regent_mesh::{MeshSnapshot, RuntimeSnapshot};

use super::{ADDR_FILE, TOKEN_FILE};

/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a response may hold.
const MAX_BODY: usize = 64 << 20;

/// What `regent status` was asked.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StatusOptions {
    /// The admin endpoint (`HOST:PORT`, as `regent train` printed it).
    /// Default: the one recorded in the run directory.
    pub(crate) addr: Option<String>,
    /// The run directory whose job to ask (its `admin.addr`, and its
    /// `admin.token` when there is one).
    #[arg(long, default_value = "regent-run")]
    pub(crate) run_dir: PathBuf,
    /// A file with the bearer token (an endpoint off loopback needs one;
    /// `REGENT_ADMIN_TOKEN` works too).
    #[arg(long)]
    pub(crate) token_file: Option<PathBuf>,
    /// Print the metrics (Prometheus text) instead of the tree.
    #[arg(long)]
    pub(crate) metrics: bool,
    /// Print the snapshot as JSON instead of the tree.
    #[arg(long)]
    pub(crate) json: bool,
}

/// GETs `path` from the endpoint at `addr`; the body, if the answer is 200.
async fn get(addr: &str, path: &str, token: Option<&str>) -> anyhow::Result<Bytes> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the admin endpoint at {addr}: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let driver = tokio::spawn(conn);
    let mut req = hyper::Request::get(path).header(hyper::header::HOST, addr);
    if let Some(t) = token {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let resp = sender
        .send_request(req.body(Empty::<Bytes>::new())?)
        .await?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
        .to_bytes();
    driver.abort();
    if !status.is_success() {
        anyhow::bail!(
            "{addr}{path}: {status}: {}",
            String::from_utf8_lossy(&body).trim()
        );
    }
    Ok(body)
}

fn token(opts: &StatusOptions) -> anyhow::Result<Option<String>> {
    if let Some(f) = &opts.token_file {
        let t = std::fs::read_to_string(f)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", f.display()))?;
        return Ok(Some(t.trim().to_owned()));
    }
    if let Ok(t) = std::env::var("REGENT_ADMIN_TOKEN") {
        return Ok(Some(t.trim().to_owned()));
    }
    Ok(std::fs::read_to_string(opts.run_dir.join(TOKEN_FILE))
        .ok()
        .map(|t| t.trim().to_owned()))
}

/// Runs `regent status`.
pub(crate) async fn status(opts: StatusOptions) -> anyhow::Result<()> {
    let addr = match &opts.addr {
        Some(a) => a.clone(),
        None => {
            let f = opts.run_dir.join(ADDR_FILE);
            std::fs::read_to_string(&f)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "no ADDR given and no {} ({e}): is a job running there?",
                        f.display()
                    )
                })?
                .trim()
                .to_owned()
        }
    };
    let token = token(&opts)?;
    let path = if opts.metrics {
        "/metrics"
    } else {
        "/api/status"
    };
    let body = tokio::time::timeout(REQUEST_TIMEOUT, get(&addr, path, token.as_deref()))
        .await
        .map_err(|_| anyhow::anyhow!("{addr} did not answer within {REQUEST_TIMEOUT:?}"))??;
    if opts.metrics {
        print!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let snapshot: RuntimeSnapshot = serde_json::from_slice(&body)
        .map_err(|e| anyhow::anyhow!("{addr} answered something that is not a status: {e}"))?;
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", tree(&snapshot));
    }
    Ok(())
}

fn secs(ms: u64) -> String {
    format!("{:.2}s", ms as f64 / 1e3)
}

/// The snapshot as a tree: meshes under their owners, ranks under their
/// mesh, then its last failures.
pub(crate) fn tree(s: &RuntimeSnapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "controller {} (up {})",
        s.controller,
        secs(s.uptime_ms)
    );
    if let Some(f) = &s.job_failure {
        let _ = writeln!(out, "  JOB STOPPED: {f}");
    }
    let roots: Vec<&MeshSnapshot> = s
        .meshes
        .iter()
        .filter(|m| {
            m.owner
                .is_none_or(|(o, _)| !s.meshes.iter().any(|p| p.id == o))
        })
        .collect();
    if roots.is_empty() {
        let _ = writeln!(out, "  (no live meshes)");
    }
    for m in roots {
        mesh(&mut out, s, m, 1);
    }
    out
}

fn mesh(out: &mut String, s: &RuntimeSnapshot, m: &MeshSnapshot, depth: usize) {
    let pad = "  ".repeat(depth);
    let owner = match m.owner {
        Some((o, r)) => format!("mesh {o} rank {r}"),
        None => "the controller".into(),
    };
    let _ = writeln!(
        out,
        "{pad}mesh {} (id {}): {}, generation {}, restarts {}, owner {owner}",
        m.name, m.id, m.status, m.generation, m.restarts
    );
    let _ = writeln!(out, "{pad}  policy {}", m.policy);
    for r in &m.ranks {
        let _ = writeln!(out, "{pad}  rank {:<4} {:<12} {}", r.rank, r.state, r.proc);
    }
    if !m.last_failures.is_empty() {
        let _ = writeln!(out, "{pad}  last failures:");
        for f in &m.last_failures {
            let _ = writeln!(
                out,
                "{pad}    at {} ranks {:?} ({}, generation {}): {}",
                secs(f.at_ms),
                f.ranks,
                f.kind,
                f.generation,
                f.cause
            );
        }
    }
    for child in s
        .meshes
        .iter()
        .filter(|c| c.owner.is_some_and(|(o, _)| o == m.id))
    {
        mesh(out, s, child, depth + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regent_mesh::{FailureRecord, RankSnapshot};

    fn m(id: u64, owner: Option<(u64, u32)>) -> MeshSnapshot {
        MeshSnapshot {
            id,
            name: format!("m{id}"),
            owner,
            policy: "p".into(),
            generation: 2,
            status: "running".into(),
            restarts: 1,
            ranks: vec![RankSnapshot {
                rank: 0,
                proc: "p0-0".into(),
                state: "running".into(),
            }],
            last_failures: vec![FailureRecord {
                at_ms: 1500,
                ranks: vec![0],
                kind: "killed".into(),
                cause: "proc p0-0 exited: signal 9".into(),
                generation: 1,
            }],
        }
    }

    #[test]
    fn owned_meshes_print_under_their_owner() {
        let s = RuntimeSnapshot {
            controller: "quic://c".into(),
            uptime_ms: 3000,
            meshes: vec![m(0, None), m(1, Some((0, 0))), m(2, Some((9, 0)))],
            job_failure: None,
        };
        let t = tree(&s);
        let line = |needle: &str| t.lines().find(|l| l.contains(needle)).unwrap().to_owned();
        let indent = |l: String| l.len() - l.trim_start().len();
        assert_eq!(indent(line("mesh m0 ")), 2);
        assert_eq!(indent(line("mesh m1 ")), 4, "{t}");
        // An owner that is gone: printed at the top.
        assert_eq!(indent(line("mesh m2 ")), 2, "{t}");
        assert!(t.contains("(killed, generation 1): proc p0-0 exited: signal 9"));
        assert!(t.contains("generation 2, restarts 1"));
    }
}
