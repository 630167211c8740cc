"""The tensor-parallel ranks' process group and the collectives the parallel layers and the plan broadcast use.

The group is a private c10d process group over its own ``TCPStore`` (not ``torch.distributed``'s default group),
so several engines, each with its own ranks, can live in one process (tests) and nothing global is touched.
gloo on CPU, NCCL on CUDA. A rank that dies closes its connections: the next collective on any other rank
raises instead of waiting (gloo reports the closed peer at once; both backends also have ``timeout``).

``timeout`` bounds a collective under way, never the other ranks' wait for rank 0's next command: an engine idles
between requests for as long as nobody asks, and a rank that gave up waiting would leave the group and fail the
next request (it did: a worker idle for a minute under the 60 s default stopped at its next request).
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: How long ranks 1.. wait for rank 0's next command: in effect forever (finite, as the backends' clocks need).
#: Rank 0's death still ends the wait at once, its connections closing.
COMMAND_WAIT = timedelta(days=3650)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TPGroup:
    """One rank's view of the group: its rank, the world size and the collectives."""

    def __init__(self, rank: int, world_size: int, port: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
        if device.type == "cuda":
            self.pg: Any = dist.ProcessGroupNCCL(self.store, rank, world_size, timeout)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def all_reduce_min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` side by side along the last dimension (rank order)."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
        """Rank 0's ``tensor`` into every rank's, within ``timeout`` (None: the group's)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled); every other rank waits for it, however long rank 0 idles (see
        ``COMMAND_WAIT``), and returns what it sent."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            self._broadcast(size)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self._broadcast(payload)
            return obj
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size, COMMAND_WAIT)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload)
        return pickle.loads(payload.cpu().numpy().tobytes())
