"""PyTorch eager reference for asyncrl-learner's learner bench.

Usage: torch_eager.py REQUEST_JSON

REQUEST_JSON = {"model_dir": DIR, "rows": N, "seq_len": L, "iterations": I,
                "warmup": W, "threads": T, "seed": S, "lr": LR, "max_grad_norm": G}

Opens DIR (written by the Rust side with `save_pretrained`) with
`AutoModelForCausalLM` in float32 on the CPU and times, per iteration, the
same step as the Rust side (learner/src/bench.rs):

  logits = model(input_ids).logits                     # [N, L, V], float32
  logp   = log_softmax(logits).gather(targets)         # [N, L]
  ratio  = exp(logp - logp.detach())                   # PPO ratio at c = p
  loss   = -(ratio * advantages).mean()
  loss.backward(); clip_grad_norm_(G); AdamW.step(); zero_grad()

Inputs (ids, targets, advantages) are drawn once from torch's generator
seeded with S; only the shapes matter for throughput. Prints one JSON line:
{"tokens_per_s": ..., "seconds": ..., "median_step_s": ..., "params": ...,
 "threads": ..., "torch": ..., "transformers": ..., "attn_implementation": ...}
"""

import json
import statistics
import sys
import time


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        req = json.load(f)
    import torch

    torch.set_num_threads(int(req["threads"]))
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32)
    model.train()
    n, seq, iters = int(req["rows"]), int(req["seq_len"]), int(req["iterations"])
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(int(req["seed"]))
    ids = torch.randint(0, vocab, (n, seq), generator=gen)
    targets = torch.randint(0, vocab, (n, seq), generator=gen)
    adv = torch.randn((n, seq), generator=gen)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=float(req["lr"]),
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    )
    max_norm = float(req["max_grad_norm"])

    def step() -> None:
        logits = model(input_ids=ids, use_cache=False).logits.float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * adv).mean()
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(int(req["warmup"])):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    total = sum(times)
    print(
        json.dumps(
            {
                "tokens_per_s": n * seq * iters / total if total > 0 else 0.0,
                "seconds": total,
                "median_step_s": statistics.median(times),
                "params": sum(p.numel() for p in model.parameters()),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
            }
        )
    )


if __name__ == "__main__":
    main()
