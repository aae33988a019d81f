"""The random-weight text decoder that `splitserve tiny-model` writes: its spec, a
byte-level BPE tokenizer trained on a deterministically generated corpus, a ChatML chat
template with tools and thinking, and weights from numpy's PCG64 generator (whose stream is
fixed across platforms and versions, so a seed gives the same files everywhere).
The vision-language variant (tiny_vl.py) builds on these pieces."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from splitserve.model.tiny_moe import TinyMoeSpec, moe_config_fields, shared_width, sparse_layer_weights

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special, as in Qwen3: they survive skip_special_tokens, so the
# reasoning and tool-call parsers can see them in decoded text.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
}
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "qwen3"
    seed: int = 0
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    intermediate: int | None = None
    vocab: int = 2048
    max_position: int = 4096
    dtype: str = "float32"
    moe: TinyMoeSpec = field(default_factory=TinyMoeSpec)  # a MoE arch's experts (others ignore it)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def resolved_intermediate(self) -> int:
        return self.intermediate or 3 * self.hidden


_COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there can all their one been has more if will "
    "would what when we about time your which so model token cache prefill decode request "
    "server engine stream answer question reason think tool call function weather city today "
    "tomorrow please thanks user assistant system hello world data value result error python "
    "json list number string true false null return import def class print"
).split()
_SYLLABLES = (
    "ka ri to mu se na lo vi pe du ra zo ne shi ta ko mi ba le gu fa ho ji wen qu xi lan ter "
    "ing ion est ar or en al an er on re st ch th sp str pl gr ou ea ie"
).split()
_NON_ASCII = (
    "café naïve Größe über straße niño façade résumé 東京 你好 世界 こんにちは 日本語 русский язык привет "
    "Ελληνικά عربي हिन्दी 한국어 🙂 🚀 ✓ € £ — … “quoted” ‘single’"
).split()
_SNIPPETS = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}',
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    '<tool_response>\n{"temperature": 21}\n</tool_response>',
    "# Tools\n\nYou may call one or more functions.\n",
    "1, 2, 3, 42, 100, 2048, 3.14159, -7, 1e-5",
)


def corpus_lines(seed: int, num_lines: int) -> list[str]:
    """Text to train the BPE on: words, pseudo-words, code, JSON and non-ASCII, all
    generated from `random.Random(seed)`, whose sequence is stable across machines."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            kind = rng.random()
            if kind < 0.45:
                words.append(rng.choice(_COMMON_WORDS))
            elif kind < 0.85:
                word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
                words.append(word.capitalize() if rng.random() < 0.2 else word)
            elif kind < 0.93:
                words.append(rng.choice(_NON_ASCII))
            else:
                words.append(str(rng.randint(0, 99999)))
        line = " ".join(words) + rng.choice([".", ",", "?", "!", ":", ""])
        if rng.random() < 0.1:
            line += "\n" + rng.choice(_SNIPPETS)
        lines.append(line)
    return lines


def build_tokenizer(vocab: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_lines = max(2000, vocab // 2)
    tokenizer.train_from_iterator(corpus_lines(seed, num_lines), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def chat_template() -> str:
    return resources.files("splitserve.model").joinpath("chatml_template.jinja").read_text()


def write_tokenizer(
    out: Path, tokenizer, added_tokens: tuple[str, ...], template: str, max_position: int
) -> None:
    """tokenizer.json and a tokenizer_config.json declaring `added_tokens` (all special
    except the MARKUP_TOKENS) and the chat template."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {}
    for token in added_tokens:
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": token not in MARKUP_TOKENS,
        }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": max_position,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))


def _config(spec: TinyModelSpec, eos_id: int, pad_id: int) -> dict:
    architecture, model_type = ARCHITECTURES[spec.arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.resolved_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if spec.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers)
    if spec.arch == "qwen3":
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if spec.arch == "qwen3_moe":
        config.update(moe_config_fields(spec.moe, spec.hidden))
    if spec.arch == "qwen2_moe":
        config.update(moe_config_fields(spec.moe, spec.hidden, spec.arch))
        config.update(
            qkv_bias=True, use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers
        )
    return config


def random_weights(spec: TinyModelSpec) -> dict[str, np.ndarray]:
    """Random float32 weights scaled so that activations stay O(1) through the layers
    and greedy logits have clear gaps (a float32 oracle comparison is then exact)."""
    rng = np.random.default_rng(spec.seed)
    hidden, head_dim = spec.hidden, spec.resolved_head_dim
    q_dim, kv_dim, inter = spec.heads * head_dim, spec.kv_heads * head_dim, spec.resolved_intermediate

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.sqrt(in_dim)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((spec.vocab, hidden), dtype=np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        if spec.arch in ("qwen2", "qwen2_moe"):
            for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                weights[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(dim)).astype(
                    np.float32
                )
        if spec.arch in ("qwen3", "qwen3_moe"):
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        if spec.arch in MOE_ARCHS and spec.moe.is_sparse_layer(i):
            shared = shared_width(spec.moe, spec.arch, hidden)
            weights.update(sparse_layer_weights(spec.moe, p, hidden, linear, shared))
            continue
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = linear(spec.vocab, hidden) * 4.0
    return weights


TEXT_DTYPES = ("float32", "bfloat16", "float16")


def check_spec(spec: TinyModelSpec) -> None:
    """ValueError for a spec no tiny model can have."""
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden must divide by heads and heads by kv-heads")
    if spec.dtype not in TEXT_DTYPES:
        raise ValueError(f"unsupported dtype {spec.dtype!r}")
    if spec.vocab < 512:
        raise ValueError("vocab must be at least 512 (256 bytes + specials + merges)")
    if spec.arch in MOE_ARCHS:
        spec.moe.check()


def write_tiny_text_model(directory: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """A llama, qwen2, qwen3, qwen3_moe or qwen2_moe model directory with random weights."""
    import torch
    from safetensors.torch import save_file

    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose from {sorted(ARCHITECTURES)}")
    check_spec(spec)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab, spec.seed)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    write_tokenizer(out, tokenizer, SPECIAL_TOKENS + MARKUP_TOKENS, chat_template(), spec.max_position)
    (out / "config.json").write_text(json.dumps(_config(spec, eos_id, pad_id), indent=2))
    write_generation_config(out, eos_id, pad_id)

    dtype = getattr(torch, spec.dtype)
    tensors = {name: torch.from_numpy(w).to(dtype).contiguous() for name, w in random_weights(spec).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_generation_config(out: Path, eos_id: int, pad_id: int) -> None:
    """generation_config.json of a tiny model: greedy, stopping at <|im_end|> or padding."""
    generation_config = {
        "bos_token_id": pad_id,
        "eos_token_id": [eos_id, pad_id],
        "pad_token_id": pad_id,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
