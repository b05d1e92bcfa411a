//! Layouts (dtype, shape, strides, offset) of tensors in registered
//! buffers, and the handles members send each other. Both come from the
//! network, so both are validated while they are decoded: bounded rank, no
//! overflow anywhere, element-aligned, and (for a handle) inside the buffer.

use std::fmt;
use std::ops::Range;

use regent_rdma::{MAX_BUFFER_BYTES, RemoteBuffer};
use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::Error;

/// The most dimensions a layout may have.
pub const MAX_DIMS: usize = 16;
/// The largest encoded [`TensorHandle`] that [`TensorHandle::decode`]
/// accepts.
pub const MAX_TENSOR_HANDLE_BYTES: usize = 1024;

/// Where a tensor's elements lie in a buffer: dtype, shape, strides (in
/// elements, non-negative) and the byte offset of element zero.
///
/// Invariants (checked by [`Layout::new`] and on decode): at most
/// [`MAX_DIMS`] dimensions; shape and strides of equal length; the element
/// count, the byte length and the span (offset to one past the last
/// element addressed) computed without overflow and at most 1 TiB; the
/// offset a multiple of the element size.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "LayoutWire", into = "LayoutWire")]
pub struct Layout {
    dtype: DType,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset_bytes: u64,
    // Derived, checked on construction.
    numel: u64,
    end_bytes: u64,
}

#[derive(Serialize, Deserialize)]
struct LayoutWire {
    dtype: DType,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset_bytes: u64,
}

impl TryFrom<LayoutWire> for Layout {
    type Error = Error;
    fn try_from(w: LayoutWire) -> Result<Self, Error> {
        Layout::new(w.dtype, w.shape, w.strides, w.offset_bytes)
    }
}

impl From<Layout> for LayoutWire {
    fn from(l: Layout) -> Self {
        LayoutWire {
            dtype: l.dtype,
            shape: l.shape,
            strides: l.strides,
            offset_bytes: l.offset_bytes,
        }
    }
}

fn row_major(shape: &[u64]) -> Option<Vec<u64>> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.checked_mul(d.max(1))?;
    }
    Some(strides)
}

impl Layout {
    /// A validated layout.
    pub fn new(
        dtype: DType,
        shape: Vec<u64>,
        strides: Vec<u64>,
        offset_bytes: u64,
    ) -> Result<Self, Error> {
        let bad = |s: String| Err(Error::Layout(s));
        if shape.len() > MAX_DIMS {
            return bad(format!("{} dimensions, at most {MAX_DIMS}", shape.len()));
        }
        if shape.len() != strides.len() {
            return bad(format!(
                "{} dimensions but {} strides",
                shape.len(),
                strides.len()
            ));
        }
        let elem = dtype.size_bytes() as u64;
        if !offset_bytes.is_multiple_of(elem) {
            return bad(format!(
                "offset {offset_bytes} is not a multiple of the {dtype} element size"
            ));
        }
        let too_big = || {
            Error::Layout(format!(
                "shape {shape:?} with strides {strides:?} is too large"
            ))
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(too_big)?;
        let nbytes = numel.checked_mul(elem).ok_or_else(too_big)?;
        // The span: one past the furthest element addressed.
        let span = if numel == 0 {
            0
        } else {
            let mut last = 0u64;
            for (&d, &s) in shape.iter().zip(&strides) {
                last = (d - 1)
                    .checked_mul(s)
                    .and_then(|x| x.checked_add(last))
                    .ok_or_else(too_big)?;
            }
            last.checked_add(1)
                .and_then(|x| x.checked_mul(elem))
                .ok_or_else(too_big)?
        };
        let end_bytes = offset_bytes.checked_add(span).ok_or_else(too_big)?;
        if end_bytes > MAX_BUFFER_BYTES || nbytes > MAX_BUFFER_BYTES {
            return bad(format!(
                "{end_bytes} bytes, more than a buffer holds ({MAX_BUFFER_BYTES})"
            ));
        }
        // tch takes i64 sizes and strides.
        if shape.iter().chain(&strides).any(|&x| x > i64::MAX as u64) {
            return Err(too_big());
        }
        Ok(Self {
            dtype,
            shape,
            strides,
            offset_bytes,
            numel,
            end_bytes,
        })
    }

    /// A row-major (C-contiguous) layout at `offset_bytes`.
    pub fn contiguous(dtype: DType, shape: &[u64], offset_bytes: u64) -> Result<Self, Error> {
        let strides = row_major(shape)
            .ok_or_else(|| Error::Layout(format!("shape {shape:?} is too large")))?;
        Self::new(dtype, shape.to_vec(), strides, offset_bytes)
    }

    /// The layout of a tch tensor (its storage offset in bytes as offset).
    pub fn of(tensor: &tch::Tensor) -> Result<Self, Error> {
        let dtype = DType::from_kind(tensor.f_kind()?)?;
        let to_u64 = |v: Vec<i64>, what: &str| -> Result<Vec<u64>, Error> {
            v.into_iter()
                .map(|x| {
                    u64::try_from(x).map_err(|_| Error::Layout(format!("negative {what} {x}")))
                })
                .collect()
        };
        let shape = to_u64(tensor.size(), "dimension")?;
        let strides = to_u64(tensor.stride(), "stride")?;
        let offset = u64::try_from(tensor.storage_offset())
            .map_err(|_| Error::Layout("negative storage offset".into()))?
            .checked_mul(dtype.size_bytes() as u64)
            .ok_or_else(|| Error::Layout("storage offset too large".into()))?;
        Self::new(dtype, shape, strides, offset)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[u64] {
        &self.strides
    }

    /// The shape as tch takes it.
    pub fn shape_i64(&self) -> Vec<i64> {
        // Bounded by i64::MAX in `new`.
        self.shape.iter().map(|&d| d as i64).collect()
    }

    /// The strides as tch takes them.
    pub fn strides_i64(&self) -> Vec<i64> {
        // Bounded by i64::MAX in `new`.
        self.strides.iter().map(|&d| d as i64).collect()
    }

    /// Byte offset of element zero.
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// The number of elements.
    pub fn numel(&self) -> u64 {
        self.numel
    }

    /// Bytes of the elements (`numel * element size`).
    pub fn nbytes(&self) -> u64 {
        self.numel * self.dtype.size_bytes() as u64
    }

    /// One past the last byte addressed: a buffer must be at least this
    /// long to hold the tensor.
    pub fn end_bytes(&self) -> u64 {
        self.end_bytes
    }

    /// This layout at another offset.
    pub fn at_offset(&self, offset_bytes: u64) -> Result<Self, Error> {
        Self::new(
            self.dtype,
            self.shape.clone(),
            self.strides.clone(),
            offset_bytes,
        )
    }

    /// Whether the elements are in row-major order with no gaps (strides
    /// of dimensions of size 1 do not matter, and an empty tensor is
    /// contiguous, as in torch).
    pub fn is_contiguous(&self) -> bool {
        if self.numel == 0 {
            return true;
        }
        let mut expect = 1u64;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// Whether the elements fill their span exactly once in some order (a
    /// contiguous tensor, or a permutation of one such as a transpose):
    /// then copying the span copies the tensor and nothing else.
    pub fn is_dense(&self) -> bool {
        let mut dims: Vec<(u64, u64)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(d, _)| **d != 1)
            .map(|(&d, &s)| (s, d))
            .collect();
        if dims.iter().any(|&(_, d)| d == 0) {
            return true;
        }
        dims.sort_unstable();
        let mut expect = 1u64;
        for (s, d) in dims {
            if s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// The same dtype, shape and strides (offsets may differ).
    pub fn same_arrangement(&self, other: &Layout) -> bool {
        self.dtype == other.dtype && self.shape == other.shape && self.strides == other.strides
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{:?} strides {:?} at byte {}",
            self.dtype, self.shape, self.strides, self.offset_bytes
        )
    }
}

/// A tensor in another member's registered buffer: the buffer's handle and
/// the tensor's layout in it. Serde; sent on the control plane. Validated
/// on decode: the layout's span lies inside the buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "HandleWire", into = "HandleWire")]
pub struct TensorHandle {
    buffer: RemoteBuffer,
    layout: Layout,
}

#[derive(Serialize, Deserialize)]
struct HandleWire {
    buffer: RemoteBuffer,
    layout: Layout,
}

impl TryFrom<HandleWire> for TensorHandle {
    type Error = Error;
    fn try_from(w: HandleWire) -> Result<Self, Error> {
        TensorHandle::new(w.buffer, w.layout)
    }
}

impl From<TensorHandle> for HandleWire {
    fn from(h: TensorHandle) -> Self {
        HandleWire {
            buffer: h.buffer,
            layout: h.layout,
        }
    }
}

impl TensorHandle {
    /// A handle; fails if the layout does not fit in the buffer.
    pub fn new(buffer: RemoteBuffer, layout: Layout) -> Result<Self, Error> {
        if layout.end_bytes() > buffer.len_bytes() {
            return Err(Error::Layout(format!(
                "{layout} ends at byte {}, past the {} bytes of {}",
                layout.end_bytes(),
                buffer.len_bytes(),
                buffer.id()
            )));
        }
        Ok(Self { buffer, layout })
    }

    /// The buffer.
    pub fn buffer(&self) -> &RemoteBuffer {
        &self.buffer
    }

    /// The tensor's layout in it.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The wire form (postcard).
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        postcard::to_allocvec(self).expect("postcard encodes a handle")
    }

    /// Decodes a handle from the wire: at most
    /// [`MAX_TENSOR_HANDLE_BYTES`], no trailing bytes, every field
    /// validated.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() > MAX_TENSOR_HANDLE_BYTES {
            return Err(Error::Layout(format!(
                "handle of {} bytes, at most {MAX_TENSOR_HANDLE_BYTES}",
                bytes.len()
            )));
        }
        // Decoded raw, then validated here: postcard drops the reason a
        // `try_from` gives.
        #[derive(Deserialize)]
        struct Raw {
            buffer: RemoteBuffer,
            layout: LayoutWire,
        }
        let (raw, rest): (Raw, _) = postcard::take_from_bytes(bytes)
            .map_err(|e| Error::Layout(format!("undecodable tensor handle: {e}")))?;
        if !rest.is_empty() {
            return Err(Error::Layout(format!(
                "{} trailing bytes after a tensor handle",
                rest.len()
            )));
        }
        Self::new(raw.buffer, Layout::try_from(raw.layout)?)
    }
}

/// The element ranges of the `size` chunks of `numel` elements that
/// collectives split tensors into.
pub fn chunk_ranges(numel: usize, size: usize) -> Vec<Range<usize>> {
    let base = numel / size;
    let extra = numel % size;
    let mut at = 0;
    (0..size)
        .map(|i| {
            let n = base + usize::from(i < extra);
            let r = at..at + n;
            at += n;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn contiguous_layouts_have_row_major_strides_and_spans() {
        let l = Layout::contiguous(DType::F32, &[2, 3, 4], 16).unwrap();
        assert_eq!(l.strides(), &[12, 4, 1]);
        assert_eq!(l.numel(), 24);
        assert_eq!(l.nbytes(), 96);
        assert_eq!(l.end_bytes(), 16 + 96);
        assert!(l.is_contiguous() && l.is_dense());
        // A transpose is dense but not contiguous.
        let t = Layout::new(DType::F32, vec![4, 3], vec![1, 4], 0).unwrap();
        assert!(!t.is_contiguous() && t.is_dense());
        assert_eq!(t.end_bytes(), 48);
        // A slice with gaps is neither; an expanded one neither.
        let s = Layout::new(DType::F32, vec![2, 2], vec![4, 1], 0).unwrap();
        assert!(!s.is_contiguous() && !s.is_dense());
        let e = Layout::new(DType::F32, vec![3, 2], vec![0, 1], 0).unwrap();
        assert!(!e.is_dense());
        // Size-1 dimensions' strides do not matter; empty tensors span 0.
        assert!(
            Layout::new(DType::U8, vec![1, 5], vec![99, 1], 0)
                .unwrap()
                .is_contiguous()
        );
        let z = Layout::new(DType::F64, vec![3, 0], vec![0, 7], 8).unwrap();
        assert_eq!((z.numel(), z.end_bytes()), (0, 8));
        assert!(z.is_contiguous() && z.is_dense());
        assert!(
            Layout::contiguous(DType::F32, &[4, 0, 6], 0)
                .unwrap()
                .is_contiguous()
        );
        assert_eq!(Layout::contiguous(DType::F32, &[], 0).unwrap().numel(), 1);
    }

    #[test]
    fn invalid_layouts_are_refused_with_a_reason() {
        let e = |r: Result<Layout, Error>| r.unwrap_err().to_string();
        assert!(e(Layout::new(DType::F32, vec![1; 17], vec![1; 17], 0)).contains("dimensions"));
        assert!(e(Layout::new(DType::F32, vec![2], vec![], 0)).contains("strides"));
        assert!(e(Layout::new(DType::F32, vec![2], vec![1], 2)).contains("multiple"));
        assert!(e(Layout::new(DType::U8, vec![u64::MAX, 2], vec![1, 1], 0)).contains("too large"));
        assert!(e(Layout::new(DType::U8, vec![2], vec![u64::MAX], 0)).contains("too large"));
        assert!(e(Layout::new(DType::U8, vec![1 << 41], vec![1], 0)).contains("more than"));
        assert!(e(Layout::new(DType::U8, vec![1], vec![1], u64::MAX)).contains("too large"));
    }

    fn arb_layout() -> impl Strategy<Value = (DType, Vec<u64>, Vec<u64>, u64)> {
        (
            prop::sample::select(DType::ALL.to_vec()),
            prop::collection::vec(0u64..1 << 22, 0..5),
            prop::collection::vec(0u64..1 << 22, 0..5),
            0u64..1 << 20,
        )
    }

    proptest! {
        /// Whatever the fields, `new` either refuses them or returns a
        /// layout whose span covers every element it addresses.
        #[test]
        fn accepted_layouts_address_only_their_span((dtype, shape, strides, off) in arb_layout()) {
            if let Ok(l) = Layout::new(dtype, shape.clone(), strides.clone(), off) {
                if l.numel() > 0 {
                    let last: u64 = shape.iter().zip(&strides).map(|(d, s)| (d - 1) * s).sum();
                    let elem = dtype.size_bytes() as u64;
                    prop_assert_eq!(l.end_bytes(), off + (last + 1) * elem);
                }
                prop_assert!(l.end_bytes() >= l.offset_bytes());
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..1200)) {
            let _ = TensorHandle::decode(&bytes);
            let _ = postcard::from_bytes::<Layout>(&bytes);
        }
    }
}
