//! The payload plane: registered buffers that a peer reads and writes
//! one-sidedly, through ibverbs, shared memory or an authenticated TCP
//! fallback. Tensors ride here, not on control messages.
//!
//! # Shape
//!
//! - A [`BufferManager`] per proc. [`Memory::allocate`] makes shared memory
//!   (a sealed memfd, populated); [`BufferManager::register`] turns it into
//!   a [`LocalBuffer`] whose [`RemoteBuffer`] handle (owner, id, length,
//!   host, capability token, one descriptor per backend; serde, small,
//!   validated on decode) goes to peers over the control plane.
//! - A peer calls [`BufferManager::read_into`] / [`BufferManager::write_from`]
//!   with the handle, an offset and a local slice, or runs a [`Batch`].
//!   Out-of-range requests fail before any transfer.
//! - A buffer's [`Access`] says what peers may do: [`Access::Exposed`]
//!   (read and write), [`Access::ReadOnly`] (read) or [`Access::Local`]
//!   (nothing: their operations fail with [`Error::Closed`]). The owner
//!   sees the bytes only while peers cannot write them
//!   ([`LocalBuffer::as_slice`], [`LocalBuffer::as_mut_slice`], the guard
//!   of [`LocalBuffer::lock_local`]); closing waits for peers' copies in
//!   flight, which each hold an access slot of the segment.
//! - The backend per (reader, buffer) pair comes from [`choose_backend`]:
//!   `ibverbs` when both ends have a device, else `shm` on the same host
//!   (equal [`HostId`]), else `tcp`; a [`BackendPolicy`] can force one.
//! - Releasing (dropping) a [`LocalBuffer`], or the owner's death, makes
//!   peers' operations fail with [`Error::Released`] / [`Error::OwnerDied`]
//!   (shm) or [`Error::Link`] (tcp), never hang: shm checks a state word in
//!   the segment header and polls a pidfd of the owner between chunks; tcp
//!   has deadlines on every chunk.
//!
//! # Backends
//!
//! - `shm` (same host): the peer opens the owner's memfd through
//!   `/proc/<pid>/fd/<fd>`, checks its seals, size and token, maps it and
//!   copies with the CPU; the owner's threads do nothing. Large copies run
//!   off the runtime's worker threads, so the control plane's tasks keep
//!   running. No name exists in any file system, so nothing is left behind
//!   when the owner dies.
//! - `tcp` (across hosts): mutual TLS with the cluster's certificates
//!   ([`regent_net::ProcCredentials`]), chunked (4 MiB) and pipelined, on one
//!   or more connections; the owner's serving task does the copying. Every
//!   wait has a deadline, and connections that never finish a handshake
//!   cannot crowd out those that do.
//! - `ibverbs` (cargo feature): RC queue pairs and RDMA READ/WRITE through
//!   `sideway`; [`ibverbs_available`] says whether a device is present.
//!
//! `docs/semantics.md` §6 states the contract (visibility, ordering,
//! invalidation, limits, security); `ARCHITECTURE.md` has the code map.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use regent_net::{ClusterCa, ProcId};
//! use regent_rdma::{BufferManager, ManagerConfig, Memory, RemoteBuffer};
//!
//! let ca = ClusterCa::generate("example")?;
//! let owner = BufferManager::start(ManagerConfig::default(), ca.issue(&ProcId::new("a")?, regent_net::Role::Proc, regent_net::Validity::job())?).await?;
//! let reader = BufferManager::start(ManagerConfig::default(), ca.issue(&ProcId::new("b")?, regent_net::Role::Proc, regent_net::Validity::job())?).await?;
//!
//! let mut memory = Memory::allocate(1 << 20)?;
//! memory[..5].copy_from_slice(b"hello");
//! let buffer = owner.register(memory)?;
//! // The handle travels on the control plane as bytes.
//! let handle = RemoteBuffer::decode(&buffer.handle().encode())?;
//!
//! let mut local = vec![0u8; 5];
//! reader.read_into(&handle, 0, &mut local).await?;
//! assert_eq!(&local, b"hello");
//! # Ok(())
//! # }
//! ```
//!
//! This is one of the two crates allowed `unsafe`; every block carries a
//! `// SAFETY:` note.
#![deny(unsafe_op_in_unsafe_fn)]

mod access;
mod choice;
pub mod config;
pub mod error;
pub mod handle;
mod ids;
mod manager;
mod memory;
mod shm;
mod tcp;
mod traffic;
mod verbs;

pub use access::{Access, Window};
pub use choice::{LocalCaps, choose_backend};
pub use config::{BackendKind, BackendPolicy, ManagerConfig};
pub use error::Error;
pub use handle::{
    BufferId, HostId, MAX_BUFFER_BYTES, RemoteBuffer, ShmDescriptor, TcpDescriptor, VerbsDescriptor,
};
pub use manager::{
    Batch, BufferManager, LocalBuffer, LocalGuard, MAX_BATCH_CONCURRENCY, MAX_BATCH_OPS, Op,
    StalledCopy,
};
pub use memory::{MEMFD_NAME_PREFIX, Memory};
pub use tcp::TcpLoad;
// The tcp backend's AEAD work alone, for `regent bench rdma`; not API.
#[doc(hidden)]
pub use tcp::seal_and_open as tcp_seal_and_open;
pub use traffic::{BackendTraffic, Traffic};
pub use verbs::available as ibverbs_available;
// The fuzzing entry points of the tcp backend's frames and headers (fuzz/),
// not API.
#[doc(hidden)]
pub use tcp::sealed::{fuzz_open as fuzz_tcp_open, fuzz_seal as fuzz_tcp_seal};
#[doc(hidden)]
pub use tcp::wire::{fuzz_request as fuzz_tcp_request, fuzz_response as fuzz_tcp_response};

#[cfg(test)]
mod tests;
