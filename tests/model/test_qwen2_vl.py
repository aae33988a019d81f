"""Qwen2-VL model pieces against transformers: the tiny directory loads there unchanged,
the vision tower's embeddings and the M-RoPE positions are identical, and checkpoints in
either weight layout (the Hub's, transformers 5's nested config and renamed keys) load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitserve.frontend.image_processor import ImageProcessorConfig, process_image
from splitserve.model.qwen2_vl import ImagePlacement, load_qwen2_vl, load_qwen2_vl_config, mrope_positions
from splitserve.model.tiny_vl import VISION_TOKENS


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


@pytest.fixture(scope="module")
def hf_model(vl_model):
    from transformers import Qwen2VLForConditionalGeneration

    model, info = Qwen2VLForConditionalGeneration.from_pretrained(
        vl_model, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    return model


def test_cli_writes_what_transformers_loads(tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    out = tmp_path / "vl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "tiny-model",
            str(out),
            "--arch",
            "qwen2_vl",
            "--layers",
            "1",
            *("--vision-depth", "3", "--vision-dim", "48", "--vision-heads", "3"),
        ],
        check=True,
        capture_output=True,
    )
    model = Qwen2VLForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.num_hidden_layers == 1
    vision = model.config.vision_config
    assert (vision.depth, vision.embed_dim, vision.num_heads) == (3, 48, 3)
    tokenizer = AutoTokenizer.from_pretrained(out)
    for token in VISION_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    processor = AutoImageProcessor.from_pretrained(out)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)
    assert ImageProcessorConfig.from_model_dir(out).max_pixels == processor.size["longest_edge"]


def test_vision_tower_and_positions_equal_transformers(vl_model, hf_model):
    config = load_qwen2_vl_config(vl_model)
    ours = load_qwen2_vl(vl_model, config, torch.float32, torch.device("cpu"))
    processor = ImageProcessorConfig.from_model_dir(vl_model)
    rng = np.random.default_rng(0)
    images = [
        process_image(Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)), processor)
        for h, w in [(90, 130), (300, 64), (56, 56)]
    ]
    pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
    grids = [image.grid_thw for image in images]
    with torch.inference_mode():
        embeddings = ours.encode_images(pixels, grids)
        expected = torch.cat(hf_model.model.get_image_features(pixels, torch.tensor(grids)).pooler_output)
    assert embeddings.shape == (sum(image.num_visual_tokens for image in images), config.text.hidden_size)
    assert torch.equal(embeddings, expected)

    token_ids, placements = [7] * 5, []
    for image in images:
        placements.append(ImagePlacement(len(token_ids), image.grid_thw))
        token_ids += [config.image_token_id] * image.num_visual_tokens + [8] * 3
    positions, delta = mrope_positions(len(token_ids), placements, 2)
    ids = torch.tensor([token_ids])
    hf_positions, hf_delta = hf_model.model.get_rope_index(
        ids, (ids == config.image_token_id).int(), image_grid_thw=torch.tensor(grids)
    )
    assert torch.equal(positions, hf_positions[:, 0]) and delta == int(hf_delta)


def test_loads_transformers5_config_and_renamed_weights(vl_model, hf_model, tmp_path):
    """transformers 5 saves a nested text_config; other tools save `model.language_model.*`
    and `model.visual.*`: both load into the same weights."""
    from safetensors.torch import load_file, save_file

    hf_model.save_pretrained(tmp_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {
        name.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): tensor
        for name, tensor in tensors.items()
    }
    assert any(name.startswith("model.language_model.layers.") for name in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    original_config, config = load_qwen2_vl_config(vl_model), load_qwen2_vl_config(tmp_path)
    assert config.mrope_section == original_config.mrope_section
    assert config.text == original_config.text and config.vision == original_config.vision
    original = load_qwen2_vl(vl_model, original_config, torch.float32, torch.device("cpu"))
    reloaded = load_qwen2_vl(str(tmp_path), config, torch.float32, torch.device("cpu"))
    original_state, reloaded_state = original.state_dict(), reloaded.state_dict()
    assert original_state.keys() == reloaded_state.keys()
    assert all(torch.equal(original_state[name], reloaded_state[name]) for name in original_state)


def test_missing_vision_weight_is_refused(vl_model, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((Path(vl_model) / name).read_bytes())
    tensors = load_file(str(Path(vl_model) / "model.safetensors"))
    del tensors["visual.merger.ln_q.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks vision weights"):
        load_qwen2_vl(str(tmp_path), load_qwen2_vl_config(tmp_path), torch.float32, torch.device("cpu"))
