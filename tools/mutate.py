"""Mutation testing, one module at a time, each against its own test files (`make mutate`).

Every target module gets its own copy of the tree under ``build/mutate/<name>/`` (cosmic-ray
edits the module in place, so the working tree is never touched, and two modules can run at
once). In that copy cosmic-ray lists the mutants of the module; those of the operators in
``KEPT_OPERATORS`` are kept, except on the lines ``LinesLeftOut`` names. The module's tests
run once unmutated (the baseline), then once per mutant, in random order, until the module's
share of the time budget is spent. Sessions are kept: running again continues with the mutants not yet tested,
and starts the module afresh when the module, its tests or this selection changed.

The summary (score per module, surviving mutants with their diffs) goes to
``results/mutation/summary.md`` and ``summary.json``. See docs/testing.md.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _mutation_runner as runner

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutate"
RESULTS = ROOT / "results" / "mutation"


@dataclass(frozen=True)
class Target:
    """A module to mutate, the test files that judge it, and optionally a ``pytest -k`` filter."""

    module: str
    tests: tuple[str, ...]
    select: str | None = None

    @property
    def name(self) -> str:
        return self.module.removeprefix("src/linattn/").removesuffix(".py").replace("/", ".")


def _targets(modules: list[str], tests: list[str], select: str | None = None) -> list[Target]:
    return [Target(module, tuple(tests), select) for module in modules]


_VQ_TESTS = ["tests/test_vq_attention.py", "tests/test_vq_decode.py"]
OPS = [
    *_targets([f"src/linattn/ops/vq/{name}.py" for name in
               ("attention", "reference", "relative", "block", "batched", "groups", "running", "schedule", "decode",
                "checks", "tensors", "cache", "soft")], _VQ_TESTS),
    Target("src/linattn/ops/sparse/local.py", ("tests/test_local_attention.py",)),
    *_targets(["src/linattn/ops/kernel/attention.py", "src/linattn/ops/kernel/forms.py"],
              ["tests/test_linear_attention.py", "tests/test_state.py"]),
    *_targets(["src/linattn/ops/softmax/attention.py", "src/linattn/ops/softmax/tiled.py"], ["tests/test_softmax.py"]),
    *_targets(["src/linattn/ops/delta/rule.py", "src/linattn/ops/delta/chunk.py"], ["tests/test_delta_rule.py"]),
    Target("src/linattn/ops/sparse/lsh.py", ("tests/test_lsh_attention.py",)),
    Target("src/linattn/ops/sparse/strided.py", ("tests/test_strided_attention.py",)),
    Target("src/linattn/ops/sparse/linformer.py", ("tests/test_linformer.py",)),
    Target("src/linattn/ops/kernel/feature_maps.py", ("tests/test_feature_maps.py",)),
    Target("src/linattn/ops/common/bias.py", ("tests/test_softmax.py", "tests/test_vq_attention.py")),
    Target("src/linattn/ops/vq/codebook.py", ("tests/test_quantizer.py", "tests/test_vq_decode.py")),
    Target("src/linattn/ops/vq/resident.py", ("tests/test_vq_decode.py", "tests/test_gau_decode.py")),
]
QUANTIZER = [
    Target("src/linattn/nn/codebook.py", ("tests/test_quantizer.py",)),
    Target("src/linattn/nn/quantizer.py", ("tests/test_quantizer.py", "tests/test_paper_variant.py")),
    Target("src/linattn/nn/fsq.py", ("tests/test_fsq.py",)),
]
NN = [
    Target("src/linattn/nn/gau.py", ("tests/test_gau.py", "tests/test_gau_decode.py", "tests/test_paper_variant.py")),
    Target("src/linattn/nn/_gau_decode.py", ("tests/test_gau_decode.py",)),
    Target("src/linattn/nn/attention.py",
           ("tests/test_layers.py", "tests/test_lm.py", "tests/test_attention_layer.py")),
    Target("src/linattn/nn/rotary.py", ("tests/test_layers.py", "tests/test_lm.py")),
    *_targets(["src/linattn/nn/delta_net.py", "src/linattn/nn/short_conv.py"],
              ["tests/test_delta_net.py", "tests/test_layers.py"]),
    Target("src/linattn/nn/linformer.py", ("tests/test_linformer.py", "tests/test_layers.py")),
    *_targets(["src/linattn/nn/retention.py", "src/linattn/nn/gla.py", "src/linattn/nn/gated_delta_net.py"],
              ["tests/test_gated_layers.py", "tests/test_state_mismatch.py"]),
    *_targets(["src/linattn/nn/vq_heads.py", "src/linattn/nn/hedgehog.py"], ["tests/test_vq_heads.py"]),
]
# The lm-eval, export, pipeline and Trainer runs load whole stacks; the rest judge the wrapper.
HF = _targets(["src/linattn/hf/modeling.py", "src/linattn/hf/cache.py", "src/linattn/hf/config.py"],
              ["tests/test_hf.py"], "not lm_eval and not export_cli and not pipeline and not hf_trainer")
MODELS = [
    *_targets(["src/linattn/models/lm.py", "src/linattn/models/config.py", "src/linattn/models/sampling.py"],
              ["tests/test_lm.py", "tests/test_layers.py"]),
    Target("src/linattn/models/layers.py", ("tests/test_layers.py", "tests/test_lm.py")),
]
# test_trainer.py's subprocess and two-process runs take minutes each; only its in-process tests (and the
# unit tests of test_train_units.py) judge train/.
_UNITS = "tests/test_train_units.py"
TRAIN = [
    Target("src/linattn/train/checkpoint.py", ("tests/test_checkpoint_ordering.py", "tests/test_trainer.py", _UNITS),
           "checkpoint or corrupt or foreign or pickle or leftover or same_step or flatten or rng_that "
           "or test_train_units or test_checkpoint_ordering"),
    Target("src/linattn/train/schedule.py", ("tests/test_trainer.py",), "learning_rate"),
    Target("src/linattn/train/trainer.py", ("tests/test_trainer.py", _UNITS),
           "tiny_run_learns or rng_that or resets_the_carried or test_train_units"),
    Target("src/linattn/train/optim.py", ("tests/test_optim.py",)),
    Target("src/linattn/train/evaluate.py", ("tests/test_trainer.py", _UNITS),
           "evaluate or tiny_run_learns or test_train_units"),
    *_targets(["src/linattn/train/config.py", "src/linattn/train/cli.py"],
              ["tests/test_train_cli.py", "tests/test_train_resume.py", _UNITS]),
    Target("src/linattn/train/lora.py", ("tests/test_lora.py",)),
]
TOOLS = [
    Target("src/linattn/convert.py", ("tests/test_convert.py",)),
    *_targets(["src/linattn/linearize.py", "src/linattn/attention_transfer.py"], ["tests/test_linearize.py"]),
    Target("src/linattn/inspector.py", ("tests/test_inspector.py",)),
]
TARGETS = OPS + QUANTIZER + NN + MODELS + TRAIN + HF + TOOLS

# cosmic-ray operators kept (regular expressions on its operator names; `cosmic-ray operators`
# lists them all). Left out: every other operator pair, number +-1 (mostly dims and indices),
# `|` (it also stands in type annotations), exception, decorator and variable replacement.
KEPT_OPERATORS = [
    r"core/ReplaceBinaryOperator_(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Div|Pow_Mul|Mod_FloorDiv|BitAnd_BitOr)",
    r"core/ReplaceComparisonOperator_(Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Eq_NotEq|NotEq_Eq|Is_IsNot|IsNot_Is)",
    r"core/ReplaceUnaryOperator_(Delete_USub|Delete_Not)",
    r"core/(ReplaceTrueWithFalse|ReplaceFalseWithTrue|ReplaceAndWithOr|ReplaceOrWithAnd|AddNot)",
    r"core/(ZeroIterationForLoop|ReplaceBreakWithContinue|ReplaceContinueWithBreak)",
]
HARNESS_VERSION = "2"  # bump when the selection of mutants changes


# -- the copy of the tree a module is mutated in ------------------------------------------


def sync_stage(stage: Path) -> None:
    """Refresh ``stage`` with the working tree's src/, tests/ and pyproject.toml."""
    stage.mkdir(parents=True, exist_ok=True)
    for folder in ("src", "tests"):
        shutil.rmtree(stage / folder, ignore_errors=True)
        shutil.copytree(ROOT / folder, stage / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy2(ROOT / "pyproject.toml", stage / "pyproject.toml")


PYTEST_OPTIONS = ["-x", "-q", "-p", "no:cacheprovider"]


def pytest_args(target: Target) -> list[str]:
    """The module's whole tests, as pytest arguments relative to the stage."""
    return [*PYTEST_OPTIONS, *target.tests, *(["-k", target.select] if target.select else [])]


def pytest_command(target: Target) -> str:
    """The same run as a command line (for the summary; run it from the module's stage)."""
    return shlex.join(["python", "-m", "pytest", *pytest_args(target)])


def fingerprints(target: Target) -> dict[str, str]:
    """What a session depends on: the module with the selection of mutants, and its tests."""

    def digest(*parts: bytes) -> str:
        value = hashlib.sha256(HARNESS_VERSION.encode())
        for part in parts:
            value.update(part)
        return value.hexdigest()

    return {"module": digest((ROOT / target.module).read_bytes(), json.dumps(KEPT_OPERATORS).encode()),
            "tests": digest(*((ROOT / path).read_bytes() for path in target.tests), json.dumps(target.select).encode())}


# -- the session: every mutant, then the selection ----------------------------------------


@dataclass(frozen=True)
class LinesLeftOut:
    """Lines whose mutants are not worth a test run."""

    raising: frozenset[int]  # raise statements: messages and exception types
    signatures: frozenset[int]  # def lines up to the body: the '*' and '/' markers are not operators

    @classmethod
    def of(cls, source: str) -> "LinesLeftOut":
        raising, signatures = set(), set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise):
                raising.update(range(node.lineno, node.end_lineno + 1))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                signatures.update(range(node.lineno, node.body[0].lineno))
        return cls(frozenset(raising), frozenset(signatures))


def skip_reason(mutation, kept: re.Pattern, left_out: LinesLeftOut) -> str | None:
    line = mutation.start_pos[0]
    if not kept.fullmatch(mutation.operator_name):
        return "operator not selected"
    if line in left_out.raising:
        return "inside a raise statement"
    if line in left_out.signatures and "BinaryOperator" in mutation.operator_name:
        return "binary operator in a signature"
    return None


def create_session(target: Target, stage: Path, session: Path) -> None:
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    module = stage / target.module
    kept = re.compile("|".join(f"(?:{pattern})" for pattern in KEPT_OPERATORS))
    left_out = LinesLeftOut.of(module.read_text(encoding="utf-8"))
    session.unlink(missing_ok=True)
    with use_db(str(session), WorkDB.Mode.create) as db:
        init([module], db, {})
        skipped: dict[str, list[str]] = {}
        for item in db.pending_work_items:
            reason = skip_reason(item.mutations[0], kept, left_out)
            if reason:
                skipped.setdefault(reason, []).append(item.job_id)
        for reason, job_ids in skipped.items():
            db.set_multiple_results(job_ids, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=reason))


def open_session(target: Target, stage: Path) -> Path:
    """The module's session. Created again when the module or the selection of mutants
    changed; when only the tests changed, its survivors are tested again (killed mutants stay
    killed: delete the stage to retest everything after tests were removed)."""
    session, stamp = stage / "session.sqlite", stage / "fingerprint"
    current = fingerprints(target)
    try:
        stored = json.loads(stamp.read_text())
    except (OSError, ValueError):
        stored = None
    if not session.exists() or not isinstance(stored, dict) or stored.get("module") != current["module"]:
        create_session(target, stage, session)
    elif stored.get("tests") != current["tests"]:
        forget_survivors(session)
    stamp.write_text(json.dumps(current))
    return session


def forget_survivors(session: Path) -> int:
    """Make the surviving mutants pending again; returns how many."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db
    from cosmic_ray.work_item import TestOutcome

    with use_db(str(session), WorkDB.Mode.open) as db:
        with db._session_maker.begin() as transaction:
            return transaction.query(WorkResultStorage).filter(
                WorkResultStorage.test_outcome == TestOutcome.SURVIVED).delete()


# -- running -------------------------------------------------------------------------------


def run_baseline(target: Target, stage: Path) -> tuple[bool, float, str, dict[int, set[str]]]:
    """The unmutated tests once: passed?, seconds, output, and the tests that run each line."""
    lines = stage / "lines.json"
    lines.unlink(missing_ok=True)
    recorder = runner.LineRecorder(stage / target.module, lines)
    start = time.monotonic()
    code, output = runner.run_pytest(pytest_args(target), stage=stage, timeout=float("inf"),
                                     log=stage / "baseline.log", plugins=(recorder,))
    seconds = time.monotonic() - start
    passed = code == 0 and lines.exists()
    return passed, seconds, output, runner.LineRecorder.read(lines) if passed else {}


# How a result names the tests that judged it (the first line of its output).
WHOLE, SELECTED = "tests: the module's whole tests", "tests: those that run the statement"


@dataclass(frozen=True)
class Judge:
    """Runs a mutant's tests: those that execute its statement, or the module's whole tests."""

    target: Target
    stage: Path
    lines: dict[int, set[str]]
    spans: dict[int, range]
    timeout: float

    def tests(self, line: int, whole: bool) -> tuple[str, list[str]]:
        chosen = None if whole else runner.tests_for(line, self.spans, self.lines)
        if chosen is None:
            return WHOLE, pytest_args(self.target)
        return f"{SELECTED} ({len(chosen)})", [*PYTEST_OPTIONS, *chosen]

    def __call__(self, mutation, whole: bool = False):
        """cosmic-ray's ``mutate_and_test``, with the tests run in a forked child."""
        import cosmic_ray.plugins
        from cosmic_ray.mutating import _make_diff, use_mutation
        from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

        operator = cosmic_ray.plugins.get_operator(mutation.operator_name)()
        with use_mutation(mutation.module_path, operator, mutation.occurrence) as (original, mutated):
            if mutated is None:
                return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
            which, args = self.tests(mutation.start_pos[0], whole)
            code, output = runner.run_pytest(args, stage=self.stage, timeout=self.timeout,
                                             log=self.stage / "mutant.log")
        if code is None:
            outcome, output = TestOutcome.KILLED, "timeout"
        else:
            outcome, output = (TestOutcome.SURVIVED if code == 0 else TestOutcome.KILLED), f"{which}\n{output}"
        diff = "\n".join(_make_diff(original, mutated, mutation.module_path))
        return WorkResult(output=output, diff=diff, test_outcome=outcome, worker_outcome=WorkerOutcome.NORMAL)


def run_mutants(session: Path, judge: Judge, until: float, seed: str) -> int:
    """Test pending mutants in a seeded random order until the wall-clock time ``until``; with
    time left, retest the survivors of a selection of tests on the module's whole tests."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=lambda item: (item.mutations[0].start_pos,
                                                                 item.mutations[0].operator_name,
                                                                 item.mutations[0].occurrence))
        random.Random(seed).shuffle(pending)
        tested = 0
        for item in pending:
            if time.time() >= until:
                return tested
            db.set_result(item.job_id, judge(item.mutations[0]))
            tested += 1
        selected_survivors = [item for item, result in db.completed_work_items
                              if result.test_outcome == TestOutcome.SURVIVED
                              and (result.output or "").startswith(SELECTED)]
        for item in sorted(selected_survivors, key=lambda item: item.job_id):
            if time.time() >= until:
                break
            db.set_result(item.job_id, judge(item.mutations[0], whole=True))
    return tested


def summarise_session(session: Path) -> dict:
    """Outcome counts and the surviving mutants (diffs with paths relative to the stage)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "timeout": 0, "survived": 0, "incompetent": 0, "not_reached": 0, "left_out": 0}
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        counts["not_reached"] = len(db.pending_work_items)
        for item, result in db.completed_work_items:
            mutation = item.mutations[0]
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["left_out"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                diff = result.diff.replace(f"{session.parent}/", "").replace("--- mutation diff ---\n", "")
                survivors.append({"line": mutation.start_pos[0], "operator": mutation.operator_name,
                                  "occurrence": mutation.occurrence, "diff": diff,
                                  "whole_tests": (result.output or "").startswith(WHOLE)})
            elif result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if result.output == "timeout" else "killed"] += 1
            else:
                counts["incompetent"] += 1
    survivors.sort(key=lambda s: (s["line"], s["operator"], s["occurrence"]))
    return {"counts": counts, "survivors": survivors}


def run_target(target: Target, until: float) -> dict:
    """Mutate one module until ``until`` (epoch seconds); the result also lands in its stage."""
    stage = WORK / target.name
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "result.json").unlink(missing_ok=True)
    result = {"module": target.module, "tests": list(target.tests), "select": target.select}
    missing = [path for path in (target.module, *target.tests) if not (ROOT / path).is_file()]
    if missing:
        result["status"] = f"skipped: missing {', '.join(missing)}"
    else:
        result.update(mutate_staged(target, stage, until))
    (stage / "result.json").write_text(json.dumps(result, indent=1))
    return result


def mutate_staged(target: Target, stage: Path, until: float) -> dict:
    started = time.monotonic()
    sync_stage(stage)
    session = open_session(target, stage)
    passed, baseline, output, lines = run_baseline(target, stage)
    result = {"baseline_seconds": round(baseline, 1), "command": pytest_command(target)}
    if not passed:
        result.update(status="baseline failed: the unmutated tests do not pass", output=output)
    else:
        spans = runner.statement_lines((stage / target.module).read_text(encoding="utf-8"))
        judge = Judge(target, stage, lines, spans, timeout=max(60.0, 4 * baseline))
        tested = run_mutants(session, judge, until, seed=target.module)
        result.update(status="ok", tested_this_run=tested)
    return {**result, **summarise_session(session), "seconds": round(time.monotonic() - started, 1)}


def count_mutants(target: Target) -> dict:
    stage = WORK / target.name
    sync_stage(stage)
    return summarise_session(open_session(target, stage))["counts"]


# -- the summary ---------------------------------------------------------------------------


def score(counts: dict) -> float | None:
    killed = counts["killed"] + counts["timeout"]
    judged = killed + counts["survived"]
    return killed / judged if judged else None


def markdown_summary(results: list[dict], elapsed: float | None) -> str:
    """The summary; ``elapsed`` None: assembled from the stored sessions (``--summary``)."""
    written = ("Assembled by `tools/mutate.py --summary` from the stored module sessions (`build/mutate/`)."
               if elapsed is None else f"Written by `tools/mutate.py` in {elapsed / 60:.1f} minutes.")
    lines = [
        "# Mutation testing summary", "",
        f"{written} Score = killed / (killed + survived); "
        "timeouts count as killed (a loaded machine can make them: rerun those modules on a quiet one); "
        "'not reached' mutants were left for the next run by the time budget.", "",
        "| module | tests | mutants | tested | killed | of which timeouts | survived | not reached | score | status |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        c = r.get("counts")
        if c is None:
            lines.append(f"| {r['module']} | {', '.join(r['tests'])} | | | | | | | | {r['status']} |")
            continue
        mutants = sum(v for k, v in c.items() if k != "left_out")
        tested = mutants - c["not_reached"]
        value = score(c)
        shown = "-" if value is None else f"{100 * value:.0f}%"
        tests = ", ".join(r["tests"]) + (f" (-k {r['select']})" if r.get("select") else "")
        lines.append(f"| {r['module']} | {tests} | {mutants} | {tested} | {c['killed'] + c['timeout']} | "
                     f"{c['timeout']} | {c['survived']} | {c['not_reached']} | {shown} | {r['status']} |")
    lines += ["", "## Surviving mutants", ""]
    for r in results:
        for survivor in r.get("survivors", []):
            judged = "" if survivor.get("whole_tests", True) else ", whole tests not run yet"
            lines += [f"### {r['module']}:{survivor['line']} ({survivor['operator']}{judged})", "", "```diff",
                      survivor["diff"].strip(), "```", ""]
    return "\n".join(lines) + "\n"


def write_summary(results: list[dict], elapsed: float | None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    seconds = None if elapsed is None else round(elapsed, 1)
    (RESULTS / "summary.json").write_text(json.dumps({"seconds": seconds, "modules": results}, indent=1))
    path = RESULTS / "summary.md"
    path.write_text(markdown_summary(results, elapsed))
    return path


# -- scheduling: modules share the budget, `--jobs` at a time, each in its own process ----


def share_until(deadline: float, remaining: int, jobs: int) -> float:
    """A fair share of the time left for the next module (time a module leaves unused rolls over)."""
    now = time.time()
    return now + (deadline - now) * min(1.0, jobs / remaining)


def _unfinished(target: Target) -> bool:
    stored = WORK / target.name / "result.json"
    result = json.loads(stored.read_text()) if stored.exists() else {}
    return result.get("status") == "ok" and result["counts"]["not_reached"] > 0


def run_all(targets: list[Target], budget_minutes: float, jobs: int) -> list[dict]:
    """Every module in turn, each with a fair share of the time left; modules with mutants left
    untested go round again while the budget lasts."""
    deadline = time.time() + 60 * budget_minutes
    queue = list(targets)
    running: dict[str, subprocess.Popen] = {}
    while queue or running:
        while queue and len(running) < jobs:
            target = queue.pop(0)
            until = share_until(deadline, len(queue) + 1 + len(running), jobs)
            print(f"mutating {target.module} until {time.strftime('%H:%M:%S', time.localtime(until))}", flush=True)
            running[target.name] = subprocess.Popen(
                [sys.executable, __file__, "--one", target.module, "--until", str(until)], cwd=ROOT)
        time.sleep(1)
        for name, process in list(running.items()):
            if process.poll() is not None:
                del running[name]
        if not queue and not running and deadline - time.time() > 60:
            queue = [target for target in targets if _unfinished(target)]  # the time left goes round again
    return stored_results(targets)


def stored_results(targets: list[Target]) -> list[dict]:
    """Each module's result as its last run left it in its stage."""
    results = []
    for target in targets:
        stored = WORK / target.name / "result.json"
        results.append(json.loads(stored.read_text()) if stored.exists() else
                       {"module": target.module, "tests": list(target.tests), "status": "no result"})
    return results


def select_targets(only: list[str]) -> list[Target]:
    if not only:
        return TARGETS
    chosen = [t for t in TARGETS if any(t.module == o or t.module.startswith(o.rstrip("/") + "/") for o in only)]
    if not chosen:
        sys.exit(f"no target matches {only}; targets: {', '.join(t.module for t in TARGETS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[], metavar="PATH",
                        help="mutate only these modules or folders (as listed in TARGETS)")
    parser.add_argument("--budget-minutes", type=float, default=55.0,
                        help="wall-clock budget for the whole run (default 55)")
    parser.add_argument("--jobs", type=int, default=2, help="modules mutated at once (default 2)")
    parser.add_argument("--count", action="store_true", help="count the mutants of each module; run no test")
    parser.add_argument("--summary", action="store_true",
                        help="write the summary from the modules' stored results (their last runs); run no test")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:
        (target,) = [t for t in TARGETS if t.module == args.one]
        runner.preload()
        run_target(target, args.until)
        return 0
    targets = select_targets(args.only)
    if args.count:
        for target in targets:
            if (ROOT / target.module).is_file():
                counts = count_mutants(target)
                print(f"{sum(v for k, v in counts.items() if k != 'left_out'):5d}  {target.module}")
        return 0
    if args.summary:
        path = write_summary(stored_results(targets), None)
    else:
        started = time.time()
        results = run_all(targets, args.budget_minutes, args.jobs)
        path = write_summary(results, time.time() - started)
    print(f"summary: {path.relative_to(ROOT)}")
    print(path.read_text().split("## Surviving mutants")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
