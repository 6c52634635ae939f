"""The ``torch`` trainer engine as a process group: ``asyncrl.v1.TrainerEngine``
(``protos/proto/asyncrl/v1/trainer.proto``) served on a Unix socket.

The learner role starts it with ``torchrun``::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m asyncrl_trainer.server --model DIR --socket PATH [options]

Every rank loads the Hugging Face model folder with transformers, shards
each decoder layer and the model with FSDP2 (``fully_shard``; bf16 mixed
precision, activation checkpointing and CPU offload on request). Rank 0
serves gRPC, one call at a time; it broadcasts each call to the other
ranks, every rank runs it, and rank 0 answers once all ranks are done (an
error on any rank is the call's error). Every rank exits when its parent
(torchrun) dies, so a learner killed with SIGKILL leaves no trainer behind.

A model folder transformers cannot load ends the group before it serves,
with one line on stderr naming ``model.path`` and exit code 2.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent import futures
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .generate import GenerateParams, generate
from .checkpoint import export_weights, load_checkpoint, load_weights, read_learner_meta, save_checkpoint
from .distributed import close_process_group
from .objective import (
    Aggregation,
    ClipMode,
    ImportanceCorrection,
    KlEstimator,
    ObjectiveConfig,
    ProximalMode,
)
from .step import StepBatch, StepError, Trainer, TrainerOptions

#: ``protos/proto`` of the repository this package lives in.
PROTO_DIR = Path(__file__).resolve().parents[2] / "protos" / "proto"
ENGINE_VERSION = "0.1.0"
#: How long a rank waits in a collective: the learner may wait long for a
#: batch between steps, and torchrun ends the group when a rank dies.
COLLECTIVE_TIMEOUT = timedelta(hours=24)


class ConfigError(Exception):
    """Bad input named by its config key; the group exits with code 2."""


def load_stubs() -> tuple[Any, Any]:
    """``trainer_pb2`` and ``trainer_pb2_grpc``, generated from the .proto
    files with grpcio-tools, so the contract has one definition."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="asyncrl-trainer-stubs-"))
    include = Path(protoc.__file__).parent / "_proto"
    files = [str(PROTO_DIR / "asyncrl" / "v1" / f) for f in ("admin.proto", "trainer.proto")]
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *files,
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed on {files} with exit code {rc}")
    sys.path.insert(0, str(out))
    return (
        importlib.import_module("asyncrl.v1.trainer_pb2"),
        importlib.import_module("asyncrl.v1.trainer_pb2_grpc"),
    )


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl_trainer.server")
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    p.add_argument("--socket", type=Path, required=True, help="the Unix socket rank 0 serves")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--proximal", default="approx", choices=[m.value for m in ProximalMode])
    p.add_argument("--max-tokens-per-microbatch", type=int, default=0)
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack each micro-batch's rows several to a lane (learner.packing)",
    )
    p.add_argument(
        "--packing-lane-tokens",
        type=int,
        default=0,
        help="the narrowest packed lane (learner.packing_lane_tokens); 0: the longest row",
    )
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument(
        "--mixed-precision",
        default="auto",
        choices=["auto", "none", "bf16"],
        help="auto: bf16 on CUDA, none (fp32) on the CPU",
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kl-reference",
        action="store_true",
        help="hold a frozen copy of the starting weights for the KL loss (learner.kl_coef > 0)",
    )
    return p.parse_args(argv)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``
    for the Llama family, Qwen2/3, Gemma 3 and their MoE variants)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        language = getattr(inner, "language_model", None)
        layers = getattr(language, "layers", None)
    if layers is None:
        raise ConfigError(
            f"model.path: {type(model).__name__} has no decoder layers at model.layers; "
            "the torch engine shards each decoder layer"
        )
    return list(layers)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no
    memory, no initialisation) and their buffers for real (rotary tables
    and scales are computed at construction, and no checkpoint holds
    them)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        # A parameter on meta already is registered as it is: a tied head
        # stays the embedding's own parameter.
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _cannot_load(args: argparse.Namespace, e: Exception) -> ConfigError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConfigError(f"model.path: transformers cannot load {args.model}: {first}")


def build_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, int]:
    """The model, sharded (:func:`shard`), and its parameter count.

    With one rank, transformers loads the folder. With more, only rank 0
    reads the weights (into host memory, fp32); every other rank builds the
    model with its parameters on the meta device, every rank shards it, and
    the full weights reach each rank's shards from rank 0 (a broadcast):
    a node holds one host copy of the model at most, not one per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    world, rank = dist.get_world_size(), dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    try:
        if world == 1 or rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        if world == 1:
            model = loaded
        else:
            config = AutoConfig.from_pretrained(args.model)
            with parameters_on_meta():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if rank == 0:
                full = {k: v.detach() for k, v in loaded.state_dict().items()}
                del loaded
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise _cannot_load(args, e) from e
    parameters = sum(p.numel() for p in model.parameters())
    if world == 1:
        model.to(device)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    shard(model, args, device)
    if world > 1:
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.to_empty(device=torch.device("cpu") if args.cpu_offload else device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        set_model_state_dict(
            model,
            full,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        del full
    return model, parameters


def shard(model: nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """FSDP2: each decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and device.type == "cuda"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if args.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def batch_from_ipc(data: bytes, pad_id: int) -> StepBatch:
    """The learner's rows (the Arrow IPC stream trainer.proto describes),
    right-padded into a :class:`StepBatch`."""
    import pyarrow as pa

    table = pa.ipc.open_stream(io.BytesIO(data)).read_all()
    names = ("input_ids", "gather_index", "behaviour", "versions", "advantages", "mask")
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise StepError(f"the batch has no column {missing[0]}")
    cols = {n: table.column(n).to_pylist() for n in names}
    rows = table.num_rows
    if rows == 0:
        raise StepError("the batch has no rows")
    length = max(len(r) for r in cols["input_ids"])
    width = max(1, max(len(r) for r in cols["gather_index"]))
    input_ids = torch.full((rows, length), pad_id, dtype=torch.int64)
    gather = torch.zeros((rows, width), dtype=torch.int64)
    behaviour = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.zeros((rows, width), dtype=torch.int32)
    advantages = torch.zeros((rows, width), dtype=torch.float32)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for i in range(rows):
        ids = cols["input_ids"][i]
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        t = len(cols["gather_index"][i])
        if any(len(cols[n][i]) != t for n in names[2:]):
            raise StepError(f"row {i}: the per-token lists differ in length")
        if t == 0:
            continue
        g = torch.tensor(cols["gather_index"][i], dtype=torch.int64)
        if int(g.min()) < 0 or int(g.max()) >= len(ids) - 1:
            raise StepError(f"row {i}: a gather index is outside its {len(ids)} tokens")
        gather[i, :t] = g
        behaviour[i, :t] = torch.tensor(cols["behaviour"][i], dtype=torch.float32)
        versions[i, :t] = torch.tensor(cols["versions"][i], dtype=torch.int32)
        advantages[i, :t] = torch.tensor(cols["advantages"][i], dtype=torch.float32)
        mask[i, :t] = torch.tensor(cols["mask"][i], dtype=torch.bool)
    return StepBatch(
        input_ids=input_ids,
        gather_index=gather,
        behaviour=behaviour,
        versions=versions,
        advantages=advantages,
        mask=mask,
        lengths=torch.tensor([len(r) for r in cols["input_ids"]], dtype=torch.int64),
    )


class Engine:
    """What every rank runs for a call (the same on each)."""

    def __init__(self, args: argparse.Namespace, pb2: Any) -> None:
        self.args = args
        self.pb2 = pb2
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        torch.manual_seed(args.seed)
        self.model, self.parameters = build_model(args, self.device)
        config = self.model.config
        text = getattr(config, "text_config", None) or config
        self.model_type = str(getattr(config, "model_type", ""))
        self.vocab_size = int(getattr(text, "vocab_size", 0))
        self.max_positions = int(getattr(text, "max_position_embeddings", 0) or 0)
        pad = getattr(text, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        # The KL loss's reference: the folder's weights, loaded and sharded
        # like the model and never trained; a restarted group loads the same.
        self.reference: Optional[nn.Module] = None
        if args.kl_reference:
            plain = argparse.Namespace(**{**vars(args), "activation_checkpointing": False})
            self.reference = build_model(plain, self.device)[0]
            self.reference.requires_grad_(False)
        budget = args.max_tokens_per_microbatch
        self.trainer = Trainer(
            self.model,
            TrainerOptions(
                proximal=ProximalMode(args.proximal),
                temperature=args.temperature,
                max_tokens_per_microbatch=budget if budget > 0 else 1 << 62,
                packing=args.packing,
                packing_lane_tokens=max(0, args.packing_lane_tokens),
                grad_clip=args.grad_clip if args.grad_clip > 0 else float("inf"),
                weight_decay=args.weight_decay,
                beta1=args.beta1,
                beta2=args.beta2,
                adam_eps=args.adam_eps,
            ),
            learning_rate=args.learning_rate,
            reference=self.reference,
        )

    def describe(self, _req: Any) -> Any:
        return self.pb2.EngineInfo(
            world_size=dist.get_world_size(),
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_positions,
            parameters=self.parameters,
            device=self.device.type,
            engine_version=ENGINE_VERSION,
        )

    def train_step(self, req: Any) -> Any:
        start = time.monotonic()
        o = req.objective
        clip = {1: ClipMode.PPO, 2: ClipMode.ADAPTIVE, 3: ClipMode.M2PO, 4: ClipMode.GSPO}.get(
            o.clip_mode
        )
        aggregation = {1: Aggregation.TOKEN, 2: Aggregation.SEQUENCE}.get(o.aggregation)
        # Unspecified (0): a learner from before the field, whose objective
        # masked above the cap.
        correction = {
            0: ImportanceCorrection.MASK,
            1: ImportanceCorrection.MASK,
            2: ImportanceCorrection.TRUNCATE,
            3: ImportanceCorrection.ICEPOP,
        }.get(o.importance_correction)
        # Unspecified (0): k3, the default.
        estimator = {0: KlEstimator.K3, 1: KlEstimator.K1, 2: KlEstimator.K3}.get(o.kl_estimator)
        if clip is None or aggregation is None or correction is None or estimator is None:
            raise StepError(
                f"the step's objective names no clip mode ({o.clip_mode}), aggregation "
                f"({o.aggregation}), importance correction ({o.importance_correction}) or KL "
                f"estimator ({o.kl_estimator})"
            )
        if not (math.isfinite(o.kl_coef) and o.kl_coef >= 0.0):
            raise StepError(f"the step's kl_coef {o.kl_coef} is not a finite number >= 0")
        # 0 (also a learner from before the field): no dual clip.
        if not (math.isfinite(o.dual_clip) and (o.dual_clip == 0.0 or o.dual_clip >= 1.0)):
            raise StepError(f"the step's dual_clip {o.dual_clip} is neither 0 (off) nor at least 1")
        cfg = ObjectiveConfig(
            eps_low=o.eps_low,
            eps_high=o.eps_high,
            clip_mode=clip,
            importance_weight_cap=o.importance_weight_cap,
            importance_correction=correction,
            importance_weight_floor=o.importance_weight_floor,
            adaptive_quantile=o.adaptive_quantile,
            adaptive_temperature=o.adaptive_temperature,
            m2po_threshold=o.m2po_threshold,
            aggregation=aggregation,
            kl_coef=o.kl_coef,
            kl_estimator=estimator,
            dual_clip=o.dual_clip,
        )
        batch = batch_from_ipc(req.batch_arrow_ipc, self.pad_id)
        if int(batch.input_ids.max()) >= self.vocab_size or int(batch.input_ids.min()) < 0:
            raise StepError(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        stats = self.trainer.train_batch(
            batch,
            [int(i) for i in req.order],
            int(req.minibatches),
            cfg,
            req.learning_rate,
            req.learner_version,
        )
        s = stats.objective
        return self.pb2.TrainStepReply(
            loss=stats.loss,
            clip_low_fraction=s.clip_low_fraction,
            clip_high_fraction=s.clip_high_fraction,
            weight_masked_fraction=s.weight_masked_fraction,
            m2po_masked_fraction=s.m2po_masked_fraction,
            dual_clip_fraction=s.dual_clip_fraction,
            approx_kl=s.approx_kl,
            mean_importance_weight=s.mean_importance_weight,
            mean_version_lag=s.mean_version_lag,
            max_version_lag=int(s.max_version_lag),
            entropy=stats.entropy,
            grad_norm=stats.grad_norm,
            microbatches=stats.microbatches,
            tokens=stats.tokens,
            logprob_gap=self.pb2.LogprobGap(
                tokens=stats.logprob_gap.tokens,
                mean_abs=stats.logprob_gap.mean_abs,
                max_abs=stats.logprob_gap.max_abs,
                kl=stats.logprob_gap.kl,
            ),
            compute_seconds=time.monotonic() - start,
            kl_ref=s.kl_ref,
        )

    def export_weights(self, req: Any) -> Any:
        shard_size: Any = int(req.max_shard_bytes) if req.max_shard_bytes > 0 else "5GB"
        files = export_weights(Path(req.path), self.model, max_shard_size=shard_size)
        return self.pb2.ExportWeightsReply(files=files)

    def load_weights(self, req: Any) -> Any:
        load_weights(self.model, Path(req.path))
        return self.pb2.LoadWeightsReply()

    def save_checkpoint(self, req: Any) -> Any:
        meta = json.loads(req.learner_meta_json) if req.learner_meta_json else {}
        step = int(meta.get("step", 0)) if isinstance(meta, dict) else 0
        save_checkpoint(
            Path(req.path), self.model, self.trainer.optimizer, step, req.learner_meta_json
        )
        return self.pb2.SaveCheckpointReply()

    def load_checkpoint(self, req: Any) -> Any:
        path = Path(req.path)
        meta = read_learner_meta(path)
        load_checkpoint(path, self.model, self.trainer.optimizer)
        return self.pb2.LoadCheckpointReply(learner_meta_json=meta)

    def generate(self, req: Any) -> Any:
        prompts = [[int(t) for t in p.tokens] for p in req.prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise StepError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise StepError(f"prompt {i}: a token id is outside the vocabulary [0, {self.vocab_size})")
            if self.max_positions and len(p) + int(req.max_new_tokens) > self.max_positions:
                raise StepError(
                    f"prompt {i}: {len(p)} tokens + {req.max_new_tokens} new exceed the model's "
                    f"{self.max_positions} positions"
                )
        params = GenerateParams(
            max_new_tokens=int(req.max_new_tokens),
            temperature=float(req.temperature),
            stop_token_ids=frozenset(int(t) for t in req.stop_token_ids),
        )
        seeds = [int(p.seed) for p in req.prompts]
        out = generate(self.model, prompts, seeds, params, self.device, self.pad_id)
        return self.pb2.GenerateReply(completions=[self.pb2.GenerateCompletion(tokens=c) for c in out])

    def shutdown(self, _req: Any) -> Any:
        return self.pb2.ShutdownReply()


def run_everywhere(engine: Engine, name: str, request: Any) -> tuple[Any, str]:
    """Runs a call on this rank; returns (reply, error) with the first
    rank's error (all ranks agree on it)."""
    reply, error = None, ""
    try:
        reply = getattr(engine, name)(request)
    except (StepError, ValueError, FileExistsError, FileNotFoundError) as e:
        error = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the learner, then fatal
        error = f"fatal {type(e).__name__}: {e}\n{traceback.format_exc()}"
    if dist.get_world_size() > 1:
        errors: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    return reply, error


def follow(engine: Engine) -> bool:
    """Ranks other than 0: run what rank 0 broadcasts until shutdown (True)
    or a fatal error (False)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        name, payload = box[0]
        request = getattr(engine.pb2, REQUESTS[name]).FromString(payload)
        _, error = run_everywhere(engine, name, request)
        if error.startswith("fatal"):
            return False
        if name == "shutdown":
            return True


#: The request message of each call, by the name rank 0 broadcasts.
REQUESTS = {
    "describe": "DescribeRequest",
    "train_step": "TrainStepRequest",
    "export_weights": "ExportWeightsRequest",
    "load_weights": "LoadWeightsRequest",
    "save_checkpoint": "SaveCheckpointRequest",
    "load_checkpoint": "LoadCheckpointRequest",
    "generate": "GenerateRequest",
    "shutdown": "ShutdownRequest",
}


def serve(engine: Engine, pb2_grpc: Any, socket_path: Path) -> bool:
    """Serves until Shutdown (True) or a fatal error on a rank (False)."""
    import grpc

    lock = threading.Lock()
    done = threading.Event()
    fatal = threading.Event()

    def handler(name: str) -> Callable[[Any, Any], Any]:
        def call(request: Any, context: Any) -> Any:
            with lock:
                if done.is_set():
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer engine is shutting down")
                if dist.get_world_size() > 1:
                    dist.broadcast_object_list([(name, request.SerializeToString())], src=0)
                reply, error = run_everywhere(engine, name, request)
                if error.startswith("fatal"):
                    fatal.set()
                if name == "shutdown" or error.startswith("fatal"):
                    done.set()
            if error.startswith("fatal"):
                print(f"asyncrl trainer engine: {name} failed: {error}", file=sys.stderr, flush=True)
                context.abort(grpc.StatusCode.INTERNAL, error.splitlines()[0])
            if error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            return reply

        return call

    class Servicer(pb2_grpc.TrainerEngineServicer):
        Describe = staticmethod(handler("describe"))
        TrainStep = staticmethod(handler("train_step"))
        ExportWeights = staticmethod(handler("export_weights"))
        LoadWeights = staticmethod(handler("load_weights"))
        SaveCheckpoint = staticmethod(handler("save_checkpoint"))
        LoadCheckpoint = staticmethod(handler("load_checkpoint"))
        Generate = staticmethod(handler("generate"))
        Shutdown = staticmethod(handler("shutdown"))

    limit = (1 << 31) - 1
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    pb2_grpc.add_TrainerEngineServicer_to_server(Servicer(), server)
    if socket_path.exists():
        socket_path.unlink()
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    print(f"asyncrl trainer engine: serving on {socket_path}", file=sys.stderr, flush=True)
    done.wait()
    server.stop(grace=5).wait()
    return not fatal.is_set()


def check_same_args(args: argparse.Namespace) -> None:
    """Every rank must run the step alike: a node started from another
    config (``asyncrl trainer-node`` reads its own copy) is refused on every
    rank, naming the first option that differs from rank 0's."""
    mine = {k: str(v) for k, v in sorted(vars(args).items()) if k != "socket"}
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0] or {}
    for rank, theirs in enumerate(everyone):
        for key, value in first.items():
            other = (theirs or {}).get(key)
            if other != value:
                option = "--" + key.replace("_", "-")
                raise ConfigError(
                    f"learner.torch: rank {rank} was started with {option}={other}, "
                    f"rank 0 with {option}={value}: every node must run the same config"
                )


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    code = run(args)
    close_process_group()
    return code


def run(args: argparse.Namespace) -> int:
    """Serve (rank 0) or follow until the learner shuts the group down; the
    exit code. The engine is gone when this returns."""
    pb2, pb2_grpc = load_stubs()
    try:
        check_same_args(args)
        engine = Engine(args, pb2)
    except ConfigError as e:
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if dist.get_rank() == 0:
        ok = serve(engine, pb2_grpc, args.socket)
    else:
        ok = follow(engine)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
