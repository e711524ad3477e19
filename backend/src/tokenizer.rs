//! The served model's tokenizer, rebuilt from GGUF metadata with tiktoken-rs (through
//! kvgate-core, so the filter and the backend count with the same code), and an incremental
//! detokenizer for streaming.

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
}
