//! `regent bench supervision`: how long a supervised restart takes, against a
//! bare ractor spawn of the same actors measured in the same run.
//!
//! - `restart_one_for_one`: one child fails (its handler returns an error);
//!   the time from the failure to the replacement's `pre_start`, against one
//!   bare `Actor::spawn` (call to `pre_start`).
//! - `restart_raw_ractor`: the same restart by a minimal hand-written ractor
//!   parent that respawns on any failure: the floor that any supervisor on
//!   ractor pays, since the failure must cross from the child's task to the
//!   parent's.
//! - `restart_one_for_all_100`: one of 100 children fails; the time until all
//!   100 replacements have run `pre_start` (99 ordered stops, each waited
//!   for, then 100 ordered starts), against 100 bare spawns in a row.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use regent_supervisor::{ChildSpec, Strategy, SupervisorFlags, SupervisorRef, SupervisorSpec};
use tokio::sync::mpsc;

use super::{BenchOptions, Figure, Report, median, micros};

const SUITE: &str = "supervision";

/// An actor that reports when it starts and fails on request, stamping the
/// moment of failure. The latest one to start leaves its reference in `last`.
#[derive(Clone)]
struct Subject {
    started: mpsc::UnboundedSender<Instant>,
    failed_at: Arc<Mutex<Option<Instant>>>,
    last: Arc<Mutex<Option<ActorRef<Fail>>>>,
}

struct Fail;

impl Actor for Subject {
    type Msg = Fail;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, me: ActorRef<Fail>, _: ()) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        *self.last.lock().expect("not poisoned") = Some(me);
        let _ = self.started.send(now);
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<Fail>,
        _: Fail,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        *self.failed_at.lock().expect("not poisoned") = Some(Instant::now());
        Err("injected failure".into())
    }
}

/// A minimal hand-written ractor parent: respawns its child on any failure.
struct RawParent(Subject);

impl Actor for RawParent {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, me: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Actor::spawn_linked(None, self.0.clone(), (), me.get_cell()).await?;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<()>,
        event: SupervisionEvent,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(..) = event {
            Actor::spawn_linked(None, self.0.clone(), (), me.get_cell()).await?;
        }
        Ok(())
    }
}

struct Harness {
    subject: Subject,
    started: mpsc::UnboundedReceiver<Instant>,
}

impl Harness {
    fn new() -> Self {
        let (tx, started) = mpsc::unbounded_channel();
        Self {
            subject: Subject {
                started: tx,
                failed_at: Arc::default(),
                last: Arc::default(),
            },
            started,
        }
    }

    async fn next_start(&mut self) -> anyhow::Result<Instant> {
        tokio::time::timeout(Duration::from_secs(30), self.started.recv())
            .await
            .context("a start took over 30 s")?
            .context("start channel closed")
    }

    /// The most recently started subject.
    fn last(&self) -> anyhow::Result<ActorRef<Fail>> {
        self.subject
            .last
            .lock()
            .expect("not poisoned")
            .clone()
            .context("no subject started")
    }

    /// The time for `n` bare spawns in a row, to the last `pre_start`.
    async fn bare_spawns(&mut self, n: usize) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let mut actors = Vec::with_capacity(n);
        for _ in 0..n {
            let (actor, _) = Actor::spawn(None, self.subject.clone(), ()).await?;
            actors.push(actor);
        }
        let mut last = t0;
        for _ in 0..n {
            last = self.next_start().await?;
        }
        for a in actors {
            a.stop_and_wait(None, None).await?;
        }
        Ok(last - t0)
    }

    /// Fails `victim` and returns the time from the failure to the last of
    /// the `n` starts it causes.
    async fn restart(&mut self, victim: ActorRef<Fail>, n: usize) -> anyhow::Result<Duration> {
        victim.cast(Fail)?;
        let mut last = Instant::now();
        for _ in 0..n {
            last = self.next_start().await?;
        }
        let failed = self
            .subject
            .failed_at
            .lock()
            .expect("not poisoned")
            .take()
            .context("no failure stamped")?;
        Ok(last - failed)
    }
}

async fn supervised(
    h: &mut Harness,
    strategy: Strategy,
    n: usize,
) -> anyhow::Result<SupervisorRef> {
    let flags = SupervisorFlags::new(strategy).intensity(u32::MAX, Duration::from_secs(1));
    let mut spec = SupervisorSpec::new("bench", flags);
    for i in 0..n {
        let s = h.subject.clone();
        spec = spec.child(ChildSpec::worker(format!("c{i}"), move || (s.clone(), ())));
    }
    let (sup, _) = SupervisorRef::start(spec).await?;
    for _ in 0..n {
        h.next_start().await?;
    }
    Ok(sup)
}

/// Runs the suite.
pub(crate) async fn run(opts: BenchOptions, report: &mut Report) -> anyhow::Result<()> {
    let (rounds_one, rounds_all) = if opts.quick { (100, 5) } else { (2000, 60) };
    let mut h = Harness::new();

    // Warm up the runtime and the allocator.
    h.bare_spawns(100).await?;

    // One child: supervised, raw ractor, and bare spawns interleaved so that
    // all three see the same machine load.
    let sup = supervised(&mut h, Strategy::OneForOne, 1).await?;
    let mut supervised_victim = h.last()?;
    let (raw, _) = Actor::spawn(None, RawParent(h.subject.clone()), ()).await?;
    h.next_start().await?;
    let mut raw_victim = h.last()?;
    let mut restarts = Vec::with_capacity(rounds_one);
    let mut raw_restarts = Vec::with_capacity(rounds_one);
    let mut spawns = Vec::with_capacity(rounds_one);
    for _ in 0..rounds_one {
        restarts.push(h.restart(supervised_victim, 1).await?);
        supervised_victim = h.last()?;
        raw_restarts.push(h.restart(raw_victim, 1).await?);
        raw_victim = h.last()?;
        spawns.push(h.bare_spawns(1).await?);
    }
    sup.stop().await;
    raw.stop_and_wait(None, None).await?;
    let spawn = micros(median(&mut spawns));
    report.push(
        Figure::new(
            SUITE,
            "restart_one_for_one",
            micros(median(&mut restarts)),
            "us",
        )
        .against("bare_spawn", spawn, "us"),
    );
    report.push(
        Figure::new(
            SUITE,
            "restart_raw_ractor",
            micros(median(&mut raw_restarts)),
            "us",
        )
        .against("bare_spawn", spawn, "us"),
    );

    // A hundred children under one_for_all.
    let n = 100;
    let sup = supervised(&mut h, Strategy::OneForAll, n).await?;
    let mut restarts = Vec::with_capacity(rounds_all);
    let mut spawns = Vec::with_capacity(rounds_all);
    for i in 0..rounds_all {
        let children = sup.which_children().await?;
        let victim = children[i % n].actor.clone().context("child not running")?;
        restarts.push(h.restart(victim.into(), n).await?);
        spawns.push(h.bare_spawns(n).await?);
    }
    sup.stop().await;
    report.push(
        Figure::new(
            SUITE,
            "restart_one_for_all_100",
            micros(median(&mut restarts)),
            "us",
        )
        .against("bare_spawn_100", micros(median(&mut spawns)), "us"),
    );
    Ok(())
}
