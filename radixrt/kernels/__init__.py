"""Attention backends over the paged KV pool: torch_native + C decode kernel (CPU), FlashInfer and Triton (GPU)."""
