"""Attention backends over the paged KV pool: torch_native + C decode / extend kernels (CPU), FlashInfer and Triton (GPU)."""
