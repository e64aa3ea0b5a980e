"""Drafts side by side on the same prompts: τ with paired bootstrap intervals, and a verdict a pipeline can gate on.

    tiny-speculators compare --drafts runs/old/export runs/new/export --verifier smollm2-135m --out runs/compare
"""
