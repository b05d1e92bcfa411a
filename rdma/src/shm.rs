//! The shm backend, reader side: a peer on the same host maps the owner's
//! memfd and copies with the CPU; the owner's threads do nothing.
//!
//! A handle names the memfd by the owner's pid and descriptor number. The
//! reader first opens a pidfd of the owner, then opens
//! `/proc/<pid>/fd/<fd>` (the kernel allows this to processes that may
//! ptrace-read the owner: the same user, and the memfd's mode is 0600),
//! checks that it is a sealed memfd of the right size whose header carries
//! the handle's 128-bit token and the registered state, and maps it. The
//! pidfd, opened before the memfd, pins the identity: a reused pid cannot
//! hold the token.
//!
//! Every chunk of a copy (256 MiB by default) runs under an access slot of
//! the segment (see [`crate::access`]): the owner may have closed the
//! buffer to peers ([`Error::Closed`]). Liveness: every chunk also checks
//! the header's state word (the owner sets it to released before freeing)
//! and polls the pidfd (readable once the owner has exited); the copy fails
//! with [`Error::Released`] or [`Error::OwnerDied`]. A sweeper unmaps
//! segments whose owner died or released them, so a dead owner's memory is
//! freed even if no operation touches it again.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};
use regent_net::ProcId;
use rustix::fs::{Mode, OFlags, SealFlags};
use rustix::process::{Pid, PidfdFlags};

use crate::access::{
    Gate, Kind, Refusal, SLOT_PAGE_BYTES, STATE_EXPOSED, STATE_LOCAL, STATE_READ_ONLY, Window,
    exited,
};
use crate::error::Error;
use crate::handle::{BufferId, RemoteBuffer, Token};
use crate::memory::{Entered, HEADER_BYTES, Header, INFO_BYTES, MAGIC, header_of, slots_at};

/// Another proc's segment, mapped here.
pub(crate) struct PeerSegment {
    owner: ProcId,
    buffer: BufferId,
    pidfd: OwnedFd,
    /// The info page, read-only.
    header: MmapRaw,
    /// The slot page and the data after it, read-write.
    body: MmapRaw,
    len_bytes: usize,
}

impl PeerSegment {
    /// Opens and checks the segment that `remote` names.
    pub(crate) fn open(remote: &RemoteBuffer) -> Result<Self, Error> {
        let owner = remote.owner().clone();
        let buffer = remote.id();
        let shm_err = |reason: String| Error::Shm {
            owner: owner.clone(),
            buffer,
            reason,
        };
        let died = || Error::OwnerDied {
            owner: owner.clone(),
            buffer,
        };
        let desc = remote
            .shm()
            .ok_or_else(|| shm_err("the handle has no shm descriptor".into()))?;
        let len_bytes = usize::try_from(remote.len_bytes())
            .map_err(|_| shm_err("length does not fit this machine".into()))?;
        let pid = Pid::from_raw(desc.pid as i32).ok_or_else(|| shm_err("pid 0".into()))?;
        let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::SRCH) => return Err(died()),
            Err(e) => return Err(shm_err(format!("pidfd_open({}): {e}", desc.pid))),
        };
        let path = format!("/proc/{}/fd/{}", desc.pid, desc.fd);
        let fd = match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => fd,
            Err(_) if exited(&pidfd) => return Err(died()),
            Err(e @ (rustix::io::Errno::ACCESS | rustix::io::Errno::PERM)) => {
                return Err(shm_err(format!("open {path}: {e}")));
            }
            // The owner closed the descriptor (it released the buffer), and
            // the number is free or names something else (a socket, ...).
            Err(_) => return Err(Error::Released { owner, buffer }),
        };
        // From here on, a descriptor that is not our segment (not a sealed
        // memfd, another size, another token) means the owner closed the
        // one of the handle and the number was reused: released.
        let released = || Error::Released {
            owner: owner.clone(),
            buffer,
        };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| released())?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(released());
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| shm_err(format!("fstat: {e}")))?;
        if (stat.st_size as u64) < HEADER_BYTES as u64 {
            return Err(released());
        }
        let file = File::from(fd);
        let header = MmapOptions::new()
            .len(INFO_BYTES)
            .map_raw_read_only(&file)
            .map_err(|e| shm_err(format!("map header: {e}")))?;
        let h: &Header = header_of(&header);
        if h.magic != MAGIC || h.owner_pid != desc.pid || Token(h.token) != remote.token() {
            return Err(released());
        }
        // The right segment, but the handle lies about its length.
        let total = HEADER_BYTES as u64 + remote.len_bytes();
        if h.len_bytes != remote.len_bytes() || stat.st_size as u64 != total {
            return Err(shm_err(format!(
                "the handle says {} bytes, the segment holds {}",
                remote.len_bytes(),
                h.len_bytes
            )));
        }
        let body = MmapOptions::new()
            .offset(INFO_BYTES as u64)
            .len(SLOT_PAGE_BYTES + len_bytes)
            .populate()
            .map_raw(&file)
            .map_err(|e| shm_err(format!("map data: {e}")))?;
        let segment = Self {
            owner,
            buffer,
            pidfd,
            header,
            body,
            len_bytes,
        };
        segment.check()?;
        Ok(segment)
    }

    fn released(&self) -> Error {
        Error::Released {
            owner: self.owner.clone(),
            buffer: self.buffer,
        }
    }

    /// Fails if the owner released the buffer or died (an owner that
    /// closed it to peers for now has neither).
    pub(crate) fn check(&self) -> Result<(), Error> {
        let state = header_of(&self.header).state.load(Ordering::SeqCst);
        if !matches!(state, STATE_EXPOSED | STATE_READ_ONLY | STATE_LOCAL) {
            return Err(self.released());
        }
        if exited(&self.pidfd) {
            return Err(Error::OwnerDied {
                owner: self.owner.clone(),
                buffer: self.buffer,
            });
        }
        Ok(())
    }

    /// The segment's slot table (for tests).
    #[cfg(test)]
    pub(crate) fn slots(&self) -> &[std::sync::atomic::AtomicU64; crate::access::SLOTS] {
        slots_at(&self.body)
    }

    /// A slot for one chunk of a copy of `kind` (under `window`, for a
    /// windowed handle): `Ok(None)` when every slot is held (try again
    /// shortly), [`Error::Closed`] when the owner does not allow `kind` now
    /// or closed the window, and the errors of [`Self::check`].
    pub(crate) fn enter(
        &self,
        kind: Kind,
        window: Option<Window>,
    ) -> Result<Option<Entered<'_>>, Error> {
        self.check()?;
        let header = header_of(&self.header);
        let gate = Gate {
            state: &header.state,
            window: &header.window,
            slots: slots_at(&self.body),
        };
        // SAFETY: the data starts one slot page into the body mapping,
        // which is `SLOT_PAGE_BYTES + len_bytes` long.
        let data = unsafe { self.body.as_mut_ptr().add(SLOT_PAGE_BYTES) };
        match crate::memory::enter(gate, kind, window, data, self.len_bytes) {
            Ok(entered) => Ok(Some(entered)),
            Err(Refusal::Full) => Ok(None),
            Err(Refusal::State(STATE_READ_ONLY | STATE_LOCAL) | Refusal::Window) => {
                Err(Error::Closed {
                    owner: self.owner.clone(),
                    buffer: self.buffer,
                    write: kind == Kind::Write,
                })
            }
            Err(Refusal::State(_)) => Err(self.released()),
        }
    }
}

/// The key of a mapped segment: its owner, buffer and token (a handle with
/// another token names another segment).
type SegmentKey = (ProcId, BufferId, [u8; 16]);

/// Segments of other procs mapped by this one, bounded.
pub(crate) struct PeerSegments {
    map: Mutex<HashMap<SegmentKey, Arc<PeerSegment>>>,
    max_entries: usize,
}

impl PeerSegments {
    pub(crate) fn new(max_entries: usize) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            max_entries,
        }
    }

    fn key(remote: &RemoteBuffer) -> SegmentKey {
        (remote.owner().clone(), remote.id(), remote.token().0)
    }

    /// The mapped segment of `remote`, opened on first use.
    pub(crate) fn get(&self, remote: &RemoteBuffer) -> Result<Arc<PeerSegment>, Error> {
        let key = Self::key(remote);
        if let Some(s) = self.lock().get(&key) {
            return Ok(s.clone());
        }
        // Opened outside the lock: mapping a large segment takes a while.
        let segment = Arc::new(PeerSegment::open(remote)?);
        let mut map = self.lock();
        if map.len() >= self.max_entries {
            // Bounded: drop an arbitrary mapping (in-flight operations keep
            // theirs alive through their `Arc`).
            if let Some(k) = map.keys().next().cloned() {
                map.remove(&k);
            }
        }
        Ok(map.entry(key).or_insert(segment).clone())
    }

    /// Forgets the mapping of `remote` (after it failed).
    pub(crate) fn forget(&self, remote: &RemoteBuffer) {
        self.lock().remove(&Self::key(remote));
    }

    /// Unmaps every segment whose owner released it or died; returns how
    /// many.
    pub(crate) fn sweep(&self) -> usize {
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, s| s.check().is_ok());
        before - map.len()
    }

    /// How many segments are mapped.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SegmentKey, Arc<PeerSegment>>> {
        // A panic while holding this lock leaves the map consistent (every
        // operation on it is a single insert, remove or retain).
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}
