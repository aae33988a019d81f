import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import MARKUP_TOKENS, SPECIAL_TOKENS, TinyModelSpec


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_transformers_loads_tiny_model(tiny_model_factory, arch):
    directory = tiny_model_factory(arch=arch)
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert model.config.model_type == arch
    assert len(tokenizer) == 2048
    for token in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) is not None
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    # Special ChatML tokens are skipped on decode, the reasoning/tool markup is not.
    ids = tokenizer.encode("<|im_start|><think>x</think>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_same_seed_same_directory(tmp_path):
    a = write_tiny_model(tmp_path / "a", TinyModelSpec(seed=3))
    b = write_tiny_model(tmp_path / "b", TinyModelSpec(seed=3))
    c = write_tiny_model(tmp_path / "c", TinyModelSpec(seed=4))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_template_drops_earlier_reasoning(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning": "old thoughts"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning": "new thoughts"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "old thoughts" not in text and "<think>\nnew thoughts\n</think>\n\na2" in text
    text = tokenizer.apply_chat_template(
        messages[:3], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_cli_writes_bigger_bf16_model(tmp_path):
    out = tmp_path / "m"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "tiny-model",
            str(out),
            "--arch",
            "llama",
            "--layers",
            "3",
            "--hidden",
            "96",
            "--heads",
            "6",
            "--kv-heads",
            "3",
            "--vocab",
            "1024",
            "--dtype",
            "bfloat16",
        ],
        check=True,
        capture_output=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["torch_dtype"] == "bfloat16"
    assert config["head_dim"] == 16


def test_cli_rejects_bad_shape(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "tiny-model", str(tmp_path / "m"), "--hidden", "65"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "must divide" in proc.stderr


def test_cli_writes_a_qwen3_moe_and_rejects_too_many_experts_per_token(tmp_path):
    tiny = [sys.executable, "-m", "splitserve.cli", "tiny-model"]
    flags = ["--arch", "qwen3_moe", "--layers", "4", "--experts", "8", "--experts-per-token", "2"]
    subprocess.run([*tiny, str(tmp_path / "m"), *flags], check=True, capture_output=True)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_hidden_layers"] == 4
    assert (config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (8, 2, True)
    bad = subprocess.run(
        [*tiny, str(tmp_path / "bad"), *flags, "--experts-per-token", "9"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "experts-per-token must be between 1" in bad.stderr
