//! Evaluation: a selection bound to a shape becomes a [`Selected`] set of
//! members.
//!
//! Binding resolves names and checks indices. A box (`*` or a constraint
//! list) stays a list of per-dimension axes and costs nothing to hold; its
//! ranks are produced on demand, and testing membership or restricting to a
//! region costs O(region), not O(shape). Any other selection is evaluated
//! bottom-up into a bitset over the shape's points in row-major order:
//! O(nodes × N / 64) words of work plus O(|box|) per constraint list and
//! O(N) per `first`/`any`, with at most depth + 1 bitsets alive.

use super::{DimSpec, Selection, SelectionError};
use crate::shape::{Axis, DimName, Rank, Shape, for_each_run};

/// The members of a shape that a selection picks, for one seed
/// ([`Selection::bind`]).
#[derive(Debug, Clone)]
pub struct Selected {
    shape: Shape,
    /// Row-major strides of the shape's sizes: point index = Σ c[i] * s[i].
    point_strides: Vec<usize>,
    members: Members,
}

#[derive(Debug, Clone)]
enum Members {
    /// No member.
    Empty,
    /// The points of a box, one non-empty axis per dimension.
    Box(Vec<Axis>),
    /// The points whose row-major index is set.
    Bits(Bits),
}

impl Selection {
    /// Binds the selection to `shape`: checks it ([`Selection::validate`]),
    /// resolves its dimension names, checks its indices and ranges against
    /// the sizes, and evaluates it. `seed` decides the members `any` picks;
    /// the same selection, shape and seed always give the same members.
    pub fn bind(&self, shape: &Shape, seed: u64) -> Result<Selected, SelectionError> {
        self.validate()?;
        let node = Node::bind(self, shape)?;
        let point_strides = row_major_strides(shape.sizes());
        let members = match node {
            Node::All => Members::Box(full_axes(shape)),
            Node::None => Members::Empty,
            Node::Box(axes) if axes.iter().any(|a| a.count == 0) => Members::Empty,
            Node::Box(axes) => Members::Box(axes),
            node => {
                let context = Context {
                    sizes: shape.sizes(),
                    point_strides: &point_strides,
                    len: shape.len(),
                    seed,
                };
                Members::Bits(context.eval(&node))
            }
        };
        Ok(Selected {
            shape: shape.clone(),
            point_strides,
            members,
        })
    }

    /// The ranks of the members the selection picks in `shape`, sorted and
    /// without duplicates.
    pub fn eval(&self, shape: &Shape, seed: u64) -> Result<Vec<Rank>, SelectionError> {
        Ok(self.bind(shape, seed)?.ranks())
    }

    /// The ranks of the members the selection picks in `shape` that are
    /// also members of `region` (typically a slice of `shape`), sorted.
    /// Coordinates in the selection are those of `shape`, so this equals
    /// filtering [`Selection::eval`] by `region`, `first` and `any`
    /// included; for a box selection it costs O(|region|).
    pub fn eval_in(
        &self,
        shape: &Shape,
        region: &Shape,
        seed: u64,
    ) -> Result<Vec<Rank>, SelectionError> {
        Ok(self.bind(shape, seed)?.ranks_in(region))
    }
}

/// The row-major strides of a shape's sizes: point index = Σ c[i] × s[i].
/// A shape's sizes are checked (none zero, their product a `u32`), so no
/// product here overflows.
fn row_major_strides(sizes: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; sizes.len()];
    let mut stride = 1usize;
    for (s, &size) in strides.iter_mut().zip(sizes).rev() {
        *s = stride;
        stride *= size;
    }
    strides
}

impl Shape {
    /// The view holding exactly the members of a box selection (`*` or a
    /// constraint list like `hosts=0..2,gpus=0..8:2`); an index keeps its
    /// dimension, with size one. Other selections have no such view in
    /// general and are refused ([`SelectionError::NotABox`]), as is one that
    /// selects nothing ([`SelectionError::Empty`]).
    pub fn select(&self, selection: &Selection) -> Result<Shape, SelectionError> {
        selection.validate()?;
        let empty = || SelectionError::Empty {
            selection: selection.to_string(),
        };
        let axes = match Node::bind(selection, self)? {
            Node::All => return Ok(self.clone()),
            Node::Box(axes) => axes,
            Node::None => return Err(empty()),
            _ => {
                return Err(SelectionError::NotABox {
                    selection: selection.to_string(),
                });
            }
        };
        let mut view = self.clone();
        for (position, axis) in axes.into_iter().enumerate() {
            view = view.restrict(position, axis).ok_or_else(empty)?;
        }
        Ok(view)
    }
}

impl Selected {
    /// The shape the selection was bound to.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The number of members selected.
    pub fn len(&self) -> usize {
        match &self.members {
            Members::Empty => 0,
            Members::Box(axes) => axes.iter().map(|a| a.count).product(),
            Members::Bits(bits) => bits.count(),
        }
    }

    /// Whether no member is selected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the member of rank `rank` is selected (false for a rank
    /// outside the shape).
    pub fn contains(&self, rank: Rank) -> bool {
        match self.shape.layout().coords_of(rank) {
            Some(coords) => self.contains_coords(&coords),
            None => false,
        }
    }

    /// Whether the point with these (valid) coordinates is selected.
    fn contains_coords(&self, coords: &[usize]) -> bool {
        match &self.members {
            Members::Empty => false,
            Members::Box(axes) => axes.iter().zip(coords).all(|(a, &c)| a.contains(c)),
            Members::Bits(bits) => {
                let index = coords
                    .iter()
                    .zip(&self.point_strides)
                    .map(|(&c, &s)| c * s)
                    .sum();
                bits.get(index)
            }
        }
    }

    /// The ranks of the selected members, sorted.
    pub fn ranks(&self) -> Vec<Rank> {
        let layout = self.shape.layout();
        let mut ranks: Vec<Rank> = match &self.members {
            Members::Empty => Vec::new(),
            Members::Box(axes) => {
                let mut ranks = Vec::with_capacity(self.len());
                for_each_run(
                    layout.offset(),
                    layout.strides(),
                    axes,
                    |first, delta, count| {
                        // Lossless: the box's ranks are ranks of the shape, which
                        // fit a u32.
                        ranks.extend((0..count as u64).map(|k| Rank((first + k * delta) as u32)));
                    },
                );
                ranks
            }
            Members::Bits(bits) => {
                let mut ranks = Vec::with_capacity(bits.count());
                let context = Context {
                    sizes: layout.sizes(),
                    point_strides: &self.point_strides,
                    len: self.shape.len(),
                    seed: 0,
                };
                context.for_each_set(bits, layout.offset(), layout.strides(), |_, rank| {
                    // Lossless: a point of the shape has a rank that fits a
                    // u32.
                    ranks.push(Rank(rank as u32));
                });
                ranks
            }
        };
        // Row-major order is rank order for every layout but a transposed
        // one; distinct points have distinct ranks, so no duplicates.
        if !layout.is_rank_ordered() {
            ranks.sort_unstable();
        }
        ranks
    }

    /// The ranks of the selected members that are also members of
    /// `region`, sorted: the selection restricted to a sub-view, as a cast
    /// tree's forwarder needs it. Costs O(|region| × dimensions); a rank of
    /// `region` outside the shape is simply not selected.
    pub fn ranks_in(&self, region: &Shape) -> Vec<Rank> {
        if matches!(self.members, Members::Empty) {
            return Vec::new();
        }
        let mut ranks: Vec<Rank> = region.ranks().filter(|&r| self.contains(r)).collect();
        if !region.layout().is_rank_ordered() {
            ranks.sort_unstable();
        }
        ranks
    }
}

/// A selection resolved against a shape: names are positions, indices and
/// ranges are axes (checked against the sizes).
#[derive(Debug)]
enum Node {
    All,
    None,
    /// One axis per dimension of the shape.
    Box(Vec<Axis>),
    First {
        /// Per dimension: whether it is in the scope.
        scope: Vec<bool>,
        of: Box<Node>,
    },
    Any {
        scope: Vec<bool>,
        of: Box<Node>,
    },
    Union(Vec<Node>),
    Intersection(Vec<Node>),
}

impl Node {
    /// Resolves a validated selection (so its depth is bounded).
    fn bind(selection: &Selection, shape: &Shape) -> Result<Node, SelectionError> {
        Ok(match selection {
            Selection::All => Node::All,
            Selection::None => Node::None,
            Selection::Dims(constraints) => {
                let mut axes = full_axes(shape);
                for constraint in constraints {
                    let position = shape.position(constraint.dim.as_str())?;
                    let size = shape.sizes()[position];
                    axes[position] = match constraint.spec {
                        DimSpec::All => Axis::full(size),
                        DimSpec::Index(index) if index < size => Axis {
                            start: index,
                            step: 1,
                            count: 1,
                        },
                        DimSpec::Index(index) => {
                            return Err(crate::shape::ShapeError::IndexOutOfRange {
                                dim: constraint.dim.to_string(),
                                index,
                                size,
                            }
                            .into());
                        }
                        DimSpec::Range(range) => range.resolve(&constraint.dim, size)?,
                    };
                }
                Node::Box(axes)
            }
            Selection::First { dims, of } => Node::First {
                scope: scope(dims, shape)?,
                of: Box::new(Node::bind(of, shape)?),
            },
            Selection::Any { dims, of } => Node::Any {
                scope: scope(dims, shape)?,
                of: Box::new(Node::bind(of, shape)?),
            },
            Selection::Union(operands) => Node::Union(
                operands
                    .iter()
                    .map(|s| Node::bind(s, shape))
                    .collect::<Result<_, _>>()?,
            ),
            Selection::Intersection(operands) => Node::Intersection(
                operands
                    .iter()
                    .map(|s| Node::bind(s, shape))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }
}

/// The axes of every point of `shape`.
fn full_axes(shape: &Shape) -> Vec<Axis> {
    shape.sizes().iter().map(|&s| Axis::full(s)).collect()
}

/// Which dimensions of `shape` a `first`/`any` scope covers (all, when the
/// scope is empty).
fn scope(dims: &[DimName], shape: &Shape) -> Result<Vec<bool>, SelectionError> {
    if dims.is_empty() {
        return Ok(vec![true; shape.ndim()]);
    }
    let mut scope = vec![false; shape.ndim()];
    for dim in dims {
        scope[shape.position(dim.as_str())?] = true;
    }
    Ok(scope)
}

/// The hash `any` minimizes: splitmix64 of `seed + (index + 1) * γ`. For a
/// fixed seed it is a bijection of the point index, so there are no ties.
/// Part of the documented semantics (`docs/semantics.md` §3): do not change it, or
/// procs of different versions would pick different members.
pub(crate) fn any_key(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What bottom-up evaluation needs of the shape.
struct Context<'a> {
    sizes: &'a [usize],
    point_strides: &'a [usize],
    len: usize,
    seed: u64,
}

impl Context<'_> {
    fn eval(&self, node: &Node) -> Bits {
        match node {
            Node::All => Bits::full(self.len),
            Node::None => Bits::empty(self.len),
            Node::Box(axes) => {
                let mut bits = Bits::empty(self.len);
                // Point indices are the ranks of the row-major layout.
                for_each_run(0, self.point_strides, axes, |first, delta, count| {
                    let first = first as usize;
                    if delta == 1 {
                        bits.set_range(first, first + count);
                    } else {
                        for k in 0..count {
                            bits.set(first + k * delta as usize);
                        }
                    }
                });
                bits
            }
            Node::Union(operands) => {
                let mut operands = operands.iter();
                let mut bits = operands
                    .next()
                    .map_or_else(|| Bits::empty(self.len), |n| self.eval(n));
                for operand in operands {
                    bits.or_assign(&self.eval(operand));
                }
                bits
            }
            Node::Intersection(operands) => {
                let mut operands = operands.iter();
                let mut bits = operands
                    .next()
                    .map_or_else(|| Bits::full(self.len), |n| self.eval(n));
                for operand in operands {
                    if bits.count() == 0 {
                        break;
                    }
                    bits.and_assign(&self.eval(operand));
                }
                bits
            }
            Node::First { scope, of } => {
                let of = self.eval(of);
                let groups = Groups::new(self.sizes, scope);
                if groups.count == 1 {
                    let mut bits = Bits::empty(self.len);
                    if let Some(index) = of.ones().next() {
                        bits.set(index);
                    }
                    return bits;
                }
                let mut seen = Bits::empty(groups.count);
                let mut bits = Bits::empty(self.len);
                // Increasing point index is row-major order, also within a
                // group.
                self.for_each_set(&of, 0, &groups.strides, |index, group| {
                    let group = group as usize;
                    if !seen.get(group) {
                        seen.set(group);
                        bits.set(index);
                    }
                });
                bits
            }
            Node::Any { scope, of } => {
                let of = self.eval(of);
                let groups = Groups::new(self.sizes, scope);
                let mut best: Vec<Option<(u64, usize)>> = vec![None; groups.count];
                self.for_each_set(&of, 0, &groups.strides, |index, group| {
                    let key = any_key(self.seed, index as u64);
                    let slot = &mut best[group as usize];
                    if slot.is_none_or(|(best_key, _)| key < best_key) {
                        *slot = Some((key, index));
                    }
                });
                let mut bits = Bits::empty(self.len);
                for (_, index) in best.into_iter().flatten() {
                    bits.set(index);
                }
                bits
            }
        }
    }

    /// Calls `f(index, value)` for each set index of `bits`, increasing,
    /// where `value = offset + Σ coord[i] * strides[i]` for the point of that
    /// row-major index (its rank, for a layout's strides; its group, for a
    /// scope's). A sparse set decodes each index; a dense one walks all
    /// points in step with the runs of values, which avoids divisions.
    fn for_each_set(
        &self,
        bits: &Bits,
        offset: usize,
        strides: &[usize],
        mut f: impl FnMut(usize, u64),
    ) {
        let set = bits.count();
        if set.saturating_mul(8 * (self.sizes.len() + 1)) < self.len {
            for index in bits.ones() {
                let mut value = offset as u64;
                let dims = self.sizes.iter().zip(self.point_strides).zip(strides);
                for ((&size, &point_stride), &stride) in dims {
                    let coord = (index / point_stride) % size;
                    // A size-one dimension's stride may be anything: skip it.
                    if coord > 0 {
                        value += (coord * stride) as u64;
                    }
                }
                f(index, value);
            }
        } else {
            let axes: Vec<Axis> = self.sizes.iter().map(|&n| Axis::full(n)).collect();
            // Runs of values cover consecutive point indices.
            let mut start = 0;
            for_each_run(offset, strides, &axes, |first, delta, count| {
                for index in bits.ones_in(start, start + count) {
                    f(index, first + (index - start) as u64 * delta);
                }
                start += count;
            });
        }
    }
}

/// The groups of a `first`/`any` scope: points that agree on every
/// dimension outside the scope, numbered row-major over those dimensions.
struct Groups {
    /// Per dimension: its stride in the group number, zero inside the scope.
    strides: Vec<usize>,
    count: usize,
}

impl Groups {
    fn new(sizes: &[usize], scope: &[bool]) -> Groups {
        let mut strides = vec![0; scope.len()];
        let mut count = 1;
        for i in (0..scope.len()).rev() {
            if !scope[i] {
                strides[i] = count;
                count *= sizes[i];
            }
        }
        Groups { strides, count }
    }
}

/// A fixed-size set of point indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bits {
    words: Vec<u64>,
    len: usize,
}

impl Bits {
    pub(crate) fn empty(len: usize) -> Bits {
        Bits {
            words: vec![0; len.div_ceil(64)],
            len,
        }
    }

    pub(crate) fn full(len: usize) -> Bits {
        let mut bits = Bits {
            words: vec![u64::MAX; len.div_ceil(64)],
            len,
        };
        if !len.is_multiple_of(64)
            && let Some(last) = bits.words.last_mut()
        {
            *last = (1 << (len % 64)) - 1;
        }
        bits
    }

    pub(crate) fn set(&mut self, index: usize) {
        debug_assert!(
            index < self.len,
            "bit {index} outside a set of {}",
            self.len
        );
        self.words[index / 64] |= 1 << (index % 64);
    }

    /// Sets the indices `start..end`.
    pub(crate) fn set_range(&mut self, start: usize, end: usize) {
        debug_assert!(
            start <= end && end <= self.len,
            "bits {start}..{end} outside a set of {}",
            self.len
        );
        let mut index = start;
        while index < end {
            let word = index / 64;
            let bit = index % 64;
            let span = (64 - bit).min(end - index);
            let mask = if span == 64 {
                u64::MAX
            } else {
                ((1 << span) - 1) << bit
            };
            self.words[word] |= mask;
            index += span;
        }
    }

    pub(crate) fn get(&self, index: usize) -> bool {
        index < self.len && self.words[index / 64] & (1 << (index % 64)) != 0
    }

    pub(crate) fn or_assign(&mut self, other: &Bits) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    pub(crate) fn and_assign(&mut self, other: &Bits) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= b;
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The set indices, increasing.
    pub(crate) fn ones(&self) -> impl Iterator<Item = usize> + '_ {
        self.ones_in(0, self.len)
    }

    /// The set indices in `start..end`, increasing.
    pub(crate) fn ones_in(&self, start: usize, end: usize) -> impl Iterator<Item = usize> + '_ {
        let end = end.min(self.len);
        let words = if start < end {
            start / 64..end.div_ceil(64)
        } else {
            0..0
        };
        words.flat_map(move |i| {
            let mut word = self.words[i];
            if i == start / 64 {
                word &= u64::MAX << (start % 64);
            }
            if i == (end - 1) / 64 && !end.is_multiple_of(64) {
                word &= (1 << (end % 64)) - 1;
            }
            std::iter::from_fn(move || {
                (word != 0).then(|| {
                    let bit = word.trailing_zeros() as usize;
                    word &= word - 1;
                    i * 64 + bit
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::shape::{MAX_DIMS, Slice};

    proptest! {
        /// The strides a bind computes are the row-major slice's.
        #[test]
        fn bound_strides_are_the_row_major_slices(
            sizes in proptest::collection::vec(1usize..12, 1..=MAX_DIMS)
                .prop_filter("a shape's size", |s| {
                    s.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                        .is_some_and(|n| n <= u64::from(u32::MAX))
                })
        ) {
            let slice = Slice::row_major(sizes.clone()).unwrap();
            prop_assert_eq!(super::row_major_strides(&sizes), slice.strides().to_vec());
        }
    }
}
