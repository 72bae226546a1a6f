"""Dropout in the learner: every logprob VALUE from the deterministic network, dropout only in the gradient.

The engines sample from the network without dropout (they run merged weights in inference), so that
network is the policy whose probabilities the behaviour logprobs record, and the one every ratio must
compare them with. A forward with dropout on is a random sub-network instead: with `learner.lora.dropout`
0.1 (rank 4) the on-policy ratio pi_theta / pi_behav of freshly sampled tokens spread over 0.968..1.084,
and two proximal forwards of one set of weights disagreed, so the clip, the IS weights, rejection and the
KL would act on dropout noise, not on staleness. Hence:

    proximal logprobs, reference logprobs      forward in eval mode (`deterministic`), as verl computes
                                               its old and reference logprobs (verl/workers/actor/dp_actor.py:
                                               `compute_log_prob` sets `actor_module.eval()`)
    the loss's logprobs (the gradient path)    values = the eval-mode forward (no grad): the ratio, clip, IS
                                               weight, rejection, KL, entropy and metrics see the sampled policy;
                                               gradient = the train-mode (dropout) forward, straight through:
                                                   logprobs = values + (noisy - noisy.detach())
                                               which equals `values` bit for bit (x - x = 0 exactly for finite x,
                                               and v + 0 = v) and has d logprobs = d noisy.

"Dropout only where it regularises" is that gradient: the PPO / GSPO / CISPO coefficient of each token
(advantage x clipped ratio) is that of the sampled policy, and its direction, grad log pi, comes from a
random sub-network, which is what dropout on the adapters' input regularises (peft's LoraLayer applies
`lora_dropout`, an nn.Dropout, to the adapter input only: peft/tuners/lora/layer.py `update_layer` and
`Linear.forward`, so it follows module.train() / eval()). verl's own training forward runs in train mode
(`update_policy` sets `actor_module.train()`), so its on-policy ratio under dropout is not 1; here it is,
exactly, at the first micro-batch of an on-policy step (tests/test_lora.py).

Cost: one more forward per micro-batch (no grad, about a third of a training forward and backward), only
when some dropout is active; none otherwise (`has_dropout`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn


def has_dropout(model: nn.Module) -> bool:
    """Whether a train-mode forward of `model` is random: an nn.Dropout with p > 0 (peft's lora_dropout, GPT-style
    resid/embd dropout) or attention dropout from the config (Llama / Qwen attention passes
    `dropout=0.0 if not self.training else self.attention_dropout` to the attention kernel)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0


@contextlib.contextmanager
def deterministic(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout) inside, its previous mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def straight_through(values: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """`values` exactly (bit for bit), with the gradient of `noisy`."""
    return values.detach() + (noisy - noisy.detach())


def loss_logprobs(forward: Callable[[bool], tuple[torch.Tensor, torch.Tensor] | torch.Tensor], model: nn.Module,
                  stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) for the loss: `forward(with_entropy)` once when `model` has no dropout; with dropout,
    values and entropy from an eval-mode forward and the gradient from a train-mode one (module docstring).
    Collective under FSDP2 like any forward: every rank must pass the same `stochastic`."""
    if not stochastic:
        return forward(True)
    with torch.no_grad(), deterministic(model):
        values, entropy = forward(True)
    return straight_through(values, forward(False)), entropy
