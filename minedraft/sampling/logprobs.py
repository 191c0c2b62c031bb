"""logprobs: each output token's log-probability under the target's raw distribution at its position (the
log-softmax of the target's logits, before penalties, logit bias, a grammar mask, temperature, top-k and top-p, as
vLLM's default), and the most likely tokens there. Computed by the verifier only for requests that ask."""

from __future__ import annotations

import torch


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[list]:
    """rows [N, V] raw logits, position i scoring tokens[i] -> per token [logprob, [[id, logprob], ...top]] (top
    entries most likely first)."""
    if not tokens:
        return []
    lp = torch.log_softmax(rows.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        vals, ids = lp.topk(min(top, lp.shape[-1]), -1)
        tops = [[[i, v] for i, v in zip(ri, rv)] for ri, rv in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [[c, t] for c, t in zip(chosen, tops)]
