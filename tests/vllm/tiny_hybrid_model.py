"""Build a tiny, randomly initialised Gemma-3 (one sliding-window and one full-attention layer), offline.

vLLM gives such a model two KV cache groups in one block pool (a full-attention group and a
sliding-window group), which is what tests/vllm/test_hybrid.py serves kvprof's policy on. Same
tokenizer, sizes and determinism as :mod:`tiny_model` (head_dim 32 for vLLM's CPU attention); the
window is 64 tokens, two of the tests' 32-token blocks. Run with the vLLM venv's python::

    .venv-vllm/bin/python tests/vllm/tiny_hybrid_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from tiny_model import MAX_MODEL_LEN, SEED, build

SLIDING_WINDOW = 64


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(SEED)
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.5,  # logits far apart, as tiny_model's: greedy outputs must not hinge on rounding
        bos_token_id=0, eos_token_id=1, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32",
    )
    Gemma3ForCausalLM(config).to(torch.float32).eval().save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_hybrid_model.py OUT_DIR")
    print(build(sys.argv[1], build_model))
