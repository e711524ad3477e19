//! Raw proxy-wasm host calls for the few operations whose SDK wrappers panic on a status other
//! than `Ok` (e.g. touching request headers after they were forwarded answers `NotFound`, and a
//! non-UTF-8 header value makes the SDK's `get_map_value` unwrap). Here every status is returned.

use proxy_wasm::types::{BufferType, MapType, Status};

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> Status;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> Status;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> Status;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> Status;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
}

fn check(s: Status) -> Result<(), Status> {
    match s {
        Status::Ok => Ok(()),
        other => Err(other),
    }
}

/// A header's value as (lossy) UTF-8, `None` when absent or unreadable.
pub fn header(map: MapType, key: &str) -> Option<String> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a buffer it allocated through this module's allocator (exported by
    // the SDK) and its size; ownership passes to us and `from_raw_parts` frees it on drop.
    unsafe {
        match proxy_get_header_map_value(map, key.as_ptr(), key.len(), &mut data, &mut size) {
            Status::Ok if !data.is_null() => {
                let bytes = Vec::from_raw_parts(data, size, size);
                Some(String::from_utf8_lossy(&bytes).into_owned())
            }
            Status::Ok => Some(String::new()),
            _ => None,
        }
    }
}

pub fn set_header(map: MapType, key: &str, value: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe live borrowed slices for the duration of the call.
    check(unsafe {
        proxy_replace_header_map_value(map, key.as_ptr(), key.len(), value.as_ptr(), value.len())
    })
}

pub fn remove_header(map: MapType, key: &str) -> Result<(), Status> {
    // SAFETY: as above.
    check(unsafe { proxy_remove_header_map_value(map, key.as_ptr(), key.len()) })
}

pub fn set_buffer(
    buffer: BufferType,
    start: usize,
    size: usize,
    value: &[u8],
) -> Result<(), Status> {
    // SAFETY: as above.
    check(unsafe { proxy_set_buffer_bytes(buffer, start, size, value.as_ptr(), value.len()) })
}

/// A property path as the ABI expects: the segments joined by NUL, with no NUL after the last
/// (Envoy takes the bytes as they are: a trailing NUL would name another filter state key).
fn property_path(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

/// Write filter state (Envoy stores `path[0]` as `wasm.<path[0]>`, readable by other filters as
/// `%FILTER_STATE(wasm.<name>:PLAIN)%`).
pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), Status> {
    let p = property_path(path);
    // SAFETY: as above.
    check(unsafe { proxy_set_property(p.as_ptr(), p.len(), value.as_ptr(), value.len()) })
}

/// A property's bytes, `None` when absent or unreadable.
pub fn get_property(path: &[&str]) -> Option<Vec<u8>> {
    let p = property_path(path);
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: as in `header`: the host's buffer becomes ours.
    unsafe {
        match proxy_get_property(p.as_ptr(), p.len(), &mut data, &mut size) {
            Status::Ok if !data.is_null() => Some(Vec::from_raw_parts(data, size, size)),
            _ => None,
        }
    }
}

/// Serialize headers as the proxy-wasm ABI expects: count, then (key len, value len) pairs, then
/// each key and value NUL-terminated. (The native test host encodes with this too.)
pub(crate) fn serialize_map<K: AsRef<str>, V: AsRef<str>>(map: &[(K, V)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in map {
        size += 8 + k.as_ref().len() + v.as_ref().len() + 2;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, v) in map {
        out.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        out.extend_from_slice(k.as_ref().as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_ref().as_bytes());
        out.push(0);
    }
    out
}

pub fn send_local_response(
    status: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), Status> {
    let h = serialize_map(headers);
    // SAFETY: as above.
    check(unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    })
}
