//! The proc (and host agent) binary of the allocator suite
//! (`tests/tests/alloc.rs`). Like a user's binary, it is what its role
//! says (`REGENT_ROLE`):
//!
//! - `proc`: boots with [`regent_mesh::boot::start_proc`], opens the port
//!   `ctl[0]#0`, reports ready, and serves: [`Ping`] is answered with
//!   [`Pong`] (its proc and pid), [`Burst`] prints lines to stdout,
//!   [`Exit`] exits with a code (after
//!   `alloc_proc PROC exits` on stdout and `half a lin` without a newline
//!   on stderr: the last lines its exit report carries), [`Panic`]
//!   panics the main thread (exit code 101). With `--ignore-term` it
//!   ignores SIGTERM (a tokio signal handler replaces the default action).
//! - `host`: a host agent, `regent host` with the same options
//!   ([`regent_mesh::host::run_from_args`]).
//!
//! A boot failure exits with code 2 and the error on stderr.

#![forbid(unsafe_code)]

use regent_mesh::boot::{self, Role};
use regent_net::Generation;
use regent_tests::peers::alloc::{Burst, Exit, Panic, Ping, Pong};

fn main() {
    regent_tests::peers::init_peer_tracing();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(&format!("runtime: {e}")),
    };
    match boot::try_role() {
        Ok(Role::Proc) => {
            if let Err(e) = rt.block_on(serve_proc()) {
                fail(&e);
            }
        }
        Ok(Role::Host) => {
            if let Err(e) = rt.block_on(regent_mesh::host::run_from_args(std::env::args().skip(1)))
            {
                fail(&e.to_string());
            }
        }
        Ok(Role::Controller) => fail("alloc_proc runs as a proc or host agent (REGENT_ROLE)"),
        Err(e) => fail(&e.to_string()),
    }
}

fn fail(message: &str) -> ! {
    eprintln!("alloc_proc: {message}");
    std::process::exit(2)
}

async fn serve_proc() -> Result<(), String> {
    if std::env::args().any(|a| a == "--ignore-term") {
        use tokio::signal::unix::{SignalKind, signal};
        // Installing the handler replaces SIGTERM's default action (exit).
        let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            while term.recv().await.is_some() {
                eprintln!("alloc_proc: SIGTERM ignored");
            }
        });
    }
    let start = boot::start_proc().await.map_err(|e| e.to_string())?;
    let proc = start.boot.proc.clone();
    let me = proc.actor("ctl", 0).map_err(|e| e.to_string())?;
    let mut inbox = start
        .endpoint
        .open_port(me.port(0))
        .map_err(|e| e.to_string())?;
    start.report_ready().await.map_err(|e| e.to_string())?;
    // The host agent hands this line to the owner as a log line.
    println!("alloc_proc {proc} ready");
    loop {
        let Some(delivery) = inbox.recv().await else {
            return Ok(());
        };
        let tag = delivery.type_tag;
        if tag == regent_net::TypeTag::of::<Ping>() {
            let ping = delivery.decode::<Ping>().map_err(|e| e.to_string())?;
            let pong = Pong {
                n: ping.n,
                proc: proc.clone(),
                pid: std::process::id(),
            };
            if let Err(e) = start
                .endpoint
                .send(&me, &ping.reply_to, Generation(0), pong)
                .await
            {
                eprintln!("alloc_proc {proc}: pong not sent: {}", e.failure);
            }
        } else if tag == regent_net::TypeTag::of::<Burst>() {
            let burst = delivery.decode::<Burst>().map_err(|e| e.to_string())?;
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            for i in 0..burst.lines {
                writeln!(out, "{} {i}", burst.label).map_err(|e| e.to_string())?;
            }
            out.flush().map_err(|e| e.to_string())?;
        } else if tag == regent_net::TypeTag::of::<Exit>() {
            let exit = delivery.decode::<Exit>().map_err(|e| e.to_string())?;
            use std::io::Write as _;
            println!("alloc_proc {proc} exits");
            eprint!("half a lin");
            let _ = std::io::stderr().flush();
            std::process::exit(exit.code);
        } else if tag == regent_net::TypeTag::of::<Panic>() {
            panic!("alloc_proc {proc}: told to panic");
        } else {
            eprintln!("alloc_proc {proc}: unknown message {tag:?}");
        }
    }
}
