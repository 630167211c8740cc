"""How many torch threads a CPU step runs on: prompt-taking steps (prefill, mixed) may use more than decode steps.

A decode step on the CPU is hundreds of short parallel ops; on cores shared with the rest of a stack its threads wait
for one another at every one of them, which is why ``sluicegate up`` gives a CPU engine one thread on two cores
(docs/benchmarks.md, "A short spin, and two engine threads under up"). A prompt's prefill is the opposite: few, long,
compute-bound products (torch's int4 kernel at 44 rows takes about 1 ms a projection), where a second thread nearly
halves the time and a passive wait costs little. ``EngineConfig.cpu_prefill_threads`` sets the count for the steps
that take in prompt tokens; decode steps go back to the engine's own count, which the compiled decode graph was built
for.
"""

from __future__ import annotations

import torch


class CpuStepThreads:
    """Switches torch's intra-op thread count between decode steps and prompt-taking steps."""

    def __init__(self, decode_threads: int, prefill_threads: int) -> None:
        self.decode_threads = decode_threads
        self.prefill_threads = prefill_threads

    @classmethod
    def from_config(cls, prefill_threads: int, device: torch.device) -> CpuStepThreads | None:
        """None where nothing switches: on a GPU, or with no prefill count (0) or one equal to the decode count."""
        decode = torch.get_num_threads()
        if device.type != "cpu" or prefill_threads <= 0 or prefill_threads == decode:
            return None
        return cls(decode, prefill_threads)

    def enter(self, decode_only: bool) -> None:
        """Set the count for the next step."""
        wanted = self.decode_threads if decode_only else self.prefill_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
