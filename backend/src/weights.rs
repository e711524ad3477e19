//! The model's weight matrices and their products: dense candle tensors (f32; bf16 or f16 on
//! CUDA), or on the CPU the GGUF's own Q4_1 and Q8_0 blocks of 32 weights, kept as stored (their
//! f16 scales widened to f32 once: 24 and 36 bytes a block, 0.19× and 0.28× f32's bytes) and
//! dequantized a row at a time where a product needs them. A decode step's streamed matmul
//! (`cpu::small_matmul`) dequantizes each weight row into f32 and takes the same dot products as
//! with f32 weights; a prefill chunk's GEMM gets the whole matrix dequantized for the call; an
//! embedding lookup dequantizes the rows it reads. The values are those candle's `dequantize`
//! gives (`x * d + m`, `x * d`, in f32), so the outputs are the f32 path's bit for bit. On other
//! devices the blocks are dequantized at load.

use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

use crate::cpu::Weight;

/// A Q4_1 block: scale `d`, minimum `m` (f16 in the file, widened once at load), 32 four-bit
/// values (weight `j` in the low nibble of byte `j`, weight `16 + j` in its high nibble):
/// `q * d + m`.
#[derive(Clone, Copy)]
pub struct Q41 {
    d: f32,
    m: f32,
    qs: [u8; 16],
}

/// A Q8_0 block: scale `d` (f16 in the file), 32 signed bytes: `q * d`.
#[derive(Clone, Copy)]
pub struct Q80 {
    d: f32,
    qs: [i8; 32],
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    let lo = b.get(i).copied().unwrap_or(0);
    let hi = b.get(i + 1).copied().unwrap_or(0);
    f16::from_le_bytes([lo, hi]).to_f32()
}

impl Q41 {
    fn parse(b: &[u8; 20]) -> Q41 {
        let mut qs = [0u8; 16];
        qs.copy_from_slice(b.get(4..).unwrap_or(&[0; 16]));
        Q41 {
            d: f16_at(b, 0),
            m: f16_at(b, 2),
            qs,
        }
    }
}

impl Q80 {
    fn parse(b: &[u8; 34]) -> Q80 {
        let mut qs = [0i8; 32];
        for (q, &byte) in qs.iter_mut().zip(b.get(2..).unwrap_or(&[])) {
            *q = byte as i8;
        }
        Q80 {
            d: f16_at(b, 0),
            qs,
        }
    }
}

/// `buf` resized to hold `row`'s weights, a block of 32 at a time.
fn blocks_of<'a, B>(row: &[B], buf: &'a mut Vec<f32>) -> std::slice::ChunksExactMut<'a, f32> {
    buf.clear();
    buf.resize(row.len() * 32, 0.0);
    buf.chunks_exact_mut(32)
}

impl Weight for Q41 {
    const PER: usize = 32;
    #[inline(always)]
    fn as_f32<'a>(row: &'a [Q41], buf: &'a mut Vec<f32>) -> &'a [f32] {
        for (b, out) in row.iter().zip(blocks_of(row, buf)) {
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), q) in lo.iter_mut().zip(hi.iter_mut()).zip(b.qs) {
                *l = f32::from(q & 0x0f) * b.d + b.m;
                *h = f32::from(q >> 4) * b.d + b.m;
            }
        }
        buf
    }
}

impl Weight for Q80 {
    const PER: usize = 32;
    #[inline(always)]
    fn as_f32<'a>(row: &'a [Q80], buf: &'a mut Vec<f32>) -> &'a [f32] {
        for (b, out) in row.iter().zip(blocks_of(row, buf)) {
            for (o, q) in out.iter_mut().zip(b.qs) {
                *o = f32::from(q) * b.d;
            }
        }
        buf
    }
}

/// The blocks of one matrix.
pub enum Blocks {
    Q41(Vec<Q41>),
    Q80(Vec<Q80>),
}

/// A `[n, k]` matrix (rows of `k` weights, as GGUF stores a projection `[out, in]`) kept in its
/// blocks.
pub struct Quantized {
    pub n: usize,
    pub k: usize,
    pub blocks: Blocks,
}

fn chunks<const N: usize>(bytes: &[u8]) -> Vec<[u8; N]> {
    bytes
        .chunks_exact(N)
        .filter_map(|c| <[u8; N]>::try_from(c).ok())
        .collect()
}

impl Quantized {
    /// `q` kept as stored, when it is a Q4_1 or Q8_0 matrix; `None` for any other type.
    pub fn of(q: &QTensor) -> Result<Option<Quantized>> {
        let (n, k) = q.shape().dims2()?;
        if k == 0 || !k.is_multiple_of(32) {
            return Ok(None);
        }
        let data = q.data()?;
        let blocks = match q.dtype() {
            GgmlDType::Q4_1 => Blocks::Q41(chunks::<20>(&data).iter().map(Q41::parse).collect()),
            GgmlDType::Q8_0 => Blocks::Q80(chunks::<34>(&data).iter().map(Q80::parse).collect()),
            _ => return Ok(None),
        };
        let len = match &blocks {
            Blocks::Q41(b) => b.len(),
            Blocks::Q80(b) => b.len(),
        };
        if len != n * k / 32 {
            bail!("a {n}x{k} matrix of {len} blocks");
        }
        Ok(Some(Quantized { n, k, blocks }))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.blocks {
            Blocks::Q41(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Q80(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// Rows `ids` dequantized, `[ids.len(), k]` (an embedding lookup).
    pub fn rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let kw = self.k / 32;
        let mut out = Vec::with_capacity(ids.len() * self.k);
        let mut buf = Vec::with_capacity(self.k);
        for &id in ids {
            let id = id as usize;
            if id >= self.n {
                bail!("row {id} of {}", self.n);
            }
            let row = match &self.blocks {
                Blocks::Q41(b) => {
                    Q41::as_f32(b.get(id * kw..(id + 1) * kw).unwrap_or(&[]), &mut buf)
                }
                Blocks::Q80(b) => {
                    Q80::as_f32(b.get(id * kw..(id + 1) * kw).unwrap_or(&[]), &mut buf)
                }
            };
            out.extend_from_slice(row);
        }
        Ok(Tensor::from_vec(out, (ids.len(), self.k), device)?)
    }

    /// The whole matrix dequantized, `[n, k]` (rows spread over rayon's threads, beside which a
    /// prefill chunk's GEMM runs).
    pub fn dequantize(&self, device: &Device) -> Result<Tensor> {
        use rayon::prelude::*;
        let kw = self.k / 32;
        let mut out = vec![0f32; self.n * self.k];
        fn fill<B: Weight>(blocks: &[B], kw: usize, k: usize, out: &mut [f32]) {
            out.par_chunks_mut(k)
                .zip(blocks.par_chunks(kw))
                .for_each_init(
                    || Vec::with_capacity(k),
                    |buf, (o, row)| {
                        for (o, w) in o.iter_mut().zip(B::as_f32(row, buf)) {
                            *o = *w;
                        }
                    },
                );
        }
        match &self.blocks {
            Blocks::Q41(b) => fill(b, kw, self.k, &mut out),
            Blocks::Q80(b) => fill(b, kw, self.k, &mut out),
        }
        Ok(Tensor::from_vec(out, (self.n, self.k), device)?)
    }

    /// `x` (`[m, k]`, f32, m ≤ `cpu::MAX_ROWS`) times the matrix transposed, streamed.
    fn streamed(&self, x: &[f32], m: usize) -> Option<Vec<f32>> {
        match &self.blocks {
            Blocks::Q41(b) => crate::cpu::small_matmul(x, m, b, self.k, self.n),
            Blocks::Q80(b) => crate::cpu::small_matmul(x, m, b, self.k, self.n),
        }
    }
}

/// A weight matrix `[in, out]` as the model multiplies by it: a candle tensor (on the CPU, the
/// transposed view of its `[out, in]` storage; see `model::stored`), or GGUF blocks.
#[derive(Clone)]
pub enum Matrix {
    Dense(Tensor),
    Quantized(Arc<Quantized>),
}

impl Matrix {
    /// `x · w` (`x` `[m, in]` f32, the result `[m, out]` f32).
    pub fn mm(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Matrix::Dense(w) => mm(x, w),
            Matrix::Quantized(q) => {
                if let (Ok((m, k)), true) = (x.dims2(), x.device().is_cpu()) {
                    if m <= crate::cpu::MAX_ROWS && k == q.k && x.dtype() == DType::F32 {
                        let xs = x.flatten_all()?.to_vec1::<f32>()?;
                        if let Some(y) = q.streamed(&xs, m) {
                            return Ok(Tensor::from_vec(y, (m, q.n), x.device())?);
                        }
                    }
                }
                // A prefill chunk (or a decode batch over `cpu::MAX_ROWS`): the GEMM, over the
                // matrix dequantized for this call, as the f32 path runs it (about one
                // dequantization of the model a step; counted in the scratch bounds).
                Ok(x.matmul(&q.dequantize(x.device())?.t()?)?)
            }
        }
    }

    /// Whether a decode step's product takes the streamed CPU kernel.
    pub fn streams(&self, x: &Tensor) -> Result<bool> {
        Ok(match self {
            Matrix::Dense(w) => small_cpu_matmul(x, w)?.is_some(),
            Matrix::Quantized(q) => {
                let (m, k) = x.dims2()?;
                x.device().is_cpu()
                    && x.dtype() == DType::F32
                    && m <= crate::cpu::MAX_ROWS
                    && k == q.k
            }
        })
    }

    /// Bytes of the f32 matrix a GEMM gets when it is kept as stored (0 when dense).
    pub fn dequantized_bytes(&self) -> u64 {
        match self {
            Matrix::Dense(_) => 0,
            Matrix::Quantized(q) => 4 * (q.n * q.k) as u64,
        }
    }

    /// Bytes the weights hold.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Matrix::Quantized(q) => q.bytes(),
        }
    }
}

/// `x · w` for f32 activations and weights of any float type: with f16/bf16 weights (CUDA) the
/// product runs in the weights' type and comes back as f32 (norms, RoPE, softmax and the
/// residual stream stay f32).
pub fn mm(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if let Some(y) = small_cpu_matmul(x, w)? {
        return Ok(y);
    }
    if x.dtype() == w.dtype() {
        return Ok(x.matmul(w)?);
    }
    Ok(x.to_dtype(w.dtype())?.matmul(w)?.to_dtype(x.dtype())?)
}

/// A projection in another dtype, in the layout `stored` keeps on its device (on the CPU a view
/// of `[out, in]` storage, so the streamed decode matmul still reads it).
pub fn convert(w: &Tensor, dtype: DType) -> Result<Tensor> {
    if w.device().is_cpu() {
        return Ok(w.t()?.to_dtype(dtype)?.t()?);
    }
    Ok(w.to_dtype(dtype)?)
}

/// A projection `[in, out]` made from the transposed view of its `[out, in]` weight. On the CPU it
/// stays a view (the decode path reads each output's weights as one contiguous row, and the GEMM
/// takes the strides as they are); elsewhere it is made contiguous `[in, out]` (cuBLAS).
pub fn stored(w_t: Tensor) -> Result<Tensor> {
    if w_t.device().is_cpu() {
        return Ok(w_t);
    }
    Ok(w_t.contiguous()?)
}

/// A decode step's `x · w` on the CPU (f32, at most `cpu::MAX_ROWS` rows of `x`, `w` the
/// transposed view of a contiguous `[n, k]`, as `stored` keeps CPU weights) through
/// `cpu::small_matmul`, which streams the weights once instead of repacking them for a GEMM.
/// `None` where that path does not apply.
pub fn small_cpu_matmul(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (Ok((m, k)), Ok((wk, n))) = (x.dims2(), w.dims2()) else {
        return Ok(None);
    };
    if !x.device().is_cpu()
        || x.dtype() != DType::F32
        || !matches!(w.dtype(), DType::F32 | DType::BF16)
        || m > crate::cpu::MAX_ROWS
        || wk != k
    {
        return Ok(None);
    }
    let wt = w.t()?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let (storage, layout) = wt.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    /// The weights `[a, b)` of `cpu` read as `W`, streamed.
    fn streamed<W: candle_core::WithDType + crate::cpu::Weight>(
        cpu: &candle_core::CpuStorage,
        (a, b): (usize, usize),
        xs: &[f32],
        (m, k, n): (usize, usize, usize),
    ) -> Option<Vec<f32>> {
        crate::cpu::small_matmul(xs, m, cpu.as_slice::<W>().ok()?.get(a..b)?, k, n)
    }
    let y = match w.dtype() {
        DType::BF16 => streamed::<half::bf16>(cpu, (a, b), &xs, (m, k, n)),
        _ => streamed::<f32>(cpu, (a, b), &xs, (m, k, n)),
    };
    let Some(y) = y else {
        return Ok(None);
    };
    Ok(Some(Tensor::from_vec(y, (m, n), x.device())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 2654435761usize % 1000) as f32 - 500.0) / 97.0)
            .collect()
    }

    #[test]
    fn blocks_dequantize_to_candles_values_and_multiply_as_the_f32_matrix_does() {
        let (n, k) = (40, 96);
        let w = Tensor::from_vec(values(n * k), (n, k), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let ours = Quantized::of(&q).unwrap().unwrap();
            let theirs = q.dequantize(&Device::Cpu).unwrap();
            let mine = ours.dequantize(&Device::Cpu).unwrap();
            assert_eq!(
                mine.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{dtype:?}"
            );
            let rows = ours.rows(&[3, 0, 39], &Device::Cpu).unwrap();
            assert_eq!(
                rows.to_vec2::<f32>().unwrap(),
                theirs
                    .index_select(&Tensor::new(&[3u32, 0, 39], &Device::Cpu).unwrap(), 0)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap()
            );
            let dense = Matrix::Dense(theirs.t().unwrap());
            let stored = Matrix::Quantized(Arc::new(ours));
            for m in [1, 3, 16, 40] {
                let x = Tensor::from_vec(values(m * k), (m, k), &Device::Cpu).unwrap();
                let a = dense.mm(&x).unwrap().to_vec2::<f32>().unwrap();
                let b = stored.mm(&x).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(a, b, "{dtype:?}, {m} rows: bit for bit the f32 product");
            }
            assert!(stored.bytes() * 3 < dense.bytes(), "{dtype:?}");
        }
    }

    #[test]
    fn other_types_and_ragged_rows_are_not_kept() {
        let w = Tensor::from_vec(values(4 * 32), (4, 32), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::F16).unwrap();
        assert!(Quantized::of(&q).unwrap().is_none());
        let q = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        assert!(Quantized::of(&q).unwrap().is_none());
    }
}
