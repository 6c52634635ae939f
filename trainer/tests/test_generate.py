"""Held-out evaluation's completions (``asyncrl_trainer.generate``): the
batched, left-padded, KV-cached decode gives each prompt the completion a
plain full-sequence decode of that prompt alone gives, on every
architecture; stop tokens and the token budget end it; a seeded sample does
not depend on the rows beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl_trainer.generate import GenerateParams, generate
from asyncrl_trainer.tiny import ARCHITECTURES, write

VOCAB = 98
PAD = 0
CPU = torch.device("cpu")


def tiny(arch: str, tmp_path: Path) -> torch.nn.Module:
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text(
        json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD})
    )
    folder = write(arch, source, tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 1, 6, 12)]


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """The prompt alone, the whole sequence through the model at every step
    (no cache, no padding); with each step's gap between the two best
    logits (a near-tie may fall either way in other arithmetic)."""
    ids, gaps = list(prompt), []
    for _ in range(new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], gaps


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_batched_with_a_cache_is_each_prompt_decoded_alone(arch: str, tmp_path: Path) -> None:
    model = tiny(arch, tmp_path)
    ps = prompts()
    params = GenerateParams(max_new_tokens=10, temperature=0.0, stop_token_ids=frozenset())
    got = generate(model, ps, [0] * len(ps), params, CPU, PAD)
    assert [len(c) for c in got] == [10] * len(ps)
    compared = 0
    for p, completion in zip(ps, got):
        want, gaps = reference_greedy(model, p, 10)
        for t, (a, b) in enumerate(zip(completion, want)):
            if gaps[t] < 1e-4:
                break  # a near-tie: the rest of the row may diverge
            assert a == b, f"{arch}: prompt {p}, token {t}: {completion} != {want}"
            compared += 1
    assert compared >= 40, f"{arch}: only {compared} tokens compared"


def test_a_stop_token_ends_the_completion_and_the_budget_caps_it(tmp_path: Path) -> None:
    model = tiny("qwen3", tmp_path)
    ps = prompts()
    free = generate(model, ps, [0] * len(ps), GenerateParams(8, 0.0, frozenset()), CPU, PAD)
    # The third token of the first completion becomes a stop token.
    stop = free[0][2]
    stopped = generate(model, ps, [0] * len(ps), GenerateParams(8, 0.0, frozenset({stop})), CPU, PAD)
    for f, s in zip(free, stopped):
        cut = f.index(stop) + 1 if stop in f else len(f)
        assert s == f[:cut]
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    assert len(stopped[0]) <= 3
    short = generate(model, ps, [0] * len(ps), GenerateParams(3, 0.0, frozenset()), CPU, PAD)
    assert short == [f[:3] for f in free]


def test_a_seeded_sample_does_not_depend_on_the_rows_beside_it(tmp_path: Path) -> None:
    model = tiny("llama", tmp_path)
    ps = prompts()
    params = GenerateParams(max_new_tokens=12, temperature=1.0, stop_token_ids=frozenset())
    seeds = [11, 12, 13, 14, 15]
    together = generate(model, ps, seeds, params, CPU, PAD)
    alone = [generate(model, [p], [s], params, CPU, PAD)[0] for p, s in zip(ps, seeds)]
    assert together == alone
    again = generate(model, ps, seeds, params, CPU, PAD)
    assert again == together
    other = generate(model, ps, [s + 100 for s in seeds], params, CPU, PAD)
    assert other != together, "the seed does not reach the sampling"
