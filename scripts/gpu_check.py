#!/usr/bin/env python3
"""The CUDA check of kvscope's compiled kernels and engine (docs/kernels.md "GPU check"), for a GPU machine
with no network that receives a copy of the working tree of at most 64 MiB (the device machine lent to some
tasks). Run through scripts/gpu_check.sh; this file needs only the standard library.

What travels: the working tree (tracked and untracked-not-ignored files) and ``.gpu_check/`` (ignored; name
it in the device tool's ``carry``), which :func:`prepare` fills here: ``wheels/`` holds the wheels of the
packages kvscope.engine imports that the device image lacks (:data:`WHEEL_DISTRIBUTIONS`, at the versions
installed here, for CPython 3.12 on x86-64 Linux), ``tokenizer/`` the test model's tokenizer files. No
weights travel: the engine tests build tiny random-weight models on the device (tests/kernels/tiny_model.py).

On the device (``scripts/gpu_check.sh``): a probe (exit 2 without CUDA), then every step in :data:`STEPS`,
each under its own timeout, each run whatever the earlier ones did, each writing ``<step>.log`` and
``<step>.junit.xml`` to ``$OUT`` (default test-artifacts/gpu-check): 8 files, the most the device tool
returns. A pytest step passes when pytest exits 0 and nothing was skipped (a skip on the GPU machine is a
test that did not run). Exit status: 0 every step passed, 1 one failed, 2 no CUDA device.

``--dry-run`` (on any machine, CI included): prepares ``.gpu_check/``, lists what would travel with sizes
(under 64 MiB), lists the commands with their timeouts (under 8 minutes with the kill grace), collects every
pytest step's selection here (each must collect, nothing missing), checks that every test file with a
``gpu`` mark is in a step, and that every package the steps import is in the device image or in the
wheelhouse. Exit status 0 when all of that holds, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpu_check"
WHEELS = CARRY / "wheels"
TOKENIZER = CARRY / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_MODEL = "smollm2-135m"
TOKENIZER_ENV = "KVSCOPE_TEST_TOKENIZER_DIR"  # read by tests/kernels/tiny_model.py
WHEEL_DISTRIBUTIONS = ("msgspec", "gguf", "llguidance")
"""Imported by kvscope.engine and absent from the device image: carried as wheels."""
CARRIED_MODULES = ("msgspec", "gguf", "llguidance")
"""Their top-level modules (what they import must be on the device too)."""
DEVICE_PYTHON = ("3.12", "cp")
WHEEL_PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31)) + ("manylinux2014_x86_64",)
DEVICE_PACKAGES = frozenset(
    {
        "filelock",
        "fsspec",
        "huggingface-hub",
        "jinja2",
        "markupsafe",
        "mpmath",
        "networkx",
        "numpy",
        "nvidia-ml-py",
        "packaging",
        "pandas",
        "pluggy",
        "prometheus-client",
        "pygments",
        "pytest",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pyyaml",
        "regex",
        "requests",
        "safetensors",
        "six",
        "sympy",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "triton",
        "typing-extensions",
        "iniconfig",
        "idna",
        "urllib3",
        "certifi",
        "charset-normalizer",
        "hf-xet",
        "execnet",
        "psutil",
        "setuptools",
        "sentencepiece",
    }
)
"""Distributions of the device image that the steps import (its package list as the device tool documents
it, 2026-11-17); the dry run fails on an import outside this set and the wheelhouse."""
COPY_LIMIT = 64 << 20
"""Bytes of working tree + carried paths the device tool copies."""
TIME_LIMIT_S = 480
"""The whole check, probe and steps with their kill grace, stays under 8 minutes."""
KILL_GRACE_S = 3
PROBE_TIMEOUT_S = 20
SITE = "/tmp/kvscope-gpu-check-site"
TRITON_CACHE = "/tmp/kvscope-gpu-check-triton"
PY = "{python}"
OUT_DIR = "{out}"
PROBE = (
    "import sys, torch, triton\n"
    "if not torch.cuda.is_available():\n"
    "    print('gpu_check: torch sees no CUDA device', file=sys.stderr); sys.exit(2)\n"
    "p = torch.cuda.get_device_properties(0)\n"
    "print(f'gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, '\n"
    "      f'{p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, '\n"
    "      f'python {sys.version.split()[0]}')\n"
)
RUNTIME_MODULES = (
    "kvscope.engine.llm",
    "kvscope.engine.server.gpu_telemetry",
    "kvscope.kernels.bench",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
)
"""Imported by the steps at run time (inside tests, by the bench): part of the dry run's import check."""


@dataclass(frozen=True, slots=True)
class Step:
    """One command under a timeout; ``tests`` is the pytest selection of a pytest step (paths or node ids)."""

    name: str
    timeout_s: int
    argv: tuple[str, ...]
    tests: tuple[str, ...] = ()


def pytest_step(name: str, timeout_s: int, tests: tuple[str, ...], *extra: str) -> Step:
    """A pytest step over ``tests`` (+ ``extra`` options) writing ``$OUT/<name>.junit.xml``."""
    argv = (
        PY,
        "-P",
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit2",
        f"--junitxml={OUT_DIR}/{name}.junit.xml",
        *extra,
        *tests,
    )
    return Step(name, timeout_s, argv, tests)


STEPS = (
    Step(
        "setup",
        30,
        (
            PY,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
        ),
    ),
    pytest_step(
        "kernels",  # the interpreter's grids, compiled, and the device-sized kernel cases
        195,
        (
            "tests/kernels/test_paged_attention.py",
            "tests/kernels/test_paged_attention_gpu.py",
            "tests/kernels/test_merge_attn_states.py",
            "tests/kernels/test_reshape_and_cache.py",
            "tests/kernels/test_large_block_ids.py",
            "tests/kernels/test_attention_triton.py",
            "tests/kernels/test_launcher_errors.py",
            "tests/kernels/test_bench.py",
        ),
        "-n",
        "4",  # Triton compiles each specialisation on the CPU: four at once
    ),
    pytest_step(
        "engine",  # tiny random-weight models: Triton vs torch greedy parity, CUDA KV budget, memory gauges
        145,
        ("tests/kernels/test_engine_triton_gpu.py", "tests/engine/test_cuda_memory.py"),
    ),
    Step("bench", 70, (PY, "-P", "-m", "kvscope.kernels.bench", "--quick")),
)
"""The check's steps, in order (each runs whatever the earlier ones did)."""


def wheel_files() -> list[Path]:
    return sorted(WHEELS.glob("*.whl"))


def step_argv(step: Step, python: str, out: Path) -> list[str]:
    """``step``'s command with the interpreter and output folder filled in (setup: + the carried wheels)."""
    argv = [a.replace(PY, python).replace(OUT_DIR, str(out)) for a in step.argv]
    if step.name == "setup":
        argv += ["--target", SITE, *(str(p.relative_to(ROOT)) for p in wheel_files())]
    return argv


def step_env(python_path: str = f"{SITE}:{ROOT / 'src'}") -> dict[str, str]:
    """The steps' environment: compiled Triton, the carried wheels and kvscope (src/kvscope) importable, the
    carried tokenizer, no network for Hugging Face."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TRITON_INTERPRET")}
    return env | {
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": TRITON_CACHE,
        "PYTHONPATH": python_path,
        "PYTHONUNBUFFERED": "1",
        TOKENIZER_ENV: str(TOKENIZER),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


# ---------------------------------------------------------------- the run, on the device


@dataclass(slots=True)
class Outcome:
    name: str
    returncode: int | None  # None: killed at its timeout
    seconds: float
    counts: dict[str, int]
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.counts.get("skipped", 0) == 0 and not self.note


def run_command(argv: list[str], timeout_s: int, log: Path, env: dict[str, str]) -> tuple[int | None, float]:
    """Run ``argv`` with stdout and stderr to ``log``; at ``timeout_s`` its whole process group gets SIGTERM,
    then SIGKILL after :data:`KILL_GRACE_S`. Returns (exit status or None when timed out, seconds)."""
    start = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {shlex.join(argv)}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            sink.write(f"gpu_check: cannot start: {exc}\n")
            return 127, time.monotonic() - start
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            sink.write(f"\ngpu_check: killed at its {timeout_s} s timeout\n")
    return returncode, time.monotonic() - start


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests/failures/errors/skipped of a junit file (summed over its testsuites), None when absent or
    unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def write_junit(path: Path, step: str, returncode: int | None, seconds: float, log: Path) -> None:
    """A one-case junit file for a step that wrote none (a plain command, or pytest killed or not started)."""
    suite = ET.Element("testsuite", name=f"gpu_check.{step}", tests="1", time=f"{seconds:.1f}")
    case = ET.SubElement(suite, "testcase", classname="gpu_check", name=step, time=f"{seconds:.1f}")
    failed = returncode != 0
    suite.set("failures", "1" if failed else "0")
    suite.set("errors", "0")
    suite.set("skipped", "0")
    if failed:
        reason = "timed out" if returncode is None else f"exit status {returncode}"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        ET.SubElement(case, "failure", message=reason).text = tail
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def run_step(step: Step, python: str, out: Path, env: dict[str, str]) -> Outcome:
    log, junit = out / f"{step.name}.log", out / f"{step.name}.junit.xml"
    junit.unlink(missing_ok=True)
    returncode, seconds = run_command(step_argv(step, python, out), step.timeout_s, log, env)
    counts = junit_counts(junit) if step.tests else None
    note = ""
    if counts is None:
        write_junit(junit, step.name, returncode, seconds, log)
        counts = junit_counts(junit) or {}
        if step.tests:
            note = "pytest wrote no junit file"
    if step.name == "setup" and not wheel_files():
        note = "no wheels in .gpu_check/wheels (run scripts/gpu_check.sh --prepare here first)"
    return Outcome(step.name, returncode, seconds, counts, note)


def run(python: str, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = step_env()
    try:
        probe = subprocess.run(
            [python, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
        print((probe.stdout + probe.stderr).strip(), flush=True)
        if probe.returncode == 2:
            print("gpu_check: no CUDA device; nothing to check here (--dry-run checks the plan on CPU)")
            return 2
    except subprocess.TimeoutExpired:
        print(f"gpu_check: the CUDA probe took over {PROBE_TIMEOUT_S} s; the steps run anyway", flush=True)
    outcomes = []
    for step in STEPS:
        outcome = run_step(step, python, out, env)
        outcomes.append(outcome)
        status = "ok" if outcome.ok else "FAILED"
        rc = "timeout" if outcome.returncode is None else f"rc {outcome.returncode}"
        counts = " ".join(f"{k} {v}" for k, v in outcome.counts.items())
        print(
            f"gpu_check: {step.name:8} {status:6} {rc:8} {outcome.seconds:6.1f} s / {step.timeout_s} s"
            + f"  {counts}"
            + (f"  ({outcome.note})" if outcome.note else ""),
            flush=True,
        )
        if not outcome.ok:
            log = out / f"{step.name}.log"
            print("\n".join("    " + line for line in log.read_text(errors="replace").splitlines()[-15:]))
    print(f"gpu_check: logs and junit files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if all(o.ok for o in outcomes) else 1


# ---------------------------------------------------------------- preparing and checking, here


def prepare(python: str) -> list[str]:
    """Fill ``.gpu_check/``: the tokenizer files of the test model (pulled on first use) and one wheel per
    :data:`WHEEL_DISTRIBUTIONS` at the version installed for ``python``. Returns the problems (empty:
    done)."""
    problems = []
    TOKENIZER.mkdir(parents=True, exist_ok=True)
    if not all((TOKENIZER / name).is_file() for name in TOKENIZER_FILES):
        code = (
            "from kvscope.engine.weights.files import resolve_model_dir; "
            f"print(resolve_model_dir({TOKENIZER_MODEL!r}))"
        )
        found = subprocess.run([python, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True)
        if found.returncode != 0:
            return [f"the {TOKENIZER_MODEL} tokenizer: {found.stderr.strip()[-500:]}"]
        source = Path(found.stdout.strip().splitlines()[-1])
        for name in TOKENIZER_FILES:
            shutil.copy(source / name, TOKENIZER / name)
    versions = subprocess.run(
        [
            python,
            "-P",
            "-c",
            f"import importlib.metadata as m; print(*[m.version(d) for d in {WHEEL_DISTRIBUTIONS}])",
        ],
        capture_output=True,
        text=True,
    )
    if versions.returncode != 0:
        return [f"versions of {WHEEL_DISTRIBUTIONS}: {versions.stderr.strip()[-500:]}"]
    WHEELS.mkdir(parents=True, exist_ok=True)
    for dist, version in zip(WHEEL_DISTRIBUTIONS, versions.stdout.split(), strict=True):
        prefix = f"{dist.replace('-', '_')}-{version}-"
        have = [p for p in WHEELS.glob(f"{dist.replace('-', '_')}-*.whl")]
        for stale in (p for p in have if not p.name.startswith(prefix)):
            stale.unlink()  # one version of each: two stop the whole install
        if any(p.name.startswith(prefix) for p in have):
            continue
        platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
        with tempfile.TemporaryDirectory() as tmp:
            got = subprocess.run(
                [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
                + ["--python-version", DEVICE_PYTHON[0], "--implementation", DEVICE_PYTHON[1], *platforms]
                + ["-d", tmp, f"{dist}=={version}"],
                capture_output=True,
                text=True,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if got.returncode != 0 or len(wheels) != 1:
                problems.append(f"wheel of {dist}=={version}: {got.stderr.strip()[-500:]}")
                continue
            shutil.move(wheels[0], WHEELS / wheels[0].name)
    return problems


def wheel_requirements(wheel: Path) -> set[str]:
    """The distributions a wheel requires outside its extras (its METADATA's Requires-Dist), normalised."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    required = set()
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            spec = line.removeprefix("Requires-Dist:").strip()
            required.add(re.split(r"[\s;<>=!~(\[]", spec, maxsplit=1)[0].lower().replace("_", "-"))
    return required


def working_tree() -> tuple[int, int]:
    """(files, bytes) of what the device tool copies besides the carried paths: tracked and untracked files
    that git does not ignore (links as links)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    files = size = 0
    for name in filter(None, listed.split(b"\0")):
        try:
            size += os.lstat(ROOT / os.fsdecode(name)).st_size
            files += 1
        except FileNotFoundError:  # deleted, not yet staged
            pass
    return files, size


COLLECT = """
import builtins, importlib, importlib.metadata, json, sys
import pytest

FIRST_PARTY, CARRIED = ("kvscope", "tests", "conftest"), set(json.loads(sys.argv[2]))
imported = set()
real_import = builtins.__import__

def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = ((globals or {}).get("__name__") or "").split(".")[0]
    if level == 0 and (importer in FIRST_PARTY or importer in CARRIED):
        imported.add(name.split(".")[0])
    return real_import(name, globals, locals, fromlist, level)

class Collected:
    def __init__(self):
        self.ids = []
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

builtins.__import__ = recording_import
collected = Collected()
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[3:]], plugins=[collected])
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
builtins.__import__ = real_import
owners = importlib.metadata.packages_distributions()
tops = {t for t in imported if t in sys.modules} - set(sys.stdlib_module_names) - set(FIRST_PARTY)
dists = sorted({d for t in tops for d in owners.get(t, [t])})
print("GPU_CHECK_RESULT " + json.dumps({"rc": int(rc), "ids": collected.ids, "dists": dists}))
"""
"""Collects a pytest selection, imports :data:`RUNTIME_MODULES`, and reports the node ids and the
distributions that kvscope, the tests and the carried packages import directly and successfully (an
optional import that fails here is not needed; what the device's own packages import is their business)."""


def collect(python: str, selection: tuple[str, ...]) -> dict:
    """Collect ``selection`` here (as the steps would, plugins not autoloaded: the device has other ones),
    then import :data:`RUNTIME_MODULES`; returns pytest's exit status, the node ids and the distributions
    of everything imported."""
    env = step_env(str(ROOT / "src")) | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("TRITON_INTERPRET")  # tests/kernels/conftest.py picks the interpreter on a machine without CUDA
    done = subprocess.run(
        [python, "-P", "-c", COLLECT, json.dumps(RUNTIME_MODULES), json.dumps(CARRIED_MODULES), *selection],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
    if not lines:
        return {"rc": done.returncode, "ids": [], "dists": [], "output": (done.stdout + done.stderr)[-3000:]}
    return json.loads(lines[-1].removeprefix("GPU_CHECK_RESULT ")) | {"output": done.stdout[-3000:]}


def gpu_marked_files(python: str) -> tuple[list[str], str]:
    """Test files with a test marked ``gpu``: the files that mention ``mark.gpu``, collected with ``-m gpu``
    (a mention inside a string marks nothing). Returns (files, collection output when it failed)."""
    candidates = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )
    found = collect(python, ("-m", "gpu", *candidates))
    files = sorted({i.split("::")[0] for i in found["ids"]})
    return files, ("" if found["rc"] in (0, 5) else found["output"])


def dry_run(python: str) -> int:
    problems = prepare(python)
    print("gpu_check --dry-run: what travels")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(CARRY)], cwd=ROOT).returncode == 0
    if not ignored:
        problems.append(
            f"{CARRY.relative_to(ROOT)} is not ignored by git (.gitignore): carry takes ignored paths"
        )
    carried = sorted(p for p in CARRY.rglob("*") if p.is_file())
    carried_bytes = 0
    for path in carried:
        size = path.stat().st_size
        carried_bytes += size
        print(f"  carry {str(path.relative_to(ROOT)):78} {size:>12,} B")
    files, tree_bytes = working_tree()
    total = tree_bytes + carried_bytes
    print(f"  working tree: {files} files, {tree_bytes:,} B")
    print(f"  total {total:,} B = {total / 2**20:.1f} MiB of {COPY_LIMIT >> 20} MiB")
    if total >= COPY_LIMIT:
        problems.append(f"{total:,} B travel, over {COPY_LIMIT:,}")
    names = {p.name.split("-")[0].replace("_", "-").lower() for p in wheel_files()}
    for dist in WHEEL_DISTRIBUTIONS:
        if dist not in names:
            problems.append(f"no wheel of {dist} in {WHEELS.relative_to(ROOT)}")

    print("gpu_check --dry-run: what runs on the device (python3 there, $OUT the output folder)")
    print(f"  probe   {PROBE_TIMEOUT_S:4} s  python3 -c <CUDA probe: exit 2 without a device>")
    for step in STEPS:
        print(f"  {step.name:7} {step.timeout_s:4} s  {shlex.join(step_argv(step, 'python3', Path('$OUT')))}")
    budget = PROBE_TIMEOUT_S + sum(s.timeout_s for s in STEPS) + KILL_GRACE_S * (len(STEPS) + 1)
    print(f"  timeouts + kill grace: {budget} s of {TIME_LIMIT_S} s")
    if budget >= TIME_LIMIT_S:
        problems.append(f"the steps may take {budget} s, over {TIME_LIMIT_S} s")

    print("gpu_check --dry-run: the pytest steps' selections, collected here")
    selected: set[str] = set()
    dists: set[str] = set()
    for step in (s for s in STEPS if s.tests):
        found = collect(python, step.tests)
        print(f"  {step.name:7} pytest exit {found['rc']}, {len(found['ids'])} tests")
        if found["rc"] != 0 or not found["ids"]:
            problems.append(f"step {step.name}: collection failed\n{found['output']}")
        for test in step.tests:
            if not any(i == test or i.startswith(f"{test}::") for i in found["ids"]):
                problems.append(f"step {step.name}: {test} collects no test")
        selected |= {i.split("::")[0] for i in found["ids"]}
        dists |= set(found["dists"])
    marked, failed = gpu_marked_files(python)
    outside = [f for f in marked if f not in selected]
    print(f"  files with gpu-marked tests: {len(marked)}, outside every step: {outside or 'none'}")
    if failed or not marked:
        problems.append(f"collecting the gpu-marked tests failed\n{failed}")
    if outside:
        problems.append(f"gpu-marked test files in no step: {outside}")
    dists = {d.lower().replace("_", "-") for d in dists} - {"kvscope"}
    for wheel in wheel_files():
        dists |= wheel_requirements(wheel)
    missing = sorted(dists - DEVICE_PACKAGES - set(WHEEL_DISTRIBUTIONS))
    print(f"  imported (+ the wheels' requirements): {', '.join(sorted(dists))}")
    print(f"  carried as wheels: {', '.join(WHEEL_DISTRIBUTIONS)}; the rest must be in the device image")
    if missing:
        problems.append(f"imported but neither in the device image nor carried: {missing}")

    print("gpu_check --dry-run: on the device, with the device tool:")
    print(f'  run(command="scripts/gpu_check.sh", carry=["{CARRY.name}"], timeout_s={TIME_LIMIT_S + 60})')
    for problem in problems:
        print(f"gpu_check --dry-run: PROBLEM: {problem}")
    print(f"gpu_check --dry-run: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="prepare and check the plan here (any machine)")
    mode.add_argument("--prepare", action="store_true", help="only fill .gpu_check/ (wheels, tokenizer)")
    args = parser.parse_args(argv)
    python = os.environ.get("GPU_CHECK_PYTHON") or sys.executable
    if args.dry_run:
        return dry_run(python)
    if args.prepare:
        problems = prepare(python)
        for problem in problems:
            print(f"gpu_check --prepare: {problem}", file=sys.stderr)
        return 1 if problems else 0
    return run(python, Path(os.environ.get("OUT") or ROOT / "test-artifacts" / "gpu-check"))


if __name__ == "__main__":
    sys.exit(main())
