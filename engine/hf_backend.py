"""Eager Hugging Face backend: the exact reference, on any device, with plain forward hooks.

Kept deliberately simple (right-padded micro-batches, hooks on the decoder layers) because every
other backend is checked against it. resid_post is the decoder layer's output: for the last layer
that is the stream *before* the final norm, which `output_hidden_states[-1]` is not.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from .capture import blocks
from .addresses import Address, POINTS, parse_addresses
from harvest.engine.capture.captured import CapturedRequest
from .checkpoint import read_model_info, validate_tokens
from .protocol import DestinationProvider, StepStats
from harvest.engine.capture.taps import check_supported, find_layers


class HFModel:
    """A harvest.engine.protocol.CaptureEngine on a Hugging Face model. A step is one padded
    micro-batch forward of at most `max_num_batched_tokens` tokens, padding included."""

    backend = "eager"
    mode = "eager"
    frozen = None
    accepts_destinations = False  # rows come from the hooks' own tensors

    def __init__(self, name_or_path: str, *, dtype: str = "bfloat16", device: str | None = None,
                 revision: str | None = None, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, **unused):
        from transformers import AutoModelForCausalLM

        self.info = read_model_info(name_or_path, revision)
        self.name, self.revision = name_or_path, revision
        self.n_layers, self.width = self.info.n_layers, self.info.width
        self.max_model_len = min(max_model_len or self.info.max_position, self.info.max_position)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            name_or_path, revision=revision, dtype=self.dtype).to(self.device).eval()
        layers = find_layers(self.model, self.n_layers)
        self.trunk = blocks.Trunk(layers, [blocks.hf_semantics(layer) for layer in layers])
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.steps = self.scheduled_tokens = 0
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.name, revision=self.revision)
        return self._tokenizer

    def describe(self) -> dict:
        import transformers

        return {"model": self.name, "revision": self.revision, "backend": "eager", "mode": "eager",
                "dtype": str(self.dtype).replace("torch.", ""), "n_layers": self.n_layers,
                "width": self.width,
                "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}

    def _hooks(self, pts: tuple[Address, ...], store: dict):
        """Same stream and sub-module rules as the vLLM taps (engine/capture/blocks.py), so a point one
        backend refuses the other refuses too."""
        check_supported(self.trunk, pts)
        handles = []
        for a in pts:
            layer, sem = self.trunk[a.layer], self.trunk.semantics[a.layer]
            if a.name == "resid_pre":
                def pre(mod, args, kwargs, a=a, sem=sem):
                    store[a] = sem.stream.get(args, kwargs)
                handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            elif a.name == "resid_post":
                def post(mod, args, out, a=a):
                    store[a] = blocks.first_or_tensor(out)
                handles.append(layer.register_forward_hook(post))
            else:
                def sub(mod, args, out, a=a):
                    store[a] = blocks.sublayer_value(out)
                handles.append(self.trunk.sublayer(a).register_forward_hook(sub))
        return handles

    def _batches(self, source):
        batch, longest = [], 0
        for item in source:
            n = len(item[1])
            if batch and max(longest, n) * (len(batch) + 1) > self.max_num_batched_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(item)
            longest = max(longest, n)
        if batch:
            yield batch

    def step_stats(self) -> StepStats:
        return {"steps": self.steps, "scheduled_tokens": self.scheduled_tokens,
                "max_num_batched_tokens": self.max_num_batched_tokens}

    def capture(self, batches: Iterable[Sequence[Sequence[int]]], points=None,
                destinations: DestinationProvider | None = None) -> Iterator[CapturedRequest]:
        if destinations is not None:  # at the call, not at the first row
            raise ValueError("the eager backend yields rows in its own tensors: destinations are "
                             "not supported (accepts_destinations is False)")
        return self._capture(batches, points)

    @torch.inference_mode()
    def _capture(self, batches, points) -> Iterator[CapturedRequest]:
        if points is None:
            points = [Address("resid_post", i) for i in range(self.n_layers)]
        pts = parse_addresses([points] if isinstance(points, (str, Address)) else points, self.n_layers)
        for a in pts:
            if a.name not in POINTS:
                raise ValueError(f"{a}: this trunk has a single residual stream")
        source = ((i, validate_tokens(t, self.max_model_len, self.info.vocab_size))
                  for i, t in enumerate(t for b in batches for t in b))
        store: dict = {}
        handles = self._hooks(pts, store)
        try:
            for mb in self._batches(source):
                longest = max(len(ids) for _, ids in mb)
                ids = torch.zeros(len(mb), longest, dtype=torch.long)
                mask = torch.zeros(len(mb), longest, dtype=torch.long)
                for j, (_, t) in enumerate(mb):
                    ids[j, : len(t)] = torch.from_numpy(t.astype(np.int64))
                    mask[j, : len(t)] = 1
                self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           use_cache=False)
                self.steps += 1
                self.scheduled_tokens += sum(len(t) for _, t in mb)
                stacked = torch.stack([store[a] for a in pts]).to("cpu")  # [P, B, T, W]
                for j, (index, t) in enumerate(mb):
                    acts = stacked[:, j, : len(t)].contiguous()
                    yield CapturedRequest(index, t, np.arange(len(t), dtype=np.int32), pts, acts)
        finally:
            for h in handles:
                h.remove()

    def close(self) -> None:
        self.model = None
