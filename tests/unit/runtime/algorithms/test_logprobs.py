"""Chunked log-probs and entropy against the naive full-vocabulary computation."""

from __future__ import annotations

import pytest
import torch

from rljob.runtime.algorithms.logprobs import chunked_logprobs, logprobs_from_logits

N, H, V = 11, 16, 97


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, bias, targets


def _naive(hidden, weight, bias, targets, temperature):  # type: ignore[no-untyped-def]
    logp_all = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)




@pytest.mark.parametrize("chunk", [1, 3, N, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_values_and_gradients(chunk: int, temperature: float) -> None:
    hidden, weight, bias, targets = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    # The chunked path does its softmax maths in float32: tolerances are float32 ones for values ~10.
    logp, entropy = chunked_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], temperature=temperature,
                                     chunk_tokens=chunk)
    naive_logp, naive_entropy = _naive(*ref, targets, temperature)
    torch.testing.assert_close(logp.double(), naive_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), naive_entropy.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)
    ((logp.double() * weights).sum() + entropy.double().sum()).backward()
    ((naive_logp * weights).sum() + naive_entropy.sum()).backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_logits_path_equals_naive_and_temperature_is_applied() -> None:
    hidden, weight, bias, targets = _inputs(seed=1)
    logits = hidden @ weight.T + bias
    for temperature in (1.0, 0.5):
        logp, entropy = logprobs_from_logits(logits, targets, temperature=temperature, chunk_tokens=4)
        naive_logp, naive_entropy = _naive(hidden, weight, bias, targets, temperature)
        torch.testing.assert_close(logp.double(), naive_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), naive_entropy, rtol=1e-5, atol=1e-5)
    hot = logprobs_from_logits(logits, targets, temperature=2.0)[1]
    cold = logprobs_from_logits(logits, targets, temperature=0.5)[1]
    assert bool((hot > cold).all())  # a higher temperature flattens every distribution


def test_empty_and_bad_inputs() -> None:
    hidden, weight, _, targets = _inputs()
    logp, entropy = chunked_logprobs(hidden[:0], weight, targets[:0])
    assert logp.shape == (0,) and entropy.shape == (0,)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(hidden, weight, targets[:-1])
