//! Token counting with tiktoken-rs: built-in encodings, or a custom byte-level BPE given as ranks,
//! pattern and special tokens (how a served model's own tokenizer is described), and ChatML
//! rendering so a chat prompt is counted as the model will see it.
//!
//! Counting must never panic: tiktoken-rs indexes its rank table by single bytes, so every byte
//! value missing from a custom vocabulary gets an out-of-vocab rank, and duplicate ranks (which
//! tiktoken-rs asserts against) are refused as a configuration error.

use std::collections::HashSet;

use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::{CoreBPE, Rank};

use crate::error::ConfigError;
use crate::request::{ChatMessage, Input, PromptItem};

/// Built-in encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Cl100kBase,
    O200kBase,
    R50kBase,
}

impl Encoding {
    pub fn from_name(name: &str) -> Option<Encoding> {
        match name {
            "cl100k_base" => Some(Encoding::Cl100kBase),
            "o200k_base" => Some(Encoding::O200kBase),
            "r50k_base" | "gpt2" => Some(Encoding::R50kBase),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Cl100kBase => "cl100k_base",
            Encoding::O200kBase => "o200k_base",
            Encoding::R50kBase => "r50k_base",
        }
    }
}

/// A custom BPE: ranks keyed by token bytes, a pre-tokenizer pattern, and special tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CustomBpe {
    pub ranks: Vec<(Vec<u8>, Rank)>,
    pub pattern: String,
    pub special_tokens: Vec<(String, Rank)>,
}

/// The pre-tokenizer pattern of GPT-2-style byte-level BPE as used by SmolLM2 / many Llama-family
/// models (verified against the reference tokenizer on 2.1 M tokens; see shared/FACTS.md).
pub const GPT2_STYLE_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+";

impl CustomBpe {
    /// Parse a `.tiktoken` ranks file: one `base64(token) rank` per line.
    pub fn parse_tiktoken(text: &str) -> Result<Vec<(Vec<u8>, Rank)>, ConfigError> {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split(' ');
            let (Some(tok), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(ConfigError::new(
                    "tokenizer.ranks",
                    format!("line {}", i + 1),
                    "each line must be `<base64 token> <rank>`",
                ));
            };
            let bytes = engine.decode(tok).map_err(|e| {
                ConfigError::new(
                    "tokenizer.ranks",
                    format!("line {}", i + 1),
                    format!("bad base64: {e}"),
                )
            })?;
            let rank: Rank = rank.parse().map_err(|_| {
                ConfigError::new(
                    "tokenizer.ranks",
                    format!("line {}", i + 1),
                    "rank must be a u32",
                )
            })?;
            out.push((bytes, rank));
        }
        Ok(out)
    }

    /// Render ranks as a `.tiktoken` file (the inverse of `parse_tiktoken`).
    pub fn to_tiktoken(&self) -> String {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut s = String::with_capacity(self.ranks.len() * 16);
        for (bytes, rank) in &self.ranks {
            s.push_str(&engine.encode(bytes));
            s.push(' ');
            s.push_str(&rank.to_string());
            s.push('\n');
        }
        s
    }

    /// Build from a GPT-2-style vocabulary (as stored in GGUF `tokenizer.ggml.tokens`): token `i`
    /// has rank `i`; its string maps back to bytes through GPT-2's byte↔unicode table. Tokens whose
    /// type is not 1 (normal) are special tokens.
    pub fn from_gpt2_vocab(
        tokens: &[String],
        token_types: &[i32],
        pattern: &str,
    ) -> Result<Self, ConfigError> {
        let table = gpt2_unicode_to_byte();
        let mut ranks = Vec::with_capacity(tokens.len());
        let mut special_tokens = Vec::new();
        for (i, tok) in tokens.iter().enumerate() {
            let rank = Rank::try_from(i).map_err(|_| {
                ConfigError::new("tokenizer.tokens", tokens.len(), "vocabulary too large")
            })?;
            let normal = token_types.get(i).is_none_or(|t| *t == 1);
            if !normal {
                special_tokens.push((tok.clone(), rank));
                continue;
            }
            let mut bytes = Vec::with_capacity(tok.len());
            for ch in tok.chars() {
                let b = table.get(&ch).copied().ok_or_else(|| {
                    ConfigError::new(
                        "tokenizer.tokens",
                        format!("{tok:?} (id {i})"),
                        "is not a GPT-2 byte-level token",
                    )
                })?;
                bytes.push(b);
            }
            ranks.push((bytes, rank));
        }
        Ok(CustomBpe {
            ranks,
            pattern: pattern.to_string(),
            special_tokens,
        })
    }
}

/// GPT-2's reversible byte → printable-unicode table, inverted.
fn gpt2_unicode_to_byte() -> FxHashMap<char, u8> {
    let mut map = FxHashMap::default();
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let cp = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        if let (Some(c), Ok(byte)) = (char::from_u32(cp), u8::try_from(b)) {
            map.insert(c, byte);
        }
    }
    map
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    Builtin(Encoding),
    Custom(CustomBpe),
}

/// Counts tokens. Built once at configuration time; counting is then allocation-light and pure.
pub struct TokenCounter {
    bpe: CoreBPE,
    specials: HashSet<String>,
    name: String,
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCounter")
            .field("name", &self.name)
            .finish()
    }
}

pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

impl TokenCounter {
    pub fn new(spec: &TokenizerSpec) -> Result<Self, ConfigError> {
        let bad = |e: String| {
            ConfigError::new(
                "tokenizer",
                "",
                format!("could not build the tokenizer: {e}"),
            )
        };
        let (bpe, name) = match spec {
            TokenizerSpec::Builtin(enc) => {
                let bpe = match enc {
                    Encoding::Cl100kBase => tiktoken_rs::cl100k_base(),
                    Encoding::O200kBase => tiktoken_rs::o200k_base(),
                    Encoding::R50kBase => tiktoken_rs::r50k_base(),
                }
                .map_err(|e| bad(e.to_string()))?;
                (bpe, enc.name().to_string())
            }
            TokenizerSpec::Custom(c) => (build_custom(c)?, "custom".to_string()),
        };
        let specials = bpe
            .special_tokens()
            .into_iter()
            .map(str::to_string)
            .collect();
        Ok(TokenCounter {
            bpe,
            specials,
            name,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokens in plain text. Special-token strings inside user text are counted as text (more
    /// tokens than a server that parses them: the safe direction).
    pub fn count_text(&self, text: &str) -> u64 {
        self.bpe.encode_ordinary(text).len() as u64
    }

    /// Encode plain text (for the backend, which needs the ids themselves).
    pub fn encode_text(&self, text: &str) -> Vec<Rank> {
        self.bpe.encode_ordinary(text)
    }

    /// The bytes of token ids (special tokens included); ids outside the vocabulary give `None`.
    pub fn decode_bytes(&self, ids: &[Rank]) -> Option<Vec<u8>> {
        self.bpe.decode_bytes(ids).ok()
    }

    /// The id of a special token, if this tokenizer has it.
    pub fn special_id(&self, token: &str) -> Option<Rank> {
        if !self.specials.contains(token) {
            return None;
        }
        self.bpe.encode_with_special_tokens(token).first().copied()
    }

    /// Encode a chat as ChatML, with the generation prompt for the assistant's turn.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Vec<Rank> {
        let mut out = Vec::new();
        let special = |s: &str, out: &mut Vec<Rank>| {
            if self.specials.contains(s) {
                out.extend(self.bpe.encode_with_special_tokens(s));
            } else {
                out.extend(self.bpe.encode_ordinary(s));
            }
        };
        for m in messages {
            special(IM_START, &mut out);
            out.extend(
                self.bpe
                    .encode_ordinary(&format!("{}\n{}", m.role, m.content)),
            );
            special(IM_END, &mut out);
            out.extend(self.bpe.encode_ordinary("\n"));
        }
        special(IM_START, &mut out);
        out.extend(self.bpe.encode_ordinary("assistant\n"));
        out
    }

    /// Tokens of a chat as the model sees it (ChatML).
    pub fn count_chat(&self, messages: &[ChatMessage]) -> u64 {
        self.encode_chat(messages).len() as u64
    }

    /// Token counts of every prompt of a request (a chat is one prompt).
    pub fn count_input(&self, input: &Input) -> Vec<u64> {
        match input {
            Input::Chat(m) => vec![self.count_chat(m)],
            Input::Prompts(items) => items
                .iter()
                .map(|p| match p {
                    PromptItem::Text(t) => self.count_text(t),
                    PromptItem::Tokens(n) => *n,
                })
                .collect(),
        }
    }
}

fn build_custom(c: &CustomBpe) -> Result<CoreBPE, ConfigError> {
    if c.ranks.is_empty() {
        return Err(ConfigError::new(
            "tokenizer.ranks",
            "empty",
            "must hold at least one token",
        ));
    }
    let mut encoder: FxHashMap<Vec<u8>, Rank> = FxHashMap::default();
    let mut seen: HashSet<Rank> = HashSet::with_capacity(c.ranks.len());
    for (bytes, rank) in &c.ranks {
        if !seen.insert(*rank) {
            return Err(ConfigError::new(
                "tokenizer.ranks",
                format!("rank {rank}"),
                "ranks must be unique",
            ));
        }
        if encoder.insert(bytes.clone(), *rank).is_some() {
            return Err(ConfigError::new(
                "tokenizer.ranks",
                format!("{bytes:?}"),
                "tokens must be unique",
            ));
        }
    }
    // Give every byte value the vocabulary lacks an out-of-vocab rank, so encoding never indexes a
    // missing single byte (tiktoken-rs would panic).
    let mut next = c
        .ranks
        .iter()
        .map(|(_, r)| *r)
        .chain(c.special_tokens.iter().map(|(_, r)| *r))
        .max()
        .unwrap_or(0);
    for b in 0u8..=255 {
        if let std::collections::hash_map::Entry::Vacant(slot) = encoder.entry(vec![b]) {
            next = next.checked_add(1).ok_or_else(|| {
                ConfigError::new(
                    "tokenizer.ranks",
                    "max rank",
                    "leaves no room for byte fallbacks",
                )
            })?;
            slot.insert(next);
        }
    }
    let mut specials: FxHashMap<String, Rank> = FxHashMap::default();
    for (s, r) in &c.special_tokens {
        if seen.contains(r) {
            return Err(ConfigError::new(
                "tokenizer.special_tokens",
                format!("{s:?} = {r}"),
                "special token ranks must not collide with ordinary ranks",
            ));
        }
        specials.insert(s.clone(), *r);
    }
    // fancy-regex validates the pattern; an invalid one is a config error, not a panic.
    CoreBPE::new(encoder, specials, &c.pattern).map_err(|e| {
        ConfigError::new(
            "tokenizer.pattern",
            format!("{:?}", c.pattern),
            format!("invalid pattern: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn builtin_encodings_count_known_strings() {
        let cl = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        // "hello world" is two tokens in cl100k_base, o200k_base and r50k_base alike.
        assert_eq!(cl.count_text("hello world"), 2);
        assert_eq!(cl.encode_text("hello world"), vec![15339, 1917]);
        let o = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::O200kBase)).unwrap();
        assert_eq!(o.encode_text("hello world"), vec![24912, 2375]);
        let r = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::R50kBase)).unwrap();
        assert_eq!(r.encode_text("hello world"), vec![31373, 995]);
        assert_eq!(Encoding::from_name("gpt2"), Some(Encoding::R50kBase));
        assert_eq!(Encoding::from_name("nope"), None);
    }

    fn tiny_vocab() -> CustomBpe {
        // A GPT-2 style vocabulary: 256 byte tokens would be usual; this one lacks most bytes to
        // prove the byte fallback, and has two merges and ChatML specials.
        let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), IM_START.into(), IM_END.into()];
        let mut types = vec![3, 3, 3];
        for t in [
            "h", "e", "l", "o", "Ġ", "Ċ", "he", "ll", "hell", "hello", "Ġhello", "u", "s", "r",
            "a", "i", "t", "n",
        ] {
            tokens.push(t.into());
            types.push(1);
        }
        CustomBpe::from_gpt2_vocab(&tokens, &types, GPT2_STYLE_PATTERN).unwrap()
    }

    #[test]
    fn custom_vocab_from_gpt2_tokens() {
        let v = tiny_vocab();
        assert_eq!(v.special_tokens.len(), 3);
        // "Ġ" is the space byte, "Ċ" the newline byte.
        assert!(v.ranks.contains(&(b" hello".to_vec(), 13)));
        assert!(v.ranks.contains(&(b"\n".to_vec(), 8)));
        let c = TokenCounter::new(&TokenizerSpec::Custom(v.clone())).unwrap();
        assert_eq!(c.encode_text("hello hello"), vec![12, 13]);
        // Bytes absent from the vocab still encode (one out-of-vocab id each), never panic.
        assert_eq!(c.count_text("€"), 3);
        // ChatML: specials count one token each.
        let ids = c.encode_chat(&[msg("user", "hello")]);
        assert_eq!(ids.first(), Some(&1));
        assert_eq!(ids.iter().filter(|i| **i == 2).count(), 1);
        assert_eq!(c.decode_bytes(&[12, 13]), Some(b"hello hello".to_vec()));
        assert_eq!(c.special_id(IM_END), Some(2));
        assert_eq!(c.special_id("<|nope|>"), None);
        // Round trip through the .tiktoken text form.
        let text = v.to_tiktoken();
        assert_eq!(CustomBpe::parse_tiktoken(&text).unwrap(), v.ranks);
    }

    #[test]
    fn chat_count_is_what_the_model_sees() {
        let c = TokenCounter::new(&TokenizerSpec::Custom(tiny_vocab())).unwrap();
        let msgs = [msg("user", "hello")];
        // <|im_start|> "user\nhello" <|im_end|> "\n" <|im_start|> "assistant\n"
        let expect = 1
            + c.count_text("user\nhello")
            + 1
            + c.count_text("\n")
            + 1
            + c.count_text("assistant\n");
        assert_eq!(c.count_chat(&msgs), expect);
        // With an encoding that lacks ChatML specials, they are counted as text (over, never under).
        let cl = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        assert!(cl.count_chat(&msgs) > cl.count_text("user\nhello") + 3);
    }

    #[test]
    fn bad_custom_vocab_is_a_config_error() {
        let mut v = tiny_vocab();
        v.ranks.push((b"zz".to_vec(), 5));
        assert!(TokenCounter::new(&TokenizerSpec::Custom(v))
            .unwrap_err()
            .rule
            .contains("unique"));
        let mut v = tiny_vocab();
        v.pattern = "(".into();
        assert_eq!(
            TokenCounter::new(&TokenizerSpec::Custom(v))
                .unwrap_err()
                .field,
            "tokenizer.pattern"
        );
        assert!(CustomBpe::parse_tiktoken("abc").is_err());
        assert!(CustomBpe::parse_tiktoken("!!! 1").is_err());
        assert!(CustomBpe::from_gpt2_vocab(&["\u{1}".into()], &[1], GPT2_STYLE_PATTERN).is_err());
    }

    #[test]
    fn counts_token_arrays_exactly() {
        let c = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        let input = Input::Prompts(vec![
            PromptItem::Tokens(17),
            PromptItem::Text("hello world".into()),
        ]);
        assert_eq!(c.count_input(&input), vec![17, 2]);
    }
}
