//! Child policies and supervisor flags: the data half of a child specification
//! and of a supervisor's configuration, with OTP's defaults and validity rules.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

/// The identifier of a child specification, unique within one supervisor.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChildId(Arc<str>);

impl ChildId {
    /// Makes an identifier from any string.
    pub fn new(id: impl AsRef<str>) -> Self {
        Self(Arc::from(id.as_ref()))
    }

    /// The identifier as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ChildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ChildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for ChildId {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for ChildId {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

/// The number of a dynamic child of a `simple_one_for_one` supervisor.
///
/// OTP addresses such children by pid; here an instance keeps its number
/// across restarts, so `terminate_child` reaches it whatever its incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InstanceId(pub u64);

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// How a supervisor names one of its children.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChildKey {
    /// A child of a static child specification.
    Static(ChildId),
    /// A dynamic child of a `simple_one_for_one` supervisor.
    Dynamic(InstanceId),
}

impl fmt::Display for ChildKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Static(id) => fmt::Display::fmt(id, f),
            Self::Dynamic(n) => fmt::Display::fmt(n, f),
        }
    }
}

/// One life of a child: every start gets a new incarnation, so an exit report
/// from an earlier life is recognised as stale and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Incarnation(pub u64);

/// When a terminated child is restarted (OTP's `restart` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Restart {
    /// Always restarted.
    #[default]
    Permanent,
    /// Restarted only after an abnormal exit (anything but `Normal` or
    /// `Shutdown`).
    Transient,
    /// Never restarted, not even when a sibling's restart stops it.
    Temporary,
}

/// How a child is stopped (OTP's `shutdown` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shutdown {
    /// Killed at once.
    BrutalKill,
    /// Asked to stop, then killed if it has not stopped within the timeout.
    Timeout(Duration),
    /// Asked to stop, and waited for without limit: the right choice for a
    /// child that is itself a supervisor, whose subtree needs time to stop.
    Infinity,
}

impl Shutdown {
    /// OTP's default for a worker: 5 seconds.
    pub const WORKER_DEFAULT: Self = Self::Timeout(Duration::from_secs(5));
}

/// Whether a child is a worker or a supervisor (OTP's `type` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ChildKind {
    /// A worker.
    #[default]
    Worker,
    /// A supervisor, whose shutdown defaults to [`Shutdown::Infinity`].
    Supervisor,
}

/// The part of a child specification that the decision logic needs: everything
/// but the start function.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChildPolicy {
    /// Unique within the supervisor.
    pub id: ChildId,
    /// When the child is restarted.
    pub restart: Restart,
    /// How the child is stopped.
    pub shutdown: Shutdown,
    /// Worker or supervisor.
    pub kind: ChildKind,
    /// Whether the child's exit can shut the supervisor down (see
    /// [`AutoShutdown`]).
    pub significant: bool,
}

impl ChildPolicy {
    /// A permanent worker with a 5 s shutdown timeout: OTP's defaults.
    pub fn worker(id: impl Into<ChildId>) -> Self {
        Self {
            id: id.into(),
            restart: Restart::Permanent,
            shutdown: Shutdown::WORKER_DEFAULT,
            kind: ChildKind::Worker,
            significant: false,
        }
    }

    /// A permanent supervisor child with an infinite shutdown: OTP's defaults.
    pub fn supervisor(id: impl Into<ChildId>) -> Self {
        Self {
            id: id.into(),
            restart: Restart::Permanent,
            shutdown: Shutdown::Infinity,
            kind: ChildKind::Supervisor,
            significant: false,
        }
    }

    /// Sets the restart type.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.restart = restart;
        self
    }

    /// Sets the shutdown.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// Sets the significant flag.
    pub fn significant(mut self, significant: bool) -> Self {
        self.significant = significant;
        self
    }

    /// Checks OTP's rules for this child under the given `auto_shutdown`: a
    /// significant child must not be permanent, and must not appear where
    /// `auto_shutdown` is `never`.
    pub fn validate(&self, auto_shutdown: AutoShutdown) -> Result<(), SpecError> {
        if self.significant {
            if auto_shutdown == AutoShutdown::Never {
                return Err(SpecError::SignificantWithoutAutoShutdown {
                    id: self.id.clone(),
                });
            }
            if self.restart == Restart::Permanent {
                return Err(SpecError::SignificantPermanent {
                    id: self.id.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Which children a restart affects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// Only the child that terminated is restarted.
    #[default]
    OneForOne,
    /// All children are stopped (in reverse start order) and started again
    /// (in start order).
    OneForAll,
    /// The terminated child and the children started after it are stopped and
    /// started again.
    RestForOne,
    /// Like `OneForOne`, for dynamically added instances of one template.
    SimpleOneForOne,
}

impl Strategy {
    /// All strategies, for tests and demos.
    pub const ALL: [Self; 4] = [
        Self::OneForOne,
        Self::OneForAll,
        Self::RestForOne,
        Self::SimpleOneForOne,
    ];
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::OneForOne => "one_for_one",
            Self::OneForAll => "one_for_all",
            Self::RestForOne => "rest_for_one",
            Self::SimpleOneForOne => "simple_one_for_one",
        })
    }
}

/// When the exit of significant children shuts the supervisor down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AutoShutdown {
    /// Never; significant children are refused.
    #[default]
    Never,
    /// When any significant child exits and is not restarted.
    AnySignificant,
    /// When the last running significant child exits and is not restarted.
    AllSignificant,
}

/// The restart intensity: more than `max_restarts` restarts within `period`
/// shut the supervisor down (OTP's `intensity` and `period`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Intensity {
    /// Restarts allowed within the period (OTP's `MaxR`); 0 means the first
    /// restart already shuts the supervisor down.
    pub max_restarts: u32,
    /// The sliding window (OTP's `MaxT`); must be non-zero.
    pub period: Duration,
}

impl Default for Intensity {
    /// One restart in five seconds, as in OTP.
    fn default() -> Self {
        Self {
            max_restarts: 1,
            period: Duration::from_secs(5),
        }
    }
}

/// Exponential restart backoff (beyond OTP; off by default).
///
/// The n-th consecutive restart of a child waits `min(initial * 2^(n-1),
/// max)` before the start; the count resets when the child had been running
/// for at least `reset_after` before it exited. The intensity check happens
/// when the restart is decided, not when the delayed start runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backoff {
    /// The delay before the first restart of a streak.
    pub initial: Duration,
    /// The cap on the delay.
    pub max: Duration,
    /// How long a child must have been running for its next exit to start a
    /// new streak.
    pub reset_after: Duration,
}

impl Backoff {
    /// The largest exponent applied; bounds the arithmetic, not the delay
    /// (which `max` bounds).
    const MAX_DOUBLINGS: u32 = 32;

    /// The delay before the restart number `streak` (1-based) of a streak.
    pub fn delay(&self, streak: u32) -> Duration {
        if streak == 0 {
            return Duration::ZERO;
        }
        let doublings = (streak - 1).min(Self::MAX_DOUBLINGS);
        let factor = 1u64 << doublings;
        let nanos = self.initial.as_nanos().saturating_mul(u128::from(factor));
        let capped = nanos.min(self.max.as_nanos());
        // `capped <= max.as_nanos()`, which came from a Duration, so it fits.
        Duration::from_nanos(u64::try_from(capped).unwrap_or(u64::MAX))
    }
}

impl Default for Backoff {
    /// 10 ms, doubling up to 5 s, reset after 30 s of stable running.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(10),
            max: Duration::from_secs(5),
            reset_after: Duration::from_secs(30),
        }
    }
}

/// A supervisor's configuration (OTP's supervisor flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SupervisorFlags {
    /// The restart strategy.
    pub strategy: Strategy,
    /// The restart intensity.
    pub intensity: Intensity,
    /// Automatic shutdown on the exit of significant children.
    pub auto_shutdown: AutoShutdown,
    /// Optional restart backoff; `None` (the default) restarts at once, as OTP.
    pub backoff: Option<Backoff>,
}

impl SupervisorFlags {
    /// Default flags with the given strategy.
    pub fn new(strategy: Strategy) -> Self {
        Self {
            strategy,
            ..Self::default()
        }
    }

    /// Sets the intensity: at most `max_restarts` within `period`.
    pub fn intensity(mut self, max_restarts: u32, period: Duration) -> Self {
        self.intensity = Intensity {
            max_restarts,
            period,
        };
        self
    }

    /// Sets automatic shutdown.
    pub fn auto_shutdown(mut self, auto_shutdown: AutoShutdown) -> Self {
        self.auto_shutdown = auto_shutdown;
        self
    }

    /// Turns restart backoff on.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// Checks the flags: the period must be non-zero.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.intensity.period.is_zero() {
            return Err(SpecError::ZeroPeriod);
        }
        if let Some(b) = &self.backoff
            && b.initial > b.max
        {
            return Err(SpecError::BackoffInitialAboveMax);
        }
        Ok(())
    }
}

/// Counts of a supervisor's children (OTP's `count_children`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChildCounts {
    /// Child specifications, running or not (1 for `simple_one_for_one`).
    pub specs: usize,
    /// Children running now.
    pub active: usize,
    /// Children (or dynamic instances) of kind supervisor.
    pub supervisors: usize,
    /// Children (or dynamic instances) of kind worker.
    pub workers: usize,
}

/// Bound on the children of one supervisor, static and dynamic together; a
/// `start_child` past it is refused.
pub const MAX_CHILDREN: usize = 1 << 20;

/// A child specification or supervisor configuration breaks OTP's rules.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// A significant child under `auto_shutdown = never`: it could never shut
    /// anything down, so OTP refuses it.
    #[error(
        "child {id}: significant children need auto_shutdown any_significant or all_significant (it is never)"
    )]
    SignificantWithoutAutoShutdown {
        /// The offending child.
        id: ChildId,
    },
    /// A significant child that is permanent: it is always restarted, so its
    /// exit could never shut the supervisor down.
    #[error("child {id}: a significant child must be transient or temporary, not permanent")]
    SignificantPermanent {
        /// The offending child.
        id: ChildId,
    },
    /// Two child specifications share an id.
    #[error("child id {id} appears twice")]
    DuplicateId {
        /// The repeated id.
        id: ChildId,
    },
    /// The intensity period is zero.
    #[error("the restart intensity period must be greater than zero")]
    ZeroPeriod,
    /// The backoff starts above its own cap.
    #[error("the restart backoff's initial delay is above its maximum")]
    BackoffInitialAboveMax,
    /// A `simple_one_for_one` supervisor has other than exactly one template.
    #[error("a simple_one_for_one supervisor takes exactly one child template, got {count}")]
    SimpleNeedsOneTemplate {
        /// How many were given.
        count: usize,
    },
    /// More children than [`MAX_CHILDREN`].
    #[error("a supervisor holds at most {MAX_CHILDREN} children")]
    TooManyChildren,
}
