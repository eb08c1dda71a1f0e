"""Errors a user can fix, told apart from bugs, and how the command line reports them.

A run that stops on a bad config value, a missing or unreadable file, malformed data, a missing checkpoint or a
full disk is not a bug: the command line (:func:`report`) prints one or two lines naming what is wrong and how to
fix it and exits 2; a traceback is printed only for other errors, or for every error with ``--debug``.

What counts as such an error (:func:`is_expected`): a :class:`UserError`; an ``OSError`` (the file system said no:
a missing file, a read-only or full disk); a ``ValueError`` or ``ImportError`` raised by jrl's own code (its
config checks, data readers and loaders word these for the user; one raised inside a library is a bug until shown
otherwise); SQLite's "disk is full"; a device out of memory (XLA's ``RESOURCE_EXHAUSTED``), told with the knobs that
shrink a step. After a device ran out of memory the process leaves at once (``os._exit``): the other devices of its
program may wait in a collective for the one that failed, and the interpreter's normal exit would wait for them.
A crash in native code (a segmentation fault, an abort) prints every thread's Python stack before the process dies
(:mod:`faulthandler`), so a report says where it happened.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import shutil
import sys
import traceback
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)
_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")


class UserError(Exception):
    """A failure the user can fix; its message says what and how."""


class DiskFullError(UserError):
    """A write that did not fit: names the path, the bytes it needed and the bytes free there."""

    def __init__(self, path: str | os.PathLike, needed: int | None, what: str, after: str = ""):
        need = f"needs {human(needed)} and " if needed is not None else ""
        super().__init__(f"no space for {what} in {path}: it {need}{human(free_bytes(path))} is free there; free "
                         f"some space or choose another --output-dir{after}")
        self.path = str(path)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing parent), or None when unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human(n: int | None) -> str:
    """``n`` bytes in KiB / MiB / GiB."""
    if n is None:
        return "an unknown amount"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _raised_by_jrl(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith((_PACKAGE, _SCRIPTS))


def _disk_full(error: BaseException) -> bool:
    return ((isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))
            or (type(error).__name__ == "OperationalError" and "disk is full" in str(error)))


def device_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's out-of-memory on a device (``jax.errors.JaxRuntimeError`` ``RESOURCE_EXHAUSTED``),
    also when it reaches the user as the failure of every candidate of XLA's GPU autotuner (``NOT_FOUND: All configs
    failed during profiling``, each for lack of memory)."""
    text = str(error)
    return isinstance(error, RuntimeError) and (text.startswith("RESOURCE_EXHAUSTED") or (
        text.startswith("NOT_FOUND: All configs failed") and "RESOURCE_EXHAUSTED" in text))


def _out_of_memory_line(error: BaseException) -> str:
    """The line of ``error``'s message that says what could not be allocated."""
    lines = str(error).splitlines()
    return next((line.strip() for line in lines if "RESOURCE_EXHAUSTED" in line), lines[0])


#: What to try after a device ran out of memory.
OUT_OF_MEMORY_FIX = ("lower --optim.micro-batch-size, --data.prompts-per-batch or --rollout.max-new-tokens; for long "
                     "completions of different lengths use --rollout.kv.layout paged (the KV cache follows the tokens "
                     "generated; there a float8 pool, --rollout.kv.dtype float8_e4m3fn, holds twice the tokens, and "
                     "--rollout.kv.pages sets the pool's size); a row of up to 8,192 tokens keeps a float32 "
                     "[tokens, vocab] chunk of logits in the loss-fused head, --loss-head logprobs does not; on "
                     "several devices give the sampler a tensor axis (--rollout.mesh.tensor N)")


def is_expected(error: BaseException) -> bool:
    """Whether ``error`` is one a user can fix (module docstring) rather than a bug."""
    if isinstance(error, (UserError, OSError)) or _disk_full(error) or device_out_of_memory(error):
        return True
    return isinstance(error, (ValueError, ImportError)) and _raised_by_jrl(error)


def describe(error: BaseException) -> str:
    """At most two lines for the user: the message, with the free space where a disk was full."""
    if isinstance(error, OSError) and not isinstance(error, UserError) and error.strerror:
        where = error.filename or error.filename2
        text = f"{error.strerror}: {where}" if where else error.strerror
        if _disk_full(error) and where:
            text += f" ({human(free_bytes(where))} free there; free some space or choose another --output-dir)"
    elif device_out_of_memory(error):
        text = f"a device ran out of memory ({_out_of_memory_line(error)})\n{OUT_OF_MEMORY_FIX}"
    else:
        text = str(error).strip() or type(error).__name__
        if _disk_full(error):
            text += " (free some space or choose another --output-dir)"
    lines = text.splitlines()
    return "\n".join(lines[:2]) + (" ..." if len(lines) > 2 else "")


def report(main, argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit code; an expected error (:func:`is_expected`) is printed as ``error: ...`` (two lines at
    most, and a third saying how to see the traceback) and gives exit code 2. ``--debug`` in ``argv`` (or
    ``JRL_DEBUG=1``) lets every error raise with its traceback. A fatal signal prints every thread's stack."""
    faulthandler.enable(all_threads=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("JRL_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return main(argv)
    except Exception as e:  # noqa: BLE001 - sorted into the user's errors and bugs
        if debug or not is_expected(e):
            raise
        print(f"error: {describe(e)}\n(run again with --debug for the traceback)", file=sys.stderr, flush=True)
        if device_out_of_memory(e):
            sys.stdout.flush()
            os._exit(2)  # see the module docstring
        return 2
