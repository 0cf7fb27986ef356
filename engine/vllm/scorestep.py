"""Runner side of `logprob.0` / `entropy.0` (engine/capture/scores.py): after each forward, the
step's final hidden states through the model's own `compute_logits`, two float32 values per row
written into their tap slots.

The token after each row comes from the request's prompt, which every rank's runner receives
once, when the scheduler first sends the request (`SchedulerOutput.scheduled_new_reqs`, their
`prompt_token_ids`), and forgets when vLLM reports it finished (`finished_req_ids`). So a row at
the end of a prefill chunk still gets its next token, and a context's last prompt position gets
none (NaN). Generated positions are not served: engine/vllm/generate.py refuses these points.

Under tensor parallelism every rank computes (vLLM's logits gather is a collective); the values
reach the store from the output rank only, like every replicated point (its tap buffer is the one
the step ring publishes).
"""

from __future__ import annotations

import numpy as np
import torch

from . import compat
from ..capture import scores


class ScoreStep:
    """The score slots of one engine's tap buffer and the prompts of the requests in flight."""

    def __init__(self, slots: dict[str, int], vocab: int, dtype: torch.dtype):
        self.slots = slots                 # "logprob"/"entropy" -> tap slot
        self.vocab, self.dtype = int(vocab), dtype
        self.prompts: dict[str, np.ndarray] = {}
        self.rows = 0

    def track(self, scheduler_output) -> None:
        """Before the forward: remember new requests' prompts, forget finished ones."""
        for rid in compat.finished_req_ids(scheduler_output):
            self.prompts.pop(rid, None)
        for req in compat.new_requests(scheduler_output):
            ids = compat.prompt_token_ids(req)
            if ids is not None:
                self.prompts[compat.request_id(req)] = np.asarray(ids, dtype=np.int64)

    def run(self, runner, lay, write) -> None:
        """After the forward: compute this step's rows and `write(values [n, w], slot)` them
        (the tap op: into the buffer, or straight to the destinations on a CPU engine)."""
        hidden = compat.step_hidden_states(runner)[:lay.n]
        nxt = scores.next_token_ids(lay.req_ids, lay.counts, lay.starts, self.prompts)
        nxt_t = torch.from_numpy(nxt).to(hidden.device, non_blocking=True)
        got = scores.scores(hidden, nxt_t, runner.get_model().compute_logits, self.vocab)
        if got is None:   # a TP rank without the gathered logits: its buffer is not published
            return
        values = dict(zip(("logprob", "entropy"), got))
        for name, slot in self.slots.items():
            write(scores.pack(values[name], self.dtype), slot)
        self.rows += lay.n
