//! The frame decoder on a stream cut into chunks, as it arrives from a QUIC
//! stream. Input: the limit (`max_frame_bytes`, u16 little-endian), a chunk
//! size (one byte; 0 feeds the whole stream at once), then the stream.
//!
//! Nothing may panic; no frame over the limit comes out, and one over it is
//! refused as soon as its prefix is in; the chunked decoder gives the same
//! frames and the same end as the one-shot `decode_stream`; every frame is
//! decoded as each protocol type (the frame bodies a peer reads next).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use regent_net::wire::{
    self, Control, FrameDecoder, LENGTH_PREFIX_BYTES, ToReceiver, ToSender, WireError,
};

fuzz_target!(|data: &[u8]| {
    let Some((&[lo, hi, chunk], stream)) = data.split_first_chunk::<3>() else {
        return;
    };
    let max = usize::from(u16::from_le_bytes([lo, hi]));
    let chunk = if chunk == 0 {
        stream.len().max(1)
    } else {
        usize::from(chunk)
    };

    let mut decoder = FrameDecoder::new(max);
    let mut bodies: Vec<Bytes> = Vec::new();
    let mut refused = None;
    let mut fed = 0;
    'feed: for piece in stream.chunks(chunk) {
        decoder.push(piece);
        fed += piece.len();
        loop {
            match decoder.next_frame() {
                Ok(Some(body)) => {
                    assert!(body.len() <= max, "a frame over the limit came out");
                    bodies.push(body);
                }
                Ok(None) => break,
                Err(e @ WireError::FrameTooLarge { len, max: m }) => {
                    assert!(len > m as u64, "refused {len} bytes under the limit {m}");
                    refused = Some(e);
                    break 'feed;
                }
                Err(e) => panic!("unexpected decoder error {e}"),
            }
        }
        // Drained, the decoder holds less than one frame.
        assert!(
            decoder.buffered() < LENGTH_PREFIX_BYTES + max,
            "{} bytes buffered after {fed} fed",
            decoder.buffered()
        );
    }
    for body in &bodies {
        let _ = wire::decode_body::<ToReceiver>(body);
        let _ = wire::decode_body::<ToSender>(body);
        let _ = wire::decode_body::<Control>(body);
        let _ = wire::decode_envelope(body);
    }

    // The one-shot decoder agrees: the same bodies, then the same end.
    let mut whole = FrameDecoder::new(max);
    whole.push(stream);
    let mut expected = Vec::new();
    let end = loop {
        match whole.next_frame() {
            Ok(Some(body)) => expected.push(body),
            Ok(None) => break whole.finish(),
            Err(e) => break Err(e),
        }
    };
    assert_eq!(bodies, expected, "chunked and one-shot decoding differ");
    let chunked_end = refused.map_or_else(|| decoder.finish(), Err);
    assert_eq!(
        chunked_end, end,
        "chunked and one-shot decoding end differently"
    );
    // decode_stream stops at the same point.
    if let Ok(frames) = wire::decode_stream::<Control>(stream, max) {
        assert!(end.is_ok() && frames.len() == expected.len());
    }
});
