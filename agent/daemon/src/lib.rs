//! `belayerd`, the per-node Belayer agent, as a library (the binary is `src/bin/belayerd.rs`).
//!
//! Belayer makes agentic-RL rollouts survive infrastructure failures (paper: "Belayer:
//! Efficient Fault Tolerance for LLM Agentic RL Training"). This crate holds what runs as root
//! on a node: sandboxes (namespaces, cgroup, overlayfs root over a read-only image), full
//! checkpoints C_k = (F_k, R_k) tied to the LLM context L_k and published atomically, full
//! restore into a fresh sandbox ("Environment-state recovery"), the per-sandbox checkpoint
//! policy (Algorithm 1) and the sandbox tracer. Clients reach it only through the socket
//! (crate `belayer-ipc`); see `docs/design.md`.
//!
//! Modules:
//! - [`service`]: the registry of sandboxes and the protocol handler (adoption, watches, gc,
//!   events, policies, context logs);
//! - [`sandbox`]: one file per verb (create, exec, checkpoint, restore, remove);
//! - [`record`]: what the daemon remembers about a sandbox (record, lifecycle state, paths);
//! - [`store`]: the checkpoint store and manifest (atomic publication);
//! - [`images`]: read-only images (lower layers);
//! - [`cgroup`]: sandbox cgroups (v2, with v1 fallbacks for limits and the freezer);
//! - [`quota`]: kernel-enforced disk quotas (btrfs subvolume + qgroup limit per instance);
//! - [`policy`]: the adaptive risk-aware checkpoint policy (Algorithm 1) and its baselines;
//! - [`helper`]: single-threaded helper processes that create and enter namespaces;
//! - [`trace`]: the sandbox tracer (crate `belayer-ebpf`): instant fail-stop detection,
//!   infrastructure-fault classification and per-action dirtiness;
//! - [`metrics`]: Prometheus metrics and the bounded HTTP endpoint that serves them;
//! - [`config`], [`runtime`], [`stage`], [`sys`], [`userns`].
//!
//! Dependencies and why: `belayer-ipc` (protocol and server), `belayer-context` (the L_k logs
//! behind the `Context*` requests), `belayer-workers` (memory servers supervised from
//! the config: the child-process handle and its config entry), `belayer-overlay` (upper-layer
//! capture and install, image streams and unpacking), `belayer-criu` (CRIU dump/restore),
//! `belayer-ebpf` (the sandbox tracer), `nix`/`rustix`/`libc` (namespaces, mounts, pidfds,
//! signals), `serde`/`serde_json`/`toml` (state files, manifests, config), `blake3` (artifact
//! digests), `flate2`/`zstd` (compressed image archives; the tar format and the hardened unpack
//! are `belayer-overlay`'s), `caps` (capability sets of sandboxes and of the image-walk helper),
//! `clap` (the `belayerd` command line), `thiserror` (typed errors), `tracing`/
//! `tracing-subscriber` (logs), `anyhow` (the binary only), `libseccomp` (compiles the sandbox
//! seccomp filter: rules with argument conditions to one classic-BPF program laid out as a
//! binary tree over syscall numbers, which keeps the kernel's install cost at every exec and
//! restored process low; links the system's libseccomp ≥ 2.5; only `belayerd` calls it, once at
//! start, so `belayer-helper` does not load it), `seccompiler` (only its
//! `apply_filter`: installs an exported program without allocating, safe between `fork` and
//! `execve`), `oci-client` (the registry client of [`images::registry`]: image references
//! and their Docker Hub defaults, the pull authentication handshake with bearer-token and
//! basic challenges, manifest types; built with rustls, no OpenSSL), `reqwest` (the same HTTP
//! client oci-client uses, for the manifest and blob GETs it cannot bound or stream without
//! hashing twice), `tokio` (the one-worker runtime each registry connection owns; the daemon
//! itself stays thread-based), `bytes` (the chunks of a blob stream), `sha2`/`hex` (OCI
//! digests are sha256/sha512, unlike our blake3 artifact digests), `oci-spec` (OCI and Docker
//! schema 2 manifests and image configs, parsed as untrusted input by [`images::oci`]),
//! `prometheus-client` (the Prometheus project's client: metric types and the OpenMetrics
//! text encoding of [`metrics`]), `httparse` (parses the request heads of the metrics
//! endpoint; the listener around it is ours, to bound threads, bytes and time per client);
//! `tar` and `tempfile` for tests only. At run time, not linked: `libnftables.so.1`
//! (`dlopen`ed by `sandbox::net_lock` to lock a restore's network namespace; the library CRIU is
//! built with; without it restores go on unlocked).
#![warn(missing_docs)]

pub mod cgroup;
pub mod config;
pub mod helper;
pub mod images;
pub mod metrics;
pub mod policy;
pub mod quota;
pub mod record;
pub mod runtime;
pub mod sandbox;
pub mod service;
pub mod stage;
pub mod store;
pub mod sys;
pub mod trace;
pub mod userns;
