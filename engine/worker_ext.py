"""Named in vLLM's `worker_extension_cls`: importing it in a worker process patches the runner.

vLLM imports this class in each worker before the model loads, so freeze taps are installed in
spawned workers exactly as in the calling process (engine core in-process).
"""

from . import harvest

harvest.install_patch()


class HarvestWorkerExtension:
    def harvest_summary(self) -> dict:
        st = harvest.ACTIVE
        return {} if st is None else {"steps": st.steps, "rows": st.rows, "mode": st.mode}
