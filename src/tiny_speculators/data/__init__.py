"""Chat data: layouts and readers, rendering with the verifier's template, assistant loss masks, draft vocabulary.

Stages: :func:`tiny_speculators.data.prepare.prepare` and :func:`tiny_speculators.data.vocab.vocab`;
readers for later stages: :func:`tiny_speculators.data.prepared.load_prepared` and
:func:`tiny_speculators.data.vocab.load_vocab`.
"""
