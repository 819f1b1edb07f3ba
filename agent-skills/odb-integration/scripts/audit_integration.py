#!/usr/bin/env python3
"""Static checks of an odb integration, read with ``ast``: the script is never run or imported.

    python audit_integration.py train.py [--json] [--strict] [--framework NAME] [--list-rules]

Each finding has a rule id, a severity (error, warning, info), a line and a fix. Exit
status: 1 when there is an error (or, with --strict, a warning), 2 when the file cannot
be read or parsed, else 0. Silence one finding with a comment on its line:
``# odb-audit: ignore[rule-id]`` (or ``# odb-audit: ignore`` for all rules there).

The checks are heuristics over the source text: they follow names within the file and
one level of local helper functions, not values computed at run time. Standard
library only; Python 3.8+.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from detect_framework import PRIORITY, ScriptIndex, detect_index, load_index  # noqa: E402
from auditlib import RULES, Finding, audit_index  # noqa: E402

__all__ = ["Finding", "Report", "audit_source", "audit_file", "main", "RULES"]

_IGNORE = re.compile(r"#\s*odb-audit:\s*ignore(?:\[([\w\-, ]+)\])?")


@dataclass
class Report:
    path: str
    framework: str
    distributed: bool
    findings: List[Finding]
    ignored: int

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.severity == "warning" for f in self.findings)

    def exit_code(self, strict: bool = False) -> int:
        return 1 if self.errors or (strict and self.warnings) else 0

    def as_dict(self) -> dict:
        return {"path": self.path, "framework": self.framework, "distributed": self.distributed,
                "ok": self.errors == 0, "errors": self.errors, "warnings": self.warnings,
                "infos": len(self.findings) - self.errors - self.warnings, "ignored": self.ignored,
                "findings": [asdict(f) for f in self.findings]}


def _suppressed(index: ScriptIndex, finding: Finding) -> bool:
    raw = index.lines[finding.line - 1] if 0 < finding.line <= len(index.lines) else ""
    m = _IGNORE.search(raw)
    if not m:
        return False
    rules = {r.strip() for r in (m.group(1) or "").split(",") if r.strip()}
    return not rules or finding.rule in rules


def audit_index_report(index: ScriptIndex, framework: Optional[str] = None) -> Report:
    detection = detect_index(index)
    fw = framework or detection.framework
    distributed = detection.distributed or fw == "ddp"
    findings = list({(f.rule, f.line, f.message): f for f in audit_index(index, fw, distributed)}.values())
    kept = [f for f in findings if not _suppressed(index, f)]
    kept.sort(key=lambda f: (f.line, f.rule))
    return Report(index.path, fw, distributed, kept, len(findings) - len(kept))


def audit_source(source: str, path: str = "<script>", framework: Optional[str] = None) -> Report:
    return audit_index_report(ScriptIndex(source, path), framework)


def audit_file(path: str, framework: Optional[str] = None) -> Report:
    with open(path, encoding="utf-8") as f:
        return audit_source(f.read(), path, framework)


def format_text(r: Report) -> str:
    out = [f"{r.path}: framework {r.framework}{', distributed' if r.distributed else ''}"]
    for f in r.findings:
        out.append(f"{r.path}:{f.line}: {f.severity} [{f.rule}] {f.message}")
        if f.code:
            out.append(f"    {f.code}")
        out.append(f"    fix: {f.fix}")
    verdict = "FAIL" if r.errors else "ok"
    out.append(f"{verdict}: {r.errors} error(s), {r.warnings} warning(s), "
               f"{len(r.findings) - r.errors - r.warnings} info(s)"
               + (f", {r.ignored} ignored by comment" if r.ignored else ""))
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Audit an odb integration statically (never runs the script).")
    parser.add_argument("script", nargs="?", help="path of the training script")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--strict", action="store_true", help="warnings also give exit status 1")
    parser.add_argument("--framework", choices=PRIORITY, help="skip detection and audit as this framework")
    parser.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    args = parser.parse_args(argv)
    if args.list_rules:
        rules = {k: {"severity": sev, "checks": text} for k, (sev, text) in RULES.items()}
        print(json.dumps(rules, indent=2) if args.json else
              "\n".join(f"{k:18} {sev:8} {text}" for k, (sev, text) in RULES.items()))
        return 0
    if not args.script:
        parser.error("the script path is required")
    try:
        report = audit_index_report(load_index(args.script), args.framework)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_text(report))
    return report.exit_code(args.strict)


if __name__ == "__main__":
    sys.exit(main())
