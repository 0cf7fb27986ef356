"""The `capture.generate` config section: its settings (GenerateConfig) and its YAML parsing.

A config section, like those in pipeline/config/sections.py and pipeline/config/corpus.py: it
imports only the config helpers, never the runtime modules that use it. It lived in
pipeline/actor/generation.py (the slots' rows), whose imports (chat -> data -> config) made loading a
config an import cycle (config -> sections -> generation -> ... -> config); the runtime side
(pipeline/actor/generation.py: Slots, engine_params, resolved_stop) imports this module, one way.
Behaviour and messages are those of the section before the move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .fields import ConfigError, check_bool, check_float, check_int
from .yamltext import unknown_msg

# The `sample` column is int16 (store/format/layout.py): more samples per prompt would not fit it.
MAX_SAMPLES = (1 << 15) - 1


@dataclass(frozen=True)
class GenerateConfig:
    """`capture.generate`: complete each context's prompt and capture the generated tokens too.

    The prompt is the first `packing.context_size - n * max_new_tokens` tokens of each context
    (chat: the conversation, at most that long). `n` samples per prompt. `stop` lists token ids
    (the engine feeds ids and never detokenizes); `stop_at_eos` adds the model's EOS ids and,
    with chat input, the template's end-of-turn token (resolved_stop). `keep_prompt: false`
    keeps the prompt's token ids but not its activations.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: list = field(default_factory=list)
    stop_at_eos: bool = True
    keep_prompt: bool = True

    def validate(self, context_size: int | None = None) -> None:
        w = "capture.generate."
        check_int(w + "max_new_tokens", self.max_new_tokens, 1)
        check_float(w + "temperature", self.temperature, 0.0, 100.0)
        check_float(w + "top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ConfigError(f"{w}top_p must be > 0 (1 keeps the whole distribution)")
        check_int(w + "n", self.n, 1, hi=MAX_SAMPLES)
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(
                f"{w}n={self.n} with temperature 0: greedy decoding samples the same text n "
                "times; set capture.generate.temperature > 0 or n: 1")
        check_int(w + "seed", self.seed, 0, optional=True, hi=(1 << 31) - 1)
        if not isinstance(self.stop, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop):
            raise ConfigError(
                f"{w}stop={self.stop!r} must be a list of token ids such as [2, 13]; the engine "
                "feeds token ids and does not detokenize, so stop strings are not supported: "
                "tokenize the string and list its ids")
        check_bool(w + "stop_at_eos", self.stop_at_eos)
        check_bool(w + "keep_prompt", self.keep_prompt)
        if context_size is not None and self.n * self.max_new_tokens >= context_size:
            raise ConfigError(
                f"{w}n={self.n} x max_new_tokens={self.max_new_tokens} leaves no prompt in a "
                f"packing.context_size={context_size} slot (prompt = context_size - n * "
                "max_new_tokens; each sample has a region of max_new_tokens rows): raise "
                "packing.context_size or lower capture.generate.n or max_new_tokens")

    def prompt_len(self, context_size: int) -> int:
        """P: the prompt's rows in a slot (chat: the most a conversation may have)."""
        return context_size - self.n * self.max_new_tokens

    def describe(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "n": self.n, "seed": self.seed, "stop": list(self.stop),
                "stop_at_eos": self.stop_at_eos, "keep_prompt": self.keep_prompt}


def from_section(value) -> GenerateConfig | None:
    """`capture.generate` as YAML gives it (None, a mapping, or already a GenerateConfig)."""
    if value is None or isinstance(value, GenerateConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"capture.generate must be a mapping such as {{max_new_tokens: 32}}, "
                          f"got {value!r}")
    names = list(GenerateConfig.__dataclass_fields__)
    for k in value:
        if k not in names:
            raise ConfigError(unknown_msg(k, names, "capture.generate."))
    return GenerateConfig(**value)
