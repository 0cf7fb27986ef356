"""`harvest schedule extend|checkpoints`: one cron tick (pipeline/driver/schedule.py does the work).

Exit codes are the alert: 0 (ran, paused, complete, would run), 1 (a run failed, or checkpoint
stores are not row-aligned), 3 (the previous run is still alive), 4 (it is stuck), 2 (bad input,
like every command: a config that is invalid or differs from the store's). A cron job that exits
0 every night while nothing happens is the failure this command exists to prevent, so "still
running" is not success, except under `--busy-ok`, for schedulers that retry a failed job and
cannot forbid overlap (KubeRay's RayCronJob): there a busy tick prints BUSY and exits 0, and the
webhook still gets it. `--webhook` receives every outcome whose own code is not 0, exit 2
included; `--webhook-file` reads its URL from a file instead (a mounted Secret: a Slack-style URL
is a credential, kept off the command line and out of the environment).

A tick that runs is quiet like `harvest run`: vLLM's, Ray's and torch's output goes to a log
folder per tick (`<cache>/logs/<name>-<time>/`, named on the console and in `--json`);
`--verbose` prints it instead.
"""

from __future__ import annotations

from pathlib import Path

from ..args import config_args, is_user_error, load_args_config, print_json
from ...config.fields import ConfigError


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
                   "'text') when it is not 0 (exit 2, a bad or changed config, included)")
    s.add_argument("--webhook-file", metavar="PATH",
                   help="read --webhook's URL from this file (e.g. a mounted Kubernetes Secret)")
    s.add_argument("--busy-ok", action="store_true",
                   help="a busy tick (the previous one still running) exits 0 after saying "
                        "BUSY, for schedulers that retry failed jobs (KubeRay RayCronJob)")
    s.add_argument("--check", action="store_true",
                   help="decide only (from the store's plan, markers and lease): start nothing")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_schedule)


def webhook_url(args) -> "str | None":
    """The webhook's URL: `--webhook URL`, or the stripped text of `--webhook-file PATH`."""
    if args.webhook_file is None:
        return args.webhook
    if args.webhook:
        raise ConfigError("give --webhook or --webhook-file, not both")
    try:
        url = Path(args.webhook_file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"--webhook-file {args.webhook_file}: {e.strerror}") from None
    if not url:
        raise ConfigError(f"--webhook-file {args.webhook_file} is empty")
    return url


def cmd_schedule(args) -> int:
    from ...driver.schedule import Tick, notify

    webhook = webhook_url(args)
    try:
        ticks, log_dir = _ticks(args, webhook)
    except Exception as e:
        if webhook and is_user_error(e):  # exit 2: posted like every non-zero outcome
            from ....store import mask_text

            hook = notify(webhook, [Tick("invalid", "", mask_text(f"{type(e).__name__}: {e}"))])
            if hook:
                print(f"warning: {hook}")
        raise
    code = max(t.exit_code for t in ticks)
    hook = notify(webhook, ticks) if webhook and code else None
    if args.busy_ok and code and all(t.status == "busy" for t in ticks if t.exit_code):
        code = 0
    if args.json:
        print_json(args, {"exit_code": code, "ticks": [t.as_dict() for t in ticks],
                         "webhook_error": hook, "log_dir": str(log_dir) if log_dir else None})
        return code
    for t in ticks:
        print(f"{t.status.upper() if t.status == 'busy' else t.status}: {t.message}"
              + (" (exit 0: --busy-ok)" if t.status == "busy" and code == 0 else ""))
    if hook:
        print(f"warning: {hook}")
    return code


def _ticks(args, webhook: "str | None"):
    """The tick's outcomes, and the log folder when it ran quiet."""
    from ...config.paths import cache_dir
    from ...logs import new_log_dir, quiet_run
    from ...driver.schedule import ScheduleConfig, checkpoint_tick, extend_tick

    cfg = load_args_config(args)
    sc = ScheduleConfig(args.mode, args.tokens_per_tick, args.checkpoints,
                        args.stuck_after * 3600.0, webhook, args.check).validate(cfg)

    def tick():
        return [extend_tick(cfg, sc)] if sc.mode == "extend" else checkpoint_tick(cfg, sc)

    if args.verbose or sc.check_only:
        return tick(), None
    log_dir = new_log_dir(cache_dir(), cfg.name)
    if not args.json:
        print(f"logs: {log_dir} (vLLM, Ray, torch; --verbose prints them here)", flush=True)
    with quiet_run(log_dir):
        return tick(), log_dir
