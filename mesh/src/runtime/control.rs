//! The controller's control thread: a current-thread tokio runtime on an
//! OS thread of its own ("regent-controller"), where every task of the
//! controller runs — its endpoint (quinn's drivers, the sessions, the
//! heartbeats), the caster, the supervisors, lease renewals, routing.
//!
//! Why: on the user's runtime those tasks were woken on whichever worker
//! was free, and the user's own task (often `block_on` on the main thread)
//! on another, so a call crossed threads many times; on one thread the
//! controller's hops are task switches, and a call crosses threads twice
//! (into the caster, back with the answer). It also keeps the control
//! plane's heartbeats and lease renewals off threads the user's compute
//! may keep busy. Public operations that start tasks (starting the
//! runtime, spawning procs and meshes, stopping them) run their body here
//! ([`ControlThread::run`]); casts and calls only hand a frame to the
//! caster's queue and wait for its answer.

use std::future::Future;
use std::sync::Mutex;
use std::thread::ThreadId;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::error::MeshError;

/// The control thread of one controller; it ends when this is dropped
/// (its tasks are dropped with its runtime).
pub(crate) struct ControlThread {
    handle: Handle,
    thread: ThreadId,
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl ControlThread {
    /// Starts the thread and its runtime.
    pub(crate) fn start() -> Result<Self, MeshError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("regent-controller".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((runtime.handle().clone(), std::thread::current().id())));
                // Runs the controller's tasks until the controller is gone.
                let _ = runtime.block_on(stopped);
                // Outside any task: dropping the runtime drops its tasks.
                runtime.shutdown_background();
            })
            .map_err(|e| MeshError::Control(format!("cannot start it: {e}")))?;
        let (handle, thread) = ready_rx
            .recv()
            .map_err(|_| MeshError::Control("it ended while starting".into()))?
            .map_err(|e| MeshError::Control(format!("no runtime: {e}")))?;
        Ok(Self {
            handle,
            thread,
            stop: Mutex::new(Some(stop)),
        })
    }

    /// Keeps the control thread polling for up to `max` after each message
    /// it moves ([`regent_net::spin`]), for as long as it runs.
    pub(crate) fn keep_awake(&self, max: std::time::Duration) {
        drop(self.handle.spawn(regent_net::spin::keep_awake(max)));
    }

    /// Runs `f` on the control thread (at once when already there) and
    /// returns its output. Dropping the returned future before it is done
    /// cancels `f` there, as dropping `f` itself would. A panic in `f` is
    /// resumed in the caller.
    pub(crate) async fn run<F, T>(&self, f: F) -> Result<T, MeshError>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        if std::thread::current().id() == self.thread {
            return Ok(f.await);
        }
        let mut task = AbortOnDrop(self.handle.spawn(f));
        match (&mut task.0).await {
            Ok(t) => Ok(t),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(MeshError::Control("it has ended".into())),
        }
    }

    /// Runs `f` (synchronous) with the control thread's runtime as the
    /// current one, so that the tasks it spawns run there.
    pub(crate) fn enter<T>(&self, f: impl FnOnce() -> T) -> T {
        let _guard = self.handle.enter();
        f()
    }
}

impl Drop for ControlThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
    }
}

/// A task of the control thread that is aborted if nobody waits for it any
/// more.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
