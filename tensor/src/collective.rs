//! Collectives over a [`Transport`]: barrier, broadcast, all-reduce,
//! all-gather, reduce-scatter and point-to-point send/receive of tensors,
//! with deterministic results and failures that name a rank.
//!
//! # Algorithms
//!
//! - [`Algorithm::Inline`]: the data rides in control messages (small
//!   tensors; one message round). Reductions fold in rank order.
//! - [`Algorithm::Direct`]: one-sided reads of peers' registered memory.
//!   All-reduce is a reduce-scatter where the owner of each chunk reads
//!   every member's chunk in rank order and folds it, then an all-gather:
//!   each member moves `2 (P-1)/P` of the tensor, as a ring does, and the
//!   result equals the serial left fold in rank order.
//! - [`Algorithm::Ring`]: the bandwidth-optimal ring (all-gather,
//!   reduce-scatter, all-reduce) or chain (broadcast), chunked and
//!   pipelined, talking to neighbours only. Deterministic, but chunk `c` is
//!   folded starting at rank `c + 1` (see [`ring_fold_order`]), not in rank
//!   order.
//! - [`Algorithm::Auto`] picks inline up to `inline_max_bytes`, else direct
//!   (exact mode, or all members on one host), else ring.
//!
//! # Completion
//!
//! A member returns `Ok` only when its result is complete and every member
//! it read from confirmed that it still held its memory when the read
//! ended (the `Done`/`Ack` exchange), and returns only when nobody reads
//! its memory any more. Any error breaks the communicator: the group is in
//! an unknown state, and a new communicator (the next generation) is
//! needed. See `docs/semantics.md` §8.

use std::future::Future;
use std::marker::PhantomData;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt};
use futures::stream::{FuturesUnordered, StreamExt as _};
use regent_rdma::{BufferManager, HostId, Memory};
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tokio::time::Instant;

use crate::buffer::{Registered, TensorBuffer, check_plain, plain_bytes_mut};
use crate::dtype::DType;
use crate::error::Error;
pub use crate::layout::chunk_ranges;
use crate::reduce::ReduceOp;
use crate::reshard::ReshardPlan;
use crate::transport::{Transport, TransportError};
use wire::{Agreement, Body, Msg, OpDesc, OpKind, Region, Tag};

mod direct;
mod inline;
mod reshard;
mod ring;
pub(crate) mod wire;

/// How a collective moves its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Algorithm {
    /// Chosen by size and placement (module docs).
    #[default]
    Auto,
    /// Data in control messages.
    Inline,
    /// One-sided reads from every member; reductions in rank order.
    Direct,
    /// Neighbours only, pipelined; reductions in ring order.
    Ring,
}

/// The longest a collective may be given (a day).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The largest pipeline chunk.
pub const MAX_CHUNK_BYTES: usize = 64 << 20;
/// How long a member whose read found a peer's memory released waits for
/// the cause (the transport's failure report, or the peer's `Abort`)
/// before it blames that peer.
pub const BLAME_GRACE: Duration = Duration::from_secs(1);
/// How long a member whose all-reduce failed waits for peers' copies into
/// its memory still in flight; past it the buffer is poisoned
/// ([`TensorBuffer::poisoned`]): a peer stopped inside a copy may finish it
/// whenever it resumes.
pub const WINDOW_CLOSE_GRACE: Duration = Duration::from_millis(50);
/// Bytes a message needs beside an inline payload.
const MESSAGE_OVERHEAD_BYTES: usize = 4096;

/// Settings of a [`Communicator`]. Members of a group must use the same
/// `algorithm`, `exact`, `inline_max_bytes` and `chunk_bytes` (checked
/// when the communicator starts).
#[derive(Clone, Debug)]
pub struct CollectiveConfig {
    /// Default [`Algorithm::Auto`].
    pub algorithm: Algorithm,
    /// Whether reductions must equal the serial fold in rank order (then
    /// `Auto` never picks the ring). Default true.
    pub exact: bool,
    /// `Auto` sends tensors up to this size inline. Default 64 KiB.
    pub inline_max_bytes: usize,
    /// Pipeline chunk of the direct and ring algorithms: a multiple of 8,
    /// at most 64 MiB. Default 256 KiB (the fold works in L2).
    pub chunk_bytes: NonZeroUsize,
    /// How long one collective may take before it fails with
    /// [`Error::Timeout`]; a backstop behind the transport's failure
    /// detection. Default 60 s, at most a day.
    pub timeout: Duration,
    /// The most memory the communicator registers for its own use (ring
    /// partial sums, staging of plain tensors). Default 4 GiB.
    pub max_scratch_bytes: usize,
}

impl Default for CollectiveConfig {
    fn default() -> Self {
        Self {
            algorithm: Algorithm::Auto,
            exact: true,
            inline_max_bytes: 64 << 10,
            chunk_bytes: NonZeroUsize::new(256 << 10).expect("nonzero"),
            timeout: Duration::from_secs(60),
            max_scratch_bytes: 4 << 30,
        }
    }
}

impl CollectiveConfig {
    /// Sets [`Self::algorithm`].
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Sets [`Self::exact`].
    pub fn exact(mut self, exact: bool) -> Self {
        self.exact = exact;
        self
    }

    /// Sets [`Self::inline_max_bytes`].
    pub fn inline_max_bytes(mut self, bytes: usize) -> Self {
        self.inline_max_bytes = bytes;
        self
    }

    /// Sets [`Self::chunk_bytes`].
    pub fn chunk_bytes(mut self, bytes: NonZeroUsize) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// Sets [`Self::timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`Self::max_scratch_bytes`].
    pub fn max_scratch_bytes(mut self, bytes: usize) -> Self {
        self.max_scratch_bytes = bytes;
        self
    }

    fn validate(&self, max_message_bytes: usize) -> Result<(), Error> {
        let bad = |s: String| Err(Error::Invalid(s));
        let chunk = self.chunk_bytes.get();
        if !chunk.is_multiple_of(8) || chunk > MAX_CHUNK_BYTES {
            return bad(format!(
                "chunk_bytes {chunk} must be a multiple of 8, at most {MAX_CHUNK_BYTES}"
            ));
        }
        if self.inline_max_bytes + MESSAGE_OVERHEAD_BYTES > max_message_bytes {
            return bad(format!(
                "inline_max_bytes {} does not fit the transport's {max_message_bytes}-byte messages",
                self.inline_max_bytes
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return bad(format!(
                "timeout {:?} must be positive and at most a day",
                self.timeout
            ));
        }
        if self.max_scratch_bytes as u64 > regent_rdma::MAX_BUFFER_BYTES {
            return bad("max_scratch_bytes above 1 TiB".into());
        }
        Ok(())
    }

    fn agreement(&self) -> Agreement {
        Agreement {
            algorithm: self.algorithm,
            exact: self.exact,
            inline_max_bytes: self.inline_max_bytes as u64,
            chunk_bytes: self.chunk_bytes.get() as u64,
        }
    }
}

/// For the ring algorithms: the order in which chunk `chunk` of a
/// reduction over `size` members is folded (ranks `chunk + 1`, `chunk +
/// 2`, ... `chunk`, modulo `size`). Chunk `c` is the `c`-th of `size`
/// nearly equal parts of the elements (the first `numel % size` parts one
/// element longer).
pub fn ring_fold_order(chunk: usize, size: usize) -> Vec<usize> {
    (1..=size).map(|k| (chunk + k) % size).collect()
}

/// Registered bytes of this member that an operation reads or writes.
#[derive(Clone)]
pub(crate) struct Operand {
    reg: Arc<Registered>,
    /// Byte range in the buffer.
    range: Range<usize>,
}

impl Operand {
    fn of(buffer: &TensorBuffer) -> Self {
        Self {
            reg: buffer.registered().clone(),
            range: buffer.span(),
        }
    }

    fn len(&self) -> usize {
        self.range.len()
    }

    /// The region peers read: `at..at + len` of the operand.
    fn region(&self, at: usize, len: usize) -> Region {
        assert!(at + len <= self.len(), "region inside the operand");
        Region {
            buffer: self.reg.handle().clone(),
            offset: (self.range.start + at) as u64,
            len: len as u64,
        }
    }

    fn whole(&self) -> Region {
        self.region(0, self.len())
    }

    /// The whole operand under a window opened now (`Registered::open_window`):
    /// the region to hand peers for one operation.
    fn open_window(&self) -> Region {
        Region {
            buffer: self.reg.open_window(),
            ..self.whole()
        }
    }

    /// Closes the window of `region` (from [`Self::open_window`]), waiting
    /// up to `timeout` for peers' copies in flight.
    async fn close_window(&self, region: &Region, timeout: Duration) -> Result<(), Error> {
        self.reg.close_window(&region.buffer, timeout).await
    }

    /// Bytes `r` of the operand, read-only.
    ///
    /// # Safety
    /// Nobody writes them while the slice lives (the caller's protocol
    /// says why).
    unsafe fn bytes(&self, r: Range<usize>) -> &[u8] {
        assert!(r.end <= self.len(), "range inside the operand");
        // SAFETY: inside the buffer (asserted, and the operand lies inside
        // it); exclusivity is the caller's promise.
        unsafe {
            self.reg
                .slice(self.range.start + r.start..self.range.start + r.end)
        }
    }

    /// Bytes `r` of the operand, writable.
    ///
    /// # Safety
    /// Nobody else reads or writes them while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, r: Range<usize>) -> &mut [u8] {
        assert!(r.end <= self.len(), "range inside the operand");
        // SAFETY: as in `bytes`.
        unsafe {
            self.reg
                .slice_mut(self.range.start + r.start..self.range.start + r.end)
        }
    }
}

/// One operation's view of the group: its tag, its deadline, and
/// messages and reads that respect both.
pub(crate) struct Ctx<'a, T> {
    t: &'a T,
    tag: Tag,
    deadline: Instant,
    timeout: Duration,
    chunk_bytes: usize,
}

impl<T: Transport> Ctx<'_, T> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn manager(&self) -> &BufferManager {
        self.t.buffers()
    }

    /// The other ranks, starting after this one (so members do not all
    /// start with rank 0).
    fn others(&self) -> Vec<usize> {
        let (r, p) = (self.rank(), self.size());
        (1..p).map(|i| (r + i) % p).collect()
    }

    fn timeout_error(&self, what: &'static str, waiting_for: Vec<usize>) -> Error {
        Error::Timeout {
            what,
            waiting_for,
            after: self.timeout,
        }
    }

    async fn send_with(&self, to: usize, body: Body, payload: &[u8]) -> Result<(), Error> {
        let bytes = Msg {
            tag: self.tag,
            body,
        }
        .encode(payload);
        match tokio::time::timeout_at(self.deadline, self.t.send(to, bytes)).await {
            Ok(r) => r.map_err(Error::from),
            Err(_) => Err(self.timeout_error("send", vec![to])),
        }
    }

    async fn send(&self, to: usize, body: Body) -> Result<(), Error> {
        self.send_with(to, body, &[]).await
    }

    async fn send_all(&self, to: &[usize], body: Body) -> Result<(), Error> {
        join_peers(to.iter().copied().map(|q| self.send(q, body.clone()))).await
    }

    /// The next message from `from` for this operation.
    async fn recv(&self, from: usize, what: &'static str) -> Result<(Body, bytes::Bytes), Error> {
        let bytes =
            match tokio::time::timeout_at(self.deadline, self.t.recv(from, self.deadline)).await {
                Ok(Ok(b)) => b,
                Ok(Err(TransportError::Timeout { .. })) | Err(_) => {
                    return Err(self.timeout_error(what, vec![from]));
                }
                Ok(Err(e)) => return Err(e.into()),
            };
        let (msg, payload) = Msg::decode(from, bytes)?;
        if let Body::Abort { culprit, reason } = msg.body {
            return Err(Error::Aborted {
                by: from,
                culprit: culprit as usize,
                reason,
            });
        }
        if msg.tag != self.tag {
            return Err(Error::Mismatch {
                rank: from,
                detail: format!(
                    "it sent a message of {} while this member is in {} (do all members call the same collectives in the same order?)",
                    msg.tag, self.tag
                ),
            });
        }
        Ok((msg.body, payload))
    }

    async fn recv_done(&self, from: usize) -> Result<(), Error> {
        match self.recv(from, "done").await?.0 {
            Body::Done => Ok(()),
            other => Err(unexpected(from, "Done", &other)),
        }
    }

    async fn recv_ack(&self, from: usize) -> Result<(), Error> {
        match self.recv(from, "ack").await?.0 {
            Body::Ack => Ok(()),
            other => Err(unexpected(from, "Ack", &other)),
        }
    }

    async fn recv_signal(&self, from: usize, step: usize, sub: usize) -> Result<(), Error> {
        match self.recv(from, "chunk").await?.0 {
            Body::Signal { step: s, sub: j } if s as usize == step && j as usize == sub => Ok(()),
            other => Err(unexpected(
                from,
                &format!("Signal {{ step: {step}, sub: {sub} }}"),
                &other,
            )),
        }
    }

    /// A `Ready` for `desc` with `n` regions of `len` bytes each.
    async fn recv_ready(
        &self,
        from: usize,
        desc: &OpDesc,
        lens: &[usize],
    ) -> Result<Vec<Region>, Error> {
        match self.recv(from, "ready").await?.0 {
            Body::Ready { desc: d, regions } => {
                check_desc(from, desc, &d)?;
                if regions.len() != lens.len()
                    || regions.iter().zip(lens).any(|(r, &l)| r.len != l as u64)
                {
                    return Err(Error::Protocol {
                        rank: from,
                        detail: format!(
                            "regions of {:?} bytes for {d}, expected {lens:?}",
                            regions.iter().map(|r| r.len).collect::<Vec<_>>()
                        ),
                    });
                }
                Ok(regions)
            }
            other => Err(unexpected(from, "Ready", &other)),
        }
    }

    /// An `Inline` for `desc` with exactly `len` bytes.
    async fn recv_inline(
        &self,
        from: usize,
        desc: &OpDesc,
        len: usize,
    ) -> Result<bytes::Bytes, Error> {
        match self.recv(from, "data").await? {
            (Body::Inline { desc: d }, payload) => {
                check_desc(from, desc, &d)?;
                if payload.len() != len {
                    return Err(Error::Protocol {
                        rank: from,
                        detail: format!("{} bytes of data, expected {len}", payload.len()),
                    });
                }
                Ok(payload)
            }
            (other, _) => Err(unexpected(from, "Inline", &other)),
        }
    }

    /// Reads `dst.len()` bytes at `at` of `rank`'s `region`.
    async fn read(
        &self,
        rank: usize,
        region: &Region,
        at: usize,
        dst: &mut [u8],
    ) -> Result<(), Error> {
        check_in_region(rank, region, at, dst.len())?;
        match tokio::time::timeout_at(
            self.deadline,
            self.manager()
                .read_into(&region.buffer, region.offset + at as u64, dst),
        )
        .await
        {
            Ok(r) => r.map_err(|source| Error::Peer { rank, source }),
            Err(_) => Err(self.timeout_error("one-sided read", vec![rank])),
        }
    }

    /// Writes `src` at `at` of `rank`'s `region`.
    async fn write(
        &self,
        rank: usize,
        region: &Region,
        at: usize,
        src: &[u8],
    ) -> Result<(), Error> {
        check_in_region(rank, region, at, src.len())?;
        match tokio::time::timeout_at(
            self.deadline,
            self.manager()
                .write_from(&region.buffer, region.offset + at as u64, src),
        )
        .await
        {
            Ok(r) => r.map_err(|source| Error::Peer { rank, source }),
            Err(_) => Err(self.timeout_error("one-sided write", vec![rank])),
        }
    }

    /// Reads `len` bytes at `at` of each `(rank, region, at)` and hands them
    /// to `f` together, in order: in place where the peer's memory is
    /// mapped here (shm), through `len` bytes of `scratch` per read
    /// otherwise (`BufferManager::read_many_with`).
    async fn read_many_with<R>(
        &self,
        reads: &[(usize, &Region, usize)],
        len: usize,
        scratch: &mut [u8],
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, Error> {
        for (rank, region, at) in reads {
            check_in_region(*rank, region, *at, len)?;
        }
        let remotes: Vec<(&regent_rdma::RemoteBuffer, u64)> = reads
            .iter()
            .map(|(_, region, at)| (&region.buffer, region.offset + *at as u64))
            .collect();
        match tokio::time::timeout_at(
            self.deadline,
            self.manager().read_many_with(&remotes, len, scratch, f),
        )
        .await
        {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(regent_rdma::Error::Batch { index, source })) => Err(Error::Peer {
                rank: reads.get(index).map_or(self.rank(), |r| r.0),
                source: *source,
            }),
            Ok(Err(source)) => Err(Error::Invalid(format!("a read of peers' memory: {source}"))),
            Err(_) => {
                Err(self.timeout_error("one-sided read", reads.iter().map(|r| r.0).collect()))
            }
        }
    }
}

fn check_in_region(rank: usize, region: &Region, at: usize, len: usize) -> Result<(), Error> {
    if (at as u64).saturating_add(len as u64) > region.len {
        return Err(Error::Protocol {
            rank,
            detail: format!(
                "read of {at}+{len} outside its region of {} bytes",
                region.len
            ),
        });
    }
    Ok(())
}

fn unexpected(from: usize, want: &str, got: &Body) -> Error {
    let got = match got {
        Body::Hello { .. } => "Hello",
        Body::Ready { .. } => "Ready",
        Body::Inline { .. } => "Inline",
        Body::Signal { .. } => "Signal",
        Body::Done => "Done",
        Body::Ack => "Ack",
        Body::Abort { .. } => "Abort",
    };
    Error::Protocol {
        rank: from,
        detail: format!("expected {want}, got {got}"),
    }
}

fn check_desc(from: usize, ours: &OpDesc, theirs: &OpDesc) -> Result<(), Error> {
    if ours != theirs {
        return Err(Error::Mismatch {
            rank: from,
            detail: format!("it runs {theirs}, this member {ours}"),
        });
    }
    Ok(())
}

/// Runs per-peer futures together. A non-timeout error returns at once;
/// timeouts are collected, so the error names every rank that was silent.
///
/// The futures are boxed before the returned future exists, so its type
/// does not mention theirs (which spares rustc's `Send` check of nested
/// async blocks that borrow).
pub(crate) fn join_peers<'a, F>(
    futures: impl IntoIterator<Item = F>,
) -> impl Future<Output = Result<(), Error>> + Send + 'a
where
    F: Future<Output = Result<(), Error>> + Send + 'a,
{
    let mut pending: FuturesUnordered<BoxFuture<'a, Result<(), Error>>> =
        futures.into_iter().map(FutureExt::boxed).collect();
    async move {
        let mut timed_out: Option<(&'static str, Vec<usize>, Duration)> = None;
        while let Some(r) = pending.next().await {
            match r {
                Ok(()) => {}
                Err(Error::Timeout {
                    what,
                    waiting_for,
                    after,
                }) => {
                    let t = timed_out.get_or_insert((what, Vec::new(), after));
                    t.1.extend(waiting_for);
                }
                Err(e) => return Err(e),
            }
        }
        match timed_out {
            None => Ok(()),
            Some((what, mut waiting_for, after)) => {
                waiting_for.sort_unstable();
                waiting_for.dedup();
                Err(Error::Timeout {
                    what,
                    waiting_for,
                    after,
                })
            }
        }
    }
}

/// Byte ranges of the `size` chunks of `len_bytes` of `elem`-byte elements.
fn chunk_bytes_of(len_bytes: usize, size: usize, elem: usize) -> Vec<Range<usize>> {
    chunk_ranges(len_bytes / elem, size)
        .into_iter()
        .map(|r| r.start * elem..r.end * elem)
        .collect()
}

/// `range` in pieces of at most `sub` bytes.
fn pieces(range: Range<usize>, sub: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range.step_by(sub).map(move |s| s..(s + sub).min(end))
}

/// The most pieces a pipelined span is cut into: each costs a message per
/// hop, and a transport must be able to queue more than this many
/// messages per pair, or a ring whose members all wait for room could
/// deadlock (both transports of this crate do, checked below).
pub const MAX_PIECES: usize = 1024;
const _: () = assert!(
    MAX_PIECES < crate::transport::local::LOCAL_QUEUE_MESSAGES
        && MAX_PIECES < crate::transport::mesh::MESH_QUEUE_MESSAGES
);

/// The piece size for pipelining `len` bytes: the configured chunk, or
/// larger so that there are at most [`MAX_PIECES`] pieces. Both ends of a
/// pair compute it from the same numbers.
fn piece_bytes(len: usize, chunk: usize) -> usize {
    chunk.max(len.div_ceil(MAX_PIECES).next_multiple_of(8))
}

/// The bytes of `f32`s (native order).
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: an `f32` is 4 bytes without padding, so the slice's memory is
    // `size_of_val(v)` initialized bytes, borrowed as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The bytes of `f32`s (native order), writable.
fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`; any 4 bytes are a valid `f32`, so writes
    // through the byte view leave valid values, and the view borrows `v`
    // mutably.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A communicator: one member's end of a group for collectives, built on
/// a [`Transport`]. Members call the same collectives in the same order.
pub struct Communicator<T> {
    t: T,
    config: CollectiveConfig,
    hosts: Vec<HostId>,
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    /// Ring partial results (registered, read by the right neighbour).
    scratch: Option<Arc<Registered>>,
    /// Copies of plain tensors (registered, read by peers).
    staging: Option<Arc<Registered>>,
    /// Local fold space.
    tmp: Vec<u8>,
    broken: Option<String>,
}

impl<T> std::fmt::Debug for Communicator<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("seq", &self.seq)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Communicator<T> {
    /// Starts a communicator: every member says hello to every other
    /// (group size, host, and the settings that must agree), within the
    /// config's timeout.
    pub async fn new(transport: T, config: CollectiveConfig) -> Result<Self, Error> {
        config.validate(transport.max_message_bytes())?;
        let (rank, size) = (transport.rank(), transport.size());
        if size == 0 || rank >= size {
            return Err(Error::Invalid(format!("rank {rank} of a group of {size}")));
        }
        let mut hosts = vec![transport.buffers().host(); size];
        {
            let cx = Ctx {
                t: &transport,
                tag: Tag { p2p: false, seq: 0 },
                deadline: deadline_after(config.timeout)?,
                timeout: config.timeout,
                chunk_bytes: config.chunk_bytes.get(),
            };
            let hello = Body::Hello {
                size: size as u32,
                host: transport.buffers().host(),
                agreement: config.agreement(),
            };
            let others = cx.others();
            cx.send_all(&others, hello).await?;
            let ours = config.agreement();
            let got = join_collect(others.iter().copied().map(|q| {
                let cx = &cx;
                let ours = &ours;
                async move {
                    match cx.recv(q, "hello").await?.0 {
                        Body::Hello {
                            size: s,
                            host,
                            agreement,
                        } => {
                            if s as usize != size {
                                return Err(Error::Mismatch {
                                    rank: q,
                                    detail: format!(
                                        "it is in a group of {s}, this member of {size}"
                                    ),
                                });
                            }
                            if agreement != *ours {
                                return Err(Error::Mismatch {
                                    rank: q,
                                    detail: format!(
                                        "its settings {agreement:?} differ from {ours:?}"
                                    ),
                                });
                            }
                            Ok((q, host))
                        }
                        other => Err(unexpected(q, "Hello", &other)),
                    }
                }
            }))
            .await?;
            for (q, host) in got {
                hosts[q] = host;
            }
        }
        Ok(Self {
            p2p_sent: vec![0; size],
            p2p_received: vec![0; size],
            t: transport,
            config,
            hosts,
            seq: 0,
            scratch: None,
            staging: None,
            tmp: Vec::new(),
            broken: None,
        })
    }

    /// This member's rank.
    pub fn rank(&self) -> usize {
        self.t.rank()
    }

    /// The group's size.
    pub fn size(&self) -> usize {
        self.t.size()
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.t
    }

    /// The settings.
    pub fn config(&self) -> &CollectiveConfig {
        &self.config
    }

    /// Whether every member runs on this member's host (then `Auto` reads
    /// directly even in non-exact mode).
    pub fn one_host(&self) -> bool {
        self.hosts.iter().all(|h| *h == self.hosts[0])
    }

    /// The error that broke the communicator, if one did.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    fn check_usable(&self) -> Result<(), Error> {
        match &self.broken {
            Some(e) => Err(Error::Broken(e.clone())),
            None => Ok(()),
        }
    }

    /// The algorithm for an operation whose largest message would carry
    /// `message_bytes` inline.
    fn choose(&self, message_bytes: usize) -> Result<Algorithm, Error> {
        let c = &self.config;
        let fits = message_bytes + MESSAGE_OVERHEAD_BYTES <= self.t.max_message_bytes();
        Ok(match c.algorithm {
            Algorithm::Auto if message_bytes <= c.inline_max_bytes => Algorithm::Inline,
            Algorithm::Auto if c.exact || self.one_host() => Algorithm::Direct,
            Algorithm::Auto => Algorithm::Ring,
            Algorithm::Inline if !fits => {
                return Err(Error::Invalid(format!(
                    "{message_bytes} bytes do not fit an inline message of this transport"
                )));
            }
            a => a,
        })
    }

    /// The tag of the next collective.
    fn bump(&mut self) -> Tag {
        self.seq += 1;
        Tag {
            p2p: false,
            seq: self.seq,
        }
    }

    fn ctx(&self, tag: Tag) -> Result<Ctx<'_, T>, Error> {
        Ok(Ctx {
            t: &self.t,
            tag,
            deadline: deadline_after(self.config.timeout)?,
            timeout: self.config.timeout,
            chunk_bytes: self.config.chunk_bytes.get(),
        })
    }

    /// Records the error that broke the communicator, and tells the other
    /// members who is to blame (best effort, bounded) so they stop waiting.
    async fn break_with(&mut self, e: &Error, tag: Tag) {
        self.broken = Some(e.to_string());
        tracing::debug!(rank = self.rank(), error = %e, "collective failed");
        // An abort is passed on too: a member that gives up releases its
        // memory, and a peer reading it then learns the culprit from here.
        let culprit = match e {
            Error::Timeout { .. } | Error::Broken(_) => None,
            other => other.culprit(),
        };
        let Some(culprit) = culprit else { return };
        let msg = Msg {
            tag,
            body: Body::Abort {
                culprit: culprit as u32,
                reason: e.to_string(),
            },
        };
        let (r, p) = (self.rank(), self.size());
        let sends = (0..p)
            .filter(|&q| q != r && q != culprit)
            .map(|q| self.t.send(q, msg.encode(&[])));
        let _ = tokio::time::timeout(
            Duration::from_secs(1).min(self.config.timeout),
            futures::future::join_all(sends),
        )
        .await;
    }

    /// Ends an operation: an error breaks the communicator, and a member
    /// failure the transport knows of is reported as its cause.
    async fn finish<R>(&mut self, tag: Tag, r: Result<R, Error>) -> Result<R, Error> {
        let e = match r {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let e = self.blame(e).await;
        let e = match self.t.failure() {
            Some((rank, reason)) if e.culprit() != Some(rank) => Error::PeerFailed {
                rank,
                reason: format!("{reason} (here: {e})"),
            },
            _ => e,
        };
        self.break_with(&e, tag).await;
        Err(e)
    }

    /// The error to report for `e`. A peer whose memory was released (or
    /// closed) while this member read it gave up on the operation, most
    /// likely because another member failed: the buffer plane sees the
    /// release before the transport reports that failure or the peer's
    /// `Abort` (sent before it let go) arrives. So wait a little (at most
    /// [`BLAME_GRACE`]) for either before blaming the peer. Other errors
    /// are returned as they are (a dead owner is its own culprit).
    async fn blame(&self, e: Error) -> Error {
        let q = match &e {
            Error::Peer {
                rank,
                source: regent_rdma::Error::Released { .. } | regent_rdma::Error::Closed { .. },
            } => *rank,
            _ => return e,
        };
        if self.t.failure().is_some() {
            return e;
        }
        let deadline = Instant::now() + BLAME_GRACE.min(self.config.timeout);
        loop {
            match self.t.recv(q, deadline).await {
                Ok(bytes) => match Msg::decode(q, bytes) {
                    Ok((
                        Msg {
                            body: Body::Abort { culprit, reason },
                            ..
                        },
                        _,
                    )) => {
                        return Error::Aborted {
                            by: q,
                            culprit: culprit as usize,
                            reason,
                        };
                    }
                    // What it sent for the operation before it gave up.
                    Ok(_) => {}
                    Err(_) => return e,
                },
                // A failure reported (`finish` names it), the deadline,
                // or the transport gone.
                Err(_) => return e,
            }
        }
    }

    /// Waits until every member has entered the barrier (dissemination:
    /// `ceil(log2 P)` rounds of one message).
    pub async fn barrier(&mut self) -> Result<(), Error> {
        self.check_usable()?;
        let tag = self.bump();
        let cx = self.ctx(tag)?;
        let r = async {
            let (rank, p) = (cx.rank(), cx.size());
            let mut dist = 1;
            let mut round = 0;
            while dist < p {
                cx.send(
                    (rank + dist) % p,
                    Body::Signal {
                        step: round,
                        sub: 0,
                    },
                )
                .await?;
                cx.recv_signal((rank + p - dist) % p, round as usize, 0)
                    .await?;
                dist *= 2;
                round += 1;
            }
            Ok(())
        }
        .await;
        self.finish(tag, r).await
    }

    /// Copies `root`'s tensor into every member's.
    pub async fn broadcast(&mut self, data: &mut TensorBuffer, root: usize) -> Result<(), Error> {
        self.check_usable()?;
        let (dtype, numel) = self.check_operand(data)?;
        if root >= self.size() {
            return Err(Error::Invalid(format!(
                "root {root} of a group of {}",
                self.size()
            )));
        }
        let op = Operand::of(data);
        let algorithm = self.choose(op.len())?;
        let desc = OpDesc {
            kind: OpKind::Broadcast,
            dtype,
            numel,
            reduce: None,
            root: root as u32,
            digest: 0,
            algorithm,
        };
        let tag = self.bump();
        let cx = self.ctx(tag)?;
        let r = match algorithm {
            Algorithm::Inline => inline::broadcast(&cx, &op, &desc, root).await,
            Algorithm::Ring => ring::broadcast(&cx, &op, &desc, root).await,
            _ => direct::broadcast(&cx, &op, &desc, root).await,
        };
        self.finish(tag, r).await
    }

    /// Reduces every member's tensor elementwise with `op`, in place:
    /// every member ends with the same bits (with an exact algorithm, the
    /// serial left fold in rank order, [`crate::serial_fold`]).
    pub async fn all_reduce(&mut self, data: &mut TensorBuffer, op: ReduceOp) -> Result<(), Error> {
        self.check_usable()?;
        let (dtype, numel) = self.check_operand(data)?;
        op.check(dtype)?;
        let operand = Operand::of(data);
        self.all_reduce_operand(operand, dtype, numel, op).await
    }

    /// [`Self::all_reduce`] of a plain CPU tensor (contiguous): copied into
    /// registered memory owned by the communicator and back.
    pub async fn all_reduce_tensor(
        &mut self,
        tensor: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.check_usable()?;
        let (dtype, numel, len) = check_plain(tensor)?;
        op.check(dtype)?;
        let staging = self.ensure(Which::Staging, len)?;
        let operand = Operand {
            reg: staging,
            range: 0..len,
        };
        {
            // SAFETY: the staging buffer is this communicator's; no peer
            // reads it outside a collective, and none runs now.
            let dst = unsafe { operand.bytes_mut(0..len) };
            tensor.f_copy_data_u8(dst, numel as usize)?;
        }
        self.all_reduce_operand(operand.clone(), dtype, numel, op)
            .await?;
        // SAFETY: the collective completed: nobody reads the staging
        // buffer any more.
        let src = unsafe { operand.bytes(0..len) };
        plain_bytes_mut(tensor)?.copy_from_slice(src);
        Ok(())
    }

    /// [`Self::all_reduce`] of `f32` elements in this process's memory (a
    /// flat gradient): copied into registered memory owned by the
    /// communicator and back, with no tensor (and no allocation) in
    /// between.
    pub async fn all_reduce_f32(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), Error> {
        self.check_usable()?;
        op.check(DType::F32)?;
        let len = std::mem::size_of_val(data);
        let staging = self.ensure(Which::Staging, len)?;
        let operand = Operand {
            reg: staging,
            range: 0..len,
        };
        {
            // SAFETY: the staging buffer is this communicator's; no peer
            // reads it outside a collective, and none runs now.
            let dst = unsafe { operand.bytes_mut(0..len) };
            dst.copy_from_slice(f32_bytes(data));
        }
        self.all_reduce_operand(operand.clone(), DType::F32, data.len() as u64, op)
            .await?;
        // SAFETY: the collective completed: nobody reads the staging
        // buffer any more.
        let src = unsafe { operand.bytes(0..len) };
        f32_bytes_mut(data).copy_from_slice(src);
        Ok(())
    }

    async fn all_reduce_operand(
        &mut self,
        operand: Operand,
        dtype: DType,
        numel: u64,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let algorithm = self.choose(operand.len())?;
        let desc = OpDesc {
            kind: OpKind::AllReduce,
            dtype,
            numel,
            reduce: Some(op),
            root: 0,
            digest: 0,
            algorithm,
        };
        let scratch = match algorithm {
            Algorithm::Ring => Some(self.ensure(Which::Scratch, operand.len())?),
            _ => None,
        };
        let mut tmp = std::mem::take(&mut self.tmp);
        let tag = self.bump();
        let cx = self.ctx(tag)?;
        let r = match (algorithm, scratch) {
            (Algorithm::Inline, _) => inline::all_reduce(&cx, &operand, &desc, &mut tmp).await,
            (Algorithm::Ring, Some(s)) => {
                ring::all_reduce(&cx, &operand, &desc, &s, &mut tmp).await
            }
            _ => direct::all_reduce(&cx, &operand, &desc, &mut tmp).await,
        };
        self.tmp = tmp;
        self.finish(tag, r).await
    }

    /// Gathers every member's `input` into `output` (member `i`'s at
    /// elements `i * n .. (i + 1) * n`, `n` the input's element count).
    /// `input` may be any CPU tensor of the output's dtype; it is copied
    /// before this returns its future.
    pub fn all_gather<'a>(
        &'a mut self,
        input: &Tensor,
        output: &'a mut TensorBuffer,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        let prep = self.prepare_all_gather(input, output);
        async move {
            // Held so that nobody touches the output meanwhile.
            let _output = output;
            let (operand, desc) = prep?;
            let tag = self.bump();
            let cx = self.ctx(tag)?;
            let r = match desc.algorithm {
                Algorithm::Inline => inline::all_gather(&cx, &operand, &desc).await,
                Algorithm::Ring => ring::all_gather(&cx, &operand, &desc).await,
                _ => direct::all_gather(&cx, &operand, &desc).await,
            };
            self.finish(tag, r).await
        }
    }

    fn prepare_all_gather(
        &mut self,
        input: &Tensor,
        output: &mut TensorBuffer,
    ) -> Result<(Operand, OpDesc), Error> {
        self.check_usable()?;
        let (dtype, out_numel) = self.check_operand(output)?;
        let (in_dtype, numel, len) = check_plain(input)?;
        if in_dtype != dtype || numel.checked_mul(self.size() as u64) != Some(out_numel) {
            return Err(Error::LayoutMismatch {
                expected: format!(
                    "{dtype} input of {} elements",
                    out_numel / self.size() as u64
                ),
                found: format!("{in_dtype} input of {numel} elements"),
            });
        }
        let operand = Operand::of(output);
        let slot = self.rank() * len..(self.rank() + 1) * len;
        {
            // SAFETY: no collective runs, so no peer reads this member's
            // output; `&mut TensorBuffer` excludes this process's users.
            let dst = unsafe { operand.bytes_mut(slot) };
            input.f_copy_data_u8(dst, numel as usize)?;
        }
        let desc = OpDesc {
            kind: OpKind::AllGather,
            dtype,
            numel,
            reduce: None,
            root: 0,
            digest: 0,
            algorithm: self.choose(len)?,
        };
        Ok((operand, desc))
    }

    /// Reduces every member's `input` elementwise and leaves chunk `i`
    /// (elements `i * n .. (i + 1) * n`, `n` the output's element count)
    /// at member `i`, in `output` (any contiguous CPU tensor of the same
    /// dtype; no tensor sharing its storage may be used meanwhile). The
    /// input is not modified.
    pub fn reduce_scatter<'a>(
        &'a mut self,
        input: &'a TensorBuffer,
        output: &'a mut Tensor,
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        let prep = self.prepare_reduce_scatter(input, output, op);
        // Keeps `input` borrowed (a `TensorBuffer` is not `Sync`, so the
        // future cannot hold the reference itself).
        let _input: PhantomData<fn() -> &'a TensorBuffer> = PhantomData;
        async move {
            let _input = _input;
            let (operand, desc) = prep?;
            let scratch = match desc.algorithm {
                Algorithm::Ring => Some(self.ensure(Which::Scratch, operand.len())?),
                _ => None,
            };
            let out = plain_bytes_mut(output)?;
            let mut tmp = std::mem::take(&mut self.tmp);
            let tag = self.bump();
            let cx = self.ctx(tag)?;
            let r = match (desc.algorithm, scratch) {
                (Algorithm::Inline, _) => inline::reduce_scatter(&cx, &operand, &desc, out).await,
                (Algorithm::Ring, Some(s)) => {
                    ring::reduce_scatter(&cx, &operand, &desc, &s, out, &mut tmp).await
                }
                _ => direct::reduce_scatter(&cx, &operand, &desc, out, &mut tmp).await,
            };
            self.tmp = tmp;
            self.finish(tag, r).await
        }
    }

    fn prepare_reduce_scatter(
        &self,
        input: &TensorBuffer,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<(Operand, OpDesc), Error> {
        self.check_usable()?;
        let (dtype, in_numel) = self.check_operand(input)?;
        op.check(dtype)?;
        let (out_dtype, numel, len) = check_plain(output)?;
        if out_dtype != dtype || numel.checked_mul(self.size() as u64) != Some(in_numel) {
            return Err(Error::LayoutMismatch {
                expected: format!(
                    "{dtype} output of {} elements",
                    in_numel / self.size() as u64
                ),
                found: format!("{out_dtype} output of {numel} elements"),
            });
        }
        let desc = OpDesc {
            kind: OpKind::ReduceScatter,
            dtype,
            numel: in_numel,
            reduce: Some(op),
            root: 0,
            digest: 0,
            algorithm: self.choose(len)?,
        };
        Ok((Operand::of(input), desc))
    }

    /// Sends a tensor to `to`, which receives it with [`Self::recv`] into
    /// a tensor of the same dtype and element count. Small tensors go
    /// inline; others are read by the receiver one-sidedly, and this
    /// returns once it has.
    pub fn send<'a>(
        &'a mut self,
        data: &'a TensorBuffer,
        to: usize,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        let prep = (|| {
            self.check_usable()?;
            let (dtype, numel) = self.check_operand(data)?;
            self.check_peer(to)?;
            let op = Operand::of(data);
            let desc = OpDesc {
                kind: OpKind::Send,
                dtype,
                numel,
                reduce: None,
                root: self.rank() as u32,
                digest: 0,
                algorithm: self.choose_p2p(op.len())?,
            };
            Ok::<_, Error>((op, desc))
        })();
        // Keeps `data` borrowed (see `reduce_scatter`).
        let _data: PhantomData<fn() -> &'a TensorBuffer> = PhantomData;
        async move {
            let _data = _data;
            let (op, desc) = prep?;
            self.p2p_sent[to] += 1;
            let cx = self.p2p_ctx(self.p2p_sent[to])?;
            let tag = cx.tag;
            let r = async {
                if desc.algorithm == Algorithm::Inline {
                    // SAFETY: the tensor stays borrowed for the call; no
                    // peer writes a member's tensor unless handed its
                    // handle for that.
                    let bytes = unsafe { op.bytes(0..op.len()) };
                    return cx
                        .send_with(to, Body::Inline { desc: desc.clone() }, bytes)
                        .await;
                }
                cx.send(
                    to,
                    Body::Ready {
                        desc: desc.clone(),
                        regions: vec![op.whole()],
                    },
                )
                .await?;
                cx.recv_done(to).await?;
                cx.send(to, Body::Ack).await
            }
            .await;
            self.finish(tag, r).await
        }
    }

    /// Runs a reshard plan (made by a controller, the same at every
    /// member): a source passes its shard of every tensor of the plan, in
    /// order, in `sources`; a destination passes tensors of its shards'
    /// shapes in `dests`, which are filled; a member that is neither passes
    /// nothing (and returns at once). Every destination reads only the
    /// blocks it needs, one-sidedly; the result is bit-exact.
    pub fn reshard<'a>(
        &'a mut self,
        plan: &'a ReshardPlan,
        sources: &[&'a TensorBuffer],
        dests: &'a mut [TensorBuffer],
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        let prep = self.prepare_reshard(plan, sources, dests);
        // Keeps `sources` borrowed (see `reduce_scatter`).
        let _sources: PhantomData<fn() -> &'a TensorBuffer> = PhantomData;
        async move {
            let _sources = _sources;
            let _dests = dests;
            let (roles, src_ops, dst_ops, desc) = prep?;
            let tag = self.bump();
            let cx = self.ctx(tag)?;
            let r = reshard::run(&cx, plan, &desc, &roles, &src_ops, &dst_ops).await;
            self.finish(tag, r).await
        }
    }

    #[allow(clippy::type_complexity)]
    fn prepare_reshard(
        &self,
        plan: &ReshardPlan,
        sources: &[&TensorBuffer],
        dests: &[TensorBuffer],
    ) -> Result<(reshard::Roles, Vec<Operand>, Vec<Operand>, OpDesc), Error> {
        self.check_usable()?;
        let p = self.size();
        if plan
            .src_ranks
            .iter()
            .chain(&plan.dst_ranks)
            .any(|&g| g >= p)
        {
            return Err(Error::Plan(format!(
                "the plan names ranks outside a group of {p}"
            )));
        }
        let roles = reshard::Roles::of(plan, self.rank());
        let check = |buffers: &[&TensorBuffer], index: Option<usize>, src: bool| {
            let Some(index) = index else {
                if !buffers.is_empty() {
                    return Err(Error::Plan(format!(
                        "this member is no {} of the plan, but passed {} tensors",
                        if src { "source" } else { "destination" },
                        buffers.len()
                    )));
                }
                return Ok(Vec::new());
            };
            if buffers.len() != plan.tensors.len() {
                return Err(Error::Plan(format!(
                    "{} tensors for a plan of {}",
                    buffers.len(),
                    plan.tensors.len()
                )));
            }
            let mut ops = Vec::with_capacity(buffers.len());
            for (b, t) in buffers.iter().zip(&plan.tensors) {
                let (dtype, _) = self.check_operand(b)?;
                let shape = if src {
                    t.src_shape(index)?
                } else {
                    t.dst_shape(index)?
                };
                if dtype != t.dtype || b.layout().shape() != shape.as_slice() {
                    return Err(Error::LayoutMismatch {
                        expected: format!("{} {}{shape:?}", t.name, t.dtype),
                        found: b.layout().to_string(),
                    });
                }
                ops.push(Operand::of(b));
            }
            Ok(ops)
        };
        let src_ops = check(sources, roles.src, true)?;
        let dest_refs: Vec<&TensorBuffer> = dests.iter().collect();
        let dst_ops = check(&dest_refs, roles.dst, false)?;
        let desc = OpDesc {
            kind: OpKind::Reshard,
            dtype: DType::U8,
            numel: plan.tensors.len() as u64,
            reduce: None,
            root: 0,
            digest: plan.digest(),
            algorithm: Algorithm::Direct,
        };
        Ok((roles, src_ops, dst_ops, desc))
    }

    /// Receives the tensor that `from` sends with [`Self::send`].
    pub async fn recv(&mut self, data: &mut TensorBuffer, from: usize) -> Result<(), Error> {
        self.check_usable()?;
        let (dtype, numel) = self.check_operand(data)?;
        self.check_peer(from)?;
        let op = Operand::of(data);
        let desc = OpDesc {
            kind: OpKind::Send,
            dtype,
            numel,
            reduce: None,
            root: from as u32,
            digest: 0,
            algorithm: self.choose_p2p(op.len())?,
        };
        self.p2p_received[from] += 1;
        let cx = self.p2p_ctx(self.p2p_received[from])?;
        let tag = cx.tag;
        let r = async {
            // SAFETY: `&mut TensorBuffer` excludes this process's users; no
            // peer holds this buffer's handle during the receive.
            let dst = unsafe { op.bytes_mut(0..op.len()) };
            if desc.algorithm == Algorithm::Inline {
                let payload = cx.recv_inline(from, &desc, op.len()).await?;
                dst.copy_from_slice(&payload);
                return Ok(());
            }
            let regions = cx.recv_ready(from, &desc, &[op.len()]).await?;
            cx.read(from, &regions[0], 0, dst).await?;
            cx.send(from, Body::Done).await?;
            cx.recv_ack(from).await
        }
        .await;
        self.finish(tag, r).await
    }

    fn choose_p2p(&self, len: usize) -> Result<Algorithm, Error> {
        Ok(match self.choose(len)? {
            Algorithm::Inline => Algorithm::Inline,
            _ => Algorithm::Direct,
        })
    }

    fn p2p_ctx(&self, seq: u64) -> Result<Ctx<'_, T>, Error> {
        self.ctx(Tag { p2p: true, seq })
    }

    fn check_peer(&self, rank: usize) -> Result<(), Error> {
        if rank >= self.size() || rank == self.rank() {
            return Err(Error::Invalid(format!(
                "rank {rank} is not another member of a group of {}",
                self.size()
            )));
        }
        Ok(())
    }

    /// A tensor buffer usable in a collective: registered here and
    /// contiguous.
    fn check_operand(&self, data: &TensorBuffer) -> Result<(DType, u64), Error> {
        data.check_owner(self.t.buffers())?;
        data.registered().check_poisoned()?;
        let l = data.layout();
        if !l.is_contiguous() {
            return Err(Error::NotContiguous {
                shape: l.shape_i64(),
                strides: l.strides_i64(),
                what: "contiguous",
            });
        }
        Ok((l.dtype(), l.numel()))
    }

    /// The scratch or staging buffer, registered with at least `len` bytes.
    fn ensure(&mut self, which: Which, len: usize) -> Result<Arc<Registered>, Error> {
        let max = self.config.max_scratch_bytes;
        let manager = self.t.buffers().clone();
        let slot = match which {
            Which::Scratch => &mut self.scratch,
            Which::Staging => &mut self.staging,
        };
        if let Some(s) = slot.as_ref().filter(|s| s.len_bytes() >= len) {
            return Ok(s.clone());
        }
        let other = match which {
            Which::Scratch => self.staging.as_ref(),
            Which::Staging => self.scratch.as_ref(),
        }
        .map_or(0, |s| s.len_bytes());
        if len.saturating_add(other) > max {
            return Err(Error::Invalid(format!(
                "{len} bytes of scratch memory, more than max_scratch_bytes ({max}) allows"
            )));
        }
        let memory = Memory::allocate(len.max(1)).map_err(Error::Rdma)?;
        let reg = Arc::new(Registered::new(&manager, memory)?);
        let slot = match which {
            Which::Scratch => &mut self.scratch,
            Which::Staging => &mut self.staging,
        };
        *slot = Some(reg.clone());
        Ok(reg)
    }
}

#[derive(Clone, Copy)]
enum Which {
    Scratch,
    Staging,
}

fn deadline_after(timeout: Duration) -> Result<Instant, Error> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| Error::Invalid(format!("timeout {timeout:?} overflows the clock")))
}

/// Like [`join_peers`], collecting values.
fn join_collect<'a, F, V>(
    futures: impl IntoIterator<Item = F>,
) -> impl Future<Output = Result<Vec<V>, Error>> + Send + 'a
where
    F: Future<Output = Result<V, Error>> + Send + 'a,
    V: Send + 'a,
{
    let out = Arc::new(std::sync::Mutex::new(Vec::new()));
    let shared = out.clone();
    let all = join_peers(futures.into_iter().map(move |f| {
        let out = shared.clone();
        async move {
            let v = f.await?;
            out.lock().unwrap_or_else(|p| p.into_inner()).push(v);
            Ok(())
        }
    }));
    async move {
        all.await?;
        let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
        Ok(std::mem::take(&mut *out))
    }
}

#[cfg(test)]
mod tests;
