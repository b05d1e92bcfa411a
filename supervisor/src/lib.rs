//! Erlang/OTP supervision on ractor actors.
//!
//! A supervisor starts its children in order, watches them through ractor's
//! links, restarts them by strategy (`one_for_one`, `one_for_all`,
//! `rest_for_one`, `simple_one_for_one`) and restart type (permanent,
//! transient, temporary), gives up after more than `MaxR` restarts in `MaxT`
//! by stopping every child in reverse start order and exiting with
//! [`ExitReason::Shutdown`] (which its own supervisor sees), and shuts itself
//! down when significant children exit (`auto_shutdown`). Optional
//! exponential backoff delays restarts, beyond OTP.
//!
//! The decisions are a pure state machine, [`machine::Machine`]: `(now,
//! event) -> actions`, with no clock and no I/O. [`Supervisor`] is the ractor
//! actor that performs those actions. `docs/semantics.md` in the repository
//! states the rules.
//!
//! ```no_run
//! # use regent_supervisor::*;
//! # use ractor::{Actor, ActorRef, ActorProcessingErr};
//! # struct Worker;
//! # impl Actor for Worker {
//! #     type Msg = (); type State = (); type Arguments = ();
//! #     async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> { Ok(()) }
//! # }
//! # async fn demo() -> Result<(), SupervisorError> {
//! let spec = SupervisorSpec::new("root", SupervisorFlags::new(Strategy::OneForOne))
//!     .child(ChildSpec::worker("a", || (Worker, ())))
//!     .child(ChildSpec::worker("b", || (Worker, ())).restart(Restart::Transient));
//! let (root, _) = SupervisorRef::start(spec).await?;
//! root.stop().await;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod child;
mod error;
pub mod machine;
mod reason;
mod spec;
mod supervisor;
mod window;

pub use child::{
    ChildSpec, ChildTemplate, Guarded, Panic, StartContext, StartFuture, spawn_guarded,
};
pub use error::{ChildError, StartError};
pub use machine::{ChildStatus, ExitCause};
pub use reason::ExitReason;
pub use spec::{
    AutoShutdown, Backoff, ChildCounts, ChildId, ChildKey, ChildKind, ChildPolicy, Incarnation,
    InstanceId, Intensity, MAX_CHILDREN, Restart, Shutdown, SpecError, Strategy, SupervisorFlags,
};
pub use supervisor::{
    Answer, Child, ChildExit, KILL_WAIT, Observation, Observed, SHUTDOWN_REASON, Supervisor,
    SupervisorError, SupervisorMsg, SupervisorRef, SupervisorSpec, SupervisorState, UserRequest,
    exit_of,
};
pub use window::RestartWindow;
