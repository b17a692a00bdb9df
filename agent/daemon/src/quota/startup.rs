//! The daemon's disk-quota policy at start.

use std::path::Path;

use super::{QuotaError, QuotaFs, QuotaMode};

/// Opens the quota domain of the state dir for `belayerd`.
///
/// - `default_limit > 0`: the state dir must enforce quotas. Quotas off on btrfs are turned on
///   ([`QuotaFs::enable`], simple quotas); anything else is an error: the daemon never runs
///   sandboxes silently without their limit.
/// - `default_limit == 0`: logged as a warning. Quotas already on are used (for sandboxes
///   whose spec asks for a `disk_max`); they are not turned on, and without them such
///   sandboxes are refused ([`super::make_instance_dir`] answers
///   [`QuotaError::Unavailable`]). Returns `Ok(None)` then.
///
/// Stale qgroups of subvolumes deleted before are counted in the log, never removed
/// ([`QuotaFs::stale_qgroups`] says why).
///
/// Errors: those of [`QuotaFs::enable`], only when `default_limit > 0`.
pub fn open_state_quota(
    state_dir: &Path,
    default_limit: u64,
) -> Result<Option<QuotaFs>, QuotaError> {
    let quota = if default_limit == 0 {
        tracing::warn!(
            state_dir = %state_dir.display(),
            "default_disk_max_bytes = 0: sandboxes without disk_max have no disk limit"
        );
        match QuotaFs::probe(state_dir) {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!(error = %e, "no disk quota: sandboxes asking for disk_max are refused");
                return Ok(None);
            }
        }
    } else {
        QuotaFs::enable(state_dir)?
    };
    if quota.mode() == QuotaMode::Full {
        tracing::warn!(
            state_dir = %state_dir.display(),
            "full btrfs qgroups are on: deleting volumes that share extents costs about 10x \
             simple quotas (btrfs quota disable, then let belayerd enable simple quotas)"
        );
    }
    if quota.inconsistent() {
        tracing::warn!(
            state_dir = %state_dir.display(),
            "btrfs qgroup numbers are flagged inconsistent: limits act on stale usage until a \
             rescan (btrfs quota rescan)"
        );
    }
    match quota.stale_qgroups() {
        Ok(0) => {}
        Ok(n) => tracing::info!(stale = n, "stale qgroups of deleted subvolumes (kept)"),
        Err(e) => tracing::warn!(error = %e, "cannot read qgroups"),
    }
    tracing::info!(
        state_dir = %state_dir.display(),
        mode = ?quota.mode(),
        default_disk_max_bytes = default_limit,
        "disk quotas enforced"
    );
    Ok(Some(quota))
}
