//! Compact, versioned binary encoding of the ledger for Envoy shared data.
//!
//! Layout (little endian):
//! ```text
//! "KVGL" | version u8 = 10 | capacity u64 | committed u64 | next_id u64 | mean_lease_ms u64
//!        | admitted u64 | rejected u64 | released u64 | reaped u64 | held_back u64 | slack u64
//!        | lease count u32
//!        | per lease: id u64 | bytes u64 | priority u8 | created_ms u64 | owner u64
//!                     | eta_ms u64 | held u64 | prefix u64 | credit u64
//!                     | class length u8 | class bytes (UTF-8)
//!        | claim count u32
//!        | per claim: key u64 | bytes u64 | held u64 | first_ms u64 | expires_ms u64
//!                     | flags u8 (bit 0: active, bit 1: waits)
//!        | lendable u64 | lendable_to_line u64
//! ```
//! 66 bytes per lease plus its class name, 41 per claim, 16 after them. The decoder checks every
//! length and the ledger invariant; garbage returns an error, never a panic.
//!
//! Versions 9 (the same without `prefix` and `credit`) and 8 (also without `slack`) are still
//! read, with neither: a filter upgraded in
//! place under the same `vm_id` (ECDS, a rolling upgrade) finds the ledger the previous release
//! wrote and keeps its leases. Older versions are not: a new `vm_id` starts an empty ledger. An
//! unknown version is an error, never an empty ledger.

use crate::ledger::{Claim, Counters, Lease, Ledger, MAX_CLAIMS};

const MAGIC: &[u8; 4] = b"KVGL";
const VERSION: u8 = 10;
/// Previous versions, still read (see the module header).
const V9: u8 = 9;
const V8: u8 = 8;
const CLAIM_LEN: usize = 5 * 8 + 1;
const HEADER_LEN: usize = 4 + 1 + 10 * 8 + 4;
const MAX_CLASS_LEN: usize = u8::MAX as usize;
/// A lease's length in the smallest version read (the encoder's is 16 more).
const LEASE_MIN_LEN: usize = 8 + 8 + 1 + 8 + 8 + 8 + 8 + 1;

/// A stored ledger's totals from its fixed header (`fleet::peek`: the room of every endpoint
/// on the request path without decoding their leases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub capacity: u64,
    pub committed: u64,
    pub held_back: u64,
    pub slack: u64,
    pub leases: u32,
}

/// [`Totals`] of an encoded ledger; `None` if it is not one this build reads.
pub fn totals(bytes: &[u8]) -> Option<Totals> {
    let mut r = Reader(bytes);
    if r.take(4).ok()? != MAGIC {
        return None;
    }
    let version = r.u8().ok()?;
    if version != VERSION && version != V9 && version != V8 {
        return None;
    }
    let capacity = r.u64().ok()?;
    let committed = r.u64().ok()?;
    r.take(6 * 8).ok()?; // next_id, mean_lease_ms, the four counters
    let held_back = r.u64().ok()?;
    let slack = match version {
        V8 => 0,
        _ => r.u64().ok()?,
    };
    Some(Totals {
        capacity,
        committed,
        held_back,
        slack,
        leases: r.u32().ok()?,
    })
}

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
        self.encode_as(VERSION)
    }

    /// As `version` lays it out (a previous one: what an older filter wrote).
    fn encode_as(&self, version: u8) -> Vec<u8> {
        let classes: usize = self
            .leases
            .iter()
            .map(|l| l.class.len().min(MAX_CLASS_LEN))
            .sum();
        let mut out = Vec::with_capacity(HEADER_LEN + self.leases.len() * LEASE_MIN_LEN + classes);
        out.extend_from_slice(MAGIC);
        out.push(version);
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
        if version != V8 {
            out.extend_from_slice(&self.slack.to_le_bytes());
        }
        let n = u32::try_from(self.leases.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n.to_le_bytes());
        for l in self.leases.iter().take(n as usize) {
            out.extend_from_slice(&l.id.to_le_bytes());
            out.extend_from_slice(&l.bytes.to_le_bytes());
            out.push(l.priority);
            out.extend_from_slice(&l.created_ms.to_le_bytes());
            out.extend_from_slice(&l.owner.to_le_bytes());
            out.extend_from_slice(&l.eta_ms.to_le_bytes());
            out.extend_from_slice(&l.held.to_le_bytes());
            if version == VERSION {
                out.extend_from_slice(&l.prefix.to_le_bytes());
                out.extend_from_slice(&l.credit.to_le_bytes());
            }
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
        if version != VERSION && version != V9 && version != V8 {
            return Err(DecodeError::UnsupportedVersion(version));
        }
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
        let held_back = r.u64()?;
        let slack = if version == V8 { 0 } else { r.u64()? };
        let n = r.u32()? as usize;
        // Refuse lease counts the input cannot hold before allocating.
        if n > r.0.len() / LEASE_MIN_LEN {
            return Err(DecodeError::Truncated);
        }
        let mut leases = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let bytes = r.u64()?;
            let priority = r.u8()?;
            let created_ms = r.u64()?;
            let owner = r.u64()?;
            let eta_ms = r.u64()?;
            let held = r.u64()?;
            let (prefix, credit) = match version {
                VERSION => (r.u64()?, r.u64()?),
                _ => (0, 0),
            };
            let len = r.u8()? as usize;
            let class = std::str::from_utf8(r.take(len)?)
                .map_err(|_| DecodeError::BadClassName)?
                .to_string();
            leases.push(Lease {
                id,
                bytes,
                class,
                priority,
                created_ms,
                owner,
                eta_ms,
                held,
                prefix,
                credit,
            });
        }
        let n = r.u32()? as usize;
        if n > MAX_CLAIMS || n > r.0.len() / CLAIM_LEN {
            return Err(DecodeError::Truncated);
        }
        let mut claims = Vec::with_capacity(n);
        for _ in 0..n {
            let (key, bytes, held, first_ms, expires_ms) =
                (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let flags = r.u8()?;
            if flags > 3 {
                return Err(DecodeError::Inconsistent("claim flags".into()));
            }
            claims.push(Claim {
                key,
                bytes,
                held,
                first_ms,
                expires_ms,
                active: flags & 1 == 1,
                waits: flags & 2 == 2,
            });
        }
        let lendable = r.u64()?;
        let lendable_to_line = r.u64()?;
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
            slack,
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
                now_ms: 1000 + i as u64,
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

    /// `l` as version 8 wrote it: no slack after `held_back`, no prefix in a lease.
    fn encode_v8(l: &Ledger) -> Vec<u8> {
        l.encode_as(V8)
    }

    #[test]
    fn a_version_9_ledger_is_read_with_no_prefixes_and_a_prefix_round_trips() {
        let mut l = sample();
        l.set_slack(1_000);
        assert_eq!(Ledger::decode(&l.encode_as(V9)).unwrap(), l);
        let (a, b) = (l.leases()[0].clone(), l.leases()[1].clone());
        l.set_prefix(a.id, 77, 0);
        l.set_prefix(b.id, 77, 0);
        assert_eq!(Ledger::decode(&l.encode()).unwrap(), l);
        // A lease excused its prefix with nobody paying it is refused.
        let mut orphan = l.clone();
        orphan.set_prefix(a.id, 78, 5);
        orphan.set_prefix(b.id, 0, 0);
        assert!(matches!(
            Ledger::decode(&orphan.encode()),
            Err(DecodeError::Inconsistent(_))
        ));
    }

    #[test]
    fn a_version_8_ledger_is_read_with_its_leases_and_written_back_as_version_9() {
        let mut l = sample();
        let id = l.leases()[0].id;
        l.set_eta(id, 9_000);
        l.set_held_back(5_000);
        l.set_lendable(3_000);
        l.set_lendable_to_line(2_000);
        l.set_held(|x| if x == id { 4_000 } else { 0 });
        let old = Ledger::decode(&encode_v8(&l)).unwrap();
        assert_eq!(old, l, "every field kept across a rolling upgrade");
        assert_eq!(old.encode()[4], VERSION);
        l.set_slack(6_000);
        assert_eq!(Ledger::decode(&l.encode()).unwrap().slack(), 6_000);
        // Versions before 8 are not read.
        let mut v7 = encode_v8(&l);
        v7[4] = 7;
        assert_eq!(Ledger::decode(&v7), Err(DecodeError::UnsupportedVersion(7)));
    }

    #[test]
    fn a_ledger_with_more_lendable_than_held_back_or_lent_than_lendable_is_refused() {
        let mut l = sample();
        l.set_held_back(5_000);
        l.set_lendable(3_000);
        l.set_lendable_to_line(2_000);
        let back = Ledger::decode(&l.encode()).unwrap();
        assert_eq!(back, l);
        let mut bad = l.encode();
        let n = bad.len();
        bad[n - 16..n - 8].copy_from_slice(&6_000u64.to_le_bytes());
        assert_eq!(
            Ledger::decode(&bad),
            Err(DecodeError::Inconsistent(
                "more lendable than held back".into()
            ))
        );
        let mut bad = l.encode();
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
            now_ms: 5000,
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
        // defined.
        let mut bad = bytes.clone();
        let at = bad.len() - 17;
        assert_eq!(bad[at], 3);
        bad[at] = 4;
        assert_eq!(
            Ledger::decode(&bad),
            Err(DecodeError::Inconsistent("claim flags".into()))
        );
    }

    #[test]
    fn garbage_is_an_error() {
        assert_eq!(Ledger::decode(b""), Err(DecodeError::Truncated));
        assert_eq!(Ledger::decode(b"XXXX\x01"), Err(DecodeError::BadMagic));
        assert_eq!(
            Ledger::decode(b"KVGL\x0b"),
            Err(DecodeError::UnsupportedVersion(11))
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
            now_ms: 0,
            owner: 1,
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
            // (A version byte turned to 7 reads another layout, written back as version 8.)
            if let Ok(l) = Ledger::decode(&b) {
                if b.get(4) == Some(&VERSION) { prop_assert_eq!(l.encode(), b); }
            }
        }
    }
}
