"""Token log-probs and entropy of chosen tokens without a [batch, length, vocab] float32 tensor.

The policy-gradient loss needs, per response token, log π(token) and (for the metric or an entropy
bonus) the entropy of π at that position, where π = softmax(logits / T) at the rollout temperature T.
With a 151,936-token vocabulary a float32 logits tensor over every position of a micro-batch is
gigabytes, and autograd keeps it (and its log-softmax) alive until the backward pass.

`chunked_logprobs` takes the final hidden states of the response positions only, flattened to
[N, H], and the output projection. It walks the tokens in chunks of `chunk_tokens`: one chunk's logits
are materialised, reduced to (log-prob, entropy) and freed. Under autograd each chunk runs inside
`torch.utils.checkpoint`, so the backward pass recomputes one chunk's logits at a time instead of
keeping all of them: peak memory is O(chunk_tokens x vocab), not O(N x vocab).

Pure functions on tensors; the trainer decides which positions are responses.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # Projection in the model's dtype (as the model's own forward does), softmax maths in float32
    # (float64 for a float64 model: the equivalence tests need every digit).
    logits = _at_least_fp32(torch.nn.functional.linear(hidden, weight, bias))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    # H = lse - Σ p·z: one pass, no [chunk, V] log-softmax tensor kept besides the logits.
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy) under softmax((hidden @ weight.T + bias) / temperature).

    hidden: [N, H] final hidden states of the positions that predict `targets` [N]; weight: [V, H].
    Returns two float32 tensors of shape [N]. Gradients flow to `hidden`, `weight` and `bias`.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, n, chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:
            logp, entropy = checkpoint(_chunk_stats, h, weight, bias, t, temperature, use_reentrant=False)
        else:
            logp, entropy = _chunk_stats(h, weight, bias, t, temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same statistics from already computed logits [N, V] (models without a separable head).

    Chunked too, so at least the float32 upcast and the softmax never cover more than a chunk.
    """
    n = logits.shape[0]
    if n == 0:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    logps, entropies = [], []
    for start in range(0, n, chunk_tokens):
        z = _at_least_fp32(logits[start : start + chunk_tokens])
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        logps.append(z.gather(-1, targets[start : start + chunk_tokens].unsqueeze(-1)).squeeze(-1) - lse)
        entropies.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(logps), torch.cat(entropies)
