"""The odb-integration agent skill: framework detection and the static audit, on sample scripts.

Every sample under agent-skills/odb-integration/tests/samples/ states what it must give
in two header lines (``# expect-framework: NAME`` and ``# expect-findings: rule, ...``):
good samples expect no finding, each bad one exactly the finding it was written for.
The scripts only read code with ``ast``; these tests also check that they never run it.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKILL = ROOT / "agent-skills" / "odb-integration"
SCRIPTS = SKILL / "scripts"
SAMPLES = sorted((SKILL / "tests" / "samples").glob("*.py"))
sys.path.insert(0, str(SCRIPTS))

import audit_integration  # noqa: E402
import detect_framework  # noqa: E402
from auditlib import RULES  # noqa: E402


def expectations(path: Path):
    head = path.read_text().splitlines()[:3]
    framework = next(line.split(":", 1)[1].strip() for line in head if line.startswith("# expect-framework:"))
    rules = next(line.split(":", 1)[1] for line in head if line.startswith("# expect-findings:"))
    return framework, sorted(r.strip() for r in rules.split(",") if r.strip())


def detect(source: str) -> detect_framework.Detection:
    return detect_framework.detect_source(textwrap.dedent(source))


def audit(source: str, framework=None) -> audit_integration.Report:
    return audit_integration.audit_source(textwrap.dedent(source), framework=framework)


def rules_of(report) -> list:
    return sorted(f.rule for f in report.findings)


# ---- the sample scripts ------------------------------------------------------------------------
def test_samples_cover_every_framework_and_rule():
    frameworks, rules = set(), set()
    for path in SAMPLES:
        fw, found = expectations(path)
        frameworks.add(fw)
        rules.update(found)
    assert frameworks >= {"plain_loop", "ddp", "hf_trainer", "seq2seq_trainer", "llamafactory", "accelerate",
                          "lightning"}
    assert rules == set(RULES), f"rules without a bad sample: {set(RULES) - rules}"
    goods = {expectations(p)[0] for p in SAMPLES if "_good" in p.stem}
    assert goods >= frameworks, f"frameworks without a good sample: {frameworks - goods}"


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample(path):
    framework, expected = expectations(path)
    assert detect_framework.detect_file(str(path)).framework == framework
    report = audit_integration.audit_file(str(path))
    assert report.framework == framework
    assert rules_of(report) == expected, audit_integration.format_text(report)
    errors = any(RULES[r][0] == "error" for r in expected)
    assert report.exit_code() == (1 if errors else 0)
    for f in report.findings:
        assert f.line >= 1 and f.fix and f.message and f.severity == RULES[f.rule][0]
        assert f.code == path.read_text().splitlines()[f.line - 1].strip()


# Training examples only: the audit checks training scripts (generate_batched.py is inference).
INFERENCE_EXAMPLES = {"generate_batched.py"}
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py")
                  if not p.name.startswith("_") and p.name not in INFERENCE_EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_repository_examples_pass_the_audit(example):
    report = audit_integration.audit_file(str(example))
    assert report.framework != "unknown" and report.errors == 0, audit_integration.format_text(report)


# ---- detection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("source, framework", [
    ("from transformers import Trainer as T\nT(model=m, args=a).train()\n", "hf_trainer"),
    ("import transformers as tf\ntrainer = tf.Seq2SeqTrainer(model=m)\n", "seq2seq_trainer"),
    ("from transformers.trainer import Trainer\nclass A(Trainer): pass\nclass B(A): pass\nB(model=m).train()\n",
     "hf_trainer"),
    ("from trl import SFTTrainer, SFTConfig\nSFTTrainer(model=m, args=SFTConfig(output_dir='o'))\n", "hf_trainer"),
    ("from llamafactory.train.tuner import run_exp\nrun_exp()\n", "llamafactory"),
    ("from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer\n"
     "from transformers import Seq2SeqTrainingArguments\nCustomSeq2SeqTrainer(model=m)\n", "llamafactory"),
    ("from .trainer import CustomSeq2SeqTrainer\nfrom transformers import Seq2SeqTrainingArguments\n"
     "CustomSeq2SeqTrainer(model=m).train()\n", "llamafactory"),
    ("import lightning as L\nL.Trainer(max_epochs=1).fit(m)\n", "lightning"),
    ("import pytorch_lightning as pl\nclass M(pl.LightningModule): pass\n", "lightning"),
    ("from lightning.pytorch import Trainer\nTrainer().fit(m)\n", "lightning"),
    ("from accelerate import Accelerator\nacc = Accelerator()\nfor b in dl:\n    acc.backward(m(b))\n",
     "accelerate"),
    ("import torch.distributed as dist\ndist.init_process_group('nccl')\nfor b in dl:\n    m(b).backward()\n",
     "ddp"),
    ("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(m)\n", "ddp"),
    ("for b in dl:\n    m(b).sum().backward()\n", "plain_loop"),
    ("while True:\n    step(m)\ndef step(m):\n    m().backward()\n", "plain_loop"),
    ("import torch\nprint(torch.ones(2))\n", "unknown"),
])
def test_detects(source, framework):
    assert detect(source).framework == framework


def test_mixed_imports_pick_the_framework_that_is_used():
    d = detect("""
        from transformers import Trainer, AutoModelForCausalLM   # imported, never used
        from accelerate import Accelerator
        import torch.distributed as dist
        accelerator = Accelerator()
        model = AutoModelForCausalLM.from_pretrained("m")
        for batch in loader:
            accelerator.backward(model(**batch).loss)
        if dist.get_rank() == 0:
            print("done")
    """)
    assert d.framework == "accelerate"
    assert d.frameworks == ["hf_trainer", "accelerate", "ddp", "plain_loop"]
    assert d.distributed
    hf = [e for e in d.evidence if e.framework == "hf_trainer"]
    assert hf and not any(e.strong for e in hf) and hf[0].line == 2


def test_trainer_beats_its_own_distributed_calls_and_reports_odb_aliases():
    d = detect("""
        import odb as o
        import torch
        from transformers import Trainer as T
        from odb.integrations.hf import enable_odb
        trainer = T(model=model, args=args, train_dataset=ds)
        enable_odb(trainer, token_budget=8192)
        if torch.distributed.is_initialized():
            print(torch.distributed.get_rank())
        o.apply
        trainer.train()
    """)
    assert (d.framework, d.distributed) == ("hf_trainer", True)
    assert d.odb_used == ["L7 odb.integrations.hf.enable_odb"]
    assert any(e.reason == "calls transformers.Trainer" and e.line == 6 for e in d.evidence)


def test_import_only_evidence_still_names_a_framework():
    d = detect("import lightning.pytorch as pl\nfrom my_project import Module\n")
    assert d.framework == "lightning" and not any(e.strong for e in d.evidence)


# ---- audit behaviour beyond the samples ------------------------------------------------------------
GOOD_LOOP = """
    import odb
    loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2, collate_fn=c)
    for batch in loader:
        info = odb.pop_step_info(batch)
        {forward}
        loss.backward()
        opt.step()
"""


def test_helper_functions_are_followed_both_ways():
    good = audit("""
        import odb
        def forward(model, b):
            return model(**b).loss
        def step(model, b):
            info = odb.pop_step_info(b)
            (forward(model, b) * info.loss_scale).backward()
        loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2, collate_fn=c)
        for batch in loader:
            step(model, batch)
            opt.step()
    """)
    assert good.findings == []
    bad = audit("""
        import odb
        def step(model, b):
            loss = model(**b).loss
            info = odb.pop_step_info(b)
            (loss * info.loss_scale).backward()
        loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2, collate_fn=c)
        for batch in loader:
            step(model, batch)
    """)
    assert rules_of(bad) == ["step-info-order"] and bad.findings[0].line == 4


@pytest.mark.parametrize("forward, rules", [
    ("loss = model(**batch).loss * info.loss_scale", []),
    ("loss = odb.scale_loss(model(**batch).loss, info)", []),
    ("from odb import scale_loss; loss = scale_loss(model(**batch).loss, info)", []),
    ("loss = model(**batch).loss; loss *= info.loss_scale", []),
    ("loss = model(**batch).loss.mul(info.loss_scale)", []),
    ("s = float(info.loss_scale); loss = s * model(**batch).loss", []),
    ("loss = model(input_ids=batch['input_ids']).loss * info.loss_scale", []),
    ("s = float(info.loss_scale); loss = model(**batch).loss", ["loss-scale"]),
    ("loss = model(**batch).loss / info.loss_scale", ["loss-scale"]),
    ("loss = model(**batch).loss; print(loss.item() * info.loss_scale)", ["loss-scale"]),
])
def test_loss_scale_forms(forward, rules):
    assert rules_of(audit(GOOD_LOOP.format(forward=forward))) == rules


@pytest.mark.parametrize("branch, rules", [
    ("if info.is_ghost: ghosts += 1", []),                    # counting ghosts is fine
    ("if info.is_ghost: continue", ["ghost-skip"]),
    ("if info.local_samples == 0: break", ["ghost-skip"]),
    ("if not info.is_ghost: warmup(model, batch)", ["ghost-skip"]),  # backward inside a helper
])
def test_ghost_branches(branch, rules):
    report = audit(f"""
        import odb
        def warmup(model, batch):
            model(**batch).loss.backward()
        loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2)
        for batch in loader:
            info = odb.pop_step_info(batch)
            {branch}
            (model(**batch).loss * info.loss_scale).backward()
            opt.step()
    """)
    assert rules_of(report) == rules


def test_accelerate_accumulate_block_without_accumulation_needs_nothing():
    report = audit("""
        import odb
        from accelerate import Accelerator
        from odb.integrations.accelerate import configure_accelerator, scale_loss
        accelerator = Accelerator()
        loader = configure_accelerator(accelerator, odb.ODBDataLoader(
            ds, token_budget=4096, sampler=odb.ShardSampler(ds), num_workers=2))
        for batch in loader:
            with accelerator.accumulate(model):
                info = odb.pop_step_info(batch)
                accelerator.backward(model(**batch).loss * info.loss_scale)
                optimizer.step()
    """)
    assert report.framework == "accelerate" and report.findings == []


def test_options_hidden_in_kwargs_are_not_reported_missing():
    report = audit("""
        import odb
        loader = odb.ODBDataLoader(ds, **loader_kwargs)
        for step, batch in enumerate(loader):
            info = odb.pop_step_info(batch)
            (model(**batch).loss * info.loss_scale).backward()
            if (step + 1) % 4 == 0:
                opt.step()
    """)
    assert report.findings == []


def test_ignore_comments():
    source = GOOD_LOOP.format(forward="loss = model(**batch).loss").replace(
        "loss.backward()", "loss.backward()  # odb-audit: ignore[loss-scale]")
    report = audit(source)
    assert report.findings == [] and report.ignored == 1
    other_rule = audit(source.replace("ignore[loss-scale]", "ignore[ghost-skip]"))
    assert rules_of(other_rule) == ["loss-scale"]
    everything = audit(source.replace("ignore[loss-scale]", "ignore"))
    assert everything.findings == []


def test_loops_that_only_iterate_need_no_pop():
    report = audit("""
        import odb
        loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2)
        for _ in loader:
            steps += 1
    """)
    assert report.findings == []


def test_each_loader_is_matched_with_the_loop_of_its_own_function():
    report = audit("""
        import odb
        def train():
            loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2, gradient_accumulation_steps=4)
            for batch in loader:
                info = odb.pop_step_info(batch)
                (model(**batch).loss * info.loss_scale).backward()
                if info.is_last_micro_step:
                    opt.step()
        def warmup():
            loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2)
            for batch in loader:
                info = odb.pop_step_info(batch)
                (model(**batch).loss * info.loss_scale).backward()
                opt.step()
    """)
    assert report.findings == []


def test_no_loop_is_reported_as_info_only():
    report = audit("""
        import odb
        loader = odb.ODBDataLoader(ds, token_budget=4096, num_workers=2)
        batch = next(iter(loader))
    """)
    assert rules_of(report) == ["no-loop"] and report.exit_code() == 0


def test_framework_override():
    source = "import odb\nloader = odb.ODBDataLoader(ds, token_budget=1, num_workers=2)\nfor b in loader: pass\n"
    assert rules_of(audit(source)) == []
    forced = audit(source, framework="ddp")  # e.g. torch.distributed is set up in another module
    assert (forced.framework, forced.distributed, rules_of(forced)) == ("ddp", True, ["ddp-sampler"])


def test_scripts_never_execute_the_code(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\nimport odb\nraise SystemExit(3)\n"
                      "from transformers import Trainer\nTrainer(model=m).train()\n")
    for tool in ("detect_framework.py", "audit_integration.py"):
        subprocess.run([sys.executable, str(SCRIPTS / tool), str(script)], capture_output=True, check=False)
    assert not marker.exists()
    assert detect_framework.detect_file(str(script)).framework == "hf_trainer"


def test_scripts_use_only_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {p.stem for p in SCRIPTS.glob("*.py")} | {"auditlib"}
    for path in SCRIPTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for mod in mods:
                assert mod.split(".")[0] in allowed, f"{path.name} imports {mod}"


# ---- command lines ---------------------------------------------------------------------------------
def run(tool: str, *args: str):
    return subprocess.run([sys.executable, str(SCRIPTS / tool), *args], capture_output=True, text=True,
                          timeout=60, cwd=str(ROOT))


def sample(name: str) -> str:
    return str(SKILL / "tests" / "samples" / name)


def test_cli_detect_json():
    proc = run("detect_framework.py", sample("ddp_good.py"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["framework"] == "ddp" and out["distributed"] is True
    assert out["reference"] == "references/ddp.md" and (SKILL / out["reference"]).exists()
    assert {"framework", "line", "code", "reason", "strong"} <= set(out["evidence"][0])
    text = run("detect_framework.py", sample("ddp_good.py"))
    assert text.returncode == 0 and "ddp" in text.stdout.splitlines()[0] and "evidence:" in text.stdout


def test_cli_audit_json_exit_codes():
    good = run("audit_integration.py", sample("plain_good.py"), "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["ok"] is True
    bad = run("audit_integration.py", sample("plain_bad_ghost_skip.py"), "--json")
    out = json.loads(bad.stdout)
    assert bad.returncode == 1 and out["ok"] is False and out["errors"] == 1
    assert out["findings"][0]["rule"] == "ghost-skip" and out["findings"][0]["line"] == 13
    assert {"rule", "severity", "line", "message", "fix", "code"} == set(out["findings"][0])
    warn = run("audit_integration.py", sample("plain_bad_no_workers.py"))
    assert warn.returncode == 0 and "warning [num-workers]" in warn.stdout
    assert run("audit_integration.py", sample("plain_bad_no_workers.py"), "--strict").returncode == 1


def test_cli_rules_and_bad_input(tmp_path):
    rules = run("audit_integration.py", "--list-rules", "--json")
    assert rules.returncode == 0 and set(json.loads(rules.stdout)) == set(RULES)
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    for tool in ("detect_framework.py", "audit_integration.py"):
        for path in (str(broken), str(tmp_path / "missing.py")):
            proc = run(tool, path, "--json")
            assert proc.returncode == 2 and proc.stdout == "" and "error:" in proc.stderr
    unknown = tmp_path / "nothing.py"
    unknown.write_text("x = 1\n")
    assert run("detect_framework.py", str(unknown)).returncode == 1


# ---- the skill's text --------------------------------------------------------------------------------
def test_skill_md_front_matter_links_and_rules():
    text = (SKILL / "SKILL.md").read_text()
    front = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert front and re.search(r"^name: odb-integration$", front.group(1), re.M)
    assert re.search(r"^description: .{40,}", front.group(1), re.M)
    for link in re.findall(r"\((references/[\w.]+|scripts/[\w.]+)\)", text):
        assert (SKILL / link).exists(), link
    for ref in set(detect_framework.REFERENCES.values()):
        assert (SKILL / ref).exists(), ref
    for rule in RULES:
        assert f"`{rule}`" in text, f"SKILL.md does not document rule {rule}"


def test_documented_odb_names_exist():
    """Every ``odb.<name>`` the skill mentions is exported by odb or is one of its modules (read, not imported)."""
    init = ast.parse((ROOT / "src" / "odb" / "__init__.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in init.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    modules = {p.stem for p in (ROOT / "src" / "odb").iterdir() if p.suffix == ".py" or p.is_dir()}
    names = set()
    for doc in [SKILL / "SKILL.md", *sorted((SKILL / "references").glob("*.md"))]:
        names.update(re.findall(r"\bodb\.([A-Za-z_]\w*)\b", doc.read_text()))
    missing = names - set(exported) - modules
    assert not missing, f"the skill names odb attributes that do not exist: {missing}"


def test_documented_integration_names_exist():
    """Every ``odb.integrations.<module>.<name>`` the skill mentions is defined there (read with ast)."""
    texts = [p.read_text() for p in [SKILL / "SKILL.md", *SKILL.glob("references/*.md"), *SAMPLES,
                                     *SCRIPTS.rglob("*.py")]]
    wanted = {}
    for text in texts:
        for module, name in re.findall(r"odb\.integrations\.(\w+)\.(\w+)", text):
            wanted.setdefault(module, set()).add(name)
        for module, names in re.findall(r"from odb\.integrations\.(\w+) import ([\w, ]+)", text):
            wanted.setdefault(module, set()).update(n.strip() for n in names.split(","))
    assert set(wanted) >= {"hf", "llamafactory", "accelerate", "lightning"}
    def source(module: str) -> Path:  # a module, or a package's __init__ (odb.integrations.hf)
        path = ROOT / "src" / "odb" / "integrations" / f"{module}.py"
        return path if path.exists() else ROOT / "src" / "odb" / "integrations" / module / "__init__.py"

    missing = sorted(m for m in wanted if not source(m).exists())
    assert not missing, (f"the skill names integration modules that do not exist: "
                         f"{['odb.integrations.' + m for m in missing]} (no src/odb/integrations/<name>.py or "
                         f"<name>/__init__.py). Fix: name an existing module in the skill, or add the module")
    for module, names in wanted.items():
        tree = ast.parse(source(module).read_text())
        exported = [n.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
        defined = set(ast.literal_eval(exported[0])) if exported else {
            n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert names <= defined, f"odb.integrations.{module} does not export {names - defined}"
