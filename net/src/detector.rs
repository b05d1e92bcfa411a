//! The failure detector of one link: how long the peer may stay silent
//! before the link is declared failed. Pure: it is told when the peer was
//! heard and asked with the current time; it reads no clock.
//!
//! Fixed (the default): the silence may last `failure_timeout`.
//!
//! Adaptive (`EndpointConfig::failure_timeout_min` set), in the spirit of
//! the φ-accrual detector of Cassandra and Akka: the detector keeps the
//! last [`WINDOW`] intervals between hearing the peer, and allows a silence
//! of their mean plus [`DEVIATIONS`] standard deviations (a deviation is
//! taken as at least a quarter of the heartbeat interval, so a perfectly
//! regular peer is not held to its exact period), never less than the
//! minimum and never more than `failure_timeout`. On a quiet machine a
//! silent peer is found at the minimum; where heartbeats arrive late
//! (cores busy, a starved process), the allowance grows with the jitter it
//! saw, up to the fixed timeout. Until [`MIN_SAMPLES`] intervals are known
//! it allows the fixed timeout.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Intervals kept (about 10 s of heartbeats at the default 100 ms).
pub(crate) const WINDOW: usize = 100;
/// Intervals needed before the allowance adapts.
pub(crate) const MIN_SAMPLES: usize = 10;
/// Standard deviations over the mean the allowance spans: under a normal
/// distribution of intervals, a live peer exceeds it about once in 10⁹
/// intervals (φ ≈ 9).
pub(crate) const DEVIATIONS: f64 = 6.0;

/// One link's detector.
#[derive(Debug, Clone)]
pub(crate) struct Detector {
    heartbeat: Duration,
    ceiling: Duration,
    floor: Option<Duration>,
    last: Instant,
    /// Intervals in seconds, with their running sums.
    intervals: VecDeque<f64>,
    sum: f64,
    sum_sq: f64,
}

impl Detector {
    /// A detector that last heard the peer at `now`: fixed at `ceiling`, or
    /// adaptive between `floor` and `ceiling` when `floor` is set.
    pub(crate) fn new(
        now: Instant,
        heartbeat: Duration,
        ceiling: Duration,
        floor: Option<Duration>,
    ) -> Self {
        Self {
            heartbeat,
            ceiling,
            floor: floor.map(|f| f.min(ceiling)),
            last: now,
            intervals: VecDeque::with_capacity(WINDOW),
            sum: 0.0,
            sum_sq: 0.0,
        }
    }

    /// The peer was heard at `now`.
    pub(crate) fn heard(&mut self, now: Instant) {
        let interval = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        if self.floor.is_none() {
            return;
        }
        if self.intervals.len() == WINDOW
            && let Some(old) = self.intervals.pop_front()
        {
            self.sum -= old;
            self.sum_sq -= old * old;
        }
        self.intervals.push_back(interval);
        self.sum += interval;
        self.sum_sq += interval * interval;
    }

    /// How long the peer has been silent at `now`.
    pub(crate) fn silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last)
    }

    /// The silence allowed now.
    pub(crate) fn timeout(&self) -> Duration {
        let Some(floor) = self.floor else {
            return self.ceiling;
        };
        let n = self.intervals.len();
        if n < MIN_SAMPLES {
            return self.ceiling;
        }
        let mean = self.sum / n as f64;
        // Running sums drift by rounding: never below zero.
        let variance = (self.sum_sq / n as f64 - mean * mean).max(0.0);
        let deviation = variance.sqrt().max(self.heartbeat.as_secs_f64() / 4.0);
        let allowed = mean + DEVIATIONS * deviation;
        if !allowed.is_finite() {
            return self.ceiling;
        }
        Duration::from_secs_f64(allowed.min(self.ceiling.as_secs_f64())).clamp(floor, self.ceiling)
    }

    /// Whether the peer is to be declared failed at `now`: its silence so
    /// far, if it passed the allowance.
    pub(crate) fn failed(&self, now: Instant) -> Option<Duration> {
        let silent = self.silent_for(now);
        (silent >= self.timeout()).then_some(silent)
    }

    /// When the peer, silent since it was last heard, will have passed
    /// the allowance as it stands now.
    pub(crate) fn deadline(&self) -> Instant {
        self.last + self.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HB: Duration = Duration::from_millis(50);
    const MIN: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(1);

    fn fed(floor: Option<Duration>, intervals_ms: &[u64]) -> (Detector, Instant) {
        let mut now = Instant::now();
        let mut d = Detector::new(now, HB, MAX, floor);
        for &ms in intervals_ms {
            now += Duration::from_millis(ms);
            d.heard(now);
        }
        (d, now)
    }

    #[test]
    fn fixed_allows_the_failure_timeout_whatever_it_heard() {
        let (d, now) = fed(None, &[50; 200]);
        assert_eq!(d.timeout(), MAX);
        assert_eq!(d.failed(now + MAX - Duration::from_millis(1)), None);
        assert_eq!(d.failed(now + MAX), Some(MAX));
    }

    #[test]
    fn adaptive_finds_a_regular_peers_silence_at_the_minimum() {
        let (d, now) = fed(Some(MIN), &[50; 200]);
        // 50 ms + 6 × 12.5 ms = 125 ms, raised to the minimum.
        assert_eq!(d.timeout(), MIN);
        assert_eq!(d.failed(now + Duration::from_millis(199)), None);
        assert!(d.failed(now + MIN).is_some());
    }

    #[test]
    fn adaptive_allows_the_fixed_timeout_until_it_knows_the_peer() {
        let (d, _) = fed(Some(MIN), &[50; MIN_SAMPLES - 1]);
        assert_eq!(d.timeout(), MAX);
        let (d, _) = fed(Some(MIN), &[50; MIN_SAMPLES]);
        assert_eq!(d.timeout(), MIN);
    }

    #[test]
    fn jitter_widens_the_allowance_and_calm_narrows_it_again() {
        // Heartbeats that came 50 to 350 ms apart (a loaded machine).
        let jittery: Vec<u64> = (0..WINDOW as u64).map(|i| 50 + (i * 97) % 300).collect();
        let (mut d, mut now) = fed(Some(MIN), &jittery);
        let wide = d.timeout();
        assert!(wide > Duration::from_millis(600), "{wide:?}");
        assert!(wide <= MAX);
        // A window of calm brings it back to the minimum.
        for _ in 0..WINDOW {
            now += HB;
            d.heard(now);
        }
        assert_eq!(d.timeout(), MIN);
    }

    #[test]
    fn the_deadline_is_the_last_hearing_plus_the_allowance() {
        let (d, now) = fed(Some(MIN), &[50; 200]);
        assert_eq!(d.deadline(), now + MIN);
        let (d, now) = fed(None, &[50; 3]);
        assert_eq!(d.deadline(), now + MAX);
    }

    proptest! {
        /// Whatever it heard, the allowance lies between the minimum and
        /// the fixed timeout, and a silence is declared exactly when it
        /// reaches the allowance.
        #[test]
        fn the_allowance_stays_within_its_bounds(
            intervals in proptest::collection::vec(0u64..5_000, 0..400),
            floor_ms in 1u64..1_000,
            wait_ms in 0u64..3_000,
        ) {
            let floor = Duration::from_millis(floor_ms);
            let (d, now) = fed(Some(floor), &intervals);
            let t = d.timeout();
            prop_assert!(t >= floor.min(MAX) && t <= MAX, "{t:?}");
            let at = now + Duration::from_millis(wait_ms);
            prop_assert_eq!(d.failed(at).is_some(), d.silent_for(at) >= t);
            prop_assert_eq!(d.failed(at).is_some(), at >= d.deadline());
        }
    }
}
