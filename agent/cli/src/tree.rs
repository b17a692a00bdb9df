//! `belayer checkpoint ls ID --tree`: a sandbox's checkpoints drawn as their tree (each under
//! its parent, the ready one marked).

use std::collections::HashMap;
use std::fmt::Write as _;

use belayer_ipc::CheckpointInfo;

/// The tree of `list` as text, one checkpoint per line, children in publication order under
/// their parent; where a checkpoint has one child only, the child goes on at its level (so
/// a long line without forks stays flat), and a fork indents its branches. Roots are the checkpoints without a parent or whose parent is not listed
/// (removed by gc).
pub fn render(list: &[CheckpointInfo]) -> String {
    let names: HashMap<&str, usize> = list
        .iter()
        .enumerate()
        .map(|(i, c)| (c.checkpoint.as_str(), i))
        .collect();
    let mut children: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut roots = Vec::new();
    for (i, c) in list.iter().enumerate() {
        match c.parent.as_deref().and_then(|p| names.get(p)) {
            // A parent is always published before its child; anything else is a root.
            Some(&p) if p < i => children.entry(p).or_default().push(i),
            _ => roots.push(i),
        }
    }
    // Depth first with an explicit stack (a line of thousands of checkpoints is deep):
    // (node, indent of its line, last among its siblings, a root).
    let mut out = String::new();
    let mut stack: Vec<(usize, String, bool, bool)> = roots
        .iter()
        .enumerate()
        .rev()
        .map(|(n, &r)| (r, String::new(), n + 1 == roots.len(), true))
        .collect();
    while let Some((node, indent, last, root)) = stack.pop() {
        let c = &list[node];
        let branch = match (root, last) {
            (true, _) => "",
            (false, true) => "└─ ",
            (false, false) => "├─ ",
        };
        let ready = if c.ready { "  (ready)" } else { "" };
        let _ = writeln!(
            out,
            "{indent}{branch}{}  k={}  {} bytes{ready}",
            c.checkpoint, c.prefix, c.bytes
        );
        let inner = match (root, last) {
            (true, _) => indent,
            (false, true) => format!("{indent}   "),
            (false, false) => format!("{indent}│  "),
        };
        let kids = children.get(&node).map(Vec::as_slice).unwrap_or(&[]);
        if let [only] = kids {
            // A line without a fork goes on under its first checkpoint, not deeper.
            stack.push((*only, inner, true, true));
            continue;
        }
        for (n, &kid) in kids.iter().enumerate().rev() {
            stack.push((kid, inner.clone(), n + 1 == kids.len(), false));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cp(name: &str, prefix: u64, parent: Option<&str>, ready: bool) -> CheckpointInfo {
        CheckpointInfo {
            checkpoint: name.into(),
            prefix,
            parent: parent.map(Into::into),
            ready,
            ..Default::default()
        }
    }

    #[test]
    fn a_long_line_is_drawn_without_recursion() {
        let names: Vec<String> = (1..=20_000).map(|i| format!("c{i}")).collect();
        let list: Vec<CheckpointInfo> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                cp(
                    n,
                    i as u64,
                    i.checked_sub(1).map(|p| names[p].as_str()),
                    false,
                )
            })
            .collect();
        assert_eq!(render(&list).lines().count(), 20_000);
    }

    #[test]
    fn branches_are_drawn_under_their_parent() {
        let list = [
            cp("c1", 1, None, false),
            cp("c2", 2, Some("c1"), false),
            cp("c3", 3, Some("c2"), false),
            cp("c4", 3, Some("c2"), true),
            cp("c5", 2, Some("c1"), false),
            cp("c6", 3, Some("c5"), false),
            cp("c7", 9, Some("gone"), false),
        ];
        let text = render(&list);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "c1  k=1  0 bytes",
                "├─ c2  k=2  0 bytes",
                "│  ├─ c3  k=3  0 bytes",
                "│  └─ c4  k=3  0 bytes  (ready)",
                "└─ c5  k=2  0 bytes",
                "   c6  k=3  0 bytes",
                "c7  k=9  0 bytes",
            ],
            "{text}"
        );
    }
}
