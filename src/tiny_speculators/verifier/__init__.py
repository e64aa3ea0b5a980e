"""The frozen verifier: loading (HF ids, local folders, the embedded default) and hidden-state capture."""
