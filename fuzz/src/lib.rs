//! What the fuzz targets (`fuzz_targets/`) assert about a decoded value, in
//! one place: every value a decoder accepts encodes, and its encoding
//! decodes to the same value.
//!
//! The targets, their seeds (`seeds/<target>/`) and how to run them are
//! described in `scripts/fuzz.sh` and ARCHITECTURE.md.

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Encodes `value` with the wire codec of the control plane (postcard, as
/// `regent_net::wire::encode_payload`). Every value a decoder accepted must
/// encode: a proc forwards what it decodes.
pub fn encode<T: Serialize + Debug>(value: &T) -> Vec<u8> {
    match regent_net::wire::encode_payload(value) {
        Ok(bytes) => bytes.to_vec(),
        Err(e) => panic!("a decoded value does not encode ({e}): {value:?}"),
    }
}

/// Asserts `decode(encode(value)) == value` for a `value` the wire codec
/// decoded.
pub fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let bytes = encode(value);
    match regent_net::wire::decode_body::<T>(&bytes) {
        Ok(back) => assert_eq!(&back, value, "decode(encode(x)) != x"),
        Err(e) => panic!("the encoding of a decoded value does not decode ({e}): {value:?}"),
    }
}

/// Asserts the round trip for a `value` that `decode` (a decoder and the
/// checks its receiver makes) accepted, where `T` has no `PartialEq`: its
/// encoding is accepted again, and the value decoded from it has the same
/// encoding and prints the same.
pub fn round_trip_with<T: Serialize + Debug>(value: &T, decode: impl Fn(&[u8]) -> Option<T>) {
    let bytes = encode(value);
    let Some(back) = decode(&bytes) else {
        panic!("the encoding of an accepted value is refused: {value:?}");
    };
    assert_eq!(
        encode(&back),
        bytes,
        "encode(decode(encode(x))) != encode(x)"
    );
    assert_eq!(
        format!("{back:?}"),
        format!("{value:?}"),
        "decode(encode(x)) prints unlike x"
    );
}
