"""Checkpoints and weights of the torch engine.

- :func:`save_checkpoint` / :func:`load_checkpoint`: the model and AdamW
  state as a sharded torch distributed checkpoint (DCP: every rank writes
  its own shards), and the step it was taken after. A checkpoint is
  written into a temporary folder and renamed into place once every rank
  has written (rank 0 renames), so a kill mid-write leaves the previous one
  and a folder to ignore, never a half-written checkpoint under the final
  name. DCP reshards on load: a checkpoint of world size 2 loads at 1.
- :func:`export_weights`: the full weights as a Hugging Face model folder
  (``config.json``, safetensors sharded with an index above
  ``max_shard_size``), with a ``sha256`` file per weight file, written the
  same way (temporary folder, then rename) by rank 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

#: The file beside the DCP shards that names the step (written last).
STEP_FILE = "asyncrl_step.json"
#: The file of an exported folder that lists each weight file's sha256.
SHA256_FILE = "sha256.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    learner_meta: str = "",
) -> None:
    """Every rank calls it. ``path`` must not exist yet. ``learner_meta``:
    the learner's own record of the checkpoint (JSON text), kept in the
    step file and given back by :func:`read_learner_meta`."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"checkpoint {path} exists already")
    tmp = _tmp(path)
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # a write that was killed
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        (tmp / STEP_FILE).write_text(
            json.dumps({"step": step, "learner_meta": learner_meta}), encoding="utf-8"
        )
        _fsync_file(tmp / STEP_FILE)
        _fsync_dir(tmp)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    _barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank calls it; returns the step the checkpoint was taken after."""
    path = Path(path)
    step_file = path / STEP_FILE
    if not step_file.is_file():
        raise FileNotFoundError(f"{path} is no complete checkpoint (no {STEP_FILE})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(json.loads(step_file.read_text(encoding="utf-8"))["step"])


def read_learner_meta(path: Path) -> str:
    """The ``learner_meta`` a complete checkpoint was saved with."""
    step_file = Path(path) / STEP_FILE
    if not step_file.is_file():
        raise FileNotFoundError(f"{path} is no complete checkpoint (no {STEP_FILE})")
    return str(json.loads(step_file.read_text(encoding="utf-8")).get("learner_meta", ""))


def load_weights(model: nn.Module, path: Path) -> None:
    """Every rank calls it: replaces the weights with a Hugging Face folder's
    (``model.safetensors`` or the shards its index lists, as
    :func:`export_weights` writes). transformers reads the files, so a
    layout it converts on save and load (fused MoE experts, say) comes back
    as the model holds it; every parameter must be there."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "model.safetensors.index.json").is_file() and not (
        path / "model.safetensors"
    ).is_file():
        raise FileNotFoundError(f"{path} holds no model.safetensors and no index")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} is no Hugging Face model (no config)")
    dtype = next(model.parameters()).dtype
    if (path / "config.json").is_file():
        loaded = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    else:
        # Published weights alone (the object store's one file): transformers
        # reads a folder with its config, so the weights get the model's.
        import tempfile

        with tempfile.TemporaryDirectory(prefix="asyncrl-load-") as tmp:
            for f in path.iterdir():
                if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
                    os.symlink(f.resolve(), Path(tmp) / f.name)
            config.save_pretrained(tmp)
            loaded = AutoModelForCausalLM.from_pretrained(tmp, config=config, dtype=dtype)
    full = {k: v.detach() for k, v in loaded.state_dict().items()}
    expected = set(get_model_state_dict(model).keys())
    missing = sorted(expected - full.keys())
    unknown = sorted(full.keys() - expected)
    if missing or unknown:
        raise ValueError(
            f"the weights in {path} do not fit the model: missing {missing[:5]}, "
            f"unknown {unknown[:5]}"
        )
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def export_weights(
    path: Path, model: nn.Module, max_shard_size: "str | int" = "5GB"
) -> list[str]:
    """Every rank calls it; rank 0 writes the Hugging Face folder ``path``
    (which must not exist yet). Returns the safetensors files (rank 0)."""
    path = Path(path)
    # Checked by every rank before the collective below, so that no rank
    # waits for one that gave up.
    if path.exists():
        raise FileExistsError(f"weights folder {path} exists already")
    pretrained = getattr(model, "save_pretrained", None)
    if pretrained is None:
        raise TypeError(f"{type(model).__name__} is no Hugging Face model (no save_pretrained)")
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() == 0:
        tmp = _tmp(path)
        if tmp.exists():
            shutil.rmtree(tmp)
        pretrained(tmp, state_dict=full, max_shard_size=max_shard_size)
        sums = {
            f.name: _sha256(f)
            for f in sorted(tmp.iterdir())
            if f.suffix == ".safetensors"
        }
        (tmp / SHA256_FILE).write_text(json.dumps(sums, indent=1), encoding="utf-8")
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    _barrier()
    return sorted(sums) if _rank() == 0 else []


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
