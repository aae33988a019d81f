"""GGUF loading against transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`):
the same dequantized weights bit for bit, the same greedy tokens, the same token IDs."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from splitserve import gguf_file
from splitserve.engine.device import cpu_has_native_half_matmul
from splitserve.engine.llm import LLM
from splitserve.frontend.chat_template import ChatTemplate
from splitserve.frontend.gguf_tokenizer import load_gguf_render_files
from splitserve.model.decoder import DecoderModel, load_model
from splitserve.model.gguf_loader import load_gguf_config
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts
from tests.model.gguf_files import GGUF_SPEC, QUANT_TYPES, write_tiny_gguf

TEXTS = (
    "What is the capital of France?",
    "Hello world!  Two  spaces\n\nnew lines\ttabs, it's we'll they're",
    "Größe 東京 🙂 café naïve",
    "<|im_start|>user\nhi<think>hmm</think><|im_end|>\n<tool_call>{}</tool_call>",
    "def add(a, b):\n    return a + b  # 42\n",
    " leading space and 1234 and 3.14159 and x1y22",
)


@contextlib.contextmanager
def one_gguf_parse_per_load() -> Iterator[None]:
    """Memoizes, for one transformers load, two pure steps it repeats: parsing the file
    (`gguf.GGUFReader`: once for the config, again for the weights or the tokenizer; 4 s
    each for SmolLM2's 49k-token vocabulary) and gguf's tensor-name map of an architecture
    (`gguf.get_tensor_name_map`, built anew for every submodule: 400 times, 5 s, for
    SmolLM2). transformers only reads the reader (the file is mapped read-only and nothing
    writes it during the load) and the map, so the oracle computes what it computed
    unmemoized, in about half the time. Our loader does not go through `gguf.GGUFReader`
    (splitserve.gguf_file holds its own reference), so it is untouched."""
    import gguf

    unmemoized_reader = gguf.GGUFReader
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = unmemoized_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    with one_gguf_parse_per_load():
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    with one_gguf_parse_per_load():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def as_hf_state(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names, fused projections split back."""
    c = model.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    state = {}
    for name, value in model.state_dict().items():
        name = name if name.startswith("lm_head") else f"model.{name}"
        if ".qkv_proj." in name:
            for part, (start, size) in {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}.items():
                state[name.replace("qkv_proj", f"{part}_proj")] = value.narrow(0, start, size)
        elif ".gate_up_proj." in name:
            for part, start in (("gate", 0), ("up", inter)):
                state[name.replace("gate_up_proj", f"{part}_proj")] = value.narrow(0, start, inter)
        else:
            state[name] = value
    return state


def assert_same_weights(model: DecoderModel, reference) -> None:
    ours = as_hf_state(model)
    theirs = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    assert sorted(ours) == sorted(theirs)
    different = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    assert different == []


def transformers_greedy(reference, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(gguf_dir: Path) -> Callable[[str, str], tuple[Path, object]]:
    """(file, transformers' model of it) for an (arch, qtype), written and loaded once for
    the module: the weights test and the greedy test of a pair read the same file (the
    writer is seeded) and only read the reference model, so they share both."""

    @functools.cache
    def make(arch: str, qtype: str) -> tuple[Path, object]:
        path = write_tiny_gguf(gguf_dir / f"{arch}-{qtype}.gguf", GGUF_SPEC[arch], qtype)
        return path, transformers_model(path)

    return make


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("arch", sorted(GGUF_SPEC))
def test_dequantized_weights_equal_transformers(tiny_gguf, arch, qtype):
    path, reference = tiny_gguf(arch, qtype)
    model = load_model(str(path), load_gguf_config(path), torch.float32, torch.device("cpu"))
    assert_same_weights(model, reference)


@pytest.mark.parametrize("qtype", ["F32", "Q4_1", "Q6_K"])
@pytest.mark.parametrize("arch", sorted(GGUF_SPEC))
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_gguf, arch, qtype):
    path, reference = tiny_gguf(arch, qtype)
    prompts = make_prompts(GGUF_SPEC[arch].vocab, seed=3)[:4]
    llm = LLM(str(path), num_blocks=64, dtype="float32")
    results = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    )
    assert [r.token_ids for r in results] == transformers_greedy(reference, prompts, 12)
    with torch.inference_mode():
        for prompt, result in zip(prompts, results, strict=True):
            logits = reference(torch.tensor([prompt + result.token_ids])).logits[0].float()
            expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            for row, entry in zip(expected, result.logprobs, strict=True):
                values, ids = row.topk(3)
                assert [t for t, _ in entry["top_logprobs"]] == ids.tolist()
                assert torch.allclose(
                    torch.tensor([lp for _, lp in entry["top_logprobs"]]), values, atol=1e-4
                )


@pytest.mark.parametrize("arch", sorted(GGUF_SPEC))
def test_token_ids_equal_transformers(gguf_dir, arch):
    path = write_tiny_gguf(gguf_dir / f"tok-{arch}.gguf", GGUF_SPEC[arch], "Q8_0")
    ours = load_gguf_render_files(path)
    theirs = transformers_tokenizer(path)
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == theirs.encode(text, add_special_tokens=False), text
    ids = ours.tokenizer.encode(TEXTS[3])
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == TEXTS[3]
    # control tokens are special, the markup ones (<think>, <tool_call>) plain added tokens
    assert ours.tokenizer.token_to_id("<|im_end|>") in ours.tokenizer.special_token_ids
    assert ours.tokenizer.token_to_id("<think>") not in ours.tokenizer.special_token_ids
    assert ours.tokenizer.eos_token_ids == {ours.tokenizer.token_to_id("<|im_end|>")}
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


@pytest.fixture(scope="module")
def smollm2(demo_model: Path):
    """The real file, loaded once by transformers and once by our engine (float32)."""
    return demo_model, transformers_model(demo_model), LLM(str(demo_model), num_blocks=64, dtype="float32")


def test_smollm2_weights_equal_transformers(smollm2):
    _, reference, llm = smollm2
    assert llm.engine.dtype == torch.float32
    assert_same_weights(llm.engine.model, reference)


def test_smollm2_answers_paris_as_transformers_does(smollm2, demo_render_files):
    _, reference, llm = smollm2
    files = demo_render_files
    template = ChatTemplate(files.chat_template, special_tokens=files.special_tokens)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = files.tokenizer.encode(template.render(messages, add_generation_prompt=True))
    result = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[
            0, len(prompt) :
        ]
    assert result.token_ids == expected.tolist()
    assert "Paris" in files.tokenizer.decode(result.token_ids)
    assert result.finish_reason == "stop" and result.token_ids[-1] == 2  # <|im_end|>


def test_smollm2_token_ids_equal_transformers_and_split_digits(demo_model, demo_render_files):
    ours = demo_render_files.tokenizer
    theirs = transformers_tokenizer(demo_model)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    # tokenizer.ggml.pre is "smollm": every digit is a token of its own
    pieces = [ours.decode([i]) for i in ours.encode("year 2024: 31415")]
    digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert all(len(p) == 1 for p in digits) and "".join(digits) == "202431415"


def test_a_gguf_file_is_served_in_bf16_where_the_cpu_multiplies_bf16_natively(gguf_dir):
    path = write_tiny_gguf(gguf_dir / "dtype-llama-Q4_1.gguf", GGUF_SPEC["llama"], "Q4_1")
    native = cpu_has_native_half_matmul(torch.bfloat16)
    default = LLM(str(path), num_blocks=16, quantization="none")  # dequantized
    assert default.engine.dtype == (torch.bfloat16 if native else torch.float32)
    assert default.engine.model_info.dtype == ("bfloat16" if native else "float32")
    assert LLM(str(path), num_blocks=16, dtype="float32").engine.dtype == torch.float32
    assert LLM(str(path), num_blocks=16, dtype="bfloat16").engine.dtype == torch.bfloat16


def test_a_model_load_parses_its_gguf_file_once(gguf_dir, monkeypatch):
    """The config, the quantization plan and the weights come from one reader; outside a
    load (`shared_gguf_readers`), each `open_gguf` reads the file, a rewritten one afresh."""
    path = write_tiny_gguf(gguf_dir / "once-qwen3-Q4_1.gguf", GGUF_SPEC["qwen3"], "Q4_1")
    parsed: list[str] = []
    reader = gguf_file.GGUFReader
    monkeypatch.setattr(gguf_file, "GGUFReader", lambda p: parsed.append(str(p)) or reader(p))
    assert LLM(str(path), num_blocks=16).engine.model_info.dtype == "float32"  # Q4_1 kept
    assert parsed == [str(path)]
    assert gguf_file.open_gguf(path) is not gguf_file.open_gguf(path) and len(parsed) == 3
    with gguf_file.shared_gguf_readers():
        first = gguf_file.open_gguf(path)
        with gguf_file.shared_gguf_readers():  # nested: the same readers
            assert gguf_file.open_gguf(path) is first
        os.replace(write_tiny_gguf(gguf_dir / "other.gguf", GGUF_SPEC["llama"], "Q8_0"), path)
        assert gguf_file.open_gguf(path) is not first
    assert len(parsed) == 5
