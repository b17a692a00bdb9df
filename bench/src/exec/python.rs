//! The Python rows of `belayer-bench exec`: one `python3 -c SCRIPT` that times
//! `subprocess.run`, mini-swe-agent's `LocalEnvironment.execute` and `belayer.Client.exec` in
//! turn (a block of calls of each per round, so load on the machine falls on all of them alike;
//! warm-up calls first) with `time.perf_counter`, and prints one JSON object on its last line
//! of output: each row's samples in milliseconds, or the error that kept it from running.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};

/// `sys.argv[1..]`: runs, warm-up calls, block, the command, the socket, the sandbox id.
const SCRIPT: &str = r#"
import json, os, subprocess, sys, time
runs, warmup, block = int(sys.argv[1]), int(sys.argv[2]), max(1, int(sys.argv[3]))
cmd, socket, sid = sys.argv[4], sys.argv[5], sys.argv[6]
rows, errors = {}, {}

def python_subprocess():
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd!r} exited {r.returncode}")
rows["python_subprocess"] = python_subprocess

try:
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from minisweagent.environments.local import LocalEnvironment
    local = LocalEnvironment()
    def minisweagent_local():
        r = local.execute({"command": cmd})
        if r["returncode"] != 0:
            raise RuntimeError(f"{cmd!r} exited {r['returncode']}")
    rows["minisweagent_local"] = minisweagent_local
except Exception as e:
    errors["minisweagent_local"] = f"cannot load mini-swe-agent: {e!r}"

try:
    import belayer
    client = belayer.Client(socket)
    def belayer_python():
        r = client.exec(sid, cmd)
        if r.exit_code != 0:
            raise RuntimeError(f"{cmd!r} exited {r.exit_code}")
    rows["belayer_python"] = belayer_python
except Exception as e:
    errors["belayer_python"] = f"cannot load the belayer package: {e!r}"

samples = {name: [] for name in rows}

def calls(name, count, timed):
    for _ in range(count):
        if name not in rows:
            return
        try:
            t = time.perf_counter()
            rows[name]()
            ms = (time.perf_counter() - t) * 1000.0
        except Exception as e:
            errors[name] = repr(e)
            del rows[name], samples[name]
            return
        if timed:
            samples[name].append(ms)

for name in list(rows):
    calls(name, warmup, False)
done = 0
while done < runs:
    k = min(block, runs - done)
    for name in list(rows):
        calls(name, k, True)
    done += k
print(json.dumps({"samples": samples, "errors": errors}))
"#;

/// How the Python rows are run.
#[derive(Debug)]
pub struct Runner<'a> {
    /// The interpreter.
    pub python: &'a Path,
    /// Directory put first on `PYTHONPATH` (the `belayer` package's parent).
    pub package: Option<&'a Path>,
    /// `libbelayer.so` (as `BELAYER_LIB`).
    pub lib: Option<PathBuf>,
    /// Timed calls of each row.
    pub runs: usize,
    /// Untimed calls of each row first.
    pub warmup: usize,
    /// Calls of one row before the next row's.
    pub block: usize,
}

/// Samples (milliseconds) or the error of each Python row, by row name.
pub type Rows = BTreeMap<String, Result<Vec<f64>>>;

#[derive(serde::Deserialize)]
struct Output {
    samples: BTreeMap<String, Vec<f64>>,
    errors: BTreeMap<String, String>,
}

impl Runner<'_> {
    /// Runs the script against sandbox `id` of the daemon at `socket`, timing `cmd`.
    pub fn run(&self, socket: &Path, id: &str, cmd: &str) -> Result<Rows> {
        let mut c = Command::new(self.python);
        c.arg("-c")
            .arg(SCRIPT)
            .arg(self.runs.to_string())
            .arg(self.warmup.to_string())
            .arg(self.block.to_string())
            .arg(cmd)
            .arg(socket)
            .arg(id)
            .stdin(std::process::Stdio::null());
        if let Some(dir) = self.package {
            let mut path = dir.as_os_str().to_owned();
            if let Some(old) = std::env::var_os("PYTHONPATH") {
                path.push(":");
                path.push(old);
            }
            c.env("PYTHONPATH", path);
        }
        if let Some(lib) = &self.lib {
            c.env("BELAYER_LIB", lib);
        }
        let out = c
            .output()
            .with_context(|| format!("running {}", self.python.display()))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or_default();
            bail!("{} exited {}: {last}", self.python.display(), out.status);
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout.lines().last().unwrap_or_default();
        let parsed: Output =
            serde_json::from_str(last).with_context(|| format!("parsing the samples {last:?}"))?;
        let mut rows: Rows = parsed
            .samples
            .into_iter()
            .map(|(k, v)| (k, Ok(v)))
            .collect();
        for (k, e) in parsed.errors {
            rows.insert(k, Err(anyhow!(e)));
        }
        Ok(rows)
    }
}
