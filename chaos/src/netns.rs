//! Link faults with root: procs in network namespaces ("hosts") joined by a
//! bridge, cut and healed in the kernel — switch port down/up, and nftables
//! rules that drop a host's traffic or one direction between two hosts.
//! The recipe is `scripts/netns-chaos.sh` (adapted from the one known to
//! work on this machine kind); this module runs it.
//!
//! There is no netem in this kernel: delay and loss with jitter come from
//! the [`Proxy`](crate::Proxy), which works in namespaces too.
//!
//! Host `k` (1-based) is namespace `<prefix>k` with address `10.77.0.k/24`
//! on its `eth0`; the root namespace gets `10.77.0.254` on the same bridge,
//! so the controller (not namespaced) reaches every host. Dropping a
//! [`Hosts`] deletes every namespace it made and ends the processes in
//! them.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ChaosError;

/// The root namespace's address on the hosts' bridge.
pub const ROOT_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 254);

/// Whether this process runs as root (uid 0), which namespaces need.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            .is_some_and(|euid| euid == "0")
    })
}

/// Whether a program is on the `PATH`.
pub fn have(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

/// The variable that makes tests needing namespace hosts fail, rather than
/// skip, where [`unavailable`] says they cannot run (CI sets it, as root).
pub const REQUIRE_NETNS: &str = "REGENT_REQUIRE_NETNS";
/// The variable that makes tests needing `nft` (the firewall and one-way
/// block faults) fail, rather than skip, where it is missing (CI installs
/// nftables and sets it).
pub const REQUIRE_NFT: &str = "REGENT_REQUIRE_NFT";

/// What a test does when something it needs is missing: fails if the
/// variable `require` is set (someone asked for the test to run, as CI
/// does for what it installs), else says it skipped (`what` is what is
/// skipped, `why` why). Returns normally only to skip.
///
/// # Panics
///
/// When `require` is set: the skip would read as a pass.
#[track_caller]
pub fn skip_unless_required(require: &str, what: &str, why: &str) {
    assert!(
        std::env::var_os(require).is_none(),
        "{require} is set, but {what} cannot run: {why}"
    );
    println!("skipped: {what} ({why}; set {require} to fail instead)");
}

/// Why namespace hosts cannot be made here, if they cannot (not root, no
/// `ip`): tests pass it to [`skip_unless_required`] with [`REQUIRE_NETNS`].
pub fn unavailable() -> Option<String> {
    if !is_root() {
        return Some("not root: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN".into());
    }
    if !have("ip") {
        return Some("no `ip` command (iproute2)".into());
    }
    None
}

/// Namespace hosts on one bridge; see the module documentation.
#[derive(Debug)]
pub struct Hosts {
    script: PathBuf,
    prefix: String,
    count: u32,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Err(e) = self.run(&["down"]) {
            tracing::warn!(error = %e, "removing network namespaces");
        }
    }
}

impl Hosts {
    /// Makes `count` hosts named `<prefix>1..` with the recipe at `script`.
    /// The prefix must be unique among runs at once (it also names the
    /// bridge namespace and the root leg, so keep it at most 6 bytes).
    pub fn up(script: &Path, prefix: &str, count: u32) -> Result<Self, ChaosError> {
        if let Some(why) = unavailable() {
            return Err(ChaosError::Netns(why));
        }
        let hosts = Self {
            script: script.to_owned(),
            prefix: prefix.to_owned(),
            count,
        };
        // Leftovers of a run that was killed.
        let _ = hosts.run(&["down"]);
        hosts.run(&["up", &count.to_string()])?;
        Ok(hosts)
    }

    fn run(&self, args: &[&str]) -> Result<(), ChaosError> {
        self.output(args).map(drop)
    }

    /// Runs the recipe; its standard output.
    fn output(&self, args: &[&str]) -> Result<String, ChaosError> {
        let out = Command::new("bash")
            .arg(&self.script)
            .args(args)
            .env("PFX", &self.prefix)
            .env("ROOT_LEG", "1")
            .output()
            .map_err(|e| ChaosError::Netns(format!("running {}: {e}", self.script.display())))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(ChaosError::Netns(format!(
                "{} {}: {}",
                self.script.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    /// How many hosts.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Host `k`'s namespace name.
    pub fn namespace(&self, k: u32) -> String {
        format!("{}{k}", self.prefix)
    }

    /// Host `k`'s address.
    pub fn ip(&self, k: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 77, 0, k.min(253) as u8))
    }

    /// Takes host `k`'s switch port down (carrier loss: both ways).
    pub fn cut(&self, k: u32) -> Result<(), ChaosError> {
        self.run(&["cut", &k.to_string()])
    }

    /// Brings host `k`'s switch port back up.
    pub fn heal(&self, k: u32) -> Result<(), ChaosError> {
        self.run(&["heal", &k.to_string()])
    }

    /// Host `k`'s firewall drops all its traffic (nftables).
    pub fn drop_all(&self, k: u32) -> Result<(), ChaosError> {
        self.run(&["nft-drop", &k.to_string()])
    }

    /// Removes host `k`'s drop rules.
    pub fn undrop_all(&self, k: u32) -> Result<(), ChaosError> {
        self.run(&["nft-undrop", &k.to_string()])
    }

    /// Drops traffic from host `a` to host `b` at the switch, one way
    /// (nftables, bridge family; host 0 is the root namespace).
    pub fn block(&self, a: u32, b: u32) -> Result<(), ChaosError> {
        self.run(&["block", &a.to_string(), &b.to_string()])
    }

    /// Removes a [`Hosts::block`].
    pub fn unblock(&self, a: u32, b: u32) -> Result<(), ChaosError> {
        self.run(&["unblock", &a.to_string(), &b.to_string()])
    }

    fn counter(&self, args: &[&str]) -> Result<u64, ChaosError> {
        let out = self.output(args)?;
        out.trim().parse().map_err(|e| {
            ChaosError::Netns(format!(
                "{} {}: not a count: {out:?} ({e})",
                self.script.display(),
                args.join(" ")
            ))
        })
    }

    /// Packets host `k`'s interface has received (its kernel counter).
    pub fn rx_packets(&self, k: u32) -> Result<u64, ChaosError> {
        self.counter(&["rx", &k.to_string()])
    }

    /// Packets the root namespace has sent on its leg to the bridge.
    pub fn root_tx_packets(&self) -> Result<u64, ChaosError> {
        self.counter(&["root-tx"])
    }

    /// Packets host `k`'s firewall drop ([`Hosts::drop_all`]) has dropped
    /// while in force.
    pub fn dropped(&self, k: u32) -> Result<u64, ChaosError> {
        self.counter(&["dropped", &k.to_string()])
    }

    /// Packets the block from `a` to `b` ([`Hosts::block`]) has dropped
    /// while in force.
    pub fn blocked(&self, a: u32, b: u32) -> Result<u64, ChaosError> {
        self.counter(&["blocked", &a.to_string(), &b.to_string()])
    }
}
