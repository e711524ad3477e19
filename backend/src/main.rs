//! kvgate-backend: an OpenAI-compatible LLM server with continuous batching and a KV block pool
//! under a hard byte budget, reporting its leases to the kvgate filter.

use kvgate_backend::{api, engine, metrics, model, pool, synthetic, tokenizer};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use clap::Parser;

use crate::engine::{Admission, EngineConfig, OnKvExhaustion};

/// An OpenAI-compatible LLM server whose KV cache is a block pool with a hard byte budget.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// GGUF model file (Llama family). `make setup` fetches the default SmolLM2-135M-Instruct.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Serve a model of a named shape with random weights instead of `--model`: `smollm2`
    /// (SmolLM2-135M's shape), `llama8b` (Llama-3-8B's) or `tiny`. No file is read; the tokenizer
    /// is byte-level (see `synthetic.rs`). For throughput tests and CPU/GPU comparisons.
    #[arg(long, value_name = "SHAPE", conflicts_with = "model")]
    synthetic: Option<String>,
    /// Seed of the synthetic weights (same seed, same weights, on every device).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The model name clients send (`model` field) and /v1/models lists [default: the GGUF's
    /// `general.name`, else its file name without `.gguf`; `smollm2-135m-instruct` for the
    /// bundled SmolLM2 file; synthetic-SHAPE].
    #[arg(long)]
    model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Device: `cpu`, or `cuda:N` (build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Where the KV cache lives. `paged`: one arena of `--kv-cache-bytes`, allocated at start on
    /// the device, whose blocks are the pool's blocks; attention reads it there. `host`: each
    /// sequence's cache in host memory, attention in a tight host loop (faster on CPU).
    /// `auto`: `paged`. The paged arena caches prompt blocks for the prompts that start the
    /// same way (prefix caching: agents sharing a system prompt share its blocks and skip its
    /// prefill); `host` does not.
    #[arg(long, value_enum, default_value_t = KvLayout::Auto)]
    kv_layout: KvLayout,
    /// Type of the projection weights and of the paged KV arena. `auto`: bf16 on CUDA, f32 on
    /// CPU. `stored` (CPU): the GGUF's Q4_1 and Q8_0 matrices kept as stored and dequantized a
    /// row at a time where they are multiplied (f32's outputs, bit for bit, in 0.27x the
    /// resident memory), other types and the KV in f32. On CPU, `bf16` halves the bytes a
    /// decode step reads at the cost of drift into other text; f16 falls back to a slow path
    /// there. The host KV layout is always f32. The KV type sets `kv_dtype_bytes` in the
    /// descriptor, so the gateway prices what the arena really holds.
    #[arg(long, value_enum, default_value_t = WeightType::Auto)]
    dtype: WeightType,
    /// Hard budget of the KV cache in bytes (rounded down to whole blocks).
    #[arg(long, default_value_t = 512 * 1024 * 1024)]
    kv_cache_bytes: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// `reserve`: hold prompt + max_tokens blocks from arrival, 429 when they are not free (never
    /// OOM mid-decode). `prompt`: hold only the prompt's blocks from arrival (429 when they are
    /// not free) and take the rest as the output grows: admission on prompt length alone, as
    /// servers without kvgate do, kept for comparison (can fail mid-decode). `none`: take blocks
    /// as sequences grow (can fail mid-decode).
    #[arg(long, value_enum, default_value_t = Admission::Reserve)]
    admission: Admission,
    /// What a running sequence that needs a KV block does when none is free (only happens with
    /// `--admission none`). `error`: it ends with an error event (a mid-decode KV OOM).
    /// `recompute` (vLLM's way): the youngest other running sequence gives back its blocks and
    /// is recomputed later from its prompt + the tokens it generated; its client sees a pause,
    /// not an error.
    #[arg(long, value_enum, default_value_t = OnKvExhaustion::Error)]
    on_kv_exhaustion: OnKvExhaustion,
    /// With `--admission reserve`: a reservation is a promise of blocks, taken as the sequence
    /// grows into them. Requests are admitted while the peak of what the live sequences can
    /// hold together at any step to come fits the pool (decoding ones end at their caps; see
    /// docs/admission.md, "Priced over time"), but blocks promised and not taken yet are free for elastic sequences grown
    /// past their reservations to borrow; the one they were promised to takes them back when it
    /// needs them. So admitting a request never preempts a borrower. On by default (`--lazy-blocks
    /// false`: blocks taken at admission).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    lazy_blocks: bool,
    /// Most sequences decoded together in one batched step.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Prompt tokens prefilled per scheduler step, between decode steps: a longer prompt is fed
    /// in chunks over several steps. Smaller: running streams pause less while a long prompt
    /// arrives; larger: the prompt's first token comes sooner. It also bounds the prefill's
    /// scratch memory (logged at start, and in the descriptor as `prefill_scratch_bytes`).
    #[arg(long, default_value_t = 256)]
    prefill_token_budget: usize,
    /// Cap on the context length (the model's own is used when smaller).
    #[arg(long, default_value_t = 8192)]
    max_context: usize,
    /// The largest request body accepted, in bytes; a larger one is refused with an
    /// OpenAI-style 413 (`request_body_too_large`). The default is the filter's default
    /// `max_body_bytes` plus 64 KiB for what the gateway writes into a body it admits (the
    /// cap, its note): keep it that much above the filter's.
    #[arg(long, default_value_t = 4 * 1024 * 1024 + 64 * 1024)]
    max_body_bytes: usize,
    /// A file holding the secret the gateway sends (`x-kvgate-secret`) on admission calls and on
    /// requests that carry a lease; one per line (or comma-separated), any of them accepted: the
    /// current one and the next, so a rotation is no outage. `KVGATE_ADMISSION_SECRET` also
    /// works. Required unless `--host` is a loopback address.
    #[arg(long)]
    admission_secret_file: Option<PathBuf>,
    /// Print the filter's `model` and exact `tokenizer` for `--model` (its KV shape, with the KV
    /// type of `--dtype`: f32 unless said, and the context of `--max-context`) as JSON, and
    /// exit: what the filter prices with in front of a server without kvgate's descriptor,
    /// such as a vLLM serving the same model (docs/vllm.md).
    #[arg(long, conflicts_with = "synthetic")]
    describe: bool,
    /// Test only: sleep this many milliseconds in every busy scheduler step (a slow backend on
    /// demand, for sustained-load tests of the gateway).
    #[arg(long, default_value_t = 0, hide = true)]
    step_delay_ms: u64,
}

/// The model `make setup` fetches, and the name it is served under.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";

/// The name a GGUF is served under without `--model-name`: the bundled default's own, else the
/// file's `general.name` (trimmed, if it is a printable one), else its file stem.
fn default_model_name(path: &Path, ct: &gguf_file::Content) -> String {
    if path.file_name() == Path::new(DEFAULT_MODEL).file_name() {
        return DEFAULT_MODEL_NAME.to_string();
    }
    let usable = |s: &str| {
        let s = s.trim();
        (!s.is_empty() && !s.chars().any(char::is_control)).then(|| s.to_string())
    };
    ct.metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok())
        .and_then(|s| usable(s))
        .or_else(|| usable(&path.file_stem()?.to_string_lossy()))
        .unwrap_or_else(|| DEFAULT_MODEL_NAME.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WeightType {
    Auto,
    Stored,
    F32,
    Bf16,
    F16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum KvLayout {
    Auto,
    Paged,
    Host,
}

fn device(spec: &str) -> Result<Device> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    if let Some(n) = spec.strip_prefix("cuda:") {
        let n: usize = n.parse().with_context(|| format!("bad device {spec:?}"))?;
        return Device::new_cuda(n)
            .with_context(|| format!("CUDA device {n} (was this built with --features cuda?)"));
    }
    bail!("unknown device {spec:?}: use cpu or cuda:N")
}

/// Any panic ends the process, as `panic = "abort"` would: a panic on the engine's thread or in
/// a handler must not leave a server that accepts requests it will never answer. A hook and not
/// the profile setting, so that `cargo test --release` (unwinding, for the test harness) and the
/// binary share one build of the dependency tree (12m35s -> 8m00s from scratch on 2 cores).
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}

/// `--describe`: the filter configuration's `model` and `tokenizer` for this model.
fn describe(
    cfg: &model::Config,
    tok: &tokenizer::Tokenizer,
    dtype: WeightType,
    cpu: bool,
) -> Result<()> {
    use kvgate_core::tokenize::ChatTemplate;
    let mut spec = cfg.kv_spec();
    // The paged arena's type (`auto` is bf16 off the CPU).
    spec.kv_dtype_bytes = match (dtype, cpu) {
        (WeightType::Bf16 | WeightType::F16, _) | (WeightType::Auto, false) => 2,
        (WeightType::Auto | WeightType::Stored, true) | (WeightType::F32, _) => 4,
        (WeightType::Stored, false) => 2,
    };
    let (bos, eos) = match &tok.bpe.chat_template {
        ChatTemplate::Jinja {
            bos_token,
            eos_token,
            ..
        } => (bos_token.as_str(), eos_token.as_str()),
        ChatTemplate::ChatMl => ("", ""),
    };
    let special: std::collections::BTreeMap<&str, u32> = tok
        .bpe
        .special_tokens
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    let out = serde_json::json!({
        "model": spec,
        "tokenizer": {
            "ranks": tok.bpe.to_tiktoken(),
            "pattern": tok.bpe.pattern,
            "special_tokens": special,
            "chat_template": tok.bpe.chat_template.wire(),
            "bos_token": bos,
            "eos_token": eos,
            "add_bos": tok.bpe.add_bos,
        },
    });
    println!("{out}");
    Ok(())
}

/// The admission secrets, from `--admission-secret-file` or else `KVGATE_ADMISSION_SECRET`
/// (`env`): one per line or comma-separated, each trimmed (a secret mounted from a Kubernetes
/// Secret or written by `echo` ends in a newline the gateway does not send). None: empty.
fn admission_secrets(file: Option<&Path>, env: Option<String>) -> Result<Vec<String>> {
    let text = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the admission secret {}", path.display()))?,
        None => env.unwrap_or_default(),
    };
    Ok(text
        .split(['\n', ','])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect())
}

/// Without a secret the admission API (lease report, cancel, demote) and the lease headers are
/// open to whoever reaches the port: refused unless the backend listens on loopback only.
fn check_exposure(host: &str, secrets: &[String]) -> Result<()> {
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if secrets.is_empty() && !loopback {
        bail!(
            "--host {host} is reachable beyond this machine, and no admission secret is set: \
             anyone reaching the port could read, cancel and forge leases. Set one with \
             --admission-secret-file or KVGATE_ADMISSION_SECRET (e.g. `openssl rand -hex 32`), \
             and give the gateway the same (`backend.secret`)"
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    abort_on_panic();
    let args = Args::parse();
    let admission_secrets = admission_secrets(
        args.admission_secret_file.as_deref(),
        std::env::var("KVGATE_ADMISSION_SECRET").ok(),
    )?;
    check_exposure(&args.host, &admission_secrets)?;
    let dev = device(&args.device)?;
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let started = std::time::Instant::now();
    let (cfg, tok, llama, model_name) = match &args.synthetic {
        Some(shape) => {
            let cfg = synthetic::config(shape, args.max_context)?;
            let tok = synthetic::tokenizer(cfg.vocab)?;
            let llama = model::Llama::synthetic(cfg.clone(), args.seed, &dev)?;
            (cfg, tok, llama, format!("synthetic-{shape}"))
        }
        None => {
            let mut file = std::fs::File::open(&args.model).with_context(|| {
                format!(
                    "opening model {} (run `make setup` to fetch the default model)",
                    args.model.display()
                )
            })?;
            let ct = gguf_file::Content::read(&mut file)
                .with_context(|| format!("reading GGUF {}", args.model.display()))?;
            let cfg = model::Config::from_gguf(&ct, args.max_context)?;
            let tok = tokenizer::Tokenizer::from_gguf(&ct)?;
            if args.describe {
                return describe(&cfg, &tok, args.dtype, dev.is_cpu());
            }
            if let Some(w) = tokenizer::merge_order_warning(&ct) {
                eprintln!("kvgate-backend: {w}");
            }
            let llama = match args.dtype {
                WeightType::Stored => {
                    model::Llama::from_gguf_as_stored(&ct, &mut file, cfg.clone(), &dev)?
                }
                _ => model::Llama::from_gguf(&ct, &mut file, cfg.clone(), &dev)?,
            };
            let name = default_model_name(&args.model, &ct);
            (cfg, tok, llama, name)
        }
    };
    let model_name = args.model_name.clone().unwrap_or(model_name);
    let tok = Arc::new(tok);
    let paged = match args.kv_layout {
        KvLayout::Paged => true,
        KvLayout::Host => false,
        // Prefix caching shares blocks, which only the arena can: paged on the CPU too.
        KvLayout::Auto => true,
    };
    let dtype = match args.dtype {
        WeightType::Auto | WeightType::Stored if dev.is_cpu() => DType::F32,
        WeightType::Auto | WeightType::Stored | WeightType::Bf16 => DType::BF16,
        WeightType::F16 => DType::F16,
        WeightType::F32 => DType::F32,
    };
    let kv_dtype = if paged { dtype } else { DType::F32 };
    let llama = llama.with_dtype(dtype)?;
    let mut spec = cfg.kv_spec();
    spec.kv_dtype_bytes = kv_dtype.size_in_bytes() as u64;
    spec.validate()?;
    let per_token = spec
        .kv_bytes_per_token()
        .context("KV bytes per token overflow")?;
    let pool = pool::BlockPool::new(args.kv_cache_bytes, args.block_size, per_token);
    let stats = pool.stats();
    if stats.blocks_total == 0 {
        bail!(
            "--kv-cache-bytes {} is smaller than one block ({} bytes)",
            args.kv_cache_bytes,
            stats.block_bytes
        );
    }
    let llama = if paged {
        llama
            .with_paged_kv(
                stats.blocks_total as usize,
                stats.block_tokens as usize,
                kv_dtype,
            )
            .context("allocating the KV arena (lower --kv-cache-bytes)")?
    } else {
        llama
    };
    // Serve no more context than the pool can hold for one sequence (vLLM refuses to start in
    // that case; we clamp and say so): a request without max_tokens is then priced at what can
    // really run, not refused as larger than the whole pool.
    let pool_tokens = u64::from(stats.blocks_total) * u64::from(stats.block_tokens);
    if pool_tokens < spec.context_tokens {
        eprintln!(
            "kvgate-backend: the KV pool holds {pool_tokens} tokens, less than the model's context \
             of {}: serving a context of {pool_tokens} tokens (raise --kv-cache-bytes to serve more)",
            spec.context_tokens
        );
        spec.context_tokens = pool_tokens;
    }
    let prefill_token_budget = args.prefill_token_budget.max(1);
    let prefill_scratch =
        llama.prefill_scratch_bytes(prefill_token_budget, spec.context_tokens as usize);
    let decode_scratch =
        llama.decode_scratch_bytes(args.max_batch.max(1), spec.context_tokens as usize);
    let metrics = Arc::new(metrics::Metrics::default());
    let engine = engine::spawn(
        llama,
        Arc::clone(&tok),
        pool,
        EngineConfig {
            admission: args.admission,
            on_kv_exhaustion: args.on_kv_exhaustion,
            max_batch: args.max_batch.max(1),
            prefill_token_budget,
            lazy_blocks: args.lazy_blocks,
            prefix_caching: paged,
            step_delay: std::time::Duration::from_millis(args.step_delay_ms),
        },
        metrics,
    );
    if admission_secrets.is_empty() {
        eprintln!(
            "warning: no admission secret (--admission-secret-file): the admission API and lease headers are \
             accepted from anyone who can reach this port (loopback only)"
        );
    }
    let state = Arc::new(api::AppState {
        engine,
        tok,
        model_name: model_name.clone(),
        spec,
        admission: args.admission,
        admission_secrets,
        scratch_margin_bytes: stats.block_bytes,
        prefill_scratch_bytes: prefill_scratch,
        decode_scratch_bytes: decode_scratch,
        prefix_caching: paged,
        max_body_bytes: args.max_body_bytes.max(1),
        pollers: Default::default(),
        validation_slots: Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        )),
    });
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .context("bad --host/--port")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    eprintln!(
        "kvgate-backend {} serving {} on http://{} ({}; {} layers, {} KV heads x {}, context {}; KV pool {} blocks x {} tokens = {} bytes, {} B/token; {} KV in {:?}, weights {}; prefill {} tokens a step, scratch at most {} bytes beside the pool (a decode step's: {} bytes); admission {:?}{}; on KV exhaustion {:?}; prefix caching {}; loaded in {:.1}s)",
        env!("CARGO_PKG_VERSION"),
        model_name,
        listener.local_addr()?,
        args.device,
        cfg.layers,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.context,
        stats.blocks_total,
        stats.block_tokens,
        stats.capacity_bytes,
        per_token,
        if paged { "paged" } else { "host" },
        kv_dtype,
        match (args.dtype, dev.is_cpu()) {
            (WeightType::Stored, true) => "as stored (Q4_1 and Q8_0 kept, others F32)".to_string(),
            _ => format!("{dtype:?}"),
        },
        prefill_token_budget,
        prefill_scratch,
        decode_scratch,
        args.admission,
        if args.lazy_blocks { " (lazy blocks)" } else { "" },
        args.on_kv_exhaustion,
        if paged {
            "on"
        } else {
            "off (host KV layout)"
        },
        started.elapsed().as_secs_f64(),
    );
    let app = api::router(state).into_make_service_with_connect_info::<api::ServedAt>();
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::path::Path;
    use std::process::Command;

    use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};

    fn gguf(name: Option<&str>) -> Content {
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: name
                .map(|n| ("general.name".to_string(), Value::String(n.into())))
                .into_iter()
                .collect(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn a_gguf_is_served_under_its_own_name() {
        let name =
            |path: &str, n: Option<&str>| super::default_model_name(Path::new(path), &gguf(n));
        assert_eq!(
            name("/m/qwen.gguf", Some(" Qwen2.5 0.5B Instruct\n")),
            "Qwen2.5 0.5B Instruct"
        );
        assert_eq!(name("/m/Llama-3.2-1B.Q8_0.gguf", None), "Llama-3.2-1B.Q8_0");
        assert_eq!(
            name("/m/Llama-3.2-1B.Q8_0.gguf", Some("  ")),
            "Llama-3.2-1B.Q8_0"
        );
        assert_eq!(name("/m/x.gguf", Some("two\nlines")), "x");
        // The bundled default keeps the name every client and test uses (its general.name is
        // "Smollm2 135M 8k Lc100K Mix1 Ep2").
        let bundled = "/repo/models/SmolLM2-135M-Instruct.Q4_1.gguf";
        assert_eq!(
            name(bundled, Some("Smollm2 135M 8k Lc100K Mix1 Ep2")),
            "smollm2-135m-instruct"
        );
        assert_eq!(name(super::DEFAULT_MODEL, None), "smollm2-135m-instruct");
    }

    #[test]
    fn the_admission_secrets_are_trimmed_from_the_environment_as_from_a_file() {
        let secrets = |env: &str| super::admission_secrets(None, Some(env.to_string())).unwrap();
        assert_eq!(secrets("s3cret\n"), ["s3cret"]);
        assert_eq!(secrets(" s3cret \r\n"), ["s3cret"]);
        assert_eq!(secrets("current, next"), ["current", "next"], "rotation");
        assert!(
            secrets(" \n").is_empty(),
            "empty: none, as an empty file gives"
        );
        assert!(super::admission_secrets(None, None).unwrap().is_empty());
        let dir = std::env::temp_dir().join(format!("kvgate-secret-{}", std::process::id()));
        std::fs::write(&dir, "from-file\nnext\n").unwrap();
        let from_file = super::admission_secrets(Some(&dir), Some("env".into())).unwrap();
        std::fs::write(&dir, "\n").unwrap();
        let empty_file = super::admission_secrets(Some(&dir), Some("env".into())).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(from_file, ["from-file", "next"], "the file wins");
        assert!(empty_file.is_empty());
        assert!(
            super::admission_secrets(Some(&dir), None).is_err(),
            "gone: an error"
        );
    }

    #[test]
    fn without_a_secret_only_loopback_is_served() {
        let none: &[String] = &[];
        for host in ["127.0.0.1", "::1", "localhost", "127.0.0.2"] {
            assert!(super::check_exposure(host, none).is_ok(), "{host}");
        }
        for host in ["0.0.0.0", "::", "10.0.0.5", "backend.local"] {
            let e = super::check_exposure(host, none).unwrap_err().to_string();
            assert!(e.contains("admission secret"), "{host}: {e}");
            assert!(super::check_exposure(host, &["s".to_string()]).is_ok());
        }
    }

    const CHILD: &str = "KVGATE_TEST_PANIC_CHILD";
    const SIGABRT: i32 = 6;

    /// A panic anywhere, here on a thread other than main (as the engine's is), ends the whole
    /// process with SIGABRT. The test runs itself again as a child to see that happen.
    #[test]
    fn a_panic_on_any_thread_aborts_the_process() {
        if std::env::var_os(CHILD).is_some() {
            super::abort_on_panic();
            let _ = std::thread::spawn(|| panic!("a fault on the engine's thread")).join();
            // Unwinding would get here and exit 0: the hook must have aborted first.
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("the test binary");
        let out = Command::new(exe)
            .args([
                "--exact",
                "tests::a_panic_on_any_thread_aborts_the_process",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        assert_eq!(
            out.status.signal(),
            Some(SIGABRT),
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("a fault on the engine's thread"));
    }
}
