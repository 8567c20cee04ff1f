"""The three faults beside bad bytes (odd files, slow peers, outputs), every case; the inputs the harness found
failing once, replayed; the harness catching each fault it claims to; and every module that opens a file or a
socket registered with the targets that fuzz it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.fuzz import faults, harness
from tests.fuzz.planted import PLANTED
from tests.fuzz.runner import run_target
from tests.fuzz.targets import READERS, TARGETS

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"odd-files": len(faults.OPENERS) * len(faults.ODD), "slow-peers": len(faults.CLIENTS) * len(faults.PEERS),
          "outputs": sum(len(faults.OUTPUT_CASES) - (0 if reads else len(faults.INPUT_CASES))
                         for _, reads in faults.WRITERS.values())}


def report(tally) -> str:
    return "\n".join([tally.line()] + [f"  input {o.index} ({o.kind}, {o.digest}): {o.why}" for o in tally.failed])


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_case_of_a_fault_table_ends_within_its_caps_in_a_result_or_one_clear_line(name):
    tally = run_target(name, None, keep=False)
    assert not tally.failed, report(tally)
    assert tally.tried == TABLES[name] and tally.refused > 0, report(tally)


@pytest.mark.parametrize("name", sorted({p.name.split("-", 1)[0] if p.name.split("-", 1)[0] in TARGETS else
                                         p.name.rsplit("-", 1)[0] for p in harness.FOUND.glob("*.bin*")}))
def test_an_input_the_harness_once_found_failing_passes_now(name):
    found = [p for p, _ in harness.found_inputs(name)]
    tally = run_target(name, None, only=found, keep=False)
    assert tally.tried == len(found) and not tally.failed, report(tally)


@pytest.mark.parametrize("name, why", [
    ("planted:hangs", "hang: over 1 s"), ("planted:unbounded", "unbounded: over the 1024 MiB memory cap"),
    ("planted:crashes", "crash: TypeError"), ("planted:writes-outside", "file touched: opened"),
    ("planted:runs-code", "code run or file touched: compile outside an allowed module"),
    ("planted:imports", "code run or file touched: imported antigravity"),
    ("planted:rambles", "a message of several lines"), ("planted:dies", "died: exit status 3"),
])
def test_the_harness_catches_each_fault_it_claims_to(name, why, tmp_path):
    tally = run_target(name, None, keep=False)
    assert tally.tried == 2 and len(tally.failed) == 2, report(tally)
    assert all(why in o.why for o in tally.failed), report(tally)
    assert not list(tmp_path.parent.parent.glob("kvscope-fuzz-planted.txt"))


def test_a_clear_refusal_passes_and_every_mutated_input_is_made_again_from_its_seed():
    tally = run_target("planted:fine", None, limit=60, keep=False)
    assert tally.tried == 60 and tally.refused > 0 and not tally.failed, report(tally)
    target = PLANTED["planted:fine"]
    first, again = harness.inputs(target, 7), harness.inputs(target, 7)
    assert [next(first) for _ in range(80)] == [next(again) for _ in range(80)]


OPENS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "socket", "create_connection",
         "HTTPConnection", "HTTPSConnection", "urlopen", "fdopen", "read_bounded", "QSettings", "Context"}


def modules_that_open() -> dict[str, set[str]]:
    """Each product module that calls something opening a file or a socket, or reads the environment."""
    found: dict[str, set[str]] = {}
    for path in sorted([*ROOT.glob("engine/**/*.py"), *ROOT.glob("app/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            elif isinstance(node, ast.Attribute) and node.attr == "environ":
                name = "environ"
            if name in OPENS or name == "environ":
                found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    return found


def test_every_module_that_opens_a_file_or_a_socket_is_registered_with_its_fuzz_targets():
    opening = modules_that_open()
    unregistered = sorted(set(opening) - set(READERS))
    assert not unregistered, ("these modules open a file or a socket (or read the environment) and no fuzz target "
                              f"covers them; add one to tests/fuzz/targets.py READERS: {unregistered}")
    for module, covered in READERS.items():
        assert (ROOT / module).is_file(), f"READERS names {module}, which does not exist"
        if isinstance(covered, tuple):
            assert covered and set(covered) <= set(TARGETS), f"{module}: unknown targets {set(covered) - set(TARGETS)}"
        else:
            assert covered.strip(), f"{module}: say why it needs no target"
