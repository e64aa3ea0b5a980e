"""The ``train`` stage: the TTT loop for an EAGLE-3 draft (offline from shards or online with the verifier).

    tiny-speculators train --verifier smollm2-135m --hidden-states runs/hs --vocab runs/vocab --out runs/draft
"""
