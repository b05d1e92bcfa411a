//! What a proc's view of a mesh makes of failure reports that arrive late.

use std::net::SocketAddr;
use std::num::NonZeroU32;

use regent_net::{ActorId, ActorName, Generation, ProcAddr, ProcId};

use super::KnownMesh;
use crate::policy::{FailureCause, MeshFailure, MeshStatus};
use crate::protocol::{CastToken, MeshId, MeshInfo, Restart};
use crate::shape::{Rank, Shape};

/// A mesh of two procs with two members each, in `generation`.
fn info(generation: u64) -> MeshInfo {
    let proc = |i: u32| ProcId::new(&format!("p{i}")).unwrap();
    MeshInfo {
        id: MeshId(1),
        name: "m".into(),
        actor_type: "t".into(),
        shape: Shape::new([("procs", 2), ("actors", 2)]).unwrap(),
        per_proc: 2,
        procs: (0..2)
            .map(|i| ProcAddr {
                socket: SocketAddr::from(([127, 0, 0, 1], 0)),
                proc: proc(i),
            })
            .collect(),
        fanout: NonZeroU32::new(4).unwrap(),
        owner: ActorId {
            proc: ProcId::new("controller").unwrap(),
            name: ActorName::new("controller").unwrap(),
            index: 0,
        }
        .port(1),
        generation: Generation(generation),
        token: CastToken::random(),
    }
}

fn failure(ranks: &[u32], generation: u64) -> MeshFailure {
    MeshFailure {
        mesh: "m".into(),
        ranks: ranks.iter().copied().map(Rank).collect(),
        cause: FailureCause::Stopped,
        generation: Generation(generation),
    }
}

fn restart(ranks: &[u32], generation: u64) -> Restart {
    Restart {
        generation: Generation(generation),
        ranks: ranks.to_vec(),
        cause: FailureCause::Stopped,
        sources: Vec::new(),
    }
}

#[test]
fn a_failure_report_overtaken_by_its_restart_changes_nothing() {
    let known = KnownMesh::new(info(0));
    // The restart's command arrives first, then the owner's report of the
    // failure it handled.
    known.update(info(1));
    known.restarted(&restart(&[1], 1));
    known.failed(&failure(&[1], 0));
    assert_eq!(*known.status.borrow(), MeshStatus::Running);
    assert!(known.state.borrow().failed.is_empty());
}

#[test]
fn a_survivors_failure_counts_in_a_later_generation() {
    let known = KnownMesh::new(info(0));
    known.update(info(1));
    known.restarted(&restart(&[1], 1));
    // Rank 0's life began in generation 0 and fails in generation 1.
    known.failed(&failure(&[0], 0));
    assert_eq!(*known.status.borrow(), MeshStatus::Restarting);
    assert_eq!(known.state.borrow().failed, vec![Rank(0)]);
    assert_eq!(known.state.borrow().generation, Generation(1));
    // The restarted rank's new life fails too.
    known.failed(&failure(&[1, 3], 1));
    assert_eq!(known.state.borrow().failed, vec![Rank(0), Rank(1), Rank(3)]);
    // The next restart clears them.
    known.update(info(2));
    known.restarted(&restart(&[0, 1, 3], 2));
    assert!(known.state.borrow().failed.is_empty());
    assert_eq!(*known.status.borrow(), MeshStatus::Running);
}

#[test]
fn after_a_gang_restart_every_older_life_is_gone() {
    let known = KnownMesh::new(info(0));
    known.update(info(2));
    known.restarted(&restart(&[3], 1));
    known.restarted(&restart(&[0, 1, 2, 3], 2));
    for rank in 0..4 {
        known.failed(&failure(&[rank], 1));
    }
    assert_eq!(*known.status.borrow(), MeshStatus::Running);
    known.failed(&failure(&[2], 2));
    assert_eq!(known.state.borrow().failed, vec![Rank(2)]);
}
