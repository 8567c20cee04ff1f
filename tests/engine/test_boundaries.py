"""The wall between engine and app, checked: engine never imports Qt; trace replay needs no torch."""

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def __init__(self, names): self.names = names
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in self.names: raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block({names!r}))
"""


def run_blocked(names, code):
    r = subprocess.run([sys.executable, "-c", BLOCK.format(names=set(names)) + code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_engine_runs_without_qt(tiny_model_dir):
    run_blocked(["PySide6", "pyqtgraph", "app"], f"""
from engine.model.models import load
from engine.run.session import Session
from engine.facts.params import GenerationParams
r = Session(load({str(tiny_model_dir)!r}, device="cpu")).run("hi", GenerationParams(max_new_tokens=2))
assert r.summary.generated_tokens == 2
""")


def test_traces_and_formulas_need_no_torch(tiny, tmp_path):
    from engine.facts.params import GenerationParams
    from engine.output.trace import TraceWriter
    from engine.run.session import Session

    writer = TraceWriter(tmp_path / "t.jsonl")
    Session(tiny).run("hi", GenerationParams(max_new_tokens=3), writer)
    path = writer.close()
    run_blocked(["torch", "transformers", "accelerate"], f"""
from engine.output.trace import read_trace, replay
from engine.facts import kvformula, report
events = list(replay(read_trace({str(path)!r}), speed=0))
assert kvformula.bytes_per_token(events[0].model) == 512
print(report.report(events[0].model, events[-1].summary))
""")


def test_every_engine_module_imports_without_qt():
    """The whole package, not only the load and session chain: a Qt import anywhere in engine/ fails here."""
    import pkgutil

    import engine

    modules = sorted(m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")
                     if not m.name.endswith("__main__"))
    assert len(modules) > 60
    run_blocked(["PySide6", "pyqtgraph", "app", "shiboken6"], "import importlib\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules))
