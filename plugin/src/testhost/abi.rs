//! The proxy-wasm host ABI (the `env` imports of proxy-wasm 0.2.5's `hostcalls` and of this
//! crate's `abi`), as `#[no_mangle]` functions over this thread's `Host`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::indexing_slicing, clippy::missing_safety_doc)]

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status, StreamType};

use super::{
    deserialize_map, find, give, map_key, serialize_map, slice, string, with, Call, Host, Reply,
};

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
    path_data: *const u8,
    path_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let path = string(path_data, path_size);
    match with(|h| h.properties.get(&(h.effective, path)).cloned()) {
        Some(v) => {
            give(&v, data, size);
            Status::Ok
        }
        None => Status::NotFound,
    }
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_property(
    path_data: *const u8,
    path_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    let path = string(path_data, path_size);
    let value = slice(value_data, value_size).to_vec();
    with(|h| h.properties.insert((h.effective, path), value));
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
