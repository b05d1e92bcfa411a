//! The controller's routing tasks: replies to pending calls, member exits
//! and spawn requests from procs, proc events from allocators and link
//! events from the control plane, each to the supervisor of the mesh it
//! concerns.

use std::sync::{Arc, Weak};

use regent_net::{LinkFailure, ProcId, TransportEvent, TypeTag, Undeliverable, UndeliveredCause};
use tokio::sync::mpsc;

use super::supervise::Signal;
use super::{Inner, Runtime};
use crate::alloc::{Allocator, ProcEvent};
use crate::fabric::Pending;
use crate::protocol::{MemberExited, ProcCommand, ProcReply, ProcStats, ReplyBody, SpawnChild};

pub(super) async fn dispatch_replies(pending: Arc<Pending>, mut replies: regent_net::Inbox) {
    while let Some(delivery) = replies.recv().await {
        let sender = delivery.sender.proc.clone();
        match delivery.decode::<ProcReply>() {
            Ok(r) => pending.resolve(r.call, r.body, &sender),
            Err(e) => tracing::warn!(error = %e, "undecodable reply dropped"),
        }
    }
}

pub(super) async fn route_member_exits(inner: Weak<Inner>, mut events: regent_net::Inbox) {
    while let Some(delivery) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        let sender = delivery.sender.proc.clone();
        match delivery.decode::<MemberExited>() {
            Ok(e) => {
                let mesh = e.mesh;
                // Only a proc of the mesh reports its members' exits.
                let from_mesh = rt.mesh_info(mesh).is_some_and(|info| {
                    e.rank < info.members()
                        && info.procs[(e.rank / info.per_proc) as usize].proc == sender
                });
                if !from_mesh {
                    tracing::warn!(from = %sender, mesh = mesh.0, "a member exit from a proc that does not host that member refused");
                    continue;
                }
                if !rt.signal_mesh(mesh, Signal::Member(e)) {
                    tracing::debug!(mesh = mesh.0, "member exit of a mesh no longer supervised");
                }
            }
            Err(e) => tracing::warn!(error = %e, "undecodable member exit dropped"),
        }
    }
}

/// Procs' reports of their traffic ([`ProcStats`]): taken from the procs
/// this controller leases only, added to the metrics.
pub(super) async fn route_proc_stats(inner: Weak<Inner>, mut reports: regent_net::Inbox) {
    while let Some(delivery) = reports.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let sender = delivery.sender.proc.clone();
        if !inner.leases.is_leased(&sender) {
            tracing::debug!(from = %sender, "a stats report from a proc not leased here dropped");
            continue;
        }
        match delivery.decode::<ProcStats>() {
            Ok(stats) => {
                if !inner.observer.proc_stats(&sender, stats) {
                    tracing::warn!(from = %sender, "a stats report whose totals shrank refused");
                }
            }
            Err(e) => {
                tracing::warn!(from = %sender, error = %e, "undecodable stats report dropped")
            }
        }
        // Procs no longer leased (dead, stopped, replaced) are forgotten,
        // and their series end, once more procs are remembered than live.
        if inner.observer.reporting_procs() > inner.leases.count() {
            inner.observer.forget_procs(|p| inner.leases.is_leased(p));
        }
    }
}

pub(super) async fn route_spawn_requests(inner: Weak<Inner>, mut requests: regent_net::Inbox) {
    while let Some(delivery) = requests.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        let sender = delivery.sender.proc.clone();
        let request = match delivery.decode::<SpawnChild>() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable spawn request dropped");
                continue;
            }
        };
        let parent = request.parent;
        let (to, call) = (request.reply_to.clone(), request.call);
        // Only the proc that hosts the requesting member may ask for it.
        let hosts_owner = rt.mesh_info(parent).is_some_and(|info| {
            request.rank < info.members()
                && info.procs[(request.rank / info.per_proc) as usize].proc == sender
        });
        if !hosts_owner {
            tracing::warn!(from = %sender, mesh = parent.0, rank = request.rank, "a spawn request from a proc that does not host that member refused");
            let body = ReplyBody::ChildSpawned(Err(
                "refused: the request did not come from the member's proc".into(),
            ));
            rt.answer(to, call, body).await;
            continue;
        }
        if !rt.signal_mesh(parent, Signal::SpawnChild(request)) {
            let body = ReplyBody::ChildSpawned(Err(format!(
                "the requesting member's mesh {} is no longer supervised",
                parent.0
            )));
            rt.answer(to, call, body).await;
        }
    }
}

pub(super) async fn route_proc_events(inner: Weak<Inner>, mut events: mpsc::Receiver<ProcEvent>) {
    while let Some(event) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let rt = Runtime { inner };
        let procs: Vec<ProcId> = match &event {
            ProcEvent::Exited { proc, .. } => vec![proc.clone()],
            ProcEvent::HostLost { procs, .. } => procs.clone(),
        };
        // Reported to the supervisors before it is marked lost: a request
        // that fails because the proc is lost finds the report queued.
        rt.signal_all(|| Signal::Proc(event.clone()));
        for p in &procs {
            rt.release(p);
            rt.mark_lost(p);
        }
    }
}

/// How long a link closed by a peer shutting down waits for an allocator's
/// report of that proc's exit before it counts as the failure.
const EXIT_REPORT_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// A proc's link failed: every supervisor hears of it, and the proc is lost.
fn link_lost(rt: &Runtime, peer: &ProcId, cause: &LinkFailure) {
    let detail = cause.to_string();
    rt.signal_all(|| Signal::Link {
        proc: peer.clone(),
        detail: detail.clone(),
    });
    rt.mark_lost(peer);
}

pub(super) async fn route_transport_events(
    inner: Weak<Inner>,
    mut events: mpsc::Receiver<TransportEvent>,
) {
    while let Some(event) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let allocators: Vec<Arc<dyn Allocator>> = inner
            .hooked
            .lock()
            .expect("hooked lock")
            .iter()
            .map(|(_, a)| a.clone())
            .collect();
        for a in allocators {
            a.transport_event(&event);
        }
        let rt = Runtime { inner };
        match event {
            TransportEvent::LinkFailed { peer, cause, .. }
            | TransportEvent::LinkClosed { peer, cause }
                if cause == LinkFailure::PeerShutdown =>
            {
                // The peer closed its endpoint on its way out: the
                // allocator's report of the exit (with its status: a stuck
                // member, a panic) follows at once and is the better cause.
                // Waited for briefly; the link's failure stands without it.
                tokio::spawn(async move {
                    let until = tokio::time::Instant::now() + EXIT_REPORT_GRACE;
                    loop {
                        let lost = &rt.inner.fabric.lost;
                        let changed = lost.changed();
                        tokio::pin!(changed);
                        changed.as_mut().enable();
                        if rt.is_lost(&peer) {
                            return;
                        }
                        if tokio::time::timeout_at(until, changed).await.is_err() {
                            break;
                        }
                    }
                    link_lost(&rt, &peer, &cause);
                });
            }
            TransportEvent::LinkFailed { peer, cause, .. }
            | TransportEvent::LinkClosed { peer, cause } => link_lost(&rt, &peer, &cause),
            TransportEvent::LinkUp { peer, .. } if rt.inner.leases.is_abandoned(&peer) => {
                tracing::warn!(proc = %peer, "an abandoned proc came back; telling it to exit");
                rt.tell_exit(&peer);
            }
            TransportEvent::Undeliverable(u) => command_came_back(&rt, &u),
            _ => {}
        }
    }
}

/// A command of this controller came back. One the proc refused (no such
/// port, fenced) never reached the proc's runtime, and a request it carried
/// gets no answer: said loudly, as nothing else reports it. One given back
/// for another cause (a failed link, a restarted peer) may have been
/// delivered, and the proc's loss is reported on its own.
fn command_came_back(rt: &Runtime, u: &Undeliverable) {
    let envelope = &u.envelope;
    if envelope.sender != rt.inner.fabric.me || envelope.type_tag != TypeTag::of::<ProcCommand>() {
        return;
    }
    let proc = envelope.receiver.proc();
    match &u.cause {
        UndeliveredCause::Rejected(cause) => {
            tracing::warn!(%proc, port = %envelope.receiver, %cause, "a proc refused a command");
        }
        cause => tracing::debug!(%proc, %cause, "a command came back undeliverable"),
    }
}
