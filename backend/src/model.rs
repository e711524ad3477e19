//! A Llama-family decoder on candle, built for continuous batching.
//!
//! Unlike candle-transformers' llama (one process-wide cache, one sequence), every sequence owns
//! its KV state (`SeqKv`) and a decode step runs ONE batched forward for all running sequences:
//! embeddings, norms, projections and the MLP run on a `[batch, hidden]` matrix, so the weights are
//! read once per step whatever the batch; only attention, whose length differs per sequence, runs
//! per sequence. Weights are loaded from GGUF and dequantized to f32 (the Q4_1 weights as shipped
//! drift into wrong text; see shared/FACTS.md).
//!
//! Forward passes are CPU/GPU bound and must never run on the async executor: the engine thread
//! owns the model.

use std::path::Path;

use anyhow::{bail, Context as _, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, IndexOp, Tensor};
use kvgate_core::ModelSpec;

/// Hyper-parameters as read from the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    pub context: usize,
}

impl Config {
    pub fn from_gguf(ct: &gguf_file::Content, max_context: usize) -> Result<Config> {
        let arch = md_str(ct, "general.architecture").unwrap_or_else(|_| "llama".into());
        if arch != "llama" {
            bail!(
                "unsupported architecture {arch:?}: kvgate-backend serves Llama-family GGUF models"
            );
        }
        let u = |k: &str| -> Result<usize> {
            Ok(ct
                .metadata
                .get(k)
                .with_context(|| format!("GGUF metadata {k} missing"))?
                .to_u32()? as usize)
        };
        let hidden = u("llama.embedding_length")?;
        let heads = u("llama.attention.head_count")?;
        let kv_heads = u("llama.attention.head_count_kv")?;
        let vocab = match ct.metadata.get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec()?.len(),
            None => u("llama.vocab_size")?,
        };
        let context = u("llama.context_length")?.min(max_context);
        Ok(Config {
            vocab,
            hidden,
            ffn: u("llama.feed_forward_length")?,
            layers: u("llama.block_count")?,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            rope_theta: ct
                .metadata
                .get("llama.rope.freq_base")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(10_000.0),
            rms_eps: ct
                .metadata
                .get("llama.attention.layer_norm_rms_epsilon")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(1e-5) as f64,
            context,
        })
    }

    /// The KV shape for pricing; f32 KV on this backend.
    pub fn kv_spec(&self) -> ModelSpec {
        ModelSpec {
            layers: self.layers as u64,
            kv_heads: self.kv_heads as u64,
            head_dim: self.head_dim as u64,
            kv_dtype_bytes: 4,
            context_tokens: self.context as u64,
        }
    }
}

pub fn md_str(ct: &gguf_file::Content, key: &str) -> Result<String> {
    Ok(ct
        .metadata
        .get(key)
        .with_context(|| format!("GGUF metadata {key} missing"))?
        .to_string()?
        .clone())
}

struct Layer {
    attn_norm: Tensor,
    /// Projections stored transposed, `[in, out]`, so `x.matmul(w)` needs no copy.
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
}

pub struct Llama {
    pub cfg: Config,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// Output head `[hidden, vocab]` (the tied embedding, transposed once at load).
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// One sequence's KV cache: per layer, K and V of shape `[kv_heads, capacity, head_dim]`.
/// Capacity grows only when the caller has secured KV blocks for it.
pub struct SeqKv {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl SeqKv {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Llama {
    pub fn load(path: &Path, device: &Device, max_context: usize) -> Result<Llama> {
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("opening model {}", path.display()))?;
        let ct = gguf_file::Content::read(&mut file)
            .with_context(|| format!("reading GGUF {}", path.display()))?;
        let cfg = Config::from_gguf(&ct, max_context)?;
        Self::from_gguf(&ct, &mut file, cfg, device)
    }

    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        cfg: Config,
        device: &Device,
    ) -> Result<Llama> {
        let mut get = |name: &str| -> Result<Tensor> {
            let q = ct
                .tensor(r, name, device)
                .with_context(|| format!("tensor {name}"))?;
            Ok(q.dequantize(device)?.to_dtype(DType::F32)?)
        };
        let embed = get("token_embd.weight")?;
        let lm_head = match get("output.weight") {
            Ok(w) => w.t()?.contiguous()?,
            Err(_) => embed.t()?.contiguous()?,
        };
        let norm = get("output_norm.weight")?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let mut w = |n: &str| -> Result<Tensor> {
                Ok(get(&format!("blk.{i}.{n}.weight"))?.t()?.contiguous()?)
            };
            let wq = w("attn_q")?;
            let wk = w("attn_k")?;
            let wv = w("attn_v")?;
            let wo = w("attn_output")?;
            let w_gate = w("ffn_gate")?;
            let w_up = w("ffn_up")?;
            let w_down = w("ffn_down")?;
            layers.push(Layer {
                attn_norm: get(&format!("blk.{i}.attn_norm.weight"))?,
                ffn_norm: get(&format!("blk.{i}.ffn_norm.weight"))?,
                wq,
                wk,
                wv,
                wo,
                w_gate,
                w_up,
                w_down,
            });
        }
        // RoPE tables, GGML "normal" (interleaved) convention as GGUF Llama weights expect.
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / cfg.head_dim as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), device)?;
        let pos = Tensor::arange(0u32, cfg.context as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.context, 1))?;
        let freqs = pos.matmul(&inv)?;
        Ok(Llama {
            cos: freqs.cos()?,
            sin: freqs.sin()?,
            embed,
            layers,
            norm,
            lm_head,
            device: device.clone(),
            cfg,
        })
    }

    /// An empty KV cache holding room for `capacity` tokens.
    pub fn new_kv(&self, capacity: usize) -> Result<SeqKv> {
        let c = &self.cfg;
        let mut layers = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            let z = || Tensor::zeros((c.kv_heads, capacity, c.head_dim), DType::F32, &self.device);
            layers.push((z()?, z()?));
        }
        Ok(SeqKv {
            layers,
            len: 0,
            capacity,
        })
    }

    /// Grow a cache to `capacity` tokens (the caller holds the KV blocks for them).
    pub fn grow_kv(&self, kv: &mut SeqKv, capacity: usize) -> Result<()> {
        if capacity <= kv.capacity {
            return Ok(());
        }
        let c = &self.cfg;
        for (k, v) in kv.layers.iter_mut() {
            for t in [k, v] {
                let bigger =
                    Tensor::zeros((c.kv_heads, capacity, c.head_dim), DType::F32, &self.device)?;
                if kv.len > 0 {
                    bigger.slice_set(&t.narrow(1, 0, kv.len)?.contiguous()?, 1, 0)?;
                }
                *t = bigger;
            }
        }
        kv.capacity = capacity;
        Ok(())
    }

    /// Prefill one sequence with `tokens` (appended after what its cache holds); returns the
    /// logits of the last position, `[vocab]`.
    pub fn prefill(&self, tokens: &[u32], kv: &mut SeqKv) -> Result<Tensor> {
        let t = tokens.len();
        if t == 0 {
            bail!("empty prompt");
        }
        if kv.len + t > kv.capacity {
            bail!("KV cache too small: {} + {} > {}", kv.len, t, kv.capacity);
        }
        let c = &self.cfg;
        let start = kv.len;
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [t, hidden]
        let cos = self.cos.narrow(0, start, t)?;
        let sin = self.sin.narrow(0, start, t)?;
        let mask = causal_mask(t, start + t, start, &self.device)?;
        for (layer, (kc, vc)) in self.layers.iter().zip(kv.layers.iter_mut()) {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps as f32)?;
            let q = h
                .matmul(&layer.wq)?
                .reshape((1, t, c.heads, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let k = h
                .matmul(&layer.wk)?
                .reshape((1, t, c.kv_heads, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let v = h
                .matmul(&layer.wv)?
                .reshape((t, c.kv_heads, c.head_dim))?
                .transpose(0, 1)?
                .contiguous()?;
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?.squeeze(0)?; // [heads, t, hd]
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?.squeeze(0)?; // [kv, t, hd]
            kc.slice_set(&k, 1, start)?;
            vc.slice_set(&v, 1, start)?;
            let y = self.attend(&q, kc, vc, start + t, Some(&mask))?; // [t, heads*hd]
            x = (x + y.matmul(&layer.wo)?)?;
            x = (&x + self.mlp(layer, &x)?)?;
        }
        kv.len += t;
        let last = x.i(t - 1)?.unsqueeze(0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, c.rms_eps as f32)?;
        Ok(last.matmul(&self.lm_head)?.squeeze(0)?)
    }

    /// One decode step for a batch: `tokens[b]` is appended to `kvs[b]`. Returns logits
    /// `[batch, vocab]`. Every cache must have room for one more token.
    pub fn decode(&self, tokens: &[u32], kvs: &mut [&mut SeqKv]) -> Result<Tensor> {
        let b = tokens.len();
        if b == 0 || b != kvs.len() {
            bail!(
                "decode batch mismatch: {} tokens for {} caches",
                b,
                kvs.len()
            );
        }
        if let Some(kv) = kvs.iter().find(|kv| kv.len >= kv.capacity) {
            bail!("KV cache full at {} tokens", kv.len);
        }
        let c = &self.cfg;
        let ids = Tensor::new(tokens, &self.device)?;
        let positions: Vec<u32> = kvs.iter().map(|kv| kv.len as u32).collect();
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        let cos = self.cos.index_select(&pos, 0)?.unsqueeze(1)?.contiguous()?; // [b, 1, hd/2]
        let sin = self.sin.index_select(&pos, 0)?.unsqueeze(1)?.contiguous()?;
        let mut x = self.embed.index_select(&ids, 0)?; // [b, hidden]
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps as f32)?;
            let q = h.matmul(&layer.wq)?.reshape((b, c.heads, 1, c.head_dim))?;
            let k = h
                .matmul(&layer.wk)?
                .reshape((b, c.kv_heads, 1, c.head_dim))?;
            let v = h
                .matmul(&layer.wv)?
                .reshape((b, c.kv_heads, 1, c.head_dim))?;
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?;
            let mut ys = Vec::with_capacity(b);
            for (bi, kv) in kvs.iter_mut().enumerate() {
                let at = kv.len;
                let Some((kc, vc)) = kv.layers.get_mut(li) else {
                    bail!("layer {li} missing in cache")
                };
                kc.slice_set(&k.i(bi)?.contiguous()?, 1, at)?;
                vc.slice_set(&v.i(bi)?.contiguous()?, 1, at)?;
                ys.push(self.attend(&q.i(bi)?, kc, vc, at + 1, None)?);
            }
            let y = Tensor::cat(&ys, 0)?; // [b, heads*hd]
            x = (x + y.matmul(&layer.wo)?)?;
            x = (&x + self.mlp(layer, &x)?)?;
        }
        for kv in kvs.iter_mut() {
            kv.len += 1;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, c.rms_eps as f32)?;
        Ok(x.matmul(&self.lm_head)?)
    }

    /// Attention of `q` `[heads, t, hd]` over the first `len` cached positions; returns
    /// `[t, heads*hd]`. Grouped-query: head `h` reads KV head `h / (heads / kv_heads)`.
    fn attend(
        &self,
        q: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        len: usize,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = q.dim(1)?;
        let groups = c.heads / c.kv_heads;
        let k = kc.narrow(1, 0, len)?; // [kv, len, hd]
        let v = vc.narrow(1, 0, len)?;
        let q = q.reshape((c.kv_heads, groups * t, c.head_dim))?;
        let att = (q.matmul(&k.t()?)? / (c.head_dim as f64).sqrt())?; // [kv, groups*t, len]
        let att = match mask {
            Some(m) => att
                .reshape((c.kv_heads, groups, t, len))?
                .broadcast_add(m)?
                .reshape((c.kv_heads, groups * t, len))?,
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v.contiguous()?)?; // [kv, groups*t, hd]
        Ok(y.reshape((c.heads, t, c.head_dim))?
            .transpose(0, 1)?
            .reshape((t, c.heads * c.head_dim))?)
    }

    fn mlp(&self, layer: &Layer, x: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &layer.ffn_norm, self.cfg.rms_eps as f32)?;
        let gate = candle_nn::ops::silu(&h.matmul(&layer.w_gate)?)?;
        let up = h.matmul(&layer.w_up)?;
        Ok((gate * up)?.matmul(&layer.w_down)?)
    }
}

/// `[t, len]` additive mask: query `i` (at absolute position `start + i`) sees keys `≤ start + i`.
fn causal_mask(t: usize, len: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mut m = vec![0f32; t * len];
    for i in 0..t {
        for j in (start + i + 1)..len {
            if let Some(x) = m.get_mut(i * len + j) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (t, len), device)?)
}
