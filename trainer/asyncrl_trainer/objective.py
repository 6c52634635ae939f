"""The learner's objective in PyTorch: decoupled PPO with a recomputed,
A-3PO-approximated or behaviour proximal policy; PPO, staleness-adaptive,
M2PO and GSPO (sequence-level) clipping; masking (decoupled PPO), truncating
(TIS) or IcePop correction of the off-policy weight; a k1 or k3 KL loss
against a reference policy's log-probs; token or sequence aggregation;
micro-batches with mini-batch statistics; optionally dual-clip PPO.

It is the Rust learner's objective (``learner/src/objective.rs``, whose
module documentation gives the formulas) term for term, and
``tests/test_objective.py`` checks it against the vectors the Rust side
writes. Per token: behaviour log-prob ``b``, proximal ``p``, current ``c``
(with gradient), advantage ``A``, behaviour version ``v_b``::

    u = exp(c - p)          trust-region ratio
    w = exp(p - b)          off-policy weight (detached); w > cap masks the token
    loss = -agg[ w * min(u*A, clip(u, lo, hi)*A) ]

Dual clip (dual-clip PPO, Ye et al. 2020, arXiv:1912.09729; verl's
``clip_ratio_c``), when ``dual_clip = d > 0`` (then ``d >= 1``): a token with
``A < 0`` carries ``max(min(u*A, clip(u, lo, hi)*A), d*A)``, so a token whose
ratio has run above ``d`` adds a bounded, gradient-free term instead of one
that grows with ``u``. Under gspo ``u`` is the sequence's ratio.

A mini-batch is planned once (:class:`ObjectivePlan`: the normalisers,
adaptive's quantile, M2PO's mask, ``p`` where known) and its loss is the
sum of :meth:`ObjectivePlan.loss` over micro-batches that partition its
rows, gradients included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch


class ClipMode(str, Enum):
    PPO = "ppo"
    ADAPTIVE = "adaptive"
    M2PO = "m2po"
    GSPO = "gspo"


class ImportanceCorrection(str, Enum):
    """How the off-policy weight ``w = exp(p - b)`` is corrected: ``mask``
    (``w > cap`` masks), ``truncate`` (TIS: ``min(w, cap)``), ``icepop``
    (``w`` outside ``[floor, cap]`` masks)."""

    MASK = "mask"
    TRUNCATE = "truncate"
    ICEPOP = "icepop"


class KlEstimator(str, Enum):
    """The per-token KL estimate of the KL loss from the current log-prob
    ``c`` and the reference's ``r``: ``k1 = c - r``,
    ``k3 = exp(r - c) - (r - c) - 1``."""

    K1 = "k1"
    K3 = "k3"


class ProximalMode(str, Enum):
    """Where ``p`` comes from (the trainer, not the objective, acts on it)."""

    RECOMPUTE = "recompute"
    APPROX = "approx"
    BEHAVIOUR = "behaviour"


class Aggregation(str, Enum):
    TOKEN = "token"
    SEQUENCE = "sequence"


@dataclass(frozen=True)
class ObjectiveConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_mode: ClipMode = ClipMode.ADAPTIVE
    importance_weight_cap: float = 5.0
    importance_correction: ImportanceCorrection = ImportanceCorrection.MASK
    importance_weight_floor: float = 0.5
    adaptive_quantile: float = 0.9
    adaptive_temperature: float = 0.1
    m2po_threshold: float = 0.04
    aggregation: Aggregation = Aggregation.TOKEN
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = KlEstimator.K3
    # Dual-clip PPO's bound on the ratio of a token with A < 0 (0: off;
    # otherwise at least 1).
    dual_clip: float = 0.0


@dataclass
class ObjectiveSums:
    """Counts and sums of one :meth:`ObjectivePlan.loss` call, summed over
    micro-batches and divided by the mini-batch's valid tokens."""

    clip_low: float = 0.0
    clip_high: float = 0.0
    weight_masked: float = 0.0
    approx_kl: float = 0.0
    importance_weight: float = 0.0
    kl_ref: float = 0.0
    # Kept tokens with A < 0 whose ratio was above the dual-clip bound.
    dual_clip: float = 0.0

    def add(self, other: "ObjectiveSums") -> None:
        self.clip_low += other.clip_low
        self.clip_high += other.clip_high
        self.weight_masked += other.weight_masked
        self.approx_kl += other.approx_kl
        self.importance_weight += other.importance_weight
        self.kl_ref += other.kl_ref
        self.dual_clip += other.dual_clip


@dataclass
class ObjectiveStats:
    tokens: int = 0
    clip_low_fraction: float = 0.0
    clip_high_fraction: float = 0.0
    weight_masked_fraction: float = 0.0
    m2po_masked_fraction: float = 0.0
    dual_clip_fraction: float = 0.0
    approx_kl: float = 0.0
    mean_importance_weight: float = 0.0
    mean_version_lag: float = 0.0
    max_version_lag: float = 0.0
    kl_ref: float = 0.0


@dataclass
class PartialLoss:
    loss: torch.Tensor
    sums: ObjectiveSums = field(default_factory=ObjectiveSums)


class ObjectiveError(ValueError):
    """Inputs the objective cannot use (a shape, a missing proximal)."""


def approx_proximal(
    behaviour: torch.Tensor,
    current: torch.Tensor,
    versions: torch.Tensor,
    learner_version: int,
) -> torch.Tensor:
    """A-3PO's proximal log-probs (detached): ``p = b + alpha*(c - b)`` with
    ``alpha = clamp((v - v_b)/(v + 1 - v_b), 0, 1)``; a token of a version
    the learner has not reached counts as fresh (``alpha = 0``)."""
    vb = versions.to(torch.float64)
    v = float(learner_version)
    alpha = ((v - vb) / ((v + 1.0) - vb)).clamp(0.0, 1.0)
    alpha = torch.where(vb < v, alpha, torch.zeros_like(vb)).to(behaviour.dtype)
    return (behaviour + alpha * (current.detach() - behaviour)).detach()


def _m2po_keep(m2: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """Masks the valid tokens with the largest ``m2`` until the mean of the
    rest is at most ``threshold``; returns the keep mask."""
    flat_valid = valid.flatten().cpu().tolist()
    flat_m2 = m2.flatten().to(torch.float64).cpu().tolist()
    idx = [i for i, ok in enumerate(flat_valid) if ok]
    # Largest first; ties keep their order (a stable sort, as in Rust).
    idx.sort(key=lambda i: -flat_m2[i])
    rest_sum = 0.0
    for i in idx:
        rest_sum += flat_m2[i]
    rest_n = len(idx)
    keep = list(flat_valid)
    for i in idx:
        if rest_n == 0 or rest_sum / rest_n <= threshold:
            break
        keep[i] = False
        rest_sum -= flat_m2[i]
        rest_n -= 1
    return torch.tensor(keep, dtype=torch.bool, device=valid.device).view(valid.shape)


def _correction_masks(w: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """The weights the correction masks (``mask``: above the cap; ``icepop``:
    outside ``[floor, cap]``; ``truncate``: none)."""
    if cfg.importance_correction == ImportanceCorrection.MASK:
        return w > cfg.importance_weight_cap
    if cfg.importance_correction == ImportanceCorrection.ICEPOP:
        return (w > cfg.importance_weight_cap) | (w < cfg.importance_weight_floor)
    return torch.zeros_like(w, dtype=torch.bool)


def _check_shape(name: str, t: torch.Tensor, want: torch.Size) -> None:
    if t.shape != want:
        raise ObjectiveError(f"input `{name}` has shape {list(t.shape)}, expected {list(want)}")


def _fraction(count: float, total: float) -> float:
    return count / total if total > 0.0 else 0.0


class ObjectivePlan:
    """The mini-batch-level part of the objective, from detached inputs
    (all ``[N, T]`` on one device)."""

    @staticmethod
    def needs_proximal(cfg: ObjectiveConfig) -> bool:
        """Adaptive's quantile and M2PO's mask are statistics of ``p`` over
        the whole mini-batch: the plan needs ``p`` (or ``current``) up front;
        PPO's and GSPO's terms need only their own rows."""
        return cfg.clip_mode in (ClipMode.ADAPTIVE, ClipMode.M2PO)

    def __init__(
        self,
        *,
        behaviour: torch.Tensor,
        proximal: Optional[torch.Tensor],
        current: Optional[torch.Tensor],
        advantages: torch.Tensor,
        versions: torch.Tensor,
        mask: torch.Tensor,
        learner_version: int,
        cfg: ObjectiveConfig,
        reference: Optional[torch.Tensor] = None,
    ) -> None:
        shape = behaviour.shape
        _check_shape("advantages", advantages, shape)
        _check_shape("versions", versions, shape)
        _check_shape("mask", mask, shape)
        if proximal is not None:
            _check_shape("proximal", proximal, shape)
        if current is not None:
            _check_shape("current", current, shape)
        if reference is not None:
            _check_shape("reference", reference, shape)
        if cfg.kl_coef > 0.0 and reference is None:
            raise ObjectiveError("kl_coef > 0 needs the reference policy's log-probs")
        kind = (
            current.dtype
            if current is not None
            else proximal.dtype
            if proximal is not None
            else behaviour.dtype
        )
        self.cfg = cfg
        self.learner_version = learner_version
        with torch.no_grad():
            b = behaviour.to(kind).detach()
            valid = mask.to(torch.bool)
            valid_f = valid.to(kind)
            self.n_valid = float(valid_f.sum(dtype=torch.float64))
            self.n_seq = float(
                (valid_f.sum(dim=-1, dtype=kind) > 0.0).to(kind).sum(dtype=torch.float64)
            )
            if proximal is not None:
                p: Optional[torch.Tensor] = proximal.to(kind).detach()
            elif current is not None:
                p = approx_proximal(b, current, versions, learner_version)
            else:
                p = None
            self.keep: Optional[torch.Tensor] = None
            self.m2po_masked = 0.0
            self.quantile = 0.0
            if self.needs_proximal(cfg):
                if p is None:
                    raise ObjectiveError(
                        f"clip mode `{cfg.clip_mode.value}` needs the proximal (or current) "
                        "log-probs of the whole mini-batch to plan the objective"
                    )
                log_w = p - b
                if cfg.clip_mode == ClipMode.M2PO:
                    masked = _correction_masks(log_w.exp(), cfg) & valid
                    unmasked = valid & ~masked
                    kept = _m2po_keep(log_w.square(), unmasked, cfg.m2po_threshold)
                    self.m2po_masked = _fraction(
                        float((unmasked & ~kept).sum(dtype=torch.float64)), self.n_valid
                    )
                    self.keep = kept
                elif cfg.clip_mode == ClipMode.ADAPTIVE and self.n_valid > 0.0:
                    self.quantile = float(
                        torch.quantile(
                            log_w.abs()[valid].to(torch.float64),
                            cfg.adaptive_quantile,
                            interpolation="linear",
                        )
                    )
            lag = (float(learner_version) - versions.to(torch.float64)) * valid.to(torch.float64)
            self.lag_sum = float(lag.sum())
            self.max_version_lag = float(lag.max()) if self.n_valid > 0.0 else 0.0
        self.behaviour = behaviour.detach()
        self.advantages = advantages.detach()
        self.versions = versions.detach()
        self.valid = valid
        self.proximal = p
        self.reference = None if reference is None else reference.detach()

    @property
    def tokens(self) -> int:
        return int(self.n_valid)

    def loss(self, rows: Optional[torch.Tensor], current: torch.Tensor) -> PartialLoss:
        """The loss of rows ``rows`` (indices; ``None``: all, in order) from
        their current log-probs (with gradient), divided by the mini-batch's
        normaliser: the losses of micro-batches that partition the rows sum
        to the mini-batch's."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        cfg = self.cfg
        behaviour = pick(self.behaviour)
        _check_shape("current", current, behaviour.shape)
        kind = current.dtype
        b = behaviour.to(kind).detach()
        c = current
        a = pick(self.advantages).to(kind).detach()
        valid = pick(self.valid)
        valid_f = valid.to(kind)
        if self.proximal is not None:
            p = pick(self.proximal).to(kind).detach()
        else:
            p = approx_proximal(b, c, pick(self.versions), self.learner_version)

        def level(x: torch.Tensor) -> torch.Tensor:
            """Per token, or (GSPO) the sequence's mean over its valid
            tokens broadcast to every token."""
            if cfg.clip_mode != ClipMode.GSPO:
                return x
            n = valid_f.sum(dim=-1, keepdim=True).clamp_min(1.0)
            mean = torch.where(valid, x, torch.zeros_like(x)).sum(dim=-1, keepdim=True) / n
            return mean.expand_as(valid_f)

        log_w = level((p - b).detach()).detach()
        w = log_w.exp()
        masked = _correction_masks(w, cfg) & valid
        if cfg.importance_correction == ImportanceCorrection.TRUNCATE:
            corrected = (w > cfg.importance_weight_cap) & valid
            w_applied = w.clamp_max(cfg.importance_weight_cap)
        else:
            corrected = masked
            w_applied = w
        keep = pick(self.keep) if self.keep is not None else valid & ~masked
        keep_f = keep.to(kind)

        u = level(c - p).exp()
        ones = torch.ones_like(u)
        if cfg.clip_mode == ClipMode.ADAPTIVE:
            d = log_w.abs()
            kappa = ((d - self.quantile).relu() / -max(cfg.adaptive_temperature, 1e-12)).exp()
            hi = torch.where(a > 0.0, kappa * cfg.eps_high + 1.0, ones * (1.0 + cfg.eps_high))
            lo = torch.where(a < 0.0, -(kappa * cfg.eps_low) + 1.0, ones * (1.0 - cfg.eps_low))
            lo, hi = lo.detach(), hi.detach()
        else:
            lo, hi = ones * (1.0 - cfg.eps_low), ones * (1.0 + cfg.eps_high)
        clipped = torch.clamp(u, min=lo, max=hi)
        surrogate = torch.minimum(u * a, clipped * a)
        # Dual clip: the tokens with A < 0 above the bound (None when off:
        # nothing to count).
        dual_clipped: Optional[torch.Tensor] = None
        if cfg.dual_clip > 0.0:
            negative = a < 0.0
            dual_clipped = negative & (u > cfg.dual_clip)
            bounded = torch.maximum(surrogate, a * cfg.dual_clip)
            surrogate = torch.where(negative, bounded, surrogate)
        # The KL estimate against the reference, 0 on padding (where, not a
        # product: a padded position's values may be anything).
        kl: Optional[torch.Tensor] = None
        if self.reference is not None:
            d = pick(self.reference).to(kind).detach() - c
            k = -d if cfg.kl_estimator == KlEstimator.K1 else d.exp() - d - 1.0
            kl = torch.where(valid, k, torch.zeros_like(k))
        per_token = w_applied * surrogate * keep_f
        if kl is not None and cfg.kl_coef > 0.0:
            per_token = per_token - kl * cfg.kl_coef

        if cfg.aggregation == Aggregation.TOKEN:
            objective = per_token.sum() / max(self.n_valid, 1.0)
        else:
            per_seq_n = valid_f.sum(dim=-1)
            has = (per_seq_n > 0.0).to(kind)
            per_seq = per_token.sum(dim=-1) / per_seq_n.clamp_min(1.0)
            objective = (per_seq * has).sum() / max(self.n_seq, 1.0)
        loss = -objective

        with torch.no_grad():

            def count(t: torch.Tensor) -> float:
                return float(t.sum(dtype=torch.float64))

            sums = ObjectiveSums(
                clip_low=count(keep & (a < 0.0) & (u < lo)),
                clip_high=count(keep & (a > 0.0) & (u > hi)),
                weight_masked=count(corrected),
                dual_clip=0.0 if dual_clipped is None else count(keep & dual_clipped),
                approx_kl=count((c.detach() - p).square() * 0.5 * valid_f),
                importance_weight=count(w * valid_f),
                kl_ref=0.0 if kl is None else count(kl.detach()),
            )
        return PartialLoss(loss=loss, sums=sums)

    def stats(self, sums: ObjectiveSums) -> ObjectiveStats:
        """The mini-batch's statistics from the sums of all its rows' losses."""
        n = self.n_valid
        return ObjectiveStats(
            tokens=int(n),
            clip_low_fraction=_fraction(sums.clip_low, n),
            clip_high_fraction=_fraction(sums.clip_high, n),
            weight_masked_fraction=_fraction(sums.weight_masked, n),
            m2po_masked_fraction=self.m2po_masked,
            dual_clip_fraction=_fraction(sums.dual_clip, n),
            approx_kl=_fraction(sums.approx_kl, n),
            mean_importance_weight=_fraction(sums.importance_weight, n),
            mean_version_lag=_fraction(self.lag_sum, n),
            max_version_lag=self.max_version_lag,
            kl_ref=_fraction(sums.kl_ref, n),
        )


def decoupled_ppo_loss(
    *,
    behaviour: torch.Tensor,
    current: torch.Tensor,
    proximal: Optional[torch.Tensor],
    advantages: torch.Tensor,
    versions: torch.Tensor,
    mask: torch.Tensor,
    learner_version: int,
    cfg: ObjectiveConfig,
    reference: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, ObjectiveStats]:
    """The plan of all rows and its loss over all of them."""
    _check_shape("current", current, behaviour.shape)
    plan = ObjectivePlan(
        behaviour=behaviour,
        proximal=proximal,
        current=current,
        advantages=advantages,
        versions=versions,
        mask=mask,
        learner_version=learner_version,
        cfg=cfg,
        reference=reference,
    )
    part = plan.loss(None, current)
    return part.loss, plan.stats(part.sums)
