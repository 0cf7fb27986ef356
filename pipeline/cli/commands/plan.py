"""`harvest plan`: the layout, the corpus's blocks, the estimated size, time, objects and
requests of a run, from metadata alone: nothing is tokenised or written."""

from __future__ import annotations

from ....store import redact_url

from ..args import config_args, load_args_config, print_json


def cmd_plan(args) -> int:
    """The layout and the corpus's blocks, from metadata: nothing is tokenised or written."""
    from ....store import fp8

    from ..estimate import corpus_bytes, dataplane, plan_estimate
    from ..objectcost import layout_cost
    from ...driver.prepare import prepare
    from ..text import plan_text
    from ...driver.resume import probe_store

    cfg = load_args_config(args)
    loc = cfg.store.location()
    existing = probe_store(cfg.store, loc)
    prep = prepare(cfg, existing)
    L = prep.layout
    out = {
        "store": redact_url(cfg.store.resolved_url),
        "store_exists": existing is not None,
        "model_path": prep.model_path,
        "points": len(prep.points),
        "width": prep.width,
        "context_size": cfg.packing.context_size,
        "data": prep.sources["description"],
        "blocks": len(prep.sources["blocks"]),
        "block_bytes": cfg.data.block_bytes,
        "max_tokens": cfg.packing.max_tokens,
        "max_units": (-(-L.capacity_rows // L.unit_rows) if cfg.packing.max_tokens else None),
        "unit_rows": L.unit_rows,
        "shard_rows": L.shard_rows,
        "chunk_rows": L.chunk_rows,
        # each point at its own width, and 4 bytes per score column (logprob / entropy)
        "bytes_per_token": sum(prep.point_bytes().values()) + 4 * len(prep.scores),
        "scores": list(prep.scores),
        "widths": dict(prep.widths or {}),
        "store_dtype": existing.dtype if existing is not None else cfg.store_dtype(),
        "corpus_bytes": corpus_bytes(prep.sources),
    }
    if existing is not None:
        plan = existing.ledger.plans.read()
        out["planned_units"] = len(plan.units)
        out["planned_tokens"] = sum(u.n_rows for u in plan.units)
        out["plan_complete"] = plan.final
    # a resumed store keeps the codec it was created with
    codec = existing.compression if existing is not None else cfg.store.compression
    ratio = fp8.expected_ratio(codec, out["store_dtype"])
    out["estimate"], out["warnings"] = plan_estimate(cfg, prep, out, args.rate, ratio, existing)
    est = out["estimate"]
    out["dataplane"], warn = dataplane(cfg, est, sum((prep.widths or {}).values()) * 2
                                       or len(prep.points) * prep.width * 2, codec, out["store_dtype"])
    out["warnings"] += warn
    out["stream"] = _stream_price(cfg, prep, est, out["dataplane"])
    out["layout"] = layout_cost(
        points=prep.points, width=prep.row_width, itemsize=prep.itemsize, shard_rows=L.shard_rows,
        unit_rows=L.unit_rows, tokens=est.get("tokens"), ratio=ratio,
        rate=args.rate or est.get("tokens_per_second"),
        object_store=loc.object_store,
        roles=cfg.data.format == "chat", generated=cfg.capture.generate is not None,
        samples=cfg.capture.generate is not None and cfg.capture.generate.n > 1,
        scores=prep.scores, point_widths={p: b // prep.itemsize for p, b in prep.point_bytes().items()}
        if len(set((prep.widths or {}).values())) > 1 else None)
    if args.json:
        print_json(args, out)
    else:
        print(plan_text(out))
    return 0


def _stream_price(cfg, prep, est: dict, dataplane: "dict | None") -> "dict | None":
    """The stream beside the store at the planned rate (pipeline/stream/cost.py), or None
    without a rate."""
    from ...driver.prepare import stored_itemsize
    from ...stream.cost import stream_cost
    from ....store import row_width

    if not est.get("tokens_per_second") or dataplane is None:
        return None
    bf16 = sum((prep.widths or {}).values()) * 2 or len(prep.points) * prep.width * 2
    dt = cfg.stream_dtype()
    wire = sum(row_width(dt, (prep.widths or {}).get(p, prep.width)) for p in prep.points) \
        * stored_itemsize(dt)
    units = round(est["tokens_per_second"] / max(1, dataplane["tokens_per_second_per"]))
    return stream_cost(est["tokens_per_second"], max(1, units), est.get("tokens"), bf16, wire,
                       est.get("bytes_stored"), dataplane["per"])


def add_parser(sub) -> None:
    pl = sub.add_parser("plan", help="layout, blocks, estimated size and time; nothing runs")
    config_args(pl)
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--rate", type=float, metavar="TOK_PER_S",
                    help="aggregate tok/s to price time and requests/s at (default: a guess "
                         "from the model's size and the actors)")
    pl.set_defaults(fn=cmd_plan)
