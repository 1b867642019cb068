"""The integrity record every format the project writes shares: size and CRC-32 of each file (`file_records`), kept
in a directory's manifest.json (exports: `written_directory`, which writes a directory whole or not at all;
checkpoints, whose collective write is storage/checkpoint.py's) or in prepared data's index.json, and checked before
anything is read (`verify_files`, `damaged_export`). Imports nothing of the project, so any layer may use it."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import zlib
from collections.abc import Iterator
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


def fsync(path: Path) -> None:
    """Flush `path` (a file or a directory entry list) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def written_directory(path: Path) -> Iterator[Path]:
    """A directory written whole or not at all (exports): yields a temporary sibling `path`.tmp/ (a leftover one is
    removed first) to write into; then every file takes its mode from the umask, is fsynced and recorded in
    manifest.json, and the directory replaces `path` in one rename (an older `path` is deleted after it). On an
    error the temporary directory is removed and `path` is left as it was."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
        for file in files:
            os.chmod(file, 0o666 & ~umask)  # safetensors writes 0600
            fsync(file)
        with (tmp / MANIFEST_NAME).open("w") as f:
            json.dump({"files": file_records(files)}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        fsync(path.parent)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class DamagedCheckpoint(ValueError):
    """A checkpoint file is missing, or its size or checksum differs from the manifest: nothing was loaded.
    `problem`: the directory and what is wrong with it, without the advice."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


def read_manifest(path: Path) -> dict[str, dict]:
    """The file records of `path`/manifest.json; ValueError when it is unreadable or names a file outside `path`
    (anything but a plain file name)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())["files"]
        names = sorted(manifest)
        sizes = [int(record["bytes"]) for record in manifest.values()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST_NAME} is missing or unreadable ({type(e).__name__})") from None
    outside = [name for name in names if Path(name).name != name or name in (".", "..")]
    if outside or min(sizes, default=0) < 0:
        raise ValueError(f"{MANIFEST_NAME} names files outside the directory: {outside[:3]}")
    return manifest


def file_damage(path: Path, manifest: dict[str, dict], names: list[str]) -> list[str]:
    """What differs between the files `names` of `path` and their manifest records: sizes first (from the
    directory, nothing read), then checksums of the files whose size is right."""
    problems = [f"{name} is missing" for name in names if not (path / name).is_file()]
    present = [name for name in names if (path / name).is_file()]
    sized = []
    for name in present:
        size = (path / name).stat().st_size
        if size != manifest[name]["bytes"]:
            problems.append(f"{name} has {size} bytes; the manifest says {manifest[name]['bytes']}")
        else:
            sized.append(name)
    for name, found in file_records([path / name for name in sized]).items():
        if found != manifest[name]:
            problems.append(f"{name} has CRC-32 {','.join(found['crc32'])[:80]}; the manifest says "
                            f"{','.join(manifest[name]['crc32'])[:80]}")
    return problems


def verify_files(path: Path) -> None:
    """Check every file of `path` (an export, or a checkpoint read by one process) against its manifest, in this
    process alone; DamagedCheckpoint naming the first damaged file."""
    try:
        manifest = read_manifest(path)
        problems = file_damage(path, manifest, sorted(manifest))
    except ValueError as e:
        problems = [str(e)]
    if problems:
        problem = f"{path} is damaged: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                         else "")
        raise DamagedCheckpoint(f"{problem}; write it again (a run's export: --resume the run, which exports again)",
                                problem)


EXPORTS = ("model", "hf", "adapter")  # what the end of a run writes into its directory, each with a manifest


def damaged_export(out_dir: Path) -> str | None:
    """What is wrong with the first damaged export (EXPORTS) of run directory `out_dir`, or None when every one is
    intact."""
    for path in (out_dir / name for name in EXPORTS):
        if (path / MANIFEST_NAME).is_file():
            try:
                verify_files(path)
            except DamagedCheckpoint as e:
                return e.problem
    return None
