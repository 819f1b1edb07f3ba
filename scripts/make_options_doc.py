"""Regenerate docs/options.md from ODBConfig's fields and docstring.

    python scripts/make_options_doc.py
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from odb.config import ODBConfig

HEADER = """# Every option

All options live in the frozen, validated `odb.ODBConfig`; `ODBDataLoader` and `odb.apply`
take them as keyword arguments too. Invalid values raise `ValueError`/`TypeError` naming the value,
the rule and the fix; an unknown name gets the closest option.

| option | default | meaning |
|---|---|---|"""

FOOTER = """
Loader-only arguments: every `torch.utils.data.DataLoader` argument (`batch_size` must stay 1;
`in_order=False` is refused: odb reads samples in sampler order, which keeps batches independent of worker
timing and resumable; `shuffle=True` shuffles the samples and the batch order, and as in torch excludes a
`sampler`, with which the batch order is shuffled when the sampler shuffles),
`config=` (an ODBConfig), `lengths=` (per-sample lengths after processing: `len()` uses them, and odb then plans
in the batch sampler so that workers fetch and collate whole batches; see docs/algorithm.md),
`process_group=` (a gloo group for odb's exchange). `odb.apply(loader, ...)` also takes `shuffle=`
(batch order; default: whether the sampler shuffles) and `collate_fn=` (for loaders built with
`batch_size=None`).

This table is generated from `ODBConfig`'s docstring by `scripts/make_options_doc.py`.
"""


def descriptions() -> dict:
    doc = ODBConfig.__doc__ or ""
    attrs = doc[doc.index("Attributes:") + len("Attributes:"):]
    out = {}
    for entry in re.split(r"\n        (?=\w+: )", "\n" + attrs):
        name, _, text = entry.strip().partition(": ")
        if name:
            out[name] = " ".join(text.split()).replace("|", "\\|")
    return out


def main() -> None:
    descr = descriptions()
    rows = []
    for f in dataclasses.fields(ODBConfig):
        if f.name not in descr:
            raise SystemExit(f"ODBConfig.{f.name} has no entry under Attributes: in the docstring. Fix: add one.")
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        rows.append(f"| `{f.name}` | `{default}` | {descr[f.name]} |")
    path = Path(__file__).resolve().parent.parent / "docs" / "options.md"
    path.write_text(HEADER + "\n" + "\n".join(rows) + "\n" + FOOTER)
    print(f"wrote {path} ({len(rows)} options)")


if __name__ == "__main__":
    main()
