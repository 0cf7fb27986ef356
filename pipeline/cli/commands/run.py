"""`harvest run`: run or resume a harvest, quiet by default (pipeline/logs.py), with its
summary, the corpus-budget warning and the finished store's report."""

from __future__ import annotations

import logging

from ...config.corpus import PackingConfig
from ...driver.tally import RunSummary

from ..args import config_args, load_args_config, print_json

log = logging.getLogger("harvest.pipeline")


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


def budget_shortfall(packing: PackingConfig, summary: RunSummary) -> "str | None":
    """The corpus ended before packing.max_tokens: say so with the numbers (the summary's
    budget_reached flag alone went unnoticed)."""
    budget = packing.max_tokens
    packed = summary.get("packing") or {}
    if not budget or summary.get("noop") or packed.get("budget_reached", True):
        return None
    tokens = summary.get("tokens") or 0
    if tokens >= budget - packing.context_size:
        return None
    return (f"packing.max_tokens={budget:,} was not reached: the corpus gave {tokens:,} tokens "
            f"({100 * tokens / budget:.1f}% of the budget); add data or lower packing.max_tokens")


def cmd_run(args) -> int:
    """Quiet by default (pipeline/logs.py): third-party output to a log folder, named once."""
    from ...config.paths import cache_dir
    from ...driver.run import run
    from ...logs import new_log_dir, quiet_run

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
                         "warnings": [w for w in [budget_shortfall(cfg.packing, summary)] if w]})
        return 0
    print(format_summary(summary))
    short = budget_shortfall(cfg.packing, summary)
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
    from ...driver.prepare import resolve_model_path
    from ..report import write_report

    try:
        r = write_report(summary["store"], cfg.store.fs_options(),
                         tokenizer_path=resolve_model_path(cfg.model.path))
    except Exception as e:  # noqa: BLE001 -- see the docstring
        return f"{type(e).__name__}: {e}"
    try:   # the card finalize wrote has no picture yet: the report made just now is its picture
        from ....store import open_store
        from ....store import write_card

        write_card(open_store(cfg.store.resolved_url, cfg.store.fs_options()))
    except Exception as e:  # noqa: BLE001 -- the card is derived: a warning, like the report
        log.warning("the dataset card was not refreshed with the report: %s", e)
    return {k: r[k] for k in ("png", "html", "json")}


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="run or resume a harvest (connects to Ray or starts it)")
    config_args(r)
    r.add_argument("--json", action="store_true", help="print only the summary, as JSON")
    r.add_argument("--no-report", action="store_true",
                   help="skip the report (PNG/HTML of norms, variances, top tokens) at the end")
    r.set_defaults(fn=cmd_run)
