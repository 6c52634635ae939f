"""The torch engine's objective against the Rust learner's: every case of
``data/objective_vectors.json`` (written by
``learner/tests/objective_vectors.rs``: every clip mode x proximal mode x
aggregation, the TIS and IcePop corrections, and the k1 and k3 KL losses)
gives the same loss, statistics, gradient and micro-batch
losses within 1e-6."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    names = {c["name"] for c in _cases()}
    assert len(names) == 4 * 3 * 2 + 2 * 3 * 2 * 2 + 2 * 3
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
