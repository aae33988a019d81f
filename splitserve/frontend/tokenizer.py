"""A tokenizer over the `tokenizers` library that encodes resent conversations in O(new text).

`tokenizers` first cuts the input at added tokens (special or not) and runs the normalizer,
pre-tokenizer and BPE on each piece between them: BPE never merges across an added token.
So `encode` splits the text at the same places, looks each piece up in a per-instance LRU
cache keyed by its content, and only runs the tokenizer on pieces it has not seen. A chat
that resends 40 turns re-tokenizes only the newest turn. The IDs equal tokenizing the
whole string; tokenizers for which that cannot be guaranteed (added tokens that strip
whitespace or match single words, or a pipeline that treats the first piece differently)
are detected at load time and encode the whole string instead.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

# Text that exercises piece boundaries: added tokens at the start, the end, back to back,
# next to spaces and newlines, and non-ASCII.
_SEGMENT_PROBES = (
    "{0}hello world{1}\n {0} x{1}{1}  y  \n\n{0}",
    " leading space{0}  two spaces {1}end ",
    "Größe 東京 🙂{0}\t tab{1}é",
)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids_from(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class SegmentCache:
    """Bounded LRU of text piece -> token IDs (bounded by entries and by characters held).
    IDs are kept as 32-bit arrays: a cached token costs 4 bytes, not a Python int."""

    def __init__(self, max_entries: int = 16384, max_chars: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, piece: str) -> array | None:
        with self._lock:
            ids = self._entries.get(piece)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(piece)
            self.hits += 1
            return ids

    def put(self, piece: str, ids: array) -> None:
        if len(piece) > self.max_chars:
            return
        with self._lock:
            if piece in self._entries:
                return
            self._entries[piece] = ids
            self._chars += len(piece)
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._entries)


class Tokenizer:
    """Token IDs <-> text for one model directory. Safe to share between threads."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        config_vocab_size: int = 0,
        eos_token_ids: Iterable[int] = (),
        cache: SegmentCache | None = None,
    ) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self.added_token_ids: frozenset[int] = frozenset(added)
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_by_content = {t.content: i for i, t in added.items()}
        self.vocab_size: int = max(config_vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.cache = cache if cache is not None else SegmentCache()
        self._byte_table: list[bytes] | None = None
        contents = sorted(self._added_by_content, key=len, reverse=True)  # longest first, as tokenizers
        self._splitter = re.compile("|".join(map(re.escape, contents))) if contents else None
        self.segmented = self._splitter is not None and self._segmentation_is_exact(added)

    @classmethod
    def from_dir(cls, model_dir: str) -> Tokenizer:
        directory = Path(model_dir)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        backend = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "config.json")
        generation = _read_json(directory / "generation_config.json")
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        eos = _ids_from(generation.get("eos_token_id")) + _ids_from(config.get("eos_token_id"))
        eos_token = tokenizer_config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if isinstance(eos_token, str) and backend.token_to_id(eos_token) is not None:
            eos.append(backend.token_to_id(eos_token))
        vocab = config.get("vocab_size")
        return cls(backend, config_vocab_size=vocab if isinstance(vocab, int) else 0, eos_token_ids=eos)

    def _segmentation_is_exact(self, added: dict) -> bool:
        normalizes = self._backend.normalizer is not None
        if any(
            t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizes) for t in added.values()
        ):
            return False
        contents = list(self._added_by_content)
        first, second = contents[0], contents[-1]
        for probe in _SEGMENT_PROBES:
            text = probe.format(first, second)
            if self._encode_pieces(text) != self._encode_whole(text):
                return False
        return True

    # ---- encoding ----
    def _encode_whole(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _split(self, text: str) -> list[str]:
        """Text pieces and added-token contents, in order; no empty pieces."""
        assert self._splitter is not None
        pieces, start = [], 0
        for match in self._splitter.finditer(text):
            if match.start() > start:
                pieces.append(text[start : match.start()])
            pieces.append(match.group())
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def _encode_pieces(self, text: str, cache: SegmentCache | None = None) -> list[int]:
        pieces = self._split(text)
        found: list[array | tuple[int] | None] = []
        missing: list[str] = []
        for piece in pieces:
            added_id = self._added_by_content.get(piece)
            if added_id is not None:
                found.append((added_id,))
                continue
            ids = cache.get(piece) if cache is not None else None
            found.append(ids)
            if ids is None:
                missing.append(piece)
        if missing:
            unique = list(dict.fromkeys(missing))
            if len(unique) == 1:
                batch = [self._backend.encode(unique[0], add_special_tokens=False)]
            else:
                batch = self._backend.encode_batch_fast(unique, add_special_tokens=False)
            encoded = dict(zip(unique, batch, strict=True))
        out: list[int] = []
        for piece, ids in zip(pieces, found, strict=True):
            if ids is None:
                ids = array("i", encoded[piece].ids)
                if cache is not None:
                    cache.put(piece, ids)
            out.extend(ids)
        return out

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text` (no BOS/EOS added), identical to the whole-string encoding."""
        if not isinstance(text, str):
            raise TypeError("text must be a string")
        if not self.segmented:
            return self._encode_whole(text)
        return self._encode_pieces(text, self.cache)

    # ---- decoding and vocabulary ----
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use)."""
        return self._backend

    @property
    def byte_level(self) -> bool:
        """Whether decoding is the concatenation of per-token bytes (a ByteLevel decoder)."""
        return isinstance(self._backend.decoder, decoders.ByteLevel)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `decode` produces for this token in a ByteLevel tokenizer (b"" if unknown)."""
        table = self._byte_table
        if table is None:
            table = self._byte_table = self._build_byte_table()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def _build_byte_table(self) -> list[bytes]:
        # The byte-level alphabet maps each byte to a printable character; a token with a
        # character outside it (an added token's text) decodes to its UTF-8 bytes, as in
        # tokenizers' ByteLevel decoder.
        char_to_byte = {c: b for b, c in byte_level_alphabet().items()}
        size = self._backend.get_vocab_size(with_added_tokens=True)
        size = max([size, *(i + 1 for i in self.added_token_ids)])
        table = []
        for token_id in range(size):
            token = self._backend.id_to_token(token_id)
            if token is None:
                table.append(b"")
                continue
            try:
                table.append(bytes(char_to_byte[c] for c in token))
            except KeyError:
                table.append(token.encode("utf-8"))
        return table


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel pre-tokenizers."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping
