"""Shared test settings: CPU only, one thread per rank, torch extensions cached in one place."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
