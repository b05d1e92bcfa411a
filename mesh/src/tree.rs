//! The shape of cast trees: which procs a node forwards a cast to.
//!
//! The procs of a mesh have ranks `0..n`. A cast from a sender (the root,
//! which is not one of them) splits `0..n` into at most `fanout` contiguous
//! chunks of nearly equal size and sends the cast to the first proc of each
//! chunk (its *head*). A head delivers to its own members and splits the rest
//! of its chunk the same way. So every proc is reached exactly once, the tree
//! has depth `⌈log_fanout n⌉`, the sender sends at most `fanout` messages
//! whatever `n`, and — since the chunks do not depend on what is selected —
//! the path from a sender to a given proc is always the same, which keeps
//! casts in FIFO order per (sender, receiver). Chunks with nothing selected
//! are skipped, which does not change the path to any other proc.

use std::num::NonZeroU32;
use std::ops::Range;

/// The default fan-out, as Monarch's.
pub const DEFAULT_FANOUT: NonZeroU32 = match NonZeroU32::new(16) {
    Some(f) => f,
    None => unreachable!(),
};

/// Splits `range` into at most `fanout` contiguous, non-empty chunks of
/// nearly equal size (the first ones one longer), in order.
pub fn chunks(range: Range<u32>, fanout: NonZeroU32) -> impl Iterator<Item = Range<u32>> {
    let len = range.end.saturating_sub(range.start);
    let parts = len.min(fanout.get());
    let base = len.checked_div(parts).unwrap_or(0);
    let extra = len.checked_rem(parts).unwrap_or(0);
    let mut start = range.start;
    (0..parts).map(move |i| {
        let size = base + u32::from(i < extra);
        let chunk = start..start + size;
        start += size;
        chunk
    })
}

/// The chunks the root sends to, for a mesh of `procs` procs.
pub fn root_children(procs: u32, fanout: NonZeroU32) -> impl Iterator<Item = Range<u32>> {
    chunks(0..procs, fanout)
}

/// The chunks the head of `chunk` (its first proc) forwards to.
pub fn children(chunk: Range<u32>, fanout: NonZeroU32) -> impl Iterator<Item = Range<u32>> {
    let rest = chunk.start.saturating_add(1).min(chunk.end)..chunk.end;
    chunks(rest, fanout)
}

/// The depth of the tree over `procs` procs: the number of hops from the
/// root to the farthest proc (0 for no proc).
pub fn depth(procs: u32, fanout: NonZeroU32) -> u32 {
    // The first chunk at every level is the largest: follow it.
    let mut depth = 0;
    let mut next = root_children(procs, fanout).next();
    while let Some(chunk) = next {
        depth += 1;
        next = children(chunk, fanout).next();
    }
    depth
}

/// The path of chunk heads from the root to proc `target` (the last element
/// is `target` itself), or `None` when `target >= procs`.
pub fn path(procs: u32, fanout: NonZeroU32, target: u32) -> Option<Vec<u32>> {
    if target >= procs {
        return None;
    }
    let mut hops = Vec::new();
    let mut chunk = root_children(procs, fanout).find(|c| c.contains(&target))?;
    loop {
        hops.push(chunk.start);
        if chunk.start == target {
            return Some(hops);
        }
        chunk = children(chunk, fanout).find(|c| c.contains(&target))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn f(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn chunks_are_contiguous_and_balanced() {
        let c: Vec<_> = chunks(0..10, f(4)).collect();
        assert_eq!(c, vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(chunks(5..7, f(16)).collect::<Vec<_>>(), vec![5..6, 6..7]);
        assert_eq!(chunks(3..3, f(16)).count(), 0);
    }

    #[test]
    fn depth_is_logarithmic() {
        assert_eq!(depth(0, f(16)), 0);
        assert_eq!(depth(1, f(16)), 1);
        assert_eq!(depth(16, f(16)), 1);
        assert_eq!(depth(17, f(16)), 2);
        assert_eq!(depth(16 * 17, f(16)), 2);
        assert_eq!(depth(100_000, f(16)), 5);
    }

    /// Visits every node, returning (proc, depth) for each reached proc and
    /// the number of messages each node sent.
    fn walk(procs: u32, fanout: NonZeroU32) -> (Vec<u32>, usize) {
        let mut reached = Vec::new();
        let mut stack: Vec<Range<u32>> = root_children(procs, fanout).collect();
        let root_sent = stack.len();
        while let Some(c) = stack.pop() {
            reached.push(c.start);
            let kids: Vec<_> = children(c, fanout).collect();
            assert!(kids.len() <= fanout.get() as usize);
            stack.extend(kids);
        }
        reached.sort_unstable();
        (reached, root_sent)
    }

    proptest! {
        #[test]
        fn every_proc_is_reached_exactly_once(procs in 0u32..3000, fanout in 1u32..20) {
            let (reached, root_sent) = walk(procs, f(fanout));
            prop_assert_eq!(reached, (0..procs).collect::<Vec<_>>());
            prop_assert!(root_sent <= fanout as usize);
        }

        #[test]
        fn paths_end_at_their_target_and_are_fixed(procs in 1u32..5000, fanout in 2u32..20, t in any::<u32>()) {
            let target = t % procs;
            let p = path(procs, f(fanout), target).unwrap();
            prop_assert_eq!(*p.last().unwrap(), target);
            prop_assert!(p.len() as u32 <= depth(procs, f(fanout)));
            prop_assert_eq!(path(procs, f(fanout), target), Some(p));
        }
    }
}
