"""A demo corpus needing no download: the docstrings of Python's standard library.

`write_demo_corpus(path)` writes them as JSONL; `prepare_demo_data(out_dir, vocab_size)` then runs
the same tools a user runs (`tools/train_tokenizer.py`, `tools/preprocess_data.py`) to produce

    out_dir/demo.model                         SentencePiece tokenizer
    out_dir/demo_text_document.bin/.idx        --data-path out_dir/demo_text_document

skipping the steps whose outputs exist and are valid. The text depends on the Python version (its
docstrings), and is deterministic for a given interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

from megatron_ds.data import DataError
from megatron_ds.data.indexed import is_valid, read_index

# Pure-Python modules present in every CPython build (no tkinter, sqlite3, curses, ssl, lzma...).
DEMO_MODULES = tuple(
    sorted(
        (
            "abc",
            "argparse",
            "ast",
            "asyncio.base_events",
            "asyncio.events",
            "asyncio.locks",
            "asyncio.queues",
            "asyncio.streams",
            "asyncio.tasks",
            "base64",
            "bdb",
            "bisect",
            "calendar",
            "cmd",
            "code",
            "codecs",
            "collections",
            "concurrent.futures",
            "configparser",
            "contextlib",
            "copy",
            "csv",
            "dataclasses",
            "datetime",
            "decimal",
            "difflib",
            "dis",
            "doctest",
            "email.message",
            "email.utils",
            "enum",
            "filecmp",
            "fileinput",
            "fnmatch",
            "fractions",
            "ftplib",
            "functools",
            "getopt",
            "gettext",
            "glob",
            "gzip",
            "heapq",
            "hmac",
            "html.parser",
            "http.client",
            "http.cookiejar",
            "http.server",
            "imaplib",
            "inspect",
            "io",
            "ipaddress",
            "itertools",
            "json",
            "locale",
            "logging",
            "logging.handlers",
            "mailbox",
            "math",
            "mimetypes",
            "numbers",
            "operator",
            "optparse",
            "os",
            "pathlib",
            "pdb",
            "pickle",
            "pkgutil",
            "platform",
            "plistlib",
            "poplib",
            "pprint",
            "pstats",
            "pydoc",
            "queue",
            "random",
            "re",
            "reprlib",
            "sched",
            "secrets",
            "selectors",
            "shlex",
            "shutil",
            "smtplib",
            "socket",
            "socketserver",
            "statistics",
            "string",
            "struct",
            "subprocess",
            "sysconfig",
            "tarfile",
            "tempfile",
            "textwrap",
            "threading",
            "timeit",
            "tokenize",
            "trace",
            "traceback",
            "types",
            "typing",
            "unittest.case",
            "unittest.mock",
            "urllib.parse",
            "urllib.request",
            "uuid",
            "warnings",
            "weakref",
            "xml.dom.minidom",
            "xml.etree.ElementTree",
            "xmlrpc.client",
            "zipfile",
        )
    )
)
DEFAULT_MAX_BYTES = 1_500_000
MIN_DOC_CHARS = 80
"""Shorter docstrings ("Return self.") teach little and would dominate the document count."""


def _documented(module: ModuleType) -> Iterator[tuple[str, object]]:
    """(qualified name, object) of the module, then of its own classes/functions, then methods."""
    yield module.__name__, module
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def demo_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """Documents `name\\n\\ndocstring` in a fixed order, about `max_bytes` of UTF-8 in total."""
    seen: set[str] = set()
    total = 0
    for module_name in DEMO_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a stripped-down Python; the corpus just gets smaller
            continue
        for name, obj in _documented(module):
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < MIN_DOC_CHARS or doc in seen:
                continue
            seen.add(doc)
            text = f"{name}\n\n{doc}"
            total += len(text.encode("utf-8"))
            yield text
            if total >= max_bytes:
                return


def write_demo_corpus(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Write the demo corpus as JSONL (`{"text": ...}` per line); return the document count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for text in demo_documents(max_bytes):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


@dataclass(frozen=True)
class DemoData:
    """Paths produced by `prepare_demo_data`."""

    tokenizer_model: str
    """`--tokenizer-model` (with `--tokenizer-type SentencePieceTokenizer`)."""
    data_prefix: str
    """`--data-path`."""
    vocab_size: int
    """Pieces in the tokenizer."""


def _load_tool(name: str) -> ModuleType:
    """Import `tools/<name>.py` (not a package) so the demo runs exactly the user's code path."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools", f"{name}.py")
    if not os.path.isfile(path):
        raise DataError(
            f"{os.path.abspath(path)} not found; prepare the demo data from a source checkout of megatron_ds"
        )
    module_name = f"megatron_ds_tools_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # worker processes unpickle its functions by name
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def _tokenizer_ok(model: str, vocab_size: int) -> bool:
    from megatron_ds.data.tokenizer import SentencePieceTokenizer

    try:
        return SentencePieceTokenizer(model).vocab_size == vocab_size
    except DataError:
        return False


def prepare_demo_data(
    out_dir: str, vocab_size: int, max_bytes: int = DEFAULT_MAX_BYTES, quiet: bool = False
) -> DemoData:
    """Corpus -> tokenizer -> `.bin/.idx` in `out_dir`, skipping steps whose outputs are valid.

    A retrained tokenizer always re-tokenizes the data, so the pair never mixes vocabularies.
    """
    corpus = os.path.join(out_dir, "demo_corpus.jsonl")
    model_prefix = os.path.join(out_dir, "demo")
    model = model_prefix + ".model"
    data_prefix = os.path.join(out_dir, "demo")
    document = f"{data_prefix}_text_document"
    retrained = False
    if not _tokenizer_ok(model, vocab_size):
        if not os.path.isfile(corpus):
            write_demo_corpus(corpus, max_bytes)
        argv = [
            "--input",
            corpus,
            "--model-prefix",
            model_prefix,
            "--vocab-size",
            str(vocab_size),
            "--model-type",
            "bpe",
            "--seed",
            "1234",
            "--num-threads",
            "1",
        ]
        _run_tool("train_tokenizer", argv, quiet)
        retrained = True
    if retrained or not is_valid(document):
        if not os.path.isfile(corpus):
            write_demo_corpus(corpus, max_bytes)
        argv = [
            "--input",
            corpus,
            "--output-prefix",
            data_prefix,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            "1",
        ]
        _run_tool("preprocess_data", argv, quiet)
    read_index(document)  # the result must load; raises DataError naming the file otherwise
    return DemoData(model, document, vocab_size)


def _run_tool(name: str, argv: list[str], quiet: bool) -> None:
    tool = _load_tool(name)
    args = tool.parse_args(argv)
    if quiet:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            tool.run(args)
    else:
        tool.run(args)
