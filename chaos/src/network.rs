//! The chaos network: which nodes exist (the controller and every proc,
//! known by the UDP socket they send from), and which faults each directed
//! link between two nodes has right now. Every [`Proxy`](crate::Proxy) reads
//! it for every datagram, so a change takes effect at once, while the run
//! goes on.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// A node of the chaos network: the controller or one proc (a replacement
/// proc is a new node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The controller.
    pub const CONTROLLER: Self = Self(0);
    /// A sender the network does not know (no rule names it but
    /// isolation).
    pub const UNKNOWN: Self = Self(u32::MAX);
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::CONTROLLER => f.write_str("controller"),
            Self::UNKNOWN => f.write_str("unknown"),
            Self(n) => write!(f, "node{n}"),
        }
    }
}

/// The faults of one directed link, applied to each datagram on it. The
/// default is a clean link.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LinkFaults {
    /// Probability that a datagram is dropped. Default 0.
    pub drop_probability: f64,
    /// Added one-way delay. Default 0.
    pub delay: Duration,
    /// Each datagram's delay is `delay` plus or minus up to this much
    /// (uniform), which also reorders datagrams. Default 0.
    pub jitter: Duration,
    /// Probability that a datagram is sent twice. Default 0.
    pub duplicate_probability: f64,
    /// Probability that a datagram is held back (by
    /// [`ProxyConfig::reorder_hold`](crate::ProxyConfig::reorder_hold)) so
    /// that the ones after it overtake it. Default 0.
    pub reorder_probability: f64,
    /// A bandwidth cap: datagrams leave one after another at this rate;
    /// past [`ProxyConfig::max_queue_delay`](crate::ProxyConfig::max_queue_delay)
    /// of backlog they are dropped (tail drop). Default none.
    pub bandwidth_bytes_per_sec: Option<NonZeroU64>,
}

impl LinkFaults {
    /// A clean link.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the drop probability.
    pub fn drop_probability(mut self, p: f64) -> Self {
        self.drop_probability = p.clamp(0.0, 1.0);
        self
    }

    /// Sets the delay and its jitter.
    pub fn delay(mut self, delay: Duration, jitter: Duration) -> Self {
        self.delay = delay;
        self.jitter = jitter;
        self
    }

    /// Sets the duplicate probability.
    pub fn duplicate_probability(mut self, p: f64) -> Self {
        self.duplicate_probability = p.clamp(0.0, 1.0);
        self
    }

    /// Sets the reorder probability.
    pub fn reorder_probability(mut self, p: f64) -> Self {
        self.reorder_probability = p.clamp(0.0, 1.0);
        self
    }

    /// Sets the bandwidth cap.
    pub fn bandwidth_bytes_per_sec(mut self, rate: Option<NonZeroU64>) -> Self {
        self.bandwidth_bytes_per_sec = rate;
        self
    }

    /// Whether the link is clean (no fault at all).
    pub fn is_clean(&self) -> bool {
        *self == Self::default()
    }

    /// Both sets of faults at once: drops compound, delays add, the larger
    /// jitter and probabilities and the smaller bandwidth win.
    pub fn compose(self, other: Self) -> Self {
        Self {
            drop_probability: 1.0 - (1.0 - self.drop_probability) * (1.0 - other.drop_probability),
            delay: self.delay + other.delay,
            jitter: self.jitter.max(other.jitter),
            duplicate_probability: self.duplicate_probability.max(other.duplicate_probability),
            reorder_probability: self.reorder_probability.max(other.reorder_probability),
            bandwidth_bytes_per_sec: match (
                self.bandwidth_bytes_per_sec,
                other.bandwidth_bytes_per_sec,
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// Which way a partition cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Only datagrams from the first set to the second are dropped.
    OneWay,
    /// Datagrams both ways are dropped.
    Both,
}

/// What a proxy does with a datagram from one node to another.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Drop it: the link is cut (partition or isolation).
    Cut,
    /// Pass it through these faults.
    Pass(LinkFaults),
}

/// The rules, replaced whole or changed one at a time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rules {
    /// Faults of every link that has no rule of its own.
    pub all_links: LinkFaults,
    /// Faults of one directed link `(from, to)`, composed with
    /// `all_links`.
    pub links: HashMap<(NodeId, NodeId), LinkFaults>,
    /// Faults of every link from or to a node, composed with the others.
    pub nodes: HashMap<NodeId, LinkFaults>,
    /// Cut directed links `(from, to)`.
    pub cut: HashSet<(NodeId, NodeId)>,
    /// Nodes cut from everyone, both ways (blackholed).
    pub isolated: HashSet<NodeId>,
}

impl Rules {
    /// Whether nothing is faulty.
    pub fn is_clean(&self) -> bool {
        self.all_links.is_clean()
            && self.links.values().all(LinkFaults::is_clean)
            && self.nodes.values().all(LinkFaults::is_clean)
            && self.cut.is_empty()
            && self.isolated.is_empty()
    }

    /// Cuts the links between two sets of nodes.
    pub fn partition(&mut self, a: &[NodeId], b: &[NodeId], direction: Direction) {
        for &x in a {
            for &y in b {
                if x == y {
                    continue;
                }
                self.cut.insert((x, y));
                if direction == Direction::Both {
                    self.cut.insert((y, x));
                }
            }
        }
    }

    /// What happens to a datagram from `from` to `to`.
    pub fn verdict(&self, from: NodeId, to: NodeId) -> Verdict {
        if self.isolated.contains(&from)
            || self.isolated.contains(&to)
            || self.cut.contains(&(from, to))
        {
            return Verdict::Cut;
        }
        let mut f = self.all_links;
        if let Some(l) = self.links.get(&(from, to)) {
            f = f.compose(*l);
        }
        if let Some(n) = self.nodes.get(&from) {
            f = f.compose(*n);
        }
        if from != to
            && let Some(n) = self.nodes.get(&to)
        {
            f = f.compose(*n);
        }
        Verdict::Pass(f)
    }
}

#[derive(Debug, Default)]
struct State {
    rules: Rules,
    /// Which node sends from which socket.
    senders: HashMap<SocketAddr, NodeId>,
    names: HashMap<NodeId, String>,
}

/// The chaos network shared by every proxy of a run. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Network {
    state: Arc<RwLock<State>>,
}

impl Network {
    /// An empty, clean network.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        // Invariant: no code panics while holding this lock, and the state
        // is valid after every single assignment anyway.
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Names a node and the socket it sends from (its QUIC endpoint's bound
    /// address), so that proxies know whose datagrams they see.
    pub fn register(&self, node: NodeId, name: impl Into<String>, sends_from: SocketAddr) {
        let mut s = self.write();
        s.senders.insert(sends_from, node);
        s.names.insert(node, name.into());
    }

    /// Forgets a node (its proc exited). Its rules stay until replaced.
    pub fn forget(&self, node: NodeId) {
        let mut s = self.write();
        s.senders.retain(|_, n| *n != node);
        s.names.remove(&node);
    }

    /// The node that sends from `addr`.
    pub fn node_of(&self, addr: SocketAddr) -> NodeId {
        self.read()
            .senders
            .get(&addr)
            .copied()
            .unwrap_or(NodeId::UNKNOWN)
    }

    /// A node's name.
    pub fn name(&self, node: NodeId) -> String {
        self.read()
            .names
            .get(&node)
            .cloned()
            .unwrap_or_else(|| node.to_string())
    }

    /// What happens to a datagram from `from` to `to` now.
    pub fn verdict(&self, from: NodeId, to: NodeId) -> Verdict {
        self.read().rules.verdict(from, to)
    }

    /// The rules now.
    pub fn rules(&self) -> Rules {
        self.read().rules.clone()
    }

    /// Replaces every rule.
    pub fn set_rules(&self, rules: Rules) {
        tracing::debug!(?rules, "chaos network rules");
        self.write().rules = rules;
    }

    /// Changes the rules in place.
    pub fn update(&self, f: impl FnOnce(&mut Rules)) {
        let mut s = self.write();
        f(&mut s.rules);
        tracing::debug!(rules = ?s.rules, "chaos network rules");
    }

    /// Faults of every link.
    pub fn set_all_links(&self, faults: LinkFaults) {
        self.update(|r| r.all_links = faults);
    }

    /// Faults of one directed link.
    pub fn set_link(&self, from: NodeId, to: NodeId, faults: LinkFaults) {
        self.update(|r| {
            r.links.insert((from, to), faults);
        });
    }

    /// Faults of every link from or to `node`.
    pub fn set_node(&self, node: NodeId, faults: LinkFaults) {
        self.update(|r| {
            r.nodes.insert(node, faults);
        });
    }

    /// Cuts the links between two sets of nodes, one way or both.
    pub fn partition(&self, a: &[NodeId], b: &[NodeId], direction: Direction) {
        self.update(|r| r.partition(a, b, direction));
    }

    /// Cuts `node` from everyone, both ways (a blackhole).
    pub fn isolate(&self, node: NodeId) {
        self.update(|r| {
            r.isolated.insert(node);
        });
    }

    /// Removes every partition and isolation; link faults stay.
    pub fn heal_partitions(&self) {
        self.update(|r| {
            r.cut.clear();
            r.isolated.clear();
        });
    }

    /// Removes every rule: a clean network.
    pub fn heal(&self) {
        self.set_rules(Rules::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cut_the_right_directions() {
        let (a, b, c) = (NodeId(1), NodeId(2), NodeId(3));
        let mut r = Rules::default();
        r.partition(&[a], &[b], Direction::OneWay);
        assert_eq!(r.verdict(a, b), Verdict::Cut);
        assert!(matches!(r.verdict(b, a), Verdict::Pass(_)));
        r.partition(&[a], &[c], Direction::Both);
        assert_eq!(r.verdict(c, a), Verdict::Cut);
        r.isolated.insert(b);
        assert_eq!(r.verdict(c, b), Verdict::Cut);
        assert_eq!(r.verdict(b, NodeId::UNKNOWN), Verdict::Cut);
    }

    #[test]
    fn faults_compose() {
        let (a, b) = (NodeId(1), NodeId(2));
        let mut r = Rules {
            all_links: LinkFaults::new().drop_probability(0.5),
            ..Rules::default()
        };
        r.nodes.insert(
            b,
            LinkFaults::new()
                .drop_probability(0.5)
                .delay(Duration::from_millis(10), Duration::ZERO),
        );
        let Verdict::Pass(f) = r.verdict(a, b) else {
            panic!("cut")
        };
        assert!((f.drop_probability - 0.75).abs() < 1e-9);
        assert_eq!(f.delay, Duration::from_millis(10));
        let Verdict::Pass(clean) = Rules::default().verdict(a, b) else {
            panic!("cut")
        };
        assert!(clean.is_clean());
    }
}
