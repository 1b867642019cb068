"""Run a function in several fresh processes that form a gloo process group (a CPU stand-in for torchrun)."""

from __future__ import annotations

import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: object, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun does: two ranks share the two cores
    fn(*args)


def run_distributed(fn: object, *args: object, world_size: int = 2) -> None:
    """Run fn(*args) in `world_size` fresh processes that form a gloo group; a failure in any fails the test.
    The free port can be taken by another program before rank 0 binds it: then (only then) try another."""
    for attempt in range(3):
        try:
            torch.multiprocessing.spawn(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size)
            return
        except torch.multiprocessing.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:  # gloo's TCPStore: "code: -98, name: EADDRINUSE"
                raise
