//! The `belayer` command line (clap): global flags, subcommands and their arguments.

use std::ffi::OsString;
use std::path::PathBuf;

use belayer_ipc::DEFAULT_SOCKET;
use clap::{Args, Parser, Subcommand};

/// `belayer` command line.
#[derive(Debug, Parser)]
#[command(
    name = "belayer",
    version,
    about = "Fault-tolerant sandboxes for agentic RL rollouts"
)]
pub struct Cli {
    /// Socket of belayerd.
    #[arg(long, global = true, env = "BELAYER_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Daemon status.
    Status,
    /// Manage images (read-only lower layers).
    #[command(subcommand)]
    Image(ImageCmd),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Run one action in a sandbox; exits with the action's exit code.
    Exec(ExecArgs),
    /// Take a full checkpoint C_k at action boundary k (`checkpoint ID --prefix K`), or list
    /// the checkpoints of a sandbox (`checkpoint ls ID`).
    Checkpoint(CheckpointCmd),
    /// Restore a sandbox from its ready checkpoint (or that of `--prefix K`) into a fresh
    /// instance.
    Restore(RestoreArgs),
    /// Fork N new sandboxes from a checkpoint C_K of a running sandbox (its ready
    /// checkpoint, or that of `--prefix K`, or `--checkpoint NAME`): each is restored into
    /// an instance of its own; the source keeps running. All or nothing.
    Fork(ForkArgs),
    /// Old spelling of `checkpoint ls ID`.
    #[command(hide = true)]
    Checkpoints {
        /// Sandbox id.
        id: String,
    },
    /// Drop checkpoints by age or rollout tag.
    Gc(GcArgs),
    /// Copy a file or directory between the host and a sandbox: `cp SRC ID:DST` or
    /// `cp ID:SRC DST`.
    ///
    /// An existing directory DST takes SRC under its own name; anything else becomes DST
    /// (its parent must exist; `DST/` must be an existing directory). `-` as SRC reads a tar
    /// archive from stdin (extracted into the existing directory ID:DST), `-` as DST writes
    /// the tar of ID:SRC to stdout. A host path with a `:` before its first `/` is written
    /// `./a:b`. Symlinks are copied as links; inside the sandbox nothing is ever written
    /// through one, and a download never writes outside DST.
    Cp(CpArgs),
    /// Agentic rollouts on recorded trajectories under failure injection, with a report.
    Rollout(crate::rollout::RolloutArgs),
    /// Benchmarks: runs `belayer-bench ARGS...` (installed next to `belayer`).
    #[command(disable_help_flag = true)]
    Bench(Forwarded),
    /// A memory server owning model weights or the KV-cache arena: runs `belayer-memd
    /// --socket SOCKET ARGS...`.
    #[command(disable_help_flag = true)]
    MemoryServer(Forwarded),
    /// The deterministic reference LLM engine: runs `belayer-toy-engine ARGS...`.
    #[command(disable_help_flag = true)]
    ToyEngine(Forwarded),
    /// The rollout router: runs `belayer-router ARGS...`.
    #[command(disable_help_flag = true)]
    Router(Forwarded),
}

/// Arguments handed unchanged to another Belayer program (see [`crate::forward`]).
#[derive(Debug, Args)]
pub struct Forwarded {
    /// Arguments of the program.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

/// `belayer image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Import an image as NAME: a rootfs directory or a tar (plain, gzip, zstd) as one flat
    /// tree, or an OCI image as shared layers: `oci:DIR[:TAG]` (an OCI image layout) or
    /// `docker-archive:FILE[:REPO:TAG]` (the output of `docker save` / `podman save`).
    ///
    /// The source is opened by this command with your own rights and passed to belayerd as
    /// descriptors: belayerd reads only what you can read (a directory is walked as your
    /// uid and groups) and verifies every digest of an OCI image. Device nodes are refused
    /// (in a flat tree, those under the source's top-level /dev are left out: every sandbox
    /// has its own /dev).
    Import {
        /// Image name: a plain name or a reference (`localhost:5000/swe/task:1`).
        name: String,
        /// Directory or archive readable by you, `oci:DIR[:TAG]` or `docker-archive:FILE[:REF]`.
        path: String,
    },
    /// Pull an image from an OCI distribution registry into the node's layer store (each
    /// layer stored once, shared by every image that has it).
    ///
    /// Credentials: `--creds USER:PASSWORD`, else the entry for the registry in a docker-
    /// style auth file (`--authfile`, `$REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json`,
    /// `~/.docker/config.json`, `$XDG_RUNTIME_DIR/containers/auth.json`), else anonymous.
    /// Loopback registries are talked to over plain HTTP; others over HTTPS unless
    /// `--insecure` (or the daemon's `insecure_registries`).
    Pull(PullArgs),
    /// List images.
    Ls,
    /// Remove an image no sandbox uses.
    Rm {
        /// Image name.
        name: String,
    },
}

/// Arguments of `image pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// `HOST[:PORT]/REPO[:TAG]` or `...@sha256:DIGEST` (no host: docker.io; no tag: latest).
    pub reference: String,
    /// Local image name (default: the reference as given).
    #[arg(long)]
    pub name: Option<String>,
    /// `USER:PASSWORD` for the registry.
    #[arg(long, env = "BELAYER_REGISTRY_CREDS", hide_env_values = true)]
    pub creds: Option<String>,
    /// A docker-style auth file (`{"auths": {"HOST": {"auth": base64(USER:PASSWORD)}}}`).
    #[arg(long)]
    pub authfile: Option<PathBuf>,
    /// Talk plain HTTP to this registry.
    #[arg(long)]
    pub insecure: bool,
}

/// `belayer sandbox ...`
#[derive(Debug, Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox; prints its id.
    Create(CreateArgs),
    /// List sandboxes.
    Ls,
    /// Describe a sandbox.
    Inspect {
        /// Sandbox id.
        id: String,
    },
    /// Remove a sandbox and its checkpoints.
    Rm {
        /// Sandbox id.
        id: String,
    },
}

/// Arguments of `sandbox create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Image name.
    #[arg(long)]
    pub image: String,
    /// Memory limit in bytes (suffixes K, M, G accepted).
    #[arg(long, value_parser = belayer_ipc::parse_bytes)]
    pub memory_max: Option<u64>,
    /// Maximum number of processes.
    #[arg(long)]
    pub pids_max: Option<u64>,
    /// Disk limit in bytes of the sandbox's upper layer (suffixes K, M, G, T accepted; default:
    /// the daemon's `default_disk_max_bytes`, 10 GiB unless configured).
    #[arg(long, value_parser = belayer_ipc::parse_bytes)]
    pub disk_max: Option<u64>,
    /// Environment variable of every action, K=V (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Rollout tag (for `gc --tag`).
    #[arg(long)]
    pub tag: Option<String>,
    /// CPU bandwidth limit in CPUs, e.g. 1.5 (default: the daemon's `default_cpus`).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// User namespace: `private` (default: root inside is an unprivileged host uid) or
    /// `host` (explicit opt-in: root inside is host root).
    #[arg(long, value_parser = parse_userns)]
    pub userns: Option<belayer_ipc::UsernsMode>,
    /// Working directory of every action (an absolute path inside the sandbox, not created;
    /// `exec --cwd` overrides it; default `/`).
    #[arg(long)]
    pub workdir: Option<String>,
    /// User every action runs as: `UID` or `UID:GID` (default: the image's configured user,
    /// else root).
    #[arg(long)]
    pub user: Option<String>,
}

/// Parses `--userns`.
fn parse_userns(s: &str) -> Result<belayer_ipc::UsernsMode, String> {
    match s {
        "private" => Ok(belayer_ipc::UsernsMode::Private),
        "host" => Ok(belayer_ipc::UsernsMode::Host),
        _ => Err(format!("{s:?}: expected `private` or `host`")),
    }
}

/// Arguments of `exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Timeout in seconds (fractions allowed).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Working directory inside the sandbox.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Extra environment, K=V (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Bytes of stdout and of stderr to keep (of the merged stream with `--merge-stderr`).
    #[arg(long, value_parser = belayer_ipc::parse_bytes)]
    pub output_limit: Option<u64>,
    /// Stdout and stderr as one ordered stream, as on a terminal: all of it comes back on
    /// stdout (and in `stdout` of `--json`).
    #[arg(long)]
    pub merge_stderr: bool,
    /// Feed the bytes of this file to the action's stdin.
    #[arg(long, value_name = "PATH", conflicts_with = "stdin")]
    pub stdin_file: Option<PathBuf>,
    /// Feed this command's own stdin (read to its end first) to the action's stdin.
    #[arg(short = 'i', long = "stdin")]
    pub stdin: bool,
    /// The command (one argument is run by `sh -c`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `belayer checkpoint ...`: take one, or a subcommand.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct CheckpointCmd {
    /// What to do instead of taking a checkpoint.
    #[command(subcommand)]
    pub action: Option<CheckpointAction>,
    /// Take a checkpoint.
    #[command(flatten)]
    pub take: CheckpointArgs,
}

/// `belayer checkpoint <subcommand>`.
#[derive(Debug, Subcommand)]
pub enum CheckpointAction {
    /// List the checkpoints of a sandbox, every branch (`--json`: each with its `parent`
    /// and whether it is the `ready` one).
    Ls {
        /// Sandbox id.
        id: String,
        /// Draw the checkpoints as their tree: each under its parent, the ready one marked.
        #[arg(long)]
        tree: bool,
    },
}

/// Arguments of `checkpoint ID --prefix K`.
#[derive(Debug, Args)]
pub struct CheckpointArgs {
    /// Sandbox id.
    #[arg(required = true)]
    pub id: Option<String>,
    /// Action boundary k of the trajectory prefix.
    #[arg(long, required = true)]
    pub prefix: Option<u64>,
    /// File holding the LLM context L_k (stored as opaque bytes).
    #[arg(long)]
    pub context: Option<PathBuf>,
}

/// Arguments of `restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Sandbox id.
    pub id: String,
    /// Write the restored L_k to this file (JSON then names it as `context_file`).
    #[arg(long)]
    pub context_out: Option<PathBuf>,
    /// Check the restored upper layer and process list against the checkpoint.
    #[arg(long)]
    pub verify: bool,
    /// Restore the checkpoint of action boundary K on the ready checkpoint's line instead;
    /// it becomes the ready checkpoint and the checkpoints taken after it stay as a branch.
    #[arg(long, value_name = "K", conflicts_with = "checkpoint")]
    pub prefix: Option<u64>,
    /// Restore this checkpoint (a name `checkpoint ls` lists, on any branch) instead.
    #[arg(long, value_name = "NAME")]
    pub checkpoint: Option<String>,
}

/// Arguments of `fork`.
#[derive(Debug, Args)]
pub struct ForkArgs {
    /// Source sandbox id.
    pub id: String,
    /// Children to make (1 to 256).
    #[arg(long, short = 'n', value_name = "N")]
    pub count: u32,
    /// Fork from the checkpoint of action boundary K on the ready checkpoint's line.
    #[arg(long, value_name = "K", conflicts_with = "checkpoint")]
    pub prefix: Option<u64>,
    /// Fork from this checkpoint (a name `checkpoint ls` lists, on any branch).
    #[arg(long, value_name = "NAME")]
    pub checkpoint: Option<String>,
    /// Write L_K to this file (JSON then names it as `context_file`).
    #[arg(long)]
    pub context_out: Option<PathBuf>,
    /// Check each child's restored upper layer and process list against the checkpoint.
    #[arg(long)]
    pub verify: bool,
}

/// Arguments of `cp`.
#[derive(Debug, Args)]
pub struct CpArgs {
    /// Source: a host path, `-` (a tar on stdin), or ID:PATH.
    pub src: String,
    /// Destination: a host path, `-` (a tar on stdout), or ID:PATH.
    pub dst: String,
    /// Timeout of the transfer in seconds (default: the daemon's exec timeout).
    #[arg(long)]
    pub timeout: Option<f64>,
}

/// Arguments of `gc`.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Drop checkpoints older than this many seconds (the ready one of a sandbox is kept).
    #[arg(long)]
    pub older_than: Option<u64>,
    /// Drop every checkpoint of the sandboxes with this rollout tag.
    #[arg(long)]
    pub tag: Option<String>,
}

/// Parses `K=V`.
pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected K=V, got {s:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envs() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("x").is_err());
    }

    #[test]
    fn exec_options_parse() {
        let cli = Cli::try_parse_from([
            "belayer",
            "exec",
            "sb-1",
            "--cwd",
            "/tmp",
            "--env",
            "A=1",
            "--env",
            "B=2",
            "--output-limit",
            "4K",
            "--merge-stderr",
            "-i",
            "--",
            "cat",
        ])
        .unwrap();
        let Command::Exec(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.cwd.as_deref(), Some("/tmp"));
        assert_eq!(a.env.len(), 2);
        assert_eq!(a.output_limit, Some(4096));
        assert!(a.merge_stderr && a.stdin && a.stdin_file.is_none());
        let cli = Cli::try_parse_from(["belayer", "exec", "sb", "--stdin-file", "/x", "--", "cat"])
            .unwrap();
        let Command::Exec(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.stdin_file.as_deref(), Some(std::path::Path::new("/x")));
        assert!(Cli::try_parse_from([
            "belayer",
            "exec",
            "sb",
            "-i",
            "--stdin-file",
            "/x",
            "--",
            "cat"
        ])
        .is_err());
    }

    /// The arguments of `belayer sandbox create --image py` followed by `extra`.
    fn create(extra: &[&str]) -> CreateArgs {
        let argv = ["belayer", "sandbox", "create", "--image", "py"];
        let cli = Cli::try_parse_from(argv.iter().chain(extra)).unwrap();
        match cli.command {
            Command::Sandbox(SandboxCmd::Create(a)) => a,
            _ => panic!("wrong command"),
        }
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "belayer",
            "exec",
            "sb-1",
            "--timeout",
            "2",
            "--",
            "ls",
            "-la",
        ])
        .unwrap();
        match cli.command {
            Command::Exec(a) => assert_eq!(a.command, vec!["ls", "-la"]),
            _ => panic!("wrong command"),
        }
        assert_eq!(create(&["--disk-max", "64M"]).disk_max, Some(64 << 20));
        let cli = Cli::try_parse_from(["belayer", "checkpoint", "ls", "sb-1"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Checkpoint(CheckpointCmd {
                action: Some(CheckpointAction::Ls { ref id, tree: false }),
                ..
            }) if id == "sb-1"
        ));
        let cli = Cli::try_parse_from(["belayer", "checkpoint", "sb-1", "--prefix", "3"]).unwrap();
        match cli.command {
            Command::Checkpoint(c) => {
                assert!(c.action.is_none());
                assert_eq!(c.take.id.as_deref(), Some("sb-1"));
                assert_eq!(c.take.prefix, Some(3));
            }
            _ => panic!("wrong command"),
        }
        assert!(Cli::try_parse_from(["belayer", "checkpoint", "sb-1"]).is_err());
        let cli = Cli::try_parse_from(["belayer", "restore", "sb-1", "--prefix", "2", "--verify"])
            .unwrap();
        match cli.command {
            Command::Restore(r) => assert_eq!((r.prefix, r.verify), (Some(2), true)),
            _ => panic!("wrong command"),
        }
        assert_eq!(
            create(&["--workdir", "/srv"]).workdir.as_deref(),
            Some("/srv")
        );
        assert!(Cli::try_parse_from(["belayer", "checkpoints", "sb-1"]).is_ok());
        let cli = Cli::try_parse_from(["belayer", "bench", "capture", "--runs", "3"]).unwrap();
        match cli.command {
            Command::Bench(f) => assert_eq!(f.args, ["capture", "--runs", "3"]),
            _ => panic!("wrong command"),
        }
    }
}
