//! The envelope codec: arbitrary bytes decode or fail cleanly, and whatever
//! decodes re-encodes to a body that decodes to the same envelope.
#![no_main]

use libfuzzer_sys::fuzz_target;
use regent_net::wire::{self, ToReceiver};

fuzz_target!(|data: &[u8]| {
    if let Ok(envelope) = wire::decode_envelope(data) {
        let frame = wire::encode_frame(&ToReceiver::Message(envelope.clone()), usize::MAX)
            .expect("a decoded envelope encodes");
        let frames: Vec<ToReceiver> =
            wire::decode_stream(&frame, usize::MAX).expect("its frame decodes");
        assert_eq!(frames, vec![ToReceiver::Message(envelope)]);
    }
    if let Ok(frame) = wire::decode_body::<ToReceiver>(data) {
        let again = wire::encode_frame(&frame, usize::MAX).expect("encodes");
        let back: Vec<ToReceiver> = wire::decode_stream(&again, usize::MAX).expect("decodes");
        assert_eq!(back, vec![frame]);
    }
});
