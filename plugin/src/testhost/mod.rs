//! An in-memory proxy-wasm host, so the filter's glue is tested natively without Envoy.
//!
//! It implements (as `#[no_mangle]` functions) the host ABI that proxy-wasm 0.2.5's `hostcalls`
//! and this crate's `abi` import, backed by one thread-local `Host` per test thread: header maps
//! and request body per context, Envoy shared data with its CAS rules (a set on a missing key
//! ignores the CAS token), metrics by name, the local replies sent, the callouts dispatched, the
//! streams resumed, and a clock the test sets. `Vm` drives the plugin through the SDK's exported
//! entry points (`proxy_on_*`) the way Envoy does, setting the effective context first.
//!
//! Buffers handed to the plugin are allocated as a boxed slice of exact length, which is what
//! the SDK frees them with (`Vec::from_raw_parts(ptr, len, len)`).
//!
//! Test-only: never compiled into the wasm module.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::indexing_slicing, clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use proxy_wasm::types::{LogLevel, MapType, MetricType, StreamType};

mod abi;
mod vm;

pub use vm::{Stream, Vm, EPOCH_MS};

/// A local reply (`send_local_response`) as the client would see it.
#[derive(Debug, Clone)]
pub struct Reply {
    pub context: u32,
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("reply body is JSON")
    }
}

/// A callout (`dispatch_http_call`).
#[derive(Debug, Clone)]
pub struct Call {
    /// The effective context when it was dispatched (where Envoy would send the answer).
    pub context: u32,
    /// The context whose callback was running when it was dispatched.
    pub during: u32,
    pub token: u32,
    pub upstream: String,
    pub headers: Vec<(String, String)>,
}

impl Call {
    pub fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }
}

pub fn find<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

#[derive(Default)]
pub struct Host {
    pub now_ns: u64,
    /// Contexts the host knows (created and not deleted): `set_effective_context` accepts these.
    pub live: BTreeSet<u32>,
    pub effective: u32,
    /// The context whose callback the host is running (set by `Vm` before each callback).
    pub callback: u32,
    pub plugin_config: Vec<u8>,
    /// Header maps by (context, map type); callout-response maps live under context 0.
    pub maps: HashMap<(u32, u32), Vec<(String, String)>>,
    /// The request body buffered so far, per context.
    pub bodies: HashMap<u32, Vec<u8>>,
    /// The body of the callout response being delivered.
    pub call_response_body: Vec<u8>,
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    pub metric_ids: Vec<(String, MetricType)>,
    pub metrics: HashMap<String, i64>,
    pub replies: Vec<Reply>,
    pub calls: Vec<Call>,
    pub next_token: u32,
    /// (context, stream) for every `continue_stream` call.
    pub resumed: Vec<(u32, StreamType)>,
    pub tick_period_ms: u32,
    pub logs: Vec<(LogLevel, String)>,
    /// Fail this many upcoming conditional (CAS) shared-data writes with a CAS mismatch, as if
    /// another worker had written first.
    pub inject_cas_mismatches: u32,
    /// Every shared-data write that was stored, by key.
    pub shared_writes: HashMap<String, u32>,
    /// Properties (filter state, and what the test sets for the filter to read, e.g.
    /// `upstream\0address\0`) by (context, NUL-terminated path).
    pub properties: HashMap<(u32, String), Vec<u8>>,
}

thread_local! {
    static HOST: RefCell<Host> = RefCell::new(Host::default());
}

/// Run `f` on this thread's host. Never hold it across a call into the plugin.
pub fn with<T>(f: impl FnOnce(&mut Host) -> T) -> T {
    HOST.with(|h| f(&mut h.borrow_mut()))
}

pub(crate) fn map_key(context: u32, map: MapType) -> (u32, u32) {
    match map {
        MapType::HttpCallResponseHeaders | MapType::HttpCallResponseTrailers => (0, map as u32),
        _ => (context, map as u32),
    }
}

// ---- memory and (de)serialization ----------------------------------------------------------

/// Hand `bytes` to the plugin, which owns and frees them as `Vec::from_raw_parts(p, n, n)`.
pub(crate) unsafe fn give(bytes: &[u8], data: *mut *mut u8, size: *mut usize) {
    if bytes.is_empty() {
        *data = std::ptr::null_mut();
        *size = 0;
        return;
    }
    let boxed: Box<[u8]> = bytes.to_vec().into_boxed_slice();
    *size = boxed.len();
    *data = Box::into_raw(boxed) as *mut u8;
}

pub(crate) unsafe fn slice<'a>(data: *const u8, size: usize) -> &'a [u8] {
    if data.is_null() || size == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(data, size)
    }
}

pub(crate) unsafe fn string(data: *const u8, size: usize) -> String {
    String::from_utf8_lossy(slice(data, size)).into_owned()
}

/// The proxy-wasm map encoding (the filter's own encoder).
pub(crate) use crate::abi::serialize_map;

pub fn deserialize_map(bytes: &[u8]) -> Vec<(String, String)> {
    if bytes.len() < 4 {
        return Vec::new();
    }
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap()) as usize;
    let n = u32_at(0);
    let mut sizes = Vec::with_capacity(n);
    for i in 0..n {
        sizes.push((u32_at(4 + 8 * i), u32_at(8 + 8 * i)));
    }
    let mut p = 4 + 8 * n;
    let mut out = Vec::with_capacity(n);
    for (kl, vl) in sizes {
        let k = String::from_utf8_lossy(&bytes[p..p + kl]).into_owned();
        p += kl + 1;
        let v = String::from_utf8_lossy(&bytes[p..p + vl]).into_owned();
        p += vl + 1;
        out.push((k, v));
    }
    out
}
