//! Known bugs that a simulation can plant, to show that its checkers catch
//! them (issue 15: "the checker is checked"). Only with the `sim` feature
//! can one be planted, and only on the thread of one simulated run (every
//! task of a simulation runs on it); elsewhere `planted` is always false.

/// A bug the simulation can plant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlantedBug {
    /// A proc delivers each cast to its local members twice.
    DuplicateDelivery,
    /// A proc takes casts of any older generation and delivers them to
    /// every life, also to lives of later generations: the fencing of casts
    /// by generation is off, both where the proc takes a cast (its command
    /// loop) and where it serves one.
    NoFencing,
    /// The controller drops members' exit reports (a member that failed in
    /// a live proc is never restarted).
    DropMemberExit,
    /// Procs serve a sender's cast even after a later one of the same
    /// sender (`CastOrder` is not checked): a cast that came the old way
    /// around a proc the tree routes around since can reach members after
    /// later casts did. Rare (about one seed in a thousand): the
    /// simulation's regression seeds find it.
    UnorderedCasts,
}

impl PlantedBug {
    /// Every plantable bug.
    pub const ALL: [Self; 4] = [
        Self::DuplicateDelivery,
        Self::NoFencing,
        Self::DropMemberExit,
        Self::UnorderedCasts,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::DuplicateDelivery => "duplicate-delivery",
            Self::NoFencing => "no-fencing",
            Self::DropMemberExit => "drop-member-exit",
            Self::UnorderedCasts => "unordered-casts",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl std::str::FromStr for PlantedBug {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let all: Vec<&str> = Self::ALL.iter().map(|b| b.name()).collect();
                format!("no planted bug {s:?} (one of {})", all.join(", "))
            })
    }
}

#[cfg(feature = "sim")]
thread_local! {
    static PLANTED: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Whether `bug` is planted on this thread.
#[inline]
pub(crate) fn planted(bug: PlantedBug) -> bool {
    #[cfg(feature = "sim")]
    {
        PLANTED.with(|p| p.get() & bug.bit() != 0)
    }
    #[cfg(not(feature = "sim"))]
    {
        let _ = bug.bit();
        false
    }
}

/// Plants `bugs` on this thread until the guard drops (for a simulated run
/// on this thread).
#[cfg(feature = "sim")]
pub fn plant(bugs: &[PlantedBug]) -> Planted {
    let bits = bugs.iter().fold(0, |b, bug| b | bug.bit());
    let before = PLANTED.with(|p| p.replace(bits));
    Planted { before }
}

/// Keeps bugs planted; dropping it restores what was planted before.
#[cfg(feature = "sim")]
#[derive(Debug)]
pub struct Planted {
    before: u8,
}

#[cfg(feature = "sim")]
impl Drop for Planted {
    fn drop(&mut self) {
        PLANTED.with(|p| p.set(self.before));
    }
}
