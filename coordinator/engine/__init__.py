"""Torch: policy training, logprob recompute, LoRA, held-out evaluation and the distributed primitives. It knows
no store and no role: the roles hand it batches and take back numbers and files."""
