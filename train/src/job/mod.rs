//! The distributed data-parallel job: members of a mesh, one replica each,
//! stepping in lockstep through the deterministic all-reduce, healing from
//! live peers and resuming from checkpoints (rules: `docs/semantics.md` §9).
//!
//! - [`spec`]: what every member is built from ([`JobSpec`]).
//! - [`store`]: states as bytes and checkpoints in a run directory.
//! - [`trainer`]: the member ([`Trainer`]).
//! - [`run`]: the controller's loop ([`run_job`]) and its [`Report`].

pub mod run;
pub mod spec;
pub mod store;
pub mod trainer;

pub use run::{
    FaultKind, FaultPlan, FaultSpacing, JOB_FAILURE_TIMEOUT, JOB_FAILURE_TIMEOUT_MIN,
    JOB_HEARTBEAT, JobCluster, JobConfig, JobEvent, NanPolicy, Report, reference,
    reference_with_skips, run_job,
};
pub use spec::{AnyReplica, JobSpec, ModelSpec, OptimSpec};
pub use trainer::{Trainer, TrainerArgs, TrainerMsg, TrainerReply};
