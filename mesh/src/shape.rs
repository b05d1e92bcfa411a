//! Shapes: named dimensions laid over a strided slice of a flat rank space.
//!
//! A mesh of N members has a [`Shape`]: an ordered list of named dimensions
//! (`{hosts=4, gpus=8}`), and a [`Slice`] that maps each point (one coordinate
//! per dimension) to a [`Rank`] in the flat space of the mesh's members:
//!
//! ```text
//! rank = offset + Σ coord[i] * stride[i]
//! ```
//!
//! Points are ordered row-major (the last dimension varies fastest). Slicing
//! ([`Shape::slice`], [`Shape::slice_step`], [`Shape::at`]) makes a new view
//! over a subset of the same ranks without touching any member: that is how a
//! mesh hands out cheap sub-mesh references.
//!
//! Everything here is bounded and checked: at most [`MAX_DIMS`] dimensions,
//! at most [`MAX_LEN`] members, every rank fits a `u32`, and all arithmetic is
//! overflow-checked at construction, so that the per-point arithmetic of a
//! valid shape cannot overflow. A shape decoded with serde is validated like
//! one built by hand.
//!
//! ```
//! use regent_mesh::shape::{Rank, Shape};
//!
//! let shape = Shape::new([("hosts", 4), ("gpus", 8)])?;
//! assert_eq!(shape.to_string(), "{hosts=4, gpus=8}");
//! assert_eq!(shape.len(), 32);
//!
//! let two_hosts = shape.slice("hosts", 2..4)?.slice_step("gpus", .., 2)?;
//! assert_eq!(two_hosts.to_string(), "{hosts=2, gpus=4}");
//! let point = two_hosts.point(&[1, 3])?;
//! assert_eq!(point.to_string(), "{hosts=1, gpus=3}");
//! assert_eq!(two_hosts.rank_of(&point)?, Rank(3 * 8 + 6));
//! assert_eq!(two_hosts.point_of(Rank(30)), Some(point));
//! # Ok::<(), regent_mesh::shape::ShapeError>(())
//! ```

use std::fmt;
use std::num::NonZeroUsize;
use std::ops::{Bound, RangeBounds};
use std::str::FromStr;
use std::sync::Arc;

use regent_net::memo::{self, Memo};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The most dimensions a shape may have.
pub const MAX_DIMS: usize = 16;
/// The most members a shape may have (every point index fits a `u32`).
pub const MAX_LEN: usize = u32::MAX as usize;
/// The longest dimension name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Words of the selection syntax that cannot name a dimension.
pub const RESERVED_NAMES: [&str; 4] = ["all", "any", "first", "none"];

/// Why a shape, a slice, a point or a range was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A dimension name is empty, too long, not an identifier, or reserved.
    #[error("invalid dimension name {name:?}: {reason}")]
    InvalidName {
        /// The refused name (cut to [`MAX_NAME_BYTES`] plus a few bytes).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two dimensions of one shape share a name.
    #[error("dimension {dim} appears twice")]
    DuplicateDim {
        /// The repeated name.
        dim: DimName,
    },
    /// The shape has no dimension of this name.
    #[error("no dimension {dim:?} in shape {shape}")]
    UnknownDim {
        /// The name asked for.
        dim: String,
        /// The shape, as it prints.
        shape: String,
    },
    /// More dimensions than [`MAX_DIMS`].
    #[error("{dims} dimensions, more than the {max} allowed")]
    TooManyDims {
        /// How many were given.
        dims: usize,
        /// The limit.
        max: usize,
    },
    /// Two lists that must be as long as each other are not (names and
    /// sizes, sizes and strides, a point's coordinates and the dimensions).
    #[error("expected {expected} {what}, found {found}")]
    Arity {
        /// What was counted.
        what: &'static str,
        /// How many the shape needs.
        expected: usize,
        /// How many were given.
        found: usize,
    },
    /// A dimension has size zero (a shape is never empty).
    #[error("dimension #{position} has size 0")]
    ZeroSize {
        /// The position of the dimension.
        position: usize,
    },
    /// The number of members, or the largest rank, exceeds its limit (or the
    /// arithmetic to compute it overflowed).
    #[error("the {what} exceeds the limit of {max}")]
    TooLarge {
        /// What is too large ("number of members", "largest rank").
        what: &'static str,
        /// The limit.
        max: u64,
    },
    /// The strides do not nest, so two points could share a rank or a rank
    /// could not be mapped back to its point. Ordered by decreasing stride,
    /// each stride (of a dimension of size above one) must exceed the span
    /// `Σ (size - 1) * stride` of all the dimensions after it.
    #[error("stride of dimension #{position} does not exceed the span of the smaller strides")]
    Overlap {
        /// The position of the offending dimension.
        position: usize,
    },
    /// A coordinate is outside its dimension.
    #[error("index {index} is outside dimension {dim} of size {size}")]
    IndexOutOfRange {
        /// The dimension, by name (or `#position` for a bare [`Slice`]).
        dim: String,
        /// The index given.
        index: usize,
        /// The size of the dimension.
        size: usize,
    },
    /// A range bound lies beyond its dimension.
    #[error("range {range} exceeds dimension {dim} of size {size}")]
    RangeOutOfRange {
        /// The dimension.
        dim: DimName,
        /// The range given.
        range: DimRange,
        /// The size of the dimension.
        size: usize,
    },
    /// Slicing would leave a dimension with no coordinate.
    #[error("slicing dimension {dim} with {range} selects nothing")]
    EmptySlice {
        /// The dimension.
        dim: DimName,
        /// The range given.
        range: DimRange,
    },
    /// A range has step zero.
    #[error("a range step must be at least 1")]
    ZeroStep,
    /// A range starts after it ends.
    #[error("range start {start} is after its end {end}")]
    ReversedRange {
        /// The start.
        start: usize,
        /// The end.
        end: usize,
    },
    /// A point was made by a shape with other dimensions.
    #[error("point {point} does not belong to shape {shape}")]
    PointMismatch {
        /// The point, as it prints.
        point: String,
        /// The shape, as it prints.
        shape: String,
    },
}

/// The position of a member in the flat rank space of a mesh (the index of
/// an actor in its mesh, like `ActorId::index` in `regent-net`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index into a `Vec` of members.
    pub fn index(self) -> usize {
        // Lossless: `usize` is at least 32 bits on every target this crate
        // builds for (see the compile-time check at the bottom of this file).
        self.0 as usize
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<u32> for Rank {
    fn from(rank: u32) -> Self {
        Rank(rank)
    }
}

impl From<Rank> for u32 {
    fn from(rank: Rank) -> Self {
        rank.0
    }
}

/// The name of a dimension: an identifier (`[A-Za-z_][A-Za-z0-9_]*`) of at
/// most [`MAX_NAME_BYTES`] bytes that is not one of [`RESERVED_NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DimName(Arc<str>);

impl DimName {
    /// Checks and makes a name.
    pub fn new(name: &str) -> Result<Self, ShapeError> {
        let refuse = |reason| ShapeError::InvalidName {
            name: truncate(name, MAX_NAME_BYTES + 8).to_owned(),
            reason,
        };
        let mut chars = name.chars();
        match chars.next() {
            None => return Err(refuse("empty")),
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
            Some(_) => return Err(refuse("must start with a letter or '_'")),
        }
        if name.len() > MAX_NAME_BYTES {
            return Err(refuse("longer than 64 bytes"));
        }
        if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(refuse("may hold only ASCII letters, digits and '_'"));
        }
        if RESERVED_NAMES.contains(&name) {
            return Err(refuse("reserved by the selection syntax"));
        }
        Ok(DimName(Arc::from(name)))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character
/// boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl fmt::Display for DimName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for DimName {
    type Err = ShapeError;
    fn from_str(s: &str) -> Result<Self, ShapeError> {
        DimName::new(s)
    }
}

impl AsRef<str> for DimName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for DimName {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for DimName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl Serialize for DimName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DimName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        thread_local! {
            static DECODED: Memo<DimName> = const { Memo::new() };
        }
        memo::decode_str(deserializer, &DECODED, |n: &DimName| &n.0, DimName::new)
    }
}

/// A range of coordinates along one dimension: `start`, `start + step`, ...
/// up to but excluding `end` (or the end of the dimension when `end` is
/// open). Prints as `start..end:step`, leaving out an open end and a step of
/// one (`0..4`, `2..`, `0..8:2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DimRange {
    start: usize,
    end: Option<usize>,
    step: NonZeroUsize,
}

impl DimRange {
    /// The whole dimension, `0..`.
    pub const FULL: DimRange = DimRange {
        start: 0,
        end: None,
        step: NonZeroUsize::MIN,
    };

    /// Checks and makes a range: `step` is at least one and `start` is not
    /// after `end`.
    pub fn new(start: usize, end: Option<usize>, step: usize) -> Result<Self, ShapeError> {
        let step = NonZeroUsize::new(step).ok_or(ShapeError::ZeroStep)?;
        if let Some(end) = end
            && start > end
        {
            return Err(ShapeError::ReversedRange { start, end });
        }
        Ok(DimRange { start, end, step })
    }

    /// Makes a range from Rust range syntax (`2..4`, `1..=3`, `2..`, `..`)
    /// and a step.
    pub fn from_bounds(range: impl RangeBounds<usize>, step: usize) -> Result<Self, ShapeError> {
        let overflow = ShapeError::TooLarge {
            what: "range bound",
            max: usize::MAX as u64,
        };
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.checked_add(1).ok_or(overflow.clone())?,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => Some(e.checked_add(1).ok_or(overflow)?),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => None,
        };
        DimRange::new(start, end, step)
    }

    /// The first coordinate.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The exclusive end, or `None` for the end of the dimension.
    pub fn end(&self) -> Option<usize> {
        self.end
    }

    /// The distance between coordinates (at least one).
    pub fn step(&self) -> usize {
        self.step.get()
    }

    /// Whether `coord` is in the range, within a dimension of size `size`.
    pub fn contains(&self, coord: usize, size: usize) -> bool {
        let end = self.end.unwrap_or(size).min(size);
        coord >= self.start && coord < end && (coord - self.start).is_multiple_of(self.step())
    }

    /// The coordinates this range picks in dimension `dim` of size `size`:
    /// both bounds must lie within the dimension (`start <= size`,
    /// `end <= size`); the result may be empty.
    pub(crate) fn resolve(&self, dim: &DimName, size: usize) -> Result<Axis, ShapeError> {
        let end = self.end.unwrap_or(size);
        if self.start > size || end > size {
            return Err(ShapeError::RangeOutOfRange {
                dim: dim.clone(),
                range: *self,
                size,
            });
        }
        // `start <= end` holds by construction, and when `end` is open,
        // `start <= size == end` was just checked.
        let count = (end - self.start).div_ceil(self.step());
        Ok(Axis {
            start: self.start,
            step: self.step(),
            count,
        })
    }
}

impl fmt::Display for DimRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..", self.start)?;
        if let Some(end) = self.end {
            write!(f, "{end}")?;
        }
        if self.step() != 1 {
            write!(f, ":{}", self.step)?;
        }
        Ok(())
    }
}

/// The coordinates `start + k * step` for `k < count` along one dimension:
/// a range resolved against a dimension's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Axis {
    pub(crate) start: usize,
    pub(crate) step: usize,
    pub(crate) count: usize,
}

impl Axis {
    /// The whole of a dimension of size `size`.
    pub(crate) fn full(size: usize) -> Axis {
        Axis {
            start: 0,
            step: 1,
            count: size,
        }
    }

    /// Whether `coord` is one of the axis's coordinates.
    pub(crate) fn contains(&self, coord: usize) -> bool {
        coord >= self.start
            && (coord - self.start).is_multiple_of(self.step)
            && (coord - self.start) / self.step < self.count
    }
}

/// A strided view of a flat rank space: an offset, and a size and a stride
/// per dimension. Point `c` has rank `offset + Σ c[i] * strides[i]`.
///
/// Invariants (checked by [`Slice::new`] and on deserialization): as many
/// strides as sizes, at most [`MAX_DIMS`] dimensions, every size positive,
/// at most [`MAX_LEN`] points, every rank fits a `u32`, and the strides of
/// the dimensions of size above one nest (see [`ShapeError::Overlap`]), so
/// distinct points have distinct ranks and [`Slice::coords_of`] is exact.
/// Every row-major layout and every slice of one satisfies them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Slice {
    offset: usize,
    sizes: Vec<usize>,
    strides: Vec<usize>,
}

impl Slice {
    /// Checks and makes a slice.
    pub fn new(offset: usize, sizes: Vec<usize>, strides: Vec<usize>) -> Result<Self, ShapeError> {
        if sizes.len() > MAX_DIMS {
            return Err(ShapeError::TooManyDims {
                dims: sizes.len(),
                max: MAX_DIMS,
            });
        }
        if strides.len() != sizes.len() {
            return Err(ShapeError::Arity {
                what: "strides",
                expected: sizes.len(),
                found: strides.len(),
            });
        }
        let mut len: u64 = 1;
        for (position, &size) in sizes.iter().enumerate() {
            if size == 0 {
                return Err(ShapeError::ZeroSize { position });
            }
            len = len
                .checked_mul(size as u64)
                .filter(|&len| len <= MAX_LEN as u64)
                .ok_or(ShapeError::TooLarge {
                    what: "number of members",
                    max: MAX_LEN as u64,
                })?;
        }
        // Dimensions of size above one, by decreasing stride: each stride
        // must exceed the span of those after it. This also bounds the
        // largest rank, computed on the way.
        let too_large = ShapeError::TooLarge {
            what: "largest rank",
            max: u64::from(u32::MAX),
        };
        // On the stack: every bind and every decoded frame checks a slice.
        let mut order = [0usize; MAX_DIMS];
        let mut count = 0;
        for i in (0..sizes.len()).filter(|&i| sizes[i] > 1) {
            order[count] = i;
            count += 1;
        }
        let order = &mut order[..count];
        order.sort_by_key(|&i| std::cmp::Reverse(strides[i]));
        let mut span: u64 = 0;
        for &i in order.iter().rev() {
            let stride = strides[i] as u64;
            if stride <= span {
                return Err(ShapeError::Overlap { position: i });
            }
            span = (sizes[i] as u64 - 1)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(span))
                .filter(|&s| s <= u64::from(u32::MAX))
                .ok_or(too_large.clone())?;
        }
        (offset as u64)
            .checked_add(span)
            .filter(|&max| max <= u64::from(u32::MAX))
            .ok_or(too_large)?;
        Ok(Slice {
            offset,
            sizes,
            strides,
        })
    }

    /// The contiguous row-major slice of the given sizes at offset zero.
    pub fn row_major(sizes: Vec<usize>) -> Result<Self, ShapeError> {
        let mut strides = vec![0; sizes.len()];
        let mut stride: usize = 1;
        for (i, &size) in sizes.iter().enumerate().rev() {
            strides[i] = stride;
            // Saturating is enough: a product past the limits is refused by
            // `new`, which recomputes it with checks.
            stride = stride.saturating_mul(size);
        }
        Slice::new(0, sizes, strides)
    }

    /// The largest rank of the slice (checked at construction to fit `u32`).
    pub fn max_rank(&self) -> usize {
        self.sizes
            .iter()
            .zip(&self.strides)
            .map(|(&size, &stride)| (size - 1) * stride)
            .sum::<usize>()
            + self.offset
    }

    /// The rank of the all-zero point.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The size of each dimension.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The stride of each dimension.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.sizes.len()
    }

    /// The number of points (at least one).
    #[expect(
        clippy::len_without_is_empty,
        reason = "a slice always has at least one point"
    )]
    pub fn len(&self) -> usize {
        self.sizes.iter().product()
    }

    /// The rank of the point with these coordinates.
    pub fn rank_at(&self, coords: &[usize]) -> Result<Rank, ShapeError> {
        self.check_coords(coords, |position| format!("#{position}"))?;
        Ok(self.rank_unchecked(coords))
    }

    /// Checks the count and range of `coords`, naming dimensions with `name`.
    fn check_coords(
        &self,
        coords: &[usize],
        name: impl Fn(usize) -> String,
    ) -> Result<(), ShapeError> {
        if coords.len() != self.ndim() {
            return Err(ShapeError::Arity {
                what: "coordinates",
                expected: self.ndim(),
                found: coords.len(),
            });
        }
        for (position, (&index, &size)) in coords.iter().zip(&self.sizes).enumerate() {
            if index >= size {
                return Err(ShapeError::IndexOutOfRange {
                    dim: name(position),
                    index,
                    size,
                });
            }
        }
        Ok(())
    }

    /// The rank of checked coordinates.
    pub(crate) fn rank_unchecked(&self, coords: &[usize]) -> Rank {
        let rank = coords
            .iter()
            .zip(&self.strides)
            .fold(self.offset as u64, |rank, (&c, &s)| {
                if c == 0 {
                    rank
                } else {
                    rank + c as u64 * s as u64
                }
            });
        // Lossless: with coordinates inside the sizes the rank is at most
        // the largest rank, which `new` checked fits a u32. (A size-one
        // dimension's stride, which may be anything, only meets coordinate
        // zero and is skipped above.)
        Rank(rank as u32)
    }

    /// The coordinates of `rank`, or `None` when no point of the slice has it.
    pub fn coords_of(&self, rank: Rank) -> Option<Vec<usize>> {
        let mut rest = (rank.0 as u64).checked_sub(self.offset as u64)?;
        let mut coords = vec![0; self.ndim()];
        let mut order: Vec<usize> = (0..self.ndim()).filter(|&i| self.sizes[i] > 1).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.strides[i]));
        for i in order {
            // Strides of dimensions of size above one are positive (they
            // exceed a span of at least zero).
            let stride = self.strides[i] as u64;
            let c = rest / stride;
            if c >= self.sizes[i] as u64 {
                return None;
            }
            coords[i] = c as usize;
            rest -= c * stride;
        }
        (rest == 0).then_some(coords)
    }

    /// Whether some point of the slice has `rank`.
    pub fn contains(&self, rank: Rank) -> bool {
        self.coords_of(rank).is_some()
    }

    /// The ranks of all points in row-major point order (not necessarily
    /// increasing: a transposed layout has other strides).
    pub fn ranks(&self) -> Ranks<'_> {
        Ranks::new(self, self.sizes.iter().map(|&s| Axis::full(s)).collect())
    }

    /// Whether row-major point order is increasing rank order: the
    /// dimensions of size above one have decreasing strides.
    pub(crate) fn is_rank_ordered(&self) -> bool {
        let mut previous = usize::MAX;
        for (&size, &stride) in self.sizes.iter().zip(&self.strides) {
            if size > 1 {
                if stride >= previous {
                    return false;
                }
                previous = stride;
            }
        }
        true
    }

    /// The slice with dimension `position` restricted to `axis` (non-empty,
    /// inside the dimension).
    fn restrict(&self, position: usize, axis: Axis) -> Slice {
        debug_assert!(
            axis.count > 0 && axis.start + (axis.count - 1) * axis.step < self.sizes[position]
        );
        let mut slice = self.clone();
        let stride = self.strides[position];
        slice.offset = self.offset + axis.start * stride;
        slice.sizes[position] = axis.count;
        if axis.count > 1 {
            // At most the old span of this dimension, so no overflow: the
            // new strides still nest.
            slice.strides[position] = stride * axis.step;
        }
        slice
    }

    /// The slice with dimension `position` fixed at `index` and removed.
    fn fix(&self, position: usize, index: usize) -> Slice {
        let mut slice = self.clone();
        slice.offset = self.offset + index * self.strides[position];
        slice.sizes.remove(position);
        slice.strides.remove(position);
        slice
    }
}

#[derive(Deserialize)]
struct SliceParts {
    offset: usize,
    sizes: Vec<usize>,
    strides: Vec<usize>,
}

impl<'de> Deserialize<'de> for Slice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let parts = SliceParts::deserialize(deserializer)?;
        Slice::new(parts.offset, parts.sizes, parts.strides).map_err(D::Error::custom)
    }
}

/// The shape of a mesh: named dimensions over a [`Slice`]. Prints as
/// `{hosts=4, gpus=8}` (sizes only; offsets and strides show in `Debug`).
///
/// A shape is cheap to clone (names and slice are shared: every cast
/// carries its view, and a node clones it for each child) and never empty.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    names: Arc<[DimName]>,
    slice: Arc<Slice>,
}

impl Shape {
    /// A contiguous row-major shape at offset zero, e.g.
    /// `Shape::new([("hosts", 4), ("gpus", 8)])`.
    pub fn new<N: AsRef<str>>(
        dims: impl IntoIterator<Item = (N, usize)>,
    ) -> Result<Self, ShapeError> {
        let mut names = Vec::new();
        let mut sizes = Vec::new();
        for (name, size) in dims {
            if names.len() == MAX_DIMS {
                return Err(ShapeError::TooManyDims {
                    dims: MAX_DIMS + 1,
                    max: MAX_DIMS,
                });
            }
            names.push(DimName::new(name.as_ref())?);
            sizes.push(size);
        }
        Shape::from_parts(names, Slice::row_major(sizes)?)
    }

    /// A shape of the given names over any valid slice.
    pub fn from_parts(names: Vec<DimName>, slice: Slice) -> Result<Self, ShapeError> {
        if names.len() != slice.ndim() {
            return Err(ShapeError::Arity {
                what: "dimension names",
                expected: slice.ndim(),
                found: names.len(),
            });
        }
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(ShapeError::DuplicateDim { dim: name.clone() });
            }
        }
        Ok(Shape {
            names: names.into(),
            slice: Arc::new(slice),
        })
    }

    /// The dimension names, in order.
    pub fn names(&self) -> &[DimName] {
        &self.names
    }

    /// The dimension sizes, in order.
    pub fn sizes(&self) -> &[usize] {
        self.slice.sizes()
    }

    /// Each dimension's name and size, in order.
    pub fn dims(&self) -> impl ExactSizeIterator<Item = (&DimName, usize)> + '_ {
        self.names.iter().zip(self.slice.sizes().iter().copied())
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.names.len()
    }

    /// The number of members (at least one).
    #[expect(
        clippy::len_without_is_empty,
        reason = "a shape always has at least one member"
    )]
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// The slice that maps points to ranks.
    pub fn layout(&self) -> &Slice {
        &self.slice
    }

    /// The position of dimension `dim`.
    pub fn position(&self, dim: &str) -> Result<usize, ShapeError> {
        self.names
            .iter()
            .position(|name| name == dim)
            .ok_or_else(|| ShapeError::UnknownDim {
                dim: truncate(dim, MAX_NAME_BYTES + 8).to_owned(),
                shape: self.to_string(),
            })
    }

    /// The size of dimension `dim`.
    pub fn size(&self, dim: &str) -> Result<usize, ShapeError> {
        Ok(self.slice.sizes[self.position(dim)?])
    }

    /// The point with these coordinates (one per dimension, in order).
    pub fn point(&self, coords: &[usize]) -> Result<Point, ShapeError> {
        self.check_coords(coords)?;
        Ok(Point {
            names: self.names.clone(),
            coords: coords.to_vec(),
        })
    }

    fn check_coords(&self, coords: &[usize]) -> Result<(), ShapeError> {
        self.slice
            .check_coords(coords, |position| self.names[position].to_string())
    }

    /// The rank of the point with these coordinates.
    pub fn rank_at(&self, coords: &[usize]) -> Result<Rank, ShapeError> {
        self.check_coords(coords)?;
        Ok(self.slice.rank_unchecked(coords))
    }

    /// The rank of `point`, which must come from a shape with the same
    /// dimension names (its coordinates are read in this shape).
    pub fn rank_of(&self, point: &Point) -> Result<Rank, ShapeError> {
        if !Arc::ptr_eq(&point.names, &self.names) && point.names != self.names {
            return Err(ShapeError::PointMismatch {
                point: point.to_string(),
                shape: self.to_string(),
            });
        }
        self.rank_at(&point.coords)
    }

    /// The point of `rank`, or `None` if no member of this view has it.
    pub fn point_of(&self, rank: Rank) -> Option<Point> {
        let coords = self.slice.coords_of(rank)?;
        Some(Point {
            names: self.names.clone(),
            coords,
        })
    }

    /// Whether some member of this view has `rank`.
    pub fn contains(&self, rank: Rank) -> bool {
        self.slice.contains(rank)
    }

    /// All points, in row-major order.
    pub fn points(&self) -> Points<'_> {
        Points {
            shape: self,
            odometer: Odometer::new(self.slice.sizes.iter().map(|&s| Axis::full(s)).collect()),
        }
    }

    /// The ranks of all points, in row-major point order.
    pub fn ranks(&self) -> Ranks<'_> {
        self.slice.ranks()
    }

    /// The view with dimension `dim` restricted to `range` (Rust range
    /// syntax: `0..2`, `1..=3`, `2..`, `..`); the dimension stays, with
    /// coordinates renumbered from zero.
    pub fn slice(&self, dim: &str, range: impl RangeBounds<usize>) -> Result<Shape, ShapeError> {
        self.slice_step(dim, range, 1)
    }

    /// Like [`Shape::slice`], keeping every `step`th coordinate of the range.
    pub fn slice_step(
        &self,
        dim: &str,
        range: impl RangeBounds<usize>,
        step: usize,
    ) -> Result<Shape, ShapeError> {
        self.slice_range(dim, &DimRange::from_bounds(range, step)?)
    }

    /// The view with dimension `dim` restricted to `range`, which must lie
    /// within the dimension and select at least one coordinate.
    pub fn slice_range(&self, dim: &str, range: &DimRange) -> Result<Shape, ShapeError> {
        let position = self.position(dim)?;
        let name = &self.names[position];
        let axis = range.resolve(name, self.slice.sizes[position])?;
        self.restrict(position, axis).ok_or(ShapeError::EmptySlice {
            dim: name.clone(),
            range: *range,
        })
    }

    /// The view with dimension `position` restricted to `axis`, or `None` if
    /// the axis is empty. The axis must lie within the dimension.
    pub(crate) fn restrict(&self, position: usize, axis: Axis) -> Option<Shape> {
        (axis.count > 0).then(|| Shape {
            names: self.names.clone(),
            slice: Arc::new(self.slice.restrict(position, axis)),
        })
    }

    /// The view with dimension `dim` fixed at `index` and removed: the
    /// members whose `dim` coordinate is `index`, over the other dimensions.
    pub fn at(&self, dim: &str, index: usize) -> Result<Shape, ShapeError> {
        let position = self.position(dim)?;
        let size = self.slice.sizes[position];
        if index >= size {
            return Err(ShapeError::IndexOutOfRange {
                dim: dim.to_owned(),
                index,
                size,
            });
        }
        let mut names = self.names.to_vec();
        names.remove(position);
        Ok(Shape {
            names: names.into(),
            slice: Arc::new(self.slice.fix(position, index)),
        })
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (name, size)) in self.dims().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}={size}")?;
        }
        f.write_str("}")
    }
}

#[derive(Serialize)]
struct ShapePartsRef<'a> {
    names: &'a [DimName],
    slice: &'a Slice,
}

#[derive(Deserialize)]
struct ShapeParts {
    names: Vec<DimName>,
    slice: SliceParts,
}

impl ShapeParts {
    /// Whether `shape` is the shape these parts make.
    fn makes(&self, shape: &Shape) -> bool {
        *shape.names == *self.names
            && shape.slice.offset == self.slice.offset
            && shape.slice.sizes == self.slice.sizes
            && shape.slice.strides == self.slice.strides
    }
}

impl Serialize for Shape {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ShapePartsRef {
            names: &self.names,
            slice: &self.slice,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Shape {
    /// Every cast carries its view: the shapes decoded last on this thread
    /// are kept, and the same parts again are not checked again.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        thread_local! {
            static DECODED: Memo<Shape> = const { Memo::new() };
        }
        let parts = ShapeParts::deserialize(deserializer)?;
        if let Some(shape) = DECODED.with(|m| m.find(|s| parts.makes(s))) {
            return Ok(shape);
        }
        let slice = Slice::new(parts.slice.offset, parts.slice.sizes, parts.slice.strides)
            .map_err(D::Error::custom)?;
        let shape = Shape::from_parts(parts.names, slice).map_err(D::Error::custom)?;
        DECODED.with(|m| m.keep(shape.clone()));
        Ok(shape)
    }
}

/// A point of a shape: one coordinate per named dimension, relative to the
/// shape (view) that made it. Prints as `{hosts=1, gpus=3}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Point {
    names: Arc<[DimName]>,
    coords: Vec<usize>,
}

impl Point {
    /// The dimension names, in order.
    pub fn names(&self) -> &[DimName] {
        &self.names
    }

    /// The coordinates, in dimension order.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// The coordinate along `dim`, if the point has that dimension.
    pub fn coord(&self, dim: &str) -> Option<usize> {
        let position = self.names.iter().position(|name| name == dim)?;
        Some(self.coords[position])
    }
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (name, coord)) in self.names.iter().zip(&self.coords).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}={coord}")?;
        }
        f.write_str("}")
    }
}

/// Steps through the coordinates of a box (one [`Axis`] per dimension) in
/// row-major order.
#[derive(Debug, Clone)]
pub(crate) struct Odometer {
    axes: Vec<Axis>,
    /// The step count along each axis (`coord = start + k * step`).
    steps: Vec<usize>,
    /// Points not yet returned.
    remaining: usize,
}

impl Odometer {
    pub(crate) fn new(axes: Vec<Axis>) -> Odometer {
        let remaining = axes.iter().map(|a| a.count).product();
        Odometer {
            steps: vec![0; axes.len()],
            axes,
            remaining,
        }
    }

    /// The current coordinates.
    pub(crate) fn coords(&self) -> impl Iterator<Item = usize> + '_ {
        self.axes
            .iter()
            .zip(&self.steps)
            .map(|(a, &k)| a.start + k * a.step)
    }

    /// Points not yet returned, the current one included.
    pub(crate) fn remaining(&self) -> usize {
        self.remaining
    }

    /// Moves to the next point; returns the dimension that advanced (every
    /// later one wrapped to its start), or `None` at the end.
    pub(crate) fn advance(&mut self) -> Option<usize> {
        self.remaining = self.remaining.saturating_sub(1);
        if self.remaining == 0 {
            return None;
        }
        for i in (0..self.axes.len()).rev() {
            self.steps[i] += 1;
            if self.steps[i] < self.axes[i].count {
                return Some(i);
            }
            self.steps[i] = 0;
        }
        // `remaining` counts the points left, so some axis could advance.
        None
    }
}

/// Calls `f(first, delta, count)` for the ranks of the box `axes` (one per
/// dimension, inside the sizes, none empty) in row-major order, as runs of
/// `count` ranks `first + k * delta`. Dimensions that continue each other
/// (like the whole of a contiguous layout) merge into one run, so that the
/// caller's loop over a run is tight.
pub(crate) fn for_each_run(
    offset: usize,
    strides: &[usize],
    axes: &[Axis],
    mut f: impl FnMut(u64, u64, usize),
) {
    debug_assert_eq!(strides.len(), axes.len());
    if axes.iter().any(|a| a.count == 0) {
        return;
    }
    // The rank of the box's first point; only axes of more than one
    // coordinate move from there (a size-one dimension's stride, which may be
    // anything, is never multiplied).
    let mut first = offset as u64;
    let mut moving: Vec<(usize, u64)> = Vec::with_capacity(axes.len());
    for (axis, &stride) in axes.iter().zip(strides) {
        if axis.start > 0 {
            first += (axis.start * stride) as u64;
        }
        if axis.count > 1 {
            moving.push((axis.count, (axis.step * stride) as u64));
        }
    }
    let (mut count, delta) = moving.pop().unwrap_or((1, 0));
    while let Some(&(outer_count, outer_delta)) = moving.last() {
        if outer_delta != count as u64 * delta {
            break;
        }
        count *= outer_count;
        moving.pop();
    }
    // Step through the outer axes, odometer style.
    let mut steps = vec![0; moving.len()];
    let mut base = first;
    loop {
        f(base, delta, count);
        let mut i = moving.len();
        loop {
            if i == 0 {
                return;
            }
            i -= 1;
            let (outer_count, outer_delta) = moving[i];
            steps[i] += 1;
            base += outer_delta;
            if steps[i] < outer_count {
                break;
            }
            base -= outer_count as u64 * outer_delta;
            steps[i] = 0;
        }
    }
}

/// The points of a shape in row-major order ([`Shape::points`]).
#[derive(Debug, Clone)]
pub struct Points<'a> {
    shape: &'a Shape,
    odometer: Odometer,
}

impl Iterator for Points<'_> {
    type Item = Point;

    fn next(&mut self) -> Option<Point> {
        if self.odometer.remaining() == 0 {
            return None;
        }
        let point = Point {
            names: self.shape.names.clone(),
            coords: self.odometer.coords().collect(),
        };
        self.odometer.advance();
        Some(point)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.odometer.remaining(), Some(self.odometer.remaining()))
    }
}

impl ExactSizeIterator for Points<'_> {}

/// Ranks of a box of points in row-major point order ([`Shape::ranks`]).
#[derive(Debug, Clone)]
pub struct Ranks<'a> {
    slice: &'a Slice,
    odometer: Odometer,
    rank: u64,
}

impl<'a> Ranks<'a> {
    /// The ranks of the box `axes` (inside the slice's dimensions).
    pub(crate) fn new(slice: &'a Slice, axes: Vec<Axis>) -> Ranks<'a> {
        let odometer = Odometer::new(axes);
        let rank = if odometer.remaining() == 0 {
            0
        } else {
            let coords: Vec<usize> = odometer.coords().collect();
            u64::from(slice.rank_unchecked(&coords).0)
        };
        Ranks {
            slice,
            odometer,
            rank,
        }
    }
}

impl Iterator for Ranks<'_> {
    type Item = Rank;

    fn next(&mut self) -> Option<Rank> {
        if self.odometer.remaining() == 0 {
            return None;
        }
        // Lossless: the odometer only visits points of the slice, whose ranks
        // fit a u32.
        let rank = Rank(self.rank as u32);
        if let Some(advanced) = self.odometer.advance() {
            let strides = &self.slice.strides;
            let axes = &self.odometer.axes;
            self.rank += (axes[advanced].step * strides[advanced]) as u64;
            for i in advanced + 1..axes.len() {
                // Back from the last coordinate of axis i to its first.
                self.rank -= ((axes[i].count - 1) * axes[i].step * strides[i]) as u64;
            }
        }
        Some(rank)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.odometer.remaining(), Some(self.odometer.remaining()))
    }
}

impl ExactSizeIterator for Ranks<'_> {}

// Ranks and member counts are u32 values used as indices.
const _: () = assert!(
    usize::BITS >= 32,
    "regent-mesh needs usize of at least 32 bits"
);

#[cfg(test)]
pub(crate) mod tests;
