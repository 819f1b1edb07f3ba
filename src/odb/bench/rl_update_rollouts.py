"""The rl_update section's rollouts: one rank's generation batch as TRL's ``_generate_and_score_completions`` hands
it to the loss, the same on every call (seeded), with what vLLM's rollouts add when TRL's importance-sampling
correction is on (``with_sampling``), and a digest per row to check that every arm trains the same rows.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List

import numpy as np
import torch

from odb.bench.rl_update_plan import draw_rollouts

__all__ = ["EOS", "PAD", "rollout_batch", "row_signatures", "step_batches", "with_sampling"]

PAD, EOS = 0, 1


def rollout_batch(prompt: np.ndarray, completion: np.ndarray, generations: int, vocab: int, total_loss_tokens: int,
                  seed: int) -> Dict[str, torch.Tensor]:
    """The generation batch of one rank as TRL's ``_generate_and_score_completions`` returns it: rows of
    ``prompt``/``completion`` tokens (random ids), padded to the longest of each.

    Example:
        >>> b = rollout_batch(np.array([2, 2, 3, 3]), np.array([1, 4, 2, 3]), 2, 16, 20, seed=0)
        >>> b["prompt_mask"].tolist()[0], b["completion_mask"].tolist()[0], b["num_items_in_batch"].item()
        ([0, 1, 1], [1, 0, 0, 0], 20)
    """
    gen = torch.Generator().manual_seed(seed)
    n, width_p, width_c = len(prompt), int(prompt.max()), int(completion.max())
    cols_p, cols_c = torch.arange(width_p), torch.arange(width_c)
    prompt_mask = (cols_p[None, :] >= width_p - torch.as_tensor(prompt)[:, None]).long()
    completion_mask = (cols_c[None, :] < torch.as_tensor(completion)[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (n, width_p), generator=gen) * prompt_mask  # PAD (0) where masked
    completion_ids = torch.randint(3, vocab, (n, width_c), generator=gen) * completion_mask
    last = torch.as_tensor(completion) - 1  # a completion ends with its end-of-sequence token
    completion_ids[torch.arange(n), last] = EOS
    rewards = torch.randn(n // generations, generations, generator=gen)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": torch.tensor(int(total_loss_tokens))}


def row_signatures(inputs: Dict[str, torch.Tensor]) -> List[str]:
    """One digest per row of its real prompt and completion tokens and its advantage (padding left out)."""
    out = []
    for i in range(inputs["prompt_ids"].shape[0]):
        p = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
        c = inputs["completion_ids"][i][inputs["completion_mask"][i].bool()].tolist()
        a = round(float(inputs["advantages"][i]), 6)
        out.append(hashlib.sha1(repr((p, c, a)).encode()).hexdigest()[:16])
    return out


def with_sampling(batch: Dict[str, torch.Tensor], model: torch.nn.Module, vllm: Dict[str, Any], seed: int
                  ) -> Dict[str, torch.Tensor]:
    """``batch`` with what TRL's ``_generate_and_score_completions`` adds to vLLM's rollouts with
    ``vllm_importance_sampling_correction`` on: ``old_per_token_logps`` (the policy's log-probabilities of the
    completion tokens, as TRL computes them before the update), ``sampling_per_token_logps`` (the sampler's: here
    the policy's plus a normal offset of ``vllm["noise"]`` per token, a sampler that differs from the trainer) and
    ``importance_sampling_ratio``, TRL's formula for ``vllm["mode"]`` with its clip bounds (per token, or one per
    row in the sequence modes).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                                  num_attention_heads=2, num_key_value_heads=2))
        >>> b = rollout_batch(np.array([2, 2]), np.array([1, 3]), 2, 16, 4, seed=0)
        >>> v = with_sampling(b, m, dict(mode="sequence_mask", clip_min=None, clip_max=3.0, noise=0.1), seed=0)
        >>> v["old_per_token_logps"].shape, v["importance_sampling_ratio"].shape, bool(v["old_per_token_logps"][0, 1])
        (torch.Size([2, 3]), torch.Size([2, 1]), False)
    """
    width_p = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
                       ).logits[:, width_p - 1:-1].float()
    old = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    old = torch.where(mask, old, torch.zeros_like(old))
    gen = torch.Generator().manual_seed(seed)
    sampling = torch.where(mask, old + vllm["noise"] * torch.randn(old.shape, generator=gen), torch.zeros_like(old))
    diff = (old - sampling) * mask  # TRL's, then per sequence in the sequence modes
    if vllm["mode"].startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = vllm["clip_min"], vllm["clip_max"]
    if vllm["mode"].endswith("truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        out = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
        ratio = ratio.masked_fill(out, 0.0)
    return dict(batch, old_per_token_logps=old, sampling_per_token_logps=sampling, importance_sampling_ratio=ratio)


def step_batches(p: Dict[str, Any], rank: int, world: int) -> List[Dict[str, torch.Tensor]]:
    """This rank's generation batch of every timed step (the same on every call: seeded)."""
    out = []
    for k in range(p["steps"]):
        prompt, completion = draw_rollouts(world, p["rows"], p["generations"], p["prompt"], p["completion"],
                                           seed=p["seed"] + k)
        out.append(rollout_batch(prompt[rank], completion[rank], p["generations"], p["model"]["vocab_size"],
                                 int(completion.sum()), seed=p["seed"] + 1000 * k + rank))
    return out
