//! Running a [`ReshardPlan`]: sources publish their shards (`Ready`, one
//! region per tensor) to the destinations that read from them; each
//! destination pulls its blocks one-sidedly, run by run, then the
//! `Done`/`Ack` exchange as in the direct collectives. A member that is
//! both source and destination copies its own blocks locally.

use std::collections::BTreeSet;

use super::{Ctx, OpDesc, Operand, join_peers};
use crate::collective::wire::{Body, Region};
use crate::error::Error;
use crate::reshard::{ReshardPlan, runs};
use crate::transport::Transport;

/// Reads issued together.
const READS_AT_ONCE: usize = 64;

/// This member's part of a plan.
pub(super) struct Roles {
    /// Source mesh index, if a source.
    pub(super) src: Option<usize>,
    /// Destination mesh index, if a destination.
    pub(super) dst: Option<usize>,
}

impl Roles {
    pub(super) fn of(plan: &ReshardPlan, rank: usize) -> Self {
        Roles {
            src: plan.src_ranks.iter().position(|&g| g == rank),
            dst: plan.dst_ranks.iter().position(|&g| g == rank),
        }
    }
}

/// Bytes of source mesh rank `s`'s shard of each tensor.
fn src_lens(plan: &ReshardPlan, s: usize) -> Result<Vec<usize>, Error> {
    plan.tensors
        .iter()
        .map(|t| {
            let shape = t.src_shape(s)?;
            Ok(shape.iter().product::<u64>() as usize * t.dtype.size_bytes())
        })
        .collect()
}

/// Copies the blocks that destination `d` reads from source `s`: through
/// `read` (a peer) or locally (`local`, this member's own shards).
async fn pull<T: Transport>(
    cx: &Ctx<'_, T>,
    plan: &ReshardPlan,
    s: usize,
    d: usize,
    dests: &[Operand],
    from: Pulled<'_>,
) -> Result<(), Error> {
    for (i, t) in plan.tensors.iter().enumerate() {
        let elem = t.dtype.size_bytes() as u64;
        let (sshape, dshape) = (t.src_shape(s)?, t.dst_shape(d)?);
        let dst = &dests[i];
        for c in t.copies[d].iter().filter(|c| c.src == s) {
            let all: Vec<(u64, u64, u64)> =
                runs(&c.src_block, &sshape, &c.dst_block, &dshape).collect();
            for group in all.chunks(READS_AT_ONCE) {
                match &from {
                    Pulled::Local(sources) => {
                        for &(so, dof, n) in group {
                            let (so, dof, n) = (
                                (so * elem) as usize,
                                (dof * elem) as usize,
                                (n * elem) as usize,
                            );
                            // SAFETY: the source shard is only read (by
                            // peers too); the destination runs of a plan
                            // are disjoint, and this member's destination
                            // shards are written only by this reshard.
                            let src = unsafe { sources[i].bytes(so..so + n) };
                            unsafe { dst.bytes_mut(dof..dof + n) }.copy_from_slice(src);
                        }
                    }
                    Pulled::Peer(q, regions) => {
                        join_peers(group.iter().map(|&(so, dof, n)| {
                            let (so, dof, n) = (
                                (so * elem) as usize,
                                (dof * elem) as usize,
                                (n * elem) as usize,
                            );
                            // SAFETY: as above: disjoint destination runs,
                            // written only by this reshard.
                            let buf = unsafe { dst.bytes_mut(dof..dof + n) };
                            cx.read(*q, &regions[i], so, buf)
                        }))
                        .await?;
                    }
                }
            }
        }
    }
    Ok(())
}

enum Pulled<'a> {
    Local(&'a [Operand]),
    Peer(usize, Vec<Region>),
}

pub(super) async fn run<T: Transport>(
    cx: &Ctx<'_, T>,
    plan: &ReshardPlan,
    desc: &OpDesc,
    roles: &Roles,
    sources: &[Operand],
    dests: &[Operand],
) -> Result<(), Error> {
    let me = cx.rank();
    // Whom this member serves, and whom it reads.
    let mut readers = BTreeSet::new();
    let mut from = BTreeSet::new();
    for t in &plan.tensors {
        for (d, copies) in t.copies.iter().enumerate() {
            for c in copies {
                if Some(c.src) == roles.src {
                    readers.insert(plan.dst_ranks[d]);
                }
                if Some(d) == roles.dst {
                    from.insert(c.src);
                }
            }
        }
    }
    readers.remove(&me);
    if !readers.is_empty() {
        let regions: Vec<Region> = sources.iter().map(Operand::whole).collect();
        let readers: Vec<usize> = readers.iter().copied().collect();
        cx.send_all(
            &readers,
            Body::Ready {
                desc: desc.clone(),
                regions,
            },
        )
        .await?;
    }
    if let (Some(s), Some(d)) = (roles.src, roles.dst)
        && from.contains(&s)
    {
        pull(cx, plan, s, d, dests, Pulled::Local(sources)).await?;
    }
    let sources_of_mine: BTreeSet<usize> = from
        .iter()
        .map(|&s| plan.src_ranks[s])
        .filter(|&g| g != me)
        .collect();
    let peers: BTreeSet<usize> = readers.union(&sources_of_mine).copied().collect();
    join_peers(peers.into_iter().map(|q| {
        let (readers, sources_of_mine) = (&readers, &sources_of_mine);
        async move {
            let q_src = plan.src_ranks.iter().position(|&g| g == q);
            if sources_of_mine.contains(&q) {
                // `q` is a source of this member, so it has a mesh index.
                let s = q_src.expect("a source has a mesh index");
                let regions = cx.recv_ready(q, desc, &src_lens(plan, s)?).await?;
                // This member reads, so it is a destination.
                let d = roles.dst.expect("a reader is a destination");
                pull(cx, plan, s, d, dests, Pulled::Peer(q, regions)).await?;
                cx.send(q, Body::Done).await?;
            }
            if readers.contains(&q) {
                cx.recv_done(q).await?;
                cx.send(q, Body::Ack).await?;
            }
            if sources_of_mine.contains(&q) {
                cx.recv_ack(q).await?;
            }
            Ok(())
        }
    }))
    .await
}
