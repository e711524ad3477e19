//! The shared-data ledger codec on any bytes.
//!
//! Properties: `Ledger::decode` never panics; a ledger it accepts satisfies `check()`; one in the
//! current version encodes back to exactly the input bytes, one in an older version (migrated on
//! read) encodes to bytes that decode to the same ledger; releasing and reaping leases of a
//! decoded ledger keep it consistent and encodable.
#![no_main]

use kvgate_core::Ledger;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(ledger) = Ledger::decode(data) else {
        return;
    };
    if let Err(e) = ledger.check() {
        panic!("decoded an inconsistent ledger: {e}");
    }
    let bytes = ledger.encode();
    let current = Ledger::new(0, 1).encode().get(4).copied();
    if data.get(4).copied() == current {
        assert_eq!(bytes, data, "encode(decode(x)) != x");
    } else {
        match Ledger::decode(&bytes) {
            Ok(again) => assert_eq!(again, ledger, "migrated ledger changed on re-decode"),
            Err(e) => panic!("a migrated ledger does not decode: {e}"),
        }
    }
    // Transitions on whatever was decoded keep it consistent.
    let mut l = ledger;
    let ids: Vec<u64> = l.leases().iter().map(|x| x.id).collect();
    let now = data.len() as u64 * 1000;
    if let Some(&id) = ids.first() {
        l.release(id, now);
        assert!(
            l.check().is_ok(),
            "release broke the ledger: {:?}",
            l.check()
        );
    }
    l.reap(now, |owner| owner % 2 == 0);
    assert!(l.check().is_ok(), "reap broke the ledger: {:?}", l.check());
    assert!(
        Ledger::decode(&l.encode()).is_ok(),
        "a reaped ledger does not decode"
    );
});
