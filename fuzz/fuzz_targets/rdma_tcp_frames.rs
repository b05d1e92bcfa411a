//! The sealed frames of the rdma tcp backend (after the handshake) from
//! untrusted bytes: any input is opened or refused cleanly (length bounds,
//! authentication), and a frame that opens seals back to exactly its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_rdma::{fuzz_tcp_open, fuzz_tcp_seal};

fuzz_target!(|data: &[u8]| {
    if let Some(payload) = fuzz_tcp_open(data) {
        let again = fuzz_tcp_seal(&payload).expect("an opened payload seals");
        assert_eq!(&data[..again.len()], &again[..], "a frame does not round-trip");
    }
});
