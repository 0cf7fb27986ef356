"""A unit's rows from the tokenised chunks it is made of (in the actor, never in the driver).

The driver sends a unit as references to the chunks holding its contexts (Ray object refs, owned
by the driver) with each chunk's digest; the actor fetches them, checks each chunk against the
digest its tokeniser recorded (the plan holds the same digests: a resumed run proves a re-created
chunk is the planned one the same way), and cuts the unit's contexts out.
"""

from __future__ import annotations

import numpy as np

from ..messages import UnitTask
from ...store import META_INSERTED


def chunk_digest(arrays: dict) -> list[int]:
    from ...store import crc32c

    out = [crc32c(arrays["token_id"]), crc32c(arrays["doc_id"]), crc32c(arrays["position"])]
    # chat chunks carry roles; text chunks keep their three-column digest, so plans recorded
    # before roles existed still match the chunks a resumed run re-creates
    return out + [crc32c(arrays["role"])] if "role" in arrays else out


def unit_rows(unit: UnitTask, context_size: int) -> tuple:
    """token_id, doc_id (global source rows), position, role (None for text) of the unit's rows."""
    import ray

    C = context_size
    chunks = ray.get(list(unit.refs))
    tok, doc, pos, role = [], [], [], []
    for (b, j, lo, hi, doc_base), arrays, digest in zip(unit.pieces, chunks, unit.digests):
        if chunk_digest(arrays) != list(digest):
            raise RuntimeError(f"unit {unit.unit_id}: chunk {b}:{j} does not match the digest "
                               "its tokeniser recorded; refusing to capture it")
        a, z = lo * C, hi * C
        d = arrays["doc_id"][a:z]
        tok.append(arrays["token_id"][a:z])
        doc.append(np.where(d == META_INSERTED, d, d + int(doc_base)))
        pos.append(arrays["position"][a:z])
        if "role" in arrays:
            role.append(arrays["role"][a:z])
    if role and len(role) != len(tok):
        raise RuntimeError(f"unit {unit.unit_id}: some of its chunks have roles and some not")
    out = tuple(np.concatenate(x) for x in (tok, doc, pos)) + (
        np.concatenate(role) if role else None,)
    n = unit.n_rows
    if out[0].shape[0] != n:
        raise RuntimeError(f"unit {unit.unit_id}: its chunks hold {out[0].shape[0]} rows, the "
                           f"plan says {n}")
    return out
