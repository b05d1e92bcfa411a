//! A reference model of an OTP supervisor, written from OTP's specification
//! and in the shape of `supervisor.erl` (children kept newest first,
//! `terminate_children`, `start_children`, `restart/2`, `do_restart`,
//! `do_auto_shutdown`, `try_again_restart` as a message to self), shared by
//! `tests/model.rs` (against the machine) and `tests/mailbox.rs` (against the
//! supervisor actor).
//!
//! For the supervisor actor, the model also keeps a clock: a stop of a child
//! that hangs on stop takes that child's shutdown timeout, everything else no
//! time, so that a driver can tell which messages arrive while the
//! supervisor is busy.

// Each test binary uses its own part of the model.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use regent_supervisor::machine::{ChildStatus, ExitCause, Request, RequestId};
use regent_supervisor::{
    AutoShutdown, ChildError, ChildId, ChildKey, ChildPolicy, ExitReason, Incarnation, InstanceId,
    Restart, StartError, Strategy, SupervisorFlags,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Trace {
    Start(ChildKey, Incarnation, bool),
    Stop(Vec<ChildKey>),
    Reply(Result<Option<(ChildKey, Incarnation)>, String>),
    Exit(String, Option<ChildKey>),
}

pub(crate) fn error_kind(e: &ChildError) -> String {
    match e {
        ChildError::NotFound(k) => format!("not_found {k}"),
        ChildError::Running(k) => format!("running {k}"),
        ChildError::Restarting(k) => format!("restarting {k}"),
        ChildError::WrongStrategy(_) => "simple_one_for_one".into(),
        ChildError::AlreadyStarted(id) => format!("already_started {id}"),
        ChildError::AlreadyPresent(id) => format!("already_present {id}"),
        ChildError::Spec(_) => "bad_spec".into(),
        ChildError::Start { key, .. } => format!("start_failed {key}"),
        ChildError::SupervisorDown => "down".into(),
    }
}

pub(crate) fn cause_trace(c: &ExitCause) -> Trace {
    match c {
        ExitCause::IntensityExceeded { key } => Trace::Exit("intensity".into(), Some(key.clone())),
        ExitCause::AutoShutdown { key } => Trace::Exit("auto_shutdown".into(), Some(key.clone())),
        ExitCause::Requested => Trace::Exit("requested".into(), None),
        ExitCause::StartFailed { key, .. } => Trace::Exit("start_failed".into(), Some(key.clone())),
    }
}

/// Which starts fail: the world both implementations run in.
#[derive(Debug, Default, Clone)]
pub(crate) struct World {
    /// Every start of these children fails.
    pub(crate) failing: HashSet<ChildKey>,
    /// For `simple_one_for_one`: every start of the template fails.
    pub(crate) template_fails: bool,
    /// The starts of these incarnations fail, whichever child they are of.
    pub(crate) failing_incarnations: HashSet<u64>,
}

impl World {
    pub(crate) fn start_ok(&self, key: &ChildKey, incarnation: Incarnation) -> bool {
        if self.failing_incarnations.contains(&incarnation.0) {
            return false;
        }
        match key {
            ChildKey::Dynamic(_) => !self.template_fails && !self.failing.contains(key),
            ChildKey::Static(_) => !self.failing.contains(key),
        }
    }
}

// ---------------------------------------------------------------------------
// The reference model, after supervisor.erl.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pid {
    Undefined,
    Restarting,
    Alive(Incarnation),
}

#[derive(Debug, Clone)]
struct MChild {
    spec: ChildPolicy,
    pid: Pid,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    Exit(ChildKey, Incarnation, ExitReason),
    TryAgain(ChildKey),
    Request(RequestId, Request),
    Shutdown,
}

pub(crate) struct Model {
    flags: SupervisorFlags,
    /// Newest first, as OTP keeps them.
    ids: Vec<ChildId>,
    db: HashMap<ChildId, MChild>,
    template: Option<ChildPolicy>,
    dynamics: BTreeMap<InstanceId, Pid>,
    next_instance: u64,
    next_incarnation: u64,
    /// Newest first, in milliseconds.
    restarts: Vec<u64>,
    pub(crate) mailbox: VecDeque<Msg>,
    pub(crate) exited: bool,
    pub(crate) trace: Vec<Trace>,
    /// Children that hang on stop: stopping one takes `hang_ms`.
    pub(crate) hangs: HashSet<ChildId>,
    pub(crate) hang_ms: u64,
    /// The model's time, advanced by the stops of children that hang.
    pub(crate) clock_ms: u64,
}

pub(crate) enum Outcome {
    Ok,
    Shutdown(ExitCause),
}

impl Model {
    pub(crate) fn new(flags: SupervisorFlags, specs: &[ChildPolicy]) -> Self {
        let mut m = Self {
            flags,
            ids: Vec::new(),
            db: HashMap::new(),
            template: None,
            dynamics: BTreeMap::new(),
            next_instance: 0,
            next_incarnation: 0,
            restarts: Vec::new(),
            mailbox: VecDeque::new(),
            exited: false,
            trace: Vec::new(),
            hangs: HashSet::new(),
            hang_ms: 0,
            clock_ms: 0,
        };
        if flags.strategy == Strategy::SimpleOneForOne {
            m.template = Some(specs[0].clone());
        } else {
            for s in specs {
                m.ids.insert(0, s.id.clone());
                m.db.insert(
                    s.id.clone(),
                    MChild {
                        spec: s.clone(),
                        pid: Pid::Undefined,
                    },
                );
            }
        }
        m
    }

    pub(crate) fn simple(&self) -> bool {
        self.template.is_some()
    }

    fn do_start_child(&mut self, key: &ChildKey, world: &World) -> Result<Incarnation, ()> {
        let inc = Incarnation(self.next_incarnation);
        self.next_incarnation += 1;
        let ok = world.start_ok(key, inc);
        self.trace.push(Trace::Start(key.clone(), inc, ok));
        if ok { Ok(inc) } else { Err(()) }
    }

    pub(crate) fn shutdown_child(&mut self, key: ChildKey) {
        if matches!(&key, ChildKey::Static(id) if self.hangs.contains(id)) {
            self.clock_ms += self.hang_ms;
        }
        self.trace.push(Trace::Stop(vec![key]));
    }

    /// init_children.
    pub(crate) fn init(&mut self, world: &World) {
        let start_order: Vec<ChildId> = self.ids.iter().rev().cloned().collect();
        for id in start_order {
            let key = ChildKey::Static(id.clone());
            match self.do_start_child(&key, world) {
                Ok(inc) => self.db.get_mut(&id).unwrap().pid = Pid::Alive(inc),
                Err(()) => {
                    let all = self.ids.clone();
                    self.terminate_children(&all);
                    self.exit(ExitCause::StartFailed {
                        key,
                        error: StartError::Failed(String::new()),
                    });
                    return;
                }
            }
        }
    }

    pub(crate) fn exit(&mut self, cause: ExitCause) {
        self.trace.push(cause_trace(&cause));
        self.exited = true;
    }

    /// terminate/2: all children, in reverse start order (dynamic: at once).
    pub(crate) fn terminate(&mut self, cause: ExitCause) {
        if self.simple() {
            let alive: Vec<ChildKey> = self
                .dynamics
                .iter()
                .filter(|(_, p)| matches!(p, Pid::Alive(_)))
                .map(|(n, _)| ChildKey::Dynamic(*n))
                .collect();
            if !alive.is_empty() {
                self.trace.push(Trace::Stop(alive));
            }
            self.dynamics.clear();
        } else {
            let all = self.ids.clone();
            self.terminate_children(&all);
        }
        self.exit(cause);
    }

    /// terminate_children over `ids` (newest first): stop the live ones,
    /// forget temporary ones, mark the rest undefined.
    pub(crate) fn terminate_children(&mut self, ids: &[ChildId]) {
        for id in ids {
            let Some(c) = self.db.get(id).cloned() else {
                continue;
            };
            if let Pid::Alive(_) = c.pid {
                self.shutdown_child(ChildKey::Static(id.clone()));
            }
            if c.spec.restart == Restart::Temporary {
                self.db.remove(id);
                self.ids.retain(|i| i != id);
            } else {
                self.db.get_mut(id).unwrap().pid = Pid::Undefined;
            }
        }
    }

    pub(crate) fn del_child(&mut self, key: &ChildKey) {
        match key {
            ChildKey::Dynamic(n) => {
                self.dynamics.remove(n);
            }
            ChildKey::Static(id) => {
                if self.db[id].spec.restart == Restart::Temporary {
                    self.db.remove(id);
                    self.ids.retain(|i| i != id);
                } else {
                    self.db.get_mut(id).unwrap().pid = Pid::Undefined;
                }
            }
        }
    }

    pub(crate) fn policy(&self, key: &ChildKey) -> ChildPolicy {
        match key {
            ChildKey::Static(id) => self.db[id].spec.clone(),
            ChildKey::Dynamic(_) => self.template.clone().unwrap(),
        }
    }

    pub(crate) fn pid(&self, key: &ChildKey) -> Option<Pid> {
        match key {
            ChildKey::Static(id) => self.db.get(id).map(|c| c.pid),
            ChildKey::Dynamic(n) => self.dynamics.get(n).copied(),
        }
    }

    pub(crate) fn set_pid(&mut self, key: &ChildKey, pid: Pid) {
        match key {
            ChildKey::Static(id) => self.db.get_mut(id).unwrap().pid = pid,
            ChildKey::Dynamic(n) => {
                self.dynamics.insert(*n, pid);
            }
        }
    }

    /// do_restart.
    pub(crate) fn do_restart(
        &mut self,
        reason: &ExitReason,
        key: ChildKey,
        now: u64,
        w: &World,
    ) -> Outcome {
        let spec = self.policy(&key);
        match spec.restart {
            Restart::Permanent => self.restart(key, now, w),
            _ if matches!(reason, ExitReason::Normal | ExitReason::Shutdown) => {
                self.del_child(&key);
                self.do_auto_shutdown(&spec, key)
            }
            Restart::Transient => self.restart(key, now, w),
            Restart::Temporary => {
                self.del_child(&key);
                self.do_auto_shutdown(&spec, key)
            }
        }
    }

    pub(crate) fn do_auto_shutdown(&mut self, spec: &ChildPolicy, key: ChildKey) -> Outcome {
        if self.flags.auto_shutdown == AutoShutdown::Never || !spec.significant {
            return Outcome::Ok;
        }
        let shut = match self.flags.auto_shutdown {
            AutoShutdown::AnySignificant => true,
            AutoShutdown::AllSignificant if self.simple() => self.dynamics.is_empty(),
            AutoShutdown::AllSignificant => !self
                .db
                .values()
                .any(|c| c.pid != Pid::Undefined && c.spec.significant),
            AutoShutdown::Never => unreachable!(),
        };
        if shut {
            Outcome::Shutdown(ExitCause::AutoShutdown { key })
        } else {
            Outcome::Ok
        }
    }

    /// add_restart: keep restarts no older than `period`, add now.
    pub(crate) fn add_restart(&mut self, now: u64) -> bool {
        let period = self.flags.intensity.period.as_millis() as u64;
        self.restarts.retain(|&t| t + period >= now);
        self.restarts.insert(0, now);
        self.restarts.len() <= self.flags.intensity.max_restarts as usize
    }

    /// restart/2.
    pub(crate) fn restart(&mut self, key: ChildKey, now: u64, w: &World) -> Outcome {
        if !self.add_restart(now) {
            self.del_child(&key);
            return Outcome::Shutdown(ExitCause::IntensityExceeded { key });
        }
        let try_again = match self.flags.strategy {
            Strategy::SimpleOneForOne | Strategy::OneForOne => match self.do_start_child(&key, w) {
                Ok(inc) => {
                    self.set_pid(&key, Pid::Alive(inc));
                    None
                }
                Err(()) => {
                    self.set_pid(&key, Pid::Restarting);
                    Some(key.clone())
                }
            },
            Strategy::RestForOne => {
                let ChildKey::Static(id) = &key else {
                    unreachable!()
                };
                // split_child: the child and those started after it (the
                // front of the newest-first list), child marked undefined.
                let pos = self.ids.iter().position(|i| i == id).unwrap();
                let after: Vec<ChildId> = self.ids[..=pos].to_vec();
                self.db.get_mut(id).unwrap().pid = Pid::Undefined;
                self.restart_multiple_children(&after, w)
            }
            Strategy::OneForAll => {
                let ChildKey::Static(id) = &key else {
                    unreachable!()
                };
                self.db.get_mut(id).unwrap().pid = Pid::Undefined;
                let all = self.ids.clone();
                self.restart_multiple_children(&all, w)
            }
        };
        if let Some(k) = try_again {
            self.mailbox.push_back(Msg::TryAgain(k));
        }
        Outcome::Ok
    }

    /// restart_multiple_children: terminate (newest first), then start the
    /// survivors oldest first; on a failure, that child is restarting and the
    /// rest stay undefined.
    pub(crate) fn restart_multiple_children(
        &mut self,
        ids: &[ChildId],
        w: &World,
    ) -> Option<ChildKey> {
        self.terminate_children(ids);
        let survivors: Vec<ChildId> = ids
            .iter()
            .rev()
            .filter(|i| self.db.contains_key(*i))
            .cloned()
            .collect();
        for id in survivors {
            let key = ChildKey::Static(id.clone());
            match self.do_start_child(&key, w) {
                Ok(inc) => self.db.get_mut(&id).unwrap().pid = Pid::Alive(inc),
                Err(()) => {
                    self.db.get_mut(&id).unwrap().pid = Pid::Restarting;
                    return Some(key);
                }
            }
        }
        None
    }

    pub(crate) fn reply(&mut self, r: Result<Option<(ChildKey, Incarnation)>, String>) {
        self.trace.push(Trace::Reply(r));
    }

    pub(crate) fn handle_request(&mut self, req: Request, w: &World) {
        let simple = self.simple();
        match req {
            Request::StartChild(spec) => {
                if simple {
                    return self.reply(Err("simple_one_for_one".into()));
                }
                if spec.validate(self.flags.auto_shutdown).is_err() {
                    return self.reply(Err("bad_spec".into()));
                }
                if let Some(c) = self.db.get(&spec.id) {
                    let e = match c.pid {
                        Pid::Alive(_) => format!("already_started {}", spec.id),
                        _ => format!("already_present {}", spec.id),
                    };
                    return self.reply(Err(e));
                }
                let key = ChildKey::Static(spec.id.clone());
                match self.do_start_child(&key, w) {
                    Ok(inc) => {
                        self.ids.insert(0, spec.id.clone());
                        self.db.insert(
                            spec.id.clone(),
                            MChild {
                                spec,
                                pid: Pid::Alive(inc),
                            },
                        );
                        self.reply(Ok(Some((key, inc))));
                    }
                    Err(()) => self.reply(Err(format!("start_failed {key}"))),
                }
            }
            Request::StartDynamic => {
                if !simple {
                    return self.reply(Err("simple_one_for_one".into()));
                }
                let n = InstanceId(self.next_instance);
                self.next_instance += 1;
                let key = ChildKey::Dynamic(n);
                match self.do_start_child(&key, w) {
                    Ok(inc) => {
                        self.dynamics.insert(n, Pid::Alive(inc));
                        self.reply(Ok(Some((key, inc))));
                    }
                    Err(()) => self.reply(Err(format!("start_failed {key}"))),
                }
            }
            Request::TerminateChild(key) => {
                if simple && matches!(key, ChildKey::Static(_)) {
                    return self.reply(Err("simple_one_for_one".into()));
                }
                match self.pid(&key) {
                    None => self.reply(Err(format!("not_found {key}"))),
                    Some(pid) => {
                        if let Pid::Alive(_) = pid {
                            self.shutdown_child(key.clone());
                        }
                        self.del_child(&key);
                        self.reply(Ok(None));
                    }
                }
            }
            Request::RestartChild(id) => {
                if simple {
                    return self.reply(Err("simple_one_for_one".into()));
                }
                let key = ChildKey::Static(id.clone());
                match self.pid(&key) {
                    None => self.reply(Err(format!("not_found {key}"))),
                    Some(Pid::Restarting) => self.reply(Err(format!("restarting {key}"))),
                    Some(Pid::Alive(_)) => self.reply(Err(format!("running {key}"))),
                    Some(Pid::Undefined) => match self.do_start_child(&key, w) {
                        Ok(inc) => {
                            self.set_pid(&key, Pid::Alive(inc));
                            self.reply(Ok(Some((key, inc))));
                        }
                        Err(()) => self.reply(Err(format!("start_failed {key}"))),
                    },
                }
            }
            Request::DeleteChild(id) => {
                if simple {
                    return self.reply(Err("simple_one_for_one".into()));
                }
                let key = ChildKey::Static(id.clone());
                match self.pid(&key) {
                    None => self.reply(Err(format!("not_found {key}"))),
                    Some(Pid::Restarting) => self.reply(Err(format!("restarting {key}"))),
                    Some(Pid::Alive(_)) => self.reply(Err(format!("running {key}"))),
                    Some(Pid::Undefined) => {
                        self.db.remove(&id);
                        self.ids.retain(|i| *i != id);
                        self.reply(Ok(None));
                    }
                }
            }
        }
    }

    /// Handles everything in the mailbox, like the gen_server loop.
    pub(crate) fn drain(&mut self, now: u64, w: &World) {
        while let Some(msg) = self.mailbox.pop_front() {
            if self.exited {
                return;
            }
            self.handle(msg, now, w);
        }
    }

    /// Handles one message at `now` (ms); what it sends itself goes to the
    /// mailbox.
    pub(crate) fn handle(&mut self, msg: Msg, now: u64, w: &World) {
        if self.exited {
            return;
        }
        let outcome = match msg {
            Msg::Exit(key, inc, reason) => match self.pid(&key) {
                Some(Pid::Alive(i)) if i == inc => self.do_restart(&reason, key, now, w),
                _ => Outcome::Ok,
            },
            Msg::TryAgain(key) => match self.pid(&key) {
                Some(Pid::Restarting) => self.restart(key, now, w),
                _ => Outcome::Ok,
            },
            Msg::Request(_, req) => {
                self.handle_request(req, w);
                Outcome::Ok
            }
            Msg::Shutdown => Outcome::Shutdown(ExitCause::Requested),
        };
        if let Outcome::Shutdown(cause) = outcome {
            self.terminate(cause);
        }
    }

    pub(crate) fn children(&self) -> Vec<(ChildKey, ChildStatus)> {
        let status = |p: Pid| match p {
            Pid::Alive(i) => ChildStatus::Running(i),
            Pid::Restarting => ChildStatus::Restarting,
            Pid::Undefined => ChildStatus::Terminated,
        };
        if self.simple() {
            self.dynamics
                .iter()
                .map(|(n, p)| (ChildKey::Dynamic(*n), status(*p)))
                .collect()
        } else {
            self.ids
                .iter()
                .rev()
                .map(|id| (ChildKey::Static(id.clone()), status(self.db[id].pid)))
                .collect()
        }
    }
}
