//! Translating recorded actions into plain shell commands for a sandbox.
//!
//! `bash` and OpenHands `run` actions run as recorded. SWE-agent's editor commands and OpenHands
//! `read`/`edit` events are rewritten into equivalent shell (SWE-agent's editor keeps the open
//! file between actions, so the translator is stateful per trajectory). Replaying a recording in
//! a different environment makes some actions fail; that is fine for a checkpoint/restore
//! workload, which cares about the state actions leave behind, not about their success.

use super::trajectory::Step;
use belayer_ipc::shell_quote;

/// Per-trajectory translator (remembers SWE-agent's open file and window).
#[derive(Debug, Default, Clone)]
pub struct Translator {
    open_file: Option<String>,
    first_line: usize,
}

/// Lines shown by SWE-agent's `open`/`goto`/`scroll_*` window.
const WINDOW: usize = 100;

impl Translator {
    /// The shell command for `step`.
    pub fn translate(&mut self, step: &Step) -> String {
        match step.kind.as_str() {
            "sweagent-tool" => self.sweagent(step.cmd.trim_end_matches('\n')),
            "read" => {
                let path = step.cmd.strip_prefix("read ").unwrap_or("").trim();
                if path.is_empty() {
                    "true".into()
                } else {
                    let p = shell_quote(path);
                    format!("if [ -d {p} ]; then ls -la {p}; else cat -n {p} | head -n 400; fi")
                }
            }
            "edit" => openhands_edit(step),
            _ => step.cmd.clone(),
        }
    }

    fn window(&self) -> String {
        match &self.open_file {
            Some(f) => format!(
                "cat -n {} | sed -n '{},{}p'",
                shell_quote(f),
                self.first_line.max(1),
                self.first_line.max(1) + WINDOW - 1
            ),
            None => "echo 'No file open. Use the open command first.'; false".into(),
        }
    }

    fn sweagent(&mut self, cmd: &str) -> String {
        let (head, rest) = cmd.split_once(char::is_whitespace).unwrap_or((cmd, ""));
        let args = split_args(rest.lines().next().unwrap_or(""));
        let arg = |i: usize| args.get(i).map(String::as_str);
        match head {
            "open" => {
                let Some(path) = arg(0) else {
                    return "echo 'Usage: open <file> [<line>]'; false".into();
                };
                self.open_file = Some(path.to_string());
                self.first_line = arg(1)
                    .and_then(|l| l.parse::<usize>().ok())
                    .unwrap_or(1)
                    .saturating_sub(WINDOW / 2);
                self.window()
            }
            "goto" => {
                self.first_line = arg(0)
                    .and_then(|l| l.parse::<usize>().ok())
                    .unwrap_or(1)
                    .saturating_sub(WINDOW / 2);
                self.window()
            }
            "scroll_down" => {
                self.first_line += WINDOW;
                self.window()
            }
            "scroll_up" => {
                self.first_line = self.first_line.saturating_sub(WINDOW);
                self.window()
            }
            "create" => {
                let Some(path) = arg(0) else {
                    return "false".into();
                };
                self.open_file = Some(path.to_string());
                self.first_line = 1;
                format!("touch {} && {}", shell_quote(path), self.window())
            }
            "find_file" => {
                let name = arg(0).unwrap_or("*");
                let dir = arg(1).unwrap_or(".");
                format!(
                    "find {} -name {} 2>/dev/null | head -n 50",
                    shell_quote(dir),
                    shell_quote(name)
                )
            }
            "search_dir" => {
                let term = arg(0).unwrap_or("");
                let dir = arg(1).unwrap_or(".");
                format!(
                    "grep -rn -- {} {} 2>/dev/null | head -n 100",
                    shell_quote(term),
                    shell_quote(dir)
                )
            }
            "search_file" => {
                let term = arg(0).unwrap_or("");
                match arg(1)
                    .map(str::to_string)
                    .or_else(|| self.open_file.clone())
                {
                    Some(f) => format!("grep -n -- {} {}", shell_quote(term), shell_quote(&f)),
                    None => "echo 'No file open.'; false".into(),
                }
            }
            "edit" => self.sweagent_edit(cmd),
            "submit" => "git diff 2>/dev/null | head -n 200; true".into(),
            _ => cmd.to_string(),
        }
    }

    /// `edit N:M\n<replacement lines>\nend_of_edit`: replaces lines N..=M of the open file.
    fn sweagent_edit(&self, cmd: &str) -> String {
        let Some(file) = &self.open_file else {
            return "echo 'No file open. Use the open command first.'; false".into();
        };
        let mut lines = cmd.lines();
        let range = lines.next().unwrap_or("").trim_start_matches("edit").trim();
        let (a, b) = range.split_once(':').unwrap_or((range, range));
        let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) else {
            return "echo 'Usage: edit <start_line>:<end_line>'; false".into();
        };
        let body: Vec<&str> = lines.take_while(|l| l.trim() != "end_of_edit").collect();
        let mut text = body.join("\n");
        text.push('\n');
        let script = format!(
            "import sys\np = sys.argv[1]\nlines = open(p).read().splitlines(True)\n\
             new = {}\nlines[{}:{}] = [new]\nopen(p, 'w').write(''.join(lines))\n",
            py_string(&text),
            a.saturating_sub(1),
            b
        );
        format!(
            "python3 -c {} {} && {}",
            shell_quote(&script),
            shell_quote(file),
            self.window()
        )
    }
}

/// An OpenHands `edit` event: writes the lines its recorded diff added (file creation), or
/// touches the file named in the observation (replacement edits).
fn openhands_edit(step: &Step) -> String {
    let path = step
        .cmd
        .strip_prefix("edit ")
        .map(str::trim)
        .filter(|p| p.starts_with('/'))
        .map(str::to_string)
        .or_else(|| {
            step.obs_head
                .split_whitespace()
                .find(|w| w.starts_with('/'))
                .map(|w| w.trim_end_matches([',', '.', ':']).to_string())
        });
    let Some(path) = path else {
        return "true".into();
    };
    let added: Vec<&str> = step
        .obs_head
        .lines()
        .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
        .map(|l| &l[1..])
        .collect();
    let dir = std::path::Path::new(&path)
        .parent()
        .map(|d| d.display().to_string())
        .unwrap_or_else(|| "/".into());
    let content = if added.is_empty() {
        "# edited\n".to_string()
    } else {
        added.join("\n") + "\n"
    };
    format!(
        "mkdir -p {} && printf '%s' {} >> {}",
        shell_quote(&dir),
        shell_quote(&content),
        shell_quote(&path)
    )
}

/// A Python string literal for arbitrary text.
fn py_string(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Splits SWE-agent command arguments: whitespace-separated, double quotes group.
fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, cmd: &str) -> Step {
        Step {
            step: 1,
            kind: kind.into(),
            cmd: cmd.into(),
            llm_s: None,
            exec_s: None,
            rc: None,
            obs_head: String::new(),
        }
    }

    #[test]
    fn bash_runs_as_recorded() {
        assert_eq!(
            Translator::default().translate(&step("bash", "ls -la")),
            "ls -la"
        );
    }

    #[test]
    fn sweagent_editor_session_edits_the_open_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.py");
        std::fs::write(&f, "a\nb\nc\n").unwrap();
        let mut t = Translator::default();
        let open = t.translate(&step("sweagent-tool", &format!("open {}\n", f.display())));
        assert!(open.contains("cat -n"));
        let edit = t.translate(&step(
            "sweagent-tool",
            "edit 2:2\nB1\nB2 'quoted' \\x\nend_of_edit\n",
        ));
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&edit)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read_to_string(&f).unwrap(),
            "a\nB1\nB2 'quoted' \\x\nc\n"
        );
        let find = t.translate(&step("sweagent-tool", "find_file \"m.py\" /tmp\n"));
        assert_eq!(find, "find /tmp -name m.py 2>/dev/null | head -n 50");
    }

    #[test]
    fn openhands_edit_writes_the_added_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/game.py");
        let mut s = step("edit", &format!("edit {}", path.display()));
        s.obs_head = format!(
            "--- {p}\n+++ {p}\n@@ -0,0 +1,2 @@\n+import random\n+x = 'it''s'\n",
            p = path.display()
        );
        let cmd = Translator::default().translate(&s);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "import random\nx = 'it''s'\n"
        );
    }

    #[test]
    fn args_split_on_quotes() {
        assert_eq!(split_args("\"a b\" c"), vec!["a b", "c"]);
        assert_eq!(split_args(""), Vec::<String>::new());
    }
}
