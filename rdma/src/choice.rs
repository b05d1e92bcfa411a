//! The backend choice for a (reader, buffer) pair: a pure function of the
//! policy, what this side can do and what the handle offers, so it is
//! tested without sockets or memory.

use crate::config::{BackendKind, BackendPolicy};
use crate::error::Error;
use crate::handle::{HostId, RemoteBuffer};

/// What the reading side can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalCaps {
    /// The reader's host.
    pub host: HostId,
    /// Whether the reader may map other procs' segments.
    pub shm: bool,
    /// Whether the reader has an open verbs device.
    pub ibverbs: bool,
}

/// Picks the backend for reaching `remote` from a proc with `local`'s
/// capabilities:
///
/// - [`BackendPolicy::Auto`]: ibverbs when both ends have a device (the
///   handle carries a verbs descriptor and the reader has a device); else
///   shm when both run on one host (equal [`HostId`]) and the owner serves
///   shm; else tcp.
/// - [`BackendPolicy::Only`]: that backend, or [`Error::NoBackend`] saying
///   why it cannot reach the buffer.
pub fn choose_backend(
    policy: BackendPolicy,
    local: &LocalCaps,
    remote: &RemoteBuffer,
) -> Result<BackendKind, Error> {
    let usable = |kind: BackendKind| -> Result<(), &'static str> {
        match kind {
            BackendKind::Ibverbs if !local.ibverbs => Err("no verbs device here"),
            BackendKind::Ibverbs if remote.verbs().is_none() => {
                Err("the owner registered no verbs region")
            }
            // The NIC does not look at the header: a window could not be
            // closed against it (that needs a new memory region per window).
            BackendKind::Ibverbs if remote.window().is_some() => {
                Err("a windowed handle is served by shm or tcp only")
            }
            BackendKind::Shm if !local.shm => Err("shm is off here"),
            BackendKind::Shm if remote.shm().is_none() => Err("the owner serves no shm"),
            BackendKind::Shm if remote.host() != local.host => Err("the owner is on another host"),
            BackendKind::Tcp if remote.tcp().is_none() => Err("the owner serves no tcp"),
            _ => Ok(()),
        }
    };
    let candidates: &[BackendKind] = match policy {
        BackendPolicy::Auto => &[BackendKind::Ibverbs, BackendKind::Shm, BackendKind::Tcp],
        BackendPolicy::Only(BackendKind::Ibverbs) => &[BackendKind::Ibverbs],
        BackendPolicy::Only(BackendKind::Shm) => &[BackendKind::Shm],
        BackendPolicy::Only(BackendKind::Tcp) => &[BackendKind::Tcp],
    };
    let mut reasons = Vec::new();
    for &kind in candidates {
        match usable(kind) {
            Ok(()) => return Ok(kind),
            Err(why) => reasons.push(format!("{kind}: {why}")),
        }
    }
    Err(Error::NoBackend {
        owner: remote.owner().clone(),
        buffer: remote.id(),
        reason: reasons.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::{BufferId, ShmDescriptor, TcpDescriptor, Token, VerbsDescriptor};
    use regent_net::ProcId;

    fn handle(host: u8, shm: bool, tcp: bool, verbs: bool) -> RemoteBuffer {
        RemoteBuffer::new(
            ProcId::new("owner").unwrap(),
            BufferId(1),
            10,
            HostId([host; 16]),
            Token([1; 16]),
            shm.then_some(ShmDescriptor { pid: 10, fd: 3 }),
            tcp.then(|| TcpDescriptor {
                addr: "127.0.0.1:9".parse().unwrap(),
            }),
            verbs.then_some(VerbsDescriptor {
                addr: 4096,
                rkey: 7,
            }),
        )
        .unwrap()
    }

    fn caps(host: u8, shm: bool, ibverbs: bool) -> LocalCaps {
        LocalCaps {
            host: HostId([host; 16]),
            shm,
            ibverbs,
        }
    }

    #[test]
    fn auto_prefers_verbs_then_shm_on_one_host_then_tcp() {
        let auto = BackendPolicy::Auto;
        let c = |l: &LocalCaps, r: &RemoteBuffer| choose_backend(auto, l, r).unwrap();
        assert_eq!(
            c(&caps(1, true, true), &handle(1, true, true, true)),
            BackendKind::Ibverbs
        );
        assert_eq!(
            c(&caps(1, true, false), &handle(1, true, true, true)),
            BackendKind::Shm
        );
        assert_eq!(
            c(&caps(1, true, true), &handle(1, true, true, false)),
            BackendKind::Shm
        );
        assert_eq!(
            c(&caps(2, true, false), &handle(1, true, true, false)),
            BackendKind::Tcp
        );
        assert_eq!(
            c(&caps(1, false, false), &handle(1, true, true, false)),
            BackendKind::Tcp
        );
        assert_eq!(
            c(&caps(1, true, false), &handle(1, false, true, false)),
            BackendKind::Tcp
        );
        let e = choose_backend(auto, &caps(2, true, false), &handle(1, true, false, false));
        assert!(matches!(e, Err(Error::NoBackend { .. })), "{e:?}");
        // A windowed handle never goes through verbs (the NIC cannot be
        // kept out of a closed window).
        let windowed = handle(1, true, true, true).with_window(crate::Window::fresh());
        assert_eq!(c(&caps(1, true, true), &windowed), BackendKind::Shm);
        assert_eq!(c(&caps(2, true, true), &windowed), BackendKind::Tcp);
        let e = choose_backend(
            BackendPolicy::Only(BackendKind::Ibverbs),
            &caps(1, true, true),
            &windowed,
        )
        .unwrap_err();
        assert!(e.to_string().contains("windowed"), "{e}");
    }

    #[test]
    fn only_forces_a_backend_or_says_why_not() {
        let only = |k| BackendPolicy::Only(k);
        let r = handle(1, true, true, false);
        assert_eq!(
            choose_backend(only(BackendKind::Tcp), &caps(1, true, false), &r).unwrap(),
            BackendKind::Tcp
        );
        let e = choose_backend(only(BackendKind::Shm), &caps(2, true, false), &r).unwrap_err();
        assert!(e.to_string().contains("another host"), "{e}");
        let e = choose_backend(only(BackendKind::Ibverbs), &caps(1, true, false), &r).unwrap_err();
        assert!(e.to_string().contains("no verbs device"), "{e}");
    }
}
