//! Model-based test of the supervision state machine.
//!
//! The reference model of `tests/otp/mod.rs`, in the shape of
//! `supervisor.erl`, runs side by side with the real
//! [`Machine`] on random child specifications and random sequences of exits
//! (normal, shutdown, failures, panics, kills, stale reports), start failures,
//! time advances and requests. After every step the two must have done the
//! same things in the same order (starts with their incarnations, stops,
//! replies, the exit and its cause) and must report the same children.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::Strategy as PropStrategy;
use regent_supervisor::machine::{Action, ChildStatus, Event, Machine, Reply, Request, RequestId};
use regent_supervisor::{
    AutoShutdown, ChildId, ChildKey, ChildPolicy, ExitReason, Incarnation, Restart, Shutdown,
    StartError, Strategy, SupervisorFlags,
};

mod otp;

use otp::{Model, Msg, Trace, World, cause_trace, error_kind};

// ---------------------------------------------------------------------------
// The driver: runs the real machine in the same world.
// ---------------------------------------------------------------------------

struct Real {
    machine: Machine,
    mailbox: VecDeque<Event>,
    trace: Vec<Trace>,
    exited: bool,
}

impl Real {
    fn perform(&mut self, now: Instant, mut actions: Vec<Action>, w: &World) {
        let mut queue: VecDeque<Action> = actions.drain(..).collect();
        while let Some(a) = queue.pop_front() {
            match a {
                Action::Start { key, incarnation } => {
                    let ok = w.start_ok(&key, incarnation);
                    self.trace.push(Trace::Start(key, incarnation, ok));
                    let outcome = if ok {
                        Ok(())
                    } else {
                        Err(StartError::Failed("injected".into()))
                    };
                    queue.extend(self.machine.handle(now, Event::Started(outcome)));
                }
                Action::Stop { targets, shutdown } => {
                    if targets.len() > 1 {
                        assert_eq!(
                            self.machine.flags().strategy,
                            Strategy::SimpleOneForOne,
                            "only dynamic children stop together"
                        );
                    }
                    let _ = shutdown;
                    let mut keys: Vec<ChildKey> = targets.into_iter().map(|(k, _)| k).collect();
                    keys.sort();
                    self.trace.push(Trace::Stop(keys));
                    queue.extend(self.machine.handle(now, Event::Stopped));
                }
                Action::SetTimer { timer, after } => {
                    assert_eq!(after, Duration::ZERO, "no backoff in the model test");
                    self.mailbox.push_back(Event::Timer(timer));
                }
                Action::Reply { reply, .. } => self.trace.push(Trace::Reply(match reply {
                    Reply::Started(Ok((k, i))) => Ok(Some((k, i))),
                    Reply::Done(Ok(())) => Ok(None),
                    Reply::Started(Err(e)) | Reply::Done(Err(e)) => Err(error_kind(&e)),
                })),
                Action::Report(_) => {}
                Action::Exit(cause) => {
                    self.trace.push(cause_trace(&cause));
                    self.exited = true;
                }
            }
        }
    }

    fn drain(&mut self, now: Instant, w: &World) {
        while let Some(e) = self.mailbox.pop_front() {
            let actions = self.machine.handle(now, e);
            self.perform(now, actions, w);
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Exit(Index, ExitReason),
    StaleExit(Index),
    Advance(u64),
    ToggleFail(Index),
    StartChild(u8, Restart, bool),
    StartDynamic,
    Terminate(Index),
    RestartChild(Index),
    Delete(Index),
    Shutdown,
}

fn reason() -> impl PropStrategy<Value = ExitReason> {
    prop_oneof![
        Just(ExitReason::Normal),
        Just(ExitReason::Shutdown),
        Just(ExitReason::Failed("boom".into())),
        Just(ExitReason::Panicked("oops".into())),
        Just(ExitReason::Killed),
    ]
}

fn restart_type() -> impl PropStrategy<Value = Restart> {
    prop_oneof![
        Just(Restart::Permanent),
        Just(Restart::Transient),
        Just(Restart::Temporary)
    ]
}

fn op() -> impl PropStrategy<Value = Op> {
    prop_oneof![
        10 => (any::<Index>(), reason()).prop_map(|(i, r)| Op::Exit(i, r)),
        1 => any::<Index>().prop_map(Op::StaleExit),
        4 => prop_oneof![0..200u64, 0..8000u64, (0..16u64).prop_map(|x| x * 500)]
            .prop_map(Op::Advance),
        3 => any::<Index>().prop_map(Op::ToggleFail),
        1 => (0..4u8, restart_type(), any::<bool>()).prop_map(|(n, r, s)| Op::StartChild(n, r, s)),
        2 => Just(Op::StartDynamic),
        1 => any::<Index>().prop_map(Op::Terminate),
        1 => any::<Index>().prop_map(Op::RestartChild),
        1 => any::<Index>().prop_map(Op::Delete),
        1 => Just(Op::Shutdown),
    ]
}

#[derive(Debug, Clone)]
struct Scenario {
    flags: SupervisorFlags,
    specs: Vec<ChildPolicy>,
    initially_failing: Vec<bool>,
    /// Each op, and whether the mailboxes are drained after it (when not,
    /// the next messages queue behind it, as in a busy mailbox).
    ops: Vec<(Op, bool)>,
}

/// Random scenarios for one strategy. With `significant`, every child is a
/// significant transient or temporary one under automatic shutdown, to reach
/// the corners of `auto_shutdown` that mixed scenarios rarely do.
fn scenario(strategy: Strategy, significant: bool) -> impl PropStrategy<Value = Scenario> {
    let auto = if significant {
        prop_oneof![
            1 => Just(AutoShutdown::AnySignificant),
            3 => Just(AutoShutdown::AllSignificant),
        ]
        .boxed()
    } else {
        prop_oneof![
            2 => Just(AutoShutdown::Never),
            1 => Just(AutoShutdown::AnySignificant),
            1 => Just(AutoShutdown::AllSignificant),
        ]
        .boxed()
    };
    let restart = if significant {
        prop_oneof![Just(Restart::Transient), Just(Restart::Temporary)].boxed()
    } else {
        restart_type().boxed()
    };
    let n = if strategy == Strategy::SimpleOneForOne {
        1..=1usize
    } else {
        1..=5usize
    };
    (
        auto,
        0..4u32,
        1..6u64,
        proptest::collection::vec((restart, prop::bool::weighted(0.7), 0..3u8), n),
        proptest::collection::vec(prop::bool::weighted(0.15), 5),
        proptest::collection::vec((op(), prop::bool::weighted(0.75)), 1..40),
    )
        .prop_map(move |(auto, max_r, period_s, children, failing, ops)| {
            let flags = SupervisorFlags::new(strategy)
                .intensity(max_r, Duration::from_secs(period_s))
                .auto_shutdown(auto);
            let specs = children
                .into_iter()
                .enumerate()
                .map(|(i, (restart, sig, shutdown))| {
                    let sig = (sig || significant)
                        && auto != AutoShutdown::Never
                        && restart != Restart::Permanent;
                    ChildPolicy::worker(format!("c{i}"))
                        .restart(restart)
                        .significant(sig)
                        .shutdown(match shutdown {
                            0 => Shutdown::BrutalKill,
                            1 => Shutdown::Timeout(Duration::from_millis(100)),
                            _ => Shutdown::Infinity,
                        })
                })
                .collect();
            Scenario {
                flags,
                specs,
                initially_failing: failing,
                ops,
            }
        })
}

/// Runs one scenario; returns a description of the first divergence.
fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let base = Instant::now();
    let mut now_ms = 0u64;
    let mut world = World::default();
    for (i, f) in s.initially_failing.iter().enumerate() {
        if *f && i < s.specs.len() && s.flags.strategy != Strategy::SimpleOneForOne {
            world
                .failing
                .insert(ChildKey::Static(s.specs[i].id.clone()));
        }
    }
    let mut model = Model::new(s.flags, &s.specs);
    let mut real = Real {
        machine: Machine::new(s.flags, s.specs.clone()).expect("valid scenario"),
        mailbox: VecDeque::new(),
        trace: Vec::new(),
        exited: false,
    };
    model.init(&world);
    let actions = real.machine.handle(base, Event::Init);
    real.perform(base, actions, &world);
    prop_assert_eq!(&real.trace, &model.trace, "init");
    // Incarnations that lived and ended, per child, for stale reports.
    let mut past: Vec<(ChildKey, Incarnation)> = Vec::new();
    let mut next_request = 0u64;
    for (step, (op, drain)) in s.ops.iter().enumerate() {
        if model.exited || real.exited {
            break;
        }
        let running: Vec<(ChildKey, Incarnation)> = model
            .children()
            .into_iter()
            .filter_map(|(k, st)| match st {
                ChildStatus::Running(i) => Some((k, i)),
                _ => None,
            })
            .collect();
        let all_keys: Vec<ChildKey> = model.children().into_iter().map(|(k, _)| k).collect();
        let push = |model: &mut Model, real: &mut Real, msg: Msg, ev: Event| {
            model.mailbox.push_back(msg);
            real.mailbox.push_back(ev);
        };
        let request = |next: &mut u64| {
            *next += 1;
            RequestId(*next)
        };
        match op {
            Op::Exit(i, reason) => {
                if running.is_empty() {
                    continue;
                }
                let (k, inc) = running[i.index(running.len())].clone();
                past.push((k.clone(), inc));
                push(
                    &mut model,
                    &mut real,
                    Msg::Exit(k.clone(), inc, reason.clone()),
                    Event::Exited {
                        key: k,
                        incarnation: inc,
                        reason: reason.clone(),
                    },
                );
            }
            Op::StaleExit(i) => {
                if past.is_empty() {
                    continue;
                }
                let (k, inc) = past[i.index(past.len())].clone();
                push(
                    &mut model,
                    &mut real,
                    Msg::Exit(k.clone(), inc, ExitReason::Killed),
                    Event::Exited {
                        key: k,
                        incarnation: inc,
                        reason: ExitReason::Killed,
                    },
                );
            }
            Op::Advance(ms) => now_ms += ms,
            Op::ToggleFail(i) => {
                if s.flags.strategy == Strategy::SimpleOneForOne {
                    world.template_fails = !world.template_fails;
                } else {
                    let k = ChildKey::Static(ChildId::new(format!("c{}", i.index(5))));
                    if !world.failing.remove(&k) {
                        world.failing.insert(k);
                    }
                }
            }
            Op::StartChild(n, restart, significant) => {
                let policy = ChildPolicy::worker(format!("x{n}"))
                    .restart(*restart)
                    .significant(*significant);
                let id = request(&mut next_request);
                push(
                    &mut model,
                    &mut real,
                    Msg::Request(id, Request::StartChild(policy.clone())),
                    Event::Request(id, Request::StartChild(policy)),
                );
            }
            Op::StartDynamic => {
                let id = request(&mut next_request);
                push(
                    &mut model,
                    &mut real,
                    Msg::Request(id, Request::StartDynamic),
                    Event::Request(id, Request::StartDynamic),
                );
            }
            Op::Terminate(i) => {
                let key = if all_keys.is_empty() || i.index(4) == 0 {
                    ChildKey::Static(ChildId::new("nobody"))
                } else {
                    all_keys[i.index(all_keys.len())].clone()
                };
                if let Some(inc) = running.iter().find(|(k, _)| *k == key).map(|(_, i)| *i) {
                    past.push((key.clone(), inc));
                }
                let id = request(&mut next_request);
                let r = Request::TerminateChild(key);
                push(
                    &mut model,
                    &mut real,
                    Msg::Request(id, r.clone()),
                    Event::Request(id, r),
                );
            }
            Op::RestartChild(i) | Op::Delete(i) => {
                let n = i.index(9);
                let cid = ChildId::new(if n < 5 {
                    format!("c{n}")
                } else {
                    format!("x{}", n - 5)
                });
                let r = if matches!(op, Op::Delete(_)) {
                    Request::DeleteChild(cid)
                } else {
                    Request::RestartChild(cid)
                };
                let id = request(&mut next_request);
                push(
                    &mut model,
                    &mut real,
                    Msg::Request(id, r.clone()),
                    Event::Request(id, r),
                );
            }
            Op::Shutdown => push(&mut model, &mut real, Msg::Shutdown, Event::Shutdown),
        }
        if !drain && step + 1 < s.ops.len() {
            continue;
        }
        let now = base + Duration::from_millis(now_ms);
        model.drain(now_ms, &world);
        real.drain(now, &world);
        prop_assert_eq!(
            &real.trace,
            &model.trace,
            "traces diverge after step {} ({:?})",
            step,
            op
        );
        prop_assert_eq!(real.exited, model.exited, "exit after step {}", step);
        if !real.exited {
            let real_children: Vec<(ChildKey, ChildStatus)> = real
                .machine
                .children()
                .into_iter()
                .map(|c| (c.key, c.status))
                .collect();
            prop_assert_eq!(
                real_children,
                model.children(),
                "children after step {}",
                step
            );
            check_counts(&real.machine)?;
        }
        check_trace_invariants(s, &real.trace)?;
    }
    Ok(())
}

fn check_counts(m: &Machine) -> Result<(), TestCaseError> {
    let c = m.counts();
    let children = m.children();
    let running = children
        .iter()
        .filter(|c| matches!(c.status, ChildStatus::Running(_)))
        .count();
    prop_assert_eq!(c.active, running);
    prop_assert_eq!(c.workers + c.supervisors, children.len());
    Ok(())
}

/// Invariants that hold whatever the model says: a temporary child is never
/// started twice, incarnations only grow, and nothing happens after the exit.
fn check_trace_invariants(s: &Scenario, trace: &[Trace]) -> Result<(), TestCaseError> {
    let temporary: HashSet<ChildKey> = s
        .specs
        .iter()
        .filter(|p| p.restart == Restart::Temporary)
        .map(|p| ChildKey::Static(p.id.clone()))
        .collect();
    let simple_temporary =
        s.flags.strategy == Strategy::SimpleOneForOne && s.specs[0].restart == Restart::Temporary;
    let mut started_ok: HashSet<ChildKey> = HashSet::new();
    let mut last_inc: Option<Incarnation> = None;
    let mut exited = false;
    for t in trace {
        prop_assert!(!exited, "action after exit: {:?}", t);
        match t {
            Trace::Start(k, inc, ok) => {
                if let Some(l) = last_inc {
                    prop_assert!(*inc > l, "incarnations grow");
                }
                last_inc = Some(*inc);
                let temp = temporary.contains(k)
                    || (simple_temporary && matches!(k, ChildKey::Dynamic(_)));
                if temp && *ok {
                    prop_assert!(
                        started_ok.insert(k.clone()),
                        "temporary child {} started twice",
                        k
                    );
                }
            }
            Trace::Exit(..) => exited = true,
            _ => {}
        }
    }
    Ok(())
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn one_for_one_matches_otp_model(s in scenario(Strategy::OneForOne, false)) {
        run(&s)?;
    }

    #[test]
    fn one_for_all_matches_otp_model(s in scenario(Strategy::OneForAll, false)) {
        run(&s)?;
    }

    #[test]
    fn rest_for_one_matches_otp_model(s in scenario(Strategy::RestForOne, false)) {
        run(&s)?;
    }

    #[test]
    fn simple_one_for_one_matches_otp_model(s in scenario(Strategy::SimpleOneForOne, false)) {
        run(&s)?;
    }

    #[test]
    fn significant_children_match_otp_model(
        s in prop::sample::select(Strategy::ALL.to_vec())
            .prop_flat_map(|strategy| scenario(strategy, true))
    ) {
        run(&s)?;
    }
}
