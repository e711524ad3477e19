//! kvgate-plugin: the proxy-wasm glue that puts kvgate-core in front of an LLM server.
//!
//! Thin by design: every decision is made by pure code in kvgate-core; this crate only moves
//! bytes between Envoy and core (headers, body, shared data, metrics, local replies). It never
//! panics on purpose: every host call's `Status` is handled, and a panic hook logs at critical
//! level should one slip through.

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod filter;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod ticket;
#[cfg(target_arch = "wasm32")]
mod worker;

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
