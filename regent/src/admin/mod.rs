//! The controller's admin endpoint: a small HTTP/1 server (hyper) beside a
//! running job that serves
//!
//! - `/` — the live dashboard (`dashboard.html`, one page, no framework);
//! - `/api/status` — [`RuntimeSnapshot`] as JSON (what `regent status`
//!   prints);
//! - `/api/events?since=N` — the runtime's journal of failures and
//!   recoveries from event `N` on;
//! - `/api/train` — a training job's series (step, loss, step time) and
//!   its faults;
//! - `/metrics` — the runtime's metrics in the Prometheus text format.
//!
//! On a loopback address nothing is asked; bound elsewhere, every request
//! needs the token the server generated (`Authorization: Bearer TOKEN`, or
//! `?token=TOKEN` for a browser), written to a file only its user can read.
//! The same page, with the data embedded instead of polled, is the HTML
//! report ([`report_html`]).

mod status;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use regent_mesh::Runtime;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub(crate) use status::{StatusOptions, status};

/// The dashboard page; `/*REGENT_DATA*/` is where a report embeds its data.
const DASHBOARD: &str = include_str!("dashboard.html");
/// Where a report's data goes in the page.
const DATA_SLOT: &str = "/*REGENT_DATA*/";
/// The most points a series keeps (older ones are thinned).
const MAX_POINTS: usize = 20_000;

/// One committed step.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StepPoint {
    pub(crate) step: u64,
    pub(crate) loss: f64,
    pub(crate) time_ms: f64,
    /// Milliseconds since the runtime started.
    pub(crate) at_ms: u64,
    pub(crate) generation: u64,
}

/// A training job's series, for the dashboard and the report.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct TrainSeries {
    /// The job's last step.
    pub(crate) target: u64,
    pub(crate) steps: Vec<StepPoint>,
    /// Useful step time over wall time so far.
    pub(crate) goodput: f64,
    /// Whether the job has ended.
    pub(crate) done: bool,
}

/// A training job's metrics, in the runtime's registry.
struct TrainMetrics {
    step: Gauge,
    loss: Gauge<f64, std::sync::atomic::AtomicU64>,
    step_time: Histogram,
    goodput: Gauge<f64, std::sync::atomic::AtomicU64>,
}

/// What the server's requests share.
struct State {
    rt: Runtime,
    token: Option<String>,
    train: Mutex<TrainSeries>,
    metrics: Mutex<Option<TrainMetrics>>,
    started: std::time::Instant,
    useful: Mutex<Duration>,
}

/// A running admin endpoint; dropping it stops the server.
pub(crate) struct Admin {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A fresh token: 32 bytes from the OS, in hex.
fn fresh_token() -> std::io::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `token` to `path`, readable by its user only.
fn write_token(path: &Path, token: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // An existing file keeps its mode: set it.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(token.as_bytes())?;
    f.write_all(b"\n")
}

/// Whether two strings are equal, in time that depends on their lengths
/// only.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A query string's pairs (no percent-decoding: the values served are
/// numbers and hex tokens).
fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

impl Admin {
    /// Serves `rt`'s admin endpoint on `bind` (port 0: any). Off loopback,
    /// a fresh token is written to `token_file` and required.
    pub(crate) async fn start(
        rt: Runtime,
        bind: SocketAddr,
        token_file: &Path,
    ) -> anyhow::Result<Admin> {
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|e| anyhow::anyhow!("admin endpoint: cannot bind {bind}: {e}"))?;
        let addr = listener.local_addr()?;
        let token = if addr.ip().is_loopback() {
            None
        } else {
            let token = fresh_token()?;
            write_token(token_file, &token).map_err(|e| {
                anyhow::anyhow!("cannot write the token to {}: {e}", token_file.display())
            })?;
            Some(token)
        };
        let state = Arc::new(State {
            rt,
            token,
            train: Mutex::new(TrainSeries::default()),
            metrics: Mutex::new(None),
            started: std::time::Instant::now(),
            useful: Mutex::new(Duration::ZERO),
        });
        let serving = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = serving.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(&state, req)) }
                    });
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                    {
                        tracing::debug!(error = %e, "admin connection");
                    }
                });
            }
        });
        Ok(Admin { addr, state, task })
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The dashboard's link (with the token, when one is needed).
    pub(crate) fn url(&self) -> String {
        match &self.state.token {
            Some(t) => format!("http://{}/?token={t}", self.addr),
            None => format!("http://{}/", self.addr),
        }
    }

    /// A training job of `target` steps starts: its metrics join the
    /// runtime's registry.
    pub(crate) fn train_started(&self, target: u64) {
        self.state.train.lock().expect("train lock").target = target;
        let mut m = self.state.metrics.lock().expect("metrics lock");
        if m.is_some() {
            return;
        }
        let metrics = TrainMetrics {
            step: Gauge::default(),
            loss: Gauge::default(),
            // 1 ms to about 65 s.
            step_time: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            goodput: Gauge::default(),
        };
        self.state.rt.with_registry(|r| {
            r.register(
                "train_step",
                "The training job's committed steps",
                metrics.step.clone(),
            );
            r.register(
                "train_loss",
                "The global mean loss of the last committed step",
                metrics.loss.clone(),
            );
            r.register(
                "train_step_seconds",
                "Duration of committed steps",
                metrics.step_time.clone(),
            );
            r.register(
                "train_goodput",
                "Time in steps that advanced the job over wall time",
                metrics.goodput.clone(),
            );
        });
        *m = Some(metrics);
    }

    /// A step was committed; `advanced`: it was a step not committed
    /// before (not a replay).
    pub(crate) fn step(&self, point: StepPoint, advanced: bool) {
        let time = Duration::from_secs_f64(point.time_ms / 1e3);
        let goodput = {
            let mut useful = self.state.useful.lock().expect("useful lock");
            if advanced {
                *useful += time;
            }
            let wall = self.state.started.elapsed().as_secs_f64();
            if wall > 0.0 {
                (useful.as_secs_f64() / wall).min(1.0)
            } else {
                0.0
            }
        };
        if let Some(m) = &*self.state.metrics.lock().expect("metrics lock") {
            m.step.set(i64::try_from(point.step).unwrap_or(i64::MAX));
            m.loss.set(point.loss);
            m.step_time.observe(time.as_secs_f64());
            m.goodput.set(goodput);
        }
        let mut t = self.state.train.lock().expect("train lock");
        t.goodput = goodput;
        if t.steps.len() >= MAX_POINTS {
            // Keep every other point: the curve's shape stays.
            let kept: Vec<StepPoint> = t.steps.iter().step_by(2).cloned().collect();
            t.steps = kept;
        }
        t.steps.push(point);
    }

    /// The job ended.
    pub(crate) fn done(&self) {
        self.state.train.lock().expect("train lock").done = true;
    }

    /// The runtime's clock (ms since it started): the series' time axis.
    pub(crate) fn now_ms(&self) -> u64 {
        self.state.rt.elapsed_ms()
    }

    /// Everything the dashboard shows, as a report embeds it.
    pub(crate) fn data(&self, title: &str) -> serde_json::Value {
        let train = self.state.train.lock().expect("train lock").clone();
        report_data(&self.state.rt, title, Some(&train), None)
    }
}

/// What a report embeds: `rt`'s snapshot and journal, a training job's
/// series, and the report in words.
pub(crate) fn report_data(
    rt: &Runtime,
    title: &str,
    train: Option<&TrainSeries>,
    text: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({
        "title": title,
        "status": rt.snapshot(),
        "events": rt.events_since(0),
        "train": train,
        "text": text,
    })
}

/// The dashboard page with `data` embedded (no polling): a self-contained
/// HTML report.
pub(crate) fn report_html(data: &serde_json::Value) -> String {
    // `</` would end the script element early; JSON allows `<\/`.
    let json = data.to_string().replace("</", "<\\/");
    DASHBOARD.replacen(DATA_SLOT, &format!("window.REGENT_DATA = {json};"), 1)
}

/// Writes the HTML report to `path`.
pub(crate) fn write_report(path: &Path, data: &serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(path, report_html(data))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

fn respond(status: StatusCode, kind: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", kind)
        .header("cache-control", "no-store")
        .body(Full::new(body.into()))
        .expect("a valid response")
}

fn json(value: &impl Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec(value) {
        Ok(body) => respond(StatusCode::OK, "application/json", body),
        Err(e) => respond(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            e.to_string(),
        ),
    }
}

fn authorized(state: &State, req: &Request<Incoming>) -> bool {
    let Some(token) = &state.token else {
        return true;
    };
    let header = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if header.is_some_and(|h| same(h.trim(), token)) {
        return true;
    }
    query(req).get("token").is_some_and(|q| same(q, token))
}

fn handle(state: &State, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if !authorized(state, &req) {
        return respond(
            StatusCode::UNAUTHORIZED,
            "text/plain",
            "a bearer token is required (the file the controller printed)\n",
        );
    }
    if req.method() != hyper::Method::GET {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    match req.uri().path() {
        "/" | "/index.html" => respond(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD),
        "/api/status" => json(&state.rt.snapshot()),
        "/api/events" => {
            let since = query(&req)
                .get("since")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            json(&state.rt.events_since(since))
        }
        "/api/train" => json(&*state.train.lock().expect("train lock")),
        "/metrics" => respond(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.rt.render_metrics(),
        ),
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// Where `regent train` records its admin endpoint in the run directory.
pub(crate) const ADDR_FILE: &str = "admin.addr";
/// Where it writes the token when one is needed.
pub(crate) const TOKEN_FILE: &str = "admin.token";

/// The admin options of `regent train` and `regent chaos soak`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct AdminOptions {
    /// Where the admin endpoint (status, metrics, the dashboard) listens;
    /// port 0: any free port (printed). Off loopback a bearer token is
    /// required, written to `--admin-token-file`. `off`: no endpoint.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) admin: String,
    /// Where the token goes when the endpoint is not on loopback (default:
    /// `admin.token` in the run directory).
    #[arg(long)]
    pub(crate) admin_token_file: Option<PathBuf>,
    /// Keep the admin endpoint up this long after the report (e.g. `30s`),
    /// to look at the final state.
    #[arg(long, default_value = "0s", value_parser = crate::args::parse_duration)]
    pub(crate) linger: Duration,
    /// Also write the final report as a self-contained HTML file (the
    /// dashboard's plots, the data embedded).
    #[arg(long)]
    pub(crate) report_html: Option<PathBuf>,
}

impl Default for AdminOptions {
    /// As the command line's defaults: on loopback, any port.
    fn default() -> Self {
        Self {
            admin: "127.0.0.1:0".into(),
            admin_token_file: None,
            linger: Duration::ZERO,
            report_html: None,
        }
    }
}

impl AdminOptions {
    /// Starts the endpoint for `rt` (unless `--admin off`), prints its
    /// link, and records its address in `dir` (if given).
    pub(crate) async fn start(
        &self,
        rt: &Runtime,
        dir: Option<&Path>,
    ) -> anyhow::Result<Option<Admin>> {
        if self.admin == "off" {
            return Ok(None);
        }
        let bind: SocketAddr = self
            .admin
            .parse()
            .map_err(|e| anyhow::anyhow!("--admin {}: {e}", self.admin))?;
        let token_file = match (&self.admin_token_file, dir) {
            (Some(f), _) => f.clone(),
            (None, Some(d)) => d.join(TOKEN_FILE),
            (None, None) => PathBuf::from(TOKEN_FILE),
        };
        let admin = Admin::start(rt.clone(), bind, &token_file).await?;
        println!("dashboard: {}", admin.url());
        if admin.state.token.is_some() {
            println!("  admin token in {}", token_file.display());
        }
        if let Some(d) = dir {
            std::fs::write(d.join(ADDR_FILE), format!("{}\n", admin.addr()))
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", d.display()))?;
        }
        Ok(Some(admin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_embeds_its_data_once_and_safely() {
        let data = serde_json::json!({"title": "x</script><b>", "n": 1});
        let html = report_html(&data);
        assert_eq!(html.matches("window.REGENT_DATA = ").count(), 1);
        assert!(
            !html.contains("x</script>"),
            "a data string cannot end the script"
        );
        assert!(html.contains(r#"x<\/script><b>"#));
    }

    #[test]
    fn tokens_compare_by_value() {
        let t = fresh_token().unwrap();
        assert_eq!(t.len(), 64);
        assert!(same(&t, &t.clone()));
        assert!(!same(&t, &t[1..]));
        assert!(!same(&t, &format!("{}0", &t[..63])) || t.ends_with('0'));
        assert_ne!(t, fresh_token().unwrap());
    }

    #[test]
    fn the_token_file_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let p = std::env::temp_dir().join(format!("regent-token-{}", std::process::id()));
        std::fs::write(&p, "old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_token(&p, "abc").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "abc\n");
        std::fs::remove_file(&p).unwrap();
    }
}
