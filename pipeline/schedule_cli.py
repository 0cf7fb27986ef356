"""`harvest schedule extend|checkpoints`: one cron tick (pipeline/schedule.py does the work).

Exit codes are the alert: 0 (ran, paused, complete, would run), 1 (a run failed, or checkpoint
stores are not row-aligned), 3 (the previous run is still alive), 4 (it is stuck), 2 (bad input,
like every command). A cron job that exits 0 every night while nothing happens is the failure
this command exists to prevent, so "still running" is not success.
"""

from __future__ import annotations

from .cli_args import config_args, load_args_config, print_json


def add_parser(sub) -> None:
    s = sub.add_parser("schedule", help="one scheduled tick: extend a store, or a store per "
                       "checkpoint; exit 3/4 when the previous run is alive/stuck")
    s.add_argument("mode", choices=("extend", "checkpoints"))
    config_args(s)
    s.add_argument("--tokens", type=int, dest="tokens_per_tick",
                   help="extend: tokens each tick adds (rounded up to whole work units); the "
                        "budget is packing.max_tokens")
    s.add_argument("--checkpoints", help="checkpoints: directory of checkpoint directories; "
                   "stores go to <store.url>/<checkpoint name>")
    s.add_argument("--stuck-after", type=float, default=6.0, metavar="HOURS",
                   help="a previous run alive longer than this is reported stuck (exit 4)")
    s.add_argument("--webhook", help="POST the tick's outcome as JSON here (Slack-compatible "
                   "'text') when it is not 0")
    s.add_argument("--check", action="store_true",
                   help="decide only (from the store's plan, markers and lease): start nothing")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_schedule)


def cmd_schedule(args) -> int:
    from .schedule import ScheduleConfig, checkpoint_tick, extend_tick, notify

    cfg = load_args_config(args)
    sc = ScheduleConfig(args.mode, args.tokens_per_tick, args.checkpoints,
                        args.stuck_after * 3600.0, args.webhook, args.check).validate(cfg)
    ticks = [extend_tick(cfg, sc)] if sc.mode == "extend" else checkpoint_tick(cfg, sc)
    code = max(t.exit_code for t in ticks)
    hook = notify(sc.webhook, ticks) if sc.webhook and code else None
    if args.json:
        print_json(args, {"exit_code": code, "ticks": [t.as_dict() for t in ticks],
                         "webhook_error": hook})
        return code
    for t in ticks:
        print(f"{t.status}: {t.message}")
    if hook:
        print(f"warning: {hook}")
    return code
