//! The tcp backend's record layer after the handshake: TLS 1.3's traffic
//! keys (taken from rustls once the handshake, hello and welcome are done)
//! sealing frames of up to [`MAX_FRAME_BYTES`] instead of TLS's 16 KiB
//! records.
//!
//! ```text
//! frame  len u32 (little-endian, 1..=MAX_FRAME_BYTES) | ciphertext (len) | tag [16]
//! ```
//!
//! Each direction keeps its TLS key, IV and record sequence number: the
//! nonce of a frame is the IV xor the sequence number (RFC 8446 §5.3), the
//! length is the additional data, so a frame that is altered, replayed,
//! reordered or cut is refused. Same encryption and authentication as the
//! TLS records before; what changes is that a frame is as large as a read
//! or write piece, so the reader decrypts in place in its destination (the
//! socket's bytes land there directly) and the sender seals its piece from
//! where it lies straight into the frame it writes ([`Keys::seal_into`]),
//! with no copy through rustls's buffers and a tag per 256 KiB instead of
//! per 16 KiB.
//!
//! The AEAD is aws-lc's (`aws-lc-rs`), not ring's that rustls uses for the
//! handshake: it seals out of place, so a sender's bytes are read once, and
//! its AES-GCM runs 1.3-1.5x ring's on the reference machines' AVX-512
//! cores (256 KiB pieces: copy and seal 118 against 178-195 ms/GB, open 80
//! against 99-116). The frames are the same bytes either way (a test seals
//! with one and opens with the other).
//!
//! A key seals at most [`KEY_LIMIT_BYTES`] (RFC 8446 §5.5 allows AES-GCM
//! about 2^24.5 full records, 2^38.5 bytes); then the connection refuses to
//! send and clients retire their pooled connections at half of it.

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Bytes of a frame's length.
pub(crate) const HEAD_BYTES: usize = 4;
/// Bytes of a frame's tag.
pub(crate) const TAG_BYTES: usize = 16;
/// The largest frame payload either side accepts.
pub(crate) const MAX_FRAME_BYTES: usize = 1 << 20;
/// The bytes one key seals at most.
pub(crate) const KEY_LIMIT_BYTES: u64 = 1 << 37;
/// Socket reads of headers and tags go through a buffer this large; a
/// payload read at least this large bypasses it (straight into its
/// destination).
const READ_BUFFER_BYTES: usize = 16 << 10;
/// The largest control message (request header, response header, verbs
/// endpoint).
const MAX_MSG_BYTES: usize = 64;

fn bad(reason: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, reason.into())
}

/// Decodes a frame's length: 1..=`max` bytes, else refused.
pub(crate) fn frame_len(head: [u8; HEAD_BYTES], max: usize) -> Result<usize, String> {
    let len = u32::from_le_bytes(head) as usize;
    if len == 0 || len > max.min(MAX_FRAME_BYTES) {
        return Err(format!(
            "frame of {len} bytes (expected 1..={})",
            max.min(MAX_FRAME_BYTES)
        ));
    }
    Ok(len)
}

/// The page size that copies are placed against (see [`Room`]).
const PAGE_BYTES: usize = 4096;

/// Whether two addresses have the same offset in their pages (see
/// [`Room`]).
pub(crate) fn same_page_offset(a: *const u8, b: *const u8) -> bool {
    (a as usize ^ b as usize).is_multiple_of(PAGE_BYTES)
}

/// Room for one frame at a time, whose payload is placed at the page
/// offset of the memory it is copied from or into.
///
/// On this project's reference machines (AMD Zen), glibc's `memcpy` copies
/// these sizes with `rep movsb`, which runs 7-8x slower when the
/// destination lies 1 to 31 bytes past the source modulo 4 KiB (the loads
/// wait on stores they only alias): 2.6 against 21 GB/s for 256 KiB pieces,
/// measured. A frame's payload right after its 4-byte length, copied from a
/// page-aligned buffer, is that case. Placed at the source's page offset,
/// the copy runs at full speed wherever the caller's bytes lie.
pub(crate) struct Room {
    buf: Vec<u8>,
}

impl Room {
    /// Room for frames of up to `max_payload` bytes.
    pub(crate) fn new(max_payload: usize) -> Self {
        Self {
            buf: vec![0u8; HEAD_BYTES + PAGE_BYTES + max_payload + TAG_BYTES],
        }
    }

    /// Where a payload placed like `like` starts in `buf`.
    fn payload_at(&self, like: *const u8) -> usize {
        let first = self.buf.as_ptr() as usize + HEAD_BYTES;
        HEAD_BYTES + ((like as usize).wrapping_sub(first) & (PAGE_BYTES - 1))
    }

    /// A frame of `len` payload bytes (length, payload, tag: what
    /// [`Keys::seal`] and [`Sealed::send`] take) whose payload has the page
    /// offset of `like`.
    pub(crate) fn frame(&mut self, len: usize, like: *const u8) -> &mut [u8] {
        let at = self.payload_at(like);
        &mut self.buf[at - HEAD_BYTES..at + len + TAG_BYTES]
    }

    /// `len` bytes at the page offset of `like`, for a payload alone.
    pub(crate) fn payload(&mut self, len: usize, like: *const u8) -> &mut [u8] {
        let at = self.payload_at(like);
        &mut self.buf[at..at + len]
    }
}

/// One direction's key, IV and sequence number.
pub(crate) struct Keys {
    key: LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
    /// Bytes sealed (or, receiving, opened) with this key.
    sealed: u64,
}

impl Keys {
    /// The key of one direction, as rustls hands it over.
    pub(crate) fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> Result<Self, String> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => return Err("a cipher suite the sealed frames do not support".into()),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| "bad traffic key".to_string())?;
        let iv: [u8; aead::NONCE_LEN] = iv
            .as_ref()
            .try_into()
            .map_err(|_| "bad traffic IV".to_string())?;
        Ok(Self {
            key: LessSafeKey::new(key),
            iv,
            seq,
            sealed: 0,
        })
    }

    fn nonce(&mut self) -> Result<Nonce, std::io::Error> {
        let seq = self.seq;
        self.seq = seq
            .checked_add(1)
            .ok_or_else(|| bad("frame sequence numbers used up"))?;
        let mut n = self.iv;
        for (b, s) in n[aead::NONCE_LEN - 8..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Seals `payload` into `frame`, which must be [`HEAD_BYTES`] +
    /// `payload.len()` + [`TAG_BYTES`] long: the length, the ciphertext and
    /// the tag. `payload` is read once and left as it is; a refused frame
    /// (the key's limit reached) leaves `frame` untouched.
    pub(crate) fn seal_into(&mut self, payload: &[u8], frame: &mut [u8]) -> std::io::Result<()> {
        let len = payload.len();
        assert!((1..=MAX_FRAME_BYTES).contains(&len), "frame of {len} bytes");
        assert_eq!(
            frame.len(),
            HEAD_BYTES + len + TAG_BYTES,
            "a frame's room is its length, payload and tag"
        );
        if self.sealed + len as u64 > KEY_LIMIT_BYTES {
            return Err(bad("the connection's key sealed as much as it may"));
        }
        let head = (len as u32).to_le_bytes();
        let nonce = self.nonce()?;
        self.sealed += len as u64;
        let (h, out) = frame.split_at_mut(HEAD_BYTES);
        h.copy_from_slice(&head);
        // Out of place: nothing sealed in place, the whole payload as the
        // "extra" input, its ciphertext and the tag into `out`.
        self.key
            .seal_in_place_scatter(nonce, Aad::from(head), &mut [], payload, out)
            .map_err(|_| bad("seal failed"))
    }

    /// Opens a frame's payload in place.
    pub(crate) fn open(
        &mut self,
        head: [u8; HEAD_BYTES],
        payload: &mut [u8],
        tag: [u8; TAG_BYTES],
    ) -> std::io::Result<()> {
        let nonce = self.nonce()?;
        self.sealed += payload.len() as u64;
        self.key
            .open_in_place_separate_tag(nonce, Aad::from(head), &tag, payload)
            .map_err(|_| bad("an rdma tcp frame failed authentication"))?;
        Ok(())
    }
}

/// An authenticated connection after its handshake: frames sealed with
/// the TLS traffic keys.
pub(crate) struct Sealed {
    io: BufReader<TcpStream>,
    tx: Keys,
    rx: Keys,
    /// Sealed control messages not written yet.
    out: Vec<u8>,
}

impl Sealed {
    /// Takes over a connection whose TLS handshake (and hello/welcome) is
    /// done: `io` must hold no unread bytes.
    pub(crate) fn new(
        io: tokio::io::BufReader<TcpStream>,
        secrets: rustls::ExtractedSecrets,
    ) -> Result<Self, String> {
        if !io.buffer().is_empty() {
            return Err("bytes after the welcome, before the first frame".into());
        }
        Ok(Self::with_keys(
            io.into_inner(),
            Keys::new(secrets.tx)?,
            Keys::new(secrets.rx)?,
        ))
    }

    fn with_keys(tcp: TcpStream, tx: Keys, rx: Keys) -> Self {
        Self {
            io: BufReader::with_capacity(READ_BUFFER_BYTES, tcp),
            tx,
            rx,
            out: Vec::new(),
        }
    }

    /// The socket (tests read what is left on it).
    #[cfg(test)]
    pub(crate) fn into_inner(self) -> BufReader<TcpStream> {
        self.io
    }

    /// Bytes the busier direction's key has sealed.
    pub(crate) fn used(&self) -> u64 {
        self.tx.sealed.max(self.rx.sealed)
    }

    /// Seals a control message and queues it (written by the next
    /// [`Self::flush`] or [`Self::send`]).
    pub(crate) fn queue(&mut self, msg: &[u8]) -> std::io::Result<()> {
        let at = self.out.len();
        self.out.resize(at + HEAD_BYTES + msg.len() + TAG_BYTES, 0);
        let sealed = self.tx.seal_into(msg, &mut self.out[at..]);
        if sealed.is_err() {
            self.out.truncate(at);
        }
        sealed
    }

    /// Writes the queued messages.
    pub(crate) async fn flush(&mut self) -> std::io::Result<()> {
        if !self.out.is_empty() {
            self.io.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }

    /// Seals `payload` into `frame` (see [`Keys::seal_into`]), to be written
    /// by [`Self::write_frame`] before anything else is queued or sealed
    /// (a frame's sequence number is its place in the stream).
    pub(crate) fn seal_into(&mut self, payload: &[u8], frame: &mut [u8]) -> std::io::Result<()> {
        self.tx.seal_into(payload, frame)
    }

    /// Writes the queued messages, then `frame`, sealed last by
    /// [`Self::seal_into`].
    pub(crate) async fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<()> {
        if self.out.is_empty() {
            return self.io.write_all(frame).await;
        }
        // One system call for both where the kernel takes them.
        let mut bufs = [
            std::io::IoSlice::new(&self.out),
            std::io::IoSlice::new(frame),
        ];
        let mut slices: &mut [std::io::IoSlice<'_>] = &mut bufs;
        while !slices.is_empty() {
            let n = self.io.write_vectored(slices).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            std::io::IoSlice::advance_slices(&mut slices, n);
        }
        self.out.clear();
        Ok(())
    }

    /// Whether the peer closed the connection before a frame's first byte.
    pub(crate) async fn at_eof(&mut self) -> std::io::Result<bool> {
        Ok(self.io.fill_buf().await?.is_empty())
    }

    async fn head(&mut self, max: usize) -> std::io::Result<([u8; HEAD_BYTES], usize)> {
        let mut head = [0u8; HEAD_BYTES];
        self.io.read_exact(&mut head).await?;
        let len = frame_len(head, max).map_err(bad)?;
        Ok((head, len))
    }

    /// Receives a control message of exactly `N` bytes.
    pub(crate) async fn recv_msg<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        const { assert!(N <= MAX_MSG_BYTES) };
        let (head, len) = self.head(N).await?;
        if len != N {
            return Err(bad(format!("message of {len} bytes, expected {N}")));
        }
        let mut buf = [0u8; MAX_MSG_BYTES];
        self.io.read_exact(&mut buf[..N + TAG_BYTES]).await?;
        let (msg, t) = buf.split_at_mut(N);
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&t[..TAG_BYTES]);
        self.rx.open(head, msg, tag)?;
        let mut out = [0u8; N];
        out.copy_from_slice(msg);
        Ok(out)
    }

    /// Receives one frame of at most `dst.len()` bytes into the front of
    /// `dst` (the socket's bytes land there, then are opened in place);
    /// returns its length. After a failure `dst` holds unspecified bytes.
    pub(crate) async fn recv_into(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        let (head, len) = self.head(dst.len()).await?;
        let payload = &mut dst[..len];
        self.io.read_exact(payload).await?;
        let mut tag = [0u8; TAG_BYTES];
        self.io.read_exact(&mut tag).await?;
        self.rx.open(head, payload, tag)?;
        Ok(len)
    }
}

/// The key of the fuzzing entry points: the fuzzer cannot forge frames of
/// a connection's real key, so these check that the decoder and the opening
/// never panic and that a sealed frame round-trips.
fn fuzz_keys() -> Keys {
    Keys::new((
        0,
        ConnectionTrafficSecrets::Aes256Gcm {
            key: rustls::crypto::cipher::AeadKey::from([0x42; 32]),
            iv: rustls::crypto::cipher::Iv::from([0x24; aead::NONCE_LEN]),
        },
    ))
    .expect("a valid key")
}

/// Seals `payload` as the first frame of the fuzzing key; `None` for a
/// payload no frame carries (empty, or over [`MAX_FRAME_BYTES`]). Not API
/// (`fuzz/fuzz_targets/rdma_tcp_frames.rs`, through the crate root).
#[doc(hidden)]
pub fn fuzz_seal(payload: &[u8]) -> Option<Vec<u8>> {
    if !(1..=MAX_FRAME_BYTES).contains(&payload.len()) {
        return None;
    }
    let mut f = vec![0u8; HEAD_BYTES + payload.len() + TAG_BYTES];
    fuzz_keys().seal_into(payload, &mut f).ok()?;
    Some(f)
}

/// Decodes and opens the frame at the front of `wire` as a receiver does
/// (the first frame of the fuzzing key): its payload, or `None` where it
/// refuses the bytes.
#[doc(hidden)]
pub fn fuzz_open(wire: &[u8]) -> Option<Vec<u8>> {
    let head: [u8; HEAD_BYTES] = *wire.first_chunk()?;
    let len = frame_len(head, MAX_FRAME_BYTES).ok()?;
    let body = wire.get(HEAD_BYTES..HEAD_BYTES + len + TAG_BYTES)?;
    let mut payload = body[..len].to_vec();
    let tag: [u8; TAG_BYTES] = body[len..].try_into().ok()?;
    fuzz_keys().open(head, &mut payload, tag).ok()?;
    Some(payload)
}

/// Seals `bytes`, `piece` bytes a frame, and opens each frame, as a
/// transfer's two ends do with each of its bytes (the sender seals from its
/// bytes into a frame, the reader opens the frame in place) with
/// AES-128-GCM, the suite procs negotiate (`regent_net::tls::crypto_provider`).
/// The AEAD's share of the backend's CPU, for `regent bench rdma`'s floor.
pub(crate) fn seal_and_open(bytes: &[u8], piece: usize) -> std::io::Result<()> {
    seal_and_open_each(bytes, piece, |_, _, _| {})
}

/// [`seal_and_open`], showing `each` every piece with its frame's payload
/// after sealing (`false`) and after opening (`true`).
fn seal_and_open_each(
    bytes: &[u8],
    piece: usize,
    mut each: impl FnMut(&[u8], &[u8], bool),
) -> std::io::Result<()> {
    let keys = || {
        UnboundKey::new(&aead::AES_128_GCM, &[0x42; 16]).map(|key| Keys {
            key: LessSafeKey::new(key),
            iv: [0x24; aead::NONCE_LEN],
            seq: 0,
            sealed: 0,
        })
    };
    let (mut tx, mut rx) = (
        keys().map_err(|_| bad("bad key"))?,
        keys().map_err(|_| bad("bad key"))?,
    );
    let piece = piece.clamp(1, MAX_FRAME_BYTES);
    let mut frame = vec![0u8; HEAD_BYTES + piece + TAG_BYTES];
    for payload in bytes.chunks(piece) {
        let f = &mut frame[..HEAD_BYTES + payload.len() + TAG_BYTES];
        tx.seal_into(payload, f)?;
        let (head, rest) = f.split_at_mut(HEAD_BYTES);
        let (sealed, tag) = rest.split_at_mut(payload.len());
        each(payload, sealed, false);
        let head: [u8; HEAD_BYTES] = (*head).try_into().map_err(|_| bad("head length"))?;
        let tag: [u8; TAG_BYTES] = (*tag).try_into().map_err(|_| bad("tag length"))?;
        rx.open(head, sealed, tag)?;
        each(payload, sealed, true);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    /// The bench's AEAD floor does the work it names: every piece sealed
    /// (changed) and opened (authenticated) back to the bytes it started
    /// from, the last piece short.
    #[test]
    fn seal_and_open_round_trips_every_piece() {
        let start: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let (mut sealed, mut opened) = (0, 0);
        seal_and_open_each(&start, 64 << 10, |plain, payload, open| {
            assert_eq!(plain.len(), payload.len());
            if open {
                assert_eq!(plain, payload, "a piece opened to other bytes");
                opened += plain.len();
            } else {
                assert_ne!(plain, payload, "a piece sealed unchanged");
                sealed += plain.len();
            }
        })
        .unwrap();
        assert_eq!((sealed, opened), (start.len(), start.len()));
        seal_and_open(&start, 64 << 10).unwrap();
    }

    /// The frames are what ring's AES-GCM (the AEAD before, and rustls's)
    /// makes of the same key, nonce (IV xor sequence number) and length as
    /// additional data, byte for byte, so either end may use either; and
    /// ring opens them.
    #[test]
    fn frames_are_the_same_bytes_as_rings() {
        use ring::aead as r;
        let suites = [
            (&r::AES_128_GCM, &aead::AES_128_GCM, 16),
            (&r::AES_256_GCM, &aead::AES_256_GCM, 32),
        ];
        for (suite, ours_alg, key_len) in suites {
            let key = vec![0x17u8; key_len];
            let iv = [0x5au8; aead::NONCE_LEN];
            let mut ours = Keys {
                key: LessSafeKey::new(UnboundKey::new(ours_alg, &key).unwrap()),
                iv,
                seq: 41,
                sealed: 0,
            };
            let theirs = r::LessSafeKey::new(r::UnboundKey::new(suite, &key).unwrap());
            for (seq, len) in [(41u64, 1usize), (42, 4096), (43, 300_001)] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
                let mut frame = vec![0u8; HEAD_BYTES + len + TAG_BYTES];
                ours.seal_into(&payload, &mut frame).unwrap();
                let head = (len as u32).to_le_bytes();
                let mut nonce = iv;
                for (b, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
                    *b ^= s;
                }
                let mut expect = payload.clone();
                let tag = theirs
                    .seal_in_place_separate_tag(
                        r::Nonce::assume_unique_for_key(nonce),
                        r::Aad::from(head),
                        &mut expect,
                    )
                    .unwrap();
                expect.extend_from_slice(tag.as_ref());
                assert_eq!(&frame[..HEAD_BYTES], &head);
                assert!(
                    frame[HEAD_BYTES..] == expect[..],
                    "frame {seq} differs from ring's"
                );
                let mut body = frame[HEAD_BYTES..].to_vec();
                let opened = theirs
                    .open_in_place(
                        r::Nonce::assume_unique_for_key(nonce),
                        r::Aad::from(head),
                        &mut body,
                    )
                    .unwrap();
                assert_eq!(opened, &payload[..]);
            }
        }
    }

    fn keys(seed: u8, seq: u64) -> Keys {
        Keys::new((
            seq,
            ConnectionTrafficSecrets::Aes256Gcm {
                key: AeadKey::from([seed; 32]),
                iv: Iv::from([seed ^ 0x5a; aead::NONCE_LEN]),
            },
        ))
        .unwrap()
    }

    /// Two ends of a loopback connection on the same keys, as a client and
    /// a server after their handshake.
    async fn ends() -> (Sealed, Sealed) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let (a, (b, _)) = (a.unwrap(), b.unwrap());
        (
            Sealed::with_keys(a, keys(1, 7), keys(2, 9)),
            Sealed::with_keys(b, keys(2, 9), keys(1, 7)),
        )
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A sealed frame of `payload`, as bytes on the wire.
    fn frame_of(k: &mut Keys, payload: &[u8]) -> Vec<u8> {
        let mut f = frame_of_room(payload.len());
        k.seal_into(payload, &mut f).unwrap();
        f
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Frames of any size, between control messages, land whole at
        /// any place of the destination, in order.
        #[test]
        fn frames_round_trip(
            sizes in proptest::collection::vec(1usize..=(300 << 10), 1..6),
            slack in 0usize..4096,
            seed in any::<u8>(),
        ) {
            rt().block_on(async {
                let (mut a, mut b) = ends().await;
                let total: usize = sizes.iter().sum();
                let src: Vec<u8> = (0..total).map(|i| (i as u8).wrapping_mul(seed | 1)).collect();
                let send = async {
                    let mut at = 0;
                    for &n in &sizes {
                        a.queue(&(n as u32).to_le_bytes()).unwrap();
                        let mut f = frame_of_room(n);
                        a.seal_into(&src[at..at + n], &mut f).unwrap();
                        a.write_frame(&f).await.unwrap();
                        at += n;
                    }
                    a.queue(b"end").unwrap();
                    a.flush().await.unwrap();
                };
                let recv = async {
                    let mut dst = vec![0u8; total + slack];
                    let mut at = 0;
                    for &n in &sizes {
                        let len = b.recv_msg::<4>().await.unwrap();
                        assert_eq!(u32::from_le_bytes(len) as usize, n);
                        // Room for more than the frame: it takes its length.
                        let got = b.recv_into(&mut dst[at..]).await.unwrap();
                        assert_eq!(got, n);
                        at += n;
                    }
                    assert_eq!(&b.recv_msg::<3>().await.unwrap(), b"end");
                    dst.truncate(total);
                    dst
                };
                let ((), dst) = tokio::join!(send, recv);
                assert!(dst == src, "the frames did not reassemble");
            });
        }

        /// Any byte changed on the wire, the frame is refused (never
        /// opened): changed length, ciphertext or tag.
        #[test]
        fn a_changed_byte_is_refused(
            payload in proptest::collection::vec(any::<u8>(), 1..2048),
            at in any::<prop::sample::Index>(),
            flip in 1u8..,
        ) {
            rt().block_on(async {
                let (a, mut b) = ends().await;
                let mut tx = keys(1, 7);
                let mut wire = frame_of(&mut tx, &payload);
                let i = at.index(wire.len());
                wire[i] ^= flip;
                let mut tcp = a.io.into_inner();
                tcp.write_all(&wire).await.unwrap();
                drop(tcp);
                let mut dst = vec![0u8; 4096];
                let r = b.recv_into(&mut dst).await;
                assert!(r.is_err(), "a changed frame was opened: {r:?}");
            });
        }

        /// Bytes from the network that are no frame of this key are refused
        /// with a clear error, never a panic.
        #[test]
        fn garbage_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            rt().block_on(async {
                let (a, mut b) = ends().await;
                let mut tcp = a.io.into_inner();
                tcp.write_all(&bytes).await.unwrap();
                drop(tcp);
                let mut dst = vec![0u8; 1 << 12];
                assert!(b.recv_into(&mut dst).await.is_err());
                let (a, mut b) = ends().await;
                let mut tcp = a.io.into_inner();
                tcp.write_all(&bytes).await.unwrap();
                drop(tcp);
                assert!(b.recv_msg::<44>().await.is_err());
            });
        }

        /// The fuzzing entry points: what is sealed opens to itself, and
        /// a changed byte is refused.
        #[test]
        fn fuzz_entry_points_round_trip(
            payload in proptest::collection::vec(any::<u8>(), 1..512),
            at in any::<prop::sample::Index>(),
        ) {
            let wire = fuzz_seal(&payload).unwrap();
            prop_assert_eq!(fuzz_open(&wire), Some(payload));
            let mut bad = wire.clone();
            let i = at.index(bad.len());
            bad[i] ^= 0x80;
            prop_assert_eq!(fuzz_open(&bad), None);
        }

        #[test]
        fn frame_lengths_are_bounded(head in any::<[u8; 4]>(), max in 0usize..(2 << 20)) {
            let len = u32::from_le_bytes(head) as usize;
            match frame_len(head, max) {
                Ok(n) => prop_assert!(n == len && n >= 1 && n <= max && n <= MAX_FRAME_BYTES),
                Err(_) => prop_assert!(len == 0 || len > max || len > MAX_FRAME_BYTES),
            }
        }
    }

    fn frame_of_room(len: usize) -> Vec<u8> {
        vec![0u8; HEAD_BYTES + len + TAG_BYTES]
    }

    proptest! {
        /// A frame's payload lies at the page offset of the bytes it is
        /// placed like, wherever those lie and whatever its length: the
        /// frame is its length, payload and tag, inside the room.
        #[test]
        fn a_placed_payload_has_the_page_offset_of_its_source(
            like in any::<usize>(),
            len in 1usize..=(64 << 10),
            max in 0usize..(16 << 10),
        ) {
            let max = len + max;
            let mut room = Room::new(max);
            let base = room.buf.as_ptr() as usize;
            let room_len = room.buf.len();
            let like = like as *const u8;
            let f = room.frame(len, like);
            prop_assert_eq!(f.len(), HEAD_BYTES + len + TAG_BYTES);
            let at = f.as_ptr() as usize + HEAD_BYTES;
            prop_assert!(same_page_offset(at as *const u8, like));
            prop_assert_eq!(at % PAGE_BYTES, like as usize % PAGE_BYTES);
            prop_assert!(at - HEAD_BYTES >= base && at + len + TAG_BYTES <= base + room_len);
            let p = room.payload(max, like);
            prop_assert_eq!(p.len(), max);
            prop_assert_eq!(p.as_ptr() as usize, at);
        }
    }

    /// A frame replayed, or two swapped, fail: the sequence number is in
    /// the nonce.
    #[test]
    fn replayed_and_reordered_frames_are_refused() {
        rt().block_on(async {
            for order in [[0usize, 0], [1, 0]] {
                let (a, mut b) = ends().await;
                let mut tx = keys(1, 7);
                let frames = [frame_of(&mut tx, b"first"), frame_of(&mut tx, b"second")];
                let mut tcp = a.io.into_inner();
                for i in order {
                    tcp.write_all(&frames[i]).await.unwrap();
                }
                drop(tcp);
                let mut dst = [0u8; 16];
                let first = b.recv_into(&mut dst).await;
                let second = b.recv_into(&mut dst).await;
                assert!(
                    first.is_err() || second.is_err(),
                    "frames {order:?} were all opened"
                );
            }
            // In order they open.
            let (mut a, mut b) = ends().await;
            a.queue(b"first").unwrap();
            a.queue(b"second").unwrap();
            a.flush().await.unwrap();
            assert_eq!(&b.recv_msg::<5>().await.unwrap(), b"first");
            assert_eq!(&b.recv_msg::<6>().await.unwrap(), b"second");
        });
    }

    /// A key refuses to seal past its limit, and the frame is not sent.
    #[test]
    fn a_key_stops_at_its_limit() {
        let mut k = keys(3, 0);
        k.sealed = KEY_LIMIT_BYTES - 10;
        let mut ok = frame_of_room(10);
        k.seal_into(&[0u8; 10], &mut ok).unwrap();
        let seq = k.seq;
        let mut over = frame_of_room(1);
        let e = k.seal_into(&[0u8; 1], &mut over).unwrap_err();
        assert!(e.to_string().contains("sealed as much as it may"), "{e}");
        assert_eq!(over, frame_of_room(1), "a refused frame was sealed");
        assert_eq!(k.seq, seq, "a refused frame used a sequence number");
    }
}
