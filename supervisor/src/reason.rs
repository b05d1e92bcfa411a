//! Why a child (or a supervisor) exited.

use std::fmt;

/// The reason an actor exited: a closed set a supervisor can match on.
///
/// `Normal` and `Shutdown` are the normal exits (OTP's `normal`, `shutdown`
/// and `{shutdown, _}`): a transient child is not restarted after them. The
/// others are abnormal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExitReason {
    /// The actor stopped itself: it finished its work.
    Normal,
    /// The actor was asked to stop (by its supervisor or owner) and did, or a
    /// supervisor shut itself down (restart intensity reached, or automatic
    /// shutdown).
    Shutdown,
    /// A handler, `pre_start` or `post_stop` returned an error.
    Failed(String),
    /// A handler, `pre_start` or `post_stop` panicked; the panic message.
    Panicked(String),
    /// The actor was killed: it did not stop in time, or was killed outright.
    Killed,
}

impl ExitReason {
    /// Whether this exit is normal in OTP's sense: `Normal` or `Shutdown`.
    pub fn is_normal(&self) -> bool {
        matches!(self, Self::Normal | Self::Shutdown)
    }

    /// Whether the actor panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, Self::Panicked(_))
    }
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Normal => f.write_str("normal"),
            Self::Shutdown => f.write_str("shutdown"),
            Self::Failed(e) => write!(f, "failed: {e}"),
            Self::Panicked(m) => write!(f, "panicked: {m}"),
            Self::Killed => f.write_str("killed"),
        }
    }
}
