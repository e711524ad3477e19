//! The status document the filter serves on its status path: a read-only view of the ledger.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::config::Config;
use crate::ledger::Ledger;

/// Render the ledger as the status JSON document.
pub fn status_json(ledger: &Ledger, cfg: &Config, tokenizer: &str) -> Value {
    let mut classes: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for c in cfg.policy.classes() {
        classes.insert(&c.name, (0, 0));
    }
    for l in ledger.leases() {
        let e = classes.entry(&l.class).or_insert((0, 0));
        e.0 += 1;
        e.1 = e.1.saturating_add(l.bytes);
    }
    let classes: serde_json::Map<String, Value> = classes
        .into_iter()
        .map(|(k, (n, b))| (k.to_string(), json!({"leases": n, "bytes": b})))
        .collect();
    let c = ledger.counters();
    json!({
        "version": crate::VERSION,
        "level": ledger.level(&cfg.levels).as_str(),
        "capacity_bytes": ledger.capacity(),
        "committed_bytes": ledger.committed(),
        "free_bytes": ledger.free(),
        "held_back_bytes": ledger.held_back(),
        "slack_bytes": ledger.slack(),
        // What leases sharing a prefix another lease pays were admitted without.
        "prefix_credit_bytes": ledger.leases().iter().map(|l| l.credit).fold(0u64, u64::saturating_add),
        "lendable_bytes": ledger.lendable(),
        "lendable_to_line_bytes": ledger.lendable_to_line(),
        "claims": ledger.claims().len(),
        // Claim keys are hashes of callers' keys and bodies: internal, never shown to clients.
        "claim_list": ledger.claims().iter().map(|c| json!({
            "bytes": c.bytes, "held": c.held,
            "active": c.active, "first_ms": c.first_ms, "expires_ms": c.expires_ms,
        })).collect::<Vec<_>>(),
        "claimed_bytes": ledger.claimed(),
        "leases": ledger.leases().len(),
        "classes": classes,
        "counters": {
            "admitted": c.admitted,
            "rejected": c.rejected,
            "released": c.released,
            "reaped": c.reaped,
        },
        "mean_lease_ms": ledger.mean_lease_ms(),
        "model": {
            "spec": cfg.pricing.spec,
            "fingerprint": format!("{:016x}", cfg.pricing.spec.fingerprint()),
            "kv_bytes_per_token": cfg.pricing.bytes_per_token,
            "tokenizer": tokenizer,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::AdmitRequest;
    use crate::retry::RetryAfterConfig;

    #[test]
    fn status_counts_per_class() {
        let cfg = Config::from_json(br#"{"model":{"layers":1,"kv_heads":1,"head_dim":1,"kv_dtype_bytes":1,"context_tokens":100},"kv_budget_bytes":1000,"safety_fraction":1.0,
            "policy":{"classes":{"default":{},"batch":{}}}}"#).unwrap();
        let mut l = Ledger::new(1000, 1);
        for (bytes, class) in [(100, "batch"), (50, "batch"), (20, "default")] {
            l.try_admit(
                &AdmitRequest {
                    id: None,
                    bytes,
                    class,
                    priority: 0,
                    now_ms: 0,
                    owner: 1,
                    claim: None,
                },
                &RetryAfterConfig::default(),
                0,
            );
        }
        let s = status_json(&l, &cfg, "cl100k_base");
        assert_eq!(s["committed_bytes"], 170);
        assert_eq!(s["free_bytes"], 830);
        assert_eq!(s["leases"], 3);
        assert_eq!(s["classes"]["batch"]["bytes"], 150);
        assert_eq!(s["classes"]["default"]["leases"], 1);
        assert_eq!(s["level"], "green");
        assert_eq!(s["model"]["kv_bytes_per_token"], 2);
    }
}
