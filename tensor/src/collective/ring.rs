//! The ring algorithms: each member reads only from its left neighbour,
//! piece by piece, and tells its right neighbour when a piece is ready, so
//! the pieces flow around the ring in a pipeline.
//!
//! Reduce phase (all-reduce, reduce-scatter): chunk `c` starts as the raw
//! chunk of rank `c + 1` and gains one member per hop, ending at rank `c`
//! ([`super::ring_fold_order`]). Partial results live in each member's
//! scratch buffer, a region per chunk, each written once. Gather phase
//! (all-reduce, all-gather): chunk `c` travels from rank `c` around the
//! ring, each member copying it from its left neighbour's tensor.
//!
//! Steps are numbered across both phases; `Signal { step, sub }` tells the
//! right neighbour that piece `sub` of its step `step` is ready.

use std::ops::Range;
use std::sync::Arc;

use super::{Ctx, OpDesc, Operand, chunk_bytes_of, piece_bytes, pieces};
use crate::buffer::Registered;
use crate::collective::wire::{Body, Region};
use crate::error::Error;
use crate::reduce::{finish, fold};
use crate::transport::Transport;

struct Ring {
    left: usize,
    right: usize,
}

impl Ring {
    fn of<T: Transport>(cx: &Ctx<'_, T>) -> Self {
        let (r, p) = (cx.rank(), cx.size());
        Ring {
            left: (r + p - 1) % p,
            right: (r + 1) % p,
        }
    }
}

/// The chunk this member handles at reduce step `s`: it sits at position
/// `s + 1` of that chunk's chain.
fn reduce_chunk_at(r: usize, p: usize, s: usize) -> usize {
    (r + 2 * p - s - 2) % p
}

/// The chunk this member receives at gather step `g`.
fn gather_chunk_at(r: usize, p: usize, g: usize) -> usize {
    (r + 2 * p - 1 - g) % p
}

fn scratch_operand(scratch: &Arc<Registered>, len: usize) -> Operand {
    assert!(scratch.len_bytes() >= len, "scratch large enough");
    Operand {
        reg: scratch.clone(),
        range: 0..len,
    }
}

/// Tells `to` that every piece of `range` is ready for its step `step`.
async fn signal_pieces<T: Transport>(
    cx: &Ctx<'_, T>,
    to: usize,
    step: usize,
    range: Range<usize>,
) -> Result<(), Error> {
    let sub = piece_bytes(range.len(), cx.chunk_bytes);
    for (j, _) in pieces(range, sub).enumerate() {
        cx.send(
            to,
            Body::Signal {
                step: step as u32,
                sub: j as u32,
            },
        )
        .await?;
    }
    Ok(())
}

/// The final exchange with both neighbours: `Done` to the left (whose
/// memory this member read), `Done` from the right, `Ack` to the right,
/// `Ack` from the left. With two members both are the same rank, and the
/// messages still come in this order.
async fn close<T: Transport>(
    cx: &Ctx<'_, T>,
    ring: &Ring,
    read_left: bool,
    read_by_right: bool,
) -> Result<(), Error> {
    if read_left {
        cx.send(ring.left, Body::Done).await?;
    }
    if read_by_right {
        cx.recv_done(ring.right).await?;
        cx.send(ring.right, Body::Ack).await?;
    }
    if read_left {
        cx.recv_ack(ring.left).await?;
    }
    Ok(())
}

/// The reduce phase. `finals(c_range, piece, acc)` receives the finished
/// pieces of this member's own chunk. Returns the left neighbour's
/// regions (scratch first).
#[allow(clippy::too_many_arguments)]
async fn reduce_phase<T: Transport>(
    cx: &Ctx<'_, T>,
    ring: &Ring,
    input: &Operand,
    scratch: &Operand,
    left_regions: &[Region],
    desc: &OpDesc,
    tmp: &mut Vec<u8>,
    mut finals: impl FnMut(Range<usize>, &[u8]) -> Result<(), Error>,
    signal_finals: Option<usize>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let op = desc.reduce.expect("a ring reduction has a reduction");
    let chunks = chunk_bytes_of(input.len(), p, desc.dtype.size_bytes());
    // Position 0 of chunk r - 1's chain: its raw data, copied where the
    // right neighbour reads partial results.
    let c0 = chunks[(r + p - 1) % p].clone();
    {
        // SAFETY: scratch region c0 is read by the right neighbour only
        // after the signals below; the input is only read.
        let dst = unsafe { scratch.bytes_mut(c0.clone()) };
        dst.copy_from_slice(unsafe { input.bytes(c0.clone()) });
    }
    signal_pieces(cx, ring.right, 0, c0).await?;
    for s in 0..p - 1 {
        let c = reduce_chunk_at(r, p, s);
        let last = s == p - 2;
        let sub = piece_bytes(chunks[c].len(), cx.chunk_bytes);
        if tmp.len() < sub {
            tmp.resize(sub, 0);
        }
        for (j, piece) in pieces(chunks[c].clone(), sub).enumerate() {
            cx.recv_signal(ring.left, s, j).await?;
            // SAFETY: the input is only read, by this member alone.
            let mine = unsafe { input.bytes(piece.clone()) };
            if last {
                let acc = &mut tmp[..piece.len()];
                cx.read(ring.left, &left_regions[0], piece.start, acc)
                    .await?;
                // The left neighbour's partial first, then this member's.
                fold(op, desc.dtype, acc, mine);
                finish(op, desc.dtype, acc, p);
                finals(piece, acc)?;
                if let Some(step) = signal_finals {
                    cx.send(
                        ring.right,
                        Body::Signal {
                            step: step as u32,
                            sub: j as u32,
                        },
                    )
                    .await?;
                }
            } else {
                // SAFETY: scratch region c is written once, here, and read
                // by the right neighbour after the signal that follows.
                let acc = unsafe { scratch.bytes_mut(piece.clone()) };
                cx.read(ring.left, &left_regions[0], piece.start, acc)
                    .await?;
                fold(op, desc.dtype, acc, mine);
                cx.send(
                    ring.right,
                    Body::Signal {
                        step: (s + 1) as u32,
                        sub: j as u32,
                    },
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// The gather phase over `data` (chunks of `chunks`), steps numbered from
/// `first_step`; the left neighbour's tensor is `left`.
async fn gather_phase<T: Transport>(
    cx: &Ctx<'_, T>,
    ring: &Ring,
    data: &Operand,
    left: &Region,
    chunks: &[Range<usize>],
    first_step: usize,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    for g in 0..p - 1 {
        let c = gather_chunk_at(r, p, g);
        let sub = piece_bytes(chunks[c].len(), cx.chunk_bytes);
        for (j, piece) in pieces(chunks[c].clone(), sub).enumerate() {
            cx.recv_signal(ring.left, first_step + g, j).await?;
            // SAFETY: chunk c of this member's tensor is written once, here;
            // the right neighbour reads it only after the signal below.
            let dst = unsafe { data.bytes_mut(piece.clone()) };
            cx.read(ring.left, left, piece.start, dst).await?;
            if g < p - 2 {
                cx.send(
                    ring.right,
                    Body::Signal {
                        step: (first_step + g + 1) as u32,
                        sub: j as u32,
                    },
                )
                .await?;
            }
        }
    }
    Ok(())
}

pub(super) async fn all_reduce<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    scratch: &Arc<Registered>,
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let p = cx.size();
    if p == 1 {
        return super::direct::all_reduce(cx, data, desc, tmp).await;
    }
    let ring = Ring::of(cx);
    let scratch = scratch_operand(scratch, data.len());
    cx.send(
        ring.right,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![scratch.whole(), data.whole()],
        },
    )
    .await?;
    let left = cx
        .recv_ready(ring.left, desc, &[data.len(), data.len()])
        .await?;
    reduce_phase(
        cx,
        &ring,
        data,
        &scratch,
        &left,
        desc,
        tmp,
        |piece, acc| {
            // SAFETY: this member's own chunk of its tensor: its elements
            // were just folded, and the right neighbour reads it only after
            // the signal that follows.
            unsafe { data.bytes_mut(piece) }.copy_from_slice(acc);
            Ok(())
        },
        Some(p - 1),
    )
    .await?;
    let chunks = chunk_bytes_of(data.len(), p, desc.dtype.size_bytes());
    gather_phase(cx, &ring, data, &left[1], &chunks, p - 1).await?;
    close(cx, &ring, true, true).await
}

pub(super) async fn reduce_scatter<T: Transport>(
    cx: &Ctx<'_, T>,
    input: &Operand,
    desc: &OpDesc,
    scratch: &Arc<Registered>,
    out: &mut [u8],
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    if p == 1 {
        return super::direct::reduce_scatter(cx, input, desc, out, tmp).await;
    }
    let ring = Ring::of(cx);
    let scratch = scratch_operand(scratch, input.len());
    cx.send(
        ring.right,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![scratch.whole()],
        },
    )
    .await?;
    let left = cx.recv_ready(ring.left, desc, &[input.len()]).await?;
    let base = chunk_bytes_of(input.len(), p, desc.dtype.size_bytes())[r].start;
    reduce_phase(
        cx,
        &ring,
        input,
        &scratch,
        &left,
        desc,
        tmp,
        |piece, acc| {
            out[piece.start - base..piece.end - base].copy_from_slice(acc);
            Ok(())
        },
        None,
    )
    .await?;
    close(cx, &ring, true, true).await
}

pub(super) async fn all_gather<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    if p == 1 {
        return Ok(());
    }
    let ring = Ring::of(cx);
    cx.send(
        ring.right,
        Body::Ready {
            desc: desc.clone(),
            regions: vec![data.whole()],
        },
    )
    .await?;
    let left = cx.recv_ready(ring.left, desc, &[data.len()]).await?;
    let slot = data.len() / p;
    let chunks: Vec<Range<usize>> = (0..p).map(|q| q * slot..(q + 1) * slot).collect();
    // This member's own slot is in place (the caller copied it).
    signal_pieces(cx, ring.right, 0, chunks[r].clone()).await?;
    gather_phase(cx, &ring, data, &left[0], &chunks, 0).await?;
    close(cx, &ring, true, true).await
}

/// Broadcast along the chain `root, root + 1, ...` (no wrap-around).
pub(super) async fn broadcast<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    root: usize,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    if p == 1 {
        return Ok(());
    }
    let ring = Ring::of(cx);
    let position = (r + p - root) % p;
    let has_right = position < p - 1;
    let has_left = position > 0;
    if has_right {
        cx.send(
            ring.right,
            Body::Ready {
                desc: desc.clone(),
                regions: vec![data.whole()],
            },
        )
        .await?;
    }
    if has_left {
        let left = cx.recv_ready(ring.left, desc, &[data.len()]).await?;
        let sub = piece_bytes(data.len(), cx.chunk_bytes);
        for (j, piece) in pieces(0..data.len(), sub).enumerate() {
            cx.recv_signal(ring.left, 0, j).await?;
            // SAFETY: each piece of this member's tensor is written once,
            // here; the right neighbour reads it only after the signal.
            let dst = unsafe { data.bytes_mut(piece.clone()) };
            cx.read(ring.left, &left[0], piece.start, dst).await?;
            if has_right {
                cx.send(
                    ring.right,
                    Body::Signal {
                        step: 0,
                        sub: j as u32,
                    },
                )
                .await?;
            }
        }
    } else {
        signal_pieces(cx, ring.right, 0, 0..data.len()).await?;
    }
    close(cx, &ring, has_left, has_right).await
}
