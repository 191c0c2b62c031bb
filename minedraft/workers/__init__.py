"""The two worker processes (drafter, verifier), their shared process plumbing, and tensor-parallel ranks."""
