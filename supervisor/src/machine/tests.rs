//! Scenario tests of the machine: one per rule, in OTP's words. The
//! model-based proptest (`tests/model.rs`) covers random sequences.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::*;
use crate::spec::Backoff;

/// Drives a machine, answering starts (failing those in `failing`) and stops,
/// and logs what it did in a compact form.
struct Driver {
    m: Machine,
    base: Instant,
    now: Duration,
    failing: HashSet<String>,
    timers: Vec<(TimerId, Duration)>,
    log: Vec<String>,
    replies: Vec<Reply>,
}

fn k(id: &str) -> ChildKey {
    ChildKey::Static(ChildId::new(id))
}

impl Driver {
    fn new(flags: SupervisorFlags, children: Vec<ChildPolicy>) -> Self {
        let mut d = Self {
            m: Machine::new(flags, children).expect("valid"),
            base: Instant::now(),
            now: Duration::ZERO,
            failing: HashSet::new(),
            timers: Vec::new(),
            log: Vec::new(),
            replies: Vec::new(),
        };
        d.send(Event::Init);
        d
    }

    fn send(&mut self, event: Event) -> Vec<String> {
        let start = self.log.len();
        let now = self.base + self.now;
        let mut queue: VecDeque<Action> = self.m.handle(now, event).into();
        while let Some(a) = queue.pop_front() {
            match a {
                Action::Start { key, .. } => {
                    let ok = !self.failing.contains(&key.to_string());
                    self.log
                        .push(format!("start {key}{}", if ok { "" } else { " fails" }));
                    let outcome = if ok {
                        Ok(())
                    } else {
                        Err(StartError::Failed("no".into()))
                    };
                    queue.extend(self.m.handle(now, Event::Started(outcome)));
                }
                Action::Stop { targets, .. } => {
                    let keys: Vec<String> = targets.iter().map(|(k, _)| k.to_string()).collect();
                    self.log.push(format!("stop {}", keys.join(",")));
                    queue.extend(self.m.handle(now, Event::Stopped));
                }
                Action::SetTimer { timer, after } => {
                    self.log.push(format!("timer {}ms", after.as_millis()));
                    self.timers.push((timer, self.now + after));
                }
                Action::Reply { reply, .. } => self.replies.push(reply),
                Action::Report(_) => {}
                Action::Exit(cause) => self.log.push(match cause {
                    ExitCause::IntensityExceeded { key } => format!("exit intensity {key}"),
                    ExitCause::AutoShutdown { key } => format!("exit auto_shutdown {key}"),
                    ExitCause::Requested => "exit requested".into(),
                    ExitCause::StartFailed { key, .. } => format!("exit start_failed {key}"),
                }),
            }
        }
        self.log[start..].to_vec()
    }

    fn inc(&self, key: &ChildKey) -> Incarnation {
        match self.status(key) {
            ChildStatus::Running(i) => i,
            other => panic!("{key} is not running: {other:?}"),
        }
    }

    fn status(&self, key: &ChildKey) -> ChildStatus {
        self.m
            .children()
            .into_iter()
            .find(|c| &c.key == key)
            .map(|c| c.status)
            .unwrap_or_else(|| panic!("no child {key}"))
    }

    fn exit(&mut self, id: &str, reason: ExitReason) -> Vec<String> {
        let key = k(id);
        let incarnation = self.inc(&key);
        self.send(Event::Exited {
            key,
            incarnation,
            reason,
        })
    }

    fn crash(&mut self, id: &str) -> Vec<String> {
        self.exit(id, ExitReason::Failed("boom".into()))
    }

    /// Advances time, firing due timers in order.
    fn advance(&mut self, by: Duration) -> Vec<String> {
        let target = self.now + by;
        let mut out = Vec::new();
        loop {
            self.timers.sort_by_key(|(_, at)| *at);
            match self.timers.first() {
                Some(&(timer, at)) if at <= target => {
                    self.timers.remove(0);
                    self.now = self.now.max(at);
                    out.extend(self.send(Event::Timer(timer)));
                }
                _ => break,
            }
        }
        self.now = target;
        out
    }

    fn request(&mut self, r: Request) -> (Vec<String>, Reply) {
        let log = self.send(Event::Request(RequestId(0), r));
        (log, self.replies.pop().expect("a reply"))
    }
}

fn workers(n: usize) -> Vec<ChildPolicy> {
    (0..n)
        .map(|i| ChildPolicy::worker(format!("c{i}")))
        .collect()
}

fn flags(strategy: Strategy) -> SupervisorFlags {
    SupervisorFlags::new(strategy).intensity(10, Duration::from_secs(5))
}

#[test]
fn children_start_in_order() {
    let d = Driver::new(flags(Strategy::OneForOne), workers(3));
    assert_eq!(d.log, ["start c0", "start c1", "start c2"]);
    assert!(d.m.is_running());
}

#[test]
fn one_for_one_restarts_only_the_child() {
    let mut d = Driver::new(flags(Strategy::OneForOne), workers(3));
    assert_eq!(d.crash("c1"), ["start c1"]);
}

#[test]
fn one_for_all_stops_the_others_in_reverse_then_starts_all_in_order() {
    let mut d = Driver::new(flags(Strategy::OneForAll), workers(4));
    assert_eq!(
        d.crash("c1"),
        [
            "stop c3", "stop c2", "stop c0", "start c0", "start c1", "start c2", "start c3"
        ]
    );
}

#[test]
fn rest_for_one_restarts_the_child_and_those_after_it() {
    let mut d = Driver::new(flags(Strategy::RestForOne), workers(4));
    assert_eq!(
        d.crash("c1"),
        ["stop c3", "stop c2", "start c1", "start c2", "start c3"]
    );
}

#[test]
fn default_intensity_is_one_restart_in_five_seconds() {
    let f = SupervisorFlags::new(Strategy::OneForOne);
    assert_eq!(f.intensity.max_restarts, 1);
    assert_eq!(f.intensity.period, Duration::from_secs(5));
    let mut d = Driver::new(f, workers(3));
    assert_eq!(d.crash("c0"), ["start c0"]);
    d.advance(Duration::from_secs(5)); // the window is inclusive: still inside
    assert_eq!(
        d.crash("c2"),
        ["stop c1", "stop c0", "exit intensity c2"],
        "the second restart within 5 s stops the rest in reverse order and exits"
    );
    assert!(d.m.has_exited());
    assert!(
        d.send(Event::Shutdown).is_empty(),
        "an exited machine is inert"
    );
}

#[test]
fn restarts_outside_the_period_are_forgotten() {
    let mut d = Driver::new(SupervisorFlags::new(Strategy::OneForOne), workers(1));
    for _ in 0..10 {
        assert_eq!(d.crash("c0"), ["start c0"]);
        d.advance(Duration::from_millis(5001));
    }
}

#[test]
fn zero_intensity_gives_up_at_the_first_restart() {
    let f = SupervisorFlags::new(Strategy::OneForOne).intensity(0, Duration::from_secs(1));
    let mut d = Driver::new(f, workers(2));
    assert_eq!(d.crash("c0"), ["stop c1", "exit intensity c0"]);
}

#[test]
fn transient_children_restart_only_after_abnormal_exits() {
    let children = vec![ChildPolicy::worker("c0").restart(Restart::Transient)];
    let mut d = Driver::new(flags(Strategy::OneForOne), children);
    for reason in [
        ExitReason::Failed("x".into()),
        ExitReason::Panicked("y".into()),
        ExitReason::Killed,
    ] {
        assert_eq!(d.exit("c0", reason), ["start c0"]);
    }
    assert!(d.exit("c0", ExitReason::Shutdown).is_empty());
    assert_eq!(d.status(&k("c0")), ChildStatus::Terminated);
    let (_, reply) = d.request(Request::RestartChild(ChildId::new("c0")));
    assert!(matches!(reply, Reply::Started(Ok(_))));
    assert!(d.exit("c0", ExitReason::Normal).is_empty());
    assert_eq!(d.status(&k("c0")), ChildStatus::Terminated);
}

#[test]
fn permanent_children_restart_even_after_normal_exits() {
    let mut d = Driver::new(flags(Strategy::OneForOne), workers(1));
    assert_eq!(d.exit("c0", ExitReason::Normal), ["start c0"]);
    assert_eq!(d.exit("c0", ExitReason::Shutdown), ["start c0"]);
}

#[test]
fn temporary_children_are_never_restarted_and_are_forgotten() {
    let mut children = workers(3);
    children[1].restart = Restart::Temporary;
    let mut d = Driver::new(flags(Strategy::OneForAll), children.clone());
    // Stopped by a sibling's restart: not restarted, removed.
    assert_eq!(
        d.crash("c2"),
        ["stop c1", "stop c0", "start c0", "start c2"]
    );
    assert_eq!(d.m.children().len(), 2);
    // Crashing on its own: removed too.
    let mut d = Driver::new(flags(Strategy::OneForOne), children);
    assert!(d.crash("c1").is_empty());
    assert_eq!(d.m.children().len(), 2);
}

#[test]
fn stale_exit_reports_are_ignored() {
    let mut d = Driver::new(flags(Strategy::OneForOne), workers(1));
    let old = d.inc(&k("c0"));
    d.crash("c0");
    let log = d.send(Event::Exited {
        key: k("c0"),
        incarnation: old,
        reason: ExitReason::Killed,
    });
    assert!(log.is_empty());
}

#[test]
fn a_failed_initial_start_stops_the_started_children_and_fails() {
    let children = workers(3);
    let mut d = Driver {
        m: Machine::new(flags(Strategy::OneForOne), children).unwrap(),
        base: Instant::now(),
        now: Duration::ZERO,
        failing: ["c2".to_owned()].into(),
        timers: Vec::new(),
        log: Vec::new(),
        replies: Vec::new(),
    };
    assert_eq!(
        d.send(Event::Init),
        [
            "start c0",
            "start c1",
            "start c2 fails",
            "stop c1",
            "stop c0",
            "exit start_failed c2"
        ]
    );
}

#[test]
fn a_failed_restart_is_tried_again_and_counts_toward_intensity() {
    let f = SupervisorFlags::new(Strategy::OneForOne).intensity(3, Duration::from_secs(5));
    let mut d = Driver::new(f, workers(2));
    d.failing.insert("c0".into());
    assert_eq!(d.crash("c0"), ["start c0 fails", "timer 0ms"]);
    assert_eq!(d.status(&k("c0")), ChildStatus::Restarting);
    // Each try again is a restart: the fourth within 5 s exceeds 3.
    assert_eq!(
        d.advance(Duration::ZERO),
        [
            "start c0 fails",
            "timer 0ms",
            "start c0 fails",
            "timer 0ms",
            "stop c1",
            "exit intensity c0"
        ]
    );
}

#[test]
fn a_failed_restart_of_a_group_leaves_the_rest_for_the_next_try() {
    let mut d = Driver::new(flags(Strategy::OneForAll), workers(3));
    d.failing.insert("c1".into());
    assert_eq!(
        d.crash("c0"),
        [
            "stop c2",
            "stop c1",
            "start c0",
            "start c1 fails",
            "timer 0ms"
        ]
    );
    assert_eq!(d.status(&k("c2")), ChildStatus::Terminated);
    d.failing.clear();
    assert_eq!(
        d.advance(Duration::ZERO),
        ["stop c0", "start c0", "start c1", "start c2"]
    );
}

#[test]
fn any_significant_shuts_down_when_a_significant_child_is_done() {
    let f = flags(Strategy::OneForOne).auto_shutdown(AutoShutdown::AnySignificant);
    let children = vec![
        ChildPolicy::worker("c0"),
        ChildPolicy::worker("c1")
            .restart(Restart::Transient)
            .significant(true),
        ChildPolicy::worker("c2"),
    ];
    let mut d = Driver::new(f, children);
    assert_eq!(d.crash("c1"), ["start c1"], "restarted, so no shutdown");
    assert_eq!(
        d.exit("c1", ExitReason::Normal),
        ["stop c2", "stop c0", "exit auto_shutdown c1"]
    );
}

#[test]
fn all_significant_waits_for_the_last_and_counts_a_restarting_child_as_alive() {
    let f = flags(Strategy::OneForOne).auto_shutdown(AutoShutdown::AllSignificant);
    let sig = |id: &str| {
        ChildPolicy::worker(id)
            .restart(Restart::Transient)
            .significant(true)
    };
    let mut d = Driver::new(f, vec![sig("c0"), sig("c1"), ChildPolicy::worker("c2")]);
    // c0 crashes and cannot restart yet: it is restarting, hence alive.
    d.failing.insert("c0".into());
    assert_eq!(d.crash("c0"), ["start c0 fails", "timer 0ms"]);
    assert!(d.exit("c1", ExitReason::Normal).is_empty());
    // Once c0 is back and then done, nothing significant is left.
    d.failing.clear();
    assert_eq!(d.advance(Duration::ZERO), ["start c0"]);
    assert_eq!(
        d.exit("c0", ExitReason::Shutdown),
        ["stop c2", "exit auto_shutdown c0"]
    );
}

#[test]
fn terminate_child_does_not_trigger_auto_shutdown() {
    let f = flags(Strategy::OneForOne).auto_shutdown(AutoShutdown::AnySignificant);
    let children = vec![
        ChildPolicy::worker("c0")
            .restart(Restart::Temporary)
            .significant(true),
    ];
    let mut d = Driver::new(f, children);
    let (log, reply) = d.request(Request::TerminateChild(k("c0")));
    assert_eq!(log, ["stop c0"]);
    assert_eq!(reply, Reply::Done(Ok(())));
    assert!(!d.m.has_exited());
    assert!(d.m.children().is_empty(), "temporary: forgotten");
}

#[test]
fn specs_break_no_otp_rule() {
    let never = SupervisorFlags::new(Strategy::OneForOne);
    let any = never.auto_shutdown(AutoShutdown::AnySignificant);
    let sig_perm = ChildPolicy::worker("a").significant(true);
    assert_eq!(
        Machine::new(any, vec![sig_perm]).unwrap_err(),
        SpecError::SignificantPermanent { id: "a".into() }
    );
    let sig_trans = ChildPolicy::worker("a")
        .restart(Restart::Transient)
        .significant(true);
    assert_eq!(
        Machine::new(never, vec![sig_trans.clone()]).unwrap_err(),
        SpecError::SignificantWithoutAutoShutdown { id: "a".into() }
    );
    assert!(Machine::new(any, vec![sig_trans]).is_ok());
    assert_eq!(
        Machine::new(
            never,
            vec![ChildPolicy::worker("a"), ChildPolicy::worker("a")]
        )
        .unwrap_err(),
        SpecError::DuplicateId { id: "a".into() }
    );
    assert_eq!(
        Machine::new(never.intensity(1, Duration::ZERO), vec![]).unwrap_err(),
        SpecError::ZeroPeriod
    );
    let simple = SupervisorFlags::new(Strategy::SimpleOneForOne);
    assert_eq!(
        Machine::new(simple, workers(2)).unwrap_err(),
        SpecError::SimpleNeedsOneTemplate { count: 2 }
    );
    // The message names the rule.
    let msg = SpecError::SignificantPermanent { id: "a".into() }.to_string();
    assert!(msg.contains("transient or temporary"), "{msg}");
}

#[test]
fn requests_follow_otp_answers() {
    let mut d = Driver::new(flags(Strategy::OneForOne), workers(1));
    let (_, r) = d.request(Request::StartChild(ChildPolicy::worker("c0")));
    assert_eq!(
        r,
        Reply::Started(Err(ChildError::AlreadyStarted("c0".into())))
    );
    let (_, r) = d.request(Request::DeleteChild("c0".into()));
    assert_eq!(r, Reply::Done(Err(ChildError::Running(k("c0")))));
    let (log, r) = d.request(Request::TerminateChild(k("c0")));
    assert_eq!((log, r), (vec!["stop c0".to_owned()], Reply::Done(Ok(()))));
    let (_, r) = d.request(Request::StartChild(ChildPolicy::worker("c0")));
    assert_eq!(
        r,
        Reply::Started(Err(ChildError::AlreadyPresent("c0".into())))
    );
    let (log, r) = d.request(Request::RestartChild("c0".into()));
    assert_eq!(log, ["start c0"]);
    assert!(matches!(r, Reply::Started(Ok(_))));
    let (_, r) = d.request(Request::TerminateChild(k("nope")));
    assert_eq!(r, Reply::Done(Err(ChildError::NotFound(k("nope")))));
    // A child added later starts last and stops first.
    let (log, _) = d.request(Request::StartChild(ChildPolicy::worker("late")));
    assert_eq!(log, ["start late"]);
    assert_eq!(
        d.send(Event::Shutdown),
        ["stop late", "stop c0", "exit requested"]
    );
}

#[test]
fn a_child_that_fails_to_start_on_request_is_not_kept() {
    let mut d = Driver::new(flags(Strategy::OneForOne), workers(1));
    d.failing.insert("new".into());
    let (log, r) = d.request(Request::StartChild(ChildPolicy::worker("new")));
    assert_eq!(log, ["start new fails"]);
    assert!(matches!(r, Reply::Started(Err(ChildError::Start { .. }))));
    assert_eq!(d.m.children().len(), 1);
}

#[test]
fn simple_one_for_one_manages_dynamic_instances() {
    let f = flags(Strategy::SimpleOneForOne);
    let mut d = Driver::new(f, vec![ChildPolicy::worker("t")]);
    assert!(d.log.is_empty(), "no child at init");
    for _ in 0..3 {
        let (_, r) = d.request(Request::StartDynamic);
        assert!(matches!(r, Reply::Started(Ok(_))));
    }
    let c = d.m.counts();
    assert_eq!((c.specs, c.active, c.workers), (1, 3, 3));
    let one = ChildKey::Dynamic(InstanceId(1));
    let inc = d.inc(&one);
    let log = d.send(Event::Exited {
        key: one.clone(),
        incarnation: inc,
        reason: ExitReason::Killed,
    });
    assert_eq!(log, ["start #1"], "the instance keeps its number");
    let (_, r) = d.request(Request::DeleteChild("t".into()));
    assert!(matches!(r, Reply::Done(Err(ChildError::WrongStrategy(_)))));
    let (_, r) = d.request(Request::TerminateChild(k("t")));
    assert!(matches!(r, Reply::Done(Err(ChildError::WrongStrategy(_)))));
    let (log, r) = d.request(Request::TerminateChild(one));
    assert_eq!((log, r), (vec!["stop #1".to_owned()], Reply::Done(Ok(()))));
    assert_eq!(d.m.counts().workers, 2);
    // Shutdown stops all instances at once.
    assert_eq!(d.send(Event::Shutdown), ["stop #2,#0", "exit requested"]);
}

#[test]
fn events_during_a_procedure_wait_for_it() {
    let mut m = Machine::new(flags(Strategy::OneForAll), workers(2)).unwrap();
    let now = Instant::now();
    assert!(matches!(
        m.handle(now, Event::Init)[..],
        [Action::Start { .. }]
    ));
    // A shutdown request arrives while c0 is starting: deferred.
    assert!(m.handle(now, Event::Shutdown).is_empty());
    let a = m.handle(now, Event::Started(Ok(())));
    assert!(matches!(&a[..], [Action::Start { key, .. }] if *key == k("c1")));
    let a = m.handle(now, Event::Started(Ok(())));
    // Init done; now the deferred shutdown runs: c1 stops first.
    assert!(matches!(&a[..], [Action::Stop { targets, .. }] if targets[0].0 == k("c1")));
}

#[test]
fn backoff_delays_restarts_exponentially_and_resets_after_stable_running() {
    let backoff = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(35),
        reset_after: Duration::from_secs(1),
    };
    let f = SupervisorFlags::new(Strategy::OneForOne)
        .intensity(100, Duration::from_secs(5))
        .backoff(backoff);
    let mut d = Driver::new(f, workers(1));
    for expected in [10, 20, 35, 35] {
        assert_eq!(d.crash("c0"), [format!("timer {expected}ms")]);
        assert_eq!(d.status(&k("c0")), ChildStatus::Restarting);
        assert!(d.advance(Duration::from_millis(expected - 1)).is_empty());
        assert_eq!(d.advance(Duration::from_millis(1)), ["start c0"]);
    }
    d.advance(Duration::from_secs(1));
    assert_eq!(
        d.crash("c0"),
        ["timer 10ms"],
        "a stable run resets the streak"
    );
}

#[test]
fn backoff_counts_intensity_when_the_restart_is_decided() {
    let f = SupervisorFlags::new(Strategy::OneForOne).backoff(Backoff::default());
    let mut d = Driver::new(f, workers(2));
    assert_eq!(d.crash("c0"), ["timer 10ms"]);
    // The second restart within 5 s exceeds the default intensity even though
    // the first has not started yet; c0, waiting, has nothing to stop.
    assert_eq!(d.crash("c1"), ["exit intensity c1"]);
}

#[test]
fn backoff_of_one_for_all_stops_at_once_and_starts_after_the_delay() {
    let f = flags(Strategy::OneForAll).backoff(Backoff::default());
    let mut d = Driver::new(f, workers(3));
    assert_eq!(d.crash("c1"), ["stop c2", "stop c0", "timer 10ms"]);
    assert_eq!(
        d.advance(Duration::from_millis(10)),
        ["start c0", "start c1", "start c2"]
    );
}

#[test]
fn terminating_a_child_waiting_for_backoff_cancels_its_restart() {
    let f = flags(Strategy::OneForOne).backoff(Backoff::default());
    let mut d = Driver::new(f, workers(1));
    d.crash("c0");
    let (log, r) = d.request(Request::TerminateChild(k("c0")));
    assert!(log.is_empty(), "nothing to stop: {log:?}");
    assert_eq!(r, Reply::Done(Ok(())));
    assert!(d.advance(Duration::from_secs(1)).is_empty());
    assert_eq!(d.status(&k("c0")), ChildStatus::Terminated);
}

#[test]
fn backoff_delay_is_capped_and_never_overflows() {
    let b = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(60),
        reset_after: Duration::from_secs(1),
    };
    assert_eq!(b.delay(0), Duration::ZERO);
    assert_eq!(b.delay(1), Duration::from_secs(1));
    assert_eq!(b.delay(3), Duration::from_secs(4));
    assert_eq!(b.delay(7), Duration::from_secs(60));
    assert_eq!(b.delay(u32::MAX), Duration::from_secs(60));
}
