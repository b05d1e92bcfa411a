//! Errors of the supervisor crate at run time (a specification's own
//! errors, `SpecError`, are with it in `spec`).

use thiserror::Error;

use crate::spec::{ChildId, ChildKey, SpecError};

/// Why a child could not be started.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StartError {
    /// The start function, or the actor's `pre_start`, returned an error.
    #[error("start failed: {0}")]
    Failed(String),
    /// The start function, or the actor's `pre_start`, panicked.
    #[error("start panicked: {0}")]
    Panicked(String),
    /// A dynamic child was given arguments of another type than its template
    /// takes.
    #[error("wrong argument type for the child template: expected {expected}")]
    WrongArguments {
        /// The type the template takes.
        expected: &'static str,
    },
}

/// A request to a supervisor (start, terminate, restart or delete a child)
/// was refused or failed. The names follow OTP's error atoms.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChildError {
    /// No child with this id or instance number.
    #[error("no child {0}")]
    NotFound(ChildKey),
    /// The child is running, so it cannot be restarted or deleted.
    #[error("child {0} is running")]
    Running(ChildKey),
    /// The child is waiting for a restart, so it cannot be restarted or
    /// deleted by request.
    #[error("child {0} is being restarted")]
    Restarting(ChildKey),
    /// The request does not apply to a `simple_one_for_one` supervisor
    /// (`delete_child`, `restart_child`, or `terminate_child` by id), or only
    /// applies to one (`start_dynamic_child`).
    #[error("{0}")]
    WrongStrategy(&'static str),
    /// A child with this id exists and is running.
    #[error("child {0} is already started")]
    AlreadyStarted(ChildId),
    /// A child with this id exists and is not running.
    #[error("child {0} is already present")]
    AlreadyPresent(ChildId),
    /// The child specification is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The child did not start.
    #[error("child {key}: {error}")]
    Start {
        /// The child.
        key: ChildKey,
        /// Why.
        error: StartError,
    },
    /// The supervisor is gone or stopped before answering.
    #[error("the supervisor is not running")]
    SupervisorDown,
}
