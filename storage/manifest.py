"""Size and CRC-32 records of files, the integrity check every format the project writes shares (checkpoints' and
exports' manifest.json, prepared data's index.json). Imports nothing of the project, so any layer may use it."""

from __future__ import annotations

import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST_NAME = "manifest.json"  # an export's or checkpoint's records of its files
CRC_BLOCK = 16 * 2**20  # bytes per checksum: blocks are checksummed in parallel


def file_records(paths: list[Path]) -> dict[str, dict]:
    """name -> {"bytes": size, "crc32": [8 hex digits per CRC_BLOCK bytes]} of each file of `paths`. A file's blocks
    are read through a memory map (no copy) and checksummed by one thread pool (zlib releases the GIL): ~3 GB/s a
    core. One file is open at a time, so any number of files stays within the process's file limit."""
    records = {}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        for path in paths:
            size = path.stat().st_size
            crcs = []
            if size:
                with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        jobs = [pool.submit(zlib.crc32, view[i:i + CRC_BLOCK]) for i in range(0, size, CRC_BLOCK)]
                        crcs = [f"{job.result():08x}" for job in jobs]
                    finally:
                        view.release()
            records[path.name] = {"bytes": size, "crc32": crcs}
    return records
