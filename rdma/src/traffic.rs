//! What a [`BufferManager`](crate::BufferManager) has moved one-sidedly:
//! bytes and operations, read and written, by backend. Counted by the
//! initiator of each operation that completed (the owner of a buffer
//! counts nothing for its peers' copies), with relaxed atomics: one
//! `fetch_add` per counter per operation, none per chunk.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::config::BackendKind;

/// One backend's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendTraffic {
    /// Bytes read from peers' buffers.
    pub read_bytes: u64,
    /// Reads completed.
    pub reads: u64,
    /// Bytes written into peers' buffers.
    pub written_bytes: u64,
    /// Writes completed.
    pub writes: u64,
}

impl BackendTraffic {
    /// Whether every count of `self` is at least `earlier`'s (counts only
    /// grow).
    pub fn covers(&self, earlier: &Self) -> bool {
        self.read_bytes >= earlier.read_bytes
            && self.reads >= earlier.reads
            && self.written_bytes >= earlier.written_bytes
            && self.writes >= earlier.writes
    }
}

/// A manager's totals since it started, by backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Through shared memory.
    pub shm: BackendTraffic,
    /// Through the tcp fallback.
    pub tcp: BackendTraffic,
    /// Through ibverbs.
    pub ibverbs: BackendTraffic,
}

impl Traffic {
    /// The totals of `backend`.
    pub fn of(&self, backend: BackendKind) -> &BackendTraffic {
        match backend {
            BackendKind::Shm => &self.shm,
            BackendKind::Tcp => &self.tcp,
            BackendKind::Ibverbs => &self.ibverbs,
        }
    }

    /// Bytes read and written through every backend.
    pub fn total_bytes(&self) -> u64 {
        [self.shm, self.tcp, self.ibverbs]
            .iter()
            .map(|b| b.read_bytes.saturating_add(b.written_bytes))
            .fold(0, u64::saturating_add)
    }

    /// Whether every count of `self` is at least `earlier`'s.
    pub fn covers(&self, earlier: &Self) -> bool {
        self.shm.covers(&earlier.shm)
            && self.tcp.covers(&earlier.tcp)
            && self.ibverbs.covers(&earlier.ibverbs)
    }
}

/// The live counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Per backend (ibverbs, shm, tcp): read bytes, reads, written bytes,
    /// writes.
    counts: [[AtomicU64; 4]; 3],
}

/// Which way an operation went.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Way {
    Read,
    Write,
}

fn slot(backend: BackendKind) -> usize {
    match backend {
        BackendKind::Ibverbs => 0,
        BackendKind::Shm => 1,
        BackendKind::Tcp => 2,
    }
}

impl Counters {
    /// An operation of `bytes` through `backend` completed.
    pub(crate) fn count(&self, backend: BackendKind, way: Way, bytes: usize) {
        let c = &self.counts[slot(backend)];
        let (b, n) = match way {
            Way::Read => (&c[0], &c[1]),
            Way::Write => (&c[2], &c[3]),
        };
        b.fetch_add(bytes as u64, Ordering::Relaxed);
        n.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Traffic {
        let of = |backend| {
            let c = &self.counts[slot(backend)];
            BackendTraffic {
                read_bytes: c[0].load(Ordering::Relaxed),
                reads: c[1].load(Ordering::Relaxed),
                written_bytes: c[2].load(Ordering::Relaxed),
                writes: c[3].load(Ordering::Relaxed),
            }
        };
        Traffic {
            shm: of(BackendKind::Shm),
            tcp: of(BackendKind::Tcp),
            ibverbs: of(BackendKind::Ibverbs),
        }
    }
}
