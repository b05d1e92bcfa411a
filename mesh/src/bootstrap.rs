//! `bootstrap()`: one binary, three roles.
//!
//! Call [`bootstrap`] first thing in `main` (also under `#[tokio::main]`).
//! In the controller it returns at once. A host agent starts the same binary
//! as a proc (`REGENT_ROLE=proc`, boot on stdin) or as a host agent
//! (`REGENT_ROLE=host`); then `bootstrap` runs that role and exits the
//! process, never returning — so the user's mesh actor types, registered in
//! this binary, exist in every proc.

use std::sync::Arc;
use std::time::Duration;

use crate::boot::{self, Role};
use crate::proc::{self, LeaseClock, ProcExit, ProcSetup};

/// The exit code of a proc stopped by its owner.
pub const EXIT_REQUESTED: i32 = 0;
/// The exit code of a proc whose owner's lease lapsed.
pub const EXIT_LEASE_LAPSED: i32 = 3;
/// The exit code of a proc whose endpoint closed.
pub const EXIT_ENDPOINT_CLOSED: i32 = 4;
/// The exit code of a proc with a member that could not be stopped (it ran
/// code that never yields): its owner replaces the proc.
pub const EXIT_MEMBER_STUCK: i32 = 5;
/// The exit code of a proc or host that could not start.
pub const EXIT_BOOT_FAILED: i32 = 70;

/// Runs this process's role: returns in the controller; runs the proc
/// runtime or host agent and exits the process otherwise.
///
/// Works inside an async runtime too (`#[tokio::main]`): a proc or host
/// agent then runs on a thread of its own with its own runtime.
pub fn bootstrap() {
    let role = match boot::try_role() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("regent: {e}");
            std::process::exit(EXIT_BOOT_FAILED);
        }
    };
    if role == Role::Controller {
        return;
    }
    let code = if tokio::runtime::Handle::try_current().is_ok() {
        // A runtime cannot start inside another: run the role beside it.
        match std::thread::Builder::new()
            .name(format!("regent-{role}"))
            .spawn(move || run_role(role))
            .map(std::thread::JoinHandle::join)
        {
            Ok(Ok(code)) => code,
            _ => EXIT_BOOT_FAILED,
        }
    } else {
        run_role(role)
    };
    std::process::exit(code);
}

fn run_role(role: Role) -> i32 {
    // A proc's control plane (its endpoint, command loop, cast dispatch and
    // the payload plane's servers) runs on one thread: its members run on
    // threads of their own, so nothing here competes with them for a
    // runtime, and every hop of a message through the proc is a task switch
    // on that thread instead of a wake-up of another worker (measured: a
    // call to a member 180 -> 109 us, pipelined calls 75k -> 116k/s, with
    // the controller on one thread too). A host agent keeps a worker pool:
    // it reaps and kills procs with short blocking waits.
    let mut builder = match role {
        Role::Proc => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().thread_name("regent-control").build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("regent: cannot start the async runtime: {e}");
            return EXIT_BOOT_FAILED;
        }
    };
    let code = runtime.block_on(async {
        match role {
            Role::Proc => run_proc().await,
            Role::Host => match crate::host::run_from_args(std::env::args().skip(1)).await {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("regent host: {e}");
                    EXIT_BOOT_FAILED
                }
            },
            Role::Controller => 0,
        }
    });
    // Members and tasks still running are abandoned on purpose: the proc is
    // done.
    runtime.shutdown_background();
    code
}

async fn run_proc() -> i32 {
    let start = match boot::start_proc().await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("regent proc: {e}");
            return EXIT_BOOT_FAILED;
        }
    };
    let buffers = match start.buffer_manager().await {
        Ok(b) => Some(Arc::new(b)),
        Err(e) => {
            eprintln!(
                "regent proc {}: the payload plane did not start: {e}",
                start.boot.proc
            );
            return EXIT_BOOT_FAILED;
        }
    };
    let lease = start.boot.owner_lease.min(proc::MAX_OWNER_LEASE);
    let lease_clock = LeaseClock::new(lease);
    if let Err(e) = watch_lease(lease_clock.clone(), lease) {
        eprintln!("regent proc {}: no lease watchdog: {e}", start.boot.proc);
        return EXIT_BOOT_FAILED;
    }
    let setup = ProcSetup {
        endpoint: start.endpoint.clone(),
        owner: start.boot.owner.proc.clone(),
        owner_lease: start.boot.owner_lease,
        owner_key: start.boot.owner_key,
        buffers,
        member_threads: true,
        seed: None,
        lease_clock: Some(lease_clock),
    };
    // This runtime is the proc's control thread (current-thread): keep it
    // polling between the messages of an exchange (`regent_net::spin`).
    drop(tokio::spawn(regent_net::spin::keep_awake(
        start.boot.endpoint.control_spin,
    )));
    let ready = async { start.report_ready().await.map_err(|e| e.to_string()) };
    match proc::serve(setup, ready).await {
        Ok(ProcExit::Requested) => EXIT_REQUESTED,
        Ok(ProcExit::LeaseLapsed) => EXIT_LEASE_LAPSED,
        Ok(ProcExit::EndpointClosed) => EXIT_ENDPOINT_CLOSED,
        Ok(ProcExit::MemberStuck { .. }) => EXIT_MEMBER_STUCK,
        Err(e) => {
            eprintln!("regent proc {}: {e}", start.boot.proc);
            EXIT_BOOT_FAILED
        }
    }
}

/// How long past its lease's lapse a proc's serve loop may take to notice
/// before the watchdog ends the process: half the lease, at least a second.
fn watchdog_grace(lease: Duration) -> Duration {
    (lease / 2).max(Duration::from_secs(1))
}

/// How often the lease watchdog looks at the clock at most.
const WATCHDOG_CHECK: Duration = Duration::from_millis(250);

/// Watches a proc's lease from a thread of its own: when it lapsed
/// [`watchdog_grace`] ago and the serve loop has not acted (its thread is
/// held: a member on the proc's thread in code that never yields), the
/// process exits with [`EXIT_LEASE_LAPSED`], as the loop would have. Its
/// owner replaced the proc when the proc fell silent; this ends the zombie
/// within a lease. The grace counts only time this thread saw pass: after
/// a gap in its checks (the process was stopped, SIGSTOP, or starved of a
/// core) the loop gets a whole grace from then to end the proc itself,
/// stopping its members gracefully, as it would have without a watchdog.
fn watch_lease(clock: LeaseClock, lease: Duration) -> std::io::Result<()> {
    let grace = watchdog_grace(lease);
    std::thread::Builder::new()
        .name("regent-lease-watch".into())
        .spawn(move || {
            let mut last = std::time::Instant::now();
            let mut watched_from = last;
            while let Some(deadline) = clock.deadline() {
                let now = std::time::Instant::now();
                if now.duration_since(last) > 2 * WATCHDOG_CHECK {
                    watched_from = now;
                }
                last = now;
                let Some(due) = deadline.max(watched_from).checked_add(grace) else {
                    // Never due; a renewal may bring it back in range.
                    std::thread::sleep(WATCHDOG_CHECK);
                    continue;
                };
                if now >= due {
                    eprintln!(
                        "regent proc: the owner's lease lapsed {:?} ago and the proc's control \
                         thread did not act (held by a member in code that never yields?): exiting",
                        now.saturating_duration_since(deadline)
                    );
                    std::process::exit(EXIT_LEASE_LAPSED);
                }
                std::thread::sleep((due - now).min(WATCHDOG_CHECK));
            }
        })
        .map(|_| ())
}
