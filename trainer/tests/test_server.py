"""The engine as the learner drives it: ``torchrun`` with two gloo ranks,
``asyncrl.v1.TrainerEngine`` over its Unix socket, batches as the Arrow IPC
rows trainer.proto describes."""

from __future__ import annotations

import io
import os
import socket as socket_module
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import grpc
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl_trainer.generate import GenerateParams, generate
from asyncrl_trainer.objective import (
    Aggregation,
    ClipMode,
    KlEstimator,
    ObjectiveConfig,
    ProximalMode,
)
from asyncrl_trainer.server import batch_from_ipc, load_stubs
from asyncrl_trainer.step import Trainer, TrainerOptions

pb2, pb2_grpc = load_stubs()

CPU = torch.device("cpu")
VOCAB = 96
ROWS = 8
LR = 1e-3


def tiny_model(path: Path) -> None:
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        # Tied, as the smaller Qwen3 models are: ranks that build the model
        # on the meta device must keep the head the embedding's parameter.
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def rows(step: int) -> pa.Table:
    """Ragged rows: prompt of 3-5 tokens, completion of 1-6."""
    g = torch.Generator().manual_seed(500 + step)
    cols: dict[str, list[Any]] = {
        k: [] for k in ("input_ids", "gather_index", "behaviour", "versions", "advantages", "mask")
    }
    for r in range(ROWS):
        prompt = int(torch.randint(3, 6, (1,), generator=g))
        completion = int(torch.randint(1, 7, (1,), generator=g))
        cols["input_ids"].append(torch.randint(0, VOCAB, (prompt + completion,), generator=g).tolist())
        cols["gather_index"].append([prompt - 1 + t for t in range(completion)])
        cols["behaviour"].append((-(torch.rand(completion, generator=g) * 2.0 + 0.1)).tolist())
        cols["versions"].append([max(0, step - int(torch.randint(0, 3, (1,), generator=g)))] * completion)
        cols["advantages"].append([float(r % 3) - 1.0] * completion)
        cols["mask"].append([True] * completion)
    return pa.table(
        {
            "input_ids": pa.array(cols["input_ids"], pa.list_(pa.int64())),
            "gather_index": pa.array(cols["gather_index"], pa.list_(pa.int64())),
            "behaviour": pa.array(cols["behaviour"], pa.list_(pa.float32())),
            "versions": pa.array(cols["versions"], pa.list_(pa.int32())),
            "advantages": pa.array(cols["advantages"], pa.list_(pa.float32())),
            "mask": pa.array(cols["mask"], pa.list_(pa.bool_())),
        }
    )


def ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def order(step: int) -> list[int]:
    return torch.randperm(ROWS, generator=torch.Generator().manual_seed(step)).tolist()


OBJECTIVE = ObjectiveConfig(eps_low=0.2, eps_high=0.28, clip_mode=ClipMode.ADAPTIVE)


def request(step: int) -> Any:
    return pb2.TrainStepRequest(
        step=step + 1,
        learner_version=step,
        batch_arrow_ipc=ipc(rows(step)),
        order=order(step),
        minibatches=2,
        objective=pb2.StepObjective(
            eps_low=OBJECTIVE.eps_low,
            eps_high=OBJECTIVE.eps_high,
            clip_mode=2,
            importance_weight_cap=OBJECTIVE.importance_weight_cap,
            adaptive_quantile=OBJECTIVE.adaptive_quantile,
            adaptive_temperature=OBJECTIVE.adaptive_temperature,
            m2po_threshold=OBJECTIVE.m2po_threshold,
            aggregation=1,
        ),
        learning_rate=LR,
    )


class Engine:
    def __init__(
        self,
        model: Path,
        socket: Path,
        world: int,
        log: Path,
        rendezvous: list[str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.socket = socket
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *(rendezvous or ["--standalone"]),
                f"--nproc-per-node={world}",
                "-m",
                "asyncrl_trainer.server",
                "--model",
                str(model),
                "--socket",
                str(socket),
                "--proximal",
                "recompute",
                "--max-tokens-per-microbatch",
                "24",
                "--learning-rate",
                str(LR),
                *(extra or []),
            ],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self.stub = pb2_grpc.TrainerEngineStub(self.channel)

    def ready(self, timeout: float = 240.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the engine exited: {self.log.read_text()}")
            try:
                return self.stub.Describe(pb2.DescribeRequest(), timeout=5)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stub.Shutdown(pb2.ShutdownRequest(), timeout=60)
            except grpc.RpcError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.channel.close()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    tiny_model(tmp_path / "model")
    e = Engine(tmp_path / "model", tmp_path / "engine.sock", 2, tmp_path / "engine.log")
    yield e
    e.close()


def reference_weights(model_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(
        model,
        TrainerOptions(proximal=ProximalMode.RECOMPUTE, max_tokens_per_microbatch=24),
        learning_rate=LR,
    )
    for step in range(steps):
        trainer.train_batch(batch_from_ipc(ipc(rows(step)), 0), order(step), 2, OBJECTIVE, LR, step)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_two_ranks_over_grpc_train_checkpoint_and_export_like_one_process(
    engine: Engine, tmp_path: Path
) -> None:
    info = engine.ready()
    assert (info.world_size, info.model_type, info.vocab_size) == (2, "qwen3", VOCAB)
    assert info.max_position_embeddings == 64

    first = engine.stub.TrainStep(request(0), timeout=120)
    assert first.tokens > 0 and first.microbatches >= 2
    assert first.logprob_gap.tokens > 0 and first.grad_norm > 0
    # A checkpoint after step 1, then two more steps.
    engine.stub.SaveCheckpoint(
        pb2.SaveCheckpointRequest(path=str(tmp_path / "ckpt"), learner_meta_json='{"step": 1}'),
        timeout=120,
    )
    for step in (1, 2):
        engine.stub.TrainStep(request(step), timeout=120)
    engine.stub.ExportWeights(pb2.ExportWeightsRequest(path=str(tmp_path / "after3")), timeout=120)

    # Two ranks give the weights of one unsharded process.
    got = load_file(str(tmp_path / "after3" / "model.safetensors"))
    want = reference_weights(tmp_path / "model", 3)
    for name, tensor in got.items():
        assert torch.allclose(tensor, want[name], atol=1e-5), name

    # Restored, the same two steps give the same weights again.
    meta = engine.stub.LoadCheckpoint(
        pb2.LoadCheckpointRequest(path=str(tmp_path / "ckpt")), timeout=120
    )
    assert meta.learner_meta_json == '{"step": 1}'
    for step in (1, 2):
        engine.stub.TrainStep(request(step), timeout=120)
    engine.stub.ExportWeights(pb2.ExportWeightsRequest(path=str(tmp_path / "again")), timeout=120)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    for name, tensor in got.items():
        assert torch.equal(tensor, again[name]), name

    # Published weights adopted, as the learner hands them over: the
    # object store's one file in a folder of its own (no config.json).
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((tmp_path / "after3" / "model.safetensors").read_bytes())
    engine.stub.LoadWeights(pb2.LoadWeightsRequest(path=str(bare)), timeout=120)
    engine.stub.ExportWeights(pb2.ExportWeightsRequest(path=str(tmp_path / "loaded")), timeout=120)
    loaded = load_file(str(tmp_path / "loaded" / "model.safetensors"))
    for name, tensor in got.items():
        assert torch.equal(tensor, loaded[name]), name


def test_a_kl_loss_against_the_starting_weights_over_two_ranks_is_the_one_process_loss(
    tmp_path: Path,
) -> None:
    tiny_model(tmp_path / "model")
    engine = Engine(
        tmp_path / "model",
        tmp_path / "engine.sock",
        2,
        tmp_path / "engine.log",
        extra=["--kl-reference"],
    )
    try:
        engine.ready()
        kl_cfg = replace(OBJECTIVE, kl_coef=0.5, kl_estimator=KlEstimator.K1)
        replies = []
        for step in range(3):
            req = request(step)
            req.objective.kl_coef = kl_cfg.kl_coef
            req.objective.kl_estimator = 1  # k1
            replies.append(engine.stub.TrainStep(req, timeout=120))
        engine.stub.ExportWeights(pb2.ExportWeightsRequest(path=str(tmp_path / "out")), timeout=120)
    finally:
        engine.close()
    got = load_file(str(tmp_path / "out" / "model.safetensors"))

    # One process, the folder's weights as its reference.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    frozen = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    frozen.requires_grad_(False)
    trainer = Trainer(
        model,
        TrainerOptions(proximal=ProximalMode.RECOMPUTE, max_tokens_per_microbatch=24),
        learning_rate=LR,
        reference=frozen,
    )
    for step, reply in enumerate(replies):
        stats = trainer.train_batch(
            batch_from_ipc(ipc(rows(step)), 0), order(step), 2, kl_cfg, LR, step
        )
        assert abs(reply.kl_ref - stats.objective.kl_ref) <= 1e-6, (step, reply.kl_ref)
        assert abs(reply.loss - stats.loss) <= 1e-5, (step, reply.loss, stats.loss)
    # The first step's first mini-batch starts at the reference; later ones
    # have moved away from it.
    assert replies[-1].kl_ref != 0.0
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for name, tensor in got.items():
        assert torch.allclose(tensor, want[name], atol=1e-5), name


def test_two_ranks_generate_every_prompt_as_one_process_does(engine: Engine, tmp_path: Path) -> None:
    # Five prompts over two ranks (three and two), then one (rank 1 decodes
    # a placeholder row): every rank runs the same forward passes.
    engine.ready()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 2, 7, 3, 5)]
    seeds = [21, 22, 23, 24, 25]
    local = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    for n, temperature in ((5, 0.0), (5, 1.0), (1, 0.0)):
        reply = engine.stub.Generate(
            pb2.GenerateRequest(
                prompts=[pb2.GeneratePrompt(tokens=p, seed=s) for p, s in zip(prompts[:n], seeds)],
                max_new_tokens=6,
                temperature=temperature,
            ),
            timeout=120,
        )
        want = generate(local, prompts[:n], seeds[:n], GenerateParams(6, temperature, frozenset()), CPU, 0)
        assert [list(c.tokens) for c in reply.completions] == want, (n, temperature)
    too_long = pb2.GenerateRequest(prompts=[pb2.GeneratePrompt(tokens=[3] * 60)], max_new_tokens=10)
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.Generate(too_long, timeout=60)
    assert "exceed the model's 64 positions" in refused.value.details()


def test_bad_calls_are_refused_with_the_reason_and_the_engine_keeps_serving(
    engine: Engine, tmp_path: Path
) -> None:
    engine.ready()
    bad = request(0)
    bad.order[:] = [0, 1, 2]
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.TrainStep(bad, timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "permutation" in refused.value.details()

    outside = rows(0).to_pydict()
    outside["input_ids"][3][0] = VOCAB + 7
    bad = request(0)
    bad.batch_arrow_ipc = ipc(pa.table(outside, schema=rows(0).schema))
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.TrainStep(bad, timeout=120)
    assert "outside the vocabulary" in refused.value.details()

    (tmp_path / "taken").mkdir()
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.ExportWeights(pb2.ExportWeightsRequest(path=str(tmp_path / "taken")), timeout=60)
    assert "exists already" in refused.value.details()

    unknown = request(0)
    unknown.objective.importance_correction = 9
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.TrainStep(unknown, timeout=120)
    assert "importance correction (9)" in refused.value.details()

    # A KL loss needs the reference this engine was not started with.
    kl = request(0)
    kl.objective.kl_coef = 0.1
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.TrainStep(kl, timeout=120)
    assert "no reference model" in refused.value.details()
    assert "--kl-reference" in refused.value.details()

    # A dual-clip bound is 0 (off) or at least 1.
    dual = request(0)
    dual.objective.dual_clip = 0.5
    with pytest.raises(grpc.RpcError) as refused:
        engine.stub.TrainStep(dual, timeout=120)
    assert "dual_clip 0.5" in refused.value.details()

    # Still serving, and nothing was applied: a good step trains.
    assert engine.stub.TrainStep(request(0), timeout=120).tokens > 0

    # GSPO's sequence ratio with IcePop's band reach the objective: a band
    # no sequence's weight is in masks every token, and the step says so.
    gspo = request(1)
    gspo.objective.clip_mode = 4
    gspo.objective.importance_correction = 3
    gspo.objective.importance_weight_cap = 1e-9
    gspo.objective.importance_weight_floor = 0.0
    reply = engine.stub.TrainStep(gspo, timeout=120)
    assert reply.tokens > 0 and reply.loss == 0.0 and reply.weight_masked_fraction == 1.0
    gspo.objective.importance_weight_floor = 0.0
    gspo.objective.importance_weight_cap = 1e9
    reply = engine.stub.TrainStep(gspo, timeout=120)
    assert reply.weight_masked_fraction == 0.0 and reply.loss != 0.0

    # Dual clip reaches the objective and the reply: the second mini-batch
    # repeats the first's rows with A = -1 where the first had A = +1, so
    # the first's update raised their ratios, and a bound just above 1
    # holds them.
    twice = rows(2).to_pydict()
    half = ROWS // 2
    for key, column in twice.items():
        twice[key] = column[:half] + column[:half]
    twice["advantages"] = [
        [1.0 if r < half else -1.0] * len(m) for r, m in enumerate(twice["mask"])
    ]
    dual = request(2)
    dual.batch_arrow_ipc = ipc(pa.table(twice, schema=rows(2).schema))
    dual.order[:] = list(range(ROWS))
    assert engine.stub.TrainStep(dual, timeout=120).dual_clip_fraction == 0.0
    dual.objective.dual_clip = 1.0 + 1e-6
    reply = engine.stub.TrainStep(dual, timeout=120)
    assert 0.0 < reply.dual_clip_fraction <= 0.5, reply.dual_clip_fraction


def test_a_folder_transformers_cannot_load_ends_the_group_with_one_line_naming_the_key(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    e = Engine(folder, tmp_path / "engine.sock", 1, tmp_path / "engine.log")
    try:
        rc = e.proc.wait(timeout=240)
    finally:
        e.close()
    assert rc != 0
    lines = [l for l in e.log.read_text().splitlines() if l.startswith("error: model.path")]
    assert len(lines) == 1, e.log.read_text()
    assert str(folder) in lines[0]


def free_port() -> int:
    with socket_module.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nodes_started_from_different_configs_are_refused_naming_the_option(
    tmp_path: Path,
) -> None:
    # Two nodes of one rank each, as the learner (node 0) and
    # `asyncrl trainer-node` (node 1) start them, meeting at a static
    # rendezvous; node 1 read a config with another seed.
    tiny_model(tmp_path / "model")
    port = free_port()
    nodes = [
        Engine(
            tmp_path / "model",
            tmp_path / "engine.sock",
            1,
            tmp_path / f"node{rank}.log",
            rendezvous=[
                "--nnodes=2",
                f"--node-rank={rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
            ],
            extra=[f"--seed={rank}"],
        )
        for rank in (0, 1)
    ]
    try:
        codes = [n.proc.wait(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            n.close()
    assert all(c != 0 for c in codes), [n.log.read_text() for n in nodes]
    lines = [l for l in nodes[0].log.read_text().splitlines() if l.startswith("error: learner.torch")]
    assert lines == [
        "error: learner.torch: rank 1 was started with --seed=1, rank 0 with --seed=0: "
        "every node must run the same config"
    ], nodes[0].log.read_text()
