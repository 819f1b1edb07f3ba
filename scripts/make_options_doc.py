"""Regenerate docs/options.md from ODBConfig's fields and docstring.

    python scripts/make_options_doc.py
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import List, Optional

from odb.config import ODBConfig

HEADER = """# Every option

All options live in the frozen, validated `odb.ODBConfig`; `ODBDataLoader` and `odb.apply`
take them as keyword arguments too. Invalid values raise `ValueError`/`TypeError` naming the value,
the rule and the fix; an unknown name gets the closest option.

| option | default | meaning |
|---|---|---|"""

FOOTER = """
Loader-only arguments: every `torch.utils.data.DataLoader` argument (`batch_size=B` is your batch: each
optimizer step holds B x `gradient_accumulation_steps` x world size samples, `global_batch_size`, cut into
micro-batches under `token_budget`; left out, steps are budget-filled; `batch_sampler` is refused;
`in_order=False` is refused: odb reads samples in sampler order, which keeps batches independent of worker
timing and resumable; `shuffle=True` shuffles the samples and the batch order, and as in torch excludes a
`sampler`, with which the batch order is shuffled when the sampler shuffles),
`config=` (an ODBConfig), `lengths=` (per-sample lengths after processing: `len()` uses them, and odb then plans
in the batch sampler so that workers fetch and collate whole batches; see docs/algorithm.md),
`process_group=` (the ranks odb exchanges between; under a mesh, the data-parallel group, with `peer_group=` the
other ranks of a replica), `device_mesh=` (a torch DeviceMesh: odb plans over its data-parallel dimensions and every
other rank of a replica gets the same batches; docs/distributed.md, "Meshes"). `odb.apply(loader, ...)` reads your batch from the
loader's `batch_size` (1 for `batch_size=None`) in the same way (`global_batch_size=None` asks for
budget-filled steps; a `batch_sampler` of your own is refused), and also takes `shuffle=` (batch order;
default: whether the sampler shuffles) and `collate_fn=` (for loaders built with `batch_size=None`).

`token_budget="auto"` and its options (`memory_cap_bytes`, `memory_fraction`, `memory_meter`,
`auto_start_budget`, `auto_margin`, `balance`): what is measured, the counters it adds, what it is not used
with, in [cost-model.md](cost-model.md).

This table is generated from `ODBConfig`'s docstring by `scripts/make_options_doc.py`
(`python scripts/make_options_doc.py --check` fails when it is out of date; a test runs it).
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


def render() -> str:
    """docs/options.md as ODBConfig's fields and docstring give it."""
    descr = descriptions()
    rows = []
    for f in dataclasses.fields(ODBConfig):
        if f.name not in descr:
            raise SystemExit(f"ODBConfig.{f.name} has no entry under Attributes: in the docstring. Fix: add one.")
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        rows.append(f"| `{f.name}` | `{default}` | {descr[f.name]} |")
    return HEADER + "\n" + "\n".join(rows) + "\n" + FOOTER


def main(argv: Optional[List[str]] = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    path = Path(__file__).resolve().parent.parent / "docs" / "options.md"
    text = render()
    if check:
        if path.read_text() != text:
            print(f"{path} differs from ODBConfig's docstring. Fix: python scripts/make_options_doc.py")
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path} ({text.count(chr(10) + '| `')} options)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
