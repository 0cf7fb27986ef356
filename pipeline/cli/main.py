"""`harvest run|plan|status|verify|finalize|uncommit|inspect|report|...`: the pipeline for people.

`status`, `verify` and `inspect` read the store alone (a URL or the store of a config), so they
work while a job runs elsewhere, after it was interrupted, or on a machine without the engine.
Errors we can explain end the command with exit code 2 and one line, not a traceback. Ctrl-C
exits 130, SIGTERM 143 and SIGHUP 129 (128 + the signal), after the same cleanup (pipeline/driver/exits.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .args import (config_args, is_user_error, load_args_config, print_json, store_args,
                   store_target)
from .repair import add_parsers as add_repair
from harvest.pipeline.config.run import HarvestConfig
from harvest.pipeline.driver.tally import RunSummary
from .schedule_cmd import add_parser as add_schedule
from .card import add_parser as add_card
from .shuffle_cmd import add_parser as add_shuffle
from harvest.store.storage.credentials import redact_url
from harvest.store.escape import terminal

EXIT_BAD_INPUT = 2
log = logging.getLogger("harvest.pipeline")


def _setup_logging(verbose: bool) -> None:
    from harvest.pipeline.logs import setup_console

    setup_console(verbose)


def format_summary(s: RunSummary) -> str:
    if s.get("noop"):
        return (f"store {s.get('store')} is already complete: {s.get('tokens')} tokens in "
                f"{s.get('units')} units, finished {s.get('finished_at')}; nothing to do")
    lines = [
        f"harvest {s['name']}: {s['tokens']} tokens in {s['units']} units "
        f"({s['units_run']} run, {s['units_skipped']} already committed) -> {s['store']}",
        f"  captured {s['tokens_this_run']} tokens in {s['dispatch_seconds']:.1f} s of dispatch: "
        f"{s['tokens_per_second'] or 0:.0f} tok/s ({s['points']} points x width {s['width']})"
        + _held(s),
        f"  bytes: {s['bytes_logical'] / 1e6:.1f} MB logical, {s['bytes_stored'] / 1e6:.1f} MB stored, "
        f"compression {s['compression_ratio']}x",
        f"  verified: {s['verified']['committed_units']}/{s['verified']['planned_units']} units, "
        f"{s['verified']['committed_rows']} rows; retries {s['unit_retries']}, "
        f"actor deaths {s['actor_deaths_seen']}; wall {s['wall_seconds']:.1f} s",
    ]
    skipped = _skipped(s)
    if skipped:
        lines.append(skipped)
    if s.get("throttled_requests"):
        lines.append(f"  storage throttled {s['throttled_requests']} requests (503 SlowDown): each "
                     "retried after a shared backoff, no unit captured again for it")
    # each rate says what it divides by: the actors' tokens over the run's dispatch time add up
    # to the run's rate; over each actor's own time in its engine they do not
    d = s["dispatch_seconds"] or 0.0
    for a in s["per_actor"]:
        share = f"{a['tokens'] / d:.0f} tok/s over the run's {d:.1f} s" if d else "no dispatch time"
        own = (f"{a['tokens_per_second']:.0f} tok/s over its {a['engine_seconds']:.1f} s in the "
               "engine" if a.get("tokens_per_second") else "no engine time")
        lines.append(f"  actor {a['index']}: {a['units']} units, {a['tokens']} tokens: {share} "
                     f"({own}), pids {a['pids']}")
    return "\n".join(lines)


def _held(s: RunSummary) -> str:
    """How many of the run's rows hold activations, where not all do (chat padding and roles
    outside capture.roles are zeros; generation slots have rows without): a reader yields those."""
    held, rows = s.get("rows_with_activations_this_run"), s.get("tokens_this_run")
    if held is None or held == rows:
        return ""
    return (f"; {held} of those rows hold activations (the others are padding, roles outside "
            "capture.roles or generated rows without, stored as zeros)")


def _skipped(s: RunSummary) -> "str | None":
    """The source rows the run skipped, by reason (docs/operations.md, "Skipped rows"): a
    conversation the template cannot label is never silent."""
    data = s.get("data") or {}
    n = data.get("rows_skipped") or 0
    if not n:
        return None
    reasons = ", ".join(f"{k} {v}" for k, v in sorted((data.get("skipped_reasons") or {}).items()))
    return (f"  skipped {n} of {data.get('rows_read', 0)} source rows ({reasons}): see "
            "docs/operations.md, \"Skipped rows\"")


def budget_shortfall(cfg: HarvestConfig, summary: RunSummary) -> "str | None":
    """The corpus ended before packing.max_tokens: say so with the numbers (the summary's
    budget_reached flag alone went unnoticed)."""
    budget = cfg.packing.max_tokens
    packing = summary.get("packing") or {}
    if not budget or summary.get("noop") or packing.get("budget_reached", True):
        return None
    tokens = summary.get("tokens") or 0
    if tokens >= budget - cfg.packing.context_size:
        return None
    return (f"packing.max_tokens={budget:,} was not reached: the corpus gave {tokens:,} tokens "
            f"({100 * tokens / budget:.1f}% of the budget); add data or lower packing.max_tokens")


def cmd_run(args) -> int:
    """Quiet by default (pipeline/logs.py): third-party output to a log folder, named once."""
    from harvest.pipeline.config.paths import cache_dir
    from harvest.pipeline.driver.run import run
    from harvest.pipeline.logs import new_log_dir, quiet_run

    cfg = load_args_config(args)
    if args.verbose:
        summary = run(cfg)
        log_dir = None
    else:
        log_dir = new_log_dir(cache_dir(), cfg.name)
        if not args.json:
            print(f"logs: {log_dir} (vLLM, Ray, torch; --verbose prints them here)", flush=True)
        with quiet_run(log_dir):
            summary = run(cfg)
    report = None if args.no_report or summary.get("noop") else _run_report(cfg, summary)
    if args.json:
        print_json(args, {**summary, "log_dir": str(log_dir) if log_dir else None,
                         "report": report,
                         "warnings": [w for w in [budget_shortfall(cfg, summary)] if w]})
        return 0
    print(format_summary(summary))
    short = budget_shortfall(cfg, summary)
    if short:
        print(f"warning: {short}")
    if isinstance(report, dict):
        print(f"report: {report['png']} (and {report['html']})")
    elif report:
        print(f"warning: no report ({report}); try: harvest report {summary['store']}")
    return 0


def _run_report(cfg, summary: RunSummary):
    """The finished store's report (pipeline/cli/report.py): it reads a fixed sample of shards, so it
    costs seconds whatever the corpus size. A report that fails is a warning, never a failed run:
    the data is committed and verified by then. Returns the paths, or the reason as a string."""
    from harvest.pipeline.driver.prepare import resolve_model_path
    from .report import write_report

    try:
        r = write_report(summary["store"], cfg.store.fs_options(),
                         tokenizer_path=resolve_model_path(cfg.model.path))
    except Exception as e:  # noqa: BLE001 -- see the docstring
        return f"{type(e).__name__}: {e}"
    try:   # the card finalize wrote has no picture yet: the report made just now is its picture
        from harvest.store import open_store
        from harvest.store.card import write_card

        write_card(open_store(cfg.store.resolved_url, cfg.store.fs_options()))
    except Exception as e:  # noqa: BLE001 -- the card is derived: a warning, like the report
        log.warning("the dataset card was not refreshed with the report: %s", e)
    return {k: r[k] for k in ("png", "html", "json")}


def cmd_plan(args) -> int:
    """The layout and the corpus's blocks, from metadata: nothing is tokenised or written."""
    from harvest.store.storage.locate import locate
    from harvest.store.format.fp8 import expected_ratio

    from .estimate import corpus_bytes, dataplane, plan_estimate
    from .objectcost import layout_cost
    from harvest.pipeline.driver.prepare import prepare
    from .text import plan_text
    from harvest.pipeline.driver.resume import probe_store

    cfg = load_args_config(args)
    existing = probe_store(cfg.store)
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
        plan = existing.plans.read()
        out["planned_units"] = len(plan["units"])
        out["planned_tokens"] = sum(u.n_rows for u in plan["units"])
        out["plan_complete"] = plan["final"]
    # a resumed store keeps the codec it was created with
    codec = existing.compression if existing is not None else cfg.store.compression
    ratio = expected_ratio(codec, out["store_dtype"])
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
        object_store=locate(cfg.store.resolved_url, cfg.store.fs_options()).request_limited,
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
    from harvest.pipeline.driver.prepare import stored_itemsize
    from harvest.pipeline.stream.cost import stream_cost
    from harvest.store.format.dtypes import row_width

    if not est.get("tokens_per_second") or dataplane is None:
        return None
    bf16 = sum((prep.widths or {}).values()) * 2 or len(prep.points) * prep.width * 2
    dt = cfg.stream_dtype()
    wire = sum(row_width(dt, (prep.widths or {}).get(p, prep.width)) for p in prep.points) \
        * stored_itemsize(dt)
    units = round(est["tokens_per_second"] / max(1, dataplane["tokens_per_second_per"]))
    return stream_cost(est["tokens_per_second"], max(1, units), est.get("tokens"), bf16, wire,
                       est.get("bytes_stored"), dataplane["per"])


def cmd_status(args) -> int:
    from .text import status_text
    from .views import status

    url, so = store_target(args)
    s = status(url, so)
    if args.json:
        print_json(args, s)
    else:
        print(status_text(s))
    return 0


def cmd_verify(args) -> int:
    """Exit 0 only for a complete, consistent store: 1 if rows are missing or anything is off."""
    from harvest.store import open_store

    from .text import verify_text
    from .views import store_missing

    url, so = store_target(args)
    if store_missing(url, so):
        print(f"no store at {redact_url(url)} yet: nothing to verify (the job may still be "
              "starting)", file=sys.stderr)
        return 1
    v = open_store(url, storage_options=so, read_only=True).verify(deep=args.deep,
                                                                   objects=args.objects)
    complete = v.complete
    if args.json:
        print_json(args, {**v.as_dict(), "complete": complete})
    else:
        print(verify_text(v, complete))
    return 0 if complete else 1


def cmd_inspect(args) -> int:
    from .text import inspect_text
    from harvest.store.inspect import inspect

    url, so = store_target(args)
    rows = None
    if args.rows:
        a, _, b = args.rows.partition(":")
        rows = (int(a), int(b) if b else int(a) + 8)
    info = inspect(url, so, rows)
    if args.json:
        print_json(args, info)
    else:
        print(inspect_text(info))
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    url, so = store_target(args)
    r = write_report(url, so, out_dir=args.out, tokenizer_path=args.tokenizer)
    if args.json:
        print_json(args, {k: v for k, v in r.items() if k != "data"})
    else:
        print(f"report: {r['png']} (and {r['html']})")
    return 0


def cmd_check_model(args) -> int:
    """Exit 0 when every point is within tolerance of HF fp32; 1 when not, or when the engine
    refuses the trunk at load (docs/engine.md, "Supported model families")."""
    from harvest.engine.model_check import run_command

    from harvest.pipeline.driver.prepare import resolve_model_path

    return run_command(resolve_model_path(args.model), args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harvest", description=__doc__.splitlines()[0])
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show vLLM's, Ray's and torch's output too (run: instead of a log file)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run or resume a harvest (connects to Ray or starts it)")
    config_args(r)
    r.add_argument("--json", action="store_true", help="print only the summary, as JSON")
    r.add_argument("--no-report", action="store_true",
                   help="skip the report (PNG/HTML of norms, variances, top tokens) at the end")
    r.set_defaults(fn=cmd_run)
    pl = sub.add_parser("plan", help="layout, blocks, estimated size and time; nothing runs")
    config_args(pl)
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--rate", type=float, metavar="TOK_PER_S",
                    help="aggregate tok/s to price time and requests/s at (default: a guess "
                         "from the model's size and the actors)")
    pl.set_defaults(fn=cmd_plan)
    st = sub.add_parser("status", help="progress of a store, from the store alone")
    store_args(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    v = sub.add_parser("verify", help="every planned row committed exactly once?")
    store_args(v)
    v.add_argument("--deep", action="store_true", help="also check every shard's CRC")
    v.add_argument("--objects", action="store_true",
                   help="also list every object and check its size (one LIST page per 1,000 "
                        "objects: slow on object storage at corpus scale)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_verify)
    i = sub.add_parser("inspect", help="layout, statistics, run attributes, rows with --rows A:B")
    store_args(i)
    i.add_argument("--rows", help="rows to show, e.g. 0:16")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)
    rp = sub.add_parser("report", help="PNG + HTML: norms, variances, top tokens, compression, rate")
    store_args(rp)
    rp.add_argument("--out", help="output folder (default: <store>/_report, or ./harvest-report)")
    rp.add_argument("--tokenizer", help="tokenizer path to decode tokens (default: the run's model)")
    rp.add_argument("--json", action="store_true", help="print the written paths as JSON")
    rp.set_defaults(fn=cmd_report)
    cm = sub.add_parser("check-model", help="capture a model in freeze mode and compare every "
                        "layer with Hugging Face fp32; exit 1 above tolerance")
    cm.add_argument("model", help="checkpoint dir, hub name, smollm2 or tiny:<arch>")
    cm.add_argument("--points", nargs="*", help="default: resid_post at every layer; any point of "
                    "the table, at its own width (mlp_act.3, z.*, router_logits.* on MoE)")
    cm.add_argument("--lengths", default="5,37,150,64,90,17,1,120", help="prompt lengths")
    cm.add_argument("--tol-p50", type=float, default=0.03,
                    help="cap on the p50 bound; below it, each point's bound is a multiple "
                         "of HF's own engine-dtype-vs-fp32 gap there (engine.model_check.GAP_RATIO)")
    cm.add_argument("--tol-p99", type=float, default=0.15, help="cap on the p99 bound")
    cm.add_argument("--reference-device", default="cpu")
    cm.add_argument("--no-compile", action="store_true", help="skip torch.compile: starts in seconds")
    cm.add_argument("--unverified-trunk", action="store_true",
                    help="capture even if the block-semantics probe refuses the trunk")
    cm.add_argument("--json", action="store_true")
    cm.set_defaults(fn=cmd_check_model)
    add_schedule(sub)
    add_card(sub)
    add_shuffle(sub)

    add_repair(sub)   # finalize, uncommit (repair.py)
    for sp in sub.choices.values():  # `harvest run --verbose` as well as `harvest --verbose run`
        sp.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: "list[str] | None" = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from harvest.pipeline.driver.exits import orderly_signals
    from harvest.pipeline.logs import json_stdout

    try:
        with orderly_signals():
            if not getattr(args, "json", False):
                return args.fn(args)
            with json_stdout() as args.json_out:
                return args.fn(args)
    except BrokenPipeError:  # `harvest inspect | head`
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (exits.Terminated)
        how = f"stopped by {e}" if getattr(e, "exit_code", None) else "interrupted"
        print(f"harvest {args.cmd}: {how}: the store is resumable, re-run the same command",
              file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except Exception as e:
        # masked: a presigned data.source or a token can sit in any message (credentials.py)
        from harvest.store.storage.credentials import scrub

        if is_user_error(e):
            # the message may quote a store's text (store/escape.py) or a secret: neither reaches
            # the terminal
            print(scrub(f"harvest {args.cmd}: error: {terminal(e, newlines=True)}"), file=sys.stderr)
            return EXIT_BAD_INPUT
        import traceback

        print(scrub(traceback.format_exc()), file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    sys.exit(main())
