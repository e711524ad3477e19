//! The ledger in a shared key-value store with compare-and-swap (Envoy shared data).
//!
//! `transact` is the only way the ledger changes: read (value + CAS token) → decode → run one
//! pure transition → encode → write with the CAS token. A CAS mismatch means another worker won
//! the race; the transition is re-run on fresh state, at most `max_attempts` times. Deciding and
//! reserving therefore happen in one atomic step that every worker sees.
//!
//! Envoy's host ignores the CAS token when the key does not exist yet, so the key must be seeded
//! (`seed`) before the first transaction.

use crate::codec::DecodeError;
use crate::ledger::Ledger;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The host call itself failed.
    Host(String),
    /// The key has not been seeded.
    Missing,
    /// The stored bytes are not a ledger.
    Corrupt(DecodeError),
    /// Every attempt lost its CAS race.
    Contended { attempts: u32 },
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Host(s) => write!(f, "shared data host call failed: {s}"),
            StoreError::Missing => write!(f, "ledger key not seeded"),
            StoreError::Corrupt(e) => write!(f, "ledger unreadable: {e}"),
            StoreError::Contended { attempts } => {
                write!(f, "ledger CAS lost {attempts} times in a row")
            }
        }
    }
}

impl std::error::Error for StoreError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutcome {
    Stored,
    CasMismatch,
}

/// A shared store with CAS: Envoy shared data in the filter, an in-memory map in tests.
pub trait SharedStore {
    /// The value and its CAS token, or `None` when the key does not exist.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Write `value` if the key's CAS token still equals `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, StoreError>;
}

/// Read the ledger without changing it (status endpoint, gauges).
pub fn read<S: SharedStore + ?Sized>(store: &S, key: &str) -> Result<Ledger, StoreError> {
    let (bytes, _) = store.get(key)?.ok_or(StoreError::Missing)?;
    Ledger::decode(&bytes).map_err(StoreError::Corrupt)
}

/// Create the ledger if the key is missing. Returns true when it wrote one.
///
/// An unreadable ledger is never replaced: it may hold live leases, and forgetting them would
/// over-admit. It is an error (`Corrupt`); every transaction on it fails the same way, so
/// admission stops loudly until an operator acts (a new `vm_id` starts a new ledger).
pub fn seed<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
    fresh: impl FnOnce() -> Ledger,
) -> Result<bool, StoreError> {
    match store.get(key)? {
        Some((bytes, _)) => Ledger::decode(&bytes)
            .map(|_| false)
            .map_err(StoreError::Corrupt),
        None => {
            store.set(key, &fresh().encode(), None)?;
            Ok(true)
        }
    }
}

/// Run `f` on the ledger as one atomic transition. `f` may run more than once (on CAS races), so
/// it must be a pure function of the ledger it is given. A transition that changes nothing
/// writes nothing (no CAS bump that would make other workers retry).
pub fn transact<S: SharedStore + ?Sized, T>(
    store: &S,
    key: &str,
    max_attempts: u32,
    mut f: impl FnMut(&mut Ledger) -> T,
) -> Result<(T, Ledger), StoreError> {
    for _ in 0..max_attempts.max(1) {
        let (bytes, cas) = store.get(key)?.ok_or(StoreError::Missing)?;
        let mut ledger = Ledger::decode(&bytes).map_err(StoreError::Corrupt)?;
        let out = f(&mut ledger);
        let encoded = ledger.encode();
        if encoded == bytes {
            return Ok((out, ledger));
        }
        match store.set(key, &encoded, Some(cas))? {
            SetOutcome::Stored => return Ok((out, ledger)),
            SetOutcome::CasMismatch => continue,
        }
    }
    Err(StoreError::Contended {
        attempts: max_attempts.max(1),
    })
}

/// An in-memory store with Envoy's semantics, for tests of code built on `SharedStore`.
/// It can inject CAS mismatches to prove retry paths.
#[derive(Default)]
pub struct MemoryStore {
    inner: std::sync::Mutex<std::collections::HashMap<String, (Vec<u8>, u32)>>,
    /// Fail this many upcoming `set` calls with a CAS mismatch.
    pub inject_mismatches: std::sync::atomic::AtomicU32,
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let map = self
            .inner
            .lock()
            .map_err(|_| StoreError::Host("poisoned".into()))?;
        Ok(map.get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, StoreError> {
        use std::sync::atomic::Ordering;
        let mut map = self
            .inner
            .lock()
            .map_err(|_| StoreError::Host("poisoned".into()))?;
        if self
            .inject_mismatches
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Ok(SetOutcome::CasMismatch);
        }
        match map.get_mut(key) {
            // As in Envoy: a missing key ignores the CAS.
            None => {
                map.insert(key.to_string(), (value.to_vec(), 1));
                Ok(SetOutcome::Stored)
            }
            Some(entry) => {
                if cas.is_some_and(|c| c != entry.1) {
                    return Ok(SetOutcome::CasMismatch);
                }
                entry.0 = value.to_vec();
                entry.1 = entry.1.wrapping_add(1).max(1);
                Ok(SetOutcome::Stored)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AdmitOutcome, AdmitRequest};
    use crate::retry::RetryAfterConfig;
    use std::sync::atomic::Ordering;
    #[cfg(not(target_family = "wasm"))]
    use std::sync::Arc;

    fn admit(l: &mut Ledger, bytes: u64) -> AdmitOutcome {
        l.try_admit(
            &AdmitRequest {
                id: None,
                bytes,
                class: "c",
                priority: 0,
                now_ms: 0,
                owner: 1,
                claim: None,
            },
            &RetryAfterConfig::default(),
            0,
        )
    }

    #[test]
    fn unseeded_key_is_an_error_and_seed_is_idempotent() {
        let s = MemoryStore::default();
        assert_eq!(
            transact(&s, "k", 3, |l| admit(l, 1)).unwrap_err(),
            StoreError::Missing
        );
        assert!(seed(&s, "k", || Ledger::new(10, 1)).unwrap());
        assert!(!seed(&s, "k", || Ledger::new(99, 1)).unwrap());
        assert_eq!(read(&s, "k").unwrap().capacity(), 10);
        // Garbage is never replaced (it may hold live leases): seeding and every transaction
        // fail loudly, and the stored bytes stay as they were.
        s.set("k", b"garbage", None).unwrap();
        assert!(matches!(read(&s, "k"), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            seed(&s, "k", || Ledger::new(7, 1)),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            transact(&s, "k", 3, |l| admit(l, 1)),
            Err(StoreError::Corrupt(_))
        ));
        assert_eq!(s.get("k").unwrap().map(|v| v.0), Some(b"garbage".to_vec()));
    }

    #[test]
    fn a_transition_that_changes_nothing_writes_nothing() {
        let s = MemoryStore::default();
        seed(&s, "k", || Ledger::new(100, 1)).unwrap();
        let cas = s.get("k").unwrap().map(|v| v.1);
        transact(&s, "k", 3, |l| l.release(12345, 0)).unwrap();
        transact(&s, "k", 3, |l| l.reap(10, |_| true)).unwrap();
        assert_eq!(
            s.get("k").unwrap().map(|v| v.1),
            cas,
            "no write, no CAS bump"
        );
        transact(&s, "k", 3, |l| admit(l, 1)).unwrap();
        assert_ne!(s.get("k").unwrap().map(|v| v.1), cas);
    }

    #[test]
    fn cas_mismatch_retries_on_fresh_state() {
        let s = MemoryStore::default();
        seed(&s, "k", || Ledger::new(100, 1)).unwrap();
        s.inject_mismatches.store(2, Ordering::SeqCst);
        let mut runs = 0;
        let (out, ledger) = transact(&s, "k", 5, |l| {
            runs += 1;
            admit(l, 40)
        })
        .unwrap();
        assert_eq!(runs, 3);
        assert!(matches!(out, AdmitOutcome::Admitted { .. }));
        assert_eq!(ledger.committed(), 40);
        assert_eq!(
            read(&s, "k").unwrap().committed(),
            40,
            "reserved once, not three times"
        );
        s.inject_mismatches.store(10, Ordering::SeqCst);
        assert_eq!(
            transact(&s, "k", 4, |l| admit(l, 1)).unwrap_err(),
            StoreError::Contended { attempts: 4 }
        );
        assert_eq!(read(&s, "k").unwrap().committed(), 40);
    }

    // wasm32-wasip1 has no threads; the single-threaded CAS tests above run there.
    #[cfg(not(target_family = "wasm"))]
    #[test]
    fn concurrent_workers_never_overcommit() {
        let s = Arc::new(MemoryStore::default());
        seed(&*s, "k", || Ledger::new(10_000, 1)).unwrap();
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    let mut admitted = Vec::new();
                    for i in 0..300u64 {
                        let bytes = 1 + (i * 7 + t) % 97;
                        if let Ok((AdmitOutcome::Admitted { lease }, _)) =
                            transact(&*s, "k", 1000, |l| admit(l, bytes))
                        {
                            admitted.push((lease.id, lease.bytes));
                        }
                        if i % 3 == 0 {
                            if let Some((id, _)) = admitted.pop() {
                                let (r, _) =
                                    transact(&*s, "k", 1000, |l| l.release(id, 1)).unwrap();
                                // A lost update would make this lease unknown here.
                                assert!(matches!(r, crate::ledger::ReleaseOutcome::Released(_)));
                            }
                        }
                    }
                    admitted
                })
            })
            .collect();
        let mut live = Vec::new();
        for t in threads {
            live.extend(t.join().unwrap());
        }
        let l = read(&*s, "k").unwrap();
        l.check().unwrap();
        // Every admission a thread was told about is in the ledger, byte for byte: a lost CAS
        // update (two workers reserving on the same snapshot) would break this.
        let mut want: Vec<u64> = live.iter().map(|x| x.0).collect();
        let mut have: Vec<u64> = l.leases().iter().map(|x| x.id).collect();
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(have, want);
        assert_eq!(l.committed(), live.iter().map(|x| x.1).sum::<u64>());
        for (id, _) in live {
            transact(&*s, "k", 1000, |l| l.release(id, 2)).unwrap();
        }
        assert_eq!(read(&*s, "k").unwrap().committed(), 0);
    }
}
