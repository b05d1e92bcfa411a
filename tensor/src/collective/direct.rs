//! The direct algorithms: every member reads what it needs from every
//! other member's registered memory, one-sidedly.
//!
//! All-reduce also writes: the owner of each chunk writes its result into
//! every member, under windows that end with the operation (see
//! [`all_reduce`]). The others only read. Their messages per pair, in
//! order: `Ready` (my memory is readable), then `Done` (I finished reading
//! your memory) and `Ack` (I saw your `Done` while still holding my
//! memory). Who writes what, and when, is stated at each `unsafe` block.

use std::ops::Range;

use super::{
    Ctx, OpDesc, Operand, WINDOW_CLOSE_GRACE, chunk_bytes_of, join_collect, join_peers, pieces,
};
use crate::collective::wire::{Body, Region};
use crate::dtype::DType;
use crate::error::Error;
use crate::reduce::{ReduceOp, finish, fold, fold_into, fold_rev};
use crate::transport::Transport;

/// Every other member's regions, by rank.
async fn readies<T: Transport>(
    cx: &Ctx<'_, T>,
    others: &[usize],
    desc: &OpDesc,
    len: usize,
) -> Result<Vec<Option<Region>>, Error> {
    let got = join_collect(others.iter().copied().map(|q| async move {
        let mut regions = cx.recv_ready(q, desc, &[len]).await?;
        Ok((q, regions.remove(0)))
    }))
    .await?;
    let mut peers = vec![None; cx.size()];
    for (q, region) in got {
        peers[q] = Some(region);
    }
    Ok(peers)
}

/// The last messages with `q`: my `Done`, its `Done`, my `Ack`, its `Ack`.
async fn close<T: Transport>(cx: &Ctx<'_, T>, q: usize) -> Result<(), Error> {
    cx.send(q, Body::Done).await?;
    cx.recv_done(q).await?;
    cx.send(q, Body::Ack).await?;
    cx.recv_ack(q).await
}

/// Where a reduced chunk goes.
enum Out<'a> {
    /// Over this member's own chunk of the input, and from there into the
    /// same bytes of each of these members, piece by piece (all-reduce).
    Spread(&'a [usize]),
    /// Into a local buffer holding just the chunk (reduce-scatter).
    Separate(&'a mut [u8]),
}

/// Folds `chunk` (bytes of the operand) over every member in rank order,
/// piece by piece: each piece of every other member is read where it lies
/// when its memory is mapped here (shm; otherwise into slots of `tmp`), this
/// member's own piece is used where it lies, and the fold writes the result
/// — one pass over the inputs, no copy of them.
#[allow(clippy::too_many_arguments)]
async fn reduce_chunk<T: Transport>(
    cx: &Ctx<'_, T>,
    input: &Operand,
    peers: &[Option<Region>],
    chunk: Range<usize>,
    dtype: DType,
    op: ReduceOp,
    tmp: &mut Vec<u8>,
    mut out: Out<'_>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let sub = cx.chunk_bytes;
    // The running value, then a slot per other member for reads that are
    // not in place.
    if tmp.len() < p * sub {
        tmp.resize(p * sub, 0);
    }
    let (acc_buf, scratch) = tmp.split_at_mut(sub);
    let base = chunk.start;
    let others: Vec<usize> = (0..p).filter(|&q| q != r).collect();
    for piece in pieces(chunk, sub) {
        let len = piece.len();
        let local = piece.start - base..piece.end - base;
        let reads: Vec<(usize, &Region, usize)> = others
            .iter()
            .map(|&q| {
                // `readies` filled every other rank.
                let region = peers[q].as_ref().expect("a region of every other rank");
                (q, region, piece.start)
            })
            .collect();
        let acc = &mut acc_buf[..len];
        let out = &mut out;
        cx.read_many_with(&reads, len, scratch, |views| {
            // SAFETY (`bytes` and `bytes_mut` below): in the reduce phase
            // nobody but this member reads or writes its own chunk of the
            // input; the shared and the mutable slice never live at once.
            let own = || unsafe { input.bytes(piece.clone()) };
            // Member q's piece: its view (others are in rank order, without r).
            let x = |q: usize| -> &[u8] {
                match q.cmp(&r) {
                    std::cmp::Ordering::Equal => own(),
                    std::cmp::Ordering::Less => views[q],
                    std::cmp::Ordering::Greater => views[q - 1],
                }
            };
            if p == 1 {
                if let Out::Separate(o) = out {
                    o[local.clone()].copy_from_slice(own());
                }
            } else {
                if p > 2 {
                    fold_into(op, dtype, acc, x(0), x(1));
                    for q in 2..p - 1 {
                        fold(op, dtype, acc, x(q));
                    }
                } else {
                    acc.copy_from_slice(x(0));
                }
                // The last step: result = acc op x(p - 1).
                let last = p - 1;
                match out {
                    Out::Separate(o) => fold_into(op, dtype, &mut o[local.clone()], acc, x(last)),
                    Out::Spread(_) if r == last => {
                        fold_rev(op, dtype, acc, unsafe { input.bytes_mut(piece.clone()) })
                    }
                    Out::Spread(_) => {
                        let y = x(last);
                        fold_into(op, dtype, unsafe { input.bytes_mut(piece.clone()) }, acc, y)
                    }
                }
            }
            let done = match out {
                Out::Spread(_) => unsafe { input.bytes_mut(piece.clone()) },
                Out::Separate(o) => &mut o[local.clone()],
            };
            finish(op, dtype, done, p);
        })
        .await?;
        if let Out::Spread(to) = &out {
            // SAFETY: this member's own chunk is written only by this
            // member (the fold above, done), and read by nobody else.
            let result = unsafe { input.bytes(piece.clone()) };
            join_peers(to.iter().map(|&q| {
                // `readies` filled every other rank.
                let region = peers[q].as_ref().expect("a region of every other rank");
                // The same bytes of member q: its chunk r, which only this
                // member touches during the operation.
                cx.write(q, region, piece.start, result)
            }))
            .await?;
        }
        // Over shm nothing above waits, so a large chunk would hold this
        // worker for its whole fold; the tasks it woke (the control plane's
        // sends, sitting in the worker's LIFO slot where no other worker
        // can steal them) would wait that long, and the proc's links go
        // silent. One yield per piece lets them run.
        tokio::task::yield_now().await;
    }
    Ok(())
}

pub(super) async fn broadcast<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    root: usize,
) -> Result<(), Error> {
    if cx.rank() == root {
        let others = cx.others();
        let ready = Body::Ready {
            desc: desc.clone(),
            regions: vec![data.whole()],
        };
        cx.send_all(&others, ready).await?;
        join_peers(others.iter().copied().map(|q| async move {
            cx.recv_done(q).await?;
            cx.send(q, Body::Ack).await
        }))
        .await
    } else {
        let regions = cx.recv_ready(root, desc, &[data.len()]).await?;
        // SAFETY: in a broadcast nobody reads a non-root's memory, and only
        // this call writes it.
        let dst = unsafe { data.bytes_mut(0..data.len()) };
        cx.read(root, &regions[0], 0, dst).await?;
        cx.send(root, Body::Done).await?;
        cx.recv_ack(root).await
    }
}

/// All-reduce: the owner of each chunk folds it over every member in rank
/// order where the pieces lie, and writes each reduced piece into every
/// member's memory while it is in cache — one pass over the inputs and one
/// over the outputs, no gather (a member moves `2 (P-1)/P` of the tensor,
/// as in a ring, but touches each byte of its memory once each way).
///
/// Messages per pair: `Ready` (my memory is open to you for this
/// operation, under a window of its own) and `Done` (I finished reading
/// your chunk of me and writing mine into you). A member returns once its
/// chunk is in every member and every `Done` has come; it then closes its
/// window, so no copy of this operation — not even a zombie's, resumed
/// later — touches its memory afterwards. It closes the window after a
/// failure too, waiting for copies in flight, so a peer that reads a member
/// that gave up reads the member's input as it was, or is refused. Who
/// writes what is stated at each `unsafe` block.
pub(super) async fn all_reduce<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let mine = data.open_window();
    let r = reduce_and_spread(cx, data, &mine, desc, tmp).await;
    // After every `Done` nothing is in flight and this returns at once.
    // After a failure a peer may be inside a copy: a running one ends
    // within the grace; one stopped inside it (SIGSTOP) may resume any
    // time, so the buffer is poisoned rather than waited for.
    let grace = if r.is_ok() {
        cx.timeout
    } else {
        WINDOW_CLOSE_GRACE.min(cx.timeout)
    };
    let closed = data.close_window(&mine, grace).await;
    match (r, closed) {
        (Ok(()), closed) => closed,
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(poisoned)) => {
            tracing::warn!(rank = cx.rank(), error = %e, %poisoned, "all-reduce failed");
            Err(e)
        }
    }
}

async fn reduce_and_spread<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    mine: &Region,
    desc: &OpDesc,
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let op = desc.reduce.expect("an all-reduce has a reduction");
    let others = cx.others();
    cx.send_all(
        &others,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![mine.clone()],
        },
    )
    .await?;
    let peers = readies(cx, &others, desc, data.len()).await?;
    let chunks = chunk_bytes_of(data.len(), p, desc.dtype.size_bytes());
    reduce_chunk(
        cx,
        data,
        &peers,
        chunks[r].clone(),
        desc.dtype,
        op,
        tmp,
        Out::Spread(&others),
    )
    .await?;
    cx.send_all(&others, Body::Done).await?;
    join_peers(others.iter().copied().map(|q| cx.recv_done(q))).await
}

pub(super) async fn reduce_scatter<T: Transport>(
    cx: &Ctx<'_, T>,
    input: &Operand,
    desc: &OpDesc,
    out: &mut [u8],
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let op = desc.reduce.expect("a reduce-scatter has a reduction");
    let others = cx.others();
    cx.send_all(
        &others,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![input.whole()],
        },
    )
    .await?;
    let peers = readies(cx, &others, desc, input.len()).await?;
    let chunk = chunk_bytes_of(input.len(), p, desc.dtype.size_bytes())[r].clone();
    reduce_chunk(
        cx,
        input,
        &peers,
        chunk,
        desc.dtype,
        op,
        tmp,
        Out::Separate(out),
    )
    .await?;
    join_peers(others.iter().copied().map(|q| close(cx, q))).await
}

pub(super) async fn all_gather<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
) -> Result<(), Error> {
    let p = cx.size();
    let slot = data.len() / p;
    let others = cx.others();
    cx.send_all(
        &others,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![data.whole()],
        },
    )
    .await?;
    join_peers(others.iter().copied().map(|q| async move {
        let regions = cx.recv_ready(q, desc, &[data.len()]).await?;
        let s = q * slot..(q + 1) * slot;
        // SAFETY: peers read only slot `rank` of this member's output; slot
        // q is written only by this future.
        let dst = unsafe { data.bytes_mut(s.clone()) };
        cx.read(q, &regions[0], s.start, dst).await?;
        close(cx, q).await
    }))
    .await
}
