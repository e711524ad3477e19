//! kvgate-plugin: the proxy-wasm glue that puts kvgate-core in front of an LLM server.
//!
//! Thin by design: every decision is made by pure code in kvgate-core; this crate only moves
//! bytes between Envoy and core (headers, body, shared data, metrics, local replies). It never
//! panics on purpose: every host call's `Status` is handled, and a panic hook logs at critical
//! level should one slip through.

// The glue runs in Envoy (wasm32); natively it is compiled only for its tests, which drive it
// through the SDK's exported entry points against an in-memory host (`testhost`).
#[cfg(any(target_arch = "wasm32", test))]
mod abi;
#[cfg(any(target_arch = "wasm32", test))]
mod filter;
#[cfg(any(target_arch = "wasm32", test))]
mod host;
#[cfg(any(target_arch = "wasm32", test))]
mod metrics;
#[cfg(any(target_arch = "wasm32", test))]
mod root;
#[cfg(any(target_arch = "wasm32", test))]
mod ticket;
#[cfg(any(target_arch = "wasm32", test))]
mod worker;

#[cfg(all(test, not(target_arch = "wasm32")))]
mod testhost;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = proxy_wasm::hostcalls::log(
            proxy_wasm::types::LogLevel::Critical,
            &format!("kvgate: panic: {info}"),
        );
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new())
    });
}}

/// The shared-data key of the ledger (scoped by Envoy to the VM id).
pub const LEDGER_KEY: &str = "kvgate.ledger.v1";
/// Attempts at one ledger transition before giving up with 503.
pub const CAS_ATTEMPTS: u32 = 64;
