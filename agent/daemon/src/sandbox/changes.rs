//! Whether a sandbox changed since its ready checkpoint: the dirtiness the checkpoint policy
//! reads for [`Request::MaybeCheckpoint`](belayer_ipc::Request) (paper: Algorithm 1, the
//! clean-step skip).
//!
//! Every verb that changes what the ready state is updates it under the sandbox's op lock: a
//! creation, a published checkpoint and a successful restore make the sandbox clean (its state
//! is the image's, or the ready checkpoint's); each action adds its tracer verdict
//! ([`ExecResult::dirty`](belayer_ipc::ExecResult)). An action without a verdict (the tracer
//! could not tell, or the action failed) makes it unknown until the next checkpoint, unless it
//! was dirty already; so does adoption by a restarted `belayerd`, which has no record of what
//! ran before. Only a known-clean sandbox lets the policy skip as `clean`.

use std::sync::Mutex;

/// The sandbox's changes since its ready checkpoint (or creation, or restore).
#[derive(Debug, Default)]
pub struct Changes {
    /// `Some(false)`: nothing changed; `Some(true)`: something did; `None`: unknown.
    state: Mutex<Option<bool>>,
}

impl Changes {
    /// A tracker in the unknown state (an adopted sandbox).
    pub fn unknown() -> Changes {
        Changes::default()
    }

    /// A tracker of a sandbox whose state is its ready state (just created).
    pub fn clean() -> Changes {
        Changes {
            state: Mutex::new(Some(false)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<bool>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state is now the ready one (a checkpoint was published, or a restore finished).
    pub fn mark_clean(&self) {
        *self.lock() = Some(false);
    }

    /// The state is unknown (a restore failed half-way).
    pub fn forget(&self) {
        *self.lock() = None;
    }

    /// An action starts: the state is unknown until [`Self::end_action`] (an action that
    /// fails half-way leaves it so, or dirty if it was). Returns the state before, for
    /// [`Self::end_action`].
    pub fn begin_action(&self) -> Option<bool> {
        let mut s = self.lock();
        let before = *s;
        *s = before.filter(|dirty| *dirty);
        before
    }

    /// The action begun when the state was `before` ended with the tracer's verdict `dirty`
    /// (`Some(true)` dirty, `Some(false)` clean, `None` unknown).
    pub fn end_action(&self, before: Option<bool>, dirty: Option<bool>) {
        *self.lock() = match (before, dirty) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        };
    }

    /// Whether the sandbox changed since its ready state (`None`: unknown).
    pub fn since_ready(&self) -> Option<bool> {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_accumulate_until_the_next_checkpoint() {
        let act = |c: &Changes, dirty| {
            let before = c.begin_action();
            c.end_action(before, dirty);
        };
        let c = Changes::clean();
        act(&c, Some(false));
        assert_eq!(c.since_ready(), Some(false));
        act(&c, Some(true));
        act(&c, Some(false));
        act(&c, None);
        assert_eq!(c.since_ready(), Some(true), "dirty stays dirty");
        c.mark_clean();
        act(&c, None);
        assert_eq!(c.since_ready(), None, "no verdict: unknown");
        act(&c, Some(false));
        assert_eq!(
            c.since_ready(),
            None,
            "a clean step does not make unknown clean"
        );
        c.mark_clean();
        let _ = c.begin_action();
        assert_eq!(
            c.since_ready(),
            None,
            "an action that never ends leaves it unknown"
        );
        let adopted = Changes::unknown();
        act(&adopted, Some(false));
        assert_eq!(adopted.since_ready(), None);
    }
}
