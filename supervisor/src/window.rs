//! The restart intensity window: OTP's count of restarts within a sliding
//! period, shared by process supervisors and mesh policies.

use std::collections::VecDeque;
use std::time::Instant;

use crate::spec::Intensity;

/// Restarts within the last `period`, bounded by `max_restarts + 1` entries.
#[derive(Debug, Clone)]
pub struct RestartWindow {
    intensity: Intensity,
    /// Oldest first.
    times: VecDeque<Instant>,
}

impl RestartWindow {
    /// An empty window for this intensity.
    pub fn new(intensity: Intensity) -> Self {
        Self {
            intensity,
            times: VecDeque::new(),
        }
    }

    /// The intensity it enforces.
    pub fn intensity(&self) -> Intensity {
        self.intensity
    }

    /// Records a restart decided at `now`. Returns `false` when it makes more
    /// than `max_restarts` restarts within `period` (inclusive at its edge):
    /// the owner must then give up.
    pub fn record(&mut self, now: Instant) -> bool {
        let period = self.intensity.period;
        while let Some(&oldest) = self.times.front() {
            if now.saturating_duration_since(oldest) > period {
                self.times.pop_front();
            } else {
                break;
            }
        }
        self.times.push_back(now);
        let limit = self.intensity.max_restarts as usize;
        if self.times.len() > limit + 1 {
            // Keep the bound: only whether the count exceeds the limit matters.
            self.times.pop_front();
        }
        self.times.len() <= limit
    }

    /// Restarts currently within the window (as of the last record).
    pub fn len(&self) -> usize {
        self.times.len()
    }

    /// Whether no restart is within the window.
    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn counts_within_the_period_inclusively_and_stays_bounded() {
        let t0 = Instant::now();
        let mut w = RestartWindow::new(Intensity {
            max_restarts: 2,
            period: Duration::from_secs(10),
        });
        assert!(w.record(t0));
        assert!(w.record(t0 + Duration::from_secs(5)));
        assert!(!w.record(t0 + Duration::from_secs(10)), "edge is inside");
        assert!(w.len() <= 3);
        // Restarts older than the period age out.
        assert!(w.record(t0 + Duration::from_secs(21)));
        let mut zero = RestartWindow::new(Intensity {
            max_restarts: 0,
            period: Duration::from_secs(1),
        });
        assert!(!zero.record(t0));
    }
}
