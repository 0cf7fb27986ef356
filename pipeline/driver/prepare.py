"""Preparation in the driver, without Ray, an engine or reading the corpus: model facts, capture
points, tokenizer facts, the layout and the corpus's blocks (from metadata only).

Everything here is cheap and checks input, so a bad config fails in seconds and before anything
is written: the model's config and tokenizer, context size against the model's limit, capture
addresses against its layers, the data source's existence and text column, and that the corpus
can fill one context (pipeline/data/check.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config.fields import ConfigError
from ..config.run import HarvestConfig
from ..config.sections import ModelConfig
from ..data.packing import resolve_bos
from .unit_sizes import Layout, choose_layout
from ..config.sections import CaptureConfig
from ..data.check import check_fills_context, probe_text_column
from ..data.corpus_blocks import plan_blocks
from ..data.documents import resolve_source
from ..data.tokenize import chat_prompt_tokens
from ...store import SINK_POSITIONS

if TYPE_CHECKING:
    from ...engine.addresses import Address
    from ..data.documents import ResolvedSource


def resolve_model_path(path: str) -> str:
    """`smollm2` and `tiny:<arch>` aliases -> checkpoint dirs (built once); others unchanged.
    One resolver for configs, the CLI and `harvest.engine.load_model` (engine.models.resolve_model)."""
    from ...engine.models import resolve_model

    try:
        return resolve_model(path)
    except ValueError as e:
        raise ConfigError(f"model.path={path!r}: {e}") from None


def resolve_points(capture: CaptureConfig, n_layers: int, info=None) -> "tuple[Address, ...]":
    """The config's points, parsed once when it was validated (`capture.parsed`), as Addresses:
    `name.*` expanded, every layer range-checked against the model, duplicates dropped, and
    (given the model's `info`) each point checked to exist in it (router_logits on a dense
    model, mlp_act on a MoE one are refused by name). Errors name the field."""
    from ...engine.addresses import Address
    from ...engine.points import BY_NAME, MODEL_LEVEL

    parsed = getattr(capture, "parsed", None)
    if parsed is None:
        raise ConfigError("capture: this config was not validated (build it with load_config "
                          "or from_dict, or call .validate()), so capture.points are not parsed")
    out: list[Address] = []
    try:
        for name, layer in parsed:
            if layer is None:   # `name.*`: every layer (model-level points: the one, `.0`)
                layers = [0] if name in MODEL_LEVEL else range(n_layers)
            else:
                layers = [layer]
            for li in layers:
                if li >= n_layers:
                    raise ValueError(f"address {name}.{li} is out of range: the model has "
                                     f"layers 0..{n_layers - 1}")
                a = Address(name, li)
                if a not in out:
                    out.append(a)
    except ValueError as e:
        raise ConfigError(f"capture.points: {e}") from None
    if info is not None:
        experts = dict(info.kinds).get("experts")
        for name in dict.fromkeys(a.name for a in out):
            spec = BY_NAME.get(name)
            if spec is not None and spec.moe is False and experts:
                raise ConfigError(
                    f"capture.points: {name} is a dense MLP's point ({spec.meaning}) and "
                    f"{info.architecture} has MoE blocks ({experts} experts): capture "
                    "router_logits or mlp_in/mlp_out there")
            try:
                info.point_width(name)
            except ValueError as e:
                raise ConfigError(f"capture.points: {e}; drop {name} from capture.points") from None
    return tuple(out)


def model_facts(model: ModelConfig) -> tuple[str, Any]:
    """(the resolved checkpoint path, its config as read_model_info reads it) of `model`."""
    from ...engine.checkpoint import read_model_info

    path = resolve_model_path(model.path)
    try:
        info = read_model_info(path)
    except Exception as e:
        raise ConfigError(
            f"model.path={model.path!r}: cannot read its config ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); give a checkpoint dir, a hub name, "
            "smollm2 or tiny:<arch>"
        ) from None
    if model.tensor_parallel_size > 1:
        check_model_tp(model, path)
    return path, info


def check_model_tp(model: ModelConfig, path: str) -> None:
    """model.tensor_parallel_size against the model's config (heads, KV heads, MLP width,
    vocabulary as vLLM splits them), before Ray or an engine starts."""
    from transformers import AutoConfig

    from ...engine.parallel import check_tp_fits

    try:
        check_tp_fits(model.tensor_parallel_size,
                      AutoConfig.from_pretrained(path).to_dict(),
                      "model.tensor_parallel_size", repr(model.path))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def context_limit(model: ModelConfig, info) -> int:
    limit = min(model.max_model_len or info.max_position, info.max_position)
    # vLLM generates one token per request, so a prompt may use at most max_model_len - 1
    return limit - 1 if model.backend == "vllm" else limit


@dataclass
class Prepared:
    """What `prepare` found and decided, the facts the rest of the driver reads (not the config:
    each consumer gets its section of that from the driver)."""

    context_size: int      # packing.context_size
    store_dtype: str       # the point arrays' dtype (HarvestConfig.store_dtype)
    content_key: dict      # HarvestConfig.content_key(): what decides the store's rows
    model_path: str
    n_layers: int
    width: int
    vocab_size: int
    max_len: int
    points: list[str]      # str(a) of `addresses`: the store's point names
    bos_token_id: int | None
    special_token_ids: list[int]
    sources: dict          # {"kind", "description", "blocks": [[segment...]...]}
    layout: Layout
    stats_skip_positions: int
    seconds: float
    token_source: "dict | None" = None  # data.tokens_column: what check_token_source found
    addresses: tuple = ()   # the capture points as parsed Addresses (engine.addresses), in order
    widths: "dict | None" = None   # point -> its width in this model (engine/points.py)
    prompt_tokens: "int | None" = None  # chat input with capture.generate: tokenize.chat_prompt_tokens
    scores: tuple = ()   # logprob / entropy asked: store row columns, not points (split_scores)
    source: "ResolvedSource | None" = None   # data.source resolved once for a new store (None: a resume)
    values: "dict | None" = None   # point -> "int32"/"float32": points of 32-bit values

    @property
    def max_width(self) -> int:
        """The widest point's width (never below the model's): block buffers are this wide."""
        return max([self.width, *(self.widths or {}).values()])

    def point_bytes(self) -> dict:
        """point -> bytes of one stored row of it (its own width; fp8: + the scale)."""
        from ...store import row_width

        return {p: row_width(self.store_dtype, (self.widths or {}).get(p, self.width))
                * self.itemsize for p in self.points}

    @property
    def itemsize(self) -> int:
        """Bytes of one stored element (fp8 stores: 1)."""
        return stored_itemsize(self.store_dtype)

    @property
    def row_width(self) -> int:
        """Stored columns per buffer row of a point (the widest point's; fp8: + 4 scale bytes)."""
        from ...store import row_width

        return row_width(self.store_dtype, self.max_width)

    def run_key(self) -> dict:
        """What the store remembers about the run, to refuse a mismatched resume."""
        return {"content": self.content_key, "points": self.points,
                "context_size": self.context_size}


def stored_itemsize(store_dtype: str) -> int:
    """Bytes per stored element of a store of dtype `store_dtype`."""
    return {"float32": 4, "float8_e4m3fn": 1}.get(store_dtype, 2)


def prepare(cfg: HarvestConfig, existing=None) -> Prepared:
    """Everything the run needs before Ray starts; `existing` is a store being resumed (its
    layout and recorded blocks win over what the config would choose now)."""
    t0 = time.perf_counter()
    model_path, info = model_facts(cfg.model)
    addresses, scores = split_scores(resolve_points(cfg.capture, info.n_layers, info))
    points = [str(a) for a in addresses if a.name not in scores]
    # a point of 32-bit values (expert_indices/_weights) is its values' bits in the engine dtype
    widths = {str(a): info.row_width(a.name, cfg.model.dtype) for a in addresses
              if a.name not in scores}
    values = point_values(cfg, addresses, scores)
    limit = context_limit(cfg.model, info)
    C = cfg.packing.context_size
    if C > limit:
        raise ConfigError(
            f"packing.context_size={C} is larger than the model's limit of {limit} tokens per "
            f"context ({cfg.model.path}: max_position {info.max_position}"
            + (", minus 1 for vLLM's generated token" if cfg.model.backend == "vllm" else "")
            + f"): set packing.context_size <= {limit}"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    bos = resolve_bos(cfg.packing, tokenizer)
    if bos is not None and not 0 <= bos < info.vocab_size:
        raise ConfigError(f"packing.bos_token_id={bos} is outside the model's vocabulary "
                          f"(0..{info.vocab_size - 1}): use a token id the model knows")
    special = sorted({int(t) for t in (getattr(tokenizer, "all_special_ids", None) or [])}
                     | ({bos} if bos is not None else set()))
    if cfg.data.format == "chat":  # before Ray: a template that cannot be used stops here
        from ..data.chat import check_template, pad_token_id

        check_template(tokenizer, repr(cfg.model.path))
        special = sorted(set(special) | {pad_token_id(tokenizer)})
    prompt_tokens = chat_prompt_tokens(cfg.capture.generate, cfg.data, C)
    skip = cfg.store.stats_skip_positions
    if skip is None:  # the first context positions are attention sinks whatever the token
        skip = SINK_POSITIONS
    itemsize = stored_itemsize(cfg.store_dtype())
    stored_sources = None
    stored_layout = None
    token_source = None
    if existing is not None:
        stored_sources = existing.ledger.plans.read_sources()
        if stored_sources is not None:
            stored_layout = (existing.shard_rows, existing.chunk_rows, int(stored_sources["unit_rows"]))
    from ...store import row_width

    # one shard size for every point (units are shard-aligned), sized for the widest
    layout = choose_layout(cfg.store, cfg.packing, cfg.ray.num_actors,
                           row_width(cfg.store_dtype(), max([info.width, *widths.values()])),
                           itemsize, len(points), stored_layout)
    if existing is not None and stored_layout is None:
        # a store created by a driver that died before recording its sources: its arrays fix
        # the shards; this run's units are whole shards of them (the plan is still empty)
        per = max(1, layout.unit_rows // existing.shard_rows)
        layout = Layout(existing.shard_rows, existing.chunk_rows, per * existing.shard_rows,
                        layout.capacity_rows, C)
    # the one resolution of data.source in the driver for a new store: the blocks, the checks
    # and the provenance take it (listing a remote corpus is not free); a resume reads its
    # blocks from the store (a save_to_disk source's fingerprint check resolves it then)
    source = None
    if stored_sources is not None:
        sources = {k: stored_sources[k] for k in ("kind", "description", "blocks")}
    else:
        source = resolve_source(cfg.data)
        sources = plan_blocks(cfg.data, source)
        probe_text_column(cfg.data, sources["blocks"], src=source)
        if cfg.data.tokens_column is not None:  # ids against the vocabulary and the tokenizer
            from ..data.token_input import check_token_source

            token_source = check_token_source(cfg.data, sources["blocks"], tokenizer,
                                              info.vocab_size, cfg.model.path, source)
        # a resumed store filled contexts already; a new one must be able to fill one
        check_fills_context(cfg.data, cfg.packing, sources["blocks"], tokenizer, bos,
                            prompt_tokens)
    return Prepared(C, cfg.store_dtype(), cfg.content_key(), model_path, info.n_layers, info.width,
                    info.vocab_size, limit, points, bos, special, sources, layout, skip,
                    time.perf_counter() - t0, token_source, addresses, widths, prompt_tokens,
                    scores, source=source, values=values)


def point_values(cfg, addresses, scores) -> dict:
    """{point: "int32" | "float32"} of the stored points that hold 32-bit values (expert_indices,
    expert_weights: FORMAT.md "Points of 32-bit values"); refused in an fp8 store by name."""
    from ...engine.points import PACKED

    values = {str(a): PACKED[a.name] for a in addresses if a.name in PACKED and a.name not in scores}
    if values and cfg.store_dtype() == "float8_e4m3fn":
        names = sorted({a.name for a in addresses if str(a) in values})
        raise ConfigError(f"capture.points {names} with store.dtype float8_e4m3fn: they hold "
                          "int32/float32 values (expert ids and weights), which fp8 would destroy; "
                          "leave store.dtype unset (the model's dtype) or drop them from "
                          "capture.points (capture router_logits and use "
                          "harvest.store.read.routing instead)")
    return values


def split_scores(addresses) -> "tuple[tuple, tuple[str, ...]]":
    """(the addresses with logprob.0 / entropy.0 last, the names of those asked): the engine
    captures them all, the store keeps the scores as row columns beside the points' arrays
    (FORMAT.md "The model's next-token scores"), so they need a point to sit beside."""
    from ...engine.points import LOGIT_POINTS

    scored = tuple(a for a in addresses if a.name in LOGIT_POINTS)
    rest = tuple(a for a in addresses if a.name not in LOGIT_POINTS)
    if scored and not rest:
        raise ConfigError(f"capture.points: {', '.join(a.name for a in scored)} are stored as "
                          "columns of the rows of a point: name at least one point besides them "
                          "(e.g. resid_post.*)")
    return rest + scored, tuple(a.name for a in scored)
