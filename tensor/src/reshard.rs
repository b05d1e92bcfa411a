//! Reshard plans: how to move a tensor sharded one way over some members
//! to members that hold it sharded another way. Pure (no I/O): a
//! controller makes the plan, every member gets it, and
//! [`crate::Communicator::reshard`] runs it, each destination pulling only
//! the blocks it needs from the sources, one-sidedly.
//!
//! A [`Sharding`] is a mesh shape and a [`Placement`] per mesh dimension,
//! as in torch's DTensor: `Shard(d)` splits tensor dimension `d` over that
//! mesh dimension (nearly equal parts, the first ones one longer, as
//! [`crate::layout::chunk_ranges`]), `Replicate` copies it. Mesh
//! ranks are row-major over the mesh shape.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::Error;
use crate::layout::{MAX_DIMS, chunk_ranges};

/// The most ranks a sharding's mesh may have.
pub const MAX_MESH_RANKS: usize = 1 << 16;
/// The most tensors in one plan.
pub const MAX_PLAN_TENSORS: usize = 1 << 16;

/// What one mesh dimension does to the tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Placement {
    /// Every rank along this mesh dimension holds the same data.
    Replicate,
    /// The ranks along this mesh dimension split this tensor dimension.
    Shard(usize),
}

/// How a tensor lies over a mesh of ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sharding {
    mesh: Vec<usize>,
    placements: Vec<Placement>,
}

/// A box of a tensor: an offset and a shape per dimension.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Block {
    /// Where it starts, per dimension.
    pub offset: Vec<u64>,
    /// Its extent, per dimension.
    pub shape: Vec<u64>,
}

impl Block {
    /// The number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    fn intersect(&self, other: &Block) -> Option<Block> {
        let mut offset = Vec::with_capacity(self.offset.len());
        let mut shape = Vec::with_capacity(self.offset.len());
        for d in 0..self.offset.len() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offset.push(lo);
            shape.push(hi - lo);
        }
        Some(Block { offset, shape })
    }

    /// This block relative to `origin`.
    fn relative_to(&self, origin: &Block) -> Block {
        Block {
            offset: self
                .offset
                .iter()
                .zip(&origin.offset)
                .map(|(a, o)| a - o)
                .collect(),
            shape: self.shape.clone(),
        }
    }
}

impl Sharding {
    /// A sharding; fails on an empty or too large mesh, a mesh dimension
    /// of size 0, or placements that do not match the mesh.
    pub fn new(mesh: Vec<usize>, placements: Vec<Placement>) -> Result<Self, Error> {
        if mesh.is_empty() || mesh.len() != placements.len() || mesh.len() > MAX_DIMS {
            return Err(Error::Plan(format!(
                "a mesh of shape {mesh:?} needs one placement per dimension (got {placements:?})"
            )));
        }
        let size = mesh
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|n| (1..=MAX_MESH_RANKS).contains(n));
        if size.is_none() {
            return Err(Error::Plan(format!(
                "mesh {mesh:?}: 1 to {MAX_MESH_RANKS} ranks"
            )));
        }
        Ok(Self { mesh, placements })
    }

    /// Every one of `ranks` holds the whole tensor.
    pub fn replicated(ranks: usize) -> Result<Self, Error> {
        Self::new(vec![ranks], vec![Placement::Replicate])
    }

    /// `ranks` split tensor dimension `dim`.
    pub fn split(ranks: usize, dim: usize) -> Result<Self, Error> {
        Self::new(vec![ranks], vec![Placement::Shard(dim)])
    }

    /// The mesh shape.
    pub fn mesh(&self) -> &[usize] {
        &self.mesh
    }

    /// The placements.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.mesh.iter().product()
    }

    fn check(&self, shape: &[u64]) -> Result<(), Error> {
        for p in &self.placements {
            if let Placement::Shard(d) = p
                && *d >= shape.len()
            {
                return Err(Error::Plan(format!(
                    "Shard({d}) of a tensor with {} dimensions",
                    shape.len()
                )));
            }
        }
        Ok(())
    }

    /// The block mesh rank `rank` holds of a tensor of `shape`.
    pub fn block(&self, shape: &[u64], rank: usize) -> Result<Block, Error> {
        self.check(shape)?;
        if rank >= self.size() {
            return Err(Error::Plan(format!(
                "rank {rank} of a mesh of {}",
                self.size()
            )));
        }
        let mut coords = vec![0usize; self.mesh.len()];
        let mut rest = rank;
        for (c, &d) in coords.iter_mut().zip(&self.mesh).rev() {
            *c = rest % d;
            rest /= d;
        }
        let mut block = Block {
            offset: vec![0; shape.len()],
            shape: shape.to_vec(),
        };
        for ((p, &c), &n) in self.placements.iter().zip(&coords).zip(&self.mesh) {
            if let Placement::Shard(d) = *p {
                let part = chunk_ranges(block.shape[d] as usize, n)[c].clone();
                block.offset[d] += part.start as u64;
                block.shape[d] = part.len() as u64;
            }
        }
        Ok(block)
    }
}

/// One copy of a plan: from source mesh rank `src`'s local shard, block
/// `src_block` (in that shard's coordinates) to the destination's local
/// shard, block `dst_block` (same shape).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy {
    /// The source mesh rank.
    pub src: usize,
    /// Where in the source's shard.
    pub src_block: Block,
    /// Where in the destination's shard.
    pub dst_block: Block,
}

/// The plan for one named tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlan {
    /// Its name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its global shape.
    pub shape: Vec<u64>,
    /// How it lies over the source mesh.
    pub src: Sharding,
    /// How it must lie over the destination mesh.
    pub dst: Sharding,
    /// Per destination mesh rank, the copies that fill its shard.
    pub copies: Vec<Vec<Copy>>,
}

impl TensorPlan {
    /// The shape of source mesh rank `rank`'s shard.
    pub fn src_shape(&self, rank: usize) -> Result<Vec<u64>, Error> {
        Ok(self.src.block(&self.shape, rank)?.shape)
    }

    /// The shape of destination mesh rank `rank`'s shard.
    pub fn dst_shape(&self, rank: usize) -> Result<Vec<u64>, Error> {
        Ok(self.dst.block(&self.shape, rank)?.shape)
    }
}

/// Plans one tensor: every destination element is covered by exactly one
/// copy, from a source that holds it. Replicated sources are spread over
/// the destinations (destination `d` reads replica `d mod replicas`).
pub fn plan_tensor(
    name: &str,
    dtype: DType,
    shape: &[u64],
    src: &Sharding,
    dst: &Sharding,
) -> Result<TensorPlan, Error> {
    if shape.len() > MAX_DIMS {
        return Err(Error::Plan(format!(
            "{} dimensions, at most {MAX_DIMS}",
            shape.len()
        )));
    }
    shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(dtype.size_bytes() as u64)
                .is_some_and(|b| b <= regent_rdma::MAX_BUFFER_BYTES)
        })
        .ok_or_else(|| Error::Plan(format!("tensor {name} of shape {shape:?} is too large")))?;
    // Distinct source blocks (they partition the tensor), with their
    // replicas in rank order.
    let mut distinct: Vec<(Block, Vec<usize>)> = Vec::new();
    for r in 0..src.size() {
        let b = src.block(shape, r)?;
        match distinct.iter_mut().find(|(d, _)| *d == b) {
            Some((_, ranks)) => ranks.push(r),
            None => distinct.push((b, vec![r])),
        }
    }
    let mut copies = Vec::with_capacity(dst.size());
    for d in 0..dst.size() {
        let want = dst.block(shape, d)?;
        let mut mine = Vec::new();
        for (block, replicas) in &distinct {
            if want.numel() == 0 || block.numel() == 0 {
                continue;
            }
            if let Some(i) = want.intersect(block) {
                mine.push(Copy {
                    src: replicas[d % replicas.len()],
                    src_block: i.relative_to(block),
                    dst_block: i.relative_to(&want),
                });
            }
        }
        copies.push(mine);
    }
    Ok(TensorPlan {
        name: name.to_owned(),
        dtype,
        shape: shape.to_vec(),
        src: src.clone(),
        dst: dst.clone(),
        copies,
    })
}

/// A reshard of named tensors from one set of members to another (of the
/// same group; they may overlap): `src_ranks[i]` is the group rank of
/// source mesh rank `i`, `dst_ranks[j]` of destination mesh rank `j`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReshardPlan {
    /// One plan per tensor, in the order the executor takes the tensors.
    pub tensors: Vec<TensorPlan>,
    /// Group ranks of the source mesh.
    pub src_ranks: Vec<usize>,
    /// Group ranks of the destination mesh.
    pub dst_ranks: Vec<usize>,
}

impl ReshardPlan {
    /// A plan; every tensor's shardings must have `src_ranks.len()` and
    /// `dst_ranks.len()` ranks, and neither list may repeat a rank.
    pub fn new(
        tensors: Vec<TensorPlan>,
        src_ranks: Vec<usize>,
        dst_ranks: Vec<usize>,
    ) -> Result<Self, Error> {
        if tensors.len() > MAX_PLAN_TENSORS {
            return Err(Error::Plan(format!(
                "{} tensors, at most {MAX_PLAN_TENSORS}",
                tensors.len()
            )));
        }
        for list in [&src_ranks, &dst_ranks] {
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != list.len() {
                return Err(Error::Plan(format!("ranks {list:?} repeat")));
            }
        }
        for t in &tensors {
            if t.src.size() != src_ranks.len() || t.dst.size() != dst_ranks.len() {
                return Err(Error::Plan(format!(
                    "{}: shardings over {} and {} ranks, but {} sources and {} destinations",
                    t.name,
                    t.src.size(),
                    t.dst.size(),
                    src_ranks.len(),
                    dst_ranks.len()
                )));
            }
        }
        Ok(Self {
            tensors,
            src_ranks,
            dst_ranks,
        })
    }

    /// A digest of the plan, which members compare before they run it.
    pub fn digest(&self) -> u64 {
        // FNV-1a over the canonical encoding: stable across processes.
        let bytes = postcard::to_allocvec(self).expect("postcard encodes a plan");
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

/// The contiguous runs of a block copied between two row-major tensors:
/// `(src element offset, dst element offset, elements)`, in order. Inner
/// dimensions that both blocks span fully are merged into one run.
pub(crate) fn runs(
    block_src: &Block,
    src_shape: &[u64],
    block_dst: &Block,
    dst_shape: &[u64],
) -> impl Iterator<Item = (u64, u64, u64)> {
    let n = src_shape.len();
    let strides = |shape: &[u64]| {
        let mut s = vec![1u64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * shape[i + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    // The first dimension of the merged inner run: every later dimension
    // is spanned fully on both sides.
    let mut m = n.saturating_sub(1);
    while m > 0 && block_src.shape[m] == src_shape[m] && block_dst.shape[m] == dst_shape[m] {
        m -= 1;
    }
    let run = if n == 0 {
        1
    } else {
        block_src.shape[m..].iter().product()
    };
    let outer: Vec<u64> = block_src.shape[..m].to_vec();
    let count: u64 = if block_src.shape.contains(&0) {
        0
    } else {
        outer.iter().product()
    };
    let (bs, bd) = (block_src.offset.clone(), block_dst.offset.clone());
    (0..count).map(move |mut k| {
        let (mut so, mut dof) = (0u64, 0u64);
        for i in (0..m).rev() {
            let idx = k % outer[i];
            k /= outer[i];
            so += (bs[i] + idx) * ss[i];
            dof += (bd[i] + idx) * ds[i];
        }
        if n > 0 {
            so += bs[m] * ss[m];
            dof += bd[m] * ds[m];
        }
        (so, dof, run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_sharding(ndims: usize) -> impl Strategy<Value = Sharding> {
        let placement = prop_oneof![
            Just(Placement::Replicate),
            (0..ndims).prop_map(Placement::Shard),
        ];
        prop::collection::vec((1usize..4, placement), 1..3).prop_map(|v| {
            let (mesh, placements) = v.into_iter().unzip();
            Sharding::new(mesh, placements).unwrap()
        })
    }

    fn arb_case() -> impl Strategy<Value = (Vec<u64>, Sharding, Sharding)> {
        (1usize..4).prop_flat_map(|n| {
            (
                prop::collection::vec(0u64..9, n),
                arb_sharding(n),
                arb_sharding(n),
            )
        })
    }

    fn elements(shape: &[u64]) -> Vec<Vec<u64>> {
        let mut out = vec![vec![]];
        for &d in shape {
            out = out
                .into_iter()
                .flat_map(|p| {
                    (0..d).map(move |i| {
                        let mut q = p.clone();
                        q.push(i);
                        q
                    })
                })
                .collect();
        }
        out
    }

    fn contains(b: &Block, e: &[u64]) -> bool {
        e.iter()
            .enumerate()
            .all(|(d, &x)| x >= b.offset[d] && x < b.offset[d] + b.shape[d])
    }

    proptest! {
        /// Every element of every destination shard is covered by exactly
        /// one copy, from a source that holds that very element, and
        /// every block lies inside both shards.
        #[test]
        fn every_destination_element_is_covered_exactly_once((shape, src, dst) in arb_case()) {
            let plan = plan_tensor("t", DType::F32, &shape, &src, &dst).unwrap();
            for (d, copies) in plan.copies.iter().enumerate() {
                let want = dst.block(&shape, d).unwrap();
                for c in copies {
                    let have = src.block(&shape, c.src).unwrap();
                    prop_assert_eq!(&c.src_block.shape, &c.dst_block.shape);
                    for k in 0..shape.len() {
                        prop_assert!(c.src_block.offset[k] + c.src_block.shape[k] <= have.shape[k]);
                        prop_assert!(c.dst_block.offset[k] + c.dst_block.shape[k] <= want.shape[k]);
                        // The same global element on both sides.
                        prop_assert_eq!(have.offset[k] + c.src_block.offset[k], want.offset[k] + c.dst_block.offset[k]);
                    }
                }
                for e in elements(&want.shape) {
                    let n = copies.iter().filter(|c| contains(&c.dst_block, &e)).count();
                    prop_assert_eq!(n, 1, "element {:?} of destination {}", e, d);
                }
            }
        }

        /// The runs of a copy visit exactly the elements of its block, in
        /// both coordinate systems.
        #[test]
        fn runs_visit_exactly_the_block((shape, src, dst) in arb_case()) {
            let plan = plan_tensor("t", DType::F32, &shape, &src, &dst).unwrap();
            let flat = |e: &[u64], s: &[u64]| e.iter().zip(s).fold(0u64, |a, (&x, &n)| a * n + x);
            for (d, copies) in plan.copies.iter().enumerate() {
                let dshape = plan.dst_shape(d).unwrap();
                for c in copies {
                    let sshape = plan.src_shape(c.src).unwrap();
                    let mut got: Vec<(u64, u64)> = runs(&c.src_block, &sshape, &c.dst_block, &dshape)
                        .flat_map(|(s, t, n)| (0..n).map(move |i| (s + i, t + i)))
                        .collect();
                    let mut want: Vec<(u64, u64)> = elements(&c.src_block.shape)
                        .into_iter()
                        .map(|e| {
                            let se: Vec<u64> = e.iter().zip(&c.src_block.offset).map(|(a, b)| a + b).collect();
                            let de: Vec<u64> = e.iter().zip(&c.dst_block.offset).map(|(a, b)| a + b).collect();
                            (flat(&se, &sshape), flat(&de, &dshape))
                        })
                        .collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    prop_assert_eq!(got, want);
                }
            }
        }
    }

    #[test]
    fn rows_over_four_to_columns_over_two() {
        let plan = plan_tensor(
            "w",
            DType::F32,
            &[8, 6],
            &Sharding::split(4, 0).unwrap(),
            &Sharding::split(2, 1).unwrap(),
        )
        .unwrap();
        // Each reader pulls 2 rows x 3 columns from each of the 4 trainers.
        for (d, copies) in plan.copies.iter().enumerate() {
            assert_eq!(copies.len(), 4);
            for (s, c) in copies.iter().enumerate() {
                assert_eq!(c.src, s);
                assert_eq!(c.src_block.offset, vec![0, 3 * d as u64]);
                assert_eq!(c.dst_block.offset, vec![2 * s as u64, 0]);
                assert_eq!(c.src_block.shape, vec![2, 3]);
            }
        }
        // Replicated sources are spread over the readers.
        let plan = plan_tensor(
            "w",
            DType::F32,
            &[8, 6],
            &Sharding::replicated(3).unwrap(),
            &Sharding::split(2, 0).unwrap(),
        )
        .unwrap();
        assert_eq!(plan.copies[0][0].src, 0);
        assert_eq!(plan.copies[1][0].src, 1);
        assert!(Sharding::new(vec![2], vec![]).is_err());
        assert!(Sharding::new(vec![0], vec![Placement::Replicate]).is_err());
        assert!(
            plan_tensor(
                "w",
                DType::F32,
                &[8],
                &Sharding::split(2, 1).unwrap(),
                &Sharding::replicated(1).unwrap()
            )
            .is_err()
        );
        assert!(ReshardPlan::new(vec![plan.clone()], vec![0, 1], vec![2, 3]).is_err());
        assert!(ReshardPlan::new(vec![plan], vec![0, 1, 1], vec![2, 3]).is_err());
    }
}
