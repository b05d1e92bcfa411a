//! The mesh protocol as a proc or a controller receives it: any bytes
//! decode (and pass the receiver's checks) as a `ProcCommand`, `ProcReply`,
//! `MemberExited`, `SpawnChild` or `ProcStats`, or are refused cleanly; whatever is
//! accepted encodes, and its encoding is accepted as the same value.
//!
//! Decoding and checking live in `regent_mesh::protocol::fuzz_decode_*`, so
//! that this target follows the checks the protocol adds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_fuzz::round_trip_with;
use regent_mesh::protocol::{
    fuzz_decode_command, fuzz_decode_member_exited, fuzz_decode_proc_stats, fuzz_decode_reply,
    fuzz_decode_spawn_child,
};

fuzz_target!(|data: &[u8]| {
    if let Some(command) = fuzz_decode_command(data) {
        round_trip_with(&command, fuzz_decode_command);
    }
    if let Some(reply) = fuzz_decode_reply(data) {
        round_trip_with(&reply, fuzz_decode_reply);
    }
    if let Some(exited) = fuzz_decode_member_exited(data) {
        round_trip_with(&exited, fuzz_decode_member_exited);
    }
    if let Some(request) = fuzz_decode_spawn_child(data) {
        round_trip_with(&request, fuzz_decode_spawn_child);
    }
    if let Some(stats) = fuzz_decode_proc_stats(data) {
        round_trip_with(&stats, fuzz_decode_proc_stats);
    }
});
