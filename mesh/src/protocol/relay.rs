//! The wire types of relayed commands (the relay module): what the owner
//! signs ([`Relayed`]), the frame that carries it down the tree
//! ([`RelayFrame`]) and what comes back ([`RelayOutcome`]).

use bytes::Bytes;
use regent_net::{ProcAddr, ProcId};
use serde::{Deserialize, Serialize};

use super::{
    MAX_BUDGET_MS, MAX_PROCS, MeshChange, MeshId, MeshInfo, ProcCommand, ReplyTo, Restart,
};

/// The most failed procs an outcome names; more are only counted.
pub const MAX_RELAY_FAILED: usize = 4096;
/// The longest reason an outcome keeps for one failed proc.
const MAX_REASON_BYTES: usize = 512;

/// What the owner signs: a command and its sequence number.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Relayed {
    /// Unique per owner, from 1 up.
    pub seq: u64,
    /// The command.
    pub body: RelayBody,
}

/// A command every proc of a route carries out.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RelayBody {
    /// The owner is alive: renew its lease.
    Renew,
    /// Spawn each proc's members of a mesh (its proc rank is its hop's).
    Spawn {
        /// The mesh.
        info: Box<MeshInfo>,
        /// The encoded arguments of every member.
        args: Bytes,
        /// Why the members start.
        start: Option<Restart>,
    },
    /// Enroll each proc's members in a new generation of a mesh.
    Update {
        /// The mesh.
        mesh: MeshId,
        /// The change, from a generation every proc of the route knows.
        change: MeshChange,
        /// What changed (survivors are told).
        restart: Option<Restart>,
    },
}

impl RelayBody {
    /// The command a proc of rank `rank` runs for this, answering `reply_to`
    /// with `call` (a renewal answers nothing: it is done when taken).
    pub(crate) fn command(self, rank: u32, call: u64, reply_to: regent_net::PortId) -> ProcCommand {
        match self {
            Self::Renew => ProcCommand::Renew,
            Self::Spawn { info, args, start } => ProcCommand::Spawn {
                call,
                reply_to,
                info: *info,
                proc_rank: rank,
                args,
                start,
            },
            Self::Update {
                mesh,
                change,
                restart,
            } => ProcCommand::Update {
                call,
                reply_to,
                mesh,
                change,
                restart,
            },
        }
    }
}

/// One proc of a route: its rank (in the command's mesh; 0 for a renewal)
/// and where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hop {
    /// The proc's rank in the command's mesh.
    pub rank: u32,
    /// The proc.
    pub addr: ProcAddr,
}

/// A signed command on its way down the tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelayFrame {
    /// The encoded [`Relayed`].
    pub signed: Bytes,
    /// The owner's Ed25519 signature of it.
    pub signature: Bytes,
    /// The procs this node's subtree covers; the node is the first.
    pub route: Vec<Hop>,
    /// The tree's fan-out.
    pub fanout: u32,
    /// Where the subtree's outcome goes; `None`: nowhere.
    pub reply: Option<ReplyTo>,
    /// How long this node may take before it reports what it has.
    pub budget_ms: u32,
}

impl RelayFrame {
    /// Checks the bounds a node relies on before it trusts anything.
    pub fn validate(&self) -> Result<(), String> {
        if self.route.is_empty() || self.route.len() > MAX_PROCS as usize {
            return Err(format!("a route of {} procs", self.route.len()));
        }
        if self.route.iter().any(|h| h.rank >= MAX_PROCS) {
            return Err("a proc rank out of range".into());
        }
        if self.fanout == 0 || self.fanout > MAX_PROCS {
            return Err(format!("a fan-out of {}", self.fanout));
        }
        if self.budget_ms > MAX_BUDGET_MS {
            return Err(format!("a budget of {} ms", self.budget_ms));
        }
        if self.signature.len() != 64 {
            return Err(format!("a signature of {} bytes", self.signature.len()));
        }
        Ok(())
    }
}

/// What came of a relayed command in a subtree.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayOutcome {
    /// Procs that carried it out.
    pub done: u32,
    /// Procs that did not, and why (at most [`MAX_RELAY_FAILED`]).
    pub failed: Vec<(ProcId, String)>,
    /// Failures past [`MAX_RELAY_FAILED`], only counted.
    pub more_failed: u32,
}

impl RelayOutcome {
    /// Procs the outcome accounts for.
    pub fn procs(&self) -> u64 {
        u64::from(self.done) + self.failed.len() as u64 + u64::from(self.more_failed)
    }

    /// Whether every proc carried it out.
    pub fn all_done(&self) -> bool {
        self.failed.is_empty() && self.more_failed == 0
    }

    pub(crate) fn fail(&mut self, proc: &ProcId, why: &str) {
        if self.failed.len() >= MAX_RELAY_FAILED {
            self.more_failed = self.more_failed.saturating_add(1);
            return;
        }
        let mut end = why.len().min(MAX_REASON_BYTES);
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        self.failed.push((proc.clone(), why[..end].to_owned()));
    }

    pub(crate) fn fail_all(&mut self, hops: &[Hop], why: &str) {
        for h in hops {
            self.fail(&h.addr.proc, why);
        }
    }

    pub(crate) fn merge(&mut self, other: Self) {
        self.done = self.done.saturating_add(other.done);
        self.more_failed = self.more_failed.saturating_add(other.more_failed);
        for (proc, why) in other.failed {
            self.fail(&proc, &why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_name_at_most_the_bound_and_count_the_rest() {
        let mut o = RelayOutcome::default();
        let p = ProcId::new("p").unwrap();
        for _ in 0..MAX_RELAY_FAILED + 3 {
            o.fail(&p, &"x".repeat(2 * MAX_REASON_BYTES));
        }
        assert_eq!(o.failed.len(), MAX_RELAY_FAILED);
        assert_eq!(o.more_failed, 3);
        assert!(o.failed[0].1.len() <= MAX_REASON_BYTES);
        assert_eq!(o.procs(), (MAX_RELAY_FAILED + 3) as u64);
    }
}
