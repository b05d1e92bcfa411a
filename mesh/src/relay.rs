//! Owner commands carried down a tree of procs: a spawn, an update to a new
//! generation or a lease renewal reaches `n` procs with at most `fanout`
//! frames from the controller instead of `n`, in the tree casts use
//! ([`crate::tree`]), and each proc's outcome comes back merged on the way
//! up (`fanout` answers at the controller).
//!
//! A proc takes commands only from its owner (docs/semantics.md §4.1). A
//! relayed command reaches it from another proc, so the owner signs it:
//! Ed25519, with a key drawn when the runtime starts (`crate::owner`),
//! whose public half is in every proc's boot ([`OwnerKey`]). What is signed
//! is the command and a sequence number ([`Relayed`]); the route (the procs
//! of the subtree), the fan-out, the reply address and the budget are not:
//! a forwarder can drop or misroute a command, as it can drop a cast, but
//! cannot make or change one. Replays are refused (`RelayGate`): a proc
//! takes each sequence number once, within a window of the last
//! [`REPLAY_WINDOW`] it took, and a renewal only when it is newer than the
//! last renewal it took.
//!
//! A node goes around a head it knows to be lost (its subtree is forwarded
//! to directly), and reports a subtree it could not reach, or that did not
//! answer within its budget, as failed, naming every proc of it.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::entropy::Entropy;
use crate::fabric::{Fabric, Pending};
pub use crate::owner::OwnerKey;
use crate::owner::OwnerSigner;
pub use crate::protocol::{Hop, MAX_RELAY_FAILED, RelayBody, RelayFrame, RelayOutcome, Relayed};
use crate::protocol::{MAX_BUDGET_MS, ProcCommand, ReplyBody, ReplyTo, encode};
use crate::tree;
/// Sequence numbers a proc remembers having taken: older ones are refused.
pub const REPLAY_WINDOW: usize = 4096;
/// What a node's children get of its budget (the rest is for answering).
const CHILD_BUDGET_SHARE: f64 = 0.8;

/// The controller's signing key and the sequence of what it signed.
pub(crate) struct RelaySigner {
    key: OwnerSigner,
    next: AtomicU64,
}

impl RelaySigner {
    /// A fresh key from `entropy` (see `OwnerSigner::new`).
    pub(crate) fn new(entropy: &Entropy) -> Self {
        Self {
            key: OwnerSigner::new(entropy),
            next: AtomicU64::new(1),
        }
    }

    /// The key procs check signatures with.
    pub(crate) fn public(&self) -> OwnerKey {
        self.key.public()
    }

    /// Signs `body` with the next sequence number; `route` is where it goes.
    pub(crate) fn frame(
        &self,
        body: RelayBody,
        route: Vec<Hop>,
        fanout: NonZeroU32,
        budget: Duration,
    ) -> Result<RelayFrame, String> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let signed = encode(&Relayed { seq, body })?;
        Ok(RelayFrame {
            signature: self.key.sign(&signed),
            signed,
            route,
            fanout: fanout.get(),
            reply: None,
            budget_ms: u32::try_from(budget.as_millis())
                .unwrap_or(MAX_BUDGET_MS)
                .min(MAX_BUDGET_MS),
        })
    }
}

/// What a proc checks of relayed commands: the owner's key, and the
/// sequence numbers it took.
#[derive(Debug, Default)]
pub(crate) struct RelayGate {
    key: Option<OwnerKey>,
    /// The last [`REPLAY_WINDOW`] sequence numbers taken.
    taken: BTreeSet<u64>,
    /// Sequence numbers up to this one are refused.
    floor: u64,
    /// The newest renewal taken.
    last_renew: u64,
}

impl RelayGate {
    pub(crate) fn new(key: Option<OwnerKey>) -> Self {
        Self {
            key,
            ..Self::default()
        }
    }

    /// The command of `frame` if the owner signed it and it was not taken
    /// before; why not otherwise.
    pub(crate) fn admit(&mut self, frame: &RelayFrame) -> Result<RelayBody, String> {
        let key = self
            .key
            .as_ref()
            .ok_or("this proc knows no owner key: it takes no relayed command")?;
        key.verify(&frame.signed, &frame.signature)?;
        let relayed: Relayed = regent_net::wire::decode_body(&frame.signed)
            .map_err(|e| format!("undecodable relayed command: {e}"))?;
        let seq = relayed.seq;
        if seq <= self.floor || self.taken.contains(&seq) {
            return Err(format!("command {seq} was taken before (a replay)"));
        }
        if matches!(relayed.body, RelayBody::Renew) {
            if seq <= self.last_renew {
                return Err(format!(
                    "renewal {seq} is older than renewal {}",
                    self.last_renew
                ));
            }
            self.last_renew = seq;
        }
        self.taken.insert(seq);
        if self.taken.len() > REPLAY_WINDOW
            && let Some(oldest) = self.taken.pop_first()
        {
            self.floor = oldest;
        }
        Ok(relayed.body)
    }
}

/// Sends `frame` on to the heads of its route's chunks and merges their
/// outcomes with `local`'s (this node's own part; `None` at the root, which
/// is not on the route). The root splits the whole route; a proc, the route
/// past itself. With `replies` false nothing is waited for (the outcome
/// counts only what could not be sent).
pub(crate) async fn spread(
    fabric: &dyn Fabric,
    pending: &Pending,
    frame: &RelayFrame,
    replies: bool,
    local: Option<BoxFuture<'_, Result<(), String>>>,
) -> RelayOutcome {
    let deadline = Instant::now() + Duration::from_millis(u64::from(frame.budget_ms));
    let fanout = NonZeroU32::new(frame.fanout).unwrap_or(tree::DEFAULT_FANOUT);
    let route = &frame.route;
    let len = route.len() as u32;
    let mut chunks: Vec<Range<u32>> = if local.is_some() {
        tree::children(0..len, fanout).collect()
    } else {
        tree::root_children(len, fanout).collect()
    };
    chunks.reverse(); // a stack, taken in order
    let child_budget = (f64::from(frame.budget_ms) * CHILD_BUDGET_SHARE) as u32;
    let mut out = RelayOutcome::default();
    let mut waiting = Vec::new();
    let hops = |c: &Range<u32>| &route[c.start as usize..c.end as usize];
    while let Some(chunk) = chunks.pop() {
        let head = &route[chunk.start as usize];
        if fabric.lost().contains(&head.addr.proc) {
            // Around a lost head: its subtree is forwarded to directly.
            out.fail(&head.addr.proc, "proc lost");
            let below: Vec<Range<u32>> = tree::children(chunk, fanout).collect();
            chunks.extend(below.into_iter().rev());
            continue;
        }
        let (call, answer) = if replies {
            let (call, rx) = pending.request(&head.addr.proc);
            (Some(call), Some(rx))
        } else {
            (None, None)
        };
        let child = RelayFrame {
            signed: frame.signed.clone(),
            signature: frame.signature.clone(),
            route: hops(&chunk).to_vec(),
            fanout: frame.fanout,
            reply: call.map(|call| ReplyTo {
                port: fabric.reply_port(),
                call,
            }),
            budget_ms: child_budget,
        };
        match fabric
            .send_to(&head.addr, ProcCommand::Relay(child), deadline)
            .await
        {
            Ok(()) => {
                if let (Some(call), Some(rx)) = (call, answer) {
                    waiting.push((chunk, call, rx));
                }
            }
            Err(e) => {
                if let Some(call) = call {
                    pending.forget(call);
                }
                out.fail_all(hops(&chunk), &format!("unreachable: {e}"));
            }
        }
    }
    if let Some(local) = local {
        match local.await {
            Ok(()) => out.done = out.done.saturating_add(1),
            Err(why) => out.fail(fabric.proc(), &why),
        }
    }
    let answers = waiting.into_iter().map(|(chunk, call, rx)| async move {
        let r = answer_of(fabric, hops(&chunk), rx, deadline).await;
        (chunk, call, r)
    });
    for (chunk, call, r) in join_all(answers).await {
        match r {
            Ok(o) if o.procs() == u64::from(chunk.end - chunk.start) => out.merge(o),
            Ok(o) => out.fail_all(
                hops(&chunk),
                &format!(
                    "the subtree answered for {} procs of {}",
                    o.procs(),
                    chunk.end - chunk.start
                ),
            ),
            Err(why) => {
                pending.forget(call);
                out.fail_all(hops(&chunk), &why);
            }
        }
    }
    out
}

/// A subtree's outcome, or why none came: one of its procs was lost (its
/// head would wait for it to its own deadline: this node does not, as a
/// request to a lost proc fails at once), or the deadline passed.
async fn answer_of(
    fabric: &dyn Fabric,
    subtree: &[Hop],
    rx: oneshot::Receiver<ReplyBody>,
    deadline: Instant,
) -> Result<RelayOutcome, String> {
    let head = &subtree[0].addr.proc;
    let answer = tokio::time::timeout_at(deadline, rx);
    tokio::pin!(answer);
    loop {
        // Registered before the check, so no loss is missed in between.
        let changed = fabric.lost().changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if let Some(lost) = subtree
            .iter()
            .find(|h| fabric.lost().contains(&h.addr.proc))
        {
            return Err(format!("proc {} of the subtree lost", lost.addr.proc));
        }
        tokio::select! {
            // The answer first: one that came with news of a loss counts.
            biased;
            r = &mut answer => return match r {
                Ok(Ok(ReplyBody::Relayed(o))) => Ok(o),
                Ok(Ok(_)) => Err(format!("subtree head {head} answered another call")),
                Ok(Err(_)) => Err(format!("subtree head {head}'s answer was dropped")),
                Err(_) => Err(format!("no answer from subtree head {head} within the budget")),
            },
            () = &mut changed => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{MeshChange, MeshId};
    use bytes::Bytes;
    use regent_net::{ProcAddr, ProcId};

    fn signer(seed: u64) -> RelaySigner {
        RelaySigner::new(&Entropy::seeded(seed))
    }

    fn hop(i: u32) -> Hop {
        Hop {
            rank: i,
            addr: ProcAddr {
                proc: ProcId::new(&format!("p{i}")).unwrap(),
                socket: "127.0.0.1:1".parse().unwrap(),
            },
        }
    }

    fn frame(s: &RelaySigner, body: RelayBody) -> RelayFrame {
        s.frame(
            body,
            vec![hop(0)],
            tree::DEFAULT_FANOUT,
            Duration::from_secs(1),
        )
        .unwrap()
    }

    #[test]
    fn a_proc_takes_what_its_owner_signed_once() {
        let s = signer(1);
        let mut gate = RelayGate::new(Some(s.public()));
        let f = frame(&s, RelayBody::Renew);
        assert!(matches!(gate.admit(&f), Ok(RelayBody::Renew)));
        let again = gate.admit(&f).unwrap_err();
        assert!(again.contains("replay"), "{again}");
    }

    #[test]
    fn another_key_or_a_changed_command_does_not_verify() {
        let (owner, other) = (signer(1), signer(2));
        let mut gate = RelayGate::new(Some(owner.public()));
        let forged = frame(&other, RelayBody::Renew);
        let e = gate.admit(&forged).unwrap_err();
        assert!(e.contains("signature"), "{e}");
        // The owner's signature over one command does not carry another.
        let mut changed = frame(&owner, RelayBody::Renew);
        let mut bytes = changed.signed.to_vec();
        bytes[0] ^= 1; // the sequence number
        changed.signed = Bytes::from(bytes);
        assert!(gate.admit(&changed).unwrap_err().contains("signature"));
        // A proc without the owner's key takes nothing relayed.
        let mut keyless = RelayGate::new(None);
        assert!(keyless.admit(&frame(&owner, RelayBody::Renew)).is_err());
    }

    #[test]
    fn an_older_renewal_is_refused_after_a_newer_one() {
        let s = signer(3);
        let mut gate = RelayGate::new(Some(s.public()));
        let (old, new) = (frame(&s, RelayBody::Renew), frame(&s, RelayBody::Renew));
        gate.admit(&new).unwrap();
        assert!(gate.admit(&old).unwrap_err().contains("older"));
    }

    #[test]
    fn out_of_order_commands_within_the_window_are_taken_older_ones_not() {
        let s = signer(4);
        let mut gate = RelayGate::new(Some(s.public()));
        let update = || RelayBody::Update {
            mesh: MeshId(1),
            change: MeshChange {
                from: regent_net::Generation(0),
                generation: regent_net::Generation(1),
                moved: vec![],
            },
            restart: None,
        };
        let first = frame(&s, update());
        let frames: Vec<RelayFrame> = (0..REPLAY_WINDOW).map(|_| frame(&s, update())).collect();
        // Taken in reverse order: each is new.
        for f in frames.iter().rev() {
            gate.admit(f).unwrap();
        }
        // One more overflows the window: the oldest taken is forgotten, and
        // it and everything older (taken or not) are refused from now on.
        gate.admit(&frame(&s, update())).unwrap();
        assert!(gate.admit(&first).unwrap_err().contains("replay"));
        assert!(gate.admit(&frames[0]).unwrap_err().contains("replay"));
        assert!(gate.admit(&frames[1]).unwrap_err().contains("replay"));
    }

    #[test]
    fn frames_out_of_bounds_are_refused_before_any_check() {
        let s = signer(5);
        let mut f = frame(&s, RelayBody::Renew);
        f.validate().unwrap();
        f.route.clear();
        assert!(f.validate().is_err());
        let mut f = frame(&s, RelayBody::Renew);
        f.signature = Bytes::from_static(b"short");
        assert!(f.validate().is_err());
        let mut f = frame(&s, RelayBody::Renew);
        f.fanout = 0;
        assert!(f.validate().is_err());
    }
}
