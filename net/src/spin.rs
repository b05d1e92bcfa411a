//! Keeping a control thread awake between the messages of an exchange.
//!
//! Waking a thread whose CPU went idle is the dearest step of a round trip
//! on a virtual machine: the CPU halts, and the wake-up takes an
//! inter-processor interrupt and the hypervisor's return from the halt
//! (measured on the 2-core reference machine: a call to a member took
//! 120-160 us with both control threads parking between messages, 35-50 us
//! with both kept awake, where a raw TCP echo took 30-60 us). So a control
//! thread that moved a message keeps polling for the next one for a short
//! window before it parks, as the kernel's `haltpoll` idle driver does for
//! a whole CPU (off on that machine).
//!
//! The window adapts like `haltpoll`'s, on the idle stretches that a
//! message's arrival ends (from the thread's last move of bytes, either
//! way, to the arrival): one that outlasted the window but ended within
//! the configured maximum grows it (from [`GROW_START`], doubling, up to
//! the maximum), one past the maximum halves it (to nothing below
//! [`GROW_START`]), one the spin caught changes nothing. Below the maximum
//! a stretch up to [`GROW_REACH`] times the maximum grows the window too:
//! it holds the wake-ups of a thread that parked, and without the reach an
//! exchange that fits the window only while both ends stay awake never
//! starts to spin. So a thread that hears a heartbeat or a renewal now
//! and then does not spin at all, nor does a proc that answers one
//! request a millisecond (a gather's leaf: its own reply starts no spin
//! once the requests have shown the gap), and one in a
//! call-and-answer exchange spins for the time between its messages.
//! While it spins, the thread yields its CPU to any other thread ready on
//! it (`sched_yield`) at every turn: a member's compute on that CPU runs
//! first, the spin only takes time the CPU would have spent halted.
//!
//! [`keep_awake`] runs on the control thread (a task of its current-thread
//! runtime); the control plane's inbound tasks call `arrived` when bytes
//! come in, and its outbound tasks `poke` when they send. On a thread
//! without a spinner (a multi-thread runtime's worker, a simulation)
//! neither does anything.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The first window after the thread's idle stretches fit the maximum.
pub const GROW_START: Duration = Duration::from_micros(20);

/// The spinner of one thread. Only that thread touches it (the pokes come
/// from tasks of its runtime); the atomics make the spinner task `Send`.
struct Spinner {
    base: Instant,
    /// The configured maximum window.
    max: Duration,
    /// Nanoseconds after `base` of the thread's last move of bytes.
    last_ns: AtomicU64,
    /// The current window, in nanoseconds: adapted by each arrival that
    /// ends an idle stretch.
    window_ns: AtomicU64,
    /// Whether the spinner is polling now (a poke then need not wake it).
    spinning: AtomicBool,
    /// Turns of the spin loop so far.
    turns: AtomicU64,
    wake: tokio::sync::Notify,
}

impl Spinner {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn since_last(&self) -> Duration {
        Duration::from_nanos(
            self.now_ns()
                .saturating_sub(self.last_ns.load(Ordering::Relaxed)),
        )
    }
}

thread_local! {
    static SPINNER: RefCell<Option<Arc<Spinner>>> = const { RefCell::new(None) };
}

/// Notes that this thread sent a message: its spinner (if it has one)
/// keeps it polling for the current window from now.
pub(crate) fn poke() {
    moved(false);
}

/// Notes that bytes arrived on this thread: the idle stretch since its
/// last move adapts the window (unless the spin caught them), and the
/// spinner keeps the thread polling for the window from now.
pub(crate) fn arrived() {
    moved(true);
}

fn moved(arrival: bool) {
    SPINNER.with(|s| {
        let Some(s) = &*s.borrow() else {
            return;
        };
        let now = s.now_ns();
        let last = s.last_ns.swap(now, Ordering::Relaxed);
        if s.spinning.load(Ordering::Relaxed) {
            // The spin caught it: the window stays, the spin runs on.
            return;
        }
        let mut window = Duration::from_nanos(s.window_ns.load(Ordering::Relaxed));
        if arrival {
            let idle = Duration::from_nanos(now.saturating_sub(last));
            window = next_window(window, idle, s.max);
            let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
            s.window_ns.store(ns, Ordering::Relaxed);
        }
        if !window.is_zero() {
            s.wake.notify_one();
        }
    });
}

/// How far past the maximum an idle stretch may end and still grow a
/// window below the maximum, as a multiple of the maximum. A stretch that
/// ended while the thread was parked includes the wake-ups a spin would
/// have saved: on the 2-core reference machine a call's round trip is
/// 35-50 us with both control threads awake and 170-230 us with both
/// parked, so with growth only up to a 200 us maximum, an exchange that
/// started parked stayed parked for thousands of calls (a stretch at
/// 220 us halves the window it would have shortened to 45 us). A thread
/// already spinning for the maximum has no such excuse: a stretch past
/// the maximum halves its window, as `haltpoll`'s does.
pub const GROW_REACH: u32 = 2;

/// The next window after an idle stretch of `idle` that an arrival ended
/// (`haltpoll`'s rule, reaching further below the maximum): unchanged
/// when the window covered it; grown when it ended within `max`, or within
/// [`GROW_REACH`] times `max` while the window is below `max`; otherwise
/// halved (to nothing below [`GROW_START`]).
pub fn next_window(window: Duration, idle: Duration, max: Duration) -> Duration {
    if idle <= window {
        window
    } else if idle <= max || (window < max && idle <= max.saturating_mul(GROW_REACH)) {
        window.saturating_mul(2).max(GROW_START).min(max)
    } else if window / 2 < GROW_START {
        Duration::ZERO
    } else {
        window / 2
    }
}

/// Keeps the current thread polling for up to `max` after each message
/// (see the module's doc); never returns. Spawn it on the control thread's
/// current-thread runtime: it serves the thread it is first polled on.
/// A zero `max` turns it off.
pub async fn keep_awake(max: Duration) {
    if max.is_zero() {
        return std::future::pending().await;
    }
    let spinner = Arc::new(Spinner {
        base: Instant::now(),
        max,
        last_ns: AtomicU64::new(0),
        window_ns: AtomicU64::new(0),
        spinning: AtomicBool::new(false),
        turns: AtomicU64::new(0),
        wake: tokio::sync::Notify::new(),
    });
    SPINNER.with(|s| *s.borrow_mut() = Some(spinner.clone()));
    loop {
        // Woken by a move while the window is open.
        spinner.wake.notified().await;
        let window = Duration::from_nanos(spinner.window_ns.load(Ordering::Relaxed));
        spinner.spinning.store(true, Ordering::Relaxed);
        while spinner.since_last() < window {
            spinner.turns.fetch_add(1, Ordering::Relaxed);
            // Any other thread ready on this CPU runs first.
            std::thread::yield_now();
            // The runtime polls its sockets (without blocking) and runs
            // what they woke before this task again.
            tokio::task::yield_now().await;
        }
        spinner.spinning.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn the_window_grows_while_idle_stretches_fit_and_halves_after_one_that_does_not() {
        let max = Duration::from_micros(200);
        let mut w = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..6 {
            w = next_window(w, Duration::from_micros(190), max);
            seen.push(w.as_micros());
        }
        assert_eq!(seen, [20, 40, 80, 160, 200, 200]);
        // A stretch past the maximum but within its reach (a parked round
        // trip of an exchange that fits the window awake) grows it too.
        assert_eq!(
            next_window(Duration::ZERO, Duration::from_micros(390), max),
            GROW_START
        );
        assert_eq!(
            next_window(Duration::ZERO, Duration::from_micros(410), max),
            Duration::ZERO
        );
        // At the maximum, a stretch past it halves the window, reach or
        // not; below it, the reach grows the window back.
        assert_eq!(
            next_window(max, Duration::from_micros(390), max),
            Duration::from_micros(100)
        );
        assert_eq!(
            next_window(Duration::from_micros(100), Duration::from_micros(390), max),
            max
        );
        // A stretch the spin covered changes nothing.
        assert_eq!(
            next_window(Duration::from_micros(80), Duration::from_micros(50), max),
            Duration::from_micros(80)
        );
        w = next_window(w, Duration::from_millis(100), max);
        assert_eq!(w, Duration::from_micros(100));
        let mut halvings = 1;
        while !w.is_zero() {
            w = next_window(w, Duration::from_millis(100), max);
            halvings += 1;
        }
        assert_eq!(halvings, 4, "200 -> 100 -> 50 -> 25 -> nothing (under 20)");
        // Any window and maximum (both functions are public): no overflow.
        let huge = Duration::MAX;
        assert_eq!(
            next_window(
                huge / 2 + Duration::from_secs(1),
                huge - Duration::from_secs(1),
                huge
            ),
            huge
        );
    }

    /// Parks and spin turns of a current-thread runtime over the second
    /// half of `rounds` exchanges, each a message from another thread
    /// (`gap` after the last) and an answer.
    fn exchange(max: Duration, gap: Duration, rounds: usize) -> (usize, u64) {
        let parks = Arc::new(AtomicUsize::new(0));
        let counted = parks.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_park(move || {
                counted.fetch_add(1, Ordering::Relaxed);
            })
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::spawn(keep_awake(max));
            tokio::task::yield_now().await;
            let turns = || {
                SPINNER.with(|s| {
                    s.borrow()
                        .as_ref()
                        .map_or(0, |s| s.turns.load(Ordering::Relaxed))
                })
            };
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let sender = std::thread::spawn(move || {
                for _ in 0..rounds {
                    std::thread::sleep(gap);
                    if tx.send(()).is_err() {
                        return;
                    }
                }
            });
            // Warm the window up, then count.
            let mut turns_before = 0;
            for i in 0..rounds {
                rx.recv().await.unwrap();
                arrived();
                poke();
                if i == rounds / 2 {
                    parks.store(0, Ordering::Relaxed);
                    turns_before = turns();
                }
            }
            sender.join().unwrap();
            (parks.load(Ordering::Relaxed), turns() - turns_before)
        })
    }

    #[test]
    fn a_thread_in_an_exchange_stays_awake_and_a_quiet_one_parks() {
        let rounds = 40;
        // Messages 1 ms apart within a 20 ms window: the thread polls
        // through (a park or two where the sender's sleep ran long).
        let (hot, _) = exchange(Duration::from_millis(20), Duration::from_millis(1), rounds);
        // The same without a spinner: a park per message.
        let (off, _) = exchange(Duration::ZERO, Duration::from_millis(1), rounds);
        // Messages 5 ms apart past a 1 ms window: the window shrinks to
        // nothing, a park per message, and the answers start no spin (as
        // a gather's leaf answers one request a millisecond).
        let (quiet, quiet_turns) =
            exchange(Duration::from_millis(1), Duration::from_millis(5), rounds);
        assert!(hot <= 3, "kept awake, yet parked {hot} times");
        assert!(off >= rounds / 2 - 1, "no spinner, parked {off} times");
        assert!(quiet >= rounds / 2 - 1, "quiet, parked only {quiet} times");
        assert_eq!(quiet_turns, 0, "quiet, yet spun after its answers");
    }
}
