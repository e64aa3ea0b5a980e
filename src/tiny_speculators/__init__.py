"""tiny-speculators: train draft models (EAGLE-3, P-EAGLE, ...) against a frozen verifier and ship them to vLLM."""

__version__ = "0.2.0"
