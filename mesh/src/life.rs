//! One life of a member: a ractor actor running the user's [`MeshActor`] on
//! a thread of its own (a current-thread tokio runtime), so that blocking
//! handlers delay nothing but their own mailbox; or, for an actor of
//! [`MemberThread::Proc`], as a task on the proc's control thread, its code
//! tagged as the member's in the proc's log lines while it is polled.
//!
//! The life starts in two steps: the actor exists at once (its mailbox takes
//! messages), then `A::new` runs as the actor's first work, and the proc is
//! told when it returned. A life ends once: stopped on purpose (after the
//! user's `stopping` hook), failed in `new` or a handler (an error or a
//! panic, caught here), or killed; its [`LifeEnd`] is sent when its thread
//! is done, so the proc knows for certain that no code of that life runs
//! any more.

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;

use crate::actor::{MemberThread, MeshActor};
use crate::error::MemberError;
use crate::logs::as_member;
use crate::member::{Member, MemberMsg};
use crate::protocol::{MAX_TEXT_BYTES, decode, encode};

/// How a life ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LifeEnd {
    /// Stopped on purpose.
    Stopped,
    /// Its `new` returned an error or panicked.
    StartFailed(String),
    /// A handler returned an error or panicked.
    Failed {
        /// The error or panic message.
        message: String,
        /// Whether it panicked.
        panicked: bool,
    },
    /// Its task was aborted (it did not stop in time) or its runtime failed.
    Killed,
}

/// What a life starts from.
pub(crate) struct LifeStart {
    pub(crate) member: Member,
    pub(crate) args: Bytes,
    /// Told when `new` returned (or failed).
    pub(crate) started: oneshot::Sender<Result<(), String>>,
    /// On a thread of its own unless its type runs on the proc's thread
    /// (`false`: a task of the current runtime whatever the type, as in the
    /// simulation of 100,000 members).
    pub(crate) own_thread: bool,
}

/// A life that runs: its mailbox, and how it will end.
pub(crate) struct Running {
    pub(crate) actor: ActorRef<MemberMsg>,
    /// Sent once the life's thread is done.
    pub(crate) ended: oneshot::Receiver<LifeEnd>,
}

/// Starts a life of `A` (on a thread of its own, or a task of the current
/// runtime); returns once its mailbox exists.
pub(crate) type SpawnFn =
    fn(LifeStart) -> futures::future::BoxFuture<'static, Result<Running, String>>;

/// The [`SpawnFn`] of `A`.
pub(crate) fn spawn<A: MeshActor>(
    start: LifeStart,
) -> futures::future::BoxFuture<'static, Result<Running, String>> {
    async move {
        let (actor_tx, actor_rx) = oneshot::channel();
        let (ended_tx, ended) = oneshot::channel();
        if start.own_thread && A::THREAD == MemberThread::Own {
            let name = format!("{}-r{}", start.member.mesh(), start.member.rank().0);
            let thread = std::thread::Builder::new().name(name).spawn(move || {
                let end = run_life::<A>(start, actor_tx);
                let _ = ended_tx.send(end);
            });
            if let Err(e) = thread {
                return Err(format!("cannot start the member's thread: {e}"));
            }
        } else {
            // On a proc's control thread (not in the simulation), what the
            // member's code logs is tagged as its own.
            let tag = if start.own_thread {
                member_tag(&start.member)
            } else {
                None
            };
            tokio::spawn(async move {
                let end = live::<A>(start, tag, actor_tx).await;
                let _ = ended_tx.send(end);
            });
        }
        match actor_rx.await {
            Ok(Ok(actor)) => Ok(Running { actor, ended }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the member's thread ended before its actor started".into()),
        }
    }
    .boxed()
}

fn run_life<A: MeshActor>(
    start: LifeStart,
    actor_tx: oneshot::Sender<Result<ActorRef<MemberMsg>, String>>,
) -> LifeEnd {
    // What is logged on this thread is the member's (`logs::ProcStderr`).
    crate::logs::set_thread_member(Some(&tag_of(&start.member)));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = actor_tx.send(Err(format!("cannot start the member's runtime: {e}")));
            return LifeEnd::Killed;
        }
    };
    let end = runtime.block_on(live::<A>(start, None, actor_tx));
    // Whatever the member spawned on its runtime ends with it.
    runtime.shutdown_background();
    end
}

fn tag_of(member: &Member) -> crate::logs::MemberTag {
    crate::logs::MemberTag {
        mesh: member.mesh().to_owned(),
        rank: member.rank().0,
        generation: member.generation().0,
    }
}

fn member_tag(member: &Member) -> Option<Arc<str>> {
    crate::logs::member_prefix(&tag_of(member))
}

/// Runs a life on the current runtime until it ends; `tag` marks the
/// member's code in log lines while it runs (on a shared thread).
async fn live<A: MeshActor>(
    start: LifeStart,
    tag: Option<Arc<str>>,
    actor_tx: oneshot::Sender<Result<ActorRef<MemberMsg>, String>>,
) -> LifeEnd {
    let outcome = Arc::new(Mutex::new(None));
    let spawned = Actor::spawn(
        None,
        MemberActor::<A>(PhantomData),
        (start, tag, outcome.clone()),
    )
    .await;
    let (actor, join) = match spawned {
        Ok(pair) => pair,
        Err(e) => {
            let _ = actor_tx.send(Err(format!("{} did not start: {e}", A::NAME)));
            return LifeEnd::Killed;
        }
    };
    let _ = actor_tx.send(Ok(actor));
    let _ = join.await;
    outcome
        .lock()
        .expect("outcome lock")
        .take()
        .unwrap_or(LifeEnd::Killed)
}

/// The ractor actor that runs one member of type `A`.
struct MemberActor<A>(PhantomData<fn() -> A>);

struct MemberState<A> {
    actor: Option<A>,
    member: Member,
    args: Option<Bytes>,
    started: Option<oneshot::Sender<Result<(), String>>>,
    outcome: Arc<Mutex<Option<LifeEnd>>>,
    /// The member's log prefix, set around its code (on a shared thread).
    tag: Option<Arc<str>>,
}

impl<A> MemberState<A> {
    fn end(&self, end: LifeEnd) {
        let mut outcome = self.outcome.lock().expect("outcome lock");
        if outcome.is_none() {
            *outcome = Some(end);
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    bounded(match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "a panic without a message".to_owned(),
        },
    })
}

/// A user's error or panic text, cut to [`MAX_TEXT_BYTES`] (it travels in
/// replies and failure reports).
fn bounded(mut text: String) -> String {
    if text.len() > MAX_TEXT_BYTES {
        let mut end = MAX_TEXT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str(" [cut]");
    }
    text
}

impl<A: MeshActor> Actor for MemberActor<A> {
    type Msg = MemberMsg;
    type State = MemberState<A>;
    type Arguments = (LifeStart, Option<Arc<str>>, Arc<Mutex<Option<LifeEnd>>>);

    async fn pre_start(
        &self,
        _: ActorRef<MemberMsg>,
        (start, tag, outcome): Self::Arguments,
    ) -> Result<MemberState<A>, ActorProcessingErr> {
        Ok(MemberState {
            actor: None,
            member: start.member,
            args: Some(start.args),
            started: Some(start.started),
            outcome,
            tag,
        })
    }

    async fn post_start(
        &self,
        _: ActorRef<MemberMsg>,
        state: &mut MemberState<A>,
    ) -> Result<(), ActorProcessingErr> {
        let args = state.args.take().unwrap_or_default();
        let result = match decode::<A::Args>(&args) {
            Err(e) => Err(format!("bad arguments for {}: {e}", A::NAME)),
            Ok(args) => {
                match AssertUnwindSafe(as_member(state.tag.as_ref(), A::new(&state.member, args)))
                    .catch_unwind()
                    .await
                {
                    Ok(Ok(actor)) => {
                        state.actor = Some(actor);
                        Ok(())
                    }
                    Ok(Err(e)) => Err(bounded(format!("{} failed to start: {e}", A::NAME))),
                    Err(p) => Err(format!(
                        "{} panicked while starting: {}",
                        A::NAME,
                        panic_message(p)
                    )),
                }
            }
        };
        if let Some(started) = state.started.take() {
            let _ = started.send(result.clone());
        }
        result.map_err(|e| {
            state.end(LifeEnd::StartFailed(e.clone()));
            e.into()
        })
    }

    async fn handle(
        &self,
        _: ActorRef<MemberMsg>,
        msg: MemberMsg,
        state: &mut MemberState<A>,
    ) -> Result<(), ActorProcessingErr> {
        let Some(actor) = state.actor.as_mut() else {
            return Ok(()); // not started: post_start failed and the actor stops
        };
        match msg {
            MemberMsg::User { payload, reply } => {
                let answer = |r: Result<Bytes, MemberError>| {
                    if let Some(reply) = reply {
                        // The caller may have given up; that is fine.
                        let _ = reply.send(r);
                    }
                };
                let message: A::Msg = match decode(&payload) {
                    Ok(m) => m,
                    Err(e) => {
                        answer(Err(MemberError::BadMessage(e)));
                        return Ok(());
                    }
                };
                match AssertUnwindSafe(as_member(
                    state.tag.as_ref(),
                    Box::pin(actor.handle(&state.member, message)),
                ))
                .catch_unwind()
                .await
                {
                    Ok(Ok(value)) => {
                        answer(encode(&value).map_err(MemberError::BadReply));
                        Ok(())
                    }
                    Ok(Err(e)) => {
                        let message = bounded(e.to_string());
                        answer(Err(MemberError::Failed(message.clone())));
                        state.end(LifeEnd::Failed {
                            message,
                            panicked: false,
                        });
                        Err(e)
                    }
                    Err(p) => {
                        let message = panic_message(p);
                        answer(Err(MemberError::Panicked(message.clone())));
                        state.end(LifeEnd::Failed {
                            message: message.clone(),
                            panicked: true,
                        });
                        Err(message.into())
                    }
                }
            }
            MemberMsg::PeersRestarted(change) => {
                match AssertUnwindSafe(as_member(
                    state.tag.as_ref(),
                    Box::pin(actor.peers_restarted(&state.member, &change)),
                ))
                .catch_unwind()
                .await
                {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => {
                        state.end(LifeEnd::Failed {
                            message: bounded(e.to_string()),
                            panicked: false,
                        });
                        Err(e)
                    }
                    Err(p) => {
                        let message = panic_message(p);
                        state.end(LifeEnd::Failed {
                            message: message.clone(),
                            panicked: true,
                        });
                        Err(message.into())
                    }
                }
            }
            MemberMsg::Supervise { failure, reply } => {
                let decision = AssertUnwindSafe(as_member(
                    state.tag.as_ref(),
                    Box::pin(actor.supervise(&state.member, &failure)),
                ))
                .catch_unwind()
                .await;
                match decision {
                    Ok(d) => {
                        let _ = reply.send(d);
                        Ok(())
                    }
                    Err(p) => {
                        let message = panic_message(p);
                        state.end(LifeEnd::Failed {
                            message: message.clone(),
                            panicked: true,
                        });
                        Err(message.into())
                    }
                }
            }
        }
    }

    async fn post_stop(
        &self,
        _: ActorRef<MemberMsg>,
        state: &mut MemberState<A>,
    ) -> Result<(), ActorProcessingErr> {
        let failed = state.outcome.lock().expect("outcome lock").is_some();
        if !failed && let Some(actor) = state.actor.as_mut() {
            // A panic in the hook still ends the life as stopped.
            let _ = AssertUnwindSafe(as_member(state.tag.as_ref(), actor.stopping(&state.member)))
                .catch_unwind()
                .await;
        }
        state.end(LifeEnd::Stopped);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member whose handler keeps 16 KiB across an await.
    struct Large;

    impl MeshActor for Large {
        const NAME: &'static str = "regent-test/large-handler";
        type Args = ();
        type Msg = u64;
        type Reply = u64;

        async fn new(_: &Member, (): ()) -> Result<Self, crate::ActorError> {
            Ok(Self)
        }

        async fn handle(&mut self, _: &Member, x: u64) -> Result<u64, crate::ActorError> {
            let block = [x as u8; 16 << 10];
            tokio::task::yield_now().await;
            Ok(u64::from(std::hint::black_box(block)[100]))
        }
    }

    /// Each message's handling builds the user's handler future once, on
    /// the heap: the actor's own future (built for every message, and moved
    /// by ractor on its way in) does not carry it, so a large handler costs
    /// one copy per message rather than one per layer around it.
    #[test]
    #[allow(unreachable_code, clippy::diverging_sub_expression)]
    fn a_large_handler_future_is_not_carried_by_the_actors_own() {
        let handler = crate::returned_size(|| Large.handle(unreachable!(), unreachable!()));
        assert!(handler > 16 << 10, "the test handler is {handler} bytes");
        let actor = crate::returned_size(|| {
            <MemberActor<Large> as Actor>::handle(
                unreachable!(),
                unreachable!(),
                unreachable!(),
                unreachable!(),
            )
        });
        assert!(
            actor < 2 << 10,
            "the member actor's handle future is {actor} bytes for a {handler}-byte handler"
        );
    }
}
