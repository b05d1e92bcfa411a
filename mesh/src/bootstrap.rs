//! `bootstrap()`: one binary, three roles.
//!
//! Call [`bootstrap`] first thing in `main` (also under `#[tokio::main]`).
//! In the controller it returns at once. A host agent starts the same binary
//! as a proc (`REGENT_ROLE=proc`, boot on stdin) or as a host agent
//! (`REGENT_ROLE=host`); then `bootstrap` runs that role and exits the
//! process, never returning — so the user's mesh actor types, registered in
//! this binary, exist in every proc.

use std::sync::Arc;

use crate::boot::{self, Role};
use crate::proc::{self, ProcExit, ProcSetup};

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
    let setup = ProcSetup {
        endpoint: start.endpoint.clone(),
        owner: start.boot.owner.proc.clone(),
        owner_lease: start.boot.owner_lease,
        owner_key: start.boot.owner_key,
        buffers,
        member_threads: true,
        seed: None,
    };
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
