"""Completions with the engine's current weights, for held-out evaluation
(``asyncrl.v1.TrainerEngine/Generate``).

Rows are left-padded into batches of at most ``BATCH_ROWS`` and decoded with
the model's KV cache: greedy takes the most likely token (the lowest id on
a tie), sampling draws from the temperature-scaled softmax with one
generator per prompt, seeded by the request, so a prompt's completion does
not depend on the other rows of its batch or on the rank that decodes it.

The ranks share the prompts (rank ``r`` decodes prompts ``r, r + W, ...``)
and run the same number of forward passes, as FSDP's all-gathers need: a
rank out of rows decodes a placeholder row, and every step asks all ranks
whether any row is still running.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: Rows decoded together.
BATCH_ROWS = 64


@dataclass(frozen=True)
class GenerateParams:
    max_new_tokens: int
    #: 0: greedy.
    temperature: float
    stop_token_ids: frozenset[int]


def _any_running(running: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if running else 0], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _cache_kwarg(model: nn.Module) -> str:
    """Transformers 5.24 names the KV cache ``cache`` (``past_key_values``
    before, deprecated since)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = out.get("cache")
    return cache if cache is not None else out.past_key_values


def _choose(logits: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> list[int]:
    if temperature <= 0.0:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    return [int(torch.multinomial(probs[i], 1, generator=generators[i]).item()) for i in range(probs.shape[0])]


@torch.no_grad()
def decode_batch(
    model: nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    params: GenerateParams,
    device: torch.device,
    pad_id: int,
) -> list[list[int]]:
    """Completions of ``prompts`` (at least one row; a row of ``[]`` is a
    placeholder that decodes ``pad_id`` and is never reported running)."""
    placeholder = [not p for p in prompts]
    rows = [p if p else [pad_id] for p in prompts]
    n = len(rows)
    longest = max(len(r) for r in rows)
    ids = torch.full((n, longest), pad_id, dtype=torch.long)
    mask = torch.zeros((n, longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, longest - len(r) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(int(s) & ((1 << 63) - 1)) for s in seeds]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    past = _cache_of(out)
    cache_kwarg = _cache_kwarg(model)
    logits = out.logits[:, -1, :].float()
    completions: list[list[int]] = [[] for _ in range(n)]
    done = list(placeholder)
    for step in range(params.max_new_tokens):
        chosen = _choose(logits, params.temperature, generators)
        for i, token in enumerate(chosen):
            if not done[i]:
                completions[i].append(token)
                if token in params.stop_token_ids:
                    done[i] = True
        last = step + 1 == params.max_new_tokens
        if not _any_running(not all(done) and not last, device):
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        step_ids = torch.tensor(chosen, dtype=torch.long, device=device).unsqueeze(1)
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_kwarg: past},
        )
        past = _cache_of(out)
        logits = out.logits[:, -1, :].float()
    return [[] if placeholder[i] else completions[i] for i in range(n)]


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    params: GenerateParams,
    device: torch.device,
    pad_id: int,
) -> list[list[int]]:
    """Every prompt's completion, in order, on every rank (see the module
    docs); each rank decodes its share."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, len(prompts), world))
    # The same number of batches on every rank: the largest share's.
    batches = math.ceil(math.ceil(len(prompts) / world) / BATCH_ROWS) if prompts else 0
    was_training = model.training
    model.eval()
    decoded: dict[int, list[int]] = {}
    try:
        for b in range(batches):
            chunk = mine[b * BATCH_ROWS : (b + 1) * BATCH_ROWS]
            rows = [prompts[i] for i in chunk] or [[]]
            row_seeds = [seeds[i] for i in chunk] or [0]
            out = decode_batch(model, rows, row_seeds, params, device, pad_id)
            decoded.update(zip(chunk, out))
    finally:
        model.train(was_training)
    if world > 1:
        shares: list[dict[int, list[int]] | None] = [None] * world
        dist.all_gather_object(shares, decoded)
        for share in shares:
            decoded.update(share or {})
    return [decoded[i] for i in range(len(prompts))]
