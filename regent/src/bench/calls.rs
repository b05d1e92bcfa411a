//! The call path's figures of `regent bench mesh`, each against a baseline
//! measured in the same run between the same kind of processes:
//!
//! - `call_rtt_p50` / `call_rtt_p99`: the controller's `call_one` to one
//!   member of a remote proc, against a 64-byte TCP echo from the
//!   controller to that member (a tokio TCP server on the member's
//!   runtime, `TCP_NODELAY`), in alternating blocks (`tcp_echo_p50`,
//!   `tcp_echo_p99`); and `call_rtt_vs_control_p50` / `_p99`, the same
//!   calls against the control plane's own round trip between two
//!   processes of this binary (`control_rtt_p50`, a 64-byte request and
//!   reply between two actors over QUIC, what `net.rtt_p50` measures): the
//!   share of a call that is the transport's.
//! - `call_rtt_cpu` and `call_rtt_runs`: what those calls cost the
//!   controller's process and the member's proc together, per call: CPU
//!   time, and how often any of their threads was put on a CPU (a wake-up
//!   each, mostly), against the same for the TCP echoes (`tcp_echo_cpu`,
//!   `tcp_echo_runs`), from the scheduler's counts over the same blocks.
//!   One call at a time keeps one of the two at work while the other
//!   waits, so a round trip whose CPU is close to its time is bound by
//!   the work done per wake-up, and the runs say how many wake-ups that is.
//!   A control thread spinning between messages (`EndpointConfig::
//!   control_spin`) is put back on its CPU after each `sched_yield`, and
//!   those turns count as runs too: read them as wake-ups only with the
//!   spin off.
//! - `pipelined_calls`: calls per second with [`IN_FLIGHT`] calls in flight
//!   to that member, against the control plane's one-way message rate
//!   between two processes of this binary (`control_one_way`, what
//!   `net.one_way` measures); a call is two messages. The calls that
//!   queue at the caster while it sends go down in shared frames, and
//!   their results that are in together come back in one reply
//!   (docs/semantics.md §4.3), as for any sender with calls in flight.
//! - `cast_nowait_rate`: fire-and-forget casts per second to that member
//!   (until it has them all: a call after them, FIFO per sender, returns
//!   its count), against the same `control_one_way`. The sender hands them
//!   over as fast as it can, so the caster finds them queued and sends
//!   them in shared frames (up to 64 casts each, docs/semantics.md §4.3),
//!   as it would for any sender that outruns it; a sender that waits for
//!   each cast pays a frame per cast.
//! - `pipelined_call_cpu` and `cast_nowait_cpu`: the CPU time per call and
//!   per cast of those runs, summed over the controller's process and the
//!   member's proc (every thread, from the scheduler's own counts), against
//!   `control_one_way_cpu`, the same sum over this process and the peer's
//!   per one-way message. The CPU a figure costs moves far less with the
//!   machine's load than its rate; a call is two messages, so a call at
//!   twice the baseline and a cast at once it would add nothing to the
//!   control plane.
//! - `controller_cpu_per_cast_<P>`: the controller process's CPU time per
//!   acknowledged cast to a mesh of P procs × 1 member, on a runtime of
//!   cast fan-out [`CPU_FANOUT`], against the same with [`CPU_FANOUT`]
//!   procs (a full first level); `controller_cpu_per_cast_nowait_<P>` the
//!   same for fire-and-forget casts (which the caster's credit keeps
//!   within what each proc queues, docs/semantics.md §4.6).
//!   Both are net of the controller's idle CPU over the casts' wall
//!   time, which is `controller_idle_cpu_<P>` (ms of CPU per second with
//!   nothing sent: heartbeats and lease renewals, per proc). The claim is
//!   that a cast's own cost stays flat in the mesh size past the fan-out,
//!   since the tree bounds what the controller sends and hears per cast. (Up to the fan-out the
//!   controller sends one frame per proc: the default fan-out is 16.)
//! - The same call, pipelined and cast figures with `_on_proc_thread`
//!   appended: to a member of `MemberThread::Proc`, which runs on its
//!   proc's control thread instead of a thread of its own (the TCP echo of
//!   their baseline then runs on that thread too).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use regent_mesh::alloc::Allocator;
use regent_mesh::{ActorMesh, MeshActor, ProcMesh, Rank, Runtime, Selection, Shape};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::mesh::{Bench, BenchOp, BenchReply};
use super::net::ControlPeer;
use super::{BenchOptions, Figure, Report, micros, percentile};

const SUITE: &str = "mesh";
/// Calls in flight for `pipelined_calls`.
pub(crate) const IN_FLIGHT: usize = 1000;
/// The bytes of one TCP echo (as `net`'s).
pub(crate) const ECHO_BYTES: usize = 64;

/// The member actors of these figures: [`Bench`], and the same on the
/// proc's thread ([`super::mesh::BenchOnProc`]).
pub(crate) trait CallTarget:
    MeshActor<Args = (), Msg = BenchOp, Reply = BenchReply>
{
}

impl<A: MeshActor<Args = (), Msg = BenchOp, Reply = BenchReply>> CallTarget for A {}

/// Runs the figures on `pm` (at least one proc; the member, an `A`, is on
/// the last); each figure's name ends in `suffix`.
pub(crate) async fn run<A: CallTarget>(
    opts: BenchOptions,
    report: &mut Report,
    pm: &ProcMesh,
    suffix: &str,
) -> anyhow::Result<()> {
    let (blocks, per_block, pipelined, casts) = if opts.quick {
        (6, 300, 20_000, 20_000)
    } else {
        (20, 1_000, 100_000, 200_000)
    };
    let mesh: ActorMesh<A> = pm.spawn("calls", 1, &()).await?;
    let member = Rank(mesh.shape().len() as u32 - 1);
    let BenchReply::Port(port) = mesh.call_one(member, &BenchOp::TcpEcho).await? else {
        anyhow::bail!("the member started no TCP echo");
    };
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.set_nodelay(true)?;
    let mut control = ControlPeer::start().await?;
    let BenchReply::Pid(proc_pid) = mesh.call_one(member, &BenchOp::Pid).await? else {
        anyhow::bail!("the member named no process");
    };
    // Warm the three paths up.
    let (mut calls, mut echoes, mut controls) = (Vec::new(), Vec::new(), Vec::new());
    call_round_trips(&mesh, member, per_block, &mut Vec::new()).await?;
    tcp_round_trips(&mut tcp, per_block, &mut Vec::new()).await?;
    control.round_trips(per_block, &mut Vec::new()).await?;
    // What the round trips cost both processes, summed over the blocks.
    let (mut call_cost, mut echo_cost) = (Cost::default(), Cost::default());
    for _ in 0..blocks {
        let before = Cost::of(proc_pid)?;
        call_round_trips(&mesh, member, per_block, &mut calls).await?;
        call_cost.add(before, Cost::of(proc_pid)?);
        let before = Cost::of(proc_pid)?;
        tcp_round_trips(&mut tcp, per_block, &mut echoes).await?;
        echo_cost.add(before, Cost::of(proc_pid)?);
        control.round_trips(per_block, &mut controls).await?;
    }
    calls.sort_unstable();
    echoes.sort_unstable();
    controls.sort_unstable();
    for p in [50.0, 99.0] {
        let call = micros(percentile(&calls, p));
        report.push(
            Figure::new(SUITE, &format!("call_rtt_p{p}{suffix}"), call, "us")
                .samples(calls.len())
                .against(
                    &format!("tcp_echo_p{p}"),
                    micros(percentile(&echoes, p)),
                    "us",
                ),
        );
        report.push(
            Figure::new(
                SUITE,
                &format!("call_rtt_vs_control_p{p}{suffix}"),
                call,
                "us",
            )
            .samples(calls.len())
            .against(
                &format!("control_rtt_p{p}"),
                micros(percentile(&controls, p)),
                "us",
            ),
        );
    }

    let n = (blocks * per_block) as f64;
    report.push(
        Figure::new(
            SUITE,
            &format!("call_rtt_cpu{suffix}"),
            call_cost.cpu.as_secs_f64() * 1e6 / n,
            "us",
        )
        .samples(blocks * per_block)
        .against("tcp_echo_cpu", echo_cost.cpu.as_secs_f64() * 1e6 / n, "us"),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("call_rtt_runs{suffix}"),
            call_cost.runs as f64 / n,
            "runs",
        )
        .samples(blocks * per_block)
        .against("tcp_echo_runs", echo_cost.runs as f64 / n, "runs"),
    );

    // Rates, interleaved with their baseline over rounds, and the CPU of
    // both processes per call, cast and message (machine noise moves it far
    // less than the rates).
    let per = |before: Duration, after: Duration, n: usize| {
        after.saturating_sub(before).as_secs_f64() * 1e6 / n as f64
    };
    control.one_way(casts / 10).await?;
    let (mut piped, mut cast_rates, mut one_way) = (Vec::new(), Vec::new(), Vec::new());
    let (mut piped_cpu, mut cast_cpu, mut one_way_cpu) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        let before = pair_cpu(proc_pid)?;
        piped.push(pipelined_calls(&mesh, member, pipelined).await?);
        piped_cpu.push(per(before, pair_cpu(proc_pid)?, pipelined));
        let before = pair_cpu(proc_pid)?;
        cast_rates.push(cast_rate(&mesh, member, casts).await?);
        cast_cpu.push(per(before, pair_cpu(proc_pid)?, casts));
        let before = pair_cpu(control.peer_pid())?;
        one_way.push(control.one_way(casts).await?);
        one_way_cpu.push(per(before, pair_cpu(control.peer_pid())?, casts));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let one_way_cpu = median(&mut one_way_cpu);
    for (name, cpu) in [
        ("pipelined_call_cpu", &mut piped_cpu),
        ("cast_nowait_cpu", &mut cast_cpu),
    ] {
        report.push(
            Figure::new(SUITE, &format!("{name}{suffix}"), median(cpu), "us")
                .samples(3)
                .against("control_one_way_cpu", one_way_cpu, "us"),
        );
    }
    let one_way = median(&mut one_way);
    report.push(
        Figure::new(
            SUITE,
            &format!("pipelined_calls{suffix}"),
            median(&mut piped),
            "calls/s",
        )
        .samples(3)
        .against("control_one_way", one_way, "msg/s"),
    );
    report.push(
        Figure::new(
            SUITE,
            &format!("cast_nowait_rate{suffix}"),
            median(&mut cast_rates),
            "casts/s",
        )
        .samples(3)
        .against("control_one_way", one_way, "msg/s"),
    );
    mesh.stop().await?;
    Ok(())
}

/// The cast fan-out of `controller_cpu_per_cast_<P>`'s runtime: small, so
/// that meshes past it fit this machine.
pub(crate) const CPU_FANOUT: u32 = 4;

/// `controller_cpu_per_cast_<P>`, `controller_cpu_per_cast_nowait_<P>` and
/// `controller_idle_cpu_<P>` for each count of procs, on `rt` (of cast
/// fan-out [`CPU_FANOUT`]), each against the first count's.
pub(crate) async fn cpu_per_cast(
    opts: BenchOptions,
    report: &mut Report,
    rt: &Runtime,
    alloc: &std::sync::Arc<dyn Allocator>,
    proc_counts: &[usize],
) -> anyhow::Result<()> {
    let casts = if opts.quick { 2_000 } else { 10_000 };
    let idle_window = Duration::from_secs(if opts.quick { 1 } else { 3 });
    let first = proc_counts.first().copied().unwrap_or(0);
    // (acked, nowait, idle) of the first count.
    let mut base: Option<(f64, f64, f64)> = None;
    for &n in proc_counts {
        let pm = rt
            .spawn_procs(alloc.clone(), Shape::new([("procs", n)])?)
            .await?;
        let mesh: ActorMesh<Bench> = pm.spawn("cpu", 1, &()).await?;
        for _ in 0..100 {
            mesh.cast(&Selection::All, &BenchOp::Echo(0))
                .await?
                .into_result()?;
        }
        // What the controller spends with nothing to do: heartbeats and
        // lease renewals, per proc. Each cast figure is net of it over the
        // casts' own wall time.
        let (cpu, wall) = (process_cpu()?, Instant::now());
        tokio::time::sleep(idle_window).await;
        let idle_rate = (process_cpu()? - cpu).as_secs_f64() / wall.elapsed().as_secs_f64();
        let net = |cpu: Duration, wall: Duration| {
            (cpu.as_secs_f64() - idle_rate * wall.as_secs_f64()).max(0.0) / f64::from(casts) * 1e6
        };
        let (cpu, wall) = (process_cpu()?, Instant::now());
        for _ in 0..casts {
            mesh.cast(&Selection::All, &BenchOp::Echo(0))
                .await?
                .into_result()?;
        }
        let acked = net(process_cpu()? - cpu, wall.elapsed());
        let (cpu, wall) = (process_cpu()?, Instant::now());
        for _ in 0..casts {
            mesh.cast_nowait(&Selection::All, &BenchOp::Echo(0)).await?;
        }
        // Delivered to all once an acked cast after them is (FIFO).
        mesh.cast(&Selection::All, &BenchOp::Echo(0))
            .await?
            .into_result()?;
        let nowait = net(process_cpu()? - cpu, wall.elapsed());
        mesh.stop().await?;
        pm.stop(Duration::from_secs(2)).await?;
        let idle_ms = idle_rate * 1e3;
        let (b_acked, b_nowait, b_idle) = *base.get_or_insert((acked, nowait, idle_ms));
        report.push(
            Figure::new(SUITE, &format!("controller_cpu_per_cast_{n}"), acked, "us")
                .samples(casts as usize)
                .against(&format!("controller_cpu_per_cast_{first}"), b_acked, "us"),
        );
        report.push(
            Figure::new(
                SUITE,
                &format!("controller_cpu_per_cast_nowait_{n}"),
                nowait,
                "us",
            )
            .samples(casts as usize)
            .against(
                &format!("controller_cpu_per_cast_nowait_{first}"),
                b_nowait,
                "us",
            ),
        );
        report.push(
            Figure::new(SUITE, &format!("controller_idle_cpu_{n}"), idle_ms, "ms/s").against(
                &format!("controller_idle_cpu_{first}"),
                b_idle,
                "ms/s",
            ),
        );
    }
    Ok(())
}

/// The CPU time another process `pid` has run, to the nanosecond: the sum
/// over its threads of the scheduler's own count
/// (`/proc/<pid>/task/*/schedstat`; `getrusage` counts only this process,
/// and `/proc/<pid>/stat` in clock ticks of 10 ms). Threads that ended are
/// not counted: the procs and the peer keep theirs while measured.
fn cpu_of(pid: u32) -> anyhow::Result<Duration> {
    Ok(schedstat(pid)?.cpu)
}

/// What this process and a proc spent so far: CPU time, and the times any
/// of their threads was put on a CPU (each a wake-up, a return after
/// preemption, or a spinning thread's turn after a yield), from the
/// scheduler's own counts.
#[derive(Clone, Copy, Default)]
pub(crate) struct Cost {
    pub(crate) cpu: Duration,
    pub(crate) runs: u64,
}

impl Cost {
    fn of(proc_pid: u32) -> anyhow::Result<Self> {
        Ok(schedstat(std::process::id())? + schedstat(proc_pid)?)
    }

    /// Adds what was spent between `before` and `after`.
    pub(crate) fn add(&mut self, before: Self, after: Self) {
        self.cpu += after.cpu.saturating_sub(before.cpu);
        self.runs += after.runs.saturating_sub(before.runs);
    }
}

impl std::ops::Add for Cost {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            cpu: self.cpu.saturating_add(other.cpu),
            runs: self.runs.saturating_add(other.runs),
        }
    }
}

/// A process's time on a CPU and runs, summed over its threads
/// (`/proc/<pid>/task/*/schedstat`: time on a CPU, time waiting to run,
/// runs). Threads that ended are left out: these figures' processes keep
/// theirs.
fn schedstat(pid: u32) -> anyhow::Result<Cost> {
    let (mut ns, mut runs) = (0u64, 0u64);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("{}: {text:?}", path.display()))?;
        let [on_cpu, _, n] = fields[..] else {
            anyhow::bail!("{}: {text:?}", path.display());
        };
        ns = ns.saturating_add(on_cpu);
        runs = runs.saturating_add(n);
    }
    Ok(Cost {
        cpu: Duration::from_nanos(ns),
        runs,
    })
}

/// What this process and its child processes (the local allocator's procs)
/// spent so far: CPU time and runs of their threads, from the scheduler's
/// counts of each thread (see [`Cost`]).
pub(crate) fn family_cost() -> anyhow::Result<Cost> {
    let me = std::process::id();
    Ok(schedstat(me)? + children_cost(me)?)
}

/// The same for the child processes of `pid` alone.
fn children_cost(pid: u32) -> anyhow::Result<Cost> {
    // A child may end between the listing and the read.
    Ok(children_of(pid)?
        .into_iter()
        .map(|child| schedstat(child).unwrap_or_default())
        .fold(Cost::default(), |total, child| total + child))
}

/// The processes whose parent is `pid` (from `/proc/*/stat`: this kernel
/// has no `/proc/<pid>/task/<tid>/children`).
fn children_of(pid: u32) -> anyhow::Result<Vec<u32>> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; the command may hold spaces and
        // parentheses, so the fields start after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|f| f.parse::<u32>().ok());
        if ppid == Some(pid) {
            children.push(child);
        }
    }
    Ok(children)
}

/// The CPU time so far of this process and of process `other` together.
pub(crate) fn pair_cpu(other: u32) -> anyhow::Result<Duration> {
    Ok(process_cpu()? + cpu_of(other)?)
}

/// This process's CPU time so far (user and system, every thread, also
/// those that ended).
fn process_cpu() -> anyhow::Result<Duration> {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)?;
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    Ok(tv(usage.user_time()) + tv(usage.system_time()))
}

async fn call_round_trips<A: CallTarget>(
    mesh: &ActorMesh<A>,
    member: Rank,
    n: usize,
    samples: &mut Vec<Duration>,
) -> anyhow::Result<()> {
    for i in 0..n {
        let t = Instant::now();
        mesh.call_one(member, &BenchOp::Echo(i as u64)).await?;
        samples.push(t.elapsed());
    }
    Ok(())
}

async fn tcp_round_trips(
    stream: &mut TcpStream,
    n: usize,
    samples: &mut Vec<Duration>,
) -> anyhow::Result<()> {
    let request = [7u8; ECHO_BYTES];
    let mut response = [0u8; ECHO_BYTES];
    for _ in 0..n {
        let t = Instant::now();
        stream.write_all(&request).await?;
        stream.read_exact(&mut response).await?;
        samples.push(t.elapsed());
    }
    Ok(())
}

/// Calls per second of `n` calls with [`IN_FLIGHT`] in flight.
async fn pipelined_calls<A: CallTarget>(
    mesh: &ActorMesh<A>,
    member: Rank,
    n: usize,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut answers = futures::stream::iter(0..n)
        .map(|i| async move { mesh.call_one(member, &BenchOp::Echo(i as u64)).await })
        .buffer_unordered(IN_FLIGHT);
    let mut done = 0;
    while let Some(r) = answers.next().await {
        r?;
        done += 1;
    }
    anyhow::ensure!(done == n, "{done} of {n} calls answered");
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// Fire-and-forget casts per second, until the member has all `n`.
async fn cast_rate<A: CallTarget>(
    mesh: &ActorMesh<A>,
    member: Rank,
    n: usize,
) -> anyhow::Result<f64> {
    let BenchReply::Count(before) = mesh.call_one(member, &BenchOp::Count).await? else {
        anyhow::bail!("no count");
    };
    let selection = rank_selection(mesh, member)?;
    let t = Instant::now();
    for i in 0..n {
        mesh.cast_nowait(&selection, &BenchOp::Echo(i as u64))
            .await?;
    }
    let BenchReply::Count(after) = mesh.call_one(member, &BenchOp::Count).await? else {
        anyhow::bail!("no count");
    };
    let elapsed = t.elapsed();
    anyhow::ensure!(
        after - before == n as u64,
        "the member had {} of {n} casts",
        after - before
    );
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// The selection of exactly `rank`, by its point.
fn rank_selection<A: CallTarget>(mesh: &ActorMesh<A>, rank: Rank) -> anyhow::Result<Selection> {
    let point = mesh
        .mesh_shape()
        .point_of(rank)
        .ok_or_else(|| anyhow::anyhow!("no rank {}", rank.0))?;
    let text: Vec<String> = point
        .names()
        .iter()
        .zip(point.coords())
        .map(|(n, c)| format!("{}={c}", n.as_str()))
        .collect();
    Ok(text.join(",").parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The children found are this process's, a child's CPU and runs count
    /// in its parent's children's, and a process that is not a child is
    /// left out. (The parent's own threads are not compared: other tests'
    /// threads come and go meanwhile.)
    #[test]
    fn children_cost_counts_children_and_only_them() {
        let me = std::process::id();
        // A child that burns CPU for a moment, then sleeps.
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; exec sleep 30",
            ])
            .spawn()
            .unwrap();
        let kill = |c: &mut std::process::Child| {
            let _ = c.kill();
            let _ = c.wait();
        };
        let found = children_of(me);
        let child_cost = (0..100)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(20));
                schedstat(child.id()).unwrap_or_default()
            })
            .find(|c| c.cpu >= Duration::from_millis(5));
        let children = children_cost(me);
        kill(&mut child);
        let found = found.unwrap();
        assert!(
            found.contains(&child.id()),
            "{found:?} lacks {}",
            child.id()
        );
        assert!(!found.contains(&1) && !found.contains(&me), "{found:?}");
        let child_cost = child_cost.expect("the child ran");
        let children = children.unwrap();
        assert!(children.cpu >= child_cost.cpu);
        assert!(children.runs >= child_cost.runs && child_cost.runs > 0);
    }
}
