//! Compact, versioned binary encoding of the ledger for Envoy shared data.
//!
//! Layout (little endian):
//! ```text
//! "KVGL" | version u8 = 7 | capacity u64 | committed u64 | next_id u64 | mean_lease_ms u64
//!        | admitted u64 | rejected u64 | released u64 | reaped u64 | held_back u64
//!        | lease count u32
//!        | per lease: id u64 | bytes u64 | priority u8 | fingerprint u64 | created_ms u64
//!                     | deadline_ms u64 | owner u64 | eta_ms u64 | held u64 | class length u8
//!                     | class bytes (UTF-8)
//!        | claim count u32
//!        | per claim: key u64 | bytes u64 | held u64 | first_ms u64 | expires_ms u64
//!                     | flags u8 (bit 0: active, bit 1: waits)
//!        | lendable u64 | lendable_to_line u64
//! ```
//! 66 bytes per lease plus its class name, 41 per claim, 16 after them. The decoder checks every
//! length and the ledger invariant; garbage returns an error, never a panic.
//!
//! Versions 1 (no `held_back`, no lease owner), 2 (no claims), 3 (no lease eta), 4 (no
//! `lendable`: nothing lent until the next poll sets it), 5 (no lease `held`: none until
//! the next poll sets it) and 6 (no claim `waits` flag: every client away; no
//! `lendable_to_line`: nothing lent to the line until the next poll) are still read, so a
//! filter upgraded in place under the same `vm_id` migrates the ledger it finds instead of forgetting its leases: migrated
//! leases have no owner and end at their deadline. An unknown version is an error, never an
//! empty ledger.

use crate::ledger::{Claim, Counters, Lease, Ledger, MAX_CLAIMS};

const MAGIC: &[u8; 4] = b"KVGL";
const VERSION: u8 = 7;
const CLAIM_LEN: usize = 5 * 8 + 1;
const HEADER_LEN: usize = 4 + 1 + 9 * 8 + 4;
const MAX_CLASS_LEN: usize = u8::MAX as usize;
const LEASE_MIN_LEN_V1: usize = 8 + 8 + 1 + 8 + 8 + 8 + 1;
const LEASE_MIN_LEN_V2: usize = LEASE_MIN_LEN_V1 + 8;
const LEASE_MIN_LEN_V4: usize = LEASE_MIN_LEN_V2 + 8;
const LEASE_MIN_LEN: usize = LEASE_MIN_LEN_V4 + 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    BadMagic,
    UnsupportedVersion(u8),
    Truncated,
    TrailingBytes(usize),
    BadClassName,
    Inconsistent(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::BadMagic => write!(f, "not a kvgate ledger (bad magic)"),
            DecodeError::UnsupportedVersion(v) => write!(f, "unsupported ledger version {v}"),
            DecodeError::Truncated => write!(f, "ledger truncated"),
            DecodeError::TrailingBytes(n) => write!(f, "{n} trailing bytes after ledger"),
            DecodeError::BadClassName => write!(f, "lease class is not UTF-8"),
            DecodeError::Inconsistent(s) => write!(f, "ledger inconsistent: {s}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Ledger {
    pub fn encode(&self) -> Vec<u8> {
        let classes: usize = self
            .leases
            .iter()
            .map(|l| l.class.len().min(MAX_CLASS_LEN))
            .sum();
        let mut out = Vec::with_capacity(HEADER_LEN + self.leases.len() * LEASE_MIN_LEN + classes);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        for v in [
            self.capacity,
            self.committed,
            self.next_id,
            self.mean_lease_ms,
            self.counters.admitted,
            self.counters.rejected,
            self.counters.released,
            self.counters.reaped,
            self.held_back,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let n = u32::try_from(self.leases.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n.to_le_bytes());
        for l in self.leases.iter().take(n as usize) {
            out.extend_from_slice(&l.id.to_le_bytes());
            out.extend_from_slice(&l.bytes.to_le_bytes());
            out.push(l.priority);
            out.extend_from_slice(&l.fingerprint.to_le_bytes());
            out.extend_from_slice(&l.created_ms.to_le_bytes());
            out.extend_from_slice(&l.deadline_ms.to_le_bytes());
            out.extend_from_slice(&l.owner.to_le_bytes());
            out.extend_from_slice(&l.eta_ms.to_le_bytes());
            out.extend_from_slice(&l.held.to_le_bytes());
            let class = truncate_utf8(&l.class, MAX_CLASS_LEN);
            out.push(class.len() as u8);
            out.extend_from_slice(class.as_bytes());
        }
        let claims = self.claims.len().min(MAX_CLAIMS);
        out.extend_from_slice(&(claims as u32).to_le_bytes());
        for c in self.claims.iter().take(claims) {
            for v in [c.key, c.bytes, c.held, c.first_ms, c.expires_ms] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.push(u8::from(c.active) | u8::from(c.waits) << 1);
        }
        out.extend_from_slice(&self.lendable.to_le_bytes());
        out.extend_from_slice(&self.lendable_to_line.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Ledger, DecodeError> {
        let mut r = Reader(bytes);
        if r.take(4)? != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = r.u8()?;
        if !(1..=VERSION).contains(&version) {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let v2 = version >= 2;
        let capacity = r.u64()?;
        let committed = r.u64()?;
        let next_id = r.u64()?;
        let mean_lease_ms = r.u64()?;
        let counters = Counters {
            admitted: r.u64()?,
            rejected: r.u64()?,
            released: r.u64()?,
            reaped: r.u64()?,
        };
        let held_back = if v2 { r.u64()? } else { 0 };
        let n = r.u32()? as usize;
        // Refuse lease counts the input cannot hold before allocating.
        let (v4, v6) = (version >= 4, version >= 6);
        let min_len = match (v2, v4, v6) {
            (_, _, true) => LEASE_MIN_LEN,
            (_, true, false) => LEASE_MIN_LEN_V4,
            (true, false, _) => LEASE_MIN_LEN_V2,
            (false, _, _) => LEASE_MIN_LEN_V1,
        };
        if n > r.0.len() / min_len {
            return Err(DecodeError::Truncated);
        }
        let mut leases = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let bytes = r.u64()?;
            let priority = r.u8()?;
            let fingerprint = r.u64()?;
            let created_ms = r.u64()?;
            let deadline_ms = r.u64()?;
            let owner = if v2 { r.u64()? } else { 0 };
            let eta_ms = if v4 { r.u64()? } else { 0 };
            let held = if v6 { r.u64()? } else { 0 };
            let len = r.u8()? as usize;
            let class = std::str::from_utf8(r.take(len)?)
                .map_err(|_| DecodeError::BadClassName)?
                .to_string();
            leases.push(Lease {
                id,
                bytes,
                class,
                priority,
                fingerprint,
                created_ms,
                deadline_ms,
                owner,
                eta_ms,
                held,
            });
        }
        let mut claims = Vec::new();
        if version >= 3 {
            let n = r.u32()? as usize;
            if n > MAX_CLAIMS || n > r.0.len() / CLAIM_LEN {
                return Err(DecodeError::Truncated);
            }
            for _ in 0..n {
                claims.push(Claim {
                    key: r.u64()?,
                    bytes: r.u64()?,
                    held: r.u64()?,
                    first_ms: r.u64()?,
                    expires_ms: r.u64()?,
                    active: false,
                    waits: false,
                });
                let flags = r.u8()?;
                if flags > 3 || (version < 7 && flags > 1) {
                    return Err(DecodeError::Inconsistent("claim flags".into()));
                }
                if let Some(c) = claims.last_mut() {
                    (c.active, c.waits) = (flags & 1 == 1, flags & 2 == 2);
                }
            }
        }
        let lendable = if version >= 5 { r.u64()? } else { 0 };
        let lendable_to_line = if version >= 7 { r.u64()? } else { 0 };
        if !r.0.is_empty() {
            return Err(DecodeError::TrailingBytes(r.0.len()));
        }
        let ledger = Ledger {
            capacity,
            committed,
            next_id,
            mean_lease_ms,
            counters,
            held_back,
            lendable,
            lendable_to_line,
            leases,
            claims,
        };
        ledger.check().map_err(DecodeError::Inconsistent)?;
        Ok(ledger)
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or("")
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AdmitOutcome, AdmitRequest};
    use crate::retry::RetryAfterConfig;
    use proptest::prelude::*;

    fn sample() -> Ledger {
        let mut l = Ledger::new(10 * (1u64 << 33), 42);
        for (i, class) in ["interactive", "batch", "ünïcode"].iter().enumerate() {
            let r = AdmitRequest {
                id: None,
                bytes: (i as u64 + 1) * (1u64 << 33),
                class,
                priority: i as u8,
                fingerprint: 0xdead_beef,
                now_ms: 1000 + i as u64,
                ttl_ms: 5000,
                owner: 0xabc + i as u64,
                claim: None,
            };
            assert!(matches!(
                l.try_admit(&r, &RetryAfterConfig::default(), 0),
                AdmitOutcome::Admitted { .. }
            ));
        }
        l.release(43, 3000);
        l
    }

    #[test]
    fn round_trip() {
        let l = sample();
        let bytes = l.encode();
        assert_eq!(Ledger::decode(&bytes).unwrap(), l);
        let empty = Ledger::new(1, 1);
        assert_eq!(Ledger::decode(&empty.encode()).unwrap(), empty);
    }

    /// The version-1 layout, written by hand as the previous release did.
    fn encode_v1(l: &Ledger) -> Vec<u8> {
        let mut out = b"KVGL\x01".to_vec();
        for v in [
            l.capacity,
            l.committed,
            l.next_id,
            l.mean_lease_ms,
            l.counters.admitted,
            l.counters.rejected,
            l.counters.released,
            l.counters.reaped,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(l.leases.len() as u32).to_le_bytes());
        for x in &l.leases {
            for v in [x.id, x.bytes] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.push(x.priority);
            for v in [x.fingerprint, x.created_ms, x.deadline_ms] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.push(x.class.len() as u8);
            out.extend_from_slice(x.class.as_bytes());
        }
        out
    }

    #[test]
    fn a_version_1_ledger_is_migrated_with_its_leases() {
        let l = sample();
        let old = Ledger::decode(&encode_v1(&l)).unwrap();
        assert_eq!(old.committed(), l.committed());
        assert_eq!(old.leases().len(), 2);
        assert!(
            old.leases().iter().all(|x| x.owner == 0),
            "migrated leases end at their deadline"
        );
        let ids: Vec<u64> = old.leases().iter().map(|x| x.id).collect();
        assert_eq!(ids, l.leases().iter().map(|x| x.id).collect::<Vec<_>>());
        // Written back, it is a current-version ledger.
        assert_eq!(old.encode()[4], VERSION);
    }

    /// `l` in an older layout, `version` 3 to 6: without the per-lease fields it did not have
    /// (v3: eta and held; v4, v5: held), before v5 the trailing `lendable`, and before v7 the
    /// trailing `lendable_to_line` (its claims' flags are the caller's to keep to bit 0).
    fn encode_as(l: &Ledger, version: u8) -> Vec<u8> {
        let mut out = l.encode();
        out[4] = version;
        if version < 7 {
            out.truncate(out.len() - 8);
        }
        if version < 5 {
            out.truncate(out.len() - 8);
        }
        if version >= 6 {
            return out;
        }
        let dropped = if version < 4 { 16 } else { 8 };
        let mut at = HEADER_LEN;
        for x in l.leases() {
            // id, bytes, priority, fingerprint, created_ms, deadline_ms, owner
            let eta_at = at + 8 + 8 + 1 + 8 + 8 + 8 + 8;
            let from = eta_at + 16 - dropped;
            out.drain(from..eta_at + 16);
            at = from + 1 + x.class.len();
        }
        out
    }

    #[test]
    fn a_version_3_ledger_is_read_without_etas_and_an_eta_round_trips() {
        let mut l = sample();
        let old = Ledger::decode(&encode_as(&l, 3)).unwrap();
        assert_eq!(old, l, "etas were 0");
        let id = l.leases()[0].id;
        l.set_eta(id, 123_456);
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!(back.lease(id).unwrap().eta_ms, 123_456);
    }

    #[test]
    fn a_version_5_ledger_is_read_with_nothing_held_and_held_round_trips() {
        let mut l = sample();
        let id = l.leases()[0].id;
        l.set_eta(id, 9_000);
        l.set_held_back(4_000);
        l.set_lendable(1_000);
        let old = Ledger::decode(&encode_as(&l, 5)).unwrap();
        assert_eq!(old, l, "held was 0");
        l.set_held(|x| if x == id { 4_000 } else { 0 });
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!(back.lease(id).unwrap().held, 4_000);
        assert_eq!(back.lease(id).unwrap().eta_ms, 9_000);
        assert_eq!(back, l);
    }

    #[test]
    fn a_version_4_ledger_is_read_with_nothing_lendable_and_lendable_round_trips() {
        let mut l = sample();
        l.set_held_back(5_000);
        l.set_lendable(3_000);
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!((back.held_back(), back.lendable()), (5_000, 3_000));
        let old = Ledger::decode(&encode_as(&l, 4)).unwrap();
        assert_eq!((old.held_back(), old.lendable()), (5_000, 0));
        // More lendable than held back is not a ledger this code writes: refused.
        let mut bad = l.encode();
        let n = bad.len();
        bad[n - 16..n - 8].copy_from_slice(&6_000u64.to_le_bytes());
        assert_eq!(
            Ledger::decode(&bad),
            Err(DecodeError::Inconsistent(
                "more lendable than held back".into()
            ))
        );
    }

    #[test]
    fn a_version_6_ledger_is_read_with_nothing_lent_to_the_line() {
        let mut l = sample();
        l.set_held_back(5_000);
        l.set_lendable(3_000);
        l.set_lendable_to_line(2_000);
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!(back, l);
        assert_eq!(back.lendable_to_line(), 2_000);
        let old = Ledger::decode(&encode_as(&l, 6)).unwrap();
        assert_eq!((old.lendable(), old.lendable_to_line()), (3_000, 0));
        // More lent to the line than lendable is not a ledger this code writes: refused.
        let mut bad = l.encode();
        let n = bad.len();
        bad[n - 8..].copy_from_slice(&3_001u64.to_le_bytes());
        assert_eq!(
            Ledger::decode(&bad),
            Err(DecodeError::Inconsistent(
                "more lendable to the line than lendable".into()
            ))
        );
    }

    #[test]
    fn claims_round_trip() {
        use crate::ledger::ClaimTicket;
        let mut l = sample();
        let r = AdmitRequest {
            id: None,
            bytes: 10 * (1u64 << 33),
            class: "big",
            priority: 0,
            fingerprint: 0,
            now_ms: 5000,
            ttl_ms: 1,
            owner: 1,
            claim: Some(ClaimTicket {
                key: 99,
                patience_ms: 10,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
        };
        assert!(matches!(
            l.try_admit(&r, &RetryAfterConfig::default(), 0),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claims().len(), 1);
        assert_eq!(Ledger::decode(&l.encode()).unwrap(), l);
        // Both flags: a second request that waits in a gateway's queue, refused twice (active).
        let queued = AdmitRequest {
            claim: r.claim.map(|t| ClaimTicket {
                key: 7,
                waits: true,
                ..t
            }),
            ..r.clone()
        };
        for _ in 0..2 {
            l.try_admit(&queued, &RetryAfterConfig::default(), 0);
        }
        let flags: Vec<(bool, bool)> = l.claims().iter().map(|c| (c.active, c.waits)).collect();
        assert_eq!(flags, [(false, false), (true, true)]);
        let bytes = l.encode();
        assert_eq!(Ledger::decode(&bytes).unwrap(), l);
        // The flag byte is the last before `lendable` and `lendable_to_line`; no other bit is
        // defined, and a version-6 ledger had only `active`.
        let mut bad = bytes.clone();
        let at = bad.len() - 17;
        assert_eq!(bad[at], 3);
        bad[at] = 4;
        assert_eq!(
            Ledger::decode(&bad),
            Err(DecodeError::Inconsistent("claim flags".into()))
        );
        let v6 = encode_as(&l, 6);
        assert_eq!(
            Ledger::decode(&v6),
            Err(DecodeError::Inconsistent("claim flags".into()))
        );
    }

    #[test]
    fn garbage_is_an_error() {
        assert_eq!(Ledger::decode(b""), Err(DecodeError::Truncated));
        assert_eq!(Ledger::decode(b"XXXX\x01"), Err(DecodeError::BadMagic));
        assert_eq!(
            Ledger::decode(b"KVGL\x09"),
            Err(DecodeError::UnsupportedVersion(9))
        );
        let mut b = sample().encode();
        b.push(0);
        assert_eq!(Ledger::decode(&b), Err(DecodeError::TrailingBytes(1)));
        // committed tampered with: the invariant check catches it.
        let mut c = sample().encode();
        c[13] ^= 1; // a byte of `committed`
        assert!(matches!(
            Ledger::decode(&c),
            Err(DecodeError::Inconsistent(_))
        ));
        // a claim count the input cannot hold (the last u32 before the two lendable u64s).
        let mut d = Ledger::new(1, 1).encode();
        let n = d.len();
        d[n - 20..n - 16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Ledger::decode(&d), Err(DecodeError::Truncated));
    }

    #[test]
    fn long_class_names_are_truncated_on_a_char_boundary() {
        let long = "é".repeat(200); // 400 bytes
        let mut l = Ledger::new(100, 1);
        let r = AdmitRequest {
            id: None,
            bytes: 1,
            class: &long,
            priority: 0,
            fingerprint: 0,
            now_ms: 0,
            ttl_ms: 1,
            owner: 0,
            claim: None,
        };
        l.try_admit(&r, &RetryAfterConfig::default(), 0);
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!(back.leases()[0].class.len(), 254);
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Ledger::decode(&bytes);
        }

        #[test]
        fn decode_of_mutated_ledger_never_panics(i in 0usize..200, x: u8) {
            let mut b = sample().encode();
            if let Some(byte) = b.get_mut(i) { *byte ^= x; }
            // Whatever the decoder accepts it must have read faithfully: the same bytes come back.
            // (A tampered `committed` or lease size is refused by the invariant check.)
            if let Ok(l) = Ledger::decode(&b) { prop_assert_eq!(l.encode(), b); }
        }
    }
}
