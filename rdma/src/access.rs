//! Who may touch a registered buffer's bytes, and the interlock that makes
//! the owner's local views sound.
//!
//! A buffer is in one of three [`Access`] states, kept in the state word of
//! its segment header (written only by the owner). Every copy a peer makes
//! (the shm backend in another process, the owner's own tcp server task)
//! is bracketed by an *access slot* in the header's second page:
//!
//! 1. claim a free slot: compare-and-swap `0 -> pid | seq | kind` (SeqCst;
//!    `seq` numbers this process's claims, so no two claims look alike);
//! 2. load the state word (SeqCst); if it does not allow `kind`, free the
//!    slot and refuse the operation ([`crate::Error::Closed`]);
//! 3. copy; 4. free the slot (store 0, Release).
//!
//! The owner narrows access by storing the new state (SeqCst), then taking
//! a snapshot of the held slots of a conflicting kind (SeqCst loads), and
//! waiting until each of those claims is gone. In the single total order of
//! SeqCst operations either the peer's state load follows the owner's store
//! (the peer refuses) or the owner's slot load follows the peer's claim (the
//! claim is in the snapshot, and the owner waits for its release, whose
//! Release store its Acquire load then synchronises with). Claims made after
//! the snapshot see the new state and refuse, so they are not waited for: a
//! storm of refused retries cannot starve the owner. Once the wait ends, no
//! peer copy of a conflicting kind is running or can start, and the owner
//! may hold references to the bytes. Widening access (reopening)
//! needs no wait: the state store (SeqCst, so Release) orders the owner's
//! earlier writes before any copy that sees the new state.
//!
//! A *window* narrows one exchange further ([`Window`]): a handle made by
//! [`crate::LocalBuffer::open_window`] carries the window, every claim made
//! through it checks (step 2, SeqCst) that the header's window word still
//! holds it, and [`crate::LocalBuffer::close_window`] stores another value,
//! snapshots the held slots and waits for them as a narrowing of access
//! does. So once a window is closed, nobody holding its handle copies into
//! or out of the buffer again, even if the buffer is opened to peers anew:
//! a zombie of an exchange that failed cannot touch the next one's bytes.
//!
//! A slot of a process that died while copying is freed by the owner when
//! it finds the process gone (a pidfd that polls readable, or no such
//! process). A stopped peer keeps its slot: the owner's wait then ends at
//! its deadline with [`crate::Error::Busy`], and the buffer keeps its
//! previous access.

use std::num::NonZeroU32;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, PidfdFlags};

/// What peers may do with a registered buffer, and so what its owner may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Open to peers: they read and write it one-sidedly. The owner has no
    /// safe view of the bytes (a peer may be writing them at any time);
    /// it closes the buffer first, or goes through the raw pointer under
    /// the contract of [`crate::LocalBuffer::as_ptr`].
    Exposed,
    /// Peers read it; their writes are refused with [`crate::Error::Closed`].
    /// The owner reads it too ([`crate::LocalBuffer::as_slice`]).
    ReadOnly,
    /// Closed to peers: their reads and writes are refused with
    /// [`crate::Error::Closed`]. The owner reads and writes it
    /// ([`crate::LocalBuffer::as_mut_slice`]).
    Local,
}

impl Access {
    /// Whether peers may run operations of `kind`.
    pub(crate) fn allows(self, kind: Kind) -> bool {
        match self {
            Self::Exposed => true,
            Self::ReadOnly => kind == Kind::Read,
            Self::Local => false,
        }
    }

    /// The header's state word for this access.
    pub(crate) fn state(self) -> u32 {
        match self {
            Self::Exposed => STATE_EXPOSED,
            Self::ReadOnly => STATE_READ_ONLY,
            Self::Local => STATE_LOCAL,
        }
    }
}

/// A grant of peers' access to a registered buffer for one exchange: the
/// value of the header's window word while it is open (never 0, which
/// means no window is open). A handle carrying it works only while the
/// owner keeps this window open (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Window(NonZeroU32);

impl Window {
    /// A window no earlier one of this process had (until the 32-bit
    /// counter wraps, after 4 billion windows).
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        loop {
            if let Some(w) = NonZeroU32::new(NEXT.fetch_add(1, Ordering::Relaxed)) {
                return Self(w);
            }
        }
    }

    /// The window word's value.
    pub(crate) fn get(self) -> u32 {
        self.0.get()
    }

    /// The window of a word read off the wire (`None` for 0).
    pub(crate) fn from_word(word: u32) -> Option<Self> {
        NonZeroU32::new(word).map(Self)
    }
}

/// The state word: memory allocated but not registered.
pub(crate) const STATE_ALLOCATED: u32 = 0;
/// Registered and [`Access::Exposed`].
pub(crate) const STATE_EXPOSED: u32 = 1;
/// Released: every later operation fails with `Released`.
pub(crate) const STATE_RELEASED: u32 = 2;
/// Registered and [`Access::ReadOnly`].
pub(crate) const STATE_READ_ONLY: u32 = 3;
/// Registered and [`Access::Local`].
pub(crate) const STATE_LOCAL: u32 = 4;

/// What a peer's copy does to the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Copies out of the buffer.
    Read = 1,
    /// Copies into the buffer.
    Write = 2,
}

/// Access slots in the header's second page.
pub(crate) const SLOTS: usize = 512;
/// The slot table: one page of `u64` words.
pub(crate) const SLOT_PAGE_BYTES: usize = SLOTS * 8;
const _: () = assert!(SLOT_PAGE_BYTES == 4096);

/// A slot's value: the pid in the high half, then 30 bits of the claim's
/// sequence number, then 2 bits of kind (never 0, so never free).
fn slot_value(pid: u32, seq: u32, kind: Kind) -> u64 {
    (u64::from(pid) << 32) | (u64::from(seq & 0x3fff_ffff) << 2) | kind as u64
}

fn slot_pid(v: u64) -> u32 {
    (v >> 32) as u32
}

fn slot_kind(v: u64) -> Kind {
    if v & 3 == Kind::Write as u64 {
        Kind::Write
    } else {
        Kind::Read
    }
}

/// Where each claim starts looking, spread over the table; also the
/// claims' sequence numbers.
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

/// Claims of other copies that an owner's change of access waits for: the
/// slots and the values they held when the new state was in place.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    claims: Vec<(usize, u64)>,
}

impl Waiting {
    /// Whether every claim waited for is gone.
    pub(crate) fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    /// The processes whose claims are still waited for.
    pub(crate) fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.claims.iter().map(|&(_, v)| slot_pid(v)).collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// Why a claim failed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Every slot is held: try again shortly.
    Full,
    /// The state word does not allow the operation (its value).
    State(u32),
    /// The claim's window is no longer open.
    Window,
}

/// The state word and slot table of one segment, as mapped here.
#[derive(Clone, Copy)]
pub(crate) struct Gate<'a> {
    pub(crate) state: &'a AtomicU32,
    /// The open window (0: none).
    pub(crate) window: &'a AtomicU32,
    pub(crate) slots: &'a [AtomicU64; SLOTS],
}

impl<'a> Gate<'a> {
    /// Claims a slot for a copy of `kind` by this process, then checks the
    /// state and, for a claim made under a window, that the window is still
    /// open. The slot is freed when the returned ticket drops.
    pub(crate) fn enter(self, kind: Kind, window: Option<Window>) -> Result<Ticket<'a>, Refusal> {
        let start = NEXT_SLOT.fetch_add(1, Ordering::Relaxed);
        let value = slot_value(std::process::id(), start as u32, kind);
        let slot = (0..SLOTS)
            .map(|i| &self.slots[(start + i) % SLOTS])
            .find(|s| {
                s.compare_exchange(0, value, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok()
            })
            .ok_or(Refusal::Full)?;
        let ticket = Ticket { slot };
        let state = self.state.load(Ordering::SeqCst);
        let allowed = match state {
            STATE_EXPOSED => true,
            STATE_READ_ONLY => kind == Kind::Read,
            _ => false,
        };
        if !allowed {
            return Err(Refusal::State(state));
        }
        match window {
            Some(w) if self.window.load(Ordering::SeqCst) != w.get() => Err(Refusal::Window),
            _ => Ok(ticket),
        }
    }

    /// Every claim held now, of any kind: to be called after a window is
    /// closed (claims made later see it closed and refuse).
    pub(crate) fn held(self) -> Waiting {
        let mut waiting = Waiting::default();
        for (i, slot) in self.slots.iter().enumerate() {
            let v = slot.load(Ordering::SeqCst);
            if v != 0 {
                waiting.claims.push((i, v));
            }
        }
        self.settle(&mut waiting);
        waiting
    }

    /// The claims of a kind that `previous` allowed and `access` forbids,
    /// held now: to be called after the new state is stored. Claims of
    /// kinds `previous` already forbade belong to peers about to refuse;
    /// they never copy, so they are not waited for (widening never waits).
    pub(crate) fn conflicting(self, previous: Access, access: Access) -> Waiting {
        let mut waiting = Waiting::default();
        for (i, slot) in self.slots.iter().enumerate() {
            let v = slot.load(Ordering::SeqCst);
            if v == 0 {
                continue;
            }
            let kind = slot_kind(v);
            if access.allows(kind) || !previous.allows(kind) {
                continue;
            }
            waiting.claims.push((i, v));
        }
        self.settle(&mut waiting);
        waiting
    }

    /// Drops the claims that are gone from `waiting`: released (the slot
    /// holds another value, or none), or of a process that died inside its
    /// copy (its slot is freed here, since nothing else will).
    pub(crate) fn settle(self, waiting: &mut Waiting) {
        let me = std::process::id();
        waiting.claims.retain(|&(i, v)| {
            let slot = &self.slots[i];
            if slot.load(Ordering::SeqCst) != v {
                return false;
            }
            let pid = slot_pid(v);
            if pid != me && gone(pid) {
                // A failed exchange means it changed (was freed) meanwhile.
                let _ = slot.compare_exchange(v, 0, Ordering::SeqCst, Ordering::Relaxed);
                return false;
            }
            true
        });
    }
}

/// A held access slot; dropping it frees the slot.
pub(crate) struct Ticket<'a> {
    slot: &'a AtomicU64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        // Release: the copy made under the slot happens before an owner's
        // Acquire load that sees the slot free.
        self.slot.store(0, Ordering::Release);
    }
}

/// Whether the process behind `pidfd` has exited.
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(n) => n > 0,
        // A pidfd that cannot be polled is no proof of life.
        Err(_) => true,
    }
}

/// Whether process `pid` is gone (exited, also if not yet reaped). A pid
/// reused by a new process looks alive: the owner then waits until its
/// deadline, never frees a live copy's slot.
fn gone(pid: u32) -> bool {
    let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return true;
    };
    match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => exited(&fd),
        Err(rustix::io::Errno::SRCH) => true,
        // Not allowed to look (EPERM, out of descriptors): assume alive.
        Err(_) => false,
    }
}
