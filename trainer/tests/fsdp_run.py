"""Trains a tiny random Qwen3 for a few steps on seeded batches under
``torchrun`` (gloo on CPU), every decoder layer and the model sharded with
FSDP2, and writes the full weights and each step's statistics (rank 0).

    python -m torch.distributed.run --standalone --nproc_per_node W \\
        tests/fsdp_run.py OUT_DIR --steps 5 --proximal recompute --clip adaptive
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl_trainer.checkpoint import export_weights, load_checkpoint, save_checkpoint
from asyncrl_trainer.distributed import close_process_group
from asyncrl_trainer.objective import (
    Aggregation,
    ClipMode,
    KlEstimator,
    ObjectiveConfig,
    ProximalMode,
)
from asyncrl_trainer.step import StepBatch, Trainer, TrainerOptions

VOCAB = 128
ROWS = 8
PROMPT = 4
MAX_COMPLETION = 8


def tiny_qwen3() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def batch(step: int, learner_version: int) -> StepBatch:
    """The seeded mini-batch of `step`: ragged prompts and completions,
    versions up to three behind, one advantage per row."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(2, MAX_COMPLETION + 1, (ROWS,), generator=g)
    length = PROMPT + MAX_COMPLETION
    input_ids = torch.randint(0, VOCAB, (ROWS, length), generator=g)
    t = torch.arange(MAX_COMPLETION).unsqueeze(0)
    mask = t < lengths.unsqueeze(1)
    # Prompts of 1..PROMPT tokens: rows from 3 to PROMPT + MAX_COMPLETION
    # tokens, right-padded.
    prompts = torch.randint(1, PROMPT + 1, (ROWS, 1), generator=g)
    gather_index = torch.where(mask, prompts - 1 + t, torch.zeros_like(t))
    behaviour = -(torch.rand(ROWS, MAX_COMPLETION, generator=g) * 2.9 + 0.1)
    versions = learner_version - torch.randint(0, 4, (ROWS, MAX_COMPLETION), generator=g)
    advantages = (torch.rand(ROWS, 1, generator=g) * 3.0 - 1.5).expand(ROWS, MAX_COMPLETION)
    return StepBatch(
        input_ids=input_ids,
        gather_index=gather_index,
        behaviour=behaviour.masked_fill(~mask, 0.0),
        versions=versions.masked_fill(~mask, 0),
        advantages=advantages.masked_fill(~mask, 0.0).contiguous(),
        mask=mask,
        # Each row ends with its completion: rows of ragged length.
        lengths=prompts.squeeze(1) + lengths,
    )


def main() -> None:
    dist.init_process_group("gloo")
    run()
    close_process_group()


def run() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--proximal", default="recompute")
    parser.add_argument("--clip", default="adaptive")
    parser.add_argument("--aggregation", default="token")
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--packing", action="store_true", help="pack each micro-batch's rows")
    parser.add_argument("--lane-tokens", type=int, default=0, help="the narrowest packed lane")
    parser.add_argument("--kl", default=None, help="a KL loss (k1 or k3) against the starting weights")
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this step and stop")
    parser.add_argument("--ckpt", type=Path, default=None, help="the checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="start from --ckpt")
    parser.add_argument("--export", type=Path, default=None, help="export the weights here at the end")
    args = parser.parse_args()

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_qwen3()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reference = None
    if args.kl is not None:
        # The same seeded starting weights, sharded alike and never trained.
        reference = tiny_qwen3()
        for layer in reference.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(reference, mesh=mesh)
        reference.requires_grad_(False)

    trainer = Trainer(
        model,
        TrainerOptions(
            proximal=ProximalMode(args.proximal),
            max_tokens_per_microbatch=args.budget,
            packing=args.packing,
            packing_lane_tokens=args.lane_tokens,
            grad_clip=1.0,
        ),
        learning_rate=1e-3,
        reference=reference,
    )
    cfg = ObjectiveConfig(
        eps_low=0.2,
        eps_high=0.28,
        clip_mode=ClipMode(args.clip),
        aggregation=Aggregation(args.aggregation),
        kl_coef=0.0 if args.kl is None else 0.5,
        kl_estimator=KlEstimator(args.kl or "k3"),
    )
    steps = []
    start = 0
    if args.resume:
        start = load_checkpoint(args.ckpt, model, trainer.optimizer)
    for step in range(start, args.steps):
        stats = trainer.train_step(batch(step, step), cfg, 1e-3, step)
        steps.append(asdict(stats))
        if args.save_at == step + 1:
            save_checkpoint(args.ckpt, model, trainer.optimizer, step + 1)
            break
    if args.export is not None:
        export_weights(args.export, model, max_shard_size="100KB")

    weights = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, args.out / "weights.pt")
        (args.out / "steps.json").write_text(json.dumps(steps), encoding="utf-8")
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
