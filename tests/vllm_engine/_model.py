"""A tiny random Llama saved to disk: no download is possible here, and greedy decoding on a
2-layer model with scaled random weights gives clear-cut, reproducible tokens."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 1000
WEIGHT_SCALE = 20.0


def build_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Write a 2-layer Llama (hidden 64, 4 heads of 32, 2 KV heads, vocab 1000, fp32) into
    ``directory`` unless it is already there; returns the directory."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the CPU attention backend accepts 32, 64, 80, ...
        max_position_embeddings=1024,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Scaled random weights make each greedy choice clear-cut (no near-ties that could
        # flip between two correct runs).
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
