"""Runs SpecForge's own CLI (``specforge train`` / ``specforge export``) inside its venv with the CPU patches.

Started by ``benchmarks/peer_specforge.py`` (which sets ``SPECFORGE_DEVICE=cpu`` and ``TORCHDYNAMO_DISABLE=1``);
not importable from our package. Two code patches:

- ``specforge.core.loss`` imports triton for its fused log-softmax KL kernel (``LogSoftmaxLoss``), a GPU-only
  kernel: a stub ``triton`` module lets the file import, and ``LogSoftmaxLoss.apply`` is pointed at the reference
  implementation shipped in the same file (``_compute_loss``: ``-sum(mask * p * log_softmax(logits)).mean()``,
  the same value the kernel computes, with autograd for the backward).
- ``TargetHead.from_pretrained`` hard-codes bfloat16: the head is cast back to float32 to multiply the fp32
  hidden states of an fp32 run.

``dflash-parity DRAFT FEATURE VERIFIER_WEIGHTS OUT`` (ours) writes the logits of SpecForge's own DFlash training
forward on one stored sample at fixed anchors, for the harness's check that our importer computes the same function.

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


def dflash_parity(draft: str, feature_file: str, verifier_weights: str, out: str) -> None:
    """Logits of SpecForge's own DFlash training forward (``OnlineDFlashModel._forward_draft_blocks``, then the
    verifier's lm_head, as its loss computes them) for every slot of blocks anchored at every ``block_size``-th
    position of one stored sample: its anchor sampler replaced by that fixed choice, nothing else changed."""
    import json
    from pathlib import Path

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.auto import AutoDraftModel

    model = AutoDraftModel.from_pretrained(draft, torch_dtype=torch.float32).float().eval()
    model.config._attn_implementation = "sdpa"
    target = json.loads((Path(draft) / "config.json").read_text())["dflash_config"]
    sample = torch.load(feature_file, weights_only=True)
    ids, aux = sample["input_ids"].long(), sample["hidden_states"].float()  # (T,), (T, n_aux*H)
    with safe_open(verifier_weights, framework="pt") as f:
        weight = f.get_tensor("model.embed_tokens.weight").float()  # tied: the embeddings are the lm_head
    embed = torch.nn.Embedding.from_pretrained(weight)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data = weight
    wrapper = OnlineDFlashModel(draft_model=model, target_lm_head=head, target_embed_tokens=embed,
                                mask_token_id=int(target["mask_token_id"]), block_size=model.block_size,
                                attention_backend="sdpa")
    size = model.block_size
    anchors = torch.arange(1, len(ids) - size, size)  # (A,): whole blocks inside the sample
    wrapper._sample_anchor_positions = lambda seq_len, loss_mask, device: (
        anchors[None], torch.ones(1, len(anchors), dtype=torch.bool))
    with torch.no_grad():
        _, _, hidden = wrapper._forward_draft_blocks(ids[None], aux[None], torch.ones_like(ids)[None])
        logits = head(hidden)[0]  # (A*size, V)
    save_file({"logits": logits.float().contiguous(), "input_ids": ids.contiguous(), "aux": aux.contiguous(),
               "anchors": anchors.contiguous()}, out)


def main(argv: list[str]) -> int:
    patch_kl_loss()
    if argv[:1] == ["dflash-parity"]:  # dflash-parity DRAFT_HF_DIR FEATURE_FILE VERIFIER_WEIGHTS OUT
        dflash_parity(*argv[1:5])
        return 0
    patch_target_head_dtype()
    if "--fp32-export" in argv:
        argv = [a for a in argv if a != "--fp32-export"]
        patch_export_fp32()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
