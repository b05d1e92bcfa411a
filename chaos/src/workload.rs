//! The workload: a mesh actor ([`Tally`]) that records every message it is
//! given, so that the controller can check, after faults, which messages
//! each member life received and how often.
//!
//! Every message carries a sequence number unique in the run and the
//! [`Sender`] (workload task) that sent it. A member life keeps the numbers
//! it received as disjoint ranges (compact while deliveries are in order)
//! and the numbers it received more than once; and, per sender, the order
//! in which they arrived ([`OrderLog`]: runs of increasing numbers, one run
//! while the order holds). Each life draws a random nonce when it starts,
//! so two lives of one rank are never confused.

use std::collections::BTreeMap;

use regent_mesh::{ActorError, ActorMesh, Member, MemberThread, MeshActor, MeshPolicy};
use serde::{Deserialize, Serialize};

/// How the message of a panic that [`TallyMsg::Panic`] asked for starts.
pub const INJECTED_PANIC: &str = "chaos: injected panic";
/// Ranges a life keeps at most; past it, new numbers outside them are
/// counted but not kept (the report says so).
pub const MAX_RANGES: usize = 1 << 16;
/// Duplicate numbers a life keeps at most.
pub const MAX_DUPLICATES: usize = 1024;
/// Ranges one report carries at most (a reply must fit a frame).
pub const MAX_REPORT_RANGES: usize = 8192;
/// Runs of arrival order a life keeps per sender at most (one while the
/// order holds; each order violation starts another). Past it, arrivals
/// are counted but their order is not kept (the report says so).
pub const MAX_ORDER_RUNS: usize = 256;
/// Senders a life keeps the arrival order of at most.
pub const MAX_SENDERS: usize = 8;
/// Nested meshes one life spawns at most ([`TallyMsg::Nest`]).
pub const MAX_NESTED: usize = 2;

/// The workload actor: see the module documentation.
pub struct Tally {
    life: Life,
    log: SeqLog,
    order: BTreeMap<Sender, OrderLog>,
    /// Records from senders past [`MAX_SENDERS`].
    order_dropped: u64,
    /// The meshes this life spawned ([`TallyMsg::Nest`]).
    nested: Vec<ActorMesh<Tally>>,
}

/// Which workload task sent a message: each numbers its messages in the
/// order it sends them (from one counter shared by all senders, so numbers
/// are unique in the run and increase along each sender's sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Sender(pub u32);

impl Sender {
    /// The task that casts records to every member.
    pub const CASTER: Self = Self(0);
    /// The task that calls every member with records.
    pub const CALLER: Self = Self(1);
}

impl std::fmt::Display for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::CASTER => f.write_str("the caster"),
            Self::CALLER => f.write_str("the caller"),
            Self(n) => write!(f, "sender {n}"),
        }
    }
}

/// Who a member life is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Life {
    /// Its rank.
    pub rank: u32,
    /// The generation it was spawned in.
    pub born: u64,
    /// Random, drawn at its start.
    pub nonce: u64,
    /// Its OS process. Encoded in four bytes whatever its value, so that a
    /// simulated run replays in another process (whose pid may need another
    /// varint length).
    #[serde(with = "fixed_u32")]
    pub pid: u32,
}

/// A `u32` as four little-endian bytes on the wire.
mod fixed_u32 {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
        v.to_le_bytes().serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        <[u8; 4]>::deserialize(d).map(u32::from_le_bytes)
    }
}

/// What a [`Tally`] member is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TallyMsg {
    /// Record this sequence number; the reply says who recorded it.
    Record {
        /// The number.
        seq: u64,
        /// Who sent it.
        sender: Sender,
    },
    /// Say who you are (records nothing).
    Probe,
    /// Report the numbers received at or after `from`, and the arrival
    /// order of everything received.
    Report {
        /// The first number of interest.
        from: u64,
    },
    /// Spawn a mesh this member owns (`Member::spawn_mesh`): a nested mesh
    /// of `Tally`, one member per proc of this member's mesh, restarting
    /// its members (100 in 60 s). A life owns at most [`MAX_NESTED`].
    Nest,
    /// Say which nested meshes this life spawned.
    Owned,
    /// Panic in the handler: how the chaos runs inject actor panics. The
    /// workload actor is the chaos crate's own (linked only by the binaries
    /// that run chaos: the `regent` command and the test suites), so no
    /// user binary carries a panic-on-command path.
    Panic,
}

/// A [`Tally`] member's reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TallyReply {
    /// Who answered.
    Life(Life),
    /// What it received.
    Report(LifeReport),
    /// What a [`TallyMsg::Nest`] came to: the nested mesh's id, or why the
    /// spawn failed.
    Nested {
        /// Who spawned it.
        life: Life,
        /// The mesh's id ([`regent_mesh::protocol::MeshId`]'s number).
        mesh: Result<u64, String>,
    },
    /// The nested meshes a life spawned ([`TallyMsg::Owned`]).
    Owned {
        /// Whose.
        life: Life,
        /// Their ids.
        meshes: Vec<u64>,
    },
}

/// The numbers one life received, from a [`TallyMsg::Report`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifeReport {
    /// Who.
    pub life: Life,
    /// Disjoint, increasing, inclusive ranges of numbers received once or
    /// more.
    pub ranges: Vec<(u64, u64)>,
    /// Numbers received more than once (each listed once).
    pub duplicates: Vec<u64>,
    /// Messages recorded in all (duplicates included).
    pub recorded: u64,
    /// Whether the log or the report was cut short by its bounds: the
    /// checker must not trust absences then.
    pub truncated: bool,
    /// The arrival order of each sender's messages, since the life began.
    pub order: Vec<(Sender, OrderLog)>,
    /// Records whose order was not kept (from senders past
    /// [`MAX_SENDERS`]).
    pub order_dropped: u64,
}

/// A stretch of one sender's arrivals at one life in which every number was
/// greater than the one before: the recorder starts a new run exactly when
/// an arrival is not greater than the previous arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// The arrival (0-based, counting this sender's messages at this life)
    /// that started the run.
    pub at: u64,
    /// Its first number.
    pub first: u64,
    /// Its last (and greatest) number.
    pub last: u64,
}

/// The order in which one sender's messages arrived at one life, as runs
/// (see [`Run`]): while messages arrive in the order they were sent, one
/// run. Bounded by [`MAX_ORDER_RUNS`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderLog {
    /// The runs, in arrival order.
    pub runs: Vec<Run>,
    /// Arrivals the runs describe (the first `covered` ones).
    pub covered: u64,
    /// Arrivals in all; past `covered` their order was not kept.
    pub arrivals: u64,
}

impl OrderLog {
    /// Records the arrival of `seq`.
    pub fn record(&mut self, seq: u64) {
        let at = self.arrivals;
        self.arrivals += 1;
        if self.covered != at {
            // Cut short earlier: the order is no longer kept.
            return;
        }
        let full = self.runs.len() >= MAX_ORDER_RUNS;
        match self.runs.last_mut() {
            Some(run) if seq > run.last => run.last = seq,
            _ if full => return,
            _ => self.runs.push(Run {
                at,
                first: seq,
                last: seq,
            }),
        }
        self.covered += 1;
    }
}

/// Disjoint ranges of received numbers.
#[derive(Debug, Default, Clone)]
pub struct SeqLog {
    /// start -> end (inclusive).
    ranges: BTreeMap<u64, u64>,
    duplicates: Vec<u64>,
    recorded: u64,
    truncated: bool,
}

impl SeqLog {
    /// Records one number; returns whether it was new.
    pub fn insert(&mut self, seq: u64) -> bool {
        self.recorded += 1;
        let before = self.ranges.range(..=seq).next_back().map(|(s, e)| (*s, *e));
        if let Some((_, e)) = before
            && e >= seq
        {
            if self.duplicates.len() < MAX_DUPLICATES {
                if !self.duplicates.contains(&seq) {
                    self.duplicates.push(seq);
                }
            } else {
                self.truncated = true;
            }
            return false;
        }
        let after = seq
            .checked_add(1)
            .and_then(|n| self.ranges.get(&n).map(|e| (n, *e)));
        match (before, after) {
            (Some((s, e)), Some((n, e2))) if e + 1 == seq => {
                self.ranges.remove(&n);
                self.ranges.insert(s, e2);
            }
            (Some((s, e)), _) if e + 1 == seq => {
                self.ranges.insert(s, seq);
            }
            (_, Some((n, e2))) => {
                self.ranges.remove(&n);
                self.ranges.insert(seq, e2);
            }
            _ => {
                if self.ranges.len() >= MAX_RANGES {
                    self.truncated = true;
                    return true;
                }
                self.ranges.insert(seq, seq);
            }
        }
        true
    }

    /// The ranges that reach `from` or beyond (cut at `from`), at most
    /// [`MAX_REPORT_RANGES`], and whether they were cut short.
    pub fn since(&self, from: u64) -> (Vec<(u64, u64)>, bool) {
        let mut out = Vec::new();
        let start = self
            .ranges
            .range(..=from)
            .next_back()
            .filter(|(_, e)| **e >= from)
            .map(|(s, _)| *s)
            .unwrap_or(from);
        for (&s, &e) in self.ranges.range(start..) {
            if out.len() >= MAX_REPORT_RANGES {
                return (out, true);
            }
            out.push((s.max(from), e));
        }
        (out, false)
    }

    /// Whether `seq` was received.
    pub fn contains(&self, seq: u64) -> bool {
        self.ranges
            .range(..=seq)
            .next_back()
            .is_some_and(|(_, e)| *e >= seq)
    }
}

/// Arguments of a [`Tally`] member (none yet; a struct so that adding some
/// keeps the wire type).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TallyArgs {}

/// A number for a life that no other life of the run has: its proc, rank
/// and generation, this process and a count of the lives it started,
/// hashed (FNV-1a). Its top bit is always set, so its encoding (a varint)
/// always has one length: in a simulated run, where every proc is a task of
/// one process and the count goes on from run to run, datagram sizes then
/// replay.
fn nonce(member: &Member) -> u64 {
    static LIVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = LIVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(member.proc().as_str().as_bytes());
    eat(&member.rank().0.to_le_bytes());
    eat(&member.generation().0.to_le_bytes());
    eat(&std::process::id().to_le_bytes());
    eat(&n.to_le_bytes());
    h | 1 << 63
}

impl MeshActor for Tally {
    const NAME: &'static str = "regent-chaos/tally";
    type Args = TallyArgs;
    type Msg = TallyMsg;
    type Reply = TallyReply;
    // Its handlers never block (they count and answer): the chaos suite
    // and soak exercise members on their proc's thread under every fault.
    const THREAD: MemberThread = MemberThread::Proc;

    async fn new(member: &Member, _args: TallyArgs) -> Result<Self, ActorError> {
        Ok(Self {
            life: Life {
                rank: member.rank().0,
                born: member.generation().0,
                nonce: nonce(member),
                pid: std::process::id(),
            },
            log: SeqLog::default(),
            order: BTreeMap::new(),
            order_dropped: 0,
            nested: Vec::new(),
        })
    }

    async fn handle(&mut self, member: &Member, msg: TallyMsg) -> Result<TallyReply, ActorError> {
        Ok(match msg {
            TallyMsg::Record { seq, sender } => {
                self.log.insert(seq);
                if self.order.len() < MAX_SENDERS || self.order.contains_key(&sender) {
                    self.order.entry(sender).or_default().record(seq);
                } else {
                    self.order_dropped += 1;
                }
                TallyReply::Life(self.life)
            }
            TallyMsg::Probe => TallyReply::Life(self.life),
            TallyMsg::Report { from } => {
                let (ranges, cut) = self.log.since(from);
                let mut duplicates: Vec<u64> = self
                    .log
                    .duplicates
                    .iter()
                    .copied()
                    .filter(|d| *d >= from)
                    .collect();
                duplicates.sort_unstable();
                TallyReply::Report(LifeReport {
                    life: self.life,
                    ranges,
                    duplicates,
                    recorded: self.log.recorded,
                    truncated: cut || self.log.truncated,
                    order: self.order.iter().map(|(s, o)| (*s, o.clone())).collect(),
                    order_dropped: self.order_dropped,
                })
            }
            TallyMsg::Nest => {
                let mesh = if self.nested.len() >= MAX_NESTED {
                    Err(format!("this life owns {MAX_NESTED} meshes already"))
                } else {
                    let policy =
                        MeshPolicy::default().intensity(100, std::time::Duration::from_secs(60));
                    match member
                        .spawn_mesh::<Tally>("nested", 1, &TallyArgs::default(), policy)
                        .await
                    {
                        Ok(m) => {
                            let id = m.id().0;
                            self.nested.push(m);
                            Ok(id)
                        }
                        Err(e) => Err(e.to_string()),
                    }
                };
                TallyReply::Nested {
                    life: self.life,
                    mesh,
                }
            }
            TallyMsg::Owned => TallyReply::Owned {
                life: self.life,
                meshes: self.nested.iter().map(|m| m.id().0).collect(),
            },
            TallyMsg::Panic => panic_hook(self.life.rank)?,
        })
    }
}

fn panic_hook(rank: u32) -> Result<TallyReply, ActorError> {
    panic!("{INJECTED_PANIC} in rank {rank}");
}

regent_mesh::register_actor!(Tally);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_ranges_and_duplicates() {
        let mut log = SeqLog::default();
        for s in [1, 2, 3, 5, 7, 6, 4] {
            assert!(log.insert(s));
        }
        assert!(!log.insert(3));
        assert_eq!(log.since(0), (vec![(1, 7)], false));
        assert_eq!(log.duplicates, vec![3]);
        assert!(log.insert(10));
        assert_eq!(log.since(5), (vec![(5, 7), (10, 10)], false));
        assert_eq!(log.since(8), (vec![(10, 10)], false));
        assert!(log.contains(10) && !log.contains(9));
        assert_eq!(log.recorded, 9);
    }

    #[test]
    fn the_order_log_is_one_run_while_the_order_holds() {
        let mut o = OrderLog::default();
        for s in [1, 4, 9, 10] {
            o.record(s);
        }
        assert_eq!(
            o.runs,
            vec![Run {
                at: 0,
                first: 1,
                last: 10
            }]
        );
        assert_eq!((o.covered, o.arrivals), (4, 4));
        // 7 after 10: a new run starts at arrival 4; a repeat too.
        o.record(7);
        o.record(8);
        o.record(8);
        assert_eq!(
            o.runs,
            vec![
                Run {
                    at: 0,
                    first: 1,
                    last: 10
                },
                Run {
                    at: 4,
                    first: 7,
                    last: 8
                },
                Run {
                    at: 6,
                    first: 8,
                    last: 8
                },
            ]
        );
    }

    #[test]
    fn the_order_log_is_bounded_and_says_what_it_dropped() {
        let mut o = OrderLog::default();
        for i in 0..(MAX_ORDER_RUNS as u64 + 10) {
            // Every arrival below the one before: a run each.
            o.record(1_000_000 - i);
        }
        assert_eq!(o.runs.len(), MAX_ORDER_RUNS);
        assert_eq!(o.covered, MAX_ORDER_RUNS as u64);
        assert_eq!(o.arrivals, MAX_ORDER_RUNS as u64 + 10);
        // Once cut short, even increasing arrivals are not appended.
        o.record(2_000_000);
        assert_eq!(o.covered, MAX_ORDER_RUNS as u64);
    }
}
