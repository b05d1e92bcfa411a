//! Tensors inside registered memory: a [`TensorBuffer`] is a registered
//! buffer and a tch tensor over its bytes, without a copy. Peers reach the
//! tensor through its [`TensorHandle`]; this side computes with the tensor.
//!
//! The tensor is made by `src/blob.cpp` (libtorch's `from_blob` with a
//! deleter): its storage holds a reference to the registered buffer, so
//! the buffer stays registered and mapped for as long as the tensor or any
//! view or shallow clone of it lives, and is released after the last one
//! goes.

use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use regent_rdma::{BufferManager, LocalBuffer, Memory, RemoteBuffer};
use tch::Tensor;

use crate::dtype::DType;
use crate::error::Error;
use crate::layout::{Layout, TensorHandle};

unsafe extern "C" {
    /// `src/blob.cpp`.
    fn regent_tensor_from_blob(
        data: *mut c_void,
        dims: *const i64,
        ndims: usize,
        strides: *const i64,
        nstrides: usize,
        dtype: c_int,
        release: extern "C" fn(*mut c_void),
        ctx: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
}

/// What to do with a tensor that is not contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Contiguity {
    /// Refuse it with [`Error::NotContiguous`].
    #[default]
    Refuse,
    /// Copy it into row-major order.
    Copy,
}

/// The base address of a mapping, shareable between threads (the bytes
/// are reached only through raw-pointer copies and short-lived slices
/// whose use the protocols make exclusive).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Base(NonNull<u8>);

// SAFETY: `Base` is an address into a shared mapping that lives as long as
// the `Registered` holding it; moving or sharing the address between
// threads is harmless, and every dereference states its own exclusivity
// argument.
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

/// A registered buffer and the address of its bytes.
#[derive(Debug)]
pub(crate) struct Registered {
    buffer: LocalBuffer,
    base: Base,
    len_bytes: usize,
    /// Set when a peer may still write the memory outside any operation
    /// (it was stopped inside a copy when a collective failed): why.
    poisoned: std::sync::OnceLock<String>,
}

impl Registered {
    /// Registers `memory` with `manager`.
    pub(crate) fn new(manager: &BufferManager, memory: Memory) -> Result<Self, Error> {
        let len_bytes = memory.len();
        let mut buffer = manager.register(memory).map_err(Error::Rdma)?;
        let base = base_of(&mut buffer);
        Ok(Self {
            buffer,
            base,
            len_bytes,
            poisoned: std::sync::OnceLock::new(),
        })
    }

    pub(crate) fn handle(&self) -> &RemoteBuffer {
        self.buffer.handle()
    }

    /// A handle for one operation, working until [`Self::close_window`].
    pub(crate) fn open_window(&self) -> RemoteBuffer {
        self.buffer.open_window()
    }

    /// Ends the window of `handle`, waiting up to `timeout` for peers'
    /// copies in flight; on [`regent_rdma::Error::Busy`] (a peer stopped
    /// inside one) the memory is poisoned: it may still change.
    pub(crate) async fn close_window(
        &self,
        handle: &RemoteBuffer,
        timeout: std::time::Duration,
    ) -> Result<(), Error> {
        match self.buffer.close_window(handle, timeout).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let why = format!("a peer may still write it: {e}");
                let _ = self.poisoned.set(why.clone());
                Err(Error::Poisoned(why))
            }
        }
    }

    /// Fails if the memory is poisoned (see [`Self::close_window`]).
    pub(crate) fn check_poisoned(&self) -> Result<(), Error> {
        match self.poisoned.get() {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The address of byte `offset`.
    pub(crate) fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len_bytes, "offset inside the buffer");
        // SAFETY: `offset` is at most the mapping's length (asserted), so
        // the result is in bounds or one past the end.
        unsafe { self.base.0.as_ptr().add(offset) }
    }

    /// The bytes `range` as a slice.
    ///
    /// # Safety
    /// For as long as the slice lives, nobody writes those bytes: not this
    /// process (through other slices or tensors over the buffer) and not a
    /// peer (the protocol of the caller says why).
    pub(crate) unsafe fn slice(&self, range: std::ops::Range<usize>) -> &[u8] {
        assert!(
            range.start <= range.end && range.end <= self.len_bytes,
            "range inside the buffer"
        );
        // SAFETY: in bounds (asserted) of a mapping that lives as long as
        // `self`; the caller vouches that nothing writes the bytes
        // meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(range.start), range.len()) }
    }

    /// The bytes `range` as a mutable slice.
    ///
    /// # Safety
    /// For as long as the slice lives, nobody else reads or writes those
    /// bytes (this process or a peer).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.len_bytes,
            "range inside the buffer"
        );
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(range.start), range.len()) }
    }
}

/// The first byte of a registered buffer's memory.
///
/// This is the only use of `LocalBuffer`'s `DerefMut` in this crate: the
/// slice it returns is dropped at once and only the address is kept (the
/// rdma crate is replacing that `Deref` with an explicit raw accessor; this
/// is the one line to change then).
fn base_of(buffer: &mut LocalBuffer) -> Base {
    Base(buffer.as_ptr())
}

/// libtorch's storage deleter: drops the reference that keeps the
/// registered buffer alive.
extern "C" fn release(ctx: *mut c_void) {
    let result = std::panic::catch_unwind(|| {
        // SAFETY: `ctx` is the pointer `Arc::into_raw` made in
        // `blob_tensor`, and libtorch calls the deleter of a storage once.
        drop(unsafe { Arc::from_raw(ctx.cast_const().cast::<Registered>()) });
    });
    if result.is_err() {
        tracing::error!("releasing a registered buffer panicked");
    }
}

/// A tch tensor over `layout` in `reg`, keeping `reg` alive.
fn blob_tensor(reg: &Arc<Registered>, layout: &Layout) -> Result<Tensor, Error> {
    if layout.end_bytes() > reg.len_bytes() as u64 {
        return Err(Error::Layout(format!(
            "{layout} does not fit the {} bytes of the buffer",
            reg.len_bytes()
        )));
    }
    let dims = layout.shape_i64();
    let strides = layout.strides_i64();
    // `end_bytes` fits the buffer, so the offset does too.
    let data = reg.ptr(layout.offset_bytes() as usize);
    let ctx = Arc::into_raw(reg.clone()).cast_mut().cast::<c_void>();
    let mut err = [0 as c_char; 256];
    // SAFETY: `data` points into a mapping of `reg` that covers the
    // layout's span (checked above) and lives while `ctx` holds `reg`;
    // `dims` and `strides` are valid for their lengths during the call;
    // the dtype number is one of c10's; `release` frees `ctx` once, when
    // the storage goes; `err` is writable for its length.
    let ptr = unsafe {
        regent_tensor_from_blob(
            data.cast(),
            dims.as_ptr(),
            dims.len(),
            strides.as_ptr(),
            strides.len(),
            layout.dtype().scalar_type(),
            release,
            ctx,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if ptr.is_null() {
        // `ctx` is leaked: libtorch may or may not have called `release`
        // while unwinding. This needs an exception inside libtorch for a
        // layout already validated here (out of memory).
        // SAFETY: blob.cpp NUL-terminates `err` within its length.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        return Err(Error::Unsupported(format!(
            "libtorch refused a tensor over registered memory: {}",
            msg.to_string_lossy()
        )));
    }
    // SAFETY: blob.cpp returns a heap `at::Tensor*`, which is what tch's
    // `C_tensor` is; the new `Tensor` owns it.
    Ok(unsafe { Tensor::from_ptr(ptr.cast()) })
}

/// A tensor in registered memory: peers read and write it one-sidedly
/// through [`TensorBuffer::handle`], this side computes with
/// [`TensorBuffer::tensor`], and no byte is copied between the two.
///
/// The rules of registered memory apply (`docs/semantics.md` §6.2, §8.2):
/// while a peer's operation on the tensor is in flight (during a
/// collective, or between a handle's send and the peer's "done"), this side
/// does not touch the tensor. The buffer stays registered until the
/// `TensorBuffer` and every tensor over its memory are dropped.
pub struct TensorBuffer {
    tensor: Tensor,
    layout: Layout,
    reg: Arc<Registered>,
}

impl std::fmt::Debug for TensorBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorBuffer")
            .field("layout", &self.layout)
            .field("buffer", &self.reg.handle().id())
            .finish_non_exhaustive()
    }
}

impl TensorBuffer {
    /// A zeroed row-major tensor of `shape` in newly registered memory.
    pub fn zeros(manager: &BufferManager, dtype: DType, shape: &[u64]) -> Result<Self, Error> {
        let layout = Layout::contiguous(dtype, shape, 0)?;
        Self::with_layout(manager, layout)
    }

    /// A zeroed tensor of a dense `layout` (contiguous, or a permutation
    /// of a contiguous one) in newly registered memory of
    /// `layout.end_bytes()` bytes.
    pub fn with_layout(manager: &BufferManager, layout: Layout) -> Result<Self, Error> {
        if !layout.is_dense() {
            return Err(Error::NotContiguous {
                shape: layout.shape_i64(),
                strides: layout.strides_i64(),
                what: "dense",
            });
        }
        // Memory is at least one byte long, even for an empty tensor.
        let memory = Memory::allocate(layout.end_bytes().max(1) as usize).map_err(Error::Rdma)?;
        Self::wrap(manager, memory, layout)
    }

    /// A copy of a CPU tensor in newly registered memory: a contiguous
    /// tensor keeps its shape; a non-contiguous one is refused or copied
    /// into row-major order, as `contiguity` says.
    pub fn copy_from(
        manager: &BufferManager,
        tensor: &Tensor,
        contiguity: Contiguity,
    ) -> Result<Self, Error> {
        check_cpu(tensor)?;
        let dtype = DType::from_kind(tensor.f_kind()?)?;
        if !tensor.is_contiguous() && contiguity == Contiguity::Refuse {
            return Err(Error::NotContiguous {
                shape: tensor.size(),
                strides: tensor.stride(),
                what: "contiguous",
            });
        }
        let src = tensor.f_contiguous()?;
        let shape: Vec<u64> = src.size().iter().map(|&d| d as u64).collect();
        let layout = Layout::contiguous(dtype, &shape, 0)?;
        let mut memory =
            Memory::allocate(layout.end_bytes().max(1) as usize).map_err(Error::Rdma)?;
        // Unregistered memory is this process's alone.
        src.f_copy_data_u8(&mut memory[..layout.nbytes() as usize], src.numel())?;
        Self::wrap(manager, memory, layout)
    }

    fn wrap(manager: &BufferManager, memory: Memory, layout: Layout) -> Result<Self, Error> {
        let reg = Arc::new(Registered::new(manager, memory)?);
        let tensor = blob_tensor(&reg, &layout)?;
        Ok(Self {
            tensor,
            layout,
            reg,
        })
    }

    /// The tensor over the registered bytes (no copy). Views and shallow
    /// clones of it keep the buffer registered.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The tensor, mutably (for in-place tch operations).
    pub fn tensor_mut(&mut self) -> &mut Tensor {
        &mut self.tensor
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The elements of a contiguous `f32` tensor as a slice over the
    /// registered memory (no copy), for code that computes on them without
    /// tch — a flat gradient a collective reduces in place. The rule of the
    /// type holds: not while a peer's operation on the tensor is in flight.
    pub fn as_f32(&self) -> Result<&[f32], Error> {
        let span = self.f32_span()?;
        // SAFETY: `f32_span` checked dtype, contiguity and alignment, so the
        // span holds `span.len() / 4` initialized `f32`s (any bits are a
        // valid `f32`); the slice borrows `self`, and by the type's rule no
        // peer writes the memory outside an operation this side awaits.
        let bytes = unsafe { self.reg.slice(span) };
        Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) })
    }

    /// [`Self::as_f32`], writable: `&mut self` keeps the buffer's other
    /// users (collectives, transfers) out while the slice lives; tensors
    /// over the memory are not to be used meanwhile (tch does not borrow).
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32], Error> {
        let span = self.f32_span()?;
        // SAFETY: as in `as_f32`; writes of any bits leave valid `f32`s, and
        // the slice borrows `self` mutably.
        let bytes = unsafe { self.reg.slice_mut(span) };
        Ok(unsafe {
            std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), bytes.len() / 4)
        })
    }

    /// Why the buffer's memory may still change under this side, if it
    /// may: a collective on it failed while a peer was stopped inside a
    /// copy into it (`docs/semantics.md` §8.3). Such a buffer is refused by
    /// collectives and by [`Self::as_f32`]; use another one.
    pub fn poisoned(&self) -> Option<&str> {
        self.reg.poisoned.get().map(String::as_str)
    }

    /// The span of a contiguous, aligned `f32` tensor.
    fn f32_span(&self) -> Result<std::ops::Range<usize>, Error> {
        self.reg.check_poisoned()?;
        if self.layout.dtype() != DType::F32 {
            return Err(Error::Invalid(format!(
                "a {} tensor is not a slice of f32",
                self.layout.dtype()
            )));
        }
        if !self.layout.is_contiguous() {
            return Err(Error::NotContiguous {
                shape: self.layout.shape_i64(),
                strides: self.layout.strides_i64(),
                what: "contiguous",
            });
        }
        let span = self.layout.offset_bytes() as usize
            ..(self.layout.offset_bytes() + self.layout.nbytes()) as usize;
        // SAFETY: an empty slice at the span's start, only for its address.
        let start = unsafe { self.reg.slice(span.start..span.start) }.as_ptr();
        if start.align_offset(std::mem::align_of::<f32>()) != 0 {
            return Err(Error::Invalid(
                "the tensor's bytes are not aligned for f32".into(),
            ));
        }
        Ok(span)
    }

    /// The handle to send to peers.
    pub fn handle(&self) -> TensorHandle {
        // The layout fits the buffer by construction.
        TensorHandle::new(self.reg.handle().clone(), self.layout.clone())
            .expect("a tensor buffer's layout fits its buffer")
    }

    pub(crate) fn registered(&self) -> &Arc<Registered> {
        &self.reg
    }

    /// The byte range of the tensor's span in its buffer.
    pub(crate) fn span(&self) -> std::ops::Range<usize> {
        // Both fit the buffer (construction).
        self.layout.offset_bytes() as usize..self.layout.end_bytes() as usize
    }

    /// Whether the buffer is registered with `manager`.
    pub(crate) fn check_owner(&self, manager: &BufferManager) -> Result<(), Error> {
        if self.reg.handle().owner() != manager.proc() {
            return Err(Error::Invalid(format!(
                "the tensor is registered by {}, not by this member ({})",
                self.reg.handle().owner(),
                manager.proc()
            )));
        }
        Ok(())
    }

    /// Reads a peer's tensor into this one, one-sidedly and without
    /// allocating: both must have the same dtype, shape and strides, and be
    /// dense.
    pub async fn read_from(
        &mut self,
        manager: &BufferManager,
        remote: &TensorHandle,
    ) -> Result<(), Error> {
        check_transfer(&self.layout, remote.layout())?;
        let span = self.span();
        // SAFETY: `&mut self` excludes other users of this TensorBuffer;
        // tensors over its memory are not to be touched during a transfer
        // (type docs); peers write it only if handed its handle for that.
        let local = unsafe { self.reg.slice_mut(span) };
        manager
            .read_into(remote.buffer(), remote.layout().offset_bytes(), local)
            .await
            .map_err(Error::Rdma)
    }

    /// Writes this tensor into a peer's tensor of the same dtype, shape and
    /// strides, one-sidedly.
    pub async fn write_to(
        &mut self,
        manager: &BufferManager,
        remote: &TensorHandle,
    ) -> Result<(), Error> {
        check_transfer(&self.layout, remote.layout())?;
        let span = self.span();
        // SAFETY: as in `read_from`; the bytes are only read.
        let local = unsafe { self.reg.slice(span) };
        manager
            .write_from(remote.buffer(), remote.layout().offset_bytes(), local)
            .await
            .map_err(Error::Rdma)
    }
}

/// A transfer copies a span: both sides must be arranged alike and dense.
pub(crate) fn check_transfer(local: &Layout, remote: &Layout) -> Result<(), Error> {
    if !local.same_arrangement(remote) {
        return Err(Error::LayoutMismatch {
            expected: local.to_string(),
            found: remote.to_string(),
        });
    }
    if !local.is_dense() {
        return Err(Error::NotContiguous {
            shape: local.shape_i64(),
            strides: local.strides_i64(),
            what: "dense",
        });
    }
    Ok(())
}

pub(crate) fn check_cpu(tensor: &Tensor) -> Result<(), Error> {
    if !tensor.defined() {
        return Err(Error::Invalid("an undefined tensor".into()));
    }
    if tensor.device() != tch::Device::Cpu {
        return Err(Error::Unsupported(format!(
            "tensors on {:?} (CPU only for now)",
            tensor.device()
        )));
    }
    Ok(())
}

/// A plain CPU tensor's dtype, element count and bytes; it must be
/// contiguous (its bytes are copied as they lie).
pub(crate) fn check_plain(t: &Tensor) -> Result<(DType, u64, usize), Error> {
    check_cpu(t)?;
    let dtype = DType::from_kind(t.f_kind()?)?;
    if !t.is_contiguous() {
        return Err(Error::NotContiguous {
            shape: t.size(),
            strides: t.stride(),
            what: "contiguous",
        });
    }
    let numel = t.numel() as u64;
    let len = numel
        .checked_mul(dtype.size_bytes() as u64)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| Error::Invalid("tensor too large".into()))?;
    Ok((dtype, numel, len))
}

/// The elements of a contiguous CPU tensor, writable.
///
/// Other tensors sharing its storage (views, shallow clones) must not be
/// used while the slice lives, as for any in-place operation (the public
/// methods that take `&mut Tensor` say so).
pub(crate) fn plain_bytes_mut(t: &mut Tensor) -> Result<&mut [u8], Error> {
    let (_, _, len) = check_plain(t)?;
    if len == 0 {
        return Ok(&mut []);
    }
    let ptr = t.data_ptr().cast::<u8>();
    assert!(!ptr.is_null(), "a non-empty CPU tensor has data");
    // SAFETY: a defined, contiguous CPU tensor of `len` bytes of elements
    // starts at `data_ptr`; the slice borrows `t` mutably, so this handle
    // is not used meanwhile, and other handles of the storage are not to
    // be used either (doc above); bytes are valid for any value.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// The elements of a contiguous CPU tensor, read-only (no tensor sharing
/// its storage may write it while the slice lives).
pub(crate) fn plain_bytes(t: &Tensor) -> Result<&[u8], Error> {
    let (_, _, len) = check_plain(t)?;
    if len == 0 {
        return Ok(&[]);
    }
    let ptr = t.data_ptr().cast::<u8>().cast_const();
    assert!(!ptr.is_null(), "a non-empty CPU tensor has data");
    // SAFETY: as in `plain_bytes_mut`, for reading; the slice borrows `t`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

#[cfg(test)]
mod tests;
