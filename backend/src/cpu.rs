//! SIMD kernels for the CPU decode step: `x · w` for a few rows, and one query's attention over
//! its host-side KV cache.
//!
//! A decode step multiplies a handful of rows (one per running sequence) by every weight matrix.
//! candle's CPU matmul hands that to a general GEMM, which repacks the whole weight matrix on
//! every call: at 8 rows the step spent most of its time packing and waiting for memory, and 8
//! streams ran only about 2× as fast as one. Here the weights are kept as GGUF stores them,
//! `[out, in]` (the model's `[in, out]` tensors on the CPU are transposed views of that), so each
//! output column is one contiguous row of `in` values: a call streams the weights once, in
//! order, taking dot products of 2 weight rows with 4 rows of `x` at a time in SIMD registers,
//! blocks of output columns spread over rayon's threads. SIMD is chosen at run time by `pulp`
//! (AVX2/FMA or scalar; its AVX-512 level is not enabled: slower on the CPU measured), so the
//! binary needs no `target-cpu` flag. Prefill chunks
//! (hundreds of rows) stay with the GEMM, which is faster there.
//!
//! Attention over a sequence's cache (`attend`) is the same dot products and multiply-adds in
//! SIMD; the decode step runs it for its sequences in parallel.

use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// The most output columns per parallel task (fewer where that gives every thread several).
const BLOCK_COLS: usize = 64;
/// The most rows of `x` this path takes; more go to the GEMM.
pub const MAX_ROWS: usize = 16;

/// A weight element the streamed matmul reads: f32 as it is, bf16 widened to f32 a row at a
/// time (half the bytes read per step; the arithmetic stays f32), or a GGUF block of `PER`
/// quantized weights dequantized a row at a time (`weights`).
pub trait Weight: Copy + Send + Sync {
    /// Weights per element.
    const PER: usize = 1;
    /// `row` as f32: itself, or widened into `buf`.
    fn as_f32<'a>(row: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32];
}

impl Weight for f32 {
    #[inline(always)]
    fn as_f32<'a>(row: &'a [f32], _buf: &'a mut Vec<f32>) -> &'a [f32] {
        row
    }
}

impl Weight for half::bf16 {
    #[inline(always)]
    fn as_f32<'a>(row: &'a [half::bf16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        buf.clear();
        // bf16 is the top half of an f32: widening is a shift.
        buf.extend(
            row.iter()
                .map(|v| f32::from_bits(u32::from(v.to_bits()) << 16)),
        );
        buf
    }
}

/// `x` (`[m, k]`, row-major) times `wᵀ` where `wt` is `[n, k]` row-major (the weight as GGUF
/// stores it; `k / W::PER` elements a row), as `[m, n]` row-major. `None` when the lengths do
/// not match the shapes.
pub fn small_matmul<W: Weight>(
    x: &[f32],
    m: usize,
    wt: &[W],
    k: usize,
    n: usize,
) -> Option<Vec<f32>> {
    let kw = k / W::PER;
    if m == 0
        || k == 0
        || n == 0
        || x.len() != m * k
        || !k.is_multiple_of(W::PER)
        || wt.len() != kw * n
    {
        return None;
    }
    let arch = Arch::new();
    let cols = n
        .div_ceil(4 * rayon::current_num_threads())
        .clamp(1, BLOCK_COLS);
    let blocks: Vec<Vec<f32>> = wt
        .par_chunks(cols * kw)
        .map(|w| {
            let width = w.len() / kw;
            let mut out = vec![0f32; m * width];
            arch.dispatch(Block {
                x,
                w,
                k,
                width,
                out: &mut out,
            });
            out
        })
        .collect();
    let mut y = vec![0f32; m * n];
    for (c, block) in blocks.iter().enumerate() {
        let j0 = c * cols;
        let width = block.len() / m;
        for (r, src) in block.chunks_exact(width).enumerate() {
            let dst = y.get_mut(r * n + j0..r * n + j0 + width)?;
            dst.copy_from_slice(src);
        }
    }
    Some(y)
}

/// `width` output columns (the weight rows `w`, `[width, k]`) for every row of `x`; `out` is
/// `[rows of x, width]`.
struct Block<'a, W> {
    x: &'a [f32],
    w: &'a [W],
    k: usize,
    width: usize,
    out: &'a mut [f32],
}

impl<W: Weight> WithSimd for Block<'_, W> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Block {
            x,
            w,
            k,
            width,
            out,
        } = self;
        // Rows of x four at a time against two weight rows (8 accumulators); what is left over
        // in smaller groups, a single row against four weight rows.
        let mut x = x.chunks_exact(k);
        let mut out = out.chunks_exact_mut(width);
        loop {
            let left = x.len();
            if left >= 4 {
                pass::<S, W, 4, 2>(simd, &mut x, &mut out, w, k);
            } else if left == 3 {
                pass::<S, W, 3, 2>(simd, &mut x, &mut out, w, k);
            } else if left == 2 {
                pass::<S, W, 2, 3>(simd, &mut x, &mut out, w, k);
            } else if left == 1 {
                pass::<S, W, 1, 4>(simd, &mut x, &mut out, w, k);
            } else {
                break;
            }
        }
    }
}

/// The next `R` rows of `x` times every weight row of the block, `P` weight rows at a time
/// (`R × P` SIMD accumulators), into the next `R` rows of `out`.
#[inline(always)]
fn pass<'a, S: Simd, W: Weight, const R: usize, const P: usize>(
    simd: S,
    x: &mut std::slice::ChunksExact<'_, f32>,
    out: &mut std::slice::ChunksExactMut<'a, f32>,
    w: &[W],
    k: usize,
) {
    let lanes = S::F32_LANES;
    let simd_k = k / lanes * lanes;
    let xr: [&[f32]; R] = std::array::from_fn(|_| x.next().unwrap_or(&[]));
    let xv: [&[S::f32s]; R] = xr.map(|row| S::as_simd_f32s(row).0);
    let mut dst: [&mut [f32]; R] = std::array::from_fn(|_| out.next().unwrap_or(&mut []));
    let kw = k / W::PER;
    let width = w.len() / kw;
    let mut bufs: [Vec<f32>; P] = std::array::from_fn(|_| Vec::with_capacity(k));
    let mut j = 0;
    while j < width {
        // P weight rows (the last one repeated where fewer are left), as f32.
        let here = (width - j).min(P);
        let mut wr: [&[f32]; P] = [&[]; P];
        for (p, (slot, buf)) in wr.iter_mut().zip(bufs.iter_mut()).enumerate() {
            let jp = j + p.min(here - 1);
            *slot = W::as_f32(w.get(jp * kw..(jp + 1) * kw).unwrap_or(&[]), buf);
        }
        let wv: [&[S::f32s]; P] = wr.map(|row| S::as_simd_f32s(row).0);
        let zero = simd.splat_f32s(0.0);
        let mut acc = [[zero; P]; R];
        for i in 0..simd_k / lanes {
            let wi: [S::f32s; P] = wv.map(|row| row.get(i).copied().unwrap_or(zero));
            for (a, xrow) in acc.iter_mut().zip(&xv) {
                let xi = xrow.get(i).copied().unwrap_or(zero);
                for (a, &wi) in a.iter_mut().zip(&wi) {
                    *a = simd.mul_add_e_f32s(xi, wi, *a);
                }
            }
        }
        for ((a, xrow), d) in acc.iter().zip(&xr).zip(dst.iter_mut()) {
            for (p, (&v, wrow)) in a.iter().zip(&wr).enumerate().take(here) {
                // The last k % lanes values, when k is not a whole number of vectors.
                let tail_x = xrow.get(simd_k..).unwrap_or(&[]);
                let tail_w = wrow.get(simd_k..).unwrap_or(&[]);
                let tail: f32 = tail_x.iter().zip(tail_w).map(|(a, b)| a * b).sum();
                if let Some(d) = d.get_mut(j + p) {
                    *d = simd.reduce_sum_f32s(v) + tail;
                }
            }
        }
        j += here;
    }
}

/// The shape attention needs: query heads, KV heads (grouped-query: head `h` reads KV head
/// `h / (heads / kv_heads)`), and the width of one head.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One query token's attention over `len` cached positions: `q` is `[heads][head_dim]`, `k` and
/// `v` are `[pos][kv_heads][head_dim]`, the result goes to `out` (`[heads][head_dim]`).
pub fn attend(shape: Heads, q: &[f32], k: &[f32], v: &[f32], len: usize, out: &mut [f32]) {
    Arch::new().dispatch(Attend {
        shape,
        q,
        k,
        v,
        len,
        out,
    });
}

struct Attend<'a> {
    shape: Heads,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    len: usize,
    out: &'a mut [f32],
}

impl WithSimd for Attend<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Attend {
            shape,
            q,
            k,
            v,
            len,
            out,
        } = self;
        let (hd, kvh) = (shape.head_dim, shape.kv_heads.max(1));
        if hd == 0 {
            return;
        }
        let groups = (shape.heads / kvh).max(1);
        let scale = 1.0 / (hd as f32).sqrt();
        let zero = simd.splat_f32s(0.0);
        let mut scores = vec![0f32; len];
        for (h, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
            let g = h / groups;
            let (qv, qt) = S::as_simd_f32s(qh);
            let mut max = f32::NEG_INFINITY;
            for (p, s) in scores.iter_mut().enumerate() {
                let at = (p * kvh + g) * hd;
                let (kv, kt) = S::as_simd_f32s(k.get(at..at + hd).unwrap_or(&[]));
                let mut acc = zero;
                for (&a, &b) in qv.iter().zip(kv) {
                    acc = simd.mul_add_e_f32s(a, b, acc);
                }
                let tail: f32 = qt.iter().zip(kt).map(|(a, b)| a * b).sum();
                *s = (simd.reduce_sum_f32s(acc) + tail) * scale;
                max = max.max(*s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            oh.fill(0.0);
            let (ov, ot) = S::as_mut_simd_f32s(oh);
            for (p, s) in scores.iter().enumerate() {
                let weight = s / sum;
                let wv = simd.splat_f32s(weight);
                let at = (p * kvh + g) * hd;
                let (vv, vt) = S::as_simd_f32s(v.get(at..at + hd).unwrap_or(&[]));
                for (o, &x) in ov.iter_mut().zip(vv) {
                    *o = simd.mul_add_e_f32s(wv, x, *o);
                }
                for (o, x) in ot.iter_mut().zip(vt) {
                    *o += weight * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · wᵀ` with `wt` as `[n, k]`, one multiply-add at a time.
    fn naive(x: &[f32], m: usize, wt: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for j in 0..n {
                y[r * n + j] = (0..k).map(|i| x[r * k + i] * wt[j * k + i]).sum();
            }
        }
        y
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_the_naive_product_for_every_row_count_and_ragged_shapes() {
        // Column counts that are and are not whole blocks / vector pairs; rows 1..=MAX_ROWS.
        for &(k, n) in &[(576, 576), (64, 192), (37, 131), (131, 37), (8, 1), (1, 70)] {
            let w = values(k * n, 7);
            for m in 1..=MAX_ROWS {
                let x = values(m * k, m as u32);
                let got = small_matmul(&x, m, &w, k, n).unwrap();
                let want = naive(&x, m, &w, k, n);
                for (g, e) in got.iter().zip(&want) {
                    assert!(
                        (g - e).abs() <= 1e-3 * (1.0 + e.abs()),
                        "m {m} k {k} n {n}: {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_product_of_their_f32_values() {
        let (k, n) = (131, 70);
        let w: Vec<half::bf16> = values(k * n, 5)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        for m in [1, 3, 8] {
            let x = values(m * k, 9);
            let got = small_matmul(&x, m, &w, k, n).unwrap();
            let want = naive(&x, m, &wf, k, n);
            for (g, e) in got.iter().zip(&want) {
                assert!((g - e).abs() <= 1e-3 * (1.0 + e.abs()), "m {m}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_match_the_data() {
        assert!(small_matmul(&[1.0; 6], 2, &[1.0; 6], 3, 2).is_some());
        assert!(small_matmul(&[1.0; 5], 2, &[1.0; 6], 3, 2).is_none());
        assert!(small_matmul(&[1.0; 6], 2, &[1.0; 7], 3, 2).is_none());
        assert!(small_matmul(&[], 0, &[1.0f32; 6], 3, 2).is_none());
    }

    /// The plain loop the kernel replaced: scores, softmax, weighted sum, one value at a time.
    fn naive_attend(shape: Heads, q: &[f32], k: &[f32], v: &[f32], len: usize) -> Vec<f32> {
        let (hd, kvh) = (shape.head_dim, shape.kv_heads);
        let groups = shape.heads / kvh;
        let mut out = vec![0f32; shape.heads * hd];
        for h in 0..shape.heads {
            let g = h / groups;
            let s: Vec<f32> = (0..len)
                .map(|p| {
                    (0..hd)
                        .map(|d| q[h * hd + d] * k[(p * kvh + g) * hd + d])
                        .sum::<f32>()
                        / (hd as f32).sqrt()
                })
                .collect();
            let max = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            for p in 0..len {
                for d in 0..hd {
                    out[h * hd + d] += e[p] / sum * v[(p * kvh + g) * hd + d];
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_the_plain_loop_with_grouped_heads_and_ragged_head_widths() {
        for &(heads, kv_heads, head_dim, len) in &[
            (9, 3, 64, 150),
            (4, 4, 20, 1),
            (8, 2, 13, 33),
            (2, 1, 128, 7),
        ] {
            let shape = Heads {
                heads,
                kv_heads,
                head_dim,
            };
            let q = values(heads * head_dim, 1);
            let k = values(len * kv_heads * head_dim, 2);
            let v = values(len * kv_heads * head_dim, 3);
            let mut got = vec![0f32; heads * head_dim];
            attend(shape, &q, &k, &v, len, &mut got);
            let want = naive_attend(shape, &q, &k, &v, len);
            for (g, e) in got.iter().zip(&want) {
                assert!(
                    (g - e).abs() <= 1e-4,
                    "{heads}/{kv_heads}x{head_dim} len {len}: {g} vs {e}"
                );
            }
        }
    }
}
