//! A Llama-family decoder on candle, built for continuous batching.
//!
//! Unlike candle-transformers' llama (one process-wide cache, one sequence), every sequence owns
//! its KV state (`SeqKv`) and a decode step runs ONE batched forward for all running sequences:
//! embeddings, norms, projections and the MLP run on a `[batch, hidden]` matrix, so the weights are
//! read once per step whatever the batch; only attention, whose length differs per sequence, runs
//! per sequence. Weights are loaded from GGUF and dequantized to f32 (the Q4_1 weights as shipped
//! drift into wrong text when computed in them on CPU, measured when this backend was written).
//!
//! Forward passes are CPU/GPU bound and must never run on the async executor: the engine thread
//! owns the model.

use anyhow::{bail, Context as _, Result};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, IndexOp, Tensor};
use kvgate_core::ModelSpec;
use rayon::prelude::*;

use crate::weights::{convert, stored, Matrix, Quantized};

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
    /// Projections `[in, out]` (dense: stored transposed, so `x.matmul(w)` needs no copy).
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    ffn_norm: Tensor,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

pub struct Llama {
    pub cfg: Config,
    /// `[vocab, hidden]`.
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Tensor,
    /// Output head `[hidden, vocab]` (the tied embedding, transposed once at load).
    lm_head: Matrix,
    cos: Tensor,
    sin: Tensor,
    device: Device,
    /// The most bytes of attention scores one prefill tile holds (`ATTENTION_TILE_BYTES`).
    attention_tile_bytes: usize,
    /// Paged KV (`with_paged_kv`): every sequence's K and V in one preallocated arena on the
    /// model's device, indexed by the pool's block ids. `None`: per-sequence host caches.
    arena: Option<Arena>,
}

/// One preallocated KV cache for every sequence: per layer, K and V as `[slots, kv_heads *
/// head_dim]` on the model's device, where slot `block * block_tokens + i` is token `i` of KV
/// block `block` (the pool's block ids: the block table is the allocation). Its size is the
/// pool's budget, allocated once at start.
struct Arena {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_tokens: usize,
    blocks: usize,
}

impl Arena {
    /// Block ids a cache may use: each one inside the arena (an id past it would write into
    /// memory that is not the arena's on a GPU).
    fn check(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&b| b as usize >= self.blocks) {
            Some(b) => bail!(
                "KV block {b} is outside the arena of {} blocks",
                self.blocks
            ),
            None => Ok(()),
        }
    }
}

/// The most bytes of attention scores a prefill computes at once (per KV head, a tile of query
/// rows × every cached position). A larger tile is a few percent faster on a long prompt; this
/// one keeps the prefill's scratch small beside a KV pool of a few hundred MB.
pub const ATTENTION_TILE_BYTES: usize = 8 << 20;

/// One sequence's KV cache. Host layout: per layer, K and V as `[position][kv_head][head_dim]`
/// f32, so appending a token is one contiguous copy and growing never re-lays out the data.
/// Paged layout: no storage of its own, only its block table into the model's arena.
/// `capacity` is what the caller's KV blocks pay for; it never holds more.
pub struct SeqKv {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    table: Vec<u32>,
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

    /// A paged cache whose first `len` positions are already in its blocks (a shared prefix
    /// another sequence wrote): it starts after them.
    pub fn starting_at(mut self, len: usize) -> Result<SeqKv> {
        if len > 0 && (self.table.is_empty() || len > self.capacity) {
            bail!("only a paged cache starts after positions its blocks hold ({len})");
        }
        self.len = len;
        Ok(self)
    }
}

impl Llama {
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        cfg: Config,
        device: &Device,
    ) -> Result<Llama> {
        Llama::load(ct, r, cfg, device, false)
    }

    /// As [`Self::from_gguf`], with Q4_1 and Q8_0 matrices kept as stored on the CPU (`weights`):
    /// the same outputs, bit for bit, in a fraction of the memory.
    pub fn from_gguf_as_stored<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        cfg: Config,
        device: &Device,
    ) -> Result<Llama> {
        Llama::load(ct, r, cfg, device, device.is_cpu())
    }

    fn load<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        cfg: Config,
        device: &Device,
        keep_quantized: bool,
    ) -> Result<Llama> {
        let mut q = |name: &str| -> Result<QTensor> {
            ct.tensor(r, name, device)
                .with_context(|| format!("tensor {name}"))
        };
        let f32_of =
            |q: QTensor| -> Result<Tensor> { Ok(q.dequantize(device)?.to_dtype(DType::F32)?) };
        // A matrix `[out, in]` as the model multiplies by it, `[in, out]`.
        let matrix = |q: QTensor| -> Result<Matrix> {
            if keep_quantized {
                if let Some(k) = Quantized::of(&q)? {
                    return Ok(Matrix::Quantized(Arc::new(k)));
                }
            }
            Ok(Matrix::Dense(stored(f32_of(q)?.t()?)?))
        };
        let embed = {
            let t = q("token_embd.weight")?;
            match keep_quantized
                .then(|| Quantized::of(&t))
                .transpose()?
                .flatten()
            {
                Some(k) => Matrix::Quantized(Arc::new(k)),
                None => Matrix::Dense(f32_of(t)?),
            }
        };
        let lm_head = match q("output.weight") {
            Ok(w) => matrix(w)?,
            // Tied: the embedding itself (one copy when kept as stored; a view on the CPU).
            Err(_) => match &embed {
                Matrix::Quantized(k) => Matrix::Quantized(Arc::clone(k)),
                Matrix::Dense(e) => Matrix::Dense(stored(e.t()?)?),
            },
        };
        let norm = f32_of(q("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let mut w = |n: &str| -> Result<Matrix> { matrix(q(&format!("blk.{i}.{n}.weight"))?) };
            let wq = w("attn_q")?;
            let wk = w("attn_k")?;
            let wv = w("attn_v")?;
            let wo = w("attn_output")?;
            let w_gate = w("ffn_gate")?;
            let w_up = w("ffn_up")?;
            let w_down = w("ffn_down")?;
            layers.push(Layer {
                attn_norm: f32_of(q(&format!("blk.{i}.attn_norm.weight"))?)?,
                ffn_norm: f32_of(q(&format!("blk.{i}.ffn_norm.weight"))?)?,
                wq,
                wk,
                wv,
                wo,
                w_gate,
                w_up,
                w_down,
            });
        }
        Llama::assemble(cfg, embed, layers, norm, lm_head, device)
    }

    /// A model of `cfg`'s shape with random weights drawn deterministically from `seed` (see
    /// `crate::random_weights`): the same seed gives bit-identical weights on every device, so CPU and
    /// GPU outputs can be compared. Projections are uniform with variance 1/fan_in, norms are 1,
    /// the output head is the tied embedding.
    pub fn synthetic(cfg: Config, seed: u64, device: &Device) -> Result<Llama> {
        use crate::random_weights::random_tensor;
        let (h, f) = (cfg.hidden, cfg.ffn);
        let (q_out, kv_out) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let ones = |n: usize| Tensor::ones(n, DType::F32, device);
        // Every tensor has its own id, so its values do not depend on the others' shapes.
        let embed = random_tensor(seed, 0, (cfg.vocab, h), h, device)?;
        let lm_head = Matrix::Dense(stored(embed.t()?)?);
        let embed = Matrix::Dense(embed);
        // The same values on every device, in the layout `stored` keeps on this one (on the CPU
        // a view of `[out, in]` storage; elsewhere the `[in, out]` tensor as drawn).
        let w = |t: Tensor| -> Result<Matrix> {
            if device.is_cpu() {
                Ok(Matrix::Dense(t.t()?.contiguous()?.t()?))
            } else {
                Ok(Matrix::Dense(t))
            }
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers as u64 {
            let id = 1 + 8 * i;
            layers.push(Layer {
                attn_norm: ones(h)?,
                ffn_norm: ones(h)?,
                wq: w(random_tensor(seed, id, (h, q_out), h, device)?)?,
                wk: w(random_tensor(seed, id + 1, (h, kv_out), h, device)?)?,
                wv: w(random_tensor(seed, id + 2, (h, kv_out), h, device)?)?,
                wo: w(random_tensor(seed, id + 3, (q_out, h), q_out, device)?)?,
                w_gate: w(random_tensor(seed, id + 4, (h, f), h, device)?)?,
                w_up: w(random_tensor(seed, id + 5, (h, f), h, device)?)?,
                w_down: w(random_tensor(seed, id + 6, (f, h), f, device)?)?,
            });
        }
        let norm = ones(h)?;
        Llama::assemble(cfg, embed, layers, norm, lm_head, device)
    }

    fn assemble(
        cfg: Config,
        embed: Matrix,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Matrix,
        device: &Device,
    ) -> Result<Llama> {
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
            attention_tile_bytes: ATTENTION_TILE_BYTES,
            arena: None,
        })
    }

    /// The embeddings of `tokens`, `[tokens, hidden]`.
    fn embed_rows(&self, tokens: &[u32]) -> Result<Tensor> {
        match &self.embed {
            Matrix::Dense(e) => Ok(e.index_select(&Tensor::new(tokens, &self.device)?, 0)?),
            Matrix::Quantized(q) => q.rows(tokens, &self.device),
        }
    }

    /// The same model with another attention tile size (tests: tiles of a few rows).
    pub fn with_attention_tile_bytes(mut self, bytes: usize) -> Llama {
        self.attention_tile_bytes = bytes.max(1);
        self
    }

    /// The projection and output weights in `dtype` (f16/bf16 on CUDA: half the memory, tensor
    /// cores); embeddings and norms stay f32, and so does the residual stream. Matrices kept as
    /// stored stay so (`from_gguf_as_stored`).
    pub fn with_dtype(mut self, dtype: DType) -> Result<Llama> {
        if dtype == DType::F32 {
            return Ok(self);
        }
        for l in self.layers.iter_mut() {
            for w in [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ] {
                if let Matrix::Dense(t) = w {
                    *t = convert(t, dtype)?;
                }
            }
        }
        if let Matrix::Dense(t) = &self.lm_head {
            self.lm_head = Matrix::Dense(convert(t, dtype)?);
        }
        Ok(self)
    }

    /// Keep every sequence's KV in one preallocated arena of `blocks` blocks of `block_tokens`
    /// tokens on the model's device, in `dtype` (the pool's blocks; `new_kv` gets each
    /// sequence's ids). Attention reads it back as f32.
    pub fn with_paged_kv(
        mut self,
        blocks: usize,
        block_tokens: usize,
        dtype: DType,
    ) -> Result<Llama> {
        let slots = blocks.saturating_mul(block_tokens);
        if block_tokens == 0 || u32::try_from(slots).is_err() {
            bail!(
                "a KV arena of {blocks} blocks x {block_tokens} tokens: slots are numbered in u32"
            );
        }
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        let zeros = || Tensor::zeros((slots, row), dtype, &self.device);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..self.cfg.layers {
            k.push(zeros()?);
            v.push(zeros()?);
        }
        self.arena = Some(Arena {
            k,
            v,
            block_tokens,
            blocks,
        });
        Ok(self)
    }

    /// Whether sequences' caches live in one arena, so that blocks can be shared.
    pub fn is_paged(&self) -> bool {
        self.arena.is_some()
    }

    /// An empty KV cache holding room for `capacity` tokens, in the KV blocks `blocks`.
    pub fn new_kv(&self, blocks: &[u32], capacity: usize) -> Result<SeqKv> {
        if let Some(a) = &self.arena {
            a.check(blocks)?;
            return Ok(SeqKv {
                layers: Vec::new(),
                table: blocks.to_vec(),
                len: 0,
                capacity: capacity.min(blocks.len() * a.block_tokens),
            });
        }
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        let layers = (0..self.cfg.layers)
            .map(|_| {
                (
                    Vec::with_capacity(capacity * row),
                    Vec::with_capacity(capacity * row),
                )
            })
            .collect();
        Ok(SeqKv {
            layers,
            table: Vec::new(),
            len: 0,
            capacity,
        })
    }

    /// Grow a cache to `capacity` tokens in the KV blocks `blocks` (the caller holds them; the
    /// blocks it had stay first).
    pub fn grow_kv(&self, kv: &mut SeqKv, blocks: &[u32], capacity: usize) -> Result<()> {
        if capacity <= kv.capacity {
            return Ok(());
        }
        if let Some(a) = &self.arena {
            if blocks.get(..kv.table.len()) != Some(kv.table.as_slice()) {
                bail!("a growing KV cache lost its blocks");
            }
            a.check(blocks)?;
            kv.table = blocks.to_vec();
            kv.capacity = capacity.min(blocks.len() * a.block_tokens);
            return Ok(());
        }
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        for (k, v) in kv.layers.iter_mut() {
            k.reserve_exact(capacity * row - k.len());
            v.reserve_exact(capacity * row - v.len());
        }
        kv.capacity = capacity;
        Ok(())
    }

    /// Cut a cache back to the KV blocks `blocks` (the first of those it had) and `capacity`
    /// tokens: the positions past them are dropped, those before kept as they are. A sequence
    /// that gives back blocks it borrowed keeps what its own blocks hold, and is fed again only
    /// from there.
    pub fn shrink_kv(&self, kv: &mut SeqKv, blocks: &[u32], capacity: usize) -> Result<()> {
        if let Some(a) = &self.arena {
            if kv.table.get(..blocks.len()) != Some(blocks) {
                bail!("a shrinking KV cache would keep blocks it did not have");
            }
            kv.table = blocks.to_vec();
            kv.capacity = capacity.min(blocks.len() * a.block_tokens);
        } else {
            kv.capacity = capacity.min(kv.capacity);
        }
        kv.len = kv.len.min(kv.capacity);
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        // Host caches give their memory back too: the pool lends those blocks to others.
        for (k, v) in kv.layers.iter_mut() {
            k.truncate(kv.len * row);
            v.truncate(kv.len * row);
            k.shrink_to(kv.capacity * row);
            v.shrink_to(kv.capacity * row);
        }
        Ok(())
    }

    /// Arena slots of positions `from..from + n` of a paged cache.
    fn slots(a: &Arena, kv: &SeqKv, from: usize, n: usize) -> Result<Vec<u32>> {
        (from..from + n)
            .map(|p| {
                let block = kv
                    .table
                    .get(p / a.block_tokens)
                    .with_context(|| format!("position {p} past the cache's blocks"))?;
                Ok(*block * a.block_tokens as u32 + (p % a.block_tokens) as u32)
            })
            .collect()
    }

    /// Write `rows` (`[n, kv_heads * head_dim]`) into the arena tensor at `slots`, in place.
    fn write_rows(store: &Tensor, slots: &[u32], rows: &Tensor) -> Result<()> {
        let width = rows.dim(1)?;
        let idx: Vec<u32> = slots
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, width))
            .collect();
        let idx = Tensor::from_vec(idx, (slots.len(), width), rows.device())?;
        store.scatter_set(&idx, &rows.to_dtype(store.dtype())?.contiguous()?, 0)?;
        Ok(())
    }

    /// Prefill `tokens` into a cache that may already hold earlier chunks of the same sequence
    /// (chunked prefill: the engine feeds a long prompt a few hundred tokens per step, between
    /// decode steps); returns the logits of the last token fed, `[vocab]`.
    ///
    /// Attention runs per KV head over tiles of query rows, each tile's scores at most
    /// `attention_tile_bytes`, so its scratch is bounded whatever the prompt's length
    /// (`prefill_scratch_bytes` states the whole bound).
    pub fn prefill(&self, tokens: &[u32], kv: &mut SeqKv) -> Result<Tensor> {
        let t = tokens.len();
        if t == 0 {
            bail!("empty prefill chunk");
        }
        let p = kv.len;
        if p + t > kv.capacity {
            bail!("KV cache too small: {} > {}", p + t, kv.capacity);
        }
        if p + t > self.cfg.context {
            bail!("past the context: {} > {}", p + t, self.cfg.context);
        }
        let c = &self.cfg;
        let row = c.kv_heads * c.head_dim;
        let mut x = self.embed_rows(tokens)?; // [t, hidden]
        let cos = self.cos.narrow(0, p, t)?;
        let sin = self.sin.narrow(0, p, t)?;
        // Paged: where this chunk goes in the arena, and every position it attends to.
        let paged = match &self.arena {
            Some(a) => {
                let all = Self::slots(a, kv, 0, p + t)?;
                let new = all.get(p..).unwrap_or(&[]).to_vec();
                Some((a, new, Tensor::new(all.as_slice(), &self.device)?))
            }
            None => None,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps as f32)?;
            let q = layer
                .wq
                .mm(&h)?
                .reshape((1, t, c.heads, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let k = layer
                .wk
                .mm(&h)?
                .reshape((1, t, c.kv_heads, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let v = layer.wv.mm(&h)?; // [t, kv * hd]
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?.squeeze(0)?; // [heads, t, hd]
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?.squeeze(0)?; // [kv, t, hd]
                                                                                // Cached rows are [position][kv][hd]: K transposed back, V as projected.
            let k = k.transpose(0, 1)?.reshape((t, row))?;
            let (k_all, v_all) = match &paged {
                Some((a, new, all)) => {
                    let (Some(ks), Some(vs)) = (a.k.get(li), a.v.get(li)) else {
                        bail!("layer {li} missing in the KV arena")
                    };
                    Self::write_rows(ks, new, &k)?;
                    Self::write_rows(vs, new, &v)?;
                    (
                        ks.index_select(all, 0)?.to_dtype(DType::F32)?,
                        vs.index_select(all, 0)?.to_dtype(DType::F32)?,
                    )
                }
                None => {
                    let Some((kc, vc)) = kv.layers.get_mut(li) else {
                        bail!("layer {li} missing in cache")
                    };
                    kc.extend(k.flatten_all()?.to_vec1::<f32>()?);
                    vc.extend(v.flatten_all()?.to_vec1::<f32>()?);
                    let (Some(kc), Some(vc)) = (kc.get(..(p + t) * row), vc.get(..(p + t) * row))
                    else {
                        bail!("KV cache shorter than {} positions", p + t);
                    };
                    (
                        Tensor::from_slice(kc, (p + t, row), &self.device)?,
                        Tensor::from_slice(vc, (p + t, row), &self.device)?,
                    )
                }
            };
            let y = self.attend_chunk(&q, &k_all, &v_all, p, t)?;
            x = (x + layer.wo.mm(&y)?)?;
            x = (&x + self.mlp(layer, &x)?)?;
        }
        kv.len = p + t;
        let last = x.i(t - 1)?.unsqueeze(0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, c.rms_eps as f32)?;
        Ok(self.lm_head.mm(&last)?.squeeze(0)?)
    }

    /// Causal attention of a chunk's queries `[heads, t, hd]` (positions `p..p + t`) over the
    /// cached rows `[p + t, kv_heads * hd]` of positions `0..p + t`; returns `[t, heads * hd]`.
    /// Grouped-query: head `h` reads KV head `h / groups`. Per KV head, query rows go in tiles
    /// whose scores `[rows, p + t]` stay under `attention_tile_bytes`.
    fn attend_chunk(
        &self,
        q: &Tensor,
        k_rows: &Tensor,
        v_rows: &Tensor,
        p: usize,
        t: usize,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (len, groups, hd) = (p + t, c.heads / c.kv_heads, c.head_dim);
        let per_head = |rows: &Tensor| -> Result<Tensor> {
            Ok(rows
                .reshape((len, c.kv_heads, hd))?
                .transpose(0, 1)?
                .contiguous()?) // [kv, len, hd]
        };
        let (k_all, v_all) = (per_head(k_rows)?, per_head(v_rows)?);
        let q = (q.reshape((c.kv_heads, groups, t, hd))? / (hd as f64).sqrt())?;
        let rows = (self.attention_tile_bytes / (4 * groups * len).max(1)).clamp(1, t);
        let mut per_kv_head = Vec::with_capacity(c.kv_heads);
        for g in 0..c.kv_heads {
            let (qg, kt, vg) = (q.i(g)?, k_all.i(g)?.t()?, v_all.i(g)?);
            let mut tiles = Vec::with_capacity(t.div_ceil(rows));
            for start in (0..t).step_by(rows) {
                let r = rows.min(t - start);
                let qt = qg
                    .narrow(1, start, r)?
                    .contiguous()?
                    .reshape((groups * r, hd))?;
                // At most two tiles of scores are alive at once (explicit drops).
                let scores = qt.matmul(&kt)?.reshape((groups, r, len))?;
                let masked = scores.broadcast_add(&chunk_mask(p + start, r, len, &self.device)?)?;
                drop(scores);
                let weights = candle_nn::ops::softmax_last_dim(&masked)?;
                drop(masked);
                let y = weights.reshape((groups * r, len))?.matmul(&vg)?;
                tiles.push(y.reshape((groups, r, hd))?);
            }
            per_kv_head.push(Tensor::cat(&tiles, 1)?); // [groups, t, hd]
        }
        Ok(Tensor::cat(&per_kv_head, 0)? // [heads, t, hd]
            .transpose(0, 1)?
            .reshape((t, c.heads * hd))?)
    }

    /// Bytes a decode step of `batch` sequences may use beyond the weights and the KV cache at a
    /// context of `context` tokens: with the paged arena, each layer gathers every sequence's K
    /// and V (and lays them out per head) before attention; the host path needs one row of
    /// scores per sequence (the sequences attend in parallel, each with its own row).
    pub fn decode_scratch_bytes(&self, batch: usize, context: usize) -> u64 {
        let c = &self.cfg;
        let f32s = |n: usize| 4 * n as u64;
        let attention = if self.arena.is_some() {
            f32s(batch * context * (4 * c.kv_heads * c.head_dim + 2 * c.heads))
        } else {
            f32s(batch * context)
        };
        let per_row = 6 * c.hidden + 6 * c.heads * c.head_dim + 4 * c.ffn + 2 * c.vocab;
        let dequantized = match batch > crate::cpu::MAX_ROWS {
            true => self.largest_dequantized(true),
            false => 0,
        };
        attention + f32s(batch * per_row) + dequantized
    }

    /// Bytes of the largest matrix kept as stored, dequantized whole for a GEMM (a prefill
    /// chunk's projections; a decode batch over `cpu::MAX_ROWS`, the output head too: a prefill
    /// takes the head's product for its last token only); 0 when none is.
    fn largest_dequantized(&self, head: bool) -> u64 {
        let head = head.then_some(&self.lm_head);
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(head)
            .map(Matrix::dequantized_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Matrices kept as stored (`weights`).
    pub fn stored_matrices(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain([&self.embed, &self.lm_head])
            .filter(|m| matches!(m, Matrix::Quantized(_)))
            .count()
    }

    /// Bytes a prefill chunk of `chunk` tokens may use beyond the weights and the KV cache, at
    /// a context of `context` tokens (f32): two tiles of attention scores plus the mask, the
    /// cached K and V laid out per head, and the chunk's activations (projections, MLP, logits).
    /// `decode_bench --prefill` measures the real peak against it.
    pub fn prefill_scratch_bytes(&self, chunk: usize, context: usize) -> u64 {
        let c = &self.cfg;
        let f32s = |n: usize| 4 * n as u64;
        let tiles = 3 * self.attention_tile_bytes as u64;
        let cached = f32s(4 * context * c.kv_heads * c.head_dim);
        let per_token =
            6 * c.hidden + 6 * c.heads * c.head_dim + 4 * c.kv_heads * c.head_dim + 4 * c.ffn;
        tiles
            + cached
            + f32s(chunk * per_token)
            + f32s(2 * c.vocab)
            + self.largest_dequantized(false)
    }

    /// One decode step for a batch: `tokens[b]` is appended to `kvs[b]`. Returns logits
    /// `[batch, vocab]`. Every cache must have room for one more token.
    ///
    /// Projections, norms and the MLP run batched on the device; attention, whose length differs
    /// per sequence, runs per sequence over the host-side caches (a tight loop instead of a dozen
    /// small tensor ops per sequence and layer, which dominated batched steps).
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
        let positions: Vec<u32> = kvs.iter().map(|kv| kv.len as u32).collect();
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        let cos = self.cos.index_select(&pos, 0)?.unsqueeze(1)?.contiguous()?; // [b, 1, hd/2]
        let sin = self.sin.index_select(&pos, 0)?.unsqueeze(1)?.contiguous()?;
        let mut x = self.embed_rows(tokens)?; // [b, hidden]
        if let Some(a) = &self.arena {
            x = self.decode_paged(a, x, &cos, &sin, kvs)?;
            for kv in kvs.iter_mut() {
                kv.len += 1;
            }
            let x = candle_nn::ops::rms_norm(&x, &self.norm, c.rms_eps as f32)?;
            return self.lm_head.mm(&x);
        }
        let (q_row, kv_row) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let shape = crate::cpu::Heads {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let mut out = vec![0f32; b * q_row];
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps as f32)?;
            let q = layer.wq.mm(&h)?.reshape((b, c.heads, 1, c.head_dim))?;
            let k = layer.wk.mm(&h)?.reshape((b, c.kv_heads, 1, c.head_dim))?;
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let v = layer.wv.mm(&h)?.flatten_all()?.to_vec1::<f32>()?;
            for (bi, kv) in kvs.iter_mut().enumerate() {
                let Some((kc, vc)) = kv.layers.get_mut(li) else {
                    bail!("layer {li} missing in cache")
                };
                let row = bi * kv_row..(bi + 1) * kv_row;
                kc.extend_from_slice(k.get(row.clone()).unwrap_or(&[]));
                vc.extend_from_slice(v.get(row).unwrap_or(&[]));
            }
            // Each sequence attends over its own cache; the sequences run in parallel.
            let seqs: &[&mut SeqKv] = kvs;
            seqs.par_iter()
                .zip(q.par_chunks(q_row))
                .zip(out.par_chunks_mut(q_row))
                .for_each(|((kv, qb), ob)| {
                    if let Some((kc, vc)) = kv.layers.get(li) {
                        crate::cpu::attend(shape, qb, kc, vc, kv.len + 1, ob);
                    }
                });
            let y = Tensor::from_slice(&out, (b, q_row), &self.device)?;
            x = (x + layer.wo.mm(&y)?)?;
            x = (&x + self.mlp(layer, &x)?)?;
        }
        for kv in kvs.iter_mut() {
            kv.len += 1;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, c.rms_eps as f32)?;
        self.lm_head.mm(&x)
    }

    /// Whether every decode matmul takes the streamed CPU kernel (`cpu::small_matmul`): f32 or
    /// bf16 weights on the CPU, kept as views of their `[out, in]` storage. False on other
    /// devices, with f16 weights, or if a layout change sent them back to the GEMM.
    pub fn decode_matmuls_stream(&self) -> Result<bool> {
        let x = Tensor::zeros((1, self.cfg.hidden), DType::F32, &self.device)?;
        let f = Tensor::zeros((1, self.cfg.ffn), DType::F32, &self.device)?;
        let q = Tensor::zeros(
            (1, self.cfg.heads * self.cfg.head_dim),
            DType::F32,
            &self.device,
        )?;
        let mut all = self.lm_head.streams(&x)?;
        for l in &self.layers {
            for (input, w) in [
                (&x, &l.wq),
                (&x, &l.wk),
                (&x, &l.wv),
                (&q, &l.wo),
                (&x, &l.w_gate),
                (&x, &l.w_up),
                (&f, &l.w_down),
            ] {
                all &= w.streams(input)?;
            }
        }
        Ok(all)
    }

    /// The layers of a decode step over the paged arena, all on the model's device: each
    /// sequence's new K/V row is written at its slot, then attention runs batched over every
    /// sequence's positions gathered from the arena (padded to the longest, masked), with no
    /// copy to the host. Returns the hidden states `[b, hidden]`.
    fn decode_paged(
        &self,
        a: &Arena,
        mut x: Tensor,
        cos: &Tensor,
        sin: &Tensor,
        kvs: &[&mut SeqKv],
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, groups, hd) = (kvs.len(), c.heads / c.kv_heads, c.head_dim);
        let row = c.kv_heads * hd;
        let longest = kvs.iter().map(|kv| kv.len + 1).max().unwrap_or(1);
        // Slots to write (each sequence's next position) and to read (its positions 0..=len,
        // padded with its first slot and masked out).
        let mut new = Vec::with_capacity(b);
        let mut read = Vec::with_capacity(b * longest);
        let mut mask = Vec::with_capacity(b * longest);
        for kv in kvs {
            let own = Self::slots(a, kv, 0, kv.len + 1)?;
            new.push(own.last().copied().unwrap_or(0));
            let pad = own.first().copied().unwrap_or(0);
            mask.extend((0..longest).map(|i| {
                if i < own.len() {
                    0f32
                } else {
                    f32::NEG_INFINITY
                }
            }));
            read.extend(
                own.iter()
                    .copied()
                    .chain(std::iter::repeat(pad))
                    .take(longest),
            );
        }
        let read = Tensor::new(read.as_slice(), &self.device)?;
        let mask = Tensor::from_vec(mask, (b, 1, 1, longest), &self.device)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            let (Some(ks), Some(vs)) = (a.k.get(li), a.v.get(li)) else {
                bail!("layer {li} missing in the KV arena")
            };
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps as f32)?;
            let q = layer.wq.mm(&h)?.reshape((b, c.heads, 1, hd))?;
            let k = layer.wk.mm(&h)?.reshape((b, c.kv_heads, 1, hd))?;
            let q = (candle_nn::rotary_emb::rope_i(&q, cos, sin)? * scale)?
                .reshape((b, c.kv_heads, groups, hd))?;
            let k = candle_nn::rotary_emb::rope_i(&k, cos, sin)?.reshape((b, row))?;
            let v = layer.wv.mm(&h)?; // [b, kv * hd]
            Self::write_rows(ks, &new, &k)?;
            Self::write_rows(vs, &new, &v)?;
            let gather = |store: &Tensor| -> Result<Tensor> {
                Ok(store
                    .index_select(&read, 0)?
                    .to_dtype(DType::F32)?
                    .reshape((b, longest, c.kv_heads, hd))?
                    .transpose(1, 2)?
                    .contiguous()?) // [b, kv, longest, hd]
            };
            let (k_all, v_all) = (gather(ks)?, gather(vs)?);
            let scores = q.matmul(&k_all.transpose(2, 3)?)?.broadcast_add(&mask)?; // [b, kv, groups, longest]
            let weights = candle_nn::ops::softmax_last_dim(&scores)?;
            let y = weights.matmul(&v_all)?.reshape((b, c.heads * hd))?;
            x = (x + layer.wo.mm(&y)?)?;
            x = (&x + self.mlp(layer, &x)?)?;
        }
        Ok(x)
    }

    fn mlp(&self, layer: &Layer, x: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &layer.ffn_norm, self.cfg.rms_eps as f32)?;
        let gate = candle_nn::ops::silu(&layer.w_gate.mm(&h)?)?;
        let up = layer.w_up.mm(&h)?;
        layer.w_down.mm(&(gate * up)?)
    }
}

/// `[rows, len]` additive causal mask for queries at positions `first..first + rows`: each
/// sees the keys at or before its own position.
fn chunk_mask(first: usize, rows: usize, len: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..rows * len)
        .map(|n| {
            if n % len > first + n / len {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(m, (rows, len), device)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::small_cpu_matmul;

    fn assert_close(got: &Tensor, want: &Tensor) {
        let (got, want) = (
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
        );
        assert_eq!(got.len(), want.len());
        for (g, e) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - e).abs() < 1e-4, "{g} vs {e}");
        }
    }

    #[test]
    fn the_streamed_matmul_reads_views_with_an_offset_and_refuses_other_layouts() {
        let dev = Device::Cpu;
        let (m, k, n) = (3usize, 40usize, 24usize);
        let vals = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5)
                .collect()
        };
        let x = Tensor::from_vec(vals(m * k), (m, k), &dev).unwrap();
        // Rows 5..5+n of a larger [out, in] matrix: contiguous storage starting at an offset.
        let big = Tensor::from_vec(vals((n + 9) * k), (n + 9, k), &dev).unwrap();
        let w = big.narrow(0, 5, n).unwrap().t().unwrap();
        let want = x.matmul(&w).unwrap();
        let got = small_cpu_matmul(&x, &w)
            .unwrap()
            .expect("a view of [out, in] rows streams");
        assert_close(&got, &want);
        // A contiguous [in, out] weight, a column slice, too many rows, f16: the GEMM's.
        let contiguous = w.contiguous().unwrap();
        assert!(small_cpu_matmul(&x, &contiguous).unwrap().is_none());
        let cols = big.narrow(1, 0, k / 2).unwrap().t().unwrap();
        let x_half = x.narrow(1, 0, k / 2).unwrap().contiguous().unwrap();
        assert!(small_cpu_matmul(&x_half, &cols).unwrap().is_none());
        let rows = Tensor::zeros((crate::cpu::MAX_ROWS + 1, k), DType::F32, &dev).unwrap();
        assert!(small_cpu_matmul(&rows, &w).unwrap().is_none());
        let half = w.to_dtype(DType::F16).unwrap();
        assert!(small_cpu_matmul(&x, &half).unwrap().is_none());
        // bf16 storage in the same layout streams, with the bf16 values' product.
        let bf = big.narrow(0, 5, n).unwrap().to_dtype(DType::BF16).unwrap();
        let want = x
            .matmul(&bf.to_dtype(DType::F32).unwrap().t().unwrap())
            .unwrap();
        let got = small_cpu_matmul(&x, &bf.t().unwrap())
            .unwrap()
            .expect("bf16 view streams");
        assert_close(&got, &want);
    }

    #[test]
    fn cpu_models_decode_through_the_streamed_matmul() {
        let cfg = crate::synthetic::config("tiny", 64).unwrap();
        let dev = Device::Cpu;
        let m = Llama::synthetic(cfg, 1, &dev).unwrap();
        assert!(m.decode_matmuls_stream().unwrap());
        // bf16 weights stay views and stream too (widened to f32 in the kernel); f16 does not.
        let half = Llama::synthetic(m.cfg.clone(), 1, &dev)
            .unwrap()
            .with_dtype(DType::F16)
            .unwrap();
        assert!(!half.decode_matmuls_stream().unwrap());
        let m = m.with_dtype(DType::BF16).unwrap();
        assert!(m.decode_matmuls_stream().unwrap());
    }
}
