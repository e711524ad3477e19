//! Deterministic random weights: each value comes from a counter-based generator keyed by
//! (seed, tensor id, chunk), so the same seed gives bit-identical weights on every device and
//! for any thread count (`Llama::synthetic`, the `--synthetic` shapes).

use anyhow::Result;
use candle_core::{Device, Shape, Tensor};

/// A `[rows, cols]` f32 tensor uniform in ±sqrt(3 / fan_in) (variance 1/fan_in), generated on the
/// host from (seed, id) in parallel and uploaded once.
pub fn random_tensor<S: Into<Shape>>(
    seed: u64,
    id: u64,
    shape: S,
    fan_in: usize,
    device: &Device,
) -> Result<Tensor> {
    let shape: Shape = shape.into();
    let n = shape.elem_count();
    let scale = (3.0 / fan_in.max(1) as f64).sqrt() as f32;
    let mut data = vec![0f32; n];
    fill_uniform(&mut data, seed, id, scale);
    Ok(Tensor::from_vec(data, shape, device)?)
}

pub(crate) const CHUNK: usize = 1 << 20;

/// Fill `out` with values uniform in ±`scale`; chunk `c` of tensor `id` uses its own stream, so
/// the result does not depend on how many threads run.
pub fn fill_uniform(out: &mut [f32], seed: u64, id: u64, scale: f32) {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let chunks: Vec<(usize, &mut [f32])> = out.chunks_mut(CHUNK).enumerate().collect();
    let per = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [f32])>> = Vec::new();
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    let run = |group: Vec<(usize, &mut [f32])>| {
        for (c, chunk) in group {
            let mut state = mix(mix(seed ^ mix(id)) ^ c as u64);
            for v in chunk.iter_mut() {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                // 24 random bits → [-1, 1), exactly representable in f32.
                let u = (mix(state) >> 40) as f32 * (1.0 / (1u64 << 23) as f32) - 1.0;
                *v = u * scale;
            }
        }
    };
    if groups.len() <= 1 {
        groups.into_iter().for_each(run);
    } else {
        std::thread::scope(|s| {
            for g in groups {
                s.spawn(|| run(g));
            }
        });
    }
}

/// SplitMix64's finalizer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
