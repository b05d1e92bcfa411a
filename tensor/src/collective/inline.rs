//! The inline algorithms: the data rides in control messages (small
//! tensors). Nobody reads another member's memory, so there is no
//! `Done`/`Ack`; reductions fold in rank order.

use super::{Ctx, OpDesc, Operand, chunk_bytes_of, join_collect, join_peers};
use crate::collective::wire::Body;
use crate::error::Error;
use crate::reduce::{finish, fold};
use crate::transport::Transport;

fn inline(desc: &OpDesc) -> Body {
    Body::Inline { desc: desc.clone() }
}

/// Every other member's payload of `len` bytes, by rank.
async fn payloads<T: Transport>(
    cx: &Ctx<'_, T>,
    others: &[usize],
    desc: &OpDesc,
    len: usize,
) -> Result<Vec<Option<bytes::Bytes>>, Error> {
    let got = join_collect(
        others
            .iter()
            .copied()
            .map(|q| async move { Ok((q, cx.recv_inline(q, desc, len).await?)) }),
    )
    .await?;
    let mut by_rank = vec![None; cx.size()];
    for (q, b) in got {
        by_rank[q] = Some(b);
    }
    Ok(by_rank)
}

pub(super) async fn broadcast<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    root: usize,
) -> Result<(), Error> {
    if cx.rank() == root {
        // SAFETY: no peer reads or writes this member's memory in an
        // inline collective; `&mut TensorBuffer` excludes local users.
        let bytes = unsafe { data.bytes(0..data.len()) };
        let others = cx.others();
        join_peers(
            others
                .iter()
                .copied()
                .map(|q| cx.send_with(q, inline(desc), bytes)),
        )
        .await
    } else {
        let payload = cx.recv_inline(root, desc, data.len()).await?;
        // SAFETY: as above.
        unsafe { data.bytes_mut(0..data.len()) }.copy_from_slice(&payload);
        Ok(())
    }
}

pub(super) async fn all_reduce<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
    tmp: &mut Vec<u8>,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let op = desc.reduce.expect("an all-reduce has a reduction");
    let len = data.len();
    let others = cx.others();
    {
        // SAFETY: no peer reads or writes this member's memory in an
        // inline collective.
        let mine = unsafe { data.bytes(0..len) };
        join_peers(
            others
                .iter()
                .copied()
                .map(|q| cx.send_with(q, inline(desc), mine)),
        )
        .await?;
    }
    let theirs = payloads(cx, &others, desc, len).await?;
    // SAFETY: as above.
    let mine = unsafe { data.bytes_mut(0..len) };
    if tmp.len() < len {
        tmp.resize(len, 0);
    }
    let acc = &mut tmp[..len];
    for (q, theirs) in theirs.iter().enumerate() {
        let x: &[u8] = match theirs {
            Some(b) => b,
            None => {
                debug_assert_eq!(q, r);
                mine
            }
        };
        if q == 0 {
            acc.copy_from_slice(x);
        } else {
            fold(op, desc.dtype, acc, x);
        }
    }
    finish(op, desc.dtype, acc, p);
    mine.copy_from_slice(acc);
    Ok(())
}

pub(super) async fn all_gather<T: Transport>(
    cx: &Ctx<'_, T>,
    data: &Operand,
    desc: &OpDesc,
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let slot = data.len() / p;
    let others = cx.others();
    {
        // SAFETY: no peer reads or writes this member's memory in an
        // inline collective.
        let mine = unsafe { data.bytes(r * slot..(r + 1) * slot) };
        join_peers(
            others
                .iter()
                .copied()
                .map(|q| cx.send_with(q, inline(desc), mine)),
        )
        .await?;
    }
    let theirs = payloads(cx, &others, desc, slot).await?;
    for (q, b) in theirs.into_iter().enumerate() {
        if let Some(b) = b {
            // SAFETY: as above.
            unsafe { data.bytes_mut(q * slot..(q + 1) * slot) }.copy_from_slice(&b);
        }
    }
    Ok(())
}

pub(super) async fn reduce_scatter<T: Transport>(
    cx: &Ctx<'_, T>,
    input: &Operand,
    desc: &OpDesc,
    out: &mut [u8],
) -> Result<(), Error> {
    let (r, p) = (cx.rank(), cx.size());
    let op = desc.reduce.expect("a reduce-scatter has a reduction");
    let chunks = chunk_bytes_of(input.len(), p, desc.dtype.size_bytes());
    let others = cx.others();
    join_peers(others.iter().copied().map(|q| {
        // SAFETY: no peer reads or writes this member's memory in an
        // inline collective; the input is only read.
        let part = unsafe { input.bytes(chunks[q].clone()) };
        cx.send_with(q, inline(desc), part)
    }))
    .await?;
    let theirs = payloads(cx, &others, desc, chunks[r].len()).await?;
    // SAFETY: as above.
    let mine = unsafe { input.bytes(chunks[r].clone()) };
    for (q, theirs) in theirs.iter().enumerate() {
        let x: &[u8] = theirs.as_deref().unwrap_or(mine);
        if q == 0 {
            out.copy_from_slice(x);
        } else {
            fold(op, desc.dtype, out, x);
        }
    }
    finish(op, desc.dtype, out, p);
    Ok(())
}
