//! Which tasks of a dump were stopped (`SIGSTOP`, `SIGTSTP`, ...) when it was taken.
//!
//! A restore that leaves the tree stopped (`--leave-stopped`, used to list the tree before it
//! runs) must afterwards continue only the tasks that were running at dump time: a task the
//! sandbox had stopped itself stays stopped, as a plain CRIU restore leaves it.
//!
//! Fields used (CRIU `images/pstree.proto`, `core.proto`): `pstree.img` entry 1 `pid` (the
//! task's pid in the dumped tree's pid namespace); `core-<pid>.img` (type magic
//! `0x55053847`), core entry 3 `tc`, task core 1 `task_state` (1 alive, 3 stopped, ...).

use std::path::Path;

use super::error::{read_optional, ImageReadError};
use super::wire::{Fields, WireError};

/// `pstree.img` type magic.
const PSTREE_MAGIC: u32 = 0x5027_3030;
/// `core-<pid>.img` type magic.
const CORE_MAGIC: u32 = 0x5505_3847;
/// `TASK_STOPPED` (`compel/include/uapi/task-state.h`).
const TASK_STOPPED: u32 = 3;

/// Pids (in the dumped tree's pid namespace) of the tasks in `images_dir` that were stopped at
/// dump time, in pstree order; none without a `pstree.img`.
///
/// Errors: [`ImageReadError`] when `pstree.img` or a task's `core-<pid>.img` cannot be read or
/// decoded (a task without its core image is one).
pub fn stopped_tasks(images_dir: &Path) -> Result<Vec<u32>, ImageReadError> {
    let pstree = images_dir.join("pstree.img");
    let Some(image) = read_optional(&pstree, PSTREE_MAGIC)? else {
        return Ok(Vec::new());
    };
    let mut stopped = Vec::new();
    for (base, msg) in image.entries() {
        let pid = first_u32(msg, base, 1).map_err(|w| ImageReadError::wire(&pstree, w))?;
        let Some(pid) = pid else {
            return Err(ImageReadError::wire(
                &pstree,
                WireError {
                    offset: base,
                    what: "pstree entry without a pid",
                },
            ));
        };
        let core = images_dir.join(format!("core-{pid}.img"));
        let Some(core_image) = read_optional(&core, CORE_MAGIC)? else {
            return Err(ImageReadError {
                path: core,
                what: "missing: a task of pstree.img has no core image".into(),
            });
        };
        let state = core_image
            .entries()
            .next()
            .map(|(base, msg)| task_state(msg, base))
            .transpose()
            .map_err(|w| ImageReadError::wire(&core, w))?
            .flatten();
        if state == Some(TASK_STOPPED) {
            stopped.push(pid);
        }
    }
    Ok(stopped)
}

/// `tc.task_state` of a core entry, `None` when absent.
fn task_state(msg: &[u8], base: u64) -> Result<Option<u32>, WireError> {
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        if n == 3 {
            let at = it.offset();
            let tc = v.bytes().ok_or(WireError {
                offset: at,
                what: "task core of the wrong type",
            })?;
            return first_u32(tc, at, 1);
        }
    }
    Ok(None)
}

/// The first varint field `field` of a message, `None` when absent.
fn first_u32(msg: &[u8], base: u64, field: u32) -> Result<Option<u32>, WireError> {
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        if n == field {
            return v.u32().map(Some).ok_or(WireError {
                offset: it.offset(),
                what: "field of the wrong type",
            });
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::{enc, write_image};

    fn task(dir: &Path, pid: u64, state: u64) -> Vec<u8> {
        let tc = enc(&[(1, Ok(state)), (2, Ok(0))]);
        write_image(
            dir,
            &format!("core-{pid}.img"),
            CORE_MAGIC,
            &[enc(&[(1, Ok(1)), (3, Err(&tc))])],
        );
        enc(&[(1, Ok(pid)), (2, Ok(1)), (3, Ok(1)), (4, Ok(1))])
    }

    #[test]
    fn lists_the_stopped_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let entries = vec![
            task(dir.path(), 1, 1),
            task(dir.path(), 7, 3),
            task(dir.path(), 9, 1),
            task(dir.path(), 12, 3),
        ];
        write_image(dir.path(), "pstree.img", PSTREE_MAGIC, &entries);
        assert_eq!(stopped_tasks(dir.path()).unwrap(), [7, 12]);
    }

    #[test]
    fn no_pstree_means_none_stopped() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(stopped_tasks(dir.path()).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn a_task_without_core_or_garbage_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let pid3 = enc(&[(1, Ok(3))]);
        write_image(dir.path(), "pstree.img", PSTREE_MAGIC, &[pid3]);
        assert!(stopped_tasks(dir.path()).is_err());
        std::fs::write(
            dir.path().join("core-3.img"),
            b"\x19\x43\x56\x54\x47\x38\x05\x55\xff",
        )
        .unwrap();
        assert!(stopped_tasks(dir.path()).is_err());
    }
}
