//! Token sampling: greedy at temperature 0, otherwise temperature + nucleus (top-p) sampling
//! with a per-sequence seeded generator, so a given `seed` reproduces its output.

use kvgate_core::retry::splitmix64;

#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    state: u64,
}

impl Sampler {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Sampler {
        Sampler {
            temperature,
            top_p,
            state: seed,
        }
    }

    fn next_f64(&mut self) -> f64 {
        self.state = splitmix64(self.state);
        (self.state >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| (i as u32, (f64::from((l - max) / self.temperature)).exp()))
            .collect();
        let sum: f64 = probs.iter().map(|p| p.1).sum();
        if self.top_p < 1.0 {
            probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            let mut acc = 0.0;
            let cut = probs
                .iter()
                .position(|p| {
                    acc += p.1 / sum;
                    acc >= f64::from(self.top_p)
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(cut.max(1));
        }
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut r = self.next_f64() * total;
        for (id, p) in &probs {
            if r < *p {
                return *id;
            }
            r -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, l) in logits.iter().enumerate() {
        if *l > best.1 {
            best = (i, *l);
        }
    }
    best.0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1, 3.0, 0.2, 2.9];
        assert_eq!(Sampler::new(0.0, 1.0, 1).sample(&logits), 1);
        let a: Vec<u32> = {
            let mut s = Sampler::new(1.0, 1.0, 42);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(1.0, 1.0, 42);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b, "same seed, same tokens");
        assert!(a.iter().all(|t| *t < 4));
        assert!(
            a.contains(&1) && a.contains(&3),
            "both likely tokens drawn: {a:?}"
        );
        // top_p small enough keeps only the most likely token.
        let mut s = Sampler::new(1.0, 0.1, 7);
        assert!((0..20).all(|_| s.sample(&logits) == 1));
    }
}
