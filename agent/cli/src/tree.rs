//! `belayer checkpoint ls ID --tree`: a sandbox's checkpoints drawn as their tree (each under
//! its parent, the ready one marked).

use std::collections::HashMap;
use std::fmt::Write as _;

use belayer_ipc::CheckpointInfo;

/// The tree of `list` as text, one checkpoint per line, children in publication order under
/// their parent. Roots are the checkpoints without a parent or whose parent is not listed
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
    let mut out = String::new();
    for (n, &root) in roots.iter().enumerate() {
        draw(
            list,
            &children,
            root,
            "",
            n + 1 == roots.len(),
            true,
            &mut out,
        );
    }
    out
}

fn draw(
    list: &[CheckpointInfo],
    children: &HashMap<usize, Vec<usize>>,
    node: usize,
    indent: &str,
    last: bool,
    root: bool,
    out: &mut String,
) {
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
        (true, _) => indent.to_string(),
        (false, true) => format!("{indent}   "),
        (false, false) => format!("{indent}│  "),
    };
    let kids = children.get(&node).map(Vec::as_slice).unwrap_or(&[]);
    for (n, &kid) in kids.iter().enumerate() {
        draw(list, children, kid, &inner, n + 1 == kids.len(), false, out);
    }
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
    fn branches_are_drawn_under_their_parent() {
        let list = [
            cp("c1", 1, None, false),
            cp("c2", 2, Some("c1"), false),
            cp("c3", 3, Some("c2"), false),
            cp("c4", 3, Some("c2"), true),
            cp("c5", 2, Some("c1"), false),
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
                "c7  k=9  0 bytes",
            ],
            "{text}"
        );
    }
}
