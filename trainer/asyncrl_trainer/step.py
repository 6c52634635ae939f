"""One learner step in PyTorch, on one process or sharded with FSDP2.

The batch is the Rust learner's ``TrainBatch`` (``learner/src/batch.rs``):
right-padded prompt + completion ids, and per completion token its place
in the shifted log-prob matrix, behaviour log-prob, version, advantage and
validity. A step:

1. splits the rows evenly over the ranks (the world size must divide them);
2. gets the proximal log-probs the proximal mode asks for (the recompute
   pass, the behaviour ones, or A-3PO's from the current ones) and, where
   the plan needs them for the whole mini-batch, gathers them from every
   rank;
3. plans the objective over the whole mini-batch on every rank (the same
   plan everywhere), so that normalisers and batch statistics are global;
4. runs its rows as micro-batches under a token budget, each packed when
   packing is on (several rows to a lane, positions restarting per row, so
   that the model's mask keeps each row to itself), each loss scaled
   so that the ranks' gradients, averaged by FSDP2, are the gradient of the
   whole mini-batch's loss; clips the gradient norm and steps AdamW.

World size 2 gives the weights of world size 1 (``tests/test_step.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .objective import (
    ObjectiveConfig,
    ObjectivePlan,
    ObjectiveStats,
    ObjectiveSums,
    ProximalMode,
    approx_proximal,
)


@dataclass
class StepBatch:
    """A mini-batch, all tensors of every rank (``[N, L]`` and ``[N, T]``)."""

    input_ids: torch.Tensor
    gather_index: torch.Tensor
    behaviour: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    #: ``[N]`` each row's real tokens (prompt + completion); None: every
    #: row is ``L`` long.
    lengths: Optional[torch.Tensor] = None

    def rows(self, idx: torch.Tensor) -> "StepBatch":
        return StepBatch(
            input_ids=self.input_ids.index_select(0, idx),
            gather_index=self.gather_index.index_select(0, idx),
            behaviour=self.behaviour.index_select(0, idx),
            versions=self.versions.index_select(0, idx),
            advantages=self.advantages.index_select(0, idx),
            mask=self.mask.index_select(0, idx),
            lengths=None if self.lengths is None else self.lengths.index_select(0, idx.to(self.lengths.device)),
        )

    def to(self, device: torch.device) -> "StepBatch":
        return StepBatch(
            input_ids=self.input_ids.to(device),
            gather_index=self.gather_index.to(device),
            behaviour=self.behaviour.to(device),
            versions=self.versions.to(device),
            advantages=self.advantages.to(device),
            mask=self.mask.to(device),
            lengths=self.lengths,
        )

    def row_lengths(self) -> list[int]:
        """Each row's real tokens (at least one)."""
        if self.lengths is None:
            return [int(self.input_ids.shape[1])] * self.n_rows
        return [max(1, int(x)) for x in self.lengths.tolist()]

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class TrainerOptions:
    proximal: ProximalMode = ProximalMode.APPROX
    #: Sampling temperature: log-probs are ``log_softmax(logits / temperature)``.
    temperature: float = 1.0
    #: Rows x padded length a micro-batch may hold (at least one row).
    max_tokens_per_microbatch: int = 8192
    #: Pack each micro-batch's rows several to a lane (:func:`layout`).
    packing: bool = False
    #: The narrowest packed lane (capped at the micro-batch budget); 0:
    #: the longest row.
    packing_lane_tokens: int = 0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclass
class LogprobGap:
    """Behaviour log-probs against the learner's own for the tokens sampled
    with the weights the step starts from (the Rust ``LogprobGap``)."""

    tokens: int = 0
    mean_abs: float = 0.0
    max_abs: float = 0.0
    #: The k3 estimate of KL(behaviour || learner).
    kl: float = 0.0


@dataclass
class StepStats:
    loss: float = 0.0
    objective: ObjectiveStats = field(default_factory=ObjectiveStats)
    #: Mean entropy (at the temperature) of the valid tokens' distributions.
    entropy: float = 0.0
    logprob_gap: LogprobGap = field(default_factory=LogprobGap)
    grad_norm: float = 0.0
    microbatches: int = 0
    tokens: int = 0


class StepError(ValueError):
    """A batch this trainer cannot step on (named, nothing applied)."""


@dataclass
class Layout:
    """The rows of one forward pass as the model sees them: one row per
    lane (padded), or several (packed)."""

    #: ``[S, W]`` token ids of each lane.
    input_ids: torch.Tensor
    #: ``[S, W]`` packed only: each position's place in its own row (0 at
    #: every row's start), which is how a Hugging Face model (with no
    #: attention mask and no cache) finds the rows and keeps each to itself.
    position_ids: Optional[torch.Tensor]
    #: ``[N, T]`` each completion token's index in the flattened shifted
    #: log-prob matrix ``[S * (W - 1)]``.
    gather: torch.Tensor

    @property
    def positions(self) -> int:
        return int(self.input_ids.numel())


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Rows into lanes of ``width`` positions: longest first, each into the
    first lane with room (rows of equal length keep their order), as the
    Rust learner packs them (``learner/src/batch.rs``)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    lanes: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        k = next((j for j, f in enumerate(fill) if f + lengths[i] <= width), None)
        if k is None:
            lanes.append([i])
            fill.append(lengths[i])
        else:
            lanes[k].append(i)
            fill[k] += lengths[i]
    return lanes


def _padded(batch: StepBatch, width: int) -> Layout:
    """``batch``'s right-padded rows as they are, cut to ``width``."""
    n = batch.input_ids.shape[0]
    base = torch.arange(n, device=batch.input_ids.device, dtype=torch.int64) * (width - 1)
    return Layout(
        input_ids=batch.input_ids[:, :width],
        position_ids=None,
        gather=batch.gather_index + base.unsqueeze(1),
    )


def layout(batch: StepBatch, packing: bool, min_width: int = 0) -> Layout:
    """The forward inputs of ``batch``'s rows: as they are (cut to the
    longest row), or packed into lanes as wide as the longest row or
    ``min_width`` if that is more."""
    n, full = batch.input_ids.shape
    lengths = batch.row_lengths()
    padded_width = min(full, max(2, max(lengths, default=1)))
    width = max(padded_width, min_width)
    lanes = first_fit_decreasing(lengths, width) if packing else []
    device = batch.input_ids.device
    # Rows that pack into no fewer positions than padding takes are padded
    # (the model's plain causal attention is then the cheaper).
    if not packing or len(lanes) * width >= n * padded_width:
        return _padded(batch, padded_width)
    s = len(lanes)
    source = torch.zeros(s * width, dtype=torch.int64)
    positions = torch.zeros(s * width, dtype=torch.int64)
    base = torch.zeros(n, dtype=torch.int64)
    for lane, rows in enumerate(lanes):
        offset = 0
        for row in rows:
            length = lengths[row]
            at = lane * width + offset
            source[at : at + length] = torch.arange(row * full, row * full + length)
            positions[at : at + length] = torch.arange(length)
            base[row] = lane * (width - 1) + offset
            offset += length
        # The lane's padding: a sequence of its own (positions from 0),
        # made of position 0's token; never attended by a row, never read.
        positions[lane * width + offset : (lane + 1) * width] = torch.arange(width - offset)
    return Layout(
        input_ids=batch.input_ids.reshape(-1).index_select(0, source.to(device)).view(s, width),
        position_ids=positions.to(device).view(s, width),
        gather=batch.gather_index + base.to(device).unsqueeze(1),
    )


def _shifted_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    length = logits.shape[1]
    scaled = logits / temperature if abs(temperature - 1.0) > 0.0 else logits
    return scaled[:, : length - 1].float().log_softmax(-1)


def _read(per_position: torch.Tensor, at: Layout) -> torch.Tensor:
    """``[S, W - 1]`` values at each completion token, ``[N, T]``."""
    return per_position.reshape(-1).index_select(0, at.gather.reshape(-1)).view(at.gather.shape)


def layout_logprobs(logits: torch.Tensor, at: Layout, temperature: float) -> torch.Tensor:
    """Log-probs of the completion tokens, ``[N, T]``, from the logits
    ``[S, W, V]`` of the layout ``at``, at the sampling temperature."""
    logp = _shifted_log_softmax(logits, temperature)
    nxt = at.input_ids[:, 1:].unsqueeze(-1)
    return _read(logp.gather(-1, nxt).squeeze(-1), at)


def completion_logprobs(
    logits: torch.Tensor, batch: StepBatch, temperature: float
) -> torch.Tensor:
    """Log-probs of the completion tokens, ``[N, T]``, from logits
    ``[N, L, V]`` of the padded rows at the sampling temperature."""
    return layout_logprobs(logits, _padded(batch, logits.shape[1]), temperature)


def _gap_sums(
    behaviour: torch.Tensor,
    learner: torch.Tensor,
    versions: torch.Tensor,
    mask: torch.Tensor,
    version: int,
) -> tuple[float, float, float, float]:
    """(tokens, sum |b - l|, max |b - l|, sum k3) over the valid tokens of
    ``version``."""
    same = mask.to(torch.bool) & (versions.to(torch.int64) == version)
    if not bool(same.any()):
        return 0.0, 0.0, 0.0, 0.0
    d = learner.detach().to(torch.float64)[same] - behaviour.to(torch.float64)[same]
    return (
        float(same.sum()),
        float(d.abs().sum()),
        float(d.abs().max()),
        float((d.exp() - 1.0 - d).sum()),
    )


def _entropy_sums(
    logits: torch.Tensor, at: Layout, batch: StepBatch, temperature: float
) -> tuple[float, float]:
    """(sum of the entropies, valid tokens) of the next-token distributions
    that produced the valid completion tokens."""
    with torch.no_grad():
        logp = _shifted_log_softmax(logits, temperature)
        ent = _read(-(logp.exp() * logp).sum(-1), at)
        mask = batch.mask.to(torch.float64)
        return float((ent.to(torch.float64) * mask).sum()), float(mask.sum())


def microbatches(n_rows: int, padded_len: int, budget: int) -> list[list[int]]:
    """Consecutive row indices whose rows x padded length stay within the
    budget (a row over it runs alone)."""
    per = max(1, budget // max(1, padded_len))
    return [list(range(i, min(i + per, n_rows))) for i in range(0, n_rows, per)]


class Trainer:
    """Steps ``model`` (a causal LM returning ``.logits``; sharded with FSDP2
    when the process group has more than one rank) on mini-batches."""

    def __init__(
        self,
        model: nn.Module,
        opts: TrainerOptions,
        learning_rate: float,
        reference: Optional[nn.Module] = None,
    ) -> None:
        self.model = model
        #: The frozen reference policy of the KL loss (the starting weights).
        self.reference = reference
        self.opts = opts
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=learning_rate,
            betas=(opts.beta1, opts.beta2),
            eps=opts.adam_eps,
            weight_decay=opts.weight_decay,
        )
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _logits(self, net: nn.Module, at: Layout) -> torch.Tensor:
        # No cache and no attention mask: a Hugging Face model then reads
        # packed rows from the position ids (masking_utils).
        if at.position_ids is None:
            return net(input_ids=at.input_ids, use_cache=False).logits
        return net(input_ids=at.input_ids, position_ids=at.position_ids, use_cache=False).logits

    def _layout(self, batch: StepBatch) -> Layout:
        min_width = min(self.opts.packing_lane_tokens, self.opts.max_tokens_per_microbatch)
        return layout(batch, self.opts.packing, min_width)

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, Layout]:
        at = self._layout(batch)
        logits = self._logits(self.model, at)
        return logits, layout_logprobs(logits, at, self.opts.temperature), at

    def _detached_logprobs(
        self, batch: StepBatch, model: Optional[nn.Module] = None
    ) -> torch.Tensor:
        """The log-probs of ``batch`` under ``model`` (default: the trained
        one), without gradient, micro-batch by micro-batch."""
        net = self.model if model is None else model
        with torch.no_grad():
            parts = []
            for rows in microbatches(
                batch.n_rows, batch.input_ids.shape[1], self.opts.max_tokens_per_microbatch
            ):
                part = batch.rows(torch.tensor(rows, device=batch.input_ids.device))
                at = self._layout(part)
                logits = self._logits(net, at)
                parts.append(layout_logprobs(logits, at, self.opts.temperature))
        return torch.cat(parts, 0).detach()

    def _reference_logprobs(self, local: StepBatch) -> torch.Tensor:
        """The reference policy's log-probs of every rank's rows."""
        if self.reference is None:
            raise StepError(
                "the step asks for a KL loss (kl_coef > 0) but the engine holds no reference "
                "model (it starts with one when learner.kl_coef > 0: --kl-reference)"
            )
        return self._gather(self._detached_logprobs(local, self.reference))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """The ranks' row blocks, in rank order."""
        if self.world == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, 0)

    def _reduce(self, values: list[float], op: "dist.ReduceOp.RedOpType") -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return [float(x) for x in t.tolist()]

    def train_step(
        self,
        batch: StepBatch,
        cfg: ObjectiveConfig,
        learning_rate: float,
        learner_version: int,
        proximal_rows: Optional[torch.Tensor] = None,
        reference_rows: Optional[torch.Tensor] = None,
    ) -> StepStats:
        """One optimizer step on the mini-batch ``batch``. ``proximal_rows``:
        recomputed proximal log-probs of its rows taken before the batch's
        first mini-batch (:meth:`train_batch`); by default the recompute
        pass runs here."""
        n = batch.n_rows
        if n == 0 or n % self.world != 0:
            raise StepError(
                f"the batch has {n} rows, which {self.world} ranks cannot share evenly"
            )
        device = next(self.model.parameters()).device
        batch = batch.to(device)
        per_rank = n // self.world
        mine = torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank, device=device)
        local = batch.rows(mine)

        # The proximal log-probs of every row, where the plan needs them.
        if self.opts.proximal == ProximalMode.RECOMPUTE:
            proximal: Optional[torch.Tensor] = (
                proximal_rows.to(device)
                if proximal_rows is not None
                else self._gather(self._detached_logprobs(local))
            )
            current_all: Optional[torch.Tensor] = None
        elif self.opts.proximal == ProximalMode.BEHAVIOUR:
            proximal, current_all = batch.behaviour, None
        else:
            proximal = None
            current_all = (
                self._gather(self._detached_logprobs(local))
                if ObjectivePlan.needs_proximal(cfg)
                else None
            )
        reference: Optional[torch.Tensor] = None
        if cfg.kl_coef > 0.0:
            reference = (
                reference_rows.to(device)
                if reference_rows is not None
                else self._reference_logprobs(local)
            )
        plan = ObjectivePlan(
            behaviour=batch.behaviour,
            proximal=proximal,
            current=current_all,
            advantages=batch.advantages,
            versions=batch.versions,
            mask=batch.mask,
            learner_version=learner_version,
            cfg=cfg,
            reference=reference,
        )

        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.zero_grad(set_to_none=True)
        sums = ObjectiveSums()
        loss_sum = 0.0
        entropy_sum, entropy_n = 0.0, 0.0
        # The engine/trainer gap: the recompute pass covers the whole batch
        # (the same on every rank); otherwise each rank's forward passes,
        # still at the step's starting weights, cover its rows.
        recomputed = self.opts.proximal == ProximalMode.RECOMPUTE
        gap = (
            _gap_sums(batch.behaviour, proximal, batch.versions, batch.mask, learner_version)
            if recomputed and proximal is not None
            else (0.0, 0.0, 0.0, 0.0)
        )
        micro = microbatches(per_rank, batch.input_ids.shape[1], self.opts.max_tokens_per_microbatch)
        for rows in micro:
            local_idx = torch.tensor(rows, device=device)
            global_idx = mine.index_select(0, local_idx)
            part_batch = local.rows(local_idx)
            logits, current, at = self._forward(part_batch)
            part = plan.loss(global_idx, current)
            # FSDP2 averages gradients over the ranks: scaled by the world
            # size, the average is the gradient of the summed (global) loss.
            (part.loss * self.world).backward()
            sums.add(part.sums)
            loss_sum += float(part.loss.detach())
            e_sum, e_n = _entropy_sums(logits, at, part_batch, self.opts.temperature)
            entropy_sum += e_sum
            entropy_n += e_n
            if not recomputed:
                g = _gap_sums(
                    part_batch.behaviour,
                    current,
                    part_batch.versions,
                    part_batch.mask,
                    learner_version,
                )
                gap = (gap[0] + g[0], gap[1] + g[1], max(gap[2], g[2]), gap[3] + g[3])

        totals = self._reduce(
            [
                loss_sum,
                sums.clip_low,
                sums.clip_high,
                sums.weight_masked,
                sums.approx_kl,
                sums.importance_weight,
                float(len(micro)),
                entropy_sum,
                entropy_n,
            ]
            + ([0.0, 0.0, 0.0] if recomputed else [gap[0], gap[1], gap[3]])
            + [sums.kl_ref, sums.dual_clip],
            dist.ReduceOp.SUM,
        )
        if not recomputed:
            gap = (totals[9], totals[10], self._reduce([gap[2]], dist.ReduceOp.MAX)[0], totals[11])
        loss = totals[0]
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise StepError(f"the loss is not finite ({loss}); the step was not applied")

        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise StepError(
                f"the gradient is not finite (norm {float(grad_norm)}); the step was not applied"
            )
        self.optimizer.step()

        gap_tokens = gap[0]
        return StepStats(
            loss=loss,
            objective=plan.stats(
                ObjectiveSums(*totals[1:6], kl_ref=totals[12], dual_clip=totals[13])
            ),
            entropy=totals[7] / totals[8] if totals[8] > 0 else 0.0,
            logprob_gap=LogprobGap(
                tokens=int(gap_tokens),
                mean_abs=gap[1] / gap_tokens if gap_tokens > 0 else 0.0,
                max_abs=gap[2],
                kl=gap[3] / gap_tokens if gap_tokens > 0 else 0.0,
            ),
            grad_norm=float(grad_norm),
            microbatches=int(totals[6]),
            tokens=plan.tokens,
        )


    def _my_rows(self, batch: StepBatch) -> StepBatch:
        """This rank's share of ``batch`` (the world size must divide the
        rows), on the model's device."""
        n = batch.n_rows
        if n == 0 or n % self.world != 0:
            raise StepError(
                f"the batch has {n} rows, which {self.world} ranks cannot share evenly"
            )
        device = next(self.model.parameters()).device
        per_rank = n // self.world
        mine = torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank, device=device)
        return batch.to(device).rows(mine)

    def recompute(self, batch: StepBatch) -> torch.Tensor:
        """The current weights' log-probs of every row (each rank computes
        its share)."""
        return self._gather(self._detached_logprobs(self._my_rows(batch)))

    def reference_logprobs(self, batch: StepBatch) -> torch.Tensor:
        """The reference policy's log-probs of every row (each rank computes
        its share)."""
        return self._reference_logprobs(self._my_rows(batch))

    def train_batch(
        self,
        batch: StepBatch,
        order: list[int],
        minibatches: int,
        cfg: ObjectiveConfig,
        learning_rate: float,
        learner_version: int,
    ) -> StepStats:
        """A learner step as the Rust trainer takes it: the rows in
        ``order`` cut into ``minibatches`` slices of ``ceil(rows / k)``, one
        optimizer step each; the recompute pass once, before the first. The
        statistics are token-weighted over the mini-batches, the gradient
        norm is the largest, and the gap is the recompute pass's (else the
        first mini-batch's, whose forward still sees the starting weights)."""
        n = batch.n_rows
        if sorted(order) != list(range(n)):
            raise StepError(f"the order is no permutation of the batch's {n} rows")
        k = max(1, min(minibatches, n))
        size = max(1, -(-n // k))
        chunks = [order[i : i + size] for i in range(0, n, size)]
        for chunk in chunks:
            if len(chunk) % self.world != 0:
                raise StepError(
                    f"a mini-batch of {len(chunk)} rows cannot be shared evenly by "
                    f"{self.world} ranks (learner.torch.world_size must divide the rows "
                    "of every mini-batch)"
                )
        proximal = (
            self.recompute(batch)
            if self.opts.proximal == ProximalMode.RECOMPUTE and len(chunks) > 1
            else None
        )
        # The reference's log-probs once for the whole batch (it is frozen).
        reference = self.reference_logprobs(batch) if cfg.kl_coef > 0.0 else None
        total = StepStats()
        weighted = dict.fromkeys(
            (
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
                "m2po_masked_fraction",
                "dual_clip_fraction",
                "approx_kl",
                "mean_importance_weight",
                "mean_version_lag",
                "kl_ref",
            ),
            0.0,
        )
        loss_sum, entropy_sum, tokens, max_lag = 0.0, 0.0, 0, 0.0
        for i, chunk in enumerate(chunks):
            idx = torch.tensor(chunk, dtype=torch.int64)
            stats = self.train_step(
                batch.rows(idx),
                cfg,
                learning_rate,
                learner_version,
                proximal_rows=None if proximal is None else proximal.index_select(0, idx.to(proximal.device)),
                reference_rows=None
                if reference is None
                else reference.index_select(0, idx.to(reference.device)),
            )
            if i == 0:
                total.logprob_gap = stats.logprob_gap
            w = float(stats.tokens)
            tokens += stats.tokens
            loss_sum += stats.loss * w
            entropy_sum += stats.entropy * w
            for key in weighted:
                weighted[key] += getattr(stats.objective, key) * w
            max_lag = max(max_lag, stats.objective.max_version_lag)
            total.grad_norm = max(total.grad_norm, stats.grad_norm)
            total.microbatches += stats.microbatches
        if proximal is not None:
            # The recompute pass saw the whole batch at the starting weights.
            g = _gap_sums(batch.behaviour, proximal, batch.versions, batch.mask, learner_version)
            total.logprob_gap = LogprobGap(
                tokens=int(g[0]),
                mean_abs=g[1] / g[0] if g[0] > 0 else 0.0,
                max_abs=g[2],
                kl=g[3] / g[0] if g[0] > 0 else 0.0,
            )

        def norm(x: float) -> float:
            return x / tokens if tokens > 0 else 0.0

        total.tokens = tokens
        total.loss = norm(loss_sum)
        total.entropy = norm(entropy_sum)
        total.objective = ObjectiveStats(
            tokens=tokens,
            max_version_lag=max_lag,
            **{key: norm(v) for key, v in weighted.items()},
        )
        return total
