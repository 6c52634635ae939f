"""Reference data from Hugging Face transformers for asyncrl-policy's tests.

Two subcommands:

  generate OUT_DIR
      Trains a small byte-level BPE tokenizer (the `tokenizers` library) on a
      few lines of text, builds tiny random Qwen2 and Llama models, saves them
      with `save_pretrained` under OUT_DIR/<name>/ (Qwen2 sharded with a small
      max_shard_size, so that the index-file path is exercised) and writes
      OUT_DIR/reference.json with, per model, fixed input ids and the float32
      logits transformers computes for them, plus tokenizer encodings of a few
      strings.

  logits REQUEST_JSON OUT_JSON
      REQUEST_JSON = {"dir": MODEL_DIR, "input_ids": [[...]], "strings": [...]}.
      Opens MODEL_DIR with AutoModelForCausalLM / AutoTokenizer (as a user of
      transformers would) and writes {"logits": ..., "encoded": ..., "decoded": ...}.

Run with the project venv's Python; needs torch and transformers.
"""

import json
import os
import sys

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Asynchronous reinforcement learning keeps the learner busy.",
    "37+58=95 and 12*12=144, 100-1=99.",
    "sort: 5 3 9 1 -> 1 3 5 9",
    "Rollout workers generate while the learner trains on stale samples.",
    "naïve café ☕ — unicode text, déjà vu.",
    "def f(x):\n    return x * 2\n",
]

STRINGS = [
    "The quick brown fox",
    "37+58=95",
    "  leading spaces and\ttabs\nnewline",
    "naïve café ☕",
    "unseen words: zyxwv qqq",
    "",
]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 3, trainer)
    # Llama-style: the post-processor prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def randomize(model, seed):
    """Moves every parameter away from its default init (norm weights 1,
    biases 0), so that each of them matters in the comparison."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def models(vocab, bos, eos, pad):
    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    yield (
        "qwen2_sharded",
        Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=64,
                intermediate_size=112,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_theta=10000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                max_position_embeddings=256,
                **common,
            )
        ),
        "40KB",
    )
    yield (
        "llama_untied",
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=48,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=6,
                num_key_value_heads=2,
                rope_theta=500000.0,
                rms_norm_eps=1e-5,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
                max_position_embeddings=256,
                **common,
            )
        ),
        None,
    )
    yield (
        "llama_tied_llama3rope",
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=80,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=16,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                max_position_embeddings=256,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                **common,
            )
        ),
        None,
    )


def logits_of(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long))
    return out.logits.float().tolist()


def generate(out_dir):
    torch.manual_seed(0)
    tokenizer = train_tokenizer()
    vocab = len(tokenizer)
    bos, eos, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>"))
    text_ids = tokenizer("Rollout workers generate 37+58=95 while the learner trains")["input_ids"][:14]
    g = torch.Generator().manual_seed(1)
    random_ids = torch.randint(0, vocab, (len(text_ids),), generator=g).tolist()
    input_ids = [text_ids, random_ids]
    reference = {"transformers_version": transformers.__version__, "models": {}}
    for seed, (name, model, shard) in enumerate(models(vocab, bos, eos, pad)):
        model = model.float().eval()
        randomize(model, seed + 10)
        path = os.path.join(out_dir, name)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(path, **kwargs)
        tokenizer.save_pretrained(path)
        reference["models"][name] = {"input_ids": input_ids, "logits": logits_of(model, input_ids)}
    reference["tokenizer"] = {
        "strings": STRINGS,
        "ids_with_special": [tokenizer(s)["input_ids"] for s in STRINGS],
        "ids": [tokenizer(s, add_special_tokens=False)["input_ids"] for s in STRINGS],
        "decoded": [
            tokenizer.decode(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in STRINGS
        ],
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)


def logits(request_path, out_path):
    with open(request_path) as f:
        req = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(req["dir"], dtype=torch.float32).eval()
    out = {"logits": logits_of(model, req["input_ids"]), "class": type(model).__name__}
    strings = req.get("strings") or []
    if strings:
        tok = AutoTokenizer.from_pretrained(req["dir"])
        encoded = [tok(s, add_special_tokens=False)["input_ids"] for s in strings]
        out["encoded"] = encoded
        out["decoded"] = [tok.decode(ids) for ids in encoded]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "generate":
        generate(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
