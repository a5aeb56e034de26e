"""Build a tiny, randomly initialised Llama and a small BPE tokenizer, entirely offline.

vLLM needs a model directory it can load with ``HF_HUB_OFFLINE=1``; there is no model hub here, so the
tests make one: a 2-layer Llama (hidden 64, 2 heads of head_dim 32 -- vLLM's CPU attention needs a head
size of at least 32) and a byte-level BPE tokenizer trained with ``tokenizers`` on generated text. Both
are deterministic (fixed seed, generated corpus), so two builds give the same weights and vocabulary.

Run with the vLLM venv's python (it has torch, transformers and tokenizers)::

    .venv-vllm/bin/python tests/vllm/tiny_model.py OUT_DIR

It writes ``OUT_DIR/config.json``, weights, ``tokenizer.json`` and ``tokenizer_config.json``, and a marker
``OUT_DIR/.complete`` last, so an interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
MAX_MODEL_LEN = 4096
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def _corpus(n_lines: int = 4000, seed: int = SEED) -> list[str]:
    """Generated English-like text: syllable words, so BPE learns merges deterministically."""
    rng = random.Random(seed)
    syll = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(n_lines)]


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_MODEL_LEN,
    )
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        # Larger than Llama's 0.02 so logits are far apart: greedy outputs must not hinge on rounding
        # differences between a prefix-cache hit and a recomputation.
        initializer_range=0.5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)


def build(out: str | Path, model_builder=None) -> Path:
    """Build the model (``model_builder(out, vocab_size)``, a Llama by default) and its tokenizer into
    ``out`` unless a complete build is already there; returns ``out``."""
    out = Path(out)
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    (model_builder or build_model)(out, vocab)
    (out / ".complete").write_text(json.dumps({"seed": SEED, "vocab_size": vocab}) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    print(build(sys.argv[1]))
