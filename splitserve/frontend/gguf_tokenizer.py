"""The tokenizer and chat template of a GGUF file, for the render tier.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary, the merges, each
token's type, the special token IDs, the name of the pre-tokenizer (`tokenizer.ggml.pre`)
and the chat template. They become a `tokenizers` byte-level BPE with the pre-tokenizer
llama.cpp applies for that name, so the token IDs are the ones the model was trained on
(SmolLM's "smollm" splits digits one by one, as its own tokenizer.json does). Only the
`gguf` package (numpy) is used: no torch in the render tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader
from gguf.constants import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from splitserve.frontend.tokenizer import Tokenizer, byte_level_alphabet
from splitserve.gguf_file import GGUFError, metadata_value, open_gguf

# llama.cpp's split expressions (llama-vocab.cpp) for the pre-tokenizer names it writes.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_THEN_BYTES = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that are GPT-2's byte-level split, with or without digits split first.
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_DIGITS_THEN_GPT2_PRE = ("smollm",)
SUPPORTED_PRE_TOKENIZERS = (*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_THEN_BYTES)
# Template variables HF fills from tokenizer_config.json, here from the special token IDs.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True)
class GGUFRenderFiles:
    """What the render tier reads from a GGUF instead of a model directory's JSON files."""

    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as template variables
    max_position_embeddings: int


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFError(
        f"unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); "
        f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def build_backend_tokenizer(reader: GGUFReader, path: str | Path) -> BackendTokenizer:
    kind = metadata_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model); supported: 'gpt2' "
            "(byte-level BPE)"
        )
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = metadata_value(reader, "tokenizer.ggml.merges") or []
    types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or []
    if not tokens or not merges:
        raise GGUFError(f"{path}: the GGUF has no vocabulary or no merges (tokenizer.ggml.*)")
    if types and len(types) != len(tokens):
        raise GGUFError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    # A byte-level vocabulary spells every token in GPT-2's byte alphabet; a token with any
    # other character is stored as raw text and is respelled (as transformers does).
    spelling = byte_level_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        if not right:
            raise GGUFError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(str(metadata_value(reader, "tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are matched
    # whole but kept in decoded text, so the reasoning and tool parsers can see them.
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind == TokenType.CONTROL and set(token) <= alphabet
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind == TokenType.USER_DEFINED and token in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return backend


def load_gguf_render_files(path: str | Path) -> GGUFRenderFiles:
    reader = open_gguf(path)
    backend = build_backend_tokenizer(reader, path)
    special_tokens = {}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata_value(reader, key)
        if token_id is not None and backend.id_to_token(int(token_id)) is not None:
            special_tokens[name] = backend.id_to_token(int(token_id))
    eos = [
        int(token_id)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if (token_id := metadata_value(reader, key)) is not None
    ]
    arch = metadata_value(reader, "general.architecture")
    tokenizer = Tokenizer(backend, config_vocab_size=backend.get_vocab_size(), eos_token_ids=eos)
    return GGUFRenderFiles(
        tokenizer=tokenizer,
        chat_template=metadata_value(reader, "tokenizer.chat_template"),
        special_tokens=special_tokens,
        max_position_embeddings=int(metadata_value(reader, f"{arch}.context_length", 4096)),
    )
