"""The torch engine's objective against the Rust learner's: every case of
``data/objective_vectors.json`` (written by
``learner/tests/objective_vectors.rs``: every clip mode x proximal mode x
aggregation, the TIS and IcePop corrections, the k1 and k3 KL losses, and
dual clip under each clip mode)
gives the same loss, statistics, gradient and micro-batch
losses within 1e-6; hand-computed cases check dual-clip PPO on its own."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from asyncrl_trainer.objective import (
    Aggregation,
    ClipMode,
    ImportanceCorrection,
    KlEstimator,
    ObjectiveConfig,
    ObjectiveError,
    ObjectivePlan,
    ObjectiveStats,
    ObjectiveSums,
    decoupled_ppo_loss,
)

TOL = 1e-6
VECTORS = Path(__file__).parent / "data" / "objective_vectors.json"


def _cases() -> list[dict[str, Any]]:
    return list(json.loads(VECTORS.read_text(encoding="utf-8"))["cases"])


def _config(raw: dict[str, Any]) -> ObjectiveConfig:
    return ObjectiveConfig(
        eps_low=raw["eps_low"],
        eps_high=raw["eps_high"],
        clip_mode=ClipMode(raw["clip_mode"]),
        importance_weight_cap=raw["importance_weight_cap"],
        importance_correction=ImportanceCorrection(raw["importance_correction"]),
        importance_weight_floor=raw["importance_weight_floor"],
        adaptive_quantile=raw["adaptive_quantile"],
        adaptive_temperature=raw["adaptive_temperature"],
        m2po_threshold=raw["m2po_threshold"],
        aggregation=Aggregation(raw["aggregation"]),
        kl_coef=raw["kl_coef"],
        kl_estimator=KlEstimator(raw["kl_estimator"]),
        dual_clip=raw["dual_clip"],
    )


def _tensors(case: dict[str, Any]) -> dict[str, Any]:
    x = case["inputs"]
    f64 = torch.float64
    return {
        "behaviour": torch.tensor(x["behaviour"], dtype=f64),
        "proximal": None if x["proximal"] is None else torch.tensor(x["proximal"], dtype=f64),
        "advantages": torch.tensor(x["advantages"], dtype=f64),
        "versions": torch.tensor(x["versions"], dtype=torch.int64),
        "mask": torch.tensor(x["mask"], dtype=torch.bool),
        "reference": None if x["reference"] is None else torch.tensor(x["reference"], dtype=f64),
    }


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{what}: {got} vs {want}"


def test_the_vectors_cover_every_mode() -> None:
    cases = _cases()
    names = {c["name"] for c in cases}
    assert len(names) == 4 * 3 * 2 + 2 * 3 * 2 * 2 + 2 * 3 + 4
    for clip in ("ppo", "adaptive", "m2po", "gspo"):
        for proximal in ("recompute", "approx", "behaviour"):
            for aggregation in ("token", "sequence"):
                assert f"{clip}-{proximal}-{aggregation}" in names
    for correction in ("truncate", "icepop"):
        for clip in ("ppo", "m2po", "gspo"):
            for proximal in ("recompute", "approx"):
                for aggregation in ("token", "sequence"):
                    assert f"{clip}-{correction}-{proximal}-{aggregation}" in names
    for estimator in ("k1", "k3"):
        for base in ("ppo-recompute-token", "gspo-approx-sequence", "m2po-approx-token"):
            assert f"{base}-kl-{estimator}" in names
    for base in (
        "ppo-recompute-token",
        "adaptive-approx-token",
        "m2po-behaviour-sequence",
        "gspo-truncate-approx-sequence",
    ):
        assert f"{base}-dual-clip" in names
    # Dual clip acts in each of its cases and in no other.
    for c in cases:
        dual = float(c["stats"]["dual_clip_fraction"])
        if float(c["config"]["dual_clip"]) > 0.0:
            assert dual > 0.0, c["name"]
        else:
            assert dual == 0.0, c["name"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: str(c["name"]))
def test_loss_stats_and_gradient_match_the_rust_objective(case: dict[str, Any]) -> None:
    t = _tensors(case)
    current = torch.tensor(case["inputs"]["current"], dtype=torch.float64, requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        current=current,
        learner_version=case["learner_version"],
        cfg=_config(case["config"]),
        **t,
    )
    loss.backward()
    _close(float(loss.detach()), case["loss"], "loss")
    want_stats = case["stats"]
    for key in ObjectiveStats.__dataclass_fields__:
        _close(float(getattr(stats, key)), float(want_stats[key]), key)
    assert current.grad is not None
    want_grad = torch.tensor(case["grad_current"], dtype=torch.float64)
    diff = (current.grad - want_grad).abs().max().item()
    assert diff <= TOL, f"gradient differs by {diff}"


@pytest.mark.parametrize("case", _cases(), ids=lambda c: str(c["name"]))
def test_micro_batches_of_one_plan_match_the_rust_ones(case: dict[str, Any]) -> None:
    t = _tensors(case)
    current = torch.tensor(case["inputs"]["current"], dtype=torch.float64)
    plan = ObjectivePlan(
        current=current,
        learner_version=case["learner_version"],
        cfg=_config(case["config"]),
        **t,
    )
    total = 0.0
    for rows, want in zip(case["micro_batches"], case["micro_losses"]):
        idx = torch.tensor(rows, dtype=torch.int64)
        part = plan.loss(idx, current.index_select(0, idx))
        _close(float(part.loss), want, f"micro-batch {rows}")
        total += float(part.loss)
    _close(total, case["loss"], "sum of the micro-batches")


def test_a_plan_without_proximal_log_probs_is_refused_for_batch_statistics() -> None:
    case = next(c for c in _cases() if c["name"] == "adaptive-approx-token")
    t = _tensors(case)
    with pytest.raises(ObjectiveError, match="needs the proximal"):
        ObjectivePlan(
            current=None,
            learner_version=case["learner_version"],
            cfg=_config(case["config"]),
            **t,
        )


def test_a_shape_mismatch_names_the_input() -> None:
    case = _cases()[0]
    t = _tensors(case)
    t["mask"] = t["mask"][:, :3]
    with pytest.raises(ObjectiveError, match="`mask` has shape"):
        ObjectivePlan(
            current=None,
            learner_version=case["learner_version"],
            cfg=_config(case["config"]),
            **t,
        )


def test_a_kl_loss_without_reference_log_probs_is_refused() -> None:
    case = next(c for c in _cases() if c["name"] == "ppo-recompute-token-kl-k3")
    t = _tensors(case)
    t["reference"] = None
    with pytest.raises(ObjectiveError, match="reference"):
        ObjectivePlan(
            current=None,
            learner_version=case["learner_version"],
            cfg=_config(case["config"]),
            **t,
        )


def _dual_clip_case(
    ratios: list[list[float]],
    advantages: list[list[float]],
    cfg: ObjectiveConfig,
    weights: Optional[list[list[float]]] = None,
) -> tuple[torch.Tensor, torch.Tensor, ObjectiveStats]:
    """Hand-made rows, every token valid and of the learner's version:
    ``p = 0``, ``b = -log w`` (``w = 1`` unless given), ``c = log u``.
    Returns the loss, its gradient wrt ``c`` and the statistics."""
    f64 = torch.float64
    w = weights if weights is not None else [[1.0] * len(r) for r in ratios]
    current = torch.tensor([[math.log(u) for u in r] for r in ratios], dtype=f64)
    current.requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        behaviour=torch.tensor([[-math.log(x) for x in r] for r in w], dtype=f64),
        current=current,
        proximal=torch.zeros(current.shape, dtype=f64),
        advantages=torch.tensor(advantages, dtype=f64),
        versions=torch.zeros(current.shape, dtype=torch.int64),
        mask=torch.ones(current.shape, dtype=torch.bool),
        learner_version=0,
        cfg=cfg,
    )
    loss.backward()
    assert current.grad is not None
    return loss.detach(), current.grad, stats


PPO = ObjectiveConfig(eps_low=0.2, eps_high=0.2, clip_mode=ClipMode.PPO)


def test_dual_clip_bounds_a_negative_advantage_token_above_the_bound() -> None:
    # objective = max(min(4*-1, 1.2*-1), 3*-1) = -3: bounded, no gradient.
    loss, grad, stats = _dual_clip_case([[4.0]], [[-1.0]], replace(PPO, dual_clip=3.0))
    _close(float(loss), 3.0, "loss")
    _close(float(grad[0, 0]), 0.0, "gradient")
    _close(stats.dual_clip_fraction, 1.0, "dual_clip_fraction")
    _close(stats.clip_low_fraction, 0.0, "clip_low_fraction")


def test_dual_clip_leaves_a_ratio_below_the_bound_alone() -> None:
    # objective = max(min(2*-1, 1.2*-1), -3) = -2 = u*A: loss = u, whose
    # gradient wrt c = log u is u (descent lowers the bad token's log-prob).
    loss, grad, stats = _dual_clip_case([[2.0]], [[-1.0]], replace(PPO, dual_clip=3.0))
    _close(float(loss), 2.0, "loss")
    _close(float(grad[0, 0]), 2.0, "gradient")
    _close(stats.dual_clip_fraction, 0.0, "dual_clip_fraction")


def test_without_dual_clip_a_negative_advantage_grows_with_the_ratio() -> None:
    loss, grad, stats = _dual_clip_case([[4.0]], [[-1.0]], PPO)
    _close(float(loss), 4.0, "loss")
    _close(float(grad[0, 0]), 4.0, "gradient")
    _close(stats.dual_clip_fraction, 0.0, "dual_clip_fraction")


@pytest.mark.parametrize("eps_high,want", [(0.28, -1.28), (0.2, -1.2)])
def test_dual_clip_leaves_a_positive_advantage_alone(eps_high: float, want: float) -> None:
    for dual_clip in (0.0, 3.0):
        cfg = replace(PPO, eps_high=eps_high, dual_clip=dual_clip)
        loss, grad, stats = _dual_clip_case([[4.0]], [[1.0]], cfg)
        _close(float(loss), want, f"loss (dual_clip {dual_clip})")
        _close(float(grad[0, 0]), 0.0, f"gradient (dual_clip {dual_clip})")
        _close(stats.dual_clip_fraction, 0.0, "dual_clip_fraction")
        _close(stats.clip_high_fraction, 1.0, "clip_high_fraction")


def test_dual_clip_counts_only_kept_tokens_and_keeps_the_weight() -> None:
    # Token 0: w = 2, u = 4, A = -1: 2 * max(min(-4, -1.2), -3) = -6.
    # Token 1: w = 10 > cap 5 is masked: no term, not counted.
    # Token 2: w = 1, u = 1, A = -1: -1, below the bound.
    loss, grad, stats = _dual_clip_case(
        [[4.0, 4.0, 1.0]],
        [[-1.0, -1.0, -1.0]],
        replace(PPO, dual_clip=3.0),
        weights=[[2.0, 10.0, 1.0]],
    )
    _close(float(loss), (6.0 + 0.0 + 1.0) / 3.0, "loss")
    want = torch.tensor([[0.0, 0.0, 1.0 / 3.0]], dtype=torch.float64)
    assert (grad - want).abs().max().item() <= TOL, grad
    _close(stats.dual_clip_fraction, 1.0 / 3.0, "dual_clip_fraction")
    _close(stats.weight_masked_fraction, 1.0 / 3.0, "weight_masked_fraction")


def test_dual_clip_under_gspo_bounds_the_sequence_ratio() -> None:
    # The sequence's ratio exp(mean(log u)) = exp(mean(log 8, log 2)) = 4
    # is above 3 on both tokens, though token 1's own ratio (2) is not.
    cfg = replace(PPO, clip_mode=ClipMode.GSPO, dual_clip=3.0)
    loss, grad, stats = _dual_clip_case([[8.0, 2.0]], [[-1.0, -1.0]], cfg)
    _close(float(loss), 3.0, "loss")
    assert grad.abs().max().item() <= TOL, grad
    _close(stats.dual_clip_fraction, 1.0, "dual_clip_fraction")
    # A bound above the sequence's ratio: the sequence's -4 on each token,
    # and d/dc_t of -mean(s*A) = s/2 on each of the two tokens.
    loss, grad, stats = _dual_clip_case([[8.0, 2.0]], [[-1.0, -1.0]], replace(cfg, dual_clip=5.0))
    _close(float(loss), 4.0, "loss")
    assert (grad - 2.0).abs().max().item() <= TOL, grad
    _close(stats.dual_clip_fraction, 0.0, "dual_clip_fraction")


def test_dual_clip_counts_sum_over_micro_batches() -> None:
    f64 = torch.float64
    current = torch.log(torch.tensor([[4.0, 0.5], [3.5, 1.0]], dtype=f64))
    plan = ObjectivePlan(
        behaviour=torch.zeros(2, 2, dtype=f64),
        proximal=torch.zeros(2, 2, dtype=f64),
        current=current,
        advantages=torch.tensor([[-1.0, -1.0], [-2.0, 1.0]], dtype=f64),
        versions=torch.zeros(2, 2, dtype=torch.int64),
        mask=torch.ones(2, 2, dtype=torch.bool),
        learner_version=0,
        cfg=replace(PPO, dual_clip=3.0),
    )
    whole = plan.loss(None, current)
    sums = ObjectiveSums()
    total = 0.0
    for r in (0, 1):
        idx = torch.tensor([r])
        part = plan.loss(idx, current.index_select(0, idx))
        sums.add(part.sums)
        total += float(part.loss)
    assert sums.dual_clip == whole.sums.dual_clip == 2.0
    _close(plan.stats(sums).dual_clip_fraction, 0.5, "dual_clip_fraction")
    # -(-3 + max(min(-0.5, -0.8), -3) - 6 + 1) / 4 = (3 + 0.8 + 6 - 1) / 4
    _close(float(whole.loss), 8.8 / 4.0, "loss")
    _close(total, float(whole.loss), "sum of the micro-batches")
