"""Modules that run inside the vLLM environment (loaded by vLLM by module path), never imported by the project."""
