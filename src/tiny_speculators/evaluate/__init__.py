"""Real speculative decoding with a Hugging Face verifier and an EAGLE-3 draft: acceptance, speed-up, reports."""
