"""Row copies with non-temporal stores, for CPU taps that deliver rows themselves (direct.py).

A capture's rows are written once and not read again until the writer encodes them, long after
the step: normal stores first read every destination line into the cache (read-for-ownership)
and evict the model's weights and activations to make room. Non-temporal stores write around the
cache. Measured on the 2-core build VM (one thread, 566 MB of rows as 256-row pieces of width
576, bf16): torch's `copy_` 87 ms, glibc's memmove 66 ms, these stores 47-53 ms.

One numba kernel (numba is a dependency: the store's statistics use it too) copies one tap's
rows for every planned request of the step in one call. LLVM's `!nontemporal` store metadata is
portable (x86 movntdq, ARM stnp); the kernel ends with a full fence, so the rows are visible to
any thread that later synchronises with this one. `available()` is False where numba is missing;
callers then copy with torch.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
except ImportError:   # pragma: no cover  (numba comes with the package)
    numba = None

ALIGN = 16   # bytes per non-temporal vector store; destinations must be aligned to it


def available() -> bool:
    return numba is not None


if numba is not None:
    @intrinsic
    def _nt_store16(typingctx, dst, src):
        """*(16 bytes *)dst = *(16 bytes *)src, the store non-temporal (dst aligned to 16)."""
        sig = types.void(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            vt = ir.VectorType(ir.IntType(64), 2)
            d = builder.inttoptr(args[0], vt.as_pointer())
            s = builder.inttoptr(args[1], vt.as_pointer())
            st = builder.store(builder.load(s, align=1), d, align=ALIGN)
            st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return sig, codegen

    @intrinsic
    def _copy_byte(typingctx, dst, src):
        sig = types.void(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            t = ir.IntType(8)
            builder.store(builder.load(builder.inttoptr(args[1], t.as_pointer())),
                          builder.inttoptr(args[0], t.as_pointer()))
        return sig, codegen

    @intrinsic
    def _fence(typingctx):
        sig = types.void()

        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
        return sig, codegen

    @numba.njit(nogil=True, cache=True)
    def _copy_segments(segs, point, src):   # pragma: no cover  (compiled; tests call it)
        for k in range(segs.shape[0]):
            dst = segs[k, 0] + point * segs[k, 1]
            s = src + segs[k, 2]
            n = segs[k, 3]
            vec = n // ALIGN
            for j in range(vec):
                _nt_store16(dst + j * ALIGN, s + j * ALIGN)
            for j in range(vec * ALIGN, n):
                _copy_byte(dst + j, s + j)
        _fence()


def plan(segments, width: int, itemsize: int) -> np.ndarray | None:
    """Segments `(dest, d0, d1, s0, s1)` as the kernel's table (int64 [k, 4]: destination of
    point 0, bytes between points, source offset, bytes), or None where a destination is not
    `[points, rows, width]` with whole aligned rows (the caller copies with torch)."""
    rows = []
    for dest, d0, d1, s0, _ in segments:
        if dest.shape[2] != width or dest.stride(2) != 1 or (d1 - d0 > 1 and dest.stride(1) != width):
            return None
        base = dest.data_ptr() + d0 * dest.stride(1) * itemsize
        step = dest.stride(0) * itemsize
        if base % ALIGN or step % ALIGN:
            return None
        rows.append((base, step, s0 * width * itemsize, (d1 - d0) * width * itemsize))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


def copy_rows(table: np.ndarray, point: int, src_ptr: int) -> None:
    """Every segment of `table` (plan()) for destination point `point`, from a contiguous
    `[rows, width]` source at `src_ptr`."""
    _copy_segments(table, point, src_ptr)
