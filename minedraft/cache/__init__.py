"""The KV cache: block accounting (blocks.py, admission.py: the caller's side, no torch) and the paged tensors
(paged_kv.py: the workers' side)."""
