//! `Vm`: one plugin VM driven as Envoy drives it, through the SDK's exported entry points
//! (`proxy_on_*`), with the effective context set before each callback.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::indexing_slicing)]

use proxy_wasm::types::{Action, MapType, StreamType};

use super::{find, with, Call, Host, Reply};

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
        // No lease id forced by an earlier test on this thread is left for this one.
        crate::worker::FORCED_LEASE_IDS.with(|f| f.borrow_mut().clear());
        proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
            Box::new(crate::root::Root::new())
        });
        // Context ids are unique per dispatcher (a thread); start above any used before.
        let root = next_root_id();
        let vm = Vm {
            root,
            next_context: root + 1,
        };
        with(|h| {
            h.live.insert(root);
        });
        vm.enter(root);
        unsafe {
            proxy_on_context_create(root, 0);
            assert!(proxy_on_vm_start(root, 0));
        }
        let ok = vm.reconfigure(config);
        (vm, ok)
    }

    /// Deliver a (new) plugin configuration to the root context, as Envoy does on start and on
    /// an update that keeps the VM.
    pub fn reconfigure(&self, config: &str) -> bool {
        with(|h| h.plugin_config = config.as_bytes().to_vec());
        self.enter(self.root);
        unsafe { proxy_on_configure(self.root, config.len()) }
    }

    /// A configuration update as Envoy applies it to a running VM: a new root context beside
    /// the old one, configured with `config`. Streams opened from now on belong to it; those
    /// already open keep theirs. Returns the old root's id (for `retire_root`) and what
    /// `on_configure` answered.
    pub fn new_root(&mut self, config: &str) -> (u32, bool) {
        let old = self.root;
        let root = self.next_context;
        self.next_context += 1;
        self.root = root;
        with(|h| {
            h.live.insert(root);
        });
        self.enter(root);
        unsafe { proxy_on_context_create(root, 0) };
        (old, self.reconfigure(config))
    }

    /// The end of an old root context, once its last stream is done.
    pub fn retire_root(&self, root: u32) {
        self.enter(root);
        unsafe {
            proxy_on_done(root);
            proxy_on_delete(root);
        }
        with(|h| {
            h.live.remove(&root);
        });
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

    /// The wall clock stepped back (as NTP may do).
    pub fn advance_ms_back(&self, ms: u64) {
        with(|h| h.now_ns = h.now_ns.saturating_sub(ms * 1_000_000));
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
            // A local client of a listener on loopback, unless the test says otherwise.
            for (side, addr) in [
                ("source", "127.0.0.1:40000"),
                ("destination", "127.0.0.1:10000"),
            ] {
                h.properties
                    .insert((id, format!("{side}\0address")), addr.into());
            }
        });
        unsafe { proxy_on_context_create(id, self.root) };
        Stream(id)
    }

    /// Set what the filter reads as `side.address` (`source` or `destination`) on `s`.
    pub fn set_address(&self, s: Stream, side: &str, addr: &str) {
        with(|h| {
            h.properties
                .insert((s.0, format!("{side}\0address")), addr.into())
        });
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

    /// The upstream's response headers with `status`, from the host at `upstream` (what
    /// `upstream.address` reads), and an end of stream.
    pub fn respond_from(&self, s: Stream, status: u32, upstream: &str) {
        self.enter(s.0);
        with(|h| {
            h.maps.insert(
                (s.0, MapType::HttpResponseHeaders as u32),
                vec![(":status".to_string(), status.to_string())],
            );
            h.properties
                .insert((s.0, "upstream\0address".to_string()), upstream.into());
        });
        unsafe {
            proxy_on_response_headers(s.0, 1, false);
            proxy_on_response_body(s.0, 10, true);
        }
    }

    /// A property the filter set on stream `s` (`path` segments joined as the ABI does).
    pub fn property(s: Stream, path: &[&str]) -> Option<Vec<u8>> {
        let key = path.join("\0");
        with(|h| h.properties.get(&(s.0, key)).cloned())
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
