//! The procs a controller keeps alive (it renews their leases) and those it
//! gave up on (zombies if they come back: they are told to exit).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Mutex, Weak};

use regent_net::{Generation, ProcAddr, ProcId};

use super::Inner;
use crate::fabric::proc_port;
use crate::protocol::{ProcCommand, names};
use crate::relay::{Hop, RelayBody};

/// The bound on remembered abandoned procs; the oldest are forgotten first
/// (by then they have long exited: a proc stops itself when its lease
/// lapses).
const MAX_ABANDONED: usize = 1 << 16;

#[derive(Default)]
pub(super) struct Leases {
    /// Procs whose lease the controller renews (ordered: renewals go out
    /// in a fixed order).
    leased: Mutex<BTreeMap<ProcId, ProcAddr>>,
    /// Procs given up on (dead, or unreachable: zombies if they come back).
    abandoned: Mutex<(HashSet<ProcId>, VecDeque<ProcId>)>,
}

impl Leases {
    pub(super) fn lease(&self, proc: &ProcAddr) {
        self.leased
            .lock()
            .expect("leased lock")
            .insert(proc.proc.clone(), proc.clone());
    }

    pub(super) fn release(&self, proc: &ProcId) {
        self.leased.lock().expect("leased lock").remove(proc);
    }

    pub(super) fn is_leased(&self, proc: &ProcId) -> bool {
        self.leased.lock().expect("leased lock").contains_key(proc)
    }

    pub(super) fn count(&self) -> usize {
        self.leased.lock().expect("leased lock").len()
    }

    pub(super) fn abandon(&self, proc: &ProcId) {
        self.release(proc);
        let mut abandoned = self.abandoned.lock().expect("abandoned lock");
        if abandoned.0.insert(proc.clone()) {
            abandoned.1.push_back(proc.clone());
            if abandoned.1.len() > MAX_ABANDONED
                && let Some(oldest) = abandoned.1.pop_front()
            {
                abandoned.0.remove(&oldest);
            }
        }
    }

    pub(super) fn is_abandoned(&self, proc: &ProcId) -> bool {
        self.abandoned
            .lock()
            .expect("abandoned lock")
            .0
            .contains(proc)
    }

    fn leased(&self) -> Vec<ProcAddr> {
        self.leased
            .lock()
            .expect("leased lock")
            .values()
            .cloned()
            .collect()
    }
}

/// Renews the lease of every leased proc every third of the lease: one
/// renewal signed by the owner, relayed down a tree of the procs (at most
/// the fan-out's frames from here). A proc whose subtree did not answer
/// within half a period is renewed directly.
pub(super) async fn renew(weak: Weak<Inner>) {
    let period = match weak.upgrade() {
        Some(i) => i.config.owner_lease / 3,
        None => return,
    };
    loop {
        tokio::time::sleep(period).await;
        // The runtime is held only while it signs and after the outcome:
        // a dropped runtime is not kept for a renewal's budget.
        let (frame, fabric, pending) = {
            let Some(inner) = weak.upgrade() else { return };
            let route: Vec<Hop> = inner
                .leases
                .leased()
                .into_iter()
                .map(|addr| Hop { rank: 0, addr })
                .collect();
            if route.is_empty() {
                continue;
            }
            let signed =
                inner
                    .signer
                    .frame(RelayBody::Renew, route, inner.config.fanout, period / 2);
            match signed {
                Ok(frame) => (frame, inner.fabric.clone(), inner.pending.clone()),
                Err(e) => {
                    tracing::warn!(error = %e, "renewal not signed; renewing each proc");
                    for p in inner.leases.leased() {
                        renew_one(&inner, &p.proc);
                    }
                    continue;
                }
            }
        };
        let outcome = crate::relay::spread(&*fabric, &pending, &frame, true, None).await;
        drop((fabric, pending));
        let Some(inner) = weak.upgrade() else { return };
        if outcome.more_failed > 0 {
            for p in inner.leases.leased() {
                renew_one(&inner, &p.proc);
            }
        } else {
            for (p, why) in &outcome.failed {
                if inner.leases.is_leased(p) && !inner.fabric.lost.contains(p) {
                    tracing::debug!(proc = %p, %why, "relayed renewal missed; renewing directly");
                    renew_one(&inner, p);
                }
            }
        }
    }
}

/// Renews `proc`'s lease now (never waiting: a full buffer or a dead proc
/// is not the lease's problem). The first renewal also opens the link and
/// the command stream to the proc.
pub(super) fn renew_one(inner: &Inner, proc: &ProcId) {
    let fabric = &inner.fabric;
    let _ = fabric.endpoint.try_send(
        &fabric.me,
        &proc_port(proc, names::COMMAND_PORT),
        Generation(0),
        ProcCommand::Renew,
    );
}
