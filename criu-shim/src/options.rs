//! Option values shared by dump and restore.

/// How CRIU blocks the tree's network while it works (`--network-lock`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkLock {
    /// `iptables` rules (CRIU's default; needs the `iptables` binary).
    Iptables,
    /// An `nftables` table (needs CRIU built with libnftables, as `scripts/setup.sh` does).
    Nftables,
    /// No lock: for trees without network connections worth protecting (a sandbox with only `lo`).
    Skip,
}

impl NetworkLock {
    /// The `--network-lock` value.
    pub(crate) fn arg(self) -> &'static str {
        match self {
            NetworkLock::Iptables => "iptables",
            NetworkLock::Nftables => "nftables",
            NetworkLock::Skip => "skip",
        }
    }
}
