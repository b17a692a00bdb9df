//! What the verbs that start an `exec` helper ([`crate::helper::exec`]) in a running sandbox
//! share (`exec`, `upload`, `download`): the check that the sandbox can take one, the default
//! timeout, and the helper's command line up to the verb's own flags.

use std::ffi::{OsStr, OsString};

use super::SandboxState;
use crate::cgroup::SandboxCgroup;
use crate::helper::HELPER_ARG;
use crate::record::SandboxRecord;
use crate::runtime::Runtime;

/// The state to report when the sandbox of `rec` cannot take a helper now: `"failed"` for a
/// running sandbox whose init is gone, else its state when that does not allow actions
/// (being restored, failed, ...). `None`: it is running.
pub(super) fn not_running(rec: &SandboxRecord) -> Option<&'static str> {
    if rec.state.can_exec() && rec.init_alive() {
        return None;
    }
    Some(if rec.state == SandboxState::Running {
        "failed"
    } else {
        rec.state.as_str()
    })
}

/// The helper's timeout, milliseconds: the request's, else the daemon's exec timeout
/// (`None`: no timeout).
pub(super) fn timeout_ms(rt: &Runtime, requested: Option<u64>) -> Option<u64> {
    requested.or_else(|| (rt.config.exec_timeout_s > 0).then_some(rt.config.exec_timeout_s * 1000))
}

/// The command line of one `exec` helper, built flag by flag (the helper reads flags by name,
/// in any order, up to `--`).
pub(super) struct HelperCommand(Vec<OsString>);

impl HelperCommand {
    /// `belayer-helper exec` entering the init of `rec` (its user namespace, pid and start
    /// time), writing its status line to fd `status_fd` and loading the sealed seccomp
    /// program from fd `seccomp_fd`, with `--timeout-ms` when `timeout_ms` is set and the
    /// procs files of `cgroup` to join.
    pub(super) fn exec(
        rt: &Runtime,
        rec: &SandboxRecord,
        status_fd: i32,
        seccomp_fd: i32,
        timeout_ms: Option<u64>,
        cgroup: &SandboxCgroup,
    ) -> Self {
        let userns = if rec.userns.is_some() {
            "private"
        } else {
            "host"
        };
        let mut cmd = HelperCommand(vec![rt.helper.exec_path().into()]);
        for a in [HELPER_ARG, "exec", "--userns", userns] {
            cmd.arg(a);
        }
        cmd.flag("--pid", rec.init_pid.unwrap_or(0).to_string());
        cmd.flag("--start-time", rec.init_start_time.unwrap_or(0).to_string());
        cmd.flag("--status-fd", status_fd.to_string());
        cmd.flag("--seccomp-fd", seccomp_fd.to_string());
        if let Some(t) = timeout_ms {
            cmd.flag("--timeout-ms", t.to_string());
        }
        for f in cgroup.procs_files() {
            cmd.flag("--procs", f);
        }
        cmd
    }

    /// Appends one argument.
    pub(super) fn arg(&mut self, a: impl AsRef<OsStr>) {
        self.0.push(a.as_ref().to_owned());
    }

    /// Appends flag `name` with its `value`.
    pub(super) fn flag(&mut self, name: &str, value: impl AsRef<OsStr>) {
        self.arg(name);
        self.arg(value);
    }

    /// Ends the flags with `--` followed by `last`; the whole argv (program path first).
    pub(super) fn finish(mut self, last: impl AsRef<OsStr>) -> Vec<OsString> {
        self.arg("--");
        self.arg(last);
        self.0
    }
}
