"""The ``train`` stage: the training loop for any draft family (offline from shards or online with the verifier).

    tiny-speculators train --verifier smollm2-135m --hidden-states runs/hs --vocab runs/vocab --out runs/draft
"""
