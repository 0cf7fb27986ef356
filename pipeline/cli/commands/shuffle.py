"""`harvest shuffle SRC DST`: a shuffled copy of a finished store (store/shuffled_copy.py).

An SAE trained with the reader's default window shuffle sees in each batch only the documents
of the few shards its window holds; on a shuffled copy every shard is a uniform sample of the
whole store, so the same reader draws like a uniform shuffle. Run it once after the capture;
rerun the same command after a crash to finish it.
"""

from __future__ import annotations

from ..args import config_args, load_args_config, print_json


def add_parser(sub) -> None:
    s = sub.add_parser("shuffle", help="write a copy of a finished store with its rows in one "
                                       "random order (readers then mix like a uniform shuffle)")
    s.add_argument("src", help="the finished store (URL or path)")
    s.add_argument("dst", help="where the copy goes (a new URL or path; rerun to resume)")
    s.add_argument("--seed", type=int, default=0, help="the order's seed (default 0)")
    s.add_argument("--spill", default=None,
                   help="the scatter pass's store (default: DST.spill; deleted at the end)")
    s.add_argument("--memory-gb", type=float, default=4.0,
                   help="memory for the scatter pass's writers (fewer scans of SRC with more)")
    s.add_argument("--points", nargs="+", default=None,
                   help="copy only these points (default: all; an SAE of one layer needs one)")
    s.add_argument("--json", action="store_true")
    config_args(s)   # --config: the S3 endpoint and credentials of the run's store section
    s.set_defaults(fn=cmd_shuffle)


def cmd_shuffle(args) -> int:
    import sys

    from ....store import shuffle_store

    so = load_args_config(args).store.fs_options() if args.config else None
    out = shuffle_store(args.src, args.dst, seed=args.seed, spill_url=args.spill,
                        storage_options=so, memory_bytes=int(args.memory_gb * 2**30),
                        points=args.points,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print_json(args, out)
    else:
        print(f"shuffled copy: {args.dst} ({out['rows']:,} rows, {out['units']} units)")
    return 0
