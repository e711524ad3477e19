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

use proxy_wasm::types::{Action, BufferType, LogLevel, MapType, MetricType, Status, StreamType};

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
}

thread_local! {
    static HOST: RefCell<Host> = RefCell::new(Host::default());
}

/// Run `f` on this thread's host. Never hold it across a call into the plugin.
pub fn with<T>(f: impl FnOnce(&mut Host) -> T) -> T {
    HOST.with(|h| f(&mut h.borrow_mut()))
}

fn map_key(context: u32, map: MapType) -> (u32, u32) {
    match map {
        MapType::HttpCallResponseHeaders | MapType::HttpCallResponseTrailers => (0, map as u32),
        _ => (context, map as u32),
    }
}

// ---- memory and (de)serialization ----------------------------------------------------------

/// Hand `bytes` to the plugin, which owns and frees them as `Vec::from_raw_parts(p, n, n)`.
unsafe fn give(bytes: &[u8], data: *mut *mut u8, size: *mut usize) {
    if bytes.is_empty() {
        *data = std::ptr::null_mut();
        *size = 0;
        return;
    }
    let boxed: Box<[u8]> = bytes.to_vec().into_boxed_slice();
    *size = boxed.len();
    *data = Box::into_raw(boxed) as *mut u8;
}

unsafe fn slice<'a>(data: *const u8, size: usize) -> &'a [u8] {
    if data.is_null() || size == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(data, size)
    }
}

unsafe fn string(data: *const u8, size: usize) -> String {
    String::from_utf8_lossy(slice(data, size)).into_owned()
}

/// The proxy-wasm map encoding: count, (key len, value len) pairs, then NUL-terminated bytes.
pub fn serialize_map(map: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, v) in map {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

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

// ---- the host ABI --------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn proxy_log(level: LogLevel, data: *const u8, size: usize) -> Status {
    let msg = unsafe { string(data, size) };
    with(|h| h.logs.push((level, msg)));
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_log_level(level: *mut LogLevel) -> Status {
    *level = LogLevel::Trace;
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_current_time_nanoseconds(out: *mut u64) -> Status {
    *out = with(|h| h.now_ns);
    Status::Ok
}

#[no_mangle]
pub extern "C" fn proxy_set_tick_period_milliseconds(period: u32) -> Status {
    with(|h| h.tick_period_ms = period);
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_buffer_bytes(
    buffer: BufferType,
    start: usize,
    max_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let whole = with(|h| match buffer {
        BufferType::HttpRequestBody => h.bodies.get(&h.effective).cloned(),
        BufferType::HttpCallResponseBody => Some(h.call_response_body.clone()),
        BufferType::PluginConfiguration => Some(h.plugin_config.clone()),
        BufferType::VmConfiguration => Some(Vec::new()),
        _ => None,
    });
    let Some(whole) = whole else {
        return Status::NotFound;
    };
    let from = start.min(whole.len());
    let to = start.saturating_add(max_size).min(whole.len());
    give(&whole[from..to], data, size);
    Status::Ok
}

/// Envoy's semantics: bytes `[start, start + size)` of the buffer are replaced by the data.
#[no_mangle]
pub unsafe extern "C" fn proxy_set_buffer_bytes(
    buffer: BufferType,
    start: usize,
    size: usize,
    data: *const u8,
    len: usize,
) -> Status {
    if buffer != BufferType::HttpRequestBody {
        return Status::BadArgument;
    }
    let value = slice(data, len).to_vec();
    with(|h| {
        let ctx = h.effective;
        let body = h.bodies.entry(ctx).or_default();
        let from = start.min(body.len());
        let to = start.saturating_add(size).min(body.len());
        body.splice(from..to, value);
    });
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_pairs(
    map: MapType,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let bytes = with(|h| {
        let pairs = h
            .maps
            .get(&map_key(h.effective, map))
            .cloned()
            .unwrap_or_default();
        serialize_map(&pairs)
    });
    give(&bytes, data, size);
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_header_map_pairs(
    map: MapType,
    data: *const u8,
    size: usize,
) -> Status {
    let pairs = deserialize_map(slice(data, size));
    with(|h| {
        let key = map_key(h.effective, map);
        h.maps.insert(key, pairs);
    });
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_value(
    map: MapType,
    key_data: *const u8,
    key_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let key = string(key_data, key_size);
    let value = with(|h| {
        h.maps
            .get(&map_key(h.effective, map))
            .and_then(|m| find(m, &key).map(str::to_string))
    });
    match value {
        Some(v) => {
            give(v.as_bytes(), data, size);
            Status::Ok
        }
        None => Status::NotFound,
    }
}

#[no_mangle]
pub unsafe extern "C" fn proxy_replace_header_map_value(
    map: MapType,
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    let key = string(key_data, key_size).to_ascii_lowercase();
    let value = string(value_data, value_size);
    with(|h| {
        let key_at = map_key(h.effective, map);
        let m = h.maps.entry(key_at).or_default();
        m.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
        m.push((key, value));
    });
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_add_header_map_value(
    map: MapType,
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    let key = string(key_data, key_size).to_ascii_lowercase();
    let value = string(value_data, value_size);
    with(|h| {
        let key_at = map_key(h.effective, map);
        h.maps.entry(key_at).or_default().push((key, value));
    });
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_remove_header_map_value(
    map: MapType,
    key_data: *const u8,
    key_size: usize,
) -> Status {
    let key = string(key_data, key_size);
    with(|h| {
        let key_at = map_key(h.effective, map);
        if let Some(m) = h.maps.get_mut(&key_at) {
            m.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
        }
    });
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_property(
    _path_data: *const u8,
    _path_size: usize,
    _data: *mut *mut u8,
    _size: *mut usize,
) -> Status {
    Status::NotFound
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_property(
    _path_data: *const u8,
    _path_size: usize,
    _value_data: *const u8,
    _value_size: usize,
) -> Status {
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_shared_data(
    key_data: *const u8,
    key_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
    cas: *mut u32,
) -> Status {
    let key = string(key_data, key_size);
    match with(|h| h.shared.get(&key).cloned()) {
        Some((bytes, c)) => {
            give(&bytes, data, size);
            *cas = c;
            Status::Ok
        }
        None => Status::NotFound,
    }
}

/// Envoy's rules: a CAS token of 0 writes unconditionally; a set on a missing key ignores the
/// token; otherwise the token must match the stored one. Every write bumps the token.
#[no_mangle]
pub unsafe extern "C" fn proxy_set_shared_data(
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
    cas: u32,
) -> Status {
    let key = string(key_data, key_size);
    let value = slice(value_data, value_size).to_vec();
    with(|h| {
        let next = match h.shared.get(&key) {
            Some((_, current)) if cas != 0 && cas != *current => return Status::CasMismatch,
            Some(_) if cas != 0 && h.inject_cas_mismatches > 0 => {
                h.inject_cas_mismatches -= 1;
                return Status::CasMismatch;
            }
            Some((_, current)) => current.wrapping_add(1).max(1),
            None => 1,
        };
        *h.shared_writes.entry(key.clone()).or_insert(0) += 1;
        h.shared.insert(key, (value, next));
        Status::Ok
    })
}

#[no_mangle]
pub extern "C" fn proxy_continue_stream(stream: StreamType) -> Status {
    with(|h| {
        let ctx = h.effective;
        h.resumed.push((ctx, stream));
    });
    Status::Ok
}

#[no_mangle]
pub extern "C" fn proxy_close_stream(_stream: StreamType) -> Status {
    Status::Ok
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn proxy_send_local_response(
    status: u32,
    _details_data: *const u8,
    _details_size: usize,
    body_data: *const u8,
    body_size: usize,
    headers_data: *const u8,
    headers_size: usize,
    _grpc_status: i32,
) -> Status {
    let body = slice(body_data, body_size).to_vec();
    let headers = deserialize_map(slice(headers_data, headers_size));
    with(|h| {
        let context = h.effective;
        h.replies.push(Reply {
            context,
            status,
            headers,
            body,
        });
    });
    Status::Ok
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn proxy_http_call(
    upstream_data: *const u8,
    upstream_size: usize,
    headers_data: *const u8,
    headers_size: usize,
    _body_data: *const u8,
    _body_size: usize,
    _trailers_data: *const u8,
    _trailers_size: usize,
    _timeout_ms: u32,
    token: *mut u32,
) -> Status {
    let upstream = string(upstream_data, upstream_size);
    let headers = deserialize_map(slice(headers_data, headers_size));
    let t = with(|h| {
        h.next_token += 1;
        let t = h.next_token;
        let (context, during) = (h.effective, h.callback);
        h.calls.push(Call {
            context,
            during,
            token: t,
            upstream,
            headers,
        });
        t
    });
    *token = t;
    Status::Ok
}

#[no_mangle]
pub extern "C" fn proxy_set_effective_context(context: u32) -> Status {
    with(|h| {
        if h.live.contains(&context) {
            h.effective = context;
            Status::Ok
        } else {
            Status::BadArgument
        }
    })
}

#[no_mangle]
pub extern "C" fn proxy_done() -> Status {
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_define_metric(
    kind: MetricType,
    name_data: *const u8,
    name_size: usize,
    id: *mut u32,
) -> Status {
    let name = string(name_data, name_size);
    // Like Envoy: every definition gets its own id; ids of one name share one stat.
    *id = with(|h| {
        h.metrics.entry(name.clone()).or_insert(0);
        h.metric_ids.push((name, kind));
        h.metric_ids.len() as u32
    });
    Status::Ok
}

fn metric_by_id(h: &Host, id: u32) -> Option<(String, MetricType)> {
    h.metric_ids.get((id as usize).checked_sub(1)?).cloned()
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_metric(id: u32, value: *mut u64) -> Status {
    match with(|h| metric_by_id(h, id).map(|(n, _)| h.metrics[&n])) {
        Some(v) => {
            *value = v as u64;
            Status::Ok
        }
        None => Status::NotFound,
    }
}

/// A gauge is set; a counter adds (as Envoy does).
#[no_mangle]
pub extern "C" fn proxy_record_metric(id: u32, value: u64) -> Status {
    with(|h| match metric_by_id(h, id) {
        Some((name, kind)) => {
            let v = h.metrics.entry(name).or_insert(0);
            match kind {
                MetricType::Gauge => *v = value as i64,
                _ => *v += value as i64,
            }
            Status::Ok
        }
        None => Status::NotFound,
    })
}

#[no_mangle]
pub extern "C" fn proxy_increment_metric(id: u32, offset: i64) -> Status {
    with(|h| match metric_by_id(h, id) {
        Some((name, _)) => {
            *h.metrics.entry(name).or_insert(0) += offset;
            Status::Ok
        }
        None => Status::NotFound,
    })
}

// What the plugin never uses (shared queues, gRPC, foreign functions): present so the SDK links,
// and failing loudly should the plugin start to use one.

#[no_mangle]
pub extern "C" fn proxy_register_shared_queue(_n: *const u8, _s: usize, _id: *mut u32) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_resolve_shared_queue(
    _vm: *const u8,
    _vm_size: usize,
    _n: *const u8,
    _s: usize,
    _id: *mut u32,
) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_dequeue_shared_queue(_q: u32, _d: *mut *mut u8, _s: *mut usize) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_enqueue_shared_queue(_q: u32, _d: *const u8, _s: usize) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_get_status(_c: *mut u32, _d: *mut *mut u8, _s: *mut usize) -> Status {
    Status::InternalFailure
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn proxy_grpc_call(
    _u: *const u8,
    _us: usize,
    _sn: *const u8,
    _sns: usize,
    _m: *const u8,
    _ms: usize,
    _md: *const u8,
    _mds: usize,
    _msg: *const u8,
    _msgs: usize,
    _timeout: u32,
    _id: *mut u32,
) -> Status {
    Status::InternalFailure
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn proxy_grpc_stream(
    _u: *const u8,
    _us: usize,
    _sn: *const u8,
    _sns: usize,
    _m: *const u8,
    _ms: usize,
    _md: *const u8,
    _mds: usize,
    _id: *mut u32,
) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_grpc_send(_t: u32, _m: *const u8, _l: usize, _eos: bool) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_grpc_cancel(_t: u32) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_grpc_close(_t: u32) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub extern "C" fn proxy_call_foreign_function(
    _n: *const u8,
    _ns: usize,
    _a: *const u8,
    _as: usize,
    _r: *mut *mut u8,
    _rs: *mut usize,
) -> Status {
    Status::InternalFailure
}

// ---- the plugin's exports (the SDK's dispatcher) ---------------------------------------------

extern "C" {
    fn proxy_on_context_create(context_id: u32, root_context_id: u32);
    fn proxy_on_vm_start(context_id: u32, vm_configuration_size: usize) -> bool;
    fn proxy_on_configure(context_id: u32, plugin_configuration_size: usize) -> bool;
    fn proxy_on_tick(context_id: u32);
    fn proxy_on_request_headers(context_id: u32, num_headers: usize, eos: bool) -> Action;
    fn proxy_on_request_body(context_id: u32, body_size: usize, eos: bool) -> Action;
    fn proxy_on_request_trailers(context_id: u32, num_trailers: usize) -> Action;
    fn proxy_on_response_headers(context_id: u32, num_headers: usize, eos: bool) -> Action;
    fn proxy_on_response_body(context_id: u32, body_size: usize, eos: bool) -> Action;
    fn proxy_on_http_call_response(
        context_id: u32,
        token: u32,
        num_headers: usize,
        body_size: usize,
        num_trailers: usize,
    );
    fn proxy_on_log(context_id: u32);
    fn proxy_on_done(context_id: u32) -> bool;
    fn proxy_on_delete(context_id: u32);
}

/// Start of the wall clock in tests (2023-11-14), in ms.
pub const EPOCH_MS: u64 = 1_700_000_000_000;

/// One plugin VM (one Envoy worker) with its root context, driven like Envoy drives it.
pub struct Vm {
    pub root: u32,
    next_context: u32,
}

/// One HTTP stream through the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(pub u32);

impl Vm {
    /// A fresh host (shared data, metrics, clock at `EPOCH_MS`), the SDK's root context set to
    /// the plugin's, then the VM started and configured with `config`. Returns the VM and what
    /// `on_configure` answered.
    pub fn start(config: &str) -> (Vm, bool) {
        Vm::start_with(config, |_| {})
    }

    /// As `start`, with the host prepared by `prepare` first (e.g. shared data already there).
    pub fn start_with(config: &str, prepare: impl FnOnce(&mut Host)) -> (Vm, bool) {
        with(|h| {
            *h = Host {
                now_ns: EPOCH_MS * 1_000_000,
                ..Host::default()
            };
            prepare(h);
        });
        proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
            Box::new(crate::root::Root::new())
        });
        // Context ids are unique per dispatcher (a thread); start above any used before.
        let root = next_root_id();
        let mut vm = Vm {
            root,
            next_context: root + 1,
        };
        let ok = vm.configure(root, config);
        (vm, ok)
    }

    fn configure(&mut self, root: u32, config: &str) -> bool {
        with(|h| {
            h.live.insert(root);
            h.plugin_config = config.as_bytes().to_vec();
        });
        self.enter(root);
        unsafe {
            proxy_on_context_create(root, 0);
            assert!(proxy_on_vm_start(root, 0));
            proxy_on_configure(root, config.len())
        }
    }

    fn enter(&self, context: u32) {
        with(|h| {
            h.effective = context;
            h.callback = context;
        });
    }

    pub fn advance_ms(&self, ms: u64) {
        with(|h| h.now_ns += ms * 1_000_000);
    }

    pub fn now_ms() -> u64 {
        with(|h| h.now_ns / 1_000_000)
    }

    pub fn tick(&self) {
        self.enter(self.root);
        unsafe { proxy_on_tick(self.root) }
    }

    /// A new stream: headers (with `:method`, `:path`, `content-length`) then `extra`.
    pub fn open(
        &mut self,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        body: &[u8],
    ) -> Stream {
        let id = self.next_context;
        self.next_context += 1;
        let mut headers = vec![
            (":method".to_string(), method.to_string()),
            (":path".to_string(), path.to_string()),
            (":authority".to_string(), "gateway".to_string()),
            ("content-length".to_string(), body.len().to_string()),
        ];
        headers.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        with(|h| {
            h.live.insert(id);
            h.maps
                .insert((id, MapType::HttpRequestHeaders as u32), headers.clone());
        });
        unsafe { proxy_on_context_create(id, self.root) };
        Stream(id)
    }

    pub fn request_headers(&self, s: Stream, end_of_stream: bool) -> Action {
        self.enter(s.0);
        let n = with(|h| h.maps[&(s.0, MapType::HttpRequestHeaders as u32)].len());
        unsafe { proxy_on_request_headers(s.0, n, end_of_stream) }
    }

    /// Append a chunk to the buffered request body and call the body callback.
    pub fn request_body(&self, s: Stream, chunk: &[u8], end_of_stream: bool) -> Action {
        self.enter(s.0);
        let size = with(|h| {
            let b = h.bodies.entry(s.0).or_default();
            b.extend_from_slice(chunk);
            b.len()
        });
        unsafe { proxy_on_request_body(s.0, size, end_of_stream) }
    }

    pub fn request_trailers(&self, s: Stream) -> Action {
        self.enter(s.0);
        unsafe { proxy_on_request_trailers(s.0, 1) }
    }

    /// Headers, then the whole body in one callback: what Envoy does for a small request.
    pub fn post(&mut self, path: &str, extra: &[(&str, &str)], body: &str) -> (Stream, Action) {
        let s = self.open("POST", path, extra, body.as_bytes());
        assert_eq!(self.request_headers(s, false), Action::Continue);
        let a = self.request_body(s, body.as_bytes(), true);
        (s, a)
    }

    /// The upstream's response headers (`:status` 200) and its whole body.
    pub fn respond(&self, s: Stream) {
        self.enter(s.0);
        with(|h| {
            h.maps.insert(
                (s.0, MapType::HttpResponseHeaders as u32),
                vec![(":status".to_string(), "200".to_string())],
            );
        });
        unsafe {
            proxy_on_response_headers(s.0, 1, false);
            proxy_on_response_body(s.0, 10, true);
        }
    }

    /// The end of a stream, as Envoy ends every one: log, done, delete.
    pub fn finish(&self, s: Stream) {
        self.enter(s.0);
        unsafe {
            proxy_on_log(s.0);
            proxy_on_done(s.0);
            proxy_on_delete(s.0);
        }
        with(|h| {
            h.live.remove(&s.0);
        });
    }

    /// Deliver the answer to callout `token` (the host calls back with the root context id,
    /// whatever context sent it; the SDK routes by token).
    pub fn answer_call(&self, token: u32, status: u32, body: &[u8]) {
        with(|h| {
            h.maps.insert(
                (0, MapType::HttpCallResponseHeaders as u32),
                vec![(":status".to_string(), status.to_string())],
            );
            h.call_response_body = body.to_vec();
        });
        self.enter(self.root);
        unsafe { proxy_on_http_call_response(self.root, token, 1, body.len(), 0) }
    }

    pub fn response_header(s: Stream, name: &str) -> Option<String> {
        with(|h| {
            h.maps
                .get(&(s.0, MapType::HttpResponseHeaders as u32))
                .and_then(|m| find(m, name).map(str::to_string))
        })
    }

    pub fn request_header(s: Stream, name: &str) -> Option<String> {
        with(|h| {
            h.maps
                .get(&(s.0, MapType::HttpRequestHeaders as u32))
                .and_then(|m| find(m, name).map(str::to_string))
        })
    }

    pub fn body(s: Stream) -> Vec<u8> {
        with(|h| h.bodies.get(&s.0).cloned().unwrap_or_default())
    }

    pub fn replies(s: Stream) -> Vec<Reply> {
        with(|h| {
            h.replies
                .iter()
                .filter(|r| r.context == s.0)
                .cloned()
                .collect()
        })
    }

    pub fn calls() -> Vec<Call> {
        with(|h| h.calls.clone())
    }

    pub fn resumed(s: Stream) -> bool {
        with(|h| {
            h.resumed
                .iter()
                .any(|(c, t)| *c == s.0 && *t == StreamType::HttpRequest)
        })
    }

    /// A metric's value by name (0 when never moved).
    pub fn metric(name: &str) -> i64 {
        with(|h| h.metrics.get(name).copied().unwrap_or(0))
    }
}

/// Each `Vm` in a thread gets root ids above the last one: the SDK's dispatcher is per thread
/// and never forgets a root context.
fn next_root_id() -> u32 {
    thread_local! {
        static NEXT: std::cell::Cell<u32> = const { std::cell::Cell::new(1) };
    }
    NEXT.with(|n| {
        let id = n.get();
        n.set(id + 1000);
        id
    })
}
