//! `regent bench <suite>`: system benchmarks that print each figure against a
//! baseline measured in the same run, so the ratio holds on a noisy machine.
//!
//! Every figure prints as one line:
//!
//! ```text
//! <suite>.<figure>: <value> <unit> (n=<samples>, baseline <name> <value> <unit>, ratio <r>)
//! ```
//!
//! where `n` (how many samples the value rests on) and the baseline are
//! there when the figure has them.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

mod calls;
pub(crate) mod mesh;
pub(crate) mod net;
mod peer;
pub(crate) mod rdma;
pub(crate) mod recovery;
pub(crate) mod supervision;
pub(crate) mod tensor;
pub(crate) mod train;

/// Options shared by every suite.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BenchOptions {
    /// A short run: fewer iterations, for smoke tests and CI.
    pub(crate) quick: bool,
}

/// A baseline measured in the same run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Baseline {
    /// What was measured (e.g. `bare_spawn`, `tcp_echo`).
    pub(crate) name: String,
    /// Its value, in `unit`.
    pub(crate) value: f64,
    /// The unit.
    pub(crate) unit: String,
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Figure {
    /// The suite (`supervision`, `net`, ...).
    pub(crate) suite: String,
    /// The figure's name within the suite.
    pub(crate) name: String,
    /// The value, in `unit`.
    pub(crate) value: f64,
    /// The unit (`us`, `ms`, `msg/s`, `GB/s`, ...).
    pub(crate) unit: String,
    /// The baseline, when the figure has one.
    pub(crate) baseline: Option<Baseline>,
    /// `value / baseline.value`.
    pub(crate) ratio: Option<f64>,
    /// How many samples the value rests on, when it is a statistic.
    pub(crate) n: Option<u64>,
}

impl Figure {
    /// A figure without a baseline.
    pub(crate) fn new(suite: &str, name: &str, value: f64, unit: &str) -> Self {
        Self {
            suite: suite.to_owned(),
            name: name.to_owned(),
            value,
            unit: unit.to_owned(),
            baseline: None,
            ratio: None,
            n: None,
        }
    }

    /// Says how many samples the value rests on.
    pub(crate) fn samples(mut self, n: usize) -> Self {
        self.n = Some(n as u64);
        self
    }

    /// Adds the baseline (in the same unit as the figure unless given) and
    /// computes the ratio.
    pub(crate) fn against(mut self, name: &str, value: f64, unit: &str) -> Self {
        self.ratio = (value != 0.0).then(|| self.value / value);
        self.baseline = Some(Baseline {
            name: name.to_owned(),
            value,
            unit: unit.to_owned(),
        });
        self
    }
}

fn num(v: f64) -> String {
    if v == 0.0 || (0.01..1e6).contains(&v.abs()) {
        let s = format!("{v:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_owned()
    } else {
        format!("{v:.3e}")
    }
}

impl fmt::Display for Figure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{}: {} {}",
            self.suite,
            self.name,
            num(self.value),
            self.unit
        )?;
        let mut parts = Vec::new();
        if let Some(n) = self.n {
            parts.push(format!("n={n}"));
        }
        if let Some(b) = &self.baseline {
            parts.push(format!("baseline {} {} {}", b.name, num(b.value), b.unit));
            if let Some(r) = self.ratio {
                parts.push(format!("ratio {}", num(r)));
            }
        }
        if !parts.is_empty() {
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

/// Collects figures, printing each as it comes.
#[derive(Debug, Default)]
pub(crate) struct Report {
    figures: Vec<Figure>,
}

impl Report {
    /// Prints the figure and keeps it.
    pub(crate) fn push(&mut self, figure: Figure) {
        println!("{figure}");
        self.figures.push(figure);
    }

    /// Writes the figures as a JSON array.
    pub(crate) fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(&self.figures)?)?;
        Ok(())
    }
}

/// Percentile `p` (0..=100) of sorted samples, nearest-rank (zero when
/// empty).
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    regent_train::job::run::nearest_rank(sorted, p).unwrap_or_default()
}

/// The median of samples (sorts them).
pub(crate) fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    percentile(samples, 50.0)
}

/// Microseconds as `f64`.
pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figure_line_has_the_documented_format() {
        let f = Figure::new("supervision", "restart_one_for_one", 30.0, "us").against(
            "bare_spawn",
            12.0,
            "us",
        );
        assert_eq!(
            f.to_string(),
            "supervision.restart_one_for_one: 30 us (baseline bare_spawn 12 us, ratio 2.5)"
        );
        assert_eq!(
            Figure::new("net", "one_way", 61234.5, "msg/s").to_string(),
            "net.one_way: 61234.5 msg/s"
        );
        assert_eq!(
            Figure::new("recovery", "detect_sigkill_p99", 0.77, "ms")
                .samples(200)
                .to_string(),
            "recovery.detect_sigkill_p99: 0.77 ms (n=200)"
        );
        assert_eq!(
            Figure::new("mesh", "call_gather_16", 300.0, "us")
                .samples(200)
                .against("concurrent_call_one_16", 600.0, "us")
                .to_string(),
            "mesh.call_gather_16: 300 us (n=200, baseline concurrent_call_one_16 600 us, ratio 0.5)"
        );
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<_> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&s, 50.0), Duration::from_micros(50));
        assert_eq!(percentile(&s, 99.0), Duration::from_micros(99));
        assert_eq!(percentile(&s, 100.0), Duration::from_micros(100));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
