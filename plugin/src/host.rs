//! Host access, implemented once over `proxy_wasm::hostcalls` with every `Status` handled.

use std::time::UNIX_EPOCH;

use kvgate_core::store::{SetOutcome, SharedStore, StoreError};
use kvgate_core::ApiError;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, MetricType, Status};

/// Envoy shared data (per VM id, visible to every worker).
pub struct EnvoyStore;

impl SharedStore for EnvoyStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Ok(Some((bytes, cas.unwrap_or(0)))),
            Ok((None, _)) => Ok(None),
            Err(s) => Err(StoreError::Host(format!("get_shared_data: {s:?}"))),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(SetOutcome::Stored),
            Err(Status::CasMismatch) => Ok(SetOutcome::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("set_shared_data: {s:?}"))),
        }
    }
}

pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.subsec_nanos() as u64 ^ d.as_secs().rotate_left(32))
}

pub fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

pub fn info(msg: &str) {
    log(LogLevel::Info, msg)
}
pub fn warn(msg: &str) {
    log(LogLevel::Warn, msg)
}

/// Answer the request locally with an OpenAI-style error.
pub fn send_error(err: &ApiError, level: &str) {
    let mut headers = err.headers();
    headers.push(("x-kvgate-level", level.to_string()));
    let refs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Err(s) = crate::abi::send_local_response(err.status, &refs, err.body().as_bytes()) {
        warn(&format!("kvgate: send_http_response failed: {s:?}"));
    }
}

/// One Envoy metric. Defined by name; every worker's definition of a name is the same stat.
#[derive(Clone, Copy, Debug)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn counter(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Counter, name).ok())
    }
    pub fn gauge(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Gauge, name).ok())
    }
    pub fn inc(self) {
        self.add(1)
    }
    pub fn add(self, n: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    pub fn add_signed(self, n: i64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::increment_metric(id, n);
        }
    }
    /// The metric's value (for gauges: summed over every worker that moves it).
    pub fn get(self) -> u64 {
        self.0
            .and_then(|id| hostcalls::get_metric(id).ok())
            .unwrap_or(0)
    }
    pub fn set(self, v: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::record_metric(id, v);
        }
    }
}

/// A callout to the backend's admission API; the answer comes to the current (effective)
/// context's `on_http_call_response` under the returned token.
/// With an `endpoint`, the call carries `x-kvgate-endpoint` so the cluster's override_host
/// balancer sends it to that host.
pub fn call_backend(
    b: &kvgate_core::config::BackendCallout,
    endpoint: Option<&str>,
    method: &str,
    path: &str,
) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", b.authority.as_str()),
    ];
    if let Some(e) = endpoint {
        headers.push(("x-kvgate-endpoint", e));
    }
    if !b.secret.is_empty() {
        headers.push(("x-kvgate-secret", b.secret.as_str()));
    }
    hostcalls::dispatch_http_call(
        &b.cluster,
        headers,
        None,
        vec![],
        std::time::Duration::from_millis(b.timeout_ms),
    )
}
