//! The request and response headers of the rdma tcp backend from untrusted
//! bytes: any header decodes or is refused cleanly, and a header that
//! decodes encodes back to exactly its bytes (nothing is ignored: reserved
//! bytes must be zero).
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_rdma::{fuzz_tcp_request, fuzz_tcp_response};

/// Bytes of a request header.
const REQUEST_BYTES: usize = 44;
/// Bytes of a response header.
const RESPONSE_BYTES: usize = 8;

fuzz_target!(|data: &[u8]| {
    if let Some(header) = data.first_chunk::<REQUEST_BYTES>()
        && let Some(again) = fuzz_tcp_request(header)
    {
        assert_eq!(&again, header, "a request header does not round-trip");
    }
    if let Some(header) = data.first_chunk::<RESPONSE_BYTES>()
        && let Some(again) = fuzz_tcp_response(header)
    {
        assert_eq!(&again, header, "a response header does not round-trip");
    }
});
