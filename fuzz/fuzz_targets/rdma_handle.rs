//! Buffer handles (`RemoteBuffer`) from untrusted bytes: any bytes decode
//! or are refused cleanly; a decoded handle keeps the invariants the
//! backends rely on and round-trips through its encoding; the serde path (a
//! handle inside a message) accepts exactly what `RemoteBuffer::decode` does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_rdma::RemoteBuffer;
use regent_rdma::handle::{MAX_BUFFER_BYTES, MAX_HANDLE_BYTES};

fuzz_target!(|data: &[u8]| {
    let decoded = RemoteBuffer::decode(data);
    if data.len() <= MAX_HANDLE_BYTES {
        let by_serde = regent_net::wire::decode_body::<RemoteBuffer>(data);
        assert_eq!(
            decoded.as_ref().ok(),
            by_serde.as_ref().ok(),
            "RemoteBuffer::decode and serde disagree"
        );
    }
    let Ok(handle) = decoded else { return };
    let len = handle.len_bytes();
    assert!((1..=MAX_BUFFER_BYTES).contains(&len), "length {len}");
    assert!(
        handle.shm().is_some() || handle.tcp().is_some(),
        "no usable descriptor: {handle:?}"
    );
    assert!(handle.check_range(0, len).is_ok());
    assert!(handle.check_range(len, 1).is_err());
    assert!(handle.check_range(u64::MAX, u64::MAX).is_err());
    if let Some(verbs) = handle.verbs() {
        assert!(verbs.addr.checked_add(len).is_some(), "verbs region wraps");
    }
    let bytes = handle.encode();
    assert!(bytes.len() <= MAX_HANDLE_BYTES, "{} bytes", bytes.len());
    assert_eq!(RemoteBuffer::decode(&bytes).ok().as_ref(), Some(&handle));
});
