"""Runs SpecForge's own CLI (``specforge train`` / ``specforge export``) inside its venv with the CPU patches.

Started by ``benchmarks/peer_specforge.py`` (which sets ``SPECFORGE_DEVICE=cpu`` and ``TORCHDYNAMO_DISABLE=1``);
not importable from our package. Two code patches:

- ``specforge.core.loss`` imports triton for its fused log-softmax KL kernel (``LogSoftmaxLoss``), a GPU-only
  kernel: a stub ``triton`` module lets the file import, and ``LogSoftmaxLoss.apply`` is pointed at the reference
  implementation shipped in the same file (``_compute_loss``: ``-sum(mask * p * log_softmax(logits)).mean()``,
  the same value the kernel computes, with autograd for the backward).
- ``TargetHead.from_pretrained`` hard-codes bfloat16: the head is cast back to float32 to multiply the fp32
  hidden states of an fp32 run.

``--fp32-export`` (ours, removed before SpecForge parses the arguments) makes ``specforge export`` keep the
trained fp32 weights instead of its hard-coded bfloat16 (a fairness check only; the default is its genuine output).

    SPECFORGE_DEVICE=cpu TORCHDYNAMO_DISABLE=1 ~/.cache/tiny-speculators/peers/specforge-venv/bin/python \
        benchmarks/peer_specforge_driver.py train --config run.yaml
"""

from __future__ import annotations

import sys
import types


def patch_kl_loss() -> None:
    """Import ``specforge.core.loss`` against a stub ``triton`` (removed again: torch must not see it), then point
    ``LogSoftmaxLoss.apply`` at the file's own reference ``_compute_loss``."""
    import torch._dynamo  # noqa: F401  (imported before the stub exists: it probes for a real triton)

    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int  # only used as an annotation when the kernels are defined
    triton.language = language
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        from specforge.core import loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    loss.LogSoftmaxLoss.apply = staticmethod(loss._compute_loss)


def patch_target_head_dtype() -> None:
    import torch
    from specforge.modeling.target.target_head import TargetHead

    original = TargetHead.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        return original(cls, *args, **kwargs).to(torch.float32)

    TargetHead.from_pretrained = classmethod(from_pretrained)


def patch_export_fp32() -> None:
    import torch
    from specforge.modeling.auto import AutoDraftModel

    original = AutoDraftModel.from_config.__func__

    def from_config(cls, config, torch_dtype=None, **kwargs):
        return original(cls, config, torch_dtype=torch.float32 if torch_dtype is not None else None, **kwargs)

    AutoDraftModel.from_config = classmethod(from_config)


def main(argv: list[str]) -> int:
    patch_kl_loss()
    patch_target_head_dtype()
    if "--fp32-export" in argv:
        argv = [a for a in argv if a != "--fp32-export"]
        patch_export_fp32()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
