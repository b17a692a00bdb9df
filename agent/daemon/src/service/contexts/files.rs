//! The bounded set of context-log files the daemon holds open: least recently used first out.

use std::collections::HashMap;
use std::fs::File;
use std::hash::Hash;
use std::sync::Arc;

/// At most `max` open files, each under its key; inserting past `max` drops the least recently
/// used one from the set.
///
/// A file dropped from the set closes when its last user is done with it (users hold an
/// `Arc`), so the descriptors the daemon holds for logs are at most `max` plus one per
/// operation in flight.
#[derive(Debug)]
pub(super) struct OpenLogs<K> {
    max: usize,
    tick: u64,
    files: HashMap<K, (Arc<File>, u64)>,
}

impl<K: Hash + Eq + Clone> OpenLogs<K> {
    /// An empty set of at most `max` (at least 1) files.
    pub(super) fn new(max: usize) -> Self {
        OpenLogs {
            max: max.max(1),
            tick: 0,
            files: HashMap::new(),
        }
    }

    /// The open file of `key`, now the most recently used.
    pub(super) fn get(&mut self, key: &K) -> Option<Arc<File>> {
        self.tick += 1;
        let tick = self.tick;
        self.files.get_mut(key).map(|(file, used)| {
            *used = tick;
            Arc::clone(file)
        })
    }

    /// Keeps `file` open under `key` (replacing another one of that key), first dropping the
    /// least recently used files while the set is full.
    pub(super) fn insert(&mut self, key: K, file: Arc<File>) {
        self.files.remove(&key);
        while self.files.len() >= self.max {
            let Some(oldest) = self
                .files
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.files.remove(&oldest);
        }
        self.tick += 1;
        self.files.insert(key, (file, self.tick));
    }

    /// Drops the file of `key` from the set (it closes when its last user is done with it).
    pub(super) fn remove(&mut self, key: &K) {
        self.files.remove(key);
    }

    /// Number of files held.
    pub(super) fn len(&self) -> usize {
        self.files.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Arc<File> {
        Arc::new(File::open("/dev/null").unwrap())
    }

    #[test]
    fn the_least_recently_used_file_goes_first() {
        let mut open = OpenLogs::new(2);
        open.insert("a", file());
        open.insert("b", file());
        assert!(open.get(&"a").is_some(), "a is now the most recent");
        open.insert("c", file());
        assert_eq!(open.len(), 2);
        assert!(open.get(&"b").is_none(), "b was the least recently used");
        assert!(open.get(&"a").is_some() && open.get(&"c").is_some());
        // Re-inserting a key replaces it without evicting another.
        open.insert("c", file());
        assert_eq!(open.len(), 2);
        assert!(open.get(&"a").is_some());
    }

    #[test]
    fn a_file_in_use_outlives_its_eviction_and_then_closes() {
        let mut open = OpenLogs::new(1);
        let a = file();
        open.insert("a", Arc::clone(&a));
        let in_use = open.get(&"a").unwrap();
        open.insert("b", file());
        assert!(open.get(&"a").is_none());
        assert_eq!(Arc::strong_count(&a), 2, "the test's and the user's");
        drop(in_use);
        assert_eq!(Arc::strong_count(&a), 1, "the set holds it no more");
        assert_eq!(OpenLogs::<u8>::new(0).max, 1);
    }

    #[test]
    fn a_removed_file_is_no_longer_held() {
        let mut open = OpenLogs::new(2);
        let a = file();
        open.insert("a", Arc::clone(&a));
        open.insert("b", file());
        open.remove(&"a");
        open.remove(&"never");
        assert!(open.get(&"a").is_none());
        assert_eq!((open.len(), Arc::strong_count(&a)), (1, 1));
    }
}
