"""Chat-template reference from Hugging Face transformers for asyncrl-text's
chat parity test (text/tests/chat_parity.rs).

Usage: chat_reference.py MODEL_DIR MESSAGES_JSON

Opens MODEL_DIR with AutoTokenizer.from_pretrained (as a user of
transformers would) and, for each message list of MESSAGES_JSON (a JSON list
of {"name": ..., "tools": [...] (optional), "messages": [{"role": ...,
"content": ..., and optionally "tool_calls", "tool_call_id", "name",
"reasoning_content"}, ...]}), applies the model's chat template with the
case's tools (tools=None when the case has none) and the generation prompt
twice: as text (tokenize=False) and as token ids
(tokenize=True). Prints one JSON object on stdout:

  {"transformers_version": "...",
   "tokenizer_class": "...",
   "cases": [{"text": "...", "ids": [...]} or {"error": "..."}, ...]}

with one case per message list, in order.

A message list for which transformers raises (an empty list, a template's
raise_exception) gets {"error": "<exception type>: <message>"}; the Rust side
must then fail as well.

Run with the project venv's Python (scripts/setup installs transformers).
"""

import json
import sys

import transformers
from transformers import AutoTokenizer


def ids_of(out):
    """The token ids of apply_chat_template(..., tokenize=True): a list in
    transformers 4.x, a BatchEncoding (dict-like, with input_ids) in 5.x."""
    if isinstance(out, list):
        return [int(i) for i in out]
    ids = out["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def reference(tokenizer, messages, tools):
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = ids_of(
            tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
        )
    except Exception as e:  # noqa: BLE001 - every failure is a reference outcome
        return {"error": f"{type(e).__name__}: {e}"}
    return {"text": text, "ids": ids}


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} MODEL_DIR MESSAGES_JSON")
    model_dir, messages_path = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(messages_path, encoding="utf-8") as f:
        cases = json.load(f)
    out = {
        "transformers_version": transformers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "cases": [reference(tokenizer, case["messages"], case.get("tools")) for case in cases],
    }
    json.dump(out, sys.stdout, ensure_ascii=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
