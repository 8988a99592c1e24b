"""Atomic output directories, JSON and progress bars, shared by checkpoint conversions; JSON inputs read
with one-line errors.

Output is written into a temporary directory next to the target, flushed to the device and renamed into place only
when complete and validated, so a failed conversion (or a power cut) leaves nothing behind and never touches the
source.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_ds.errors import UserError, first_line


class OutputExistsError(UserError):
    """The output directory already exists; conversions never overwrite."""


@contextlib.contextmanager
def atomic_directory(target: str, flag: str) -> Iterator[str]:
    """Yield a temporary directory that becomes `target` when the block ends without an error."""
    target = os.path.abspath(target)
    if os.path.lexists(target) and not (os.path.isdir(target) and not os.listdir(target)):
        raise OutputExistsError(f"{flag} {target}: already exists; choose a new directory (nothing is overwritten)")
    parent = os.path.dirname(target)
    clear_leftovers(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.incomplete.", dir=parent)
    except OSError as err:
        blocker = _file_in_the_way(parent)
        why = f"{blocker} is a file, not a directory" if blocker else err.strerror
        raise UserError(f"{flag} {target}: cannot write there ({why}); choose a writable directory") from None
    try:
        yield tmp
        _set_permissions(tmp)
        fsync_tree(tmp)
        if os.path.isdir(target):
            os.rmdir(target)  # the empty directory checked above
        os.rename(tmp, target)
        fsync_directory(parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(err)
        if failure is None:
            raise
        raise UserError(
            f"{flag} {target}: writing failed ({failure}{free_space(parent)}); nothing was written and the source is "
            f"untouched: free space or choose another directory"
        ) from None


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM)
_TORCH_WRITER_FAILURES = ("iostream error", "PytorchStreamWriter failed", "inline_container.cc")
"""How torch.save reports a failed write (its C++ writer does not pass the errno on)."""


def write_failure(err: BaseException) -> str | None:
    """What a write failure says, in one line: a full disk or quota, a read-only or failing device (an OSError, or
    torch.save's RuntimeError); None for any other error."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
        return err.strerror or str(err)
    text = str(err).strip()
    if isinstance(err, RuntimeError) and any(s in text for s in _TORCH_WRITER_FAILURES):
        return (text.splitlines() or [type(err).__name__])[0]
    return None


def free_space(directory: str) -> str:
    """'; N MiB free there' for a message (empty when it cannot be told)."""
    try:
        return f"; {shutil.disk_usage(directory).free / 2**20:.0f} MiB free there"
    except OSError:
        return ""


def clear_leftovers(target: str) -> None:
    """Remove the temporary directories earlier writes of `target` left when killed (SIGKILL, a power cut: nothing
    ran their clean-up); `atomic_directory`'s names, which nothing else uses."""
    parent, base = os.path.split(os.path.abspath(target))
    for path in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.incomplete.*")):
        shutil.rmtree(path, ignore_errors=True)


_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP)
"""What a file system that cannot flush an open file (some network and FUSE ones refuse directories) says."""


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a written file to the device before a rename publishes it."""
    _fsync(path)


def fsync_directory(path: str) -> None:
    """Flush `path`'s own entries (a rename into it, a new file) to the device."""
    _fsync(path)


def fsync_tree(directory: str) -> None:
    """Flush every file under `directory`, then its directories, to the device. A rename that publishes written
    files reaches the disk independently of their contents: without this, a power cut just after it can leave a
    complete-looking checkpoint of empty or torn files (the page cache held them). Symbolic links are skipped."""
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _fsync(path)
        _fsync(root)


def _set_permissions(directory: str) -> None:
    # mkdtemp makes a private directory; give the result the permissions of any new directory.
    umask = os.umask(0)
    os.umask(umask)
    for parent, _dirs, names in os.walk(directory):
        os.chmod(parent, 0o777 & ~umask)
        for name in names:
            os.chmod(os.path.join(parent, name), 0o666 & ~umask)


def check_writable_directory(flag: str, path: str, create: bool = True, error: type[UserError] = UserError) -> None:
    """The output directory `flag` names can be written: created and probed, or (`create=False`, a dry run) its
    nearest existing ancestor is a writable directory. Checked before training starts, so a typo fails in one line."""
    blocker = _file_in_the_way(path)
    if blocker:  # makedirs would say "File exists" or "Not a directory"
        raise error(f"{flag} {path}: {blocker} is a file, not a directory; choose a directory")
    if not create:
        nearest = _nearest_existing(path)  # a directory: no file is in the way
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise error(f"{flag} {path}: {nearest} is not writable; choose a writable directory")
        return
    try:
        _probe(path)
    except OSError as e:
        raise error(f"{flag} {path}: not writable ({e.strerror}); choose a writable directory") from None


def check_output_prefix(
    flag: str, prefix: str, outputs: Sequence[str] = (), error: type[UserError] = UserError, inputs: Sequence[str] = ()
) -> None:
    """`prefix`, the output files' name that `flag` gives, names a file (`outputs`, the files it makes, are no
    directories and none of `inputs`) in a directory that is created and can be written: checked before any work (a tokenizer's
    training, a corpus' tokenization), where the failed write came after it as an OSError naming a temporary file."""
    if not os.path.basename(prefix):
        raise error(f"{flag} {prefix}: ends in a directory; add a file name prefix")
    sources = {os.path.realpath(p) for p in inputs}
    for path in outputs:
        if os.path.isdir(path):
            raise error(f"{path}: a directory; remove it or give another {flag}")
        if os.path.realpath(path) in sources:  # replaced at the end, after being read: the input would be lost
            raise error(f"{flag} {prefix}: would write {path}, which is an --input; give another prefix")
    directory = os.path.dirname(os.path.abspath(prefix))
    blocker = _file_in_the_way(directory)
    if blocker:
        raise error(f"{flag} {prefix}: {blocker} is a file, not a directory; choose a directory")
    try:
        _probe(directory)
    except OSError as e:
        raise error(
            f"{flag} {prefix}: cannot write in {directory} ({e.strerror}); choose a writable directory"
        ) from None


def _nearest_existing(path: str) -> str:
    """`path` or its nearest ancestor that exists (a dangling link counts: it blocks as a file would)."""
    nearest = os.path.abspath(path)
    while not os.path.lexists(nearest):
        nearest = os.path.dirname(nearest)
    return nearest


def _file_in_the_way(directory: str) -> str | None:
    """The nearest existing path at or above `directory` when it is not a directory (nothing can be made there)."""
    nearest = _nearest_existing(directory)
    return None if os.path.isdir(nearest) else nearest


def _probe(directory: str) -> None:
    """Create `directory` if needed and write (then remove) a file in it; OSError when that cannot be done."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write_probe_{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def read_json(path: str, flag: str, error: type[UserError], fixes: tuple[str, str], at_line: bool = True) -> Any:
    """The JSON value in `path`, the file `flag` names; a file that cannot be read or is not JSON is one
    line of `error` with its fix (`fixes`: for each of the two; `at_line`: name the line of bad JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise error(f"{flag} {path}: cannot read it ({e.strerror}); {fixes[0]}") from None
    except json.JSONDecodeError as e:
        where = f"{e.msg} at line {e.lineno}" if at_line else e.msg
        raise error(f"{flag} {path}: not valid JSON ({where}); {fixes[1]}") from None
    except UnicodeDecodeError:  # a binary file: json.load would not even start
        raise error(f"{flag} {path}: not valid JSON (not UTF-8 text); {fixes[1]}") from None


def write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=False)
        f.write("\n")


def progress(total: int, description: str, enabled: bool) -> Any:
    """A tqdm progress bar on stderr (shown on terminals only), or a stand-in without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=description, unit="tensor", disable=None if enabled else True, leave=False)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        del n

    def close(self) -> None:
        pass


def load_failure(path: str, err: BaseException, damaged: str = "the file is damaged or truncated") -> str:
    """Why `torch.load(path, weights_only=True)`, a restricted unpickler (`interop.restricted_pickle`) or a
    safetensors read failed, as a one-line error: a refused pickled object is named as such (torch's own text
    advises turning the protection off), anything else is damage (`damaged` says whose and what)."""
    return refused_pickle(path, err) or f"{path}: unreadable ({_damage(path, err)}); {damaged}"


def _damage(path: str, err: BaseException) -> str:
    """What is wrong with the file, in a few words: torch's text for an empty or non-zip file advises re-saving
    with a torch.save option, and a truncated zip's runs on about a possible cause for a full line."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) == 0:
            return "empty, 0 bytes"
    text = first_line(err)
    if "mmap can only be used with files saved with" in text:
        return "not a zip archive, as torch.save writes"
    return text.split(". This is an internal miniz error")[0]  # torch's advice after it is the fix we give


def refused_pickle(path: str, err: BaseException) -> str | None:
    """`load_failure`'s line for a pickled object the load refused; None when `err` is something else."""
    text = str(err)
    found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)|^holds a pickled ([\w.]+),", text)
    if not found and "Weights only load failed" not in text:
        return None
    what = f"a pickled {found.group(1) or found.group(2)}" if found else "pickled objects other than tensors"
    return f"{path}: holds {what}, which such a file does not hold; refused (nothing in it was run)"
