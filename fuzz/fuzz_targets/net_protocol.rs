//! The protocol frames of the control plane as a peer receives them: any
//! bytes decode as a `Control`, `ToReceiver` or `ToSender` frame body or
//! fail cleanly, and whatever decodes round-trips through its encoding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_fuzz::round_trip;
use regent_net::wire::{self, Control, ToReceiver, ToSender};

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = wire::decode_body::<Control>(data) {
        round_trip(&frame);
    }
    if let Ok(frame) = wire::decode_body::<ToReceiver>(data) {
        round_trip(&frame);
    }
    if let Ok(frame) = wire::decode_body::<ToSender>(data) {
        round_trip(&frame);
    }
});
