//! The served model's tokenizer, rebuilt from GGUF metadata with tiktoken-rs (through
//! kvgate-core, so the filter and the backend count with the same code), an incremental
//! detokenizer for streaming, and stop-string hold-back (`TextStream`).

use anyhow::{Context as _, Result};
use candle_core::quantized::gguf_file;
use kvgate_core::tokenize::{CustomBpe, GPT2_STYLE_PATTERN, IM_END};
use kvgate_core::{TokenCounter, TokenizerSpec};

pub struct Tokenizer {
    pub counter: TokenCounter,
    pub bpe: CustomBpe,
    /// Ids that end generation: EOS and ChatML's end of turn.
    pub stop_ids: Vec<u32>,
    /// Number of token ids the model knows.
    pub vocab: u64,
}

impl Tokenizer {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer> {
        let tokens: Vec<String> = ct
            .metadata
            .get("tokenizer.ggml.tokens")
            .context("GGUF has no tokenizer.ggml.tokens")?
            .to_vec()?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<candle_core::Result<_>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<candle_core::Result<_>>()?,
            None => Vec::new(),
        };
        let bpe = CustomBpe::from_gpt2_vocab(&tokens, &types, GPT2_STYLE_PATTERN)?;
        let counter = TokenCounter::new(&TokenizerSpec::Custom(bpe.clone()))?;
        let mut stop_ids = Vec::new();
        if let Some(eos) = ct
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok())
        {
            stop_ids.push(eos);
        }
        if let Some(id) = counter.special_id(IM_END) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        Ok(Tokenizer {
            counter,
            bpe,
            stop_ids,
            vocab: tokens.len() as u64,
        })
    }
}

/// Turns a growing list of token ids into text chunks, never splitting a UTF-8 character.
#[derive(Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
    pub text: String,
}

impl Detokenizer {
    /// Append a token's bytes; returns the newly completed text (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> &str {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid bytes (not just incomplete): emit them lossily rather than stall.
                self.pending.len()
            }
            Err(e) => e.valid_up_to(),
        };
        let start = self.text.len();
        let done: Vec<u8> = self.pending.drain(..valid).collect();
        self.text.push_str(&String::from_utf8_lossy(&done));
        self.text.get(start..).unwrap_or("")
    }
}

/// A sequence's generated text as it may be streamed: decoded without splitting a UTF-8
/// character, cut at the first stop string, and holding back a tail that could still become
/// one (a stop string's length less one byte), so a client never sees part of a stop string.
pub struct TextStream {
    detok: Detokenizer,
    stops: Vec<String>,
    /// Bytes held back while no stop string has been seen.
    hold: usize,
    /// Byte offset of the first stop string, once there is one.
    stop_at: Option<usize>,
    /// Bytes of `detok.text` already handed out.
    emitted: usize,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        TextStream {
            detok: Detokenizer::default(),
            hold: stops
                .iter()
                .map(|s| s.len().saturating_sub(1))
                .max()
                .unwrap_or(0),
            stops,
            stop_at: None,
            emitted: 0,
        }
    }

    /// Append a token's bytes; true once the text holds a stop string (generation ends there).
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        self.detok.push(bytes);
        if self.stop_at.is_none() {
            self.stop_at = find_stop(&self.detok.text, &self.stops);
        }
        self.stop_at.is_some()
    }

    /// Text that can be sent now: up to a stop string, or all but the held-back tail.
    pub fn ready(&mut self) -> Option<String> {
        let text = &self.detok.text;
        let end = self.stop_at.unwrap_or_else(|| {
            let mut end = text.len().saturating_sub(self.hold);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            end
        });
        self.take_to(end)
    }

    /// Everything not sent yet (generation ended for another reason than a stop string; up to
    /// the stop string if there is one).
    pub fn rest(&mut self) -> Option<String> {
        self.take_to(self.stop_at.unwrap_or(self.detok.text.len()))
    }

    fn take_to(&mut self, end: usize) -> Option<String> {
        if end <= self.emitted {
            return None;
        }
        let chunk = self.detok.text.get(self.emitted..end)?.to_string();
        self.emitted = end;
        Some(chunk)
    }
}

/// Byte offset of the first stop string in `text`, if any.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detokenizer_waits_for_whole_characters() {
        let mut d = Detokenizer::default();
        let euro = "€".as_bytes();
        assert_eq!(d.push(b"a"), "a");
        assert_eq!(d.push(&euro[..1]), "");
        assert_eq!(d.push(&euro[1..]), "€");
        assert_eq!(d.push(&[0xff]), "\u{fffd}");
        assert_eq!(d.text, "a€\u{fffd}");
    }

    fn stream(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut t = TextStream::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            let stopped = t.push(p.as_bytes());
            out.extend(t.ready());
            if stopped {
                return (out, true);
            }
        }
        out.extend(t.rest());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_never_sent() {
        let (out, stopped) = stream(&["END"], &["ab", "cE", "N", "Dxyz"]);
        assert!(stopped);
        assert_eq!(out.concat(), "abc");
        // The held-back tail is sent as soon as it can no longer become a stop string.
        assert_eq!(out, vec!["ab", "c"]);
    }

    #[test]
    fn without_a_stop_string_everything_is_sent_in_the_end() {
        let (out, stopped) = stream(&["END", ""], &["ab", "cE", "N"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "abcEN");
        let (out, _) = stream(&[], &["a", "b"]);
        assert_eq!(out, vec!["a", "b"], "no stop strings: nothing held back");
    }

    #[test]
    fn hold_back_never_splits_a_character() {
        // "€" is 3 bytes; holding back 1 byte must hold back the whole character.
        let (out, stopped) = stream(&["xy"], &["a€", "b"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "€", "b"]);
        assert_eq!(find_stop("aXbX", &["X".into(), "b".into()]), Some(1));
    }
}
