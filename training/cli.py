"""The command line's conventions, shared by every entry script: a bad input is one line naming it and the fix,
exit code 2, printed once per torchrun job (`exit_with_error`, `Parser`); JSON options are objects
(`json_object`); outputs are checked writable, and outside every model, checkpoint and run, before the work
(`check_writable`) and new ones never overwrite old ones (`numbered`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.util
import itertools
import json
import os
import re
import sys
import tempfile
import time
import typing
from pathlib import Path

from storage.places import kept_output

FOLLOWER_DELAY = 2.0  # seconds a rank other than 0 waits before exiting on an error under torchrun


def exit_with_error(message: str, code: int = 2) -> typing.NoReturn:
    """End a command-line run on a user error with one line: printed by rank 0 only (every rank of a torchrun job
    fails the same check) and written to torchrun's error file (TORCHELASTIC_ERROR_FILE), so that the launcher's
    report ends with it ("Root Cause ... traceback : <message>"); exit `code` (2: bad input, 1: a run stopped). The
    launcher names the earliest failure its root cause, so the other ranks wait `FOLLOWER_DELAY` seconds before
    exiting: were one of them to exit first, the report would end with its empty error file instead."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            with contextlib.suppress(OSError):
                Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    elif "TORCHELASTIC_ERROR_FILE" in os.environ:
        time.sleep(FOLLOWER_DELAY)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (exit_with_error), once per torchrun job, and which reads a value in
    scientific notation such as `--lr -1e-3` as a number (plain argparse takes it for an option and reports
    "expected one argument")."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --verb is no --verbose: an unknown option, not a guess
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$|^-nan$")

    def error(self, message: str) -> typing.NoReturn:
        exit_with_error(f"{self.prog}: error: {message} (see --help)")


PLUGIN_HELP = ("a module (a dotted name importable from here, or a .py file) whose register() adds attention types, "
               "fine-tuning modes or evaluation tasks, as examples/ does; repeatable, and needed again on resume")


def load_plugins(argv: typing.Sequence[str] | None) -> None:
    """Import each `--plugin MODULE` of `argv` (default: the command line) and call its register(), before any
    parser is built: what it registers is then among the names every option and check accepts. A module that
    cannot be imported, or has no register(), is one line (exit_with_error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = [args[i + 1] for i, word in enumerate(args[:-1]) if word == "--plugin"] + \
        [word.split("=", 1)[1] for word in args if word.startswith("--plugin=")]
    if names and "" not in sys.path and str(Path.cwd()) not in sys.path:  # dotted names from the working
        sys.path.append(str(Path.cwd()))  # directory, as python -m finds them
    for name in names:
        try:
            if name.endswith(".py"):
                spec = importlib.util.spec_from_file_location(f"plugin_{Path(name).stem}", name)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # as an import would (dataclasses look the module up there)
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(name)
        except (ImportError, OSError, ValueError, TypeError) as e:
            exit_with_error(f"error: --plugin {name}: cannot import it ({e}); pass a dotted module name importable "
                            "from the working directory, or a .py file")
        if not callable(getattr(module, "register", None)):
            exit_with_error(f"error: --plugin {name}: the module has no register() to call; define one that calls "
                            "register_attention, register_finetune or register_task")
        try:
            module.register()
        except Exception as e:  # noqa: BLE001 (whatever the plugin raises: one line naming it)
            exit_with_error(f"error: --plugin {name}: its register() failed ({type(e).__name__}: {e})")


def json_object(text: str) -> dict:
    """A JSON object from the command line -> the dict; an ArgumentTypeError (a usage error naming the option)
    otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ('{{\"key\": value, ...}}'), got {text}")
    return value


def numbered(path: Path) -> typing.Iterator[Path]:
    """path, path-2, path-3, ...: the names a new output takes beside earlier ones."""
    yield path
    for i in itertools.count(2):
        yield path.with_name(f"{path.name}-{i}")


def check_writable(path: Path, option: str, directory: bool = False) -> None:
    """ValueError naming `option` unless `path` (a file in an existing directory; a directory when `directory`,
    created if missing) can be written and keeps what is there: not inside a model or a checkpoint, nor at a name a
    run writes in its directory (storage/places.py `kept_output`, the one rule every entry point's outputs follow);
    checked before the work whose result it holds, not after."""
    folder = path if directory else path.parent
    if reason := kept_output(path, directory):
        raise ValueError(f"{option} {path}: {reason}; write it in a directory of its own (e.g. beside it)")
    try:
        if directory and path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file")
        if directory:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write in {folder} ({e.strerror or e}); choose another path") \
            from None
