"""Per-request output controls on logits (penalties, logit bias) and structured output (grammar token masks),
applied at every drafted and verified position."""
