"""Tiny random Hugging Face models of the architectures users train, for
tests: Llama, Qwen3, Gemma 3 (text) and Qwen3-MoE at a few thousand
parameters each, with a tokenizer taken from another model folder (the
built-in model's character tokenizer, say) so that any task can run on
them.

    python -m asyncrl_trainer.tiny --arch qwen3 --tokenizer-from DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

#: The architectures, by Hugging Face ``model_type``, with their extra keys.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma3_text": {
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 32,
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    },
}

#: Files a tokenizer folder may hold.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def write(arch: str, tokenizer_from: Path, out: Path, seed: int = 0) -> Path:
    """A random model of ``arch`` in ``out``, its vocabulary and special
    tokens those of the model folder ``tokenizer_from``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; one of {sorted(ARCHITECTURES)}")
    source = json.loads((tokenizer_from / "config.json").read_text(encoding="utf-8"))
    special = {
        k: source[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if source.get(k) is not None
    }
    config = AutoConfig.for_model(
        arch,
        vocab_size=int(source["vocab_size"]),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs 32 or more
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **special,
        **ARCHITECTURES[arch],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def write_from_config(config: dict[str, Any], out: Path, seed: int = 0) -> Path:
    """A random model of a whole ``config.json`` (real shapes: the GPU
    check), weights N(0, 0.02) saved in bf16, with no tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    fields.pop("torch_dtype", None)
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl_trainer.tiny")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES))
    p.add_argument("--tokenizer-from", type=Path)
    p.add_argument("--config-json", type=Path, help="a whole config.json instead of --arch")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.config_json is not None:
        write_from_config(json.loads(args.config_json.read_text(encoding="utf-8")), args.out, args.seed)
        return 0
    if args.arch is None or args.tokenizer_from is None:
        p.error("--arch and --tokenizer-from are needed (or --config-json)")
    write(args.arch, args.tokenizer_from, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
