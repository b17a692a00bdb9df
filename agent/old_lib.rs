//! Belayer agent: `belayerd` and the `belayer` command.
//!
//! Belayer makes agentic-RL rollouts survive infrastructure failures (paper: "Belayer:
//! Efficient Fault Tolerance for LLM Agentic RL Training"). This crate holds the per-node agent:
//! sandboxes (namespaces, cgroup, overlayfs root over a read-only image), full checkpoints
//! C_k = (F_k, R_k) tied to the LLM context L_k and published atomically, and full restore into
//! a fresh sandbox ("Environment-state recovery"). See `docs/design.md`.
//!
//! Modules:
//! - [`daemon`]: the registry of sandboxes and the protocol handler;
//! - [`sandbox`]: one file per verb (create, exec, checkpoint, restore, remove);
//! - [`store`]: the checkpoint store and manifest (atomic publication);
//! - [`images`]: read-only images (lower layers);
//! - [`cgroup`]: sandbox cgroups (v2, with v1 fallbacks for limits and the freezer);
//! - [`quota`]: kernel-enforced disk quotas (btrfs subvolume + qgroup limit per instance);
//! - [`context`]: the LLM-context log L_k (framed, CRC-checked records; torn-tail recovery);
//! - [`policy`]: the adaptive risk-aware checkpoint policy (Algorithm 1) and its baselines;
//! - [`report`]: the rollout report (`report.json`, `report.md`, SVG plots);
//! - [`rollout`]: the rollout driver (`belayer rollout`) on recorded trajectories;
//! - [`helper`]: single-threaded helper processes that create and enter namespaces;
//! - [`handover`]: shadow workers, the five-step handover, the rollout router with token-level
//!   context recovery, and the reference engine `belayer toy-engine`;
//! - [`memory`]: memory servers owning model weights and the KV-cache arena, handing region
//!   descriptors to workers ("State isolation");
//! - [`trace`]: the sandbox tracer (crate `belayer-ebpf`): instant fail-stop detection,
//!   infrastructure-fault classification and per-action dirtiness;
//! - [`config`], [`runtime`], [`sys`].
//!
//! Dependencies and why: `belayer-ipc` (protocol, client, memory-server worker side),
//! `belayer-overlay` (upper-layer capture and install, image streams and unpacking), `belayer-criu`
//! (CRIU dump/restore), `belayer-ebpf` (the sandbox tracer), `nix`/`rustix`/`libc` (namespaces,
//! mounts, pidfds, signals), `serde`/`serde_json`/`toml` (state files, manifests, config, CLI
//! JSON), `blake3` (artifact and record digests, seeded failure schedule), `bincode` + `crc32fast` +
//! `serde_bytes` (context-log records: the protocol's encoding, a checksum per record, byte
//! fields as blobs), `flate2`/`zstd` (compressed image archives; the tar format and the hardened
//! unpack are `belayer-overlay`'s), `caps` (capability sets of sandboxes and of the image-walk
//! helper), `plotters` (SVG plots of the rollout report, no system fonts needed), `indicatif`
//! (rollout progress bars), `clap` (CLI), `thiserror` (typed errors),
//! `tracing`/`tracing-subscriber` (logs), `anyhow` (CLI and binaries only), `libseccomp` (compiles the sandbox seccomp filter: rules with argument conditions to one
//! classic-BPF program laid out as a binary tree over syscall numbers, which keeps the
//! kernel's install cost at every exec and restored process low; links the system's
//! libseccomp ≥ 2.5), `seccompiler` (only its `apply_filter`: installs an exported program
//! without allocating, safe between `fork` and `execve`); `tar` for tests only.
//! At run time, not linked: `libnftables.so.1` (`dlopen`ed by `sandbox::net_lock` to lock a
//! restore's network namespace; the library CRIU is built with; without it restores go on
//! unlocked).
#![warn(missing_docs)]

pub mod cgroup;
pub mod cli;
pub mod config;
pub mod context;
pub mod daemon;
pub mod handover;
pub mod helper;
pub mod images;
pub mod memory;
pub mod policy;
pub mod quota;
pub mod report;
pub mod rollout;
pub mod runtime;
pub mod sandbox;
pub mod stage;
pub mod store;
pub mod sys;
pub mod trace;
pub mod userns;
