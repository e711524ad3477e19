//! The admission queue of one worker: requests of `queue` classes that did not fit wait here,
//! bounded per class, and are retried in priority then arrival order, with aging; past their
//! class's `max_wait_ms` they are answered 429 with a reason.
//!
//! Aging: waiting `aging_ms` is worth one priority level, so an entry's place is set by
//! `arrived_ms − priority × aging_ms` (earlier first; ties by arrival). That is the same order
//! as "priority plus time waited / aging_ms, highest first" at every instant, but fixed at push,
//! so the queue stays sorted without re-sorting on each tick. The bound it gives: a request is
//! never passed by one that arrived more than `(its priority gap) × aging_ms` after it, so a
//! low class waits behind a stream of higher ones for a bounded time instead of forever.
//! `aging_ms = 0` is strict priority.
//!
//! Pure bookkeeping: the filter keeps one per worker and owns what each entry points to.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<T> {
    pub item: T,
    pub class: String,
    pub priority: u8,
    pub seq: u64,
    pub arrived_ms: u64,
    pub deadline_ms: u64,
}

/// What a queued request waits as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting<'a> {
    pub class: &'a str,
    pub priority: u8,
    pub arrived_ms: u64,
    pub deadline_ms: u64,
    pub max_depth: u32,
}

#[derive(Debug, Clone)]
pub struct AdmissionQueue<T> {
    entries: Vec<Entry<T>>,
    next_seq: u64,
    aging_ms: u64,
}

impl<T> Default for AdmissionQueue<T> {
    fn default() -> Self {
        AdmissionQueue {
            entries: Vec::new(),
            next_seq: 0,
            aging_ms: 0,
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

    /// Whether a request of `class` refused now would wait here: its class queues and has
    /// room. Its place in line is then one whose client is present (`ClaimTicket::waits`).
    pub fn would_wait(&self, class: &crate::policy::ClassPolicy) -> bool {
        match class.action {
            crate::policy::Action::Queue { max_depth, .. } => {
                self.depth(&class.name) < max_depth as usize
            }
            _ => false,
        }
    }

    /// How long a wait is worth one priority level (0: strict priority). A change re-sorts.
    pub fn set_aging_ms(&mut self, aging_ms: u64) {
        if aging_ms != self.aging_ms {
            self.aging_ms = aging_ms;
            self.sort();
        }
    }

    /// Enqueue unless the class already has `max_depth` waiting; gives the item back if full.
    pub fn push(&mut self, item: T, w: Waiting<'_>) -> Result<(), T> {
        if self.depth(w.class) >= w.max_depth as usize {
            return Err(item);
        }
        self.next_seq += 1;
        self.entries.push(Entry {
            item,
            class: w.class.to_string(),
            priority: w.priority,
            seq: self.next_seq,
            arrived_ms: w.arrived_ms,
            deadline_ms: w.deadline_ms,
        });
        self.sort();
        Ok(())
    }

    /// Earliest aged arrival first (highest priority first without aging), then arrival, then
    /// push order. An arrival may be earlier than the push: a retry keeps its first refusal's.
    fn sort(&mut self) {
        let aging = i128::from(self.aging_ms);
        let key = |e: &Entry<T>| match aging {
            0 => 0,
            a => i128::from(e.arrived_ms) - i128::from(e.priority) * a,
        };
        self.entries.sort_by(|a, b| {
            key(a)
                .cmp(&key(b))
                .then(b.priority.cmp(&a.priority))
                .then(a.arrived_ms.cmp(&b.arrived_ms))
                .then(a.seq.cmp(&b.seq))
        });
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

    fn at<'a>(class: &'a str, priority: u8, arrived_ms: u64, deadline_ms: u64) -> Waiting<'a> {
        Waiting {
            class,
            priority,
            arrived_ms,
            deadline_ms,
            max_depth: 8,
        }
    }

    fn order(q: &AdmissionQueue<&'static str>) -> Vec<&'static str> {
        q.items().copied().collect()
    }

    #[test]
    fn priority_then_arrival_bounded_per_class_with_deadlines() {
        let mut q = AdmissionQueue::default();
        q.push("batch-1", at("batch", 0, 0, 1000)).unwrap();
        q.push("vip-1", at("vip", 9, 0, 500)).unwrap();
        q.push("batch-2", at("batch", 0, 0, 2000)).unwrap();
        assert_eq!(
            q.push(
                "batch-3",
                Waiting {
                    max_depth: 2,
                    ..at("batch", 0, 0, 2000)
                }
            ),
            Err("batch-3"),
            "class full"
        );
        q.push("vip-2", at("vip", 9, 0, 3000)).unwrap();
        assert_eq!(order(&q), vec!["vip-1", "vip-2", "batch-1", "batch-2"]);
        let expired: Vec<_> = q.expire(1000).into_iter().map(|e| e.item).collect();
        assert_eq!(expired, vec!["vip-1", "batch-1"]);
        assert_eq!(q.pop_front().map(|e| e.item), Some("vip-2"));
        assert_eq!(q.remove_where(|i| *i == "batch-2").len(), 1);
        assert!(q.is_empty());
    }

    #[test]
    fn a_long_wait_outranks_priority_one_level_per_aging_interval() {
        let mut q = AdmissionQueue::default();
        q.set_aging_ms(1_000);
        q.push("batch", at("batch", 0, 0, 60_000)).unwrap();
        // Higher classes that arrive within their priority gap's worth of aging go first...
        q.push("vip-early", at("vip", 9, 8_999, 60_000)).unwrap();
        q.push("std-early", at("std", 1, 999, 60_000)).unwrap();
        // ...those that arrive later queue behind the batch request, however high.
        q.push("vip-late", at("vip", 9, 9_002, 60_000)).unwrap();
        q.push("std-late", at("std", 1, 1_001, 60_000)).unwrap();
        assert_eq!(
            order(&q),
            vec!["vip-early", "std-early", "batch", "std-late", "vip-late"]
        );
        // A tie in aged arrival goes to the higher priority.
        q.push("vip-tie", at("vip", 9, 9_000, 60_000)).unwrap();
        assert_eq!(order(&q)[2..4], ["vip-tie", "batch"]);
        // Strict priority again: every vip first, whenever it came.
        q.set_aging_ms(0);
        assert_eq!(
            order(&q),
            vec![
                "vip-early",
                "vip-tie",
                "vip-late",
                "std-early",
                "std-late",
                "batch"
            ]
        );
    }
}
