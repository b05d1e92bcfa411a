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
    let snapshot = parse(&body)
        .map_err(|e| anyhow::anyhow!("{addr} answered something that is not a status: {e}"))?;
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", tree(&snapshot));
    }
    Ok(())
}

/// Decodes an endpoint's answer to `/api/status` (outside bytes: any input
/// gets a snapshot or an error).
pub(crate) fn parse(body: &[u8]) -> Result<RuntimeSnapshot, serde_json::Error> {
    serde_json::from_slice(body)
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
    let mut printed = vec![false; s.meshes.len()];
    for m in roots {
        mesh(&mut out, s, m, 1, &mut printed);
    }
    out
}

/// How deep the tree is printed (a controller's meshes nest a few levels;
/// an answer with repeated ids could nest forever).
const MAX_DEPTH: usize = 16;

/// Prints `m` and the meshes it owns, each mesh of the snapshot at most
/// once (an answer with repeated ids could otherwise print without end).
fn mesh(
    out: &mut String,
    s: &RuntimeSnapshot,
    m: &MeshSnapshot,
    depth: usize,
    printed: &mut [bool],
) {
    let pad = "  ".repeat(depth);
    if depth > MAX_DEPTH {
        let _ = writeln!(out, "{pad}…");
        return;
    }
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
    for (i, child) in s.meshes.iter().enumerate() {
        if child.owner.is_some_and(|(o, _)| o == m.id) && !printed[i] {
            printed[i] = true;
            mesh(out, s, child, depth + 1, printed);
        }
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

    proptest::proptest! {
        #[test]
        fn any_answer_decodes_to_a_snapshot_or_an_error(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            if let Ok(s) = parse(&bytes) {
                let _ = tree(&s);
            }
        }

        #[test]
        fn snapshots_round_trip_and_print_whatever_their_owners(
            meshes in proptest::collection::vec((0u64..4, proptest::option::of((0u64..4, 0u32..3))), 0..6),
            uptime in 0u64..1_000_000,
        ) {
            // Ids may repeat and owners form cycles: a peer's answer need
            // not be a controller's.
            let s = RuntimeSnapshot {
                controller: "quic://c".into(),
                uptime_ms: uptime,
                meshes: meshes.iter().map(|(id, o)| m(*id, *o)).collect(),
                job_failure: None,
            };
            let json = serde_json::to_vec(&s).unwrap();
            let back = parse(&json).unwrap();
            proptest::prop_assert_eq!(&back, &s);
            let t = tree(&back);
            for mesh in s.meshes.iter().filter(|m| m.owner.is_none()) {
                let line = format!("mesh {} (id {})", mesh.name, mesh.id);
                proptest::prop_assert!(t.contains(&line), "{}", t);
            }
            proptest::prop_assert!(t.lines().count() < 10_000);
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
