//! The host agent's wire (`regent_mesh::host::wire`) as an agent, a proc's
//! owner or a controller receives it: any bytes decode as each message or
//! fail cleanly, whatever decodes round-trips, and every duration decoded
//! is within `MAX_WIRE_DURATION`, so a deadline that far from now exists
//! (the agent and the proc turn leases and stop graces into deadlines, and
//! `Instant + Duration` panics on overflow).
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use regent_fuzz::{round_trip, round_trip_with};
use regent_mesh::host::wire::{
    HostHello, HostOp, HostReply, HostRequest, MAX_WIRE_DURATION, ProcExited, ProcLogs, ProcReady,
    Ready, Renew,
};
use regent_mesh::logs::{MAX_LINE_BYTES, MAX_LOG_BATCH, MAX_TAIL_LINES};
use regent_net::wire::decode_body;

/// Asserts that a decoded duration is bounded and a deadline `d` from now
/// exists.
fn deadline_exists(what: &str, d: Duration) {
    assert!(d <= MAX_WIRE_DURATION, "a decoded {what} of {d:?}");
    assert!(
        Instant::now().checked_add(d).is_some(),
        "a decoded {what} of {d:?} overflows a deadline"
    );
}

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = decode_body::<HostRequest>(data) {
        match &request.op {
            HostOp::Spawn(spawn) => {
                deadline_exists("lease", spawn.lease);
                deadline_exists("owner lease", spawn.boot.owner_lease);
            }
            HostOp::Stop { grace, .. } => deadline_exists("stop grace", *grace),
            HostOp::Signal { .. } | HostOp::Shutdown => {}
        }
        round_trip_with(&request, |b| decode_body(b).ok());
    }
    if let Ok(renew) = decode_body::<Renew>(data) {
        deadline_exists("lease", renew.lease);
        round_trip(&renew);
    }
    if let Ok(m) = decode_body::<Ready>(data) {
        round_trip(&m);
    }
    if let Ok(m) = decode_body::<HostReply>(data) {
        round_trip(&m);
    }
    if let Ok(m) = decode_body::<ProcReady>(data) {
        round_trip(&m);
    }
    if let Ok(m) = decode_body::<ProcExited>(data) {
        assert!(m.last_lines.len() <= MAX_TAIL_LINES);
        round_trip(&m);
    }
    if let Ok(m) = decode_body::<ProcLogs>(data) {
        assert!(m.lines.len() <= MAX_LOG_BATCH);
        assert!(m.lines.iter().all(|l| l.text.len() <= MAX_LINE_BYTES));
        round_trip(&m);
    }
    if let Ok(m) = decode_body::<HostHello>(data) {
        round_trip(&m);
    }
});
