"""Every architecture of :mod:`asyncrl_trainer.tiny` trains with the torch
engine's step: its decoder layers are found for FSDP2, two steps change
the weights with a finite loss, and the exported folder loads back exactly.
Qwen3-MoE is here too: vLLM's CPU build does not serve it token-exactly
(docs/benchmarks.md), so its training side is what is tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl_trainer.checkpoint import export_weights, load_weights
from asyncrl_trainer.objective import ClipMode, ObjectiveConfig, ProximalMode
from asyncrl_trainer.server import decoder_layers
from asyncrl_trainer.step import StepBatch, Trainer, TrainerOptions
from asyncrl_trainer.tiny import ARCHITECTURES, write

VOCAB = 98


def batch(step: int) -> StepBatch:
    g = torch.Generator().manual_seed(step)
    rows, prompt, completion = 4, 5, 4
    ids = torch.randint(3, VOCAB, (rows, prompt + completion), generator=g)
    t = torch.arange(completion).unsqueeze(0).expand(rows, completion)
    return StepBatch(
        input_ids=ids,
        gather_index=(prompt - 1 + t).contiguous(),
        behaviour=-(torch.rand(rows, completion, generator=g) + 3.0),
        versions=torch.full((rows, completion), step, dtype=torch.int32),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1).expand(rows, completion).contiguous(),
        mask=torch.ones(rows, completion, dtype=torch.bool),
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_trains_and_exports(arch: str, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(
        json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    folder = write(arch, source, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.model_type == arch
    assert len(decoder_layers(model)) == 2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, TrainerOptions(proximal=ProximalMode.RECOMPUTE), learning_rate=1e-3)
    cfg = ObjectiveConfig(clip_mode=ClipMode.ADAPTIVE)
    for step in range(2):
        stats = trainer.train_batch(batch(step), [3, 1, 0, 2], 2, cfg, 1e-3, step)
        assert torch.isfinite(torch.tensor(stats.loss)) and stats.tokens == 16
        assert stats.grad_norm > 0
    after = model.state_dict()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert len(changed) > len(after) // 2, f"{arch}: only {changed} changed"

    files = export_weights(tmp_path / "export", model)
    assert files and all((tmp_path / "export" / f).is_file() for f in files)
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    load_weights(fresh, tmp_path / "export")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, after[k]), k
    exported = load_file(str(tmp_path / "export" / files[0]))
    assert exported, "an empty export"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_rows_give_every_architecture_its_padded_log_probs(arch: str, tmp_path: Path) -> None:
    """Rows packed several to a lane read the log-probs and entropies of
    the same rows padded, within 1e-5: the model's own mask (found from the
    position ids) keeps each row to itself in every architecture, sliding
    windows and mixtures of experts included."""
    from asyncrl_trainer.step import _entropy_sums, layout, layout_logprobs

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(
        json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    model = AutoModelForCausalLM.from_pretrained(write(arch, source, tmp_path / arch), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    rows, width, completion = 8, 14, 4
    lengths = torch.tensor([14, 6, 5, 9, 7, 8, 3, 12])
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    t = torch.arange(completion).unsqueeze(0)
    mask = t < (lengths.unsqueeze(1) - 2).clamp(max=completion)
    # Each row's completion is its last tokens (up to four).
    n_comp = mask.sum(1, keepdim=True)
    gather = torch.where(mask, lengths.unsqueeze(1) - n_comp - 1 + t, torch.zeros_like(t))
    b = StepBatch(
        input_ids=ids,
        gather_index=gather,
        behaviour=torch.zeros(rows, completion),
        versions=torch.zeros(rows, completion, dtype=torch.int32),
        advantages=torch.zeros(rows, completion),
        mask=mask,
        lengths=lengths,
    )
    trainer = Trainer(model, TrainerOptions(), learning_rate=1e-3)
    read = {}
    for packing in (False, True):
        at = layout(b, packing, 20)
        with torch.no_grad():
            logits = trainer._logits(model, at)
        read[packing] = (at.positions, layout_logprobs(logits, at, 0.8), _entropy_sums(logits, at, b, 0.8))
    (padded, lp, ent), (packed, plp, pent) = read[False], read[True]
    assert packed < padded and packed % 20 == 0, (packed, padded)
    worst = float(((lp - plp).abs() * mask).max())
    assert worst <= 1e-5, f"{arch}: log-probs differ by {worst}"
    assert abs(ent[0] - pent[0]) <= 1e-5 * max(1.0, ent[0]) and ent[1] == pent[1]
    assert float(lp[mask].std()) > 0.01, "the rows' log-probs are not all alike"
