//! Chat templates: how a served model turns chat messages into the prompt text it sees.
//!
//! Two kinds: the built-in ChatML rendering (`"chatml"` on the wire, what backends before
//! templates meant and what a filter configured by hand uses), and a Jinja template as a GGUF
//! carries it (`tokenizer.chat_template`), rendered with minijinja the way Hugging Face
//! `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks` on, with `messages`,
//! `add_generation_prompt = true`, `bos_token`, `eos_token` and `raise_exception`, and Python's
//! string methods (`.strip()`, `.startswith()`, …) through minijinja-contrib's pycompat.
//!
//! The filter and the backend render with this same code, so the filter counts exactly the
//! prompt the backend will run. Rendering is linear in the messages' bytes for the templates
//! models ship (one pass over the messages); the caller bounds those bytes before rendering.
//! Never panics: a template that does not compile or raises is an error value.

use minijinja::{Environment, ErrorKind, Value};

use crate::error::ConfigError;
use crate::request::ChatMessage;

/// The wire name of the built-in ChatML rendering.
pub const CHATML: &str = "chatml";

/// How chat messages become prompt text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ChatTemplate {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
    #[default]
    ChatMl,
    /// A Jinja chat template with the strings it may insert for `bos_token` and `eos_token`.
    Jinja {
        source: String,
        bos_token: String,
        eos_token: String,
    },
}

impl ChatTemplate {
    /// From the descriptor's `chat_template`: `"chatml"` (or nothing, from an older backend) is
    /// the built-in rendering; anything else is a Jinja template's source.
    pub fn from_wire(source: &str, bos_token: &str, eos_token: &str) -> ChatTemplate {
        if source.is_empty() || source == CHATML {
            ChatTemplate::ChatMl
        } else {
            ChatTemplate::Jinja {
                source: source.to_string(),
                bos_token: bos_token.to_string(),
                eos_token: eos_token.to_string(),
            }
        }
    }

    /// What the descriptor's `chat_template` carries.
    pub fn wire(&self) -> &str {
        match self {
            ChatTemplate::ChatMl => CHATML,
            ChatTemplate::Jinja { source, .. } => source,
        }
    }
}

/// A compiled Jinja chat template.
pub(crate) struct Compiled {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl Compiled {
    pub(crate) fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ConfigError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| {
                ConfigError::new(
                    "tokenizer.chat_template",
                    format!("{} bytes", source.len()),
                    format!("does not compile: {e}"),
                )
            })?;
        Ok(Compiled {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The prompt text of `messages`, with the generation prompt for the assistant's turn.
    pub(crate) fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_iter([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(minijinja::context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_string(),
            _ => e.to_string(),
        })
    }
}

/// `raise_exception(msg)` as Hugging Face defines it for templates: fail with the message.
fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }

    /// SmolLM2-135M-Instruct's GGUF template, as shipped.
    pub(crate) const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Llama 3's template (Meta-Llama-3-8B-Instruct).
    pub(crate) const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn renders_smollm2_with_its_default_system_message() {
        let t = Compiled::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            t.render(&[msg("user", "Hi")]).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[msg("system", "S"), msg("user", "Hi")]).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn renders_llama3_with_bos_and_trim() {
        let t = Compiled::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        assert_eq!(
            t.render(&[msg("user", "  Hi \n")]).unwrap(),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_python_methods_and_bad_templates() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}";
        let t = Compiled::new(src, "", "").unwrap();
        assert_eq!(
            t.render(&[msg("system", "x")]).unwrap_err(),
            "roles must start with user"
        );
        assert_eq!(t.render(&[msg("user", " hi ")]).unwrap(), "HI");
        let e = Compiled::new("{% for %}", "", "").err().unwrap();
        assert_eq!(e.field, "tokenizer.chat_template");
        assert_eq!(
            ChatTemplate::from_wire("chatml", "a", "b"),
            ChatTemplate::ChatMl
        );
        assert_eq!(ChatTemplate::from_wire("", "a", "b"), ChatTemplate::ChatMl);
        assert_eq!(ChatTemplate::from_wire(SMOLLM2, "", "").wire(), SMOLLM2);
    }
}
