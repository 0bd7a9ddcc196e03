"""A small Llama made on the spot: a ``config.json``, a WordLevel tokenizer built with
``tokenizers`` and seeded random weights in a safetensors file. No download. ``TINY`` (the
tests': 4.4 M parameters, 18 MB) or any other ``Dims`` (``bench/engine_e2e.py``'s is larger, so
that a prefill costs something on a CPU).

The weights are drawn from a seeded generator at scales that keep activations near 1, with the
query and key projections scaled up so that attention is sharp (each position attends to a few
others): a wrong byte in a loaded KV block then changes the next token's distribution, which the
tests compare bit for bit. ``tokenizers`` and ``safetensors`` come with vLLM and are imported by
name, so this module loads without them.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DTYPE_BYTES = 4  # float32
SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class Dims:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 4096
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


TINY = Dims()


def kv_bytes_per_token(dims: Dims = TINY) -> int:
    """KV bytes of one token, all layers: K and V of every KV head."""
    return 2 * dims.kv_heads * dims.head_dim * DTYPE_BYTES * dims.layers


def config(dims: Dims = TINY) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": dims.max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def weights(seed: int, dims: Dims = TINY) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim

    def linear(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        drawn: np.ndarray = rng.standard_normal((out, inp), dtype=np.float32)
        return (drawn * np.float32(gain / np.sqrt(inp))).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((dims.vocab, hidden), dtype=np.float32),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
        "lm_head.weight": linear(dims.vocab, hidden, 4.0),
    }
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden, 3.0)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden, 3.0)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = linear(dims.intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = linear(dims.intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = linear(hidden, dims.intermediate)
    return tensors


def write_tokenizer(directory: Path, dims: Dims = TINY) -> None:
    tokenizers = importlib.import_module("tokenizers")
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), dims.vocab)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": dims.max_positions,
            }
        )
    )


def build(directory: Path, seed: int = 0, dims: Dims = TINY) -> Path:
    """Write the model into ``directory`` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(dims), indent=1))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2})
    )
    write_tokenizer(directory, dims)
    save_file = importlib.import_module("safetensors.numpy").save_file
    save_file(weights(seed, dims), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def prompt(seed: int, length: int, dims: Dims = TINY) -> list[int]:
    """``length`` token ids (no special token), the same for the same seed."""
    rng = np.random.default_rng(1_000_003 + seed)
    return [int(t) for t in rng.integers(len(SPECIALS), dims.vocab, size=length)]
