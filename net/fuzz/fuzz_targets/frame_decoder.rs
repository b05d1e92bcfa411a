//! Feeds arbitrary bytes, cut into arbitrary chunks, to the frame decoder
//! and decodes every frame as each protocol type. Nothing may panic, and a
//! frame over the limit must be refused.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use regent_net::wire::{self, Control, FrameDecoder, ToReceiver, ToSender, WireError};

#[derive(Debug, Arbitrary)]
struct Input {
    max_frame_bytes: u16,
    chunks: Vec<Vec<u8>>,
}

fuzz_target!(|input: Input| {
    let max = usize::from(input.max_frame_bytes);
    let mut decoder = FrameDecoder::new(max);
    let mut all = Vec::new();
    'feed: for chunk in &input.chunks {
        all.extend_from_slice(chunk);
        decoder.push(chunk);
        loop {
            match decoder.next_frame() {
                Ok(Some(body)) => {
                    assert!(body.len() <= max, "a frame over the limit came out");
                    let _ = wire::decode_body::<ToReceiver>(&body);
                    let _ = wire::decode_body::<ToSender>(&body);
                    let _ = wire::decode_body::<Control>(&body);
                    let _ = wire::decode_envelope(&body);
                }
                Ok(None) => break,
                Err(WireError::FrameTooLarge { len, max: m }) => {
                    assert!(len > m as u64);
                    break 'feed;
                }
                Err(e) => panic!("unexpected decoder error {e}"),
            }
        }
    }
    let _ = decoder.finish();
    // The one-shot entry point agrees on the whole input.
    let _ = wire::decode_stream::<ToReceiver>(&all, max);
});
