//! The filter configuration parser on any bytes: `Config::from_json` never panics, and an accepted
//! configuration answers `guards` without panicking.
#![no_main]

use kvgate_core::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cfg) = Config::from_json(data) {
        for p in ["/v1/completions", "/v1/chat/completions?x=1", "", "?"] {
            let _ = cfg.guards(p);
        }
    }
});
