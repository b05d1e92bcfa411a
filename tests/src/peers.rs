//! What a two-process suite and its peer binary share: the messages they
//! exchange and the data patterns they check, defined once.

use regent_net::{Message, PortId, ProcId};
use serde::{Deserialize, Serialize};

/// Logs of a peer binary go to stderr, `warn` and up unless `RUST_LOG` says
/// otherwise (stdout carries the protocol with the suite).
pub fn init_peer_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The control-plane suite (`tests/net.rs` and `net_peer`).
pub mod net {
    use super::*;

    /// The message of the suite: a numbered probe on a stream, answered
    /// at `reply_to` when set, padded to size.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Probe {
        /// Which of the sender's streams (actor pairs) it rides.
        pub stream: u32,
        /// Its number on that stream.
        pub n: u64,
        /// Where to answer, if anywhere.
        pub reply_to: Option<PortId>,
        /// Padding to size.
        pub pad: Vec<u8>,
    }

    impl Message for Probe {
        const TYPE_NAME: &'static str = "regent-tests/net/Probe";
    }
}

/// The allocator suite (`tests/alloc.rs` and `alloc_proc`).
pub mod alloc {
    use super::*;

    /// Asks for a [`Pong`] at `reply_to`.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Ping {
        /// Echoed in the [`Pong`].
        pub n: u64,
        /// Where to answer.
        pub reply_to: PortId,
    }

    impl Message for Ping {
        const TYPE_NAME: &'static str = "regent-tests/alloc/Ping";
    }

    /// The answer to a [`Ping`]: which proc and process answered.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Pong {
        /// The [`Ping`]'s number.
        pub n: u64,
        /// The proc that answered.
        pub proc: ProcId,
        /// Its process id.
        pub pid: u32,
    }

    impl Message for Pong {
        const TYPE_NAME: &'static str = "regent-tests/alloc/Pong";
    }

    /// Print `lines` lines `LABEL I` to stdout (at once, as fast as the
    /// proc can).
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Burst {
        /// How many.
        pub lines: u32,
        /// Each line's first word.
        pub label: String,
    }

    impl Message for Burst {
        const TYPE_NAME: &'static str = "regent-tests/alloc/Burst";
    }

    /// Exit with this code.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Exit {
        /// The exit code.
        pub code: i32,
    }

    impl Message for Exit {
        const TYPE_NAME: &'static str = "regent-tests/alloc/Exit";
    }

    /// Panic.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Panic;

    impl Message for Panic {
        const TYPE_NAME: &'static str = "regent-tests/alloc/Panic";
    }
}

/// The payload-plane suite (`tests/rdma.rs` and `rdma_peer`).
pub mod rdma {
    /// Bytes of the repeated base block of a pattern.
    pub const BLOCK_BYTES: usize = 64 << 10;

    /// Fills `buf` with the pattern of `seed`: a 64 KiB block of
    /// pseudo-random bytes repeated, each block starting with its own index,
    /// so that a chunk landing at the wrong offset is seen. Cheap even in
    /// debug builds (block copies).
    pub fn fill(buf: &mut [u8], seed: u64) {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let head = buf.len().min(BLOCK_BYTES);
        for b in &mut buf[..head] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let mut done = head;
        while done < buf.len() {
            let n = done.min(buf.len() - done);
            buf.copy_within(..n, done);
            done += n;
        }
        for (k, block) in buf.chunks_mut(BLOCK_BYTES).enumerate() {
            let tag = (k as u64 ^ seed).to_le_bytes();
            let n = block.len().min(8);
            block[..n].copy_from_slice(&tag[..n]);
        }
    }

    /// `bytes` as lowercase hex (handles travel as hex on the peer's lines).
    pub fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The bytes of [`hex`]'s output.
    ///
    /// # Panics
    /// On anything else (the suite's own peer wrote it).
    pub fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
            .collect()
    }
}
