"""Run a function on N gloo ranks in fresh processes (loopback only, bounded time).

``run_ranks(fn, world, *args)`` starts ``world`` spawned processes, each joining one gloo
process group on 127.0.0.1 and calling ``fn(rank, world, *args)`` (a module-level
function: spawn pickles it by name); it returns every rank's return value in rank order,
or raises with the first failing rank's traceback.  A rank that hangs (a collective its
peer never joins) fails the test after ``timeout`` seconds instead of stalling CI.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        try:
            # as bytes: a tensor put on the queue is shared by a handle that dies with this
            # process, before the parent reads it
            buf = io.BytesIO()
            torch.save(fn(rank, world, *args), buf)
            out.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world, port, fn, args, out), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results))} hung"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
