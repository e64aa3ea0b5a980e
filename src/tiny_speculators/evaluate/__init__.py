"""Real speculative decoding with a Hugging Face verifier and a draft of any family: acceptance, speed-up, reports."""
