"""The CLI as a user runs it: a subprocess, its exit code, stdout and stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args, cache):
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_prints_text_and_report(tiny_model_dir, cache_root, tmp_path):
    trace = tmp_path / "run.jsonl"
    r = cli("--model", str(tiny_model_dir), "--dtype", "float32", "--prompt", "hello world", "--max-new-tokens", "8",
            "--trace", str(trace), cache=cache_root)
    assert r.returncode == 0, r.stderr
    assert "prompt eval time =" in r.stdout and "eval time =" in r.stdout and "/     7 runs" in r.stdout
    assert "KV cache: 2 layers x 2 KV heads x 16 dims x 2 (K,V) x 4 B = 512 B/token" in r.stdout
    from engine.output.trace import read_trace

    kinds = [type(e).__name__ for e in read_trace(trace)]
    assert kinds.count("TokenStep") == 8 and kinds[:2] == ["RunStarted", "PrefillDone"]
    assert kinds[-1] == "RunFinished"


def test_json_summary(tiny_model_dir, cache_root):
    r = cli("--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "4", "--json",
            "--no-kv-cache", "--raw", "--seed", "1", "--temperature", "0.5", cache=cache_root)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["generated_tokens"] == 4 and data["decode_runs"] == 3 and data["kv_bytes"] == 0
    assert data["result"] == "max_tokens" and data["params"]["kv_cache"] is False


NOWHERE = ["--model", "/no/such/model"]          # every case below is refused before the model would load


@pytest.mark.parametrize("args, fragment", [
    (["--model", "/no/such/model", "--prompt", "hi"], "No such file or folder: /no/such/model"),
    ([*NOWHERE, "--prompt", "   "], "prompt is empty"),
    ([*NOWHERE, "--prompt", "hi", "--top-p", "0"], "--top-p: 0 is out of range: use 0.01 to 1"),
    ([*NOWHERE, "--prompt", "hi", "--top-p", "1e-300"], "--top-p: 1e-300 is out of range: use 0.01 to 1"),
    ([*NOWHERE, "--prompt", "hi", "--seed", "-1"], "--seed: -1 is out of range: use 0 to 2,147,483,647"),
    ([*NOWHERE, "--prompt", "hi", "--seed", "lucky"], "--seed: 'lucky' is not a whole number"),
    ([*NOWHERE, "--prompt", "hi", "--temperature", "1e-300"], "temperature must be 0 (greedy) or between 0.01"),
    ([*NOWHERE, "--prompt", "hi", "--temperature", "-1"], "--temperature: -1 is out of range: use 0 to 100"),
    ([*NOWHERE, "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range: use 1 to"),
    ([*NOWHERE, "--prompt", "hi", "--trace", "/tmp"], "/tmp is a folder: give a file name for the trace, e.g. "
                                                      "/tmp/run.kvscope.jsonl"),
    ([*NOWHERE, "--prompt", "hi", "--trace", "/missing/dir/t.jsonl"], "the folder /missing/dir does not exist"),
    (["sweep", "prefill", *NOWHERE, "--start", "0"], "--start: 0 is out of range: use 1 to"),
    (["sweep", "prefill", *NOWHERE, "--start", "-5"], "--start: -5 is out of range"),
    (["sweep", "prefill", *NOWHERE, "--start", "64", "--max-length", "32"], "--max-length (32) must be at least"),
    (["sweep", "batch", *NOWHERE, "--sizes", "0"], "--sizes: 0 is out of range: use 1 to 1,024"),
    (["sweep", "batch", *NOWHERE, "--sizes", "1,x"], "--sizes: 'x' is not a whole number"),
    (["sweep", "batch", *NOWHERE, "--tokens", "0"], "--tokens: 0 is out of range: use 2 to"),
    (["sweep", "continuous", *NOWHERE, "--requests", "0"], "--requests: 0 is out of range: use 1 to 256"),
    (["sweep", "cache", *NOWHERE, "--trace", "/missing/dir/t.jsonl"], "the folder /missing/dir does not exist"),
])
def test_bad_input_exits_with_one_clear_line(args, fragment, cache_root):
    r = cli(*args, cache=cache_root)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error:") and fragment in r.stderr, r.stderr


def test_a_prompt_that_is_not_utf8_runs_with_replacement_characters(tiny_model_dir, cache_root):
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable.encode(), b"-m", b"engine", b"--model", str(tiny_model_dir).encode(),
                        b"--prompt", b"\xff\xfe hello", b"--max-new-tokens", b"2", b"--json"],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert b"warning: the prompt was not valid UTF-8: 2 character(s) replaced with U+FFFD" in r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == 2


def test_a_trace_gets_the_permissions_of_any_other_file(tiny_model_dir, cache_root, tmp_path):
    trace = tmp_path / "run.jsonl"
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    r = cli("--model", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "2", "--trace", str(trace),
            cache=cache_root)
    assert r.returncode == 0, r.stderr
    assert trace.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_broken_model_folder(tiny_model_dir, cache_root, tmp_path):
    import shutil

    broken = tmp_path / "m"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    r = cli("--model", str(broken), "--prompt", "hi", cache=cache_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error: Cannot load the model" in r.stderr


def test_json_reports_the_seed_a_sampled_run_really_used(tiny_model_dir, capsys):
    from engine import cli as engine_cli

    assert engine_cli.main(["--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "3", "--json",
                            "--temperature", "0.8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["params"]["seed"], int)
    again = engine_cli.main(["--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "3", "--json",
                             "--temperature", "0.8", "--seed", str(data["params"]["seed"])])
    assert again == 0 and json.loads(capsys.readouterr().out)["token_ids"] == data["token_ids"]


def _parsers():
    """Every parser the CLI has: the plain form, each subcommand, each sweep's lesson."""
    import argparse

    from engine.cli import PARSERS, generate_parser

    found = [("python -m engine", generate_parser())]
    for name, make in PARSERS.items():
        found.append((name, make()))
    for _name, parser in list(found):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found += [(f"sweep {kind}", sub) for kind, sub in action.choices.items()]
    return found


def test_every_flag_of_every_command_has_help_text():
    missing = [(name, action.option_strings) for name, parser in _parsers() for action in parser._actions
               if action.option_strings and action.help in (None, "") and "-h" not in action.option_strings]
    assert missing == []


def test_the_installed_script_names_itself_in_its_usage(monkeypatch):
    from engine.cli import generate_parser

    monkeypatch.setattr("sys.argv", ["/usr/bin/kvscope-cli"])
    assert generate_parser().format_usage().startswith("usage: kvscope-cli ")
    monkeypatch.setattr("sys.argv", ["/x/engine/__main__.py"])
    assert generate_parser().format_usage().startswith("usage: python -m engine ")


def test_a_flag_that_turns_a_setting_off_says_so_before_what_the_setting_does():
    from engine.cli import generate_parser

    helps = {a.option_strings[0]: a.help for a in generate_parser()._actions if a.option_strings}
    assert helps["--raw"].startswith("turns chat template off (on by default). Chat template: wrap the prompt")
    assert helps["--no-kv-cache"].startswith("turns kv cache off (on by default). KV cache: keep each layer's")
    assert helps["--static-cache"].startswith("turns static on (off by default).")


def test_an_unknown_kv_cache_method_is_refused_offering_only_what_a_run_takes(tiny_model_dir, capsys):
    from engine import cli

    for method, words in (("int3", "Unknown KV cache method 'int3'"), ("h2o:64", "a run does not record")):
        with pytest.raises(SystemExit) as ended:
            cli.main(["--model", str(tiny_model_dir), "--prompt", "hi", "--kv-cache", method])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and words in err and "sinks:S+W" in err and "h2o:N" not in err


def test_an_interrupt_after_a_progress_line_is_said_on_a_line_of_its_own(capsys):
    from engine import cli
    from engine.terminal import command_line

    def interrupted_mid_line() -> int:
        print("\r[100% Loaded tiny in 0.1 s]", end="", file=sys.stderr)
        command_line.OPEN_LINE[0] = True
        raise KeyboardInterrupt

    assert cli.guarded(interrupted_mid_line) == command_line.EXIT_INTERRUPTED
    assert capsys.readouterr().err.endswith("0.1 s]\ninterrupted\n")
    assert not command_line.OPEN_LINE[0]


def test_where_prints_only_the_folder_a_serving_engine_loads(smol, tiny_model_dir, capsys):
    """vLLM's recipe takes its --model from ``python -m engine where``: the GGUF's converted copy, the very folder
    KVScope itself loaded, and a Hugging Face folder as it is; a wrong path is one line, status 2."""
    from engine.cli import main
    from engine.model import embedded, gguf

    assert main(["where"]) == 0
    out = capsys.readouterr().out
    folder = gguf.converted_folder(embedded.embedded_gguf())
    assert out == f"{folder}\n" and (folder / "config.json").is_file()
    assert main(["where", "--model", str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out == f"{Path(tiny_model_dir).resolve()}\n"
    assert main(["where", "--model", "/no/such/model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "No such file or folder" in captured.err


def test_the_cli_computes_with_threads_that_follow_the_load_unless_told_fixed(tiny_model_dir, cache_root,
                                                                             monkeypatch):
    monkeypatch.delenv("KVSCOPE_THREADS")            # the tests' own setting (fixed) is not a user's
    r = cli("--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "2", "--json", cache=cache_root)
    assert r.returncode == 0, r.stderr
    policy = json.loads(r.stdout)["threads"]
    assert policy["follows_load"] is True and 1 <= policy["threads"] <= policy["ceiling"]
    monkeypatch.setenv("KVSCOPE_THREADS", "fixed")
    fixed = cli("--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "2", "--json",
                cache=cache_root)
    assert json.loads(fixed.stdout)["threads"]["follows_load"] is False
