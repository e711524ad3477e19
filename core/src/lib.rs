//! kvgate-core: the pure admission logic shared by the Envoy filter and the backend.
//!
//! Prices every request at the worst case it is allowed to reach (prompt + effective output
//! cap), keeps a ledger of reservations, and decides admission in one pure transition. No
//! proxy-wasm, no tokio, no I/O, no panics: it compiles for the host and for wasm32.

pub mod addr;
pub mod cap;
pub mod codec;
pub mod config;
pub mod elastic;
pub mod error;
pub mod fleet;
pub mod gate;
pub mod lease_id;
pub mod ledger;
pub mod peak;
pub mod policy;
pub mod queue;
pub mod reconcile;
pub mod report;
pub mod request;
pub mod retry;
pub mod spec;
pub mod store;
pub mod tokenize;
pub mod validate;
pub mod vllm;
pub mod wire;

pub use cap::{effective_output_cap, largest_cap_that_fits, price_request, CapDecision, Price};
pub use error::{ApiError, ConfigError, ErrorKind};
pub use ledger::estimate_retry_after;
pub use ledger::{
    AdmitOutcome, AdmitRequest, Claim, ClaimTicket, Lease, Ledger, Level, LevelThresholds,
    RejectReason, ReleaseOutcome,
};
pub use policy::{Action, ClassPolicy, ClassSources, PolicyTable, Reservation};
pub use request::{
    parse_request, write_cap, Endpoint, GatewayNote, Input, ParsedRequest, GATEWAY_FIELD,
};
pub use retry::{RetryAfter, RetryAfterConfig};
pub use spec::{ModelSpec, Pricing, ESTIMATOR_VERSION};
pub use tokenize::{CustomBpe, Encoding, TokenCounter, TokenizerSpec};
pub use validate::{validate, Sampling, Served};

/// Version of this crate, logged by the filter and the backend at start.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
