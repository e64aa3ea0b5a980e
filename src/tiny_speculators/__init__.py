"""tiny-speculators: train EAGLE-3 draft models against a frozen verifier and ship them to vLLM."""

__version__ = "0.1.0"
