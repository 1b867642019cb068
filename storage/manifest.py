"""Size and CRC-32 records of files, the integrity check every format the project writes shares (checkpoints' and
exports' manifest.json, prepared data's index.json). Imports nothing of the project, so any layer may use it."""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CRC_BLOCK = 16 * 2**20  # bytes per checksum: blocks are checksummed in parallel


def file_records(paths: list[Path]) -> dict[str, dict]:
    """name -> {"bytes": size, "crc32": [8 hex digits per CRC_BLOCK bytes]} of each file of `paths`. The blocks are
    read through memory maps (no copy) and checksummed by one thread pool (zlib releases the GIL): ~3 GB/s a core."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        jobs = {}
        for path in paths:
            size = path.stat().st_size
            view = None
            if size:
                f = stack.enter_context(path.open("rb"))
                view = memoryview(stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
                stack.callback(view.release)
            jobs[path.name] = (size, [pool.submit(zlib.crc32, view[i:i + CRC_BLOCK]) for i in range(0, size,
                                                                                                       CRC_BLOCK)])
        return {name: {"bytes": size, "crc32": [f"{job.result():08x}" for job in blocks]}
                for name, (size, blocks) in jobs.items()}
