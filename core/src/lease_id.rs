//! The layout of a lease id: one home for it. The filter draws ids, the ledger and the
//! backend's report carry them, reconciliation and the backend's poller table read the
//! gateway's number back out of them.
//!
//! An id is 53 bits (so JSON clients read it exactly): the gateway's number in the top 10
//! bits, a nonzero random part in the 43 below. Two gateways with their own numbers never
//! draw the same id.

/// The gateway's number sits in the bits above this one.
const GATEWAY_SHIFT: u32 = 43;

/// The most gateway numbers there are (10 bits).
pub const GATEWAYS: u64 = 1 << 10;

/// The id of gateway `gateway` (taken modulo [`GATEWAYS`]) with random part `random` (its low
/// 43 bits; never 0, so no id is 0).
pub fn compose(gateway: u64, random: u64) -> u64 {
    let low = random & ((1 << GATEWAY_SHIFT) - 1);
    ((gateway % GATEWAYS) << GATEWAY_SHIFT) | low.max(1)
}

/// The number of the gateway that drew `id`.
pub fn gateway_of(id: u64) -> u64 {
    id >> GATEWAY_SHIFT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_number_comes_back_out_and_ids_fit_53_bits() {
        for g in [0, 1, 7, GATEWAYS - 1] {
            for r in [0, 1, u64::MAX, 0x1234_5678_9abc] {
                let id = compose(g, r);
                assert_eq!(gateway_of(id), g);
                assert!(id > 0 && id < (1 << 53), "{id}");
            }
        }
        assert_eq!(gateway_of(compose(GATEWAYS + 3, 5)), 3);
    }
}
