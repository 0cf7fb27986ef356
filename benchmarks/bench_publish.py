"""What publish records cost (store/commit/published.py), on a real S3 server (SeaweedFS).

At Llama-3.1-8B's shape and 10^9 tokens (3,815 units of 262,144 rows; 512 data objects of
16,384-row shards x 32 points and 3 metadata chunks per unit): the records one run writes (one
PUT each), the listing that tells which units are published (what verify, status, a resume and
the end of a run add), and the stats (HEADs) a unit without a record costs, measured here and
extrapolated by their counts. `python -m harvest.benchmarks.bench_publish [--units 3815]`.
"""

from __future__ import annotations

import argparse
import json
import time

UNITS_PER_1B = 3815
OBJECTS_PER_UNIT = 512 + 3


def main(argv=None) -> dict:
    from ..store.format import layout
    from ..store.storage.locate import locate
    from ..store.commit.published import published_units, write_record
    from ..store.commit.records import Marker
    from ..testing import seaweed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=UNITS_PER_1B)
    ap.add_argument("--heads", type=int, default=OBJECTS_PER_UNIT)
    args = ap.parse_args(argv)
    srv = seaweed.start()
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **srv.storage_options).mkdir("bench")
        loc = locate("s3://bench/publish", srv.storage_options)
        t0 = time.perf_counter()
        for u in range(min(args.units, 200)):   # the writer's path: one PUT each, timed
            write_record(loc, Marker(u, 0, 1, f"{u:016x}"), OBJECTS_PER_UNIT)
        put_s = (time.perf_counter() - t0) / min(args.units, 200)
        rest = {loc.key(layout.published_key(u, f"{u:016x}")): b'{"unit_id":0}'
                for u in range(200, args.units)}
        loc.write_many(rest, durable=False, batch=500)
        t0 = time.perf_counter()
        got = published_units(loc)
        list_s = time.perf_counter() - t0
        assert len(got) == args.units, len(got)
        keys = [f"objs/{i}" for i in range(args.heads)]
        loc.write_many({loc.key(k): b"x" * 64 for k in keys}, durable=False, batch=500)
        t0 = time.perf_counter()
        sizes = loc.object_sizes(keys)
        head_s = time.perf_counter() - t0
        assert all(v == 64 for v in sizes.values())
    finally:
        srv.stop()
    out = {"units": args.units, "record_put_ms": round(put_s * 1e3, 2),
           "records_put_s_1B": round(put_s * UNITS_PER_1B, 1),
           "listing_s": round(list_s, 3), "heads_per_unit": args.heads,
           "heads_s_per_unit": round(head_s, 3), "heads_per_s": round(args.heads / head_s),
           "legacy_settle_s_1B": round(head_s * UNITS_PER_1B, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
