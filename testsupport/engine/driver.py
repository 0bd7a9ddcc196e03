"""One vLLM CPU engine in its own process, driven by the tests over a pipe.

``python -m testsupport.engine.driver MODEL_DIR ANSWER_FD [KV_TRANSFER_CONFIG [ENGINE_JSON]]``
builds a ``vllm.LLM`` of the model made by ``testsupport/engine/model.py`` with prefix caching
and, unless it is ``null``, the kv-transfer config (JSON; ``ENGINE_JSON``: more ``LLM``
arguments, or ones to replace); then reads one JSON command a line on stdin and writes one JSON
answer a line to file descriptor ``ANSWER_FD`` (stdout and stderr are vLLM's log):

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}``: greedy, with the
  chosen token's logprob; answers ``{"outputs": [{"tokens", "logprobs", "cached"}, ...],
  "seconds": S}`` (``cached``: the prompt tokens vLLM did not compute, from its prefix cache or
  the connector; ``seconds``: the ``generate`` call, in this process);
- ``{"op": "reset", "connector": true}``: ``reset_prefix_cache``, which empties the engine's
  prefix cache and, with ``connector`` (the default), vLLM's primary host tier (never
  kvoffload);
- ``{"op": "quit"}``.

The first answer is ``{"ready": true}`` once the engine is built; an engine that fails to start
exits non-zero with the reason in its log.

Imports vLLM inside its functions; it runs only in the engine venv (``.venv-engine``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

BLOCK_SIZE = 128  # tokens per engine block; one block per offloaded chunk
MAX_MODEL_LEN = 2048


def build_engine(
    model: str, kv_config: dict[str, Any] | None, engine: dict[str, Any] | None = None
) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "seed": 0,
        **(engine or {}),
    }
    return LLM(**args, kv_transfer_config=KVTransferConfig(**kv_config) if kv_config else None)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    outputs = []
    for result in results:
        completion = result.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [
            float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs, strict=True)
        ]
        outputs.append(
            {"tokens": tokens, "logprobs": logprobs, "cached": result.num_cached_tokens or 0}
        )
    return outputs


def main(argv: list[str]) -> int:
    model, answer_fd = argv[0], int(argv[1])
    kv_config = json.loads(argv[2]) if len(argv) > 2 else None
    engine = json.loads(argv[3]) if len(argv) > 3 else None
    answers = os.fdopen(answer_fd, "w", buffering=1)

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")

    llm = build_engine(model, kv_config, engine)
    answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            started = time.perf_counter()
            outputs = generate(llm, command["prompts"], command["max_tokens"])
            answer({"outputs": outputs, "seconds": time.perf_counter() - started})
        elif op == "reset":
            connector = bool(command.get("connector", True))
            answer({"reset": bool(llm.reset_prefix_cache(reset_connector=connector))})
        elif op == "quit":
            break
        else:
            answer({"error": f"unknown op {op!r}"})
    answer({"bye": True})
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a process of its own (spawn)
    sys.exit(main(sys.argv[1:]))
