"""Per-row token sampling for a decode batch: temperature, top-k, top-p, greedy.

Log-prob convention (the one every engine of the project reports): the log-probability of the chosen
token under ``log_softmax(logits / temperature)`` over the FULL vocabulary, i.e. before top-k/top-p
truncation. Greedy rows (temperature <= 0) use temperature 1. This matches what the trainer recomputes
from the policy at the same temperature, so importance ratios compare like with like; truncation only
changes which tokens can be drawn, not the base the log-prob is measured in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # below this a row is decoded greedily


@dataclass
class SamplingParams:
    """Sampling settings of one batch row."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


def _truncate_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus (rows renormalised by the caller)."""
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    # A token is kept while the mass BEFORE it is below top_p, so the top token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_before < top_p.unsqueeze(-1)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(-1)
    keep &= ranks < k
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter(-1, sorted_idx, sorted_probs)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (token ids [B], log-probs [B]).

    See the module docstring for which distribution the log-probs refer to.
    """
    # At least float32 (bf16/fp16 logits lose the log-prob tails); a float64 model keeps float64.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    greedy = temps < GREEDY_TEMPERATURE
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = scaled.argmax(dim=-1)
    if not bool(greedy.all()):
        probs = logprobs.exp()
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=logits.device)
        if bool((top_p < 1.0).any() or (top_k > 0).any()):
            probs = _truncate_top_k_top_p(probs, top_k, top_p)
        drawn = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
