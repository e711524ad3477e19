//! Capped, linear-time token counting: the admission path's counter.
//!
//! Admission needs a count only up to the context: a prompt past it is refused (413) whatever
//! its exact length, so counting stops as soon as the running count passes the limit, and a
//! text whose byte length alone proves it over (each token covers at most `max_token_bytes`
//! bytes) is refused before any BPE.
//!
//! Cost: the pre-tokenizer regex is linear; BPE of one piece is O(n log n) in its length, which
//! on a megabyte without whitespace (one piece) is slow and cache-hostile. Pieces up to
//! [`LONG_PIECE_BYTES`] are merged whole, exactly as tiktoken does (same algorithm, same
//! tie-break), so ordinary text counts exactly as before. A longer piece is merged in chunks of at
//! most [`LONG_PIECE_BYTES`] cut at char boundaries, and every cut adds [`SLACK_PER_CUT`] tokens:
//! BPE is not splittable, so a cut can give fewer tokens than the whole piece would; the slack
//! keeps the count at or above the exact one (property-tested against tiktoken on random and
//! adversarial strings in `tests`). The result for such a piece is an upper bound, over by at
//! most a few tokens per KiB of unbroken text: the safe direction for pricing.
//!
//! Must never panic on any input (no indexing, regex errors become a byte-count upper bound).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use fancy_regex::Regex;
use rustc_hash::FxHashMap;
use tiktoken_rs::Rank;

/// Pieces longer than this are merged in chunks of at most this many bytes.
pub const LONG_PIECE_BYTES: usize = 1024;
/// Tokens added per chunk cut so a chunked count is never below the exact one. Measured against
/// tiktoken-rs (cl100k, o200k, r50k and a GPT-2-style custom vocabulary; 2,000 adversarial strings
/// each): a cut lost at most 1 token (in 40 of 4,616 checks), so 2 leaves a margin of 1.
pub const SLACK_PER_CUT: u64 = 2;
/// Below this length a piece is merged with the simple quadratic scan (tiktoken's choice too).
const SMALL_PIECE_BYTES: usize = 100;

/// A count that stops at a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capped {
    /// At most the limit. Exact unless a piece was longer than [`LONG_PIECE_BYTES`]; then an
    /// upper bound.
    Within(u64),
    /// More than the limit (counting stopped there).
    Over,
}

/// The running count of one prompt against its limit.
#[derive(Debug)]
pub(crate) struct Tally {
    pub(crate) n: u64,
    pub(crate) limit: u64,
    /// Chunk cuts made in long pieces so far (each added `slack_per_cut`).
    pub(crate) cuts: u64,
}

/// Counting passed the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Over;

impl Tally {
    pub(crate) fn new(limit: u64) -> Self {
        Tally {
            n: 0,
            limit,
            cuts: 0,
        }
    }
    pub(crate) fn add(&mut self, k: u64) -> Result<(), Over> {
        self.n = self.n.saturating_add(k);
        if self.n > self.limit {
            Err(Over)
        } else {
            Ok(())
        }
    }
    pub(crate) fn finish(r: Result<u64, Over>) -> Capped {
        match r {
            Ok(n) => Capped::Within(n),
            Err(Over) => Capped::Over,
        }
    }
}

/// The pre-tokenizer and ranks of one encoding, for counting only.
pub(crate) struct PieceCounter {
    regex: Regex,
    ranks: FxHashMap<Vec<u8>, Rank>,
    max_token_bytes: usize,
}

impl PieceCounter {
    pub(crate) fn new(ranks: FxHashMap<Vec<u8>, Rank>, regex: Regex) -> Self {
        // Re-allocate the keys in rank order: frequent (low-rank) tokens then sit together in
        // memory, which keeps the lookup of every piece cache-friendly.
        let mut entries: Vec<(Vec<u8>, Rank)> = ranks.into_iter().collect();
        entries.sort_unstable_by_key(|(_, r)| *r);
        let mut ranks = FxHashMap::with_capacity_and_hasher(entries.len(), Default::default());
        for (k, r) in &entries {
            ranks.insert(k.as_slice().to_vec(), *r);
        }
        drop(entries);
        let max_token_bytes = ranks.keys().map(Vec::len).max().unwrap_or(1).max(1);
        PieceCounter {
            regex,
            ranks,
            max_token_bytes,
        }
    }

    /// True when `bytes` of ordinary text must hold more than `limit` tokens whatever they are.
    pub(crate) fn surely_over(&self, bytes: usize, limit: u64) -> bool {
        let min_tokens = bytes.div_ceil(self.max_token_bytes) as u64;
        min_tokens > limit
    }

    /// Add the ordinary (no special tokens) count of `text` to the tally.
    pub(crate) fn count(&self, text: &str, tally: &mut Tally) -> Result<(), Over> {
        self.count_with_slack(text, tally, SLACK_PER_CUT)
    }

    /// `count` with another slack: zero only in the tests that measure what a cut loses.
    pub(crate) fn count_with_slack(
        &self,
        text: &str,
        tally: &mut Tally,
        slack_per_cut: u64,
    ) -> Result<(), Over> {
        let mut done = 0usize;
        for m in self.regex.find_iter(text) {
            let Ok(m) = m else {
                // The regex gave up (backtrack limit): every byte left is at most one token.
                return tally.add(text.len().saturating_sub(done) as u64);
            };
            done = m.end();
            self.count_piece(m.as_str(), tally, slack_per_cut)?;
        }
        Ok(())
    }

    fn count_piece(&self, piece: &str, tally: &mut Tally, slack_per_cut: u64) -> Result<(), Over> {
        let bytes = piece.as_bytes();
        if bytes.len() <= LONG_PIECE_BYTES {
            return tally.add(bpe_count(&self.ranks, bytes));
        }
        let mut rest = piece;
        let mut first = true;
        while !rest.is_empty() {
            let mut cut = LONG_PIECE_BYTES.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            if cut == 0 {
                // Unreachable for UTF-8 (a char is at most 4 bytes); take the whole rest.
                cut = rest.len();
            }
            let (chunk, tail) = rest.split_at(cut);
            let slack = if first {
                0
            } else {
                tally.cuts = tally.cuts.saturating_add(1);
                slack_per_cut
            };
            first = false;
            tally.add(bpe_count(&self.ranks, chunk.as_bytes()).saturating_add(slack))?;
            rest = tail;
        }
        Ok(())
    }
}

/// Number of tokens byte-pair merging gives for `piece` (tiktoken's algorithm: repeatedly merge
/// the adjacent pair whose concatenation has the lowest rank, leftmost first).
pub(crate) fn bpe_count(ranks: &FxHashMap<Vec<u8>, Rank>, piece: &[u8]) -> u64 {
    if piece.len() <= 1 || ranks.contains_key(piece) {
        return piece.len().min(1) as u64;
    }
    if piece.len() < SMALL_PIECE_BYTES {
        merge_small(ranks, piece)
    } else {
        merge_large(ranks, piece)
    }
}

fn rank_of(ranks: &FxHashMap<Vec<u8>, Rank>, piece: &[u8], a: usize, b: usize) -> Rank {
    piece
        .get(a..b)
        .and_then(|s| ranks.get(s))
        .copied()
        .unwrap_or(Rank::MAX)
}

/// O(n·merges) over a vector of part starts; fast for short pieces.
fn merge_small(ranks: &FxHashMap<Vec<u8>, Rank>, piece: &[u8]) -> u64 {
    let n = piece.len();
    // (start of a part, rank of merging it with the next part); a sentinel at `n` ends it.
    let mut parts: Vec<(usize, Rank)> = (0..n)
        .map(|i| (i, rank_of(ranks, piece, i, i + 2)))
        .collect();
    if let Some(last) = parts.last_mut() {
        last.1 = Rank::MAX;
    }
    parts.push((n, Rank::MAX));
    loop {
        let mut best = (Rank::MAX, usize::MAX);
        for (i, p) in parts.iter().enumerate() {
            if p.1 < best.0 {
                best = (p.1, i);
            }
        }
        if best.0 == Rank::MAX {
            break;
        }
        let i = best.1;
        parts.remove(i + 1);
        let start = |parts: &Vec<(usize, Rank)>, j: usize| parts.get(j).map(|p| p.0);
        let pair_rank =
            |parts: &Vec<(usize, Rank)>, j: usize| match (start(parts, j), start(parts, j + 2)) {
                (Some(a), Some(b)) => rank_of(ranks, piece, a, b),
                _ => Rank::MAX,
            };
        let r = pair_rank(&parts, i);
        if let Some(p) = parts.get_mut(i) {
            p.1 = r;
        }
        if i > 0 {
            let r = pair_rank(&parts, i - 1);
            if let Some(p) = parts.get_mut(i - 1) {
                p.1 = r;
            }
        }
    }
    parts.len().saturating_sub(1) as u64
}

/// O(n log n) with a heap of candidate merges over a linked list of parts.
fn merge_large(ranks: &FxHashMap<Vec<u8>, Rank>, piece: &[u8]) -> u64 {
    let n = piece.len();
    // For the part starting at byte i: where the next part starts, where the previous one
    // starts, and the rank of merging with the next (MAX: none, or i is not a part start).
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut pair: Vec<Rank> = (0..n).map(|i| rank_of(ranks, piece, i, i + 2)).collect();
    let mut heap: BinaryHeap<Reverse<(Rank, usize)>> = pair
        .iter()
        .enumerate()
        .filter(|(_, r)| **r != Rank::MAX)
        .map(|(i, r)| Reverse((*r, i)))
        .collect();
    let mut parts = n as u64;
    let at = |v: &Vec<usize>, i: usize| v.get(i).copied().unwrap_or(n);
    while let Some(Reverse((r, i))) = heap.pop() {
        if pair.get(i) != Some(&r) {
            continue; // stale: this part changed or was merged away
        }
        let j = at(&next, i); // the right part
        let k = at(&next, j); // where the merged part ends
        if let Some(x) = next.get_mut(i) {
            *x = k;
        }
        if let Some(x) = prev.get_mut(k) {
            *x = i;
        }
        if let Some(x) = pair.get_mut(j) {
            *x = Rank::MAX;
        }
        parts = parts.saturating_sub(1);
        let r = if k < n {
            rank_of(ranks, piece, i, at(&next, k))
        } else {
            Rank::MAX
        };
        if let Some(x) = pair.get_mut(i) {
            *x = r;
        }
        if r != Rank::MAX {
            heap.push(Reverse((r, i)));
        }
        if i > 0 {
            let p = at(&prev, i);
            let r = rank_of(ranks, piece, p, k);
            if let Some(x) = pair.get_mut(p) {
                *x = r;
            }
            if r != Rank::MAX {
                heap.push(Reverse((r, p)));
            }
        }
    }
    parts
}
