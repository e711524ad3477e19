"""Any Llama-family GGUF: the backend takes its tokenizer, pre-tokenizer, chat template, BOS and
stop ids from the file's own metadata.

Each test writes a small GGUF with the `gguf` package: random weights for a tiny Llama, and a
byte-level BPE vocabulary + merges trained here with Hugging Face `tokenizers` (its ByteLevel BPE
trainer) under a Llama-3-style or Qwen2-style pre-tokenizer and chat template. The real backend
binary serves it, and what it reports (`usage.prompt_tokens` of /v1/completions and
/v1/chat/completions) is checked against an independent implementation: the HF tokenizer that
was trained, encoding the chat as `jinja2` renders the template (HF `apply_chat_template`'s
settings: trim_blocks, lstrip_blocks, raise_exception). A SentencePiece GGUF is refused at start.
"""

import json

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
import requests
from gguf import GGUFWriter
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from harness import BACKEND, Backend

# The pre-tokenizers as the models' tokenizer.json spell them (the backend uses llama.cpp's
# rewrites of the `(?i:…)` group; these are the originals).
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's template without the tool branches (a default system message, ChatML turns).
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = {
    "pre": "llama-bpe",
    "split": LLAMA3_SPLIT,
    "template": LLAMA3_TEMPLATE,
    "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "bos": "<|begin_of_text|>",
    "eos": "<|end_of_text|>",
    "eot": "<|eot_id|>",
    "add_bos": True,
}
QWEN = {
    "pre": "qwen2",
    "split": QWEN2_SPLIT,
    "template": QWEN_TEMPLATE,
    "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "bos": None,
    "eos": "<|im_end|>",
    "eot": None,
    "add_bos": False,
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12345 tokens!",
    "Key-value caches grow with every generated token; a server must budget them in bytes.",
    "Don't panic: THE ANSWER IS 42. They're here, you've seen it, I'd say we're done.\n\n  Indented line\tand tab",
    "Émile a mangé 3 croissants à 7h30 — très bien. Ünïcödé wörds, naïve café, 東京 and 北京.",
    "def f(x):\n    return x * 2  # double it\n\nprint(f(21))\r\n",
    "What is the capital of France? Paris is the capital of France. Numbers: 1 22 333 4444 55555.",
] * 20

TEXTS = [
    "Hello world! What's the capital of France?",
    "It's 12345678 o'clock, THEY'LL say; we're 99% sure.\n\n\nNew paragraph   with  spaces\t\ttabs.",
    "Émile mangé 東京 café 😀 naïve — done.",
    "  leading and trailing spaces  ",
    "code:\n    x = [1, 2, 3]\r\n    y = {'a': 1}\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Count 1 2 3 4 5, please.\n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me 12345 things about café culture in 東京."}],
]


def train_tokenizer(kind):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(kind["split"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=kind["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_gguf(path, kind, tok, tokenizer_model="gpt2", favourite=None):
    """`favourite`: a token the model always picks (its embedding dominates, the layers add
    nothing: attention and MLP outputs are zero), so greedy decoding is predictable."""
    vocab = tok.get_vocab()
    n = len(vocab)
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens)
    types = [3 if t in kind["specials"] else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    hidden, heads, kv_heads, ffn, layers = 64, 4, 2, 128, 2
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(kind["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if kind["bos"]:
        w.add_bos_token_id(vocab[kind["bos"]])
    w.add_eos_token_id(vocab[kind["eos"]])
    if kind["eot"]:
        w.add_eot_token_id(vocab[kind["eot"]])
    w.add_add_bos_token(kind["add_bos"])
    w.add_chat_template(kind["template"])
    rng = np.random.default_rng(0)
    head_dim = hidden // heads

    def lin(out_dim, in_dim):  # [out, in], as PyTorch and llama.cpp's converter store it
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    embed = lin(n, hidden)
    zero_out = favourite is not None
    if favourite is not None:
        u = rng.standard_normal(hidden).astype(np.float32)
        embed = 0.1 * embed + u
        embed[vocab[favourite]] = 10 * u
    w.add_tensor("token_embd.weight", embed)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", lin(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", lin(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", lin(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", lin(hidden, heads * head_dim) * (0 if zero_out else 1))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", lin(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", lin(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", lin(hidden, ffn) * (0 if zero_out else 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def render(kind, messages):
    """What HF `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` gives."""
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(kind["template"]).render(
        messages=messages, add_generation_prompt=True,
        bos_token=kind["bos"] or "", eos_token=kind["eos"])


class GgufBackend(Backend):
    name = "backend"

    def __init__(self, workdir, model):
        super().__init__(workdir, "--kv-cache-bytes", 8 << 20, "--model-name", "tiny")
        self.args[self.args.index("--model") + 1] = str(model)


@pytest.fixture
def served(request, tmp_path):
    """served(kind) -> (backend, trained HF tokenizer) for a GGUF of that kind."""
    assert BACKEND.exists(), f"{BACKEND} missing: run `make backend-build`"
    started = []

    def make(kind, favourite=None):
        tok = train_tokenizer(kind)
        path = tmp_path / f"{kind['pre']}-{len(started)}.gguf"
        write_gguf(path, kind, tok, favourite=favourite)
        b = GgufBackend(tmp_path, path)
        started.append(b)
        b.start()
        # HF's trainer numbers merged tokens in merge order: ids work as ranks, no warning.
        assert "token-id order" not in b.logs()
        return b, tok

    yield make
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else False
    for b in started:
        if failed:
            print(b.logs())
        b.stop()


def usage(b, path, body):
    r = requests.post(b.url + path, json={"model": "tiny", "max_tokens": 1, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("kind", [LLAMA3, QWEN], ids=["llama3", "qwen2"])
def test_tokenization_and_chat_template_match_hf(served, kind):
    b, tok = served(kind)
    bos = 1 if kind["add_bos"] else 0
    for text in TEXTS:
        want = len(tok.encode(text, add_special_tokens=False).ids) + bos
        assert usage(b, "/v1/completions", {"prompt": text}) == want, text
    for msgs in CHATS:
        want = len(tok.encode(render(kind, msgs), add_special_tokens=False).ids)
        assert usage(b, "/v1/chat/completions", {"messages": msgs}) == want, msgs
    # The descriptor carries the same template, BOS and specials to the filter.
    d = requests.get(b.url + "/v1/admission/leases?include=tokenizer", timeout=5,
                     headers=b.gateway_headers()).json()["model"]["tokenizer"]
    assert d["chat_template"] == kind["template"]
    assert d.get("add_bos") == (tok.token_to_id(kind["bos"]) if kind["add_bos"] else None)
    assert d["eos_token"] == kind["eos"]


def random_texts(n, seed):
    """Strings that exercise every branch of the pre-tokenizers: contractions in both cases,
    digit runs, punctuation runs with newlines, every kind of whitespace, non-Latin scripts."""
    rng = np.random.default_rng(seed)
    atoms = ["'s", "'S", "'ll", "'LL", "'Re", "'ve", "'d", "'m", "'t", "a", "e", "The", "fox", "ÉTÉ", "ß",
             "東京", "ж", "😀", "1", "22", "333", "4444", "7", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ",
             "\u00a0", ".", "!!", "?\n", "--", "$", "(", "'", "\"", "#"]
    return ["".join(rng.choice(atoms, size=rng.integers(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("kind", [LLAMA3, QWEN], ids=["llama3", "qwen2"])
def test_random_text_counts_match_hf(served, kind):
    b, tok = served(kind)
    bos = 1 if kind["add_bos"] else 0
    bad = []
    for text in random_texts(150, seed=12):
        want = len(tok.encode(text, add_special_tokens=False).ids) + bos
        got = usage(b, "/v1/completions", {"prompt": text})
        if got != want:
            bad.append((text, got, want))
    assert not bad, bad[:5]


def test_the_template_can_refuse_a_chat(served):
    b, _ = served(QWEN)
    r = requests.post(b.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "developer", "content": "x"}]})
    assert r.status_code == 400, r.text
    assert "Unsupported role: developer" in r.json()["error"]["message"]


@pytest.mark.parametrize("kind,end", [(LLAMA3, "<|eot_id|>"), (LLAMA3, "<|end_of_text|>"), (QWEN, "<|im_end|>")],
                         ids=["llama3-eot", "llama3-eos", "qwen2-im_end"])
def test_generation_stops_on_the_models_end_of_turn(served, kind, end):
    """A model that always picks `end` stops at once (finish_reason `stop`); one that always
    picks an ordinary token runs to max_tokens."""
    b, _ = served(kind, favourite=end)
    for path, body in [("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": CHATS[0]})]:
        r = requests.post(b.url + path, timeout=60, json={"model": "tiny", "max_tokens": 8, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop", r.json()
        assert r.json()["usage"]["completion_tokens"] <= 1
    b, _ = served(kind, favourite="e")
    r = requests.post(b.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.json()["choices"][0]["finish_reason"] == "length", r.json()
    assert r.json()["usage"]["completion_tokens"] == 8


def test_a_sentencepiece_gguf_is_refused_at_start(tmp_path):
    tok = train_tokenizer(LLAMA3)
    path = tmp_path / "spm.gguf"
    write_gguf(path, LLAMA3, tok, tokenizer_model="llama")
    b = GgufBackend(tmp_path, path)
    with pytest.raises(RuntimeError) as e:
        b.start(timeout=30)
    assert 'tokenizer.ggml.model = "llama" is not supported' in str(e.value)
    b.stop()
