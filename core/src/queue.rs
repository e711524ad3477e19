//! The admission queue of one worker: requests of `queue` classes that did not fit wait here,
//! bounded per class, and are retried in priority then arrival order; past their class's
//! `max_wait_ms` they are answered 429 with a reason.
//!
//! Pure bookkeeping: the filter keeps one per worker and owns what each entry points to.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<T> {
    pub item: T,
    pub class: String,
    pub priority: u8,
    pub seq: u64,
    pub deadline_ms: u64,
}

#[derive(Debug, Clone)]
pub struct AdmissionQueue<T> {
    entries: Vec<Entry<T>>,
    next_seq: u64,
}

impl<T> Default for AdmissionQueue<T> {
    fn default() -> Self {
        AdmissionQueue {
            entries: Vec::new(),
            next_seq: 0,
        }
    }
}

impl<T> AdmissionQueue<T> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn depth(&self, class: &str) -> usize {
        self.entries.iter().filter(|e| e.class == class).count()
    }

    /// Enqueue unless the class already has `max_depth` waiting; gives the item back if full.
    pub fn push(
        &mut self,
        item: T,
        class: &str,
        priority: u8,
        deadline_ms: u64,
        max_depth: u32,
    ) -> Result<(), T> {
        if self.depth(class) >= max_depth as usize {
            return Err(item);
        }
        self.next_seq += 1;
        self.entries.push(Entry {
            item,
            class: class.to_string(),
            priority,
            seq: self.next_seq,
            deadline_ms,
        });
        // Highest priority first, then arrival order.
        self.entries
            .sort_by(|a, b| b.priority.cmp(&a.priority).then(a.seq.cmp(&b.seq)));
        Ok(())
    }

    /// Remove and return every entry whose deadline has passed.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Entry<T>> {
        let (expired, keep) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.deadline_ms <= now_ms);
        self.entries = keep;
        expired
    }

    /// The entry to try next.
    pub fn front(&self) -> Option<&Entry<T>> {
        self.entries.first()
    }

    pub fn pop_front(&mut self) -> Option<Entry<T>> {
        if self.entries.is_empty() {
            None
        } else {
            Some(self.entries.remove(0))
        }
    }

    /// The waiting items, front first.
    pub fn items(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|e| &e.item)
    }

    /// Remove entries matching `f` (e.g. a client that went away).
    pub fn remove_where(&mut self, mut f: impl FnMut(&T) -> bool) -> Vec<Entry<T>> {
        let (gone, keep) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| f(&e.item));
        self.entries = keep;
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_then_arrival_bounded_per_class_with_deadlines() {
        let mut q = AdmissionQueue::default();
        q.push("batch-1", "batch", 0, 1000, 2).unwrap();
        q.push("vip-1", "vip", 9, 500, 2).unwrap();
        q.push("batch-2", "batch", 0, 2000, 2).unwrap();
        assert_eq!(
            q.push("batch-3", "batch", 0, 2000, 2),
            Err("batch-3"),
            "class full"
        );
        q.push("vip-2", "vip", 9, 3000, 2).unwrap();
        let order: Vec<_> = q.entries.iter().map(|e| e.item).collect();
        assert_eq!(order, vec!["vip-1", "vip-2", "batch-1", "batch-2"]);
        let expired: Vec<_> = q.expire(1000).into_iter().map(|e| e.item).collect();
        assert_eq!(expired, vec!["vip-1", "batch-1"]);
        assert_eq!(q.pop_front().map(|e| e.item), Some("vip-2"));
        assert_eq!(q.remove_where(|i| *i == "batch-2").len(), 1);
        assert!(q.is_empty());
    }
}
