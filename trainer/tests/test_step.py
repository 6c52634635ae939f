"""The torch engine's step: FSDP2 at world size 2 (gloo, two processes
under torchrun) gives the weights of world size 1 after 5 steps, and the
same statistics; micro-batches change nothing; a batch the ranks cannot
share is refused before anything is applied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl_trainer.objective import ClipMode, ObjectiveConfig
from asyncrl_trainer.step import (
    StepError,
    Trainer,
    TrainerOptions,
    completion_logprobs,
    microbatches,
)

HERE = Path(__file__).parent


def _run(out: Path, world: int, *extra: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(HERE / "fsdp_run.py"),
        str(out),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    weights = torch.load(out / "weights.pt", weights_only=True)
    steps = json.loads((out / "steps.json").read_text(encoding="utf-8"))
    return weights, steps


@pytest.mark.parametrize(
    "proximal,clip,aggregation,kl,packing",
    [
        ("recompute", "adaptive", "token", None, False),
        ("approx", "m2po", "sequence", None, False),
        ("approx", "gspo", "token", "k3", False),
        # Each rank packs its own rows (its lanes differ from the other's).
        ("recompute", "adaptive", "sequence", "k1", True),
    ],
)
def test_world_size_two_gives_the_weights_of_world_size_one(
    tmp_path: Path, proximal: str, clip: str, aggregation: str, kl: str | None, packing: bool
) -> None:
    args = ["--steps", "5", "--proximal", proximal, "--clip", clip, "--aggregation", aggregation]
    if kl is not None:
        args += ["--kl", kl]
    if packing:
        args += ["--packing", "--lane-tokens", "16"]
    one, steps_one = _run(tmp_path / "w1", 1, *args)
    two, steps_two = _run(tmp_path / "w2", 2, *args)
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= 1e-5, f"weights differ by {worst}"
    # The weights moved: the comparison is not of two untouched models.
    fresh, _ = _run(tmp_path / "w0", 1, "--steps", "0")
    moved = max((one[k] - fresh[k]).abs().max().item() for k in one)
    assert moved > 1e-4, f"the weights moved only {moved}"
    for a, b in zip(steps_one, steps_two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert a["tokens"] == b["tokens"]
        # The gradient itself, not only Adam's scale-free step, is the same.
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (a, b)
        assert abs(a["entropy"] - b["entropy"]) <= 1e-5, (a, b)
        for part in ("objective", "logprob_gap"):
            for key, value in a[part].items():
                assert abs(value - b[part][key]) <= 1e-5, (part, key, a, b)
    # The KL to the starting weights: none before the first step, some after.
    kls = [s["objective"]["kl_ref"] for s in steps_one]
    if kl is None:
        assert all(k == 0.0 for k in kls), kls
    else:
        # (k1's estimate may be negative; k3's never is.)
        assert abs(kls[0]) < 1e-9 < abs(kls[-1]), kls


def test_a_checkpoint_resumes_the_run_exactly_and_reshards(tmp_path: Path) -> None:
    args = ["--proximal", "recompute", "--clip", "adaptive"]
    straight, _ = _run(tmp_path / "straight", 2, "--steps", "5", *args)
    ckpt = tmp_path / "ckpt"
    _run(tmp_path / "first", 2, "--steps", "5", "--save-at", "3", "--ckpt", str(ckpt), *args)
    assert (ckpt / "asyncrl_step.json").is_file()
    assert not (tmp_path / ".ckpt.tmp").exists(), "the temporary folder was renamed"
    # Resumed at the same world size: the same weights as the run that
    # never stopped (the model and AdamW's moments and step restored).
    resumed, steps = _run(tmp_path / "resumed", 2, "--steps", "5", "--resume", "--ckpt", str(ckpt), *args)
    assert len(steps) == 2, "steps 4 and 5 only"
    worst = max((straight[k] - resumed[k]).abs().max().item() for k in straight)
    assert worst <= 1e-6, f"resumed weights differ by {worst}"
    # Resharded: the world-size-2 checkpoint loads at world size 1.
    one, _ = _run(tmp_path / "one", 1, "--steps", "5", "--resume", "--ckpt", str(ckpt), *args)
    worst = max((straight[k] - one[k]).abs().max().item() for k in straight)
    assert worst <= 1e-5, f"resharded weights differ by {worst}"


def test_exported_weights_load_in_transformers_with_their_checksums(tmp_path: Path) -> None:
    import hashlib

    from transformers import AutoModelForCausalLM

    out = tmp_path / "weights"
    trained, _ = _run(tmp_path / "run", 2, "--steps", "2", "--export", str(out))
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, "sharded with an index above max_shard_size"
    sums = json.loads((out / "sha256.json").read_text(encoding="utf-8"))
    assert sorted(sums) == files
    for name in files:
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sums[name]
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    loaded = model.state_dict()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key


def test_micro_batches_stay_within_the_token_budget() -> None:
    assert microbatches(5, 10, 20) == [[0, 1], [2, 3], [4]]
    # A row longer than the budget runs alone.
    assert microbatches(2, 50, 20) == [[0], [1]]


def _local() -> tuple[Any, Any]:
    sys.path.insert(0, str(HERE))
    from fsdp_run import batch, tiny_qwen3

    return batch, tiny_qwen3


def test_the_gap_measures_behaviour_against_the_learner() -> None:
    batch, tiny_qwen3 = _local()
    model = tiny_qwen3()
    b = batch(0, 7)
    b.versions = torch.where(b.mask, torch.full_like(b.versions, 7), b.versions)
    with torch.no_grad():
        own = completion_logprobs(model(input_ids=b.input_ids).logits, b, 1.0)
    b.behaviour = torch.where(b.mask, own, torch.zeros_like(own))
    trainer = Trainer(model, TrainerOptions(), learning_rate=1e-3)
    exact = trainer.train_step(b, ObjectiveConfig(), 1e-3, 7).logprob_gap
    assert exact.tokens == int(b.mask.sum())
    assert exact.max_abs <= 1e-5 and exact.kl <= 1e-8, exact
    # An engine whose log-probs are 0.1 off: the gap says so (the second
    # step starts from other weights, so compare against them).
    with torch.no_grad():
        own = completion_logprobs(model(input_ids=b.input_ids).logits, b, 1.0)
    b.behaviour = torch.where(b.mask, own - 0.1, torch.zeros_like(own))
    off = trainer.train_step(b, ObjectiveConfig(), 1e-3, 7).logprob_gap
    assert abs(off.mean_abs - 0.1) <= 1e-5 and abs(off.max_abs - 0.1) <= 1e-5, off


def test_a_non_finite_loss_is_refused_and_nothing_is_applied() -> None:
    batch, tiny_qwen3 = _local()
    model = tiny_qwen3()
    trainer = Trainer(model, TrainerOptions(), learning_rate=1e-3)
    b = batch(0, 0)
    # A hostile behaviour log-prob: the off-policy weight overflows.
    b.behaviour[0, 0] = -1e4
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StepError, match="not finite"):
        trainer.train_step(b, ObjectiveConfig(clip_mode=ClipMode.PPO, importance_weight_cap=1e308), 1e-3, 0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_batch_the_ranks_cannot_share_is_refused() -> None:
    batch, tiny_qwen3 = _local()
    model = tiny_qwen3()
    trainer = Trainer(model, TrainerOptions(), learning_rate=1e-3)
    trainer.world = 3  # as if three ranks shared the 8 rows
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StepError, match="8 rows, which 3 ranks"):
        trainer.train_step(batch(0, 0), ObjectiveConfig(), 1e-3, 0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("budget,lane_tokens", [(1 << 62, 0), (24, 0), (1 << 62, 32)])
def test_packed_steps_match_padded_steps(budget: int, lane_tokens: int) -> None:
    """Packing changes what the forward passes compute, not what they
    give: three steps (each objective family) packed and padded end at the
    same weights with the same statistics."""
    from asyncrl_trainer.objective import Aggregation, KlEstimator
    from asyncrl_trainer.step import layout

    batch, tiny_qwen3 = _local()
    cfgs = [
        ObjectiveConfig(clip_mode=ClipMode.ADAPTIVE),
        ObjectiveConfig(clip_mode=ClipMode.GSPO, aggregation=Aggregation.SEQUENCE),
        ObjectiveConfig(clip_mode=ClipMode.M2PO, kl_coef=0.5, kl_estimator=KlEstimator.K3),
    ]
    runs = {}
    for packing in (False, True):
        model = tiny_qwen3()
        reference = tiny_qwen3().requires_grad_(False)
        opts = TrainerOptions(
            max_tokens_per_microbatch=budget, packing=packing, packing_lane_tokens=lane_tokens
        )
        trainer = Trainer(model, opts, learning_rate=1e-3, reference=reference)
        stats = [trainer.train_step(batch(i, i), cfg, 1e-3, i) for i, cfg in enumerate(cfgs)]
        runs[packing] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, stats)
    (padded, want), (packed, got) = runs[False], runs[True]
    worst = max((padded[k] - packed[k]).abs().max().item() for k in padded)
    assert worst <= 1e-5, f"weights differ by {worst}"
    fresh = tiny_qwen3().state_dict()
    assert max((padded[k] - fresh[k]).abs().max().item() for k in padded) > 1e-4
    for a, b in zip(want, got):
        assert abs(a.loss - b.loss) <= 1e-5 and a.tokens == b.tokens, (a, b)
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * max(1.0, a.grad_norm), (a, b)
        assert abs(a.entropy - b.entropy) <= 1e-5, (a, b)
        assert a.microbatches == b.microbatches
        for key, value in vars(a.objective).items():
            assert abs(value - getattr(b.objective, key)) <= 1e-5, (key, a, b)
    b0 = batch(0, 0)
    assert layout(b0, True, lane_tokens).positions < layout(b0, False).positions
