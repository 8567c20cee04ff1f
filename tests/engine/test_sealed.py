"""Nothing from a file runs unless this user's KVScope wrote it: a crafted pickle planted in every cache KVScope
reads (a saved compiled graph: ``tests/engine/test_compiled.py``; inductor's cache folder, the machine records
such as kernels.json, a converted model's record) is refused before any parser reads it, named in one line and
kept aside; the key that seals them and the folders they live in are refused when others could write them."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from engine.store import machine_cache, sealed


class Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def crafted(tmp_path) -> tuple[bytes, Path]:
    marker = tmp_path / "the planted pickle ran"
    return pickle.dumps(Planted(str(marker))), marker


def test_a_sealed_file_reads_back_and_any_other_bytes_are_refused_named_and_kept_aside(tmp_path, crafted):
    data, marker = crafted
    path = tmp_path / "cache" / "entry.bin"
    sealed.private_folder(path.parent)
    sealed.write_sealed(path, "a test record", b"what KVScope wrote")
    assert sealed.read_sealed(path, "a test record") == b"what KVScope wrote"
    other = path.with_name("other purpose.bin")
    sealed.write_sealed(other, "a test record", b"what KVScope wrote")
    with pytest.raises(sealed.Refused, match="its seal does not match"):
        sealed.read_sealed(other, "another purpose")             # a seal is for one purpose
    path.write_bytes(data)
    with pytest.raises(sealed.Refused) as refused:
        sealed.read_sealed(path, "a test record")
    assert str(refused.value) == (f"a test record {path} is refused: its seal does not match its bytes (written "
                                  f"elsewhere, or changed since); kept aside as {path}.refused")
    assert (path.parent / "entry.bin.refused").read_bytes() == data and not path.exists() and not marker.exists()
    unsealed = tmp_path / "cache" / "other.bin"
    unsealed.write_bytes(data)
    with pytest.raises(sealed.Refused, match="KVScope did not write it"):
        sealed.read_sealed(unsealed, "a test record")


def test_a_folder_or_key_others_could_write_is_refused_and_a_folder_kvscope_made_is_tightened(tmp_path):
    folder = tmp_path / "cache"
    path = folder / "entry.bin"
    sealed.private_folder(folder)
    sealed.write_sealed(path, "a test record", b"x")
    os.chmod(folder, 0o777)
    with pytest.raises(sealed.Refused, match="its folder can be written by other users"):
        sealed.read_sealed(path, "a test record")
    os.chmod(folder, 0o775)
    sealed.private_folder(folder)                                 # KVScope's own folder, made private again
    assert os.stat(folder).st_mode & 0o022 == 0
    key = Path(os.environ["KVSCOPE_CONFIG_DIR"]) / sealed.KEY_FILE
    os.chmod(key, 0o644)
    try:
        sealed.write_sealed(path, "a test record", b"y")
    except sealed.Refused as refused:
        assert "can be read or written by other users" in str(refused) and "chmod 600" in str(refused)
    else:
        raise AssertionError("a key others can read must not seal anything")
    finally:
        os.chmod(key, 0o600)


def test_a_first_launch_that_finds_the_key_made_meanwhile_by_another_seals_with_that_key(tmp_path, monkeypatch):
    """Two first launches at once: the second looked for the key before the first published it. It must not fail
    nor make a key of its own, and what each seals the other reads."""
    monkeypatch.setenv("KVSCOPE_CONFIG_DIR", str(tmp_path / "config"))
    first = tmp_path / "first.bin"
    sealed.write_sealed(first, "a test record", b"the first launch's")            # the first launch made the key
    key = tmp_path / "config" / sealed.KEY_FILE
    made = key.read_bytes()
    exists = Path.exists
    looked: list[Path] = []

    def not_yet(path: Path) -> bool:                    # the second launch's look came before the first's link
        if path == key and not looked:
            looked.append(path)
            return False
        return exists(path)

    monkeypatch.setattr(Path, "exists", not_yet)
    second = tmp_path / "second.bin"
    sealed.write_sealed(second, "a test record", b"the second launch's")
    assert looked == [key]
    assert key.read_bytes() == made and os.stat(key).st_mode & 0o077 == 0
    assert sealed.read_sealed(second, "a test record") == b"the second launch's"
    assert sorted(p.name for p in key.parent.iterdir()) == [sealed.KEY_FILE]       # no draft left beside it


def test_a_machine_record_kvscope_did_not_write_is_not_read_and_is_measured_again(tmp_path, monkeypatch, crafted):
    data, marker = crafted
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    (tmp_path / "kernels.json").write_bytes(data)
    assert machine_cache.entry("kernels.json", "any") is None and not marker.exists()
    assert any(str(tmp_path / "kernels.json") in line and "kept aside" in line for line in machine_cache.refused)
    assert (tmp_path / "kernels.json.refused").read_bytes() == data
    machine_cache.refused.clear()
    machine_cache.remember("kernels.json", "key", {"kernel": "aten", "step_ms": {"aten": 1.0}})
    assert machine_cache.entry("kernels.json", "key")["kernel"] == "aten"
    text = (tmp_path / "kernels.json").read_text()
    (tmp_path / "kernels.json").write_text(text.replace('"aten"', '"onednn"', 1))    # edited by hand
    assert machine_cache.entry("kernels.json", "key") is None


def test_inductors_folder_with_a_file_kvscope_did_not_write_is_moved_aside_before_anything_compiles(
        tmp_path, monkeypatch, crafted):
    from engine.model import compiled

    data, marker = crafted
    folder = tmp_path / "torch-compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    monkeypatch.setattr(compiled, "_CHECKED", {})
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    (folder / "fxgraph" / "ab" / "entry").write_bytes(b"a kernel inductor wrote")
    compiled.seal_inductor_cache()                               # what a compile of this user's KVScope leaves
    assert compiled.trusted_inductor_cache() == ""
    monkeypatch.setattr(compiled, "_CHECKED", {})                # a new process
    (folder / "fxgraph" / "ab" / "planted").write_bytes(data)
    said = compiled.trusted_inductor_cache()
    assert said.startswith(f"torch.compile's cache folder {folder} is refused: fxgraph/ab/planted is not a file "
                           "KVScope wrote there; kept aside as ")
    kept = Path(said.rsplit("kept aside as ", 1)[1])
    assert (kept / "fxgraph" / "ab" / "planted").read_bytes() == data and not marker.exists()
    assert folder.is_dir() and not any(folder.iterdir())          # inductor starts an empty, private one
    assert os.stat(folder).st_mode & 0o077 == 0


def test_a_converted_model_whose_record_kvscope_did_not_write_is_moved_aside_and_converted_again(tmp_path):
    from engine.model import gguf

    folder = tmp_path / "SmolLM2-135M-Instruct.Q4_1-0123456789ab"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / gguf.MARKER).write_text(json.dumps({"format": gguf.FORMAT, "files": {"config.json": {"size": 2}}}))
    broken = gguf.damage(folder)
    assert broken.startswith(gguf.UNTRUSTED) and "KVScope did not write it" in broken
    said = []
    gguf.discard(folder, broken, said.append)
    assert not folder.exists() and list(tmp_path.glob(f"{folder.name}.refused-*"))
    assert "is not one this user's KVScope wrote" in said[0].message and "converting it again" in said[0].message


def finishes(call, seconds: float = 30.0) -> BaseException | None:
    """What ``call`` raised, from a thread joined with a limit: a read that blocks on a FIFO fails the test, not the
    suite."""
    import threading

    raised: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:               # noqa: BLE001 (handed to the test)
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    return raised[0] if raised else None


@pytest.mark.parametrize("which", ["file", "seal"])
@pytest.mark.parametrize("odd", ["a FIFO", "a link to /dev/zero"])
def test_a_cache_file_or_its_seal_that_is_a_fifo_or_a_device_is_refused_before_it_is_opened(tmp_path, which, odd):
    path = tmp_path / "cache" / "entry.bin"
    sealed.private_folder(path.parent)
    sealed.write_sealed(path, "a test record", b"what KVScope wrote")
    target = path if which == "file" else path.with_name(path.name + sealed.SEAL)
    target.unlink()
    if odd == "a FIFO":
        os.mkfifo(target, 0o600)
    else:
        target.symlink_to("/dev/zero")
    raised = finishes(lambda: sealed.read_sealed(path, "a test record", aside=False))
    assert isinstance(raised, sealed.Refused)
    assert f"is refused: {'it' if which == 'file' else 'its seal'} is not a plain file" in str(raised)


def test_a_sparse_cache_file_larger_than_kvscope_writes_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(sealed, "MOST_HELD", 1 << 20)          # read into memory: held to its own bound
    path = tmp_path / "cache" / "entry.bin"
    sealed.private_folder(path.parent)
    sealed.write_sealed(path, "a test record", b"what KVScope wrote")
    with open(path, "r+b") as f:
        f.truncate(2 << 20)                              # sparse: 2 MiB that take no disk
    with pytest.raises(sealed.Refused, match=r"it is 2,097,152 bytes, more than KVScope ever writes there"):
        sealed.read_sealed(path, "a test record", aside=False)


def test_a_seal_key_that_is_a_fifo_is_refused_not_waited_on(tmp_path, monkeypatch):
    config = tmp_path / "config"
    config.mkdir(mode=0o700)
    os.mkfifo(config / sealed.KEY_FILE, 0o600)
    monkeypatch.setenv("KVSCOPE_CONFIG_DIR", str(config))
    path = tmp_path / "cache" / "entry.bin"
    sealed.private_folder(path.parent)
    raised = finishes(lambda: sealed.write_sealed(path, "a test record", b"x"))
    assert isinstance(raised, sealed.Refused) and "is not a plain file" in str(raised) and "delete it" in str(raised)
