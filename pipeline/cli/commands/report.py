"""`harvest report`: a store's PNG + HTML report (pipeline/cli/report.py builds it)."""

from __future__ import annotations

from ..args import show, store_args, store_target


def cmd_report(args) -> int:
    from ..report import write_report

    url, so = store_target(args)
    r = write_report(url, so, out_dir=args.out, tokenizer_path=args.tokenizer)
    return show(args, {k: v for k, v in r.items() if k != "data"},
                lambda w: f"report: {w['png']} (and {w['html']})")


def add_parser(sub) -> None:
    rp = sub.add_parser("report", help="PNG + HTML: norms, variances, top tokens, compression, rate")
    store_args(rp)
    rp.add_argument("--out", help="output folder (default: <store>/_report, or ./harvest-report)")
    rp.add_argument("--tokenizer", help="tokenizer path to decode tokens (default: the run's model)")
    rp.add_argument("--json", action="store_true", help="print the written paths as JSON")
    rp.set_defaults(fn=cmd_report)
