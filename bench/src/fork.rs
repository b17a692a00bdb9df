//! Fork ×N of a workload's sandbox (paper §"Environment-state recovery"; the goal: all
//! N children running within 120 ms for the busybox loop): `runs` forks of N children from
//! the sandbox's ready checkpoint, each timed from the request until every child ran (the
//! daemon's `ForkInfo.total_ms` and the client's wall clock), the children removed after each.

use std::time::Instant;

use anyhow::{bail, Result};
use belayer_cli::client::call;
use belayer_ipc::{Client, ForkRequest, Request, Response};
use serde::Serialize;

use crate::median;

/// Medians of `runs` forks, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ForkMedians {
    /// Children per fork.
    pub count: u32,
    /// Forks measured.
    pub runs: usize,
    /// Median of the daemon's total (request until every child ran).
    pub total_ms: f64,
    /// Median of the client's wall-clock time of the request.
    pub wall_ms: f64,
    /// Median of every child's own restore.
    pub child_restore_ms: f64,
}

/// Forks sandbox `id` (which has a ready checkpoint) `runs` times into `count` children,
/// removing them after each fork.
///
/// Errors: a fork or a removal that fails.
pub(crate) fn fork_cycles(
    c: &mut Client,
    id: &str,
    count: u32,
    runs: usize,
) -> Result<ForkMedians> {
    let (mut total, mut wall, mut child) = (vec![], vec![], vec![]);
    for _ in 0..runs {
        let req = ForkRequest {
            id: id.into(),
            count,
            ..Default::default()
        };
        let t = Instant::now();
        let info = match call(c, Request::Fork(req))? {
            Response::Forked(f) => f,
            r => bail!("unexpected answer to a fork: {r:?}"),
        };
        wall.push(t.elapsed().as_secs_f64() * 1000.0);
        total.push(info.total_ms);
        child.extend(info.children.iter().map(|r| r.timings_ms.total));
        for r in &info.children {
            match call(
                c,
                Request::RemoveSandbox {
                    id: r.sandbox.clone(),
                },
            )? {
                Response::Done => {}
                r => bail!("unexpected answer to a removal: {r:?}"),
            }
        }
    }
    Ok(ForkMedians {
        count,
        runs,
        total_ms: median(&mut total),
        wall_ms: median(&mut wall),
        child_restore_ms: median(&mut child),
    })
}
