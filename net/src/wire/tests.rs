use proptest::prelude::*;

use super::*;
use crate::id::ProcId;

fn actor(proc: &str, name: &str, index: u32) -> ActorId {
    ProcId::new(proc).unwrap().actor(name, index).unwrap()
}

fn envelope(payload: Vec<u8>, seq: u64) -> Envelope {
    Envelope {
        sender: actor("a", "x", 1),
        receiver: actor("b", "y", 2).port(3),
        seq: Seq(seq),
        generation: Generation(7),
        type_tag: TypeTag::from_name("t"),
        payload: Bytes::from(payload),
    }
}

#[test]
fn oversized_frames_are_refused_at_the_prefix() {
    let big = envelope(vec![0; 2048], 1);
    assert!(matches!(
        encode_frame(&big, 1024),
        Err(WireError::FrameTooLarge { max: 1024, .. })
    ));
    let frame = encode_frame(&big, 1 << 20).unwrap();
    let mut decoder = FrameDecoder::new(1024);
    // Only the prefix is needed to refuse it.
    decoder.push(&frame[..LENGTH_PREFIX_BYTES]);
    let err = decoder.next_frame().unwrap_err();
    assert!(matches!(err, WireError::FrameTooLarge { max: 1024, len } if len > 2048));
    assert!(err.to_string().contains("exceeds max_frame_bytes = 1024"));
}

#[test]
fn truncated_streams_and_trailing_bytes_are_errors() {
    let frame = encode_frame(&envelope(vec![1, 2, 3], 1), 1024).unwrap();
    let cut = &frame[..frame.len() - 1];
    assert!(matches!(
        decode_stream::<Envelope>(cut, 1024),
        Err(WireError::Truncated { .. })
    ));
    let mut body = frame[LENGTH_PREFIX_BYTES..].to_vec();
    body.push(0);
    assert_eq!(decode_envelope(&body), Err(WireError::TrailingBytes(1)));
}

#[test]
fn message_frames_encode_like_the_owned_enum() {
    let env = envelope(vec![9; 10], 42);
    assert_eq!(
        encode_message_frame(&env, 1024).unwrap(),
        encode_frame(&ToReceiver::Message(env), 1024).unwrap()
    );
}

fn arb_envelope() -> impl Strategy<Value = Envelope> {
    (
        "[a-z0-9]{1,12}",
        "[A-Za-z0-9_-]{1,20}",
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(p, n, i, port, seq, g, tag, payload)| Envelope {
            sender: actor(&p, &n, i),
            receiver: actor("r", &n, i).port(port),
            seq: Seq(seq),
            generation: Generation(g),
            type_tag: TypeTag(tag),
            payload: Bytes::from(payload),
        })
}

proptest! {
    /// The encoders write exactly postcard's own bytes (their output
    /// flavor is ours, the format is postcard's): a message frame is the
    /// length prefix and `to_allocvec` of the frame, a payload is
    /// `to_allocvec` of the value, whatever the names and payload sizes
    /// (below and past the room the encoders start with).
    #[test]
    fn encoders_write_postcards_bytes(env in arb_envelope(), big in 0usize..2_000) {
        let mut env = env;
        if big > 1_000 {
            env.payload = Bytes::from(vec![5u8; big]);
        }
        let frame = encode_message_frame(&env, 1 << 16).unwrap();
        let body = postcard::to_allocvec(&ToReceiver::Message(env.clone())).unwrap();
        prop_assert_eq!(&frame[..LENGTH_PREFIX_BYTES], &(body.len() as u32).to_le_bytes()[..]);
        prop_assert_eq!(&frame[LENGTH_PREFIX_BYTES..], &body[..]);
        prop_assert_eq!(&encode_payload(&env).unwrap()[..], &postcard::to_allocvec(&env).unwrap()[..]);
    }

    #[test]
    fn envelopes_round_trip_through_frames(
        envs in proptest::collection::vec(arb_envelope(), 0..8),
        split in any::<prop::sample::Index>(),
    ) {
        let mut stream = Vec::new();
        for e in &envs {
            stream.extend_from_slice(&encode_message_frame(e, 1 << 16).unwrap());
        }
        // Whole stream.
        let back: Vec<ToReceiver> = decode_stream(&stream, 1 << 16).unwrap();
        let back: Vec<Envelope> = back.into_iter().map(|f| match f {
            ToReceiver::Message(e) => e,
            other => panic!("unexpected {other:?}"),
        }).collect();
        prop_assert_eq!(&back, &envs);
        // Split in two pushes at any point.
        let at = if stream.is_empty() { 0 } else { split.index(stream.len()) };
        let mut decoder = FrameDecoder::new(1 << 16);
        decoder.push(&stream[..at]);
        let mut n = 0;
        while let Some(body) = decoder.next_frame().unwrap() {
            prop_assert!(decode_body::<ToReceiver>(&body).is_ok());
            n += 1;
        }
        decoder.push(&stream[at..]);
        while let Some(body) = decoder.next_frame().unwrap() {
            prop_assert!(decode_body::<ToReceiver>(&body).is_ok());
            n += 1;
        }
        prop_assert_eq!(n, envs.len());
        prop_assert!(decoder.finish().is_ok());
    }

    #[test]
    fn random_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_envelope(&bytes);
        let _ = decode_body::<Control>(&bytes);
        let _ = decode_body::<ToReceiver>(&bytes);
        let _ = decode_body::<ToSender>(&bytes);
        let _ = decode_stream::<ToReceiver>(&bytes, 256);
        let _ = decode_stream::<Control>(&bytes, 1 << 20);
    }

    #[test]
    fn mutated_frames_decode_or_fail_cleanly(
        env in arb_envelope(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut frame = encode_message_frame(&env, 1 << 16).unwrap().to_vec();
        for (at, byte) in flips {
            let i = at.index(frame.len());
            frame[i] ^= byte;
        }
        let _ = decode_stream::<ToReceiver>(&frame, 1 << 16);
    }
}
