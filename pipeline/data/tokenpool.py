"""The driver's side of tokenisation: a few worker actors, jobs in block order, a bounded window.

A job is one block (or the part of one a resume needs: from a chunk's cursor, up to a last chunk)
streamed by one worker. Jobs start in block order; the driver consumes the lowest-block job
always (it is the one the frontier waits for) and the others only while the tokens it holds stay
under the window, so tokenisation runs ahead of capture by a bounded amount and Ray's generator
backpressure parks workers that are too far ahead. A job whose worker died is started again from
its beginning: chunks already received are recognised by (block, chunk) and dropped.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..config.corpus import DataConfig, PackingConfig
from ..config.sections import RayConfig

log = logging.getLogger("harvest.pipeline")

JOB_ATTEMPTS = 3


@dataclass
class Job:
    block: int
    start: dict | None = None
    first_index: int = 0
    last_index: int | None = None
    attempt: int = 1
    # contexts the job may pack at most (packing.max_tokens's share from its start on); None:
    # the run's whole budget (a block's start, whose place in the run is not known yet)
    budget: int | None = None
    gen: Iterator[Any] | None = None   # the worker's ray generator of (arrays, descriptor) refs
    worker: int = -1
    chunks: int = 0


@dataclass
class TokenPool:
    workers: list
    jobs: deque                      # explicit jobs (a resume's), in block order
    fresh_from: int | None           # then every block from here to the last, from its start
    blocks: list                     # the blocks' segments (plan_blocks)
    active: dict = field(default_factory=dict)   # worker index -> Job
    blocks_tokenised: list = field(default_factory=list)  # (block, first chunk), for tests/logs
    stopped: bool = False

    @classmethod
    def start(cls, data: DataConfig, packing: PackingConfig, ray_cfg: RayConfig, prep,
              jobs: list[Job], fresh_from: int | None, chunk_contexts: int,
              max_contexts: int | None, env: dict) -> "TokenPool":
        """Tokenising workers for `jobs` (then every block from `fresh_from`), each packing
        with the `data` and `packing` sections; ray.tokenize_workers and tokenize_cpus size them."""
        import dataclasses

        import ray

        from .tokenize import TokenizeWorker

        spec = {"model_path": prep.model_path, "data": dataclasses.asdict(data),
                "packing": dataclasses.asdict(packing), "bos": prep.bos_token_id,
                "chunk_contexts": chunk_contexts, "max_contexts": max_contexts, "env": env,
                "prompt_tokens": prep.prompt_tokens, "vocab_size": prep.vocab_size}
        cpus = ray_cfg.tokenizer_cpus(ray.cluster_resources())
        blocks = prep.sources["blocks"]
        total = len(jobs) + (len(blocks) - fresh_from if fresh_from is not None else 0)
        n = max(1, min(ray_cfg.tokenize_workers, total))
        Remote = ray.remote(TokenizeWorker)
        workers = [Remote.options(num_cpus=cpus, max_restarts=2).remote(spec) for _ in range(n)]
        log.info("started %d tokenising workers (%s CPU each) for %d jobs", n, cpus, total)
        return cls(workers, deque(jobs), fresh_from, blocks)

    # ---- scheduling ---------------------------------------------------------------------------
    def _next_job(self) -> Job | None:
        if self.jobs:
            return self.jobs.popleft()
        if self.fresh_from is not None and self.fresh_from < len(self.blocks):
            j = Job(self.fresh_from)
            self.fresh_from += 1
            return j
        return None

    def _launch(self, w: int, job: Job) -> None:
        job.worker = w
        job.gen = self.workers[w].tokenize.options(
            num_returns="streaming", _generator_backpressure_num_objects=4).remote(
            job.block, self.blocks[job.block], job.start, job.first_index, job.last_index,
            job.budget)
        self.active[w] = job
        self.blocks_tokenised.append((job.block, job.first_index))

    def fill(self, held_tokens: int, window: int) -> None:
        """Start jobs on idle workers while under the window (or when nothing is in flight)."""
        if self.stopped:
            return
        for w in range(len(self.workers)):
            if w in self.active:
                continue
            if self.active and held_tokens >= window:
                return
            job = self._next_job()
            if job is None:
                return
            self._launch(w, job)

    def waitables(self, held_tokens: int, window: int) -> list:
        if not self.active:
            return []
        lowest = min(self.active.values(), key=lambda j: j.block)
        return [j.gen for j in self.active.values() if j is lowest or held_tokens < window]

    def job_of(self, gen) -> Job | None:
        for j in self.active.values():
            if j.gen is gen:
                return j
        return None

    def take(self, job: Job) -> "tuple[object, dict] | None":
        """The job's next (arrays ref, descriptor), or None when it has finished (its worker is
        then free). A failed job is re-queued from its start, or raises after JOB_ATTEMPTS."""
        import ray

        try:
            arrays = next(job.gen)
            desc = ray.get(next(job.gen))
        except StopIteration:
            del self.active[job.worker]
            return None
        except Exception as e:  # noqa: BLE001 -- the worker died or its block failed
            del self.active[job.worker]
            if job.attempt >= JOB_ATTEMPTS:
                raise
            log.warning("tokenising block %d failed (attempt %d: %s); starting it again",
                        job.block, job.attempt, str(e).strip().splitlines()[-1][:200])
            self.jobs.appendleft(Job(job.block, job.start, job.first_index, job.last_index,
                                     job.attempt + 1, budget=job.budget))
            return None
        job.chunks += 1
        return arrays, desc

    def stop(self) -> None:
        """No new jobs (the frontier is done); running ones are left to backpressure."""
        self.stopped = True
        self.jobs.clear()
        self.fresh_from = None

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.active.clear()


def env_for_workers() -> dict:
    keys = ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HARVEST_CACHE",
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_REGION")
    return {k: os.environ[k] for k in keys if os.environ.get(k)}
