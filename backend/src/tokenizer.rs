//! The served model's tokenizer, rebuilt from GGUF metadata with tiktoken-rs (through
//! kvgate-core, so the filter and the backend count with the same code), an incremental
//! detokenizer for streaming, and stop-string hold-back (`TextStream`).

use std::collections::HashSet;

use anyhow::{bail, Context as _, Result};
use candle_core::quantized::gguf_file;
use kvgate_core::tokenize::{ChatTemplate, CustomBpe, GPT2_STYLE_PATTERN};
use kvgate_core::{TokenCounter, TokenizerSpec};

/// Llama 3's pre-tokenizer (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`; the `(?i:…)` contractions of
/// its tokenizer.json spelled out, as llama.cpp does): digits in groups of up to three.
pub const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`): Llama 3's with single digits.
pub const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-2's own pre-tokenizer (llama.cpp `LLAMA_VOCAB_PRE_TYPE_GPT2`): runs of digits together.
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values served, and their patterns.
pub const PRE_TOKENIZERS: &[(&str, &str)] = &[
    ("llama-bpe", LLAMA3_PATTERN),
    ("llama3", LLAMA3_PATTERN),
    ("qwen2", QWEN2_PATTERN),
    ("smollm", GPT2_STYLE_PATTERN),
    ("default", GPT2_STYLE_PATTERN),
    ("gpt2", GPT2_PATTERN),
    ("gpt-2", GPT2_PATTERN),
];

/// The pre-tokenizer pattern of a GGUF's `tokenizer.ggml.pre` (absent: `default`).
pub fn pre_tokenizer_pattern(pre: Option<&str>) -> Result<&'static str> {
    let pre = pre.unwrap_or("default");
    match PRE_TOKENIZERS.iter().find(|(name, _)| *name == pre) {
        Some((_, pattern)) => Ok(pattern),
        None => bail!(
            "GGUF metadata tokenizer.ggml.pre = {pre:?} is not supported: kvgate-backend serves the \
             BPE pre-tokenizers {}",
            PRE_TOKENIZERS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// End-of-turn special tokens that stop generation when the vocabulary has them as control tokens.
pub const END_OF_TURN: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|eom_id|>",
];

pub struct Tokenizer {
    pub counter: TokenCounter,
    pub bpe: CustomBpe,
    /// Ids that end generation: EOS, EOT and EOM from the metadata, and the vocabulary's
    /// end-of-turn control tokens.
    pub stop_ids: Vec<u32>,
    /// Ids whose text is never streamed (they still count as generated tokens): the
    /// vocabulary's control tokens and other non-text ids (`<|im_start|>`,
    /// `<|start_header_id|>`), as vLLM's `skip_special_tokens` (its default) and llama.cpp's
    /// BPE `token_to_piece` without `special` leave them out. User-defined tokens
    /// (GGUF token type 4, Hugging Face's added tokens that are not special) are text.
    pub hidden_ids: HashSet<u32>,
    /// Number of token ids the model knows.
    pub vocab: u64,
}

/// GGUF `tokenizer.ggml.token_type` of a user-defined token (llama.cpp
/// `LLAMA_TOKEN_TYPE_USER_DEFINED`).
const USER_DEFINED: i32 = 4;
/// GGUF `tokenizer.ggml.token_type` of a control token (llama.cpp `LLAMA_TOKEN_TYPE_CONTROL`).
const CONTROL: i32 = 3;

fn md_u32(ct: &gguf_file::Content, key: &str) -> Option<u32> {
    ct.metadata.get(key).and_then(|v| v.to_u32().ok())
}

fn md_string(ct: &gguf_file::Content, key: &str) -> Option<String> {
    ct.metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .cloned()
}

impl Tokenizer {
    /// The tokenizer a GGUF describes. Refused (with the key, the value and what is served): a
    /// tokenizer model other than `gpt2` (byte-level BPE), or an unknown pre-tokenizer.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer> {
        let model = md_string(ct, "tokenizer.ggml.model").unwrap_or_else(|| "gpt2".into());
        if model != "gpt2" {
            bail!(
                "GGUF metadata tokenizer.ggml.model = {model:?} is not supported: kvgate-backend \
                 serves byte-level BPE tokenizers (\"gpt2\") only, not SentencePiece (\"llama\") or others"
            );
        }
        let pattern = pre_tokenizer_pattern(md_string(ct, "tokenizer.ggml.pre").as_deref())?;
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
        let mut bpe = CustomBpe::from_gpt2_vocab(&tokens, &types, pattern)?;
        let token = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let bos = md_u32(ct, "tokenizer.ggml.bos_token_id");
        let eos = md_u32(ct, "tokenizer.ggml.eos_token_id");
        let add_bos = ct
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        if add_bos {
            bpe.add_bos = Some(bos.context(
                "GGUF metadata tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing",
            )?);
        }
        if let Some(source) = md_string(ct, "tokenizer.chat_template") {
            bpe.chat_template = ChatTemplate::Jinja {
                source,
                bos_token: token(bos),
                eos_token: token(eos),
            };
        }
        let counter = TokenCounter::new(&TokenizerSpec::Custom(bpe.clone()))?;
        let mut stop_ids = Vec::new();
        let metadata_ids = [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ]
        .into_iter()
        .filter_map(|k| md_u32(ct, k));
        let end_of_turn = END_OF_TURN
            .iter()
            .filter_map(|s| counter.special_id(s))
            .filter(|id| types.get(*id as usize) == Some(&CONTROL));
        for id in metadata_ids.chain(end_of_turn) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        // `from_gpt2_vocab` makes every token whose type is not normal (1) a special token.
        let hidden_ids = bpe
            .special_tokens
            .iter()
            .map(|(_, id)| *id)
            .filter(|id| types.get(*id as usize) != Some(&USER_DEFINED))
            .collect();
        Ok(Tokenizer {
            counter,
            bpe,
            stop_ids,
            hidden_ids,
            vocab: tokens.len() as u64,
        })
    }
}

/// Counting uses token ids as BPE ranks (tiktoken's merge rule: the adjacent pair whose joined
/// bytes have the lowest id merges first). That is the reference tokenizer's own rule when every
/// merge `a b` (GGUF `tokenizer.ggml.merges`, in priority order) makes a token of a higher id
/// than the merges before it, as in GPT-2, Llama 3, Qwen 2 and SmolLM2 vocabularies. Returns a
/// warning naming the first merge out of that order, if any.
pub fn merge_order_warning(ct: &gguf_file::Content) -> Option<String> {
    let strings = |key: &str| -> Option<Vec<String>> {
        ct.metadata
            .get(key)?
            .to_vec()
            .ok()?
            .iter()
            .map(|v| v.to_string().ok().cloned())
            .collect()
    };
    let merges = strings("tokenizer.ggml.merges")?;
    let tokens = strings("tokenizer.ggml.tokens")?;
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut last = None;
    let mut out_of_order = 0usize;
    let mut first = None;
    for (i, m) in merges.iter().enumerate() {
        let joined: String = m.split(' ').collect();
        let id = ids.get(joined.as_str()).copied();
        let ok = match (last, id) {
            (Some(prev), Some(id)) => id > prev,
            (_, None) => false,
            (None, Some(_)) => true,
        };
        if !ok {
            out_of_order += 1;
            first.get_or_insert_with(|| format!("merge {i} {m:?} (token id {id:?})"));
        }
        last = id.or(last);
    }
    first.map(|f| {
        format!(
            "warning: {out_of_order} of {} GGUF merges are not in token-id order (first: {f}); kvgate \
             counts with ids as merge ranks, so its token counts may differ from the model's reference tokenizer",
            merges.len()
        )
    })
}

/// Turns a growing list of token ids into text chunks, never splitting a UTF-8 character.
///
/// Bytes that can never be UTF-8 become one U+FFFD per invalid sequence (as
/// `String::from_utf8_lossy` counts them) and are dropped; the valid text after them, and an
/// incomplete character at the end, are kept. A character still incomplete when generation
/// ends is flushed as one U+FFFD by `finish`, as vLLM's detokenizer does.
#[derive(Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
    pub text: String,
}

impl Detokenizer {
    /// Append a token's bytes; returns the newly completed text (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> &str {
        self.pending.extend_from_slice(bytes);
        let start = self.text.len();
        let mut from = 0;
        loop {
            let rest = self.pending.get(from..).unwrap_or_default();
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    self.text.push_str(s);
                    from = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Valid by construction: `from_utf8` checked these bytes.
                    self.text.push_str(&String::from_utf8_lossy(
                        rest.get(..valid).unwrap_or_default(),
                    ));
                    match e.error_len() {
                        // Bytes that no later byte can make valid: one U+FFFD, and go on after.
                        Some(bad) => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            from += valid + bad;
                        }
                        // A character the next token may complete: it waits.
                        None => {
                            from += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..from);
        self.text.get(start..).unwrap_or("")
    }

    /// Generation ended: an incomplete character left pending becomes one U+FFFD. Returns the
    /// text this added (possibly empty).
    pub fn finish(&mut self) -> &str {
        let start = self.text.len();
        if !self.pending.is_empty() {
            self.pending.clear();
            self.text.push(char::REPLACEMENT_CHARACTER);
        }
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
    ///
    /// Only the new text and the held-back tail before it are searched: a stop string that
    /// was not in the text before this token must end in what it added, so it starts at most
    /// `hold` bytes before. A sequence's search costs its output's length, not its square.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        let before = self.detok.text.len();
        self.detok.push(bytes);
        self.search_from(before);
        self.stop_at.is_some()
    }

    /// Look for the first stop string in what the text gained after byte `before` (and the
    /// held-back tail before it), unless one was found already.
    fn search_from(&mut self, before: usize) {
        if self.stop_at.is_some() {
            return;
        }
        let text = &self.detok.text;
        let mut from = before.saturating_sub(self.hold);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        self.stop_at = text
            .get(from..)
            .and_then(|tail| find_stop(tail, &self.stops))
            .map(|at| from + at);
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
    ///
    /// An incomplete character at the end is flushed first (one U+FFFD), and searched for a stop
    /// string like any other text.
    pub fn rest(&mut self) -> Option<String> {
        let before = self.detok.text.len();
        self.detok.finish();
        self.search_from(before);
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
pub fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;
    use kvgate_core::request::ChatMessage;

    /// GGUF metadata of a small byte-level BPE: specials first (control tokens), then the printable
    /// ASCII bytes, then a few merges.
    fn gguf(extra: &[(&str, Value)]) -> gguf_file::Content {
        let mut tokens: Vec<String> = [
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut types = vec![3i32; tokens.len()];
        // "Ġ" is the space byte and "Ċ" the newline in GPT-2's byte-level alphabet.
        for t in (b'!'..=b'~').map(|b| (b as char).to_string()).chain(
            [
                "Ġ", "Ċ", "ĊĊ", "12", "123", "he", "ll", "hell", "hello", "Ġhello",
            ]
            .iter()
            .map(|s| s.to_string()),
        ) {
            tokens.push(t);
            types.push(1);
        }
        let mut md: std::collections::HashMap<String, Value> = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("llama-bpe".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(0)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for (k, v) in extra {
            md.insert(k.to_string(), v.clone());
        }
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata: md,
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn pre_tokenizers_map_to_their_patterns_and_others_are_refused() {
        assert_eq!(
            pre_tokenizer_pattern(Some("llama-bpe")).unwrap(),
            LLAMA3_PATTERN
        );
        assert_eq!(
            pre_tokenizer_pattern(Some("llama3")).unwrap(),
            LLAMA3_PATTERN
        );
        assert_eq!(pre_tokenizer_pattern(Some("qwen2")).unwrap(), QWEN2_PATTERN);
        assert_eq!(
            pre_tokenizer_pattern(Some("smollm")).unwrap(),
            GPT2_STYLE_PATTERN
        );
        assert_eq!(pre_tokenizer_pattern(None).unwrap(), GPT2_STYLE_PATTERN);
        assert_eq!(pre_tokenizer_pattern(Some("gpt2")).unwrap(), GPT2_PATTERN);
        let e = pre_tokenizer_pattern(Some("deepseek-llm"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.ggml.pre") && e.contains("deepseek-llm") && e.contains("qwen2"),
            "{e}"
        );
        // The patterns differ where the models do: digits.
        let tok = |pre: &str| {
            Tokenizer::from_gguf(&gguf(&[("tokenizer.ggml.pre", Value::String(pre.into()))]))
                .unwrap()
        };
        assert_eq!(
            tok("llama-bpe").counter.encode_text("1234").len(),
            2,
            "123 4"
        );
        assert_eq!(
            tok("qwen2").counter.encode_text("1234").len(),
            4,
            "one digit a token"
        );
        let bad = gguf(&[("tokenizer.ggml.pre", Value::String("falcon".into()))]);
        assert!(Tokenizer::from_gguf(&bad).is_err());
        let spm = gguf(&[("tokenizer.ggml.model", Value::String("llama".into()))]);
        let e = Tokenizer::from_gguf(&spm).err().unwrap().to_string();
        assert!(
            e.contains("tokenizer.ggml.model") && e.contains("\"llama\"") && e.contains("gpt2"),
            "{e}"
        );
    }

    #[test]
    fn merges_out_of_id_order_are_reported() {
        let merges = |ms: &[&str]| {
            gguf(&[(
                "tokenizer.ggml.merges",
                Value::Array(ms.iter().map(|m| Value::String(m.to_string())).collect()),
            )])
        };
        // "he" < "ll" < "hell" < "hello" in id order, as their merges.
        assert_eq!(
            merge_order_warning(&merges(&["h e", "l l", "he ll", "hell o"])),
            None
        );
        assert_eq!(merge_order_warning(&gguf(&[])), None);
        let w = merge_order_warning(&merges(&["l l", "h e", "he ll"])).unwrap();
        assert!(w.contains("1 of 3") && w.contains("\"h e\""), "{w}");
        assert!(
            merge_order_warning(&merges(&["x y"])).is_some(),
            "a merge making no token"
        );
    }

    #[test]
    fn stop_ids_and_bos_come_from_the_metadata() {
        let t = Tokenizer::from_gguf(&gguf(&[])).unwrap();
        // EOS (2), then the vocabulary's end-of-turn control tokens.
        assert_eq!(t.stop_ids, vec![2, 1, 5]);
        assert_eq!(t.bpe.add_bos, None);
        assert_eq!(
            t.counter.encode_prompt("hello"),
            t.counter.encode_text("hello")
        );
        let t = Tokenizer::from_gguf(&gguf(&[
            ("tokenizer.ggml.eot_token_id", Value::U32(1)),
            ("tokenizer.ggml.eom_token_id", Value::U32(5)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ]))
        .unwrap();
        assert_eq!(t.stop_ids, vec![2, 1, 5]);
        assert_eq!(t.counter.encode_prompt("hello").first(), Some(&0));
        let no_bos = gguf(&[("tokenizer.ggml.add_bos_token", Value::Bool(true))]);
        let mut no_bos = no_bos;
        no_bos.metadata.remove("tokenizer.ggml.bos_token_id");
        assert!(Tokenizer::from_gguf(&no_bos).is_err());
    }

    #[test]
    fn control_tokens_are_hidden_and_user_defined_ones_are_text() {
        let mut ct = gguf(&[]);
        let push = |ct: &mut gguf_file::Content, key: &str, v: Value| {
            if let Some(Value::Array(a)) = ct.metadata.get_mut(key) {
                a.push(v);
            }
        };
        push(
            &mut ct,
            "tokenizer.ggml.tokens",
            Value::String("<tool_call>".into()),
        );
        push(
            &mut ct,
            "tokenizer.ggml.token_type",
            Value::I32(USER_DEFINED),
        );
        let t = Tokenizer::from_gguf(&ct).unwrap();
        let tool_call = t.vocab as u32 - 1;
        assert_eq!(t.counter.special_id("<tool_call>"), Some(tool_call));
        let mut hidden: Vec<u32> = t.hidden_ids.iter().copied().collect();
        hidden.sort_unstable();
        // Every control token (the stop ids among them, and <|start_header_id|> = 3, which
        // is none), not the user-defined one and no normal token.
        assert_eq!(hidden, vec![0, 1, 2, 3, 4, 5]);
        assert!(!t.hidden_ids.contains(&tool_call));
        // Without token types every token is normal: nothing is hidden.
        let mut ct = gguf(&[]);
        ct.metadata.remove("tokenizer.ggml.token_type");
        assert!(Tokenizer::from_gguf(&ct).unwrap().hidden_ids.is_empty());
    }

    #[test]
    fn the_chat_template_comes_from_the_gguf() {
        let llama3 = "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let t = Tokenizer::from_gguf(&gguf(&[(
            "tokenizer.chat_template",
            Value::String(llama3.into()),
        )]))
        .unwrap();
        let msgs = [ChatMessage {
            role: "user".into(),
            content: " hello ".into(),
            ..ChatMessage::default()
        }];
        let ids = t.counter.encode_chat(&msgs).unwrap();
        let mut want = vec![0, 3];
        want.extend(t.counter.encode_text("user"));
        want.push(4);
        want.extend(t.counter.encode_text("\n\nhello"));
        want.extend([1, 3]);
        want.extend(t.counter.encode_text("assistant"));
        want.push(4);
        want.extend(t.counter.encode_text("\n\n"));
        assert_eq!(ids, want);
        assert_eq!(t.counter.count_chat(&msgs), ids.len() as u64);
        // Without a template in the GGUF: the built-in ChatML.
        let t = Tokenizer::from_gguf(&gguf(&[])).unwrap();
        assert_eq!(t.bpe.chat_template, ChatTemplate::ChatMl);
    }

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

    #[test]
    fn detokenizer_replaces_only_the_invalid_bytes_and_keeps_a_partial_character_after_them() {
        let mut d = Detokenizer::default();
        // A leaves a lead byte pending; B makes it invalid and starts "\u{201c}"; C ends it.
        assert_eq!(d.push(&[0xe2]), "");
        assert_eq!(d.push(&[b' ', 0xe2, 0x80]), "\u{fffd} ");
        assert_eq!(d.push(&[0x9c]), "\u{201c}");
        // Several invalid sequences in one token: one U+FFFD each, as from_utf8_lossy counts.
        assert_eq!(
            d.push(&[0xff, b'a', 0xc3, 0x28, 0xe2, 0x82]),
            "\u{fffd}a\u{fffd}("
        );
        assert_eq!(d.push(&[0xac]), "\u{20ac}");
        assert_eq!(d.text, "\u{fffd} \u{201c}\u{fffd}a\u{fffd}(\u{20ac}");
        // What is left incomplete at the end is flushed as one U+FFFD.
        assert_eq!(d.push(&[0xf0, 0x9f]), "");
        assert_eq!(d.finish(), "\u{fffd}");
        assert_eq!(d.finish(), "", "flushed once");
    }

    #[test]
    fn the_rest_flushes_an_incomplete_character_and_searches_it_for_a_stop() {
        let stops = vec!["x".to_string()];
        let mut t = TextStream::new(&stops);
        assert!(!t.push(b"ab"));
        assert!(!t.push(&[0xe2, 0x82]));
        assert_eq!(t.ready(), Some("ab".into()));
        assert_eq!(t.rest(), Some("\u{fffd}".into()));
        assert_eq!(t.rest(), None, "nothing is sent twice");
        // A stop string the flushed U+FFFD completes still cuts the text there.
        let stops = vec!["b\u{fffd}".to_string()];
        let mut t = TextStream::new(&stops);
        assert!(!t.push(b"ab"));
        assert!(!t.push(&[0xe2]));
        assert_eq!(t.ready(), None, "held back: it may start the stop string");
        assert_eq!(t.rest(), Some("a".into()));
        assert_eq!(t.stop_at, Some(1));
    }

    #[test]
    fn a_bad_byte_before_a_split_character_does_not_break_the_character_or_a_stop() {
        // The same bytes as in the detokenizer test, through the stream with a stop string on
        // the character the bad bytes are followed by: found, and nothing past it sent.
        let stops = vec!["\u{201c}".to_string()];
        let mut t = TextStream::new(&stops);
        let mut out = Vec::new();
        assert!(!t.push(&[0xe2]));
        out.extend(t.ready());
        assert!(!t.push(&[b' ', 0xe2, 0x80]));
        out.extend(t.ready());
        assert!(t.push(&[0x9c, b'z']));
        out.extend(t.ready());
        assert_eq!(out.concat(), "\u{fffd} ");
        assert_eq!(t.rest(), None);
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

    proptest::proptest! {
        /// The search of the new text alone finds the stop the whole text's search finds,
        /// however the text is cut into tokens (multi-byte characters and stops included).
        #[test]
        fn searching_only_the_new_text_finds_the_first_stop(
            text in "[ab€X]{0,60}",
            sizes in proptest::collection::vec(0usize..7, 1..40),
            stops in proptest::collection::vec("[ab€X]{1,3}", 0..4),
        ) {
            let mut t = TextStream::new(&stops);
            let mut rest = text.as_bytes();
            for n in sizes.iter().cycle().take(text.len() + sizes.len()) {
                let (token, after) = rest.split_at((*n).min(rest.len()));
                rest = after;
                let stopped = t.push(token);
                proptest::prop_assert_eq!(t.stop_at, find_stop(&t.detok.text, &stops));
                if stopped || rest.is_empty() {
                    break;
                }
            }
        }
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
