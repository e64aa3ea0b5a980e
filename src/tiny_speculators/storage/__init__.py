"""Hidden-state storage: checksummed safetensors shards, a merge-safe manifest, and a verifying reader.

See :mod:`tiny_speculators.storage.manifest` for the folder layout and :mod:`~tiny_speculators.storage.layout`
for what each storage layout keeps per token.
"""
