//! Registrable memory: one sealed memfd per buffer, mapped shared and
//! populated at allocation, with a two-page header: the first page peers
//! check (and map read-only), the second holds the access slots of
//! [`crate::access`] (peers map it read-write).
//!
//! Layout of a segment (`HEADER_BYTES` + length):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `RGNRDMA2` (u64) |
//! | 8 | state (atomic u32: 0 allocated, 1 exposed, 2 released, 3 read-only, 4 local) |
//! | 12 | owner pid (u32) |
//! | 16 | length in bytes (u64) |
//! | 24 | token (16 bytes) |
//! | 40 | open window (atomic u32: 0 none, else its value) |
//! | 4096 | access slots (512 atomic u64: 0 free, else pid << 32 \| kind) |
//! | 8192 | the buffer's bytes |
//!
//! The memfd is sealed against shrinking and growing, so a mapping of it
//! never faults with SIGBUS, and has mode 0600. It has no name in any file
//! system: nothing is left behind when its last descriptor and mapping go.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{FallocateFlags, MemfdFlags, Mode, SealFlags};

use crate::access::{Gate, Kind, Refusal, SLOT_PAGE_BYTES, SLOTS, STATE_ALLOCATED, Ticket, Window};
use crate::error::Error;
use crate::handle::{MAX_BUFFER_BYTES, Token};

/// Bytes of the first header page (the fields peers check).
pub(crate) const INFO_BYTES: usize = 4096;
/// Bytes before the data: the info page and the slot page.
pub(crate) const HEADER_BYTES: usize = INFO_BYTES + SLOT_PAGE_BYTES;
/// Version 2: the slot page and the access states.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"RGNRDMA2");
/// The memfd name prefix (visible in `/proc/<pid>/maps` and `fd/`).
pub const MEMFD_NAME_PREFIX: &str = "regent-rdma-";

/// The segment header, at the start of the mapping.
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: u64,
    pub(crate) state: AtomicU32,
    pub(crate) owner_pid: u32,
    pub(crate) len_bytes: u64,
    pub(crate) token: [u8; 16],
    pub(crate) window: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Header>() <= INFO_BYTES);

/// A header at the start of a mapping of at least `INFO_BYTES`.
///
/// The header is only read through this reference and written through its
/// atomic; the plain fields are written once by the owner before any other
/// process can learn where the segment is.
pub(crate) fn header_of(map: &MmapRaw) -> &Header {
    assert!(map.len() >= INFO_BYTES, "mapping shorter than a header");
    // SAFETY: the mapping is at least one page long and page-aligned, so it
    // holds a properly aligned `Header` (repr(C), all fields valid for any
    // bit pattern); it lives as long as `map`, which the returned reference
    // borrows. Fields other than `state` are never written after the owner
    // initialises them; `state` and `window` are atomics, so concurrent
    // stores from the owner process are not data races.
    unsafe { &*map.as_ptr().cast::<Header>() }
}

/// The slot table at the start of a mapping of at least `SLOT_PAGE_BYTES`
/// that begins at the slot page of a segment.
pub(crate) fn slots_at(map: &MmapRaw) -> &[AtomicU64; SLOTS] {
    assert!(
        map.len() >= SLOT_PAGE_BYTES,
        "mapping shorter than the slots"
    );
    // SAFETY: the mapping is page-aligned and at least a page long, so it
    // holds an aligned array of `SLOTS` `AtomicU64` (valid for any bit
    // pattern; a fresh memfd is zeroed, so every slot starts free). It lives
    // as long as `map`, which the reference borrows. Every access to these
    // words, from any process, is atomic.
    unsafe { &*map.as_ptr().cast::<[AtomicU64; SLOTS]>() }
}

/// Copies into and out of a segment's data while holding an access slot:
/// the only way bytes of registered memory move, apart from the owner's
/// views under [`crate::Access::Local`] or [`crate::Access::ReadOnly`].
pub(crate) struct Entered<'a> {
    _ticket: Ticket<'a>,
    data: *mut u8,
    len_bytes: usize,
    kind: Kind,
}

// SAFETY: `data` points into a shared mapping that outlives `'a` (the
// segment or region the ticket borrows), and nothing about the slot or the
// mapping is tied to a thread: the ticket gives its slot back with atomic
// operations on shared memory from whichever thread drops it. An async
// read that holds slots across an await may move between worker threads.
unsafe impl Send for Entered<'_> {}

impl Entered<'_> {
    /// Copies `dst.len()` bytes from `offset` out of the data.
    pub(crate) fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= self.len_bytes),
            "copy_out range checked by the caller"
        );
        debug_assert_eq!(self.kind, Kind::Read, "a read under a read slot");
        // SAFETY: the range lies inside the data mapping (asserted), which
        // outlives `self` (it borrows the region or segment). `dst` is
        // memory of this process outside every segment mapping of this
        // buffer (the reader's slice, or the tcp server's piece), so they do
        // not overlap. The slot held makes the owner wait before it takes a
        // reference to the bytes (`access`), so the owner does not write
        // them meanwhile; another peer writing the same range at the same
        // time is a contract violation of the application (torn bytes,
        // docs/semantics.md §6.2), and `u8` is valid for any value.
        unsafe { std::ptr::copy_nonoverlapping(self.data.add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// The bytes `offset..offset + len` of the data, in place: for a reader
    /// that computes on them without copying them out first.
    pub(crate) fn view(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len_bytes),
            "view range checked by the caller"
        );
        debug_assert_eq!(self.kind, Kind::Read, "a view under a read slot");
        // SAFETY: the range lies inside the data mapping (asserted), which
        // outlives `self`, and the slice borrows `self`, so it ends before
        // the slot is given back. As in `copy_out`: the slot makes the owner
        // wait before it takes a reference to the bytes, so it does not
        // write them while the view lives; another peer writing them at
        // the same time violates the application's contract
        // (docs/semantics.md §6.2) and the reader sees torn values, as a
        // copy would (`u8` is valid for any bits).
        unsafe { std::slice::from_raw_parts(self.data.add(offset), len) }
    }

    /// Copies `src` into the data at `offset`.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= self.len_bytes),
            "copy_in range checked by the caller"
        );
        debug_assert_eq!(self.kind, Kind::Write, "a write under a write slot");
        // SAFETY: as in `copy_out`, with the roles swapped; the owner holds
        // no reference to the bytes while a write slot is held (it waits
        // for write slots before any view), and the mapping is writable.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(offset), src.len()) }
    }
}

/// Claims a slot of `gate` for `kind` and wraps the data for copies.
pub(crate) fn enter<'a>(
    gate: Gate<'a>,
    kind: Kind,
    window: Option<Window>,
    data: *mut u8,
    len_bytes: usize,
) -> Result<Entered<'a>, Refusal> {
    Ok(Entered {
        _ticket: gate.enter(kind, window)?,
        data,
        len_bytes,
        kind,
    })
}

/// An allocated segment: the memfd, its mapping and its identity.
pub(crate) struct Region {
    file: File,
    map: MmapRaw,
    len_bytes: usize,
    token: Token,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("fd", &self.file.as_raw_fd())
            .field("len_bytes", &self.len_bytes)
            .finish_non_exhaustive()
    }
}

impl Region {
    fn allocate(len_bytes: usize) -> Result<Self, Error> {
        if len_bytes == 0 || len_bytes as u64 > MAX_BUFFER_BYTES {
            return Err(Error::Length {
                len_bytes: len_bytes as u64,
                max_bytes: MAX_BUFFER_BYTES,
            });
        }
        let pid = std::process::id();
        let fd = rustix::fs::memfd_create(
            format!("{MEMFD_NAME_PREFIX}{pid}"),
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| Error::memory("memfd_create")(e.into()))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))
            .map_err(|e| Error::memory("fchmod 0600")(e.into()))?;
        let total = (HEADER_BYTES + len_bytes) as u64;
        rustix::fs::ftruncate(&fd, total).map_err(|e| Error::memory("ftruncate")(e.into()))?;
        // Reserve the pages now: a full tmpfs fails here with ENOSPC rather
        // than later with SIGBUS on first touch.
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, total)
            .map_err(|e| Error::memory("fallocate")(e.into()))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::memory("seal the memfd")(e.into()))?;
        let file = File::from(fd);
        // Populated: page tables are filled now, so the first transfer runs
        // at copy speed rather than at first-touch speed.
        let map = MmapOptions::new()
            .len(HEADER_BYTES + len_bytes)
            .populate()
            .map_raw(&file)
            .map_err(Error::memory("map the memfd"))?;
        let token = Token::random()?;
        // SAFETY: the mapping is fresh, page-aligned and at least one page
        // long; no other process knows of it yet (no handle exists), so this
        // thread writes the header alone.
        unsafe {
            map.as_mut_ptr().cast::<Header>().write(Header {
                magic: MAGIC,
                state: AtomicU32::new(STATE_ALLOCATED),
                owner_pid: pid,
                len_bytes: len_bytes as u64,
                token: token.0,
                window: AtomicU32::new(0),
            });
        }
        Ok(Self {
            file,
            map,
            len_bytes,
            token,
        })
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    pub(crate) fn token(&self) -> Token {
        self.token
    }

    pub(crate) fn fd(&self) -> u32 {
        self.file.as_fd().as_raw_fd() as u32
    }

    /// The first byte of the data (after the two header pages).
    pub(crate) fn data_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is `HEADER_BYTES + len_bytes` long, so the
        // offset stays inside it.
        unsafe { self.map.as_mut_ptr().add(HEADER_BYTES) }
    }

    pub(crate) fn set_state(&self, state: u32) {
        header_of(&self.map).state.store(state, Ordering::SeqCst);
    }

    /// The state word and slots, as the owner maps them.
    pub(crate) fn gate(&self) -> Gate<'_> {
        let header = header_of(&self.map);
        // SAFETY: the slot page starts `INFO_BYTES` into the mapping, which
        // is `HEADER_BYTES + len_bytes` long and page-aligned, so it holds
        // an aligned `[AtomicU64; SLOTS]` inside the mapping, living as long
        // as `self`; every access to it is atomic.
        let slots = unsafe {
            &*self
                .map
                .as_mut_ptr()
                .add(INFO_BYTES)
                .cast::<[AtomicU64; SLOTS]>()
        };
        Gate {
            state: &header.state,
            window: &header.window,
            slots,
        }
    }

    /// Opens `window` (the claims of its handles are allowed from now on;
    /// those of any earlier window are refused).
    pub(crate) fn set_window(&self, window: Window) {
        header_of(&self.map)
            .window
            .store(window.get(), Ordering::SeqCst);
    }

    /// Closes `window` if it is the open one; whether it was.
    pub(crate) fn close_window(&self, window: Window) -> bool {
        header_of(&self.map)
            .window
            .compare_exchange(window.get(), 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// A slot for a copy of `kind` by this process (the tcp server), under
    /// `window` if the request carried one.
    pub(crate) fn enter(&self, kind: Kind, window: Option<Window>) -> Result<Entered<'_>, Refusal> {
        enter(self.gate(), kind, window, self.data_ptr(), self.len_bytes)
    }

    /// The data as a slice, for the owner.
    ///
    /// # Safety
    /// Nothing writes the bytes while the slice is in use: the memory is
    /// not registered, or the owner closed it to peers' writes and waited
    /// for their slots (`Access::ReadOnly` or `Access::Local`).
    pub(crate) unsafe fn data(&self) -> &[u8] {
        // SAFETY: the data is `len_bytes` long, mapped for as long as
        // `self`; the caller vouches that nothing writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.data_ptr(), self.len_bytes) }
    }

    /// The data as a mutable slice, for the owner.
    ///
    /// # Safety
    /// Nothing else reads or writes the bytes while the slice is in use:
    /// the memory is not registered, or the owner closed it to peers and
    /// waited for their slots (`Access::Local`); and no other reference to
    /// the data exists in this process.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn data_mut(&self) -> &mut [u8] {
        // SAFETY: as in `data`; the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.data_ptr(), self.len_bytes) }
    }
}

/// Memory that can be registered: a shared-memory segment of a given
/// length, zeroed, its pages allocated and mapped (no first-touch cost
/// later). Only memory made here can be registered, because the shm
/// backend needs it to live in a memfd that peers can map.
#[derive(Debug)]
pub struct Memory {
    pub(crate) region: Region,
}

impl Memory {
    /// Allocates `len_bytes` (1 byte to [`MAX_BUFFER_BYTES`]) of zeroed
    /// shared memory.
    pub fn allocate(len_bytes: usize) -> Result<Self, Error> {
        Ok(Self {
            region: Region::allocate(len_bytes)?,
        })
    }

    /// Allocates memory holding a copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Result<Self, Error> {
        let mut m = Self::allocate(bytes.len())?;
        m.copy_from_slice(bytes);
        Ok(m)
    }
}

impl std::ops::Deref for Memory {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: unregistered memory has no handle, so no peer writes it;
        // `&self` excludes writers in this process.
        unsafe { self.region.data() }
    }
}

impl std::ops::DerefMut for Memory {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only
        // reference.
        unsafe { self.region.data_mut() }
    }
}
