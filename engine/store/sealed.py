"""KVScope's own files, sealed: every cache KVScope reads back (a compiled decode graph, which is a pickle; the
kernel, dtype and peak measurements; a converted model's record; inductor's cache folder, whose entries are
pickles and shared libraries) is authenticated as one this user's KVScope wrote before any byte reaches a parser,
an unpickler or the dynamic loader.

A seal is an HMAC-SHA256 of the file's purpose, name and bytes under a per-user key kept outside the cache folder
(``KVSCOPE_CONFIG_DIR``, else the user's config folder: ``seal.key``, 0600, in a 0700 folder), written beside
the file as ``NAME.seal``. So a file that came from anywhere else (a shared cache folder, a copied home, a bundle,
a file replaced by a crafted pickle) has no valid seal and is refused, and so is one in a folder another user
could write to, as ssh refuses a key others could have written. A refused file is never deleted: it is moved
aside as ``NAME.refused`` (kept for inspection) and its one line names it; the caller builds or measures again.

A folder whose files another program writes (inductor's cache) is sealed as a whole: a manifest of every file's
SHA-256, itself sealed, checked before the first compile of a process; any file it does not list, or lists with
other bytes, refuses the folder (moved aside whole). The bytes that are checked are the bytes that are used: a
sealed file is read once into memory, checked, and parsed from there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path

from engine.facts.errors import EngineError
from engine.store.files import write_bytes
from engine.store.paths import config_dir

SEAL = ".seal"
MAC_PIECE = 4 << 20          # a file sealed or checked is read this much at a time
MOST_SEALED = 8 << 30        # no file KVScope seals is larger (a compiled package: hundreds of MB)
MOST_HELD = 1 << 30          # a sealed file read into memory whole (larger ones are only checked, in pieces)
MOST_SEAL = 256              # a seal: 64 hex digits
MOST_KEY = 4096              # the key: 32 bytes
MANIFEST = "kvscope-manifest.json"
KEY_FILE = "seal.key"


class Refused(EngineError):
    """A file KVScope will not read: not sealed by this user's KVScope, sealed for other bytes, or where others
    could have written it. ``str()`` is the one line, naming the file and where it was put aside."""


def _key() -> bytes:
    """This user's key, made on first use; refused when others could read or replace it."""
    folder = config_dir()
    path = folder / KEY_FILE
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        _publish_key(path)
    odd = _not_plain(path, MOST_KEY)
    if odd:
        raise Refused(f"KVScope's key {path} {odd}: delete it (every cache is then built again)")
    problem = _exposed(path, secret=True) or _exposed(folder)
    if problem:
        raise Refused(f"KVScope's key {path} {problem}: no cache file is trusted until it is private (chmod 600 "
                      f"{path}; chmod 700 {folder})")
    key = path.read_bytes()
    if len(key) < 32:
        raise Refused(f"KVScope's key {path} is damaged (delete it: every cache is then built again)")
    return key


def _publish_key(path: Path) -> None:
    """Make a key whole beside ``path`` and link it in, so it appears complete or not at all. Two first launches
    at once (the window and a terminal run) each make one; the first link wins and the other reads the winner's.
    Creating the file in place let the loser fail, or read it half-written and call it damaged. Where the file
    system has no hard links, the key is created in place as before."""
    key = secrets.token_bytes(32)
    draft = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_new(draft, key)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass                                   # another launch published first: its key is this user's key
        except OSError:
            try:
                _write_new(path, key)
            except FileExistsError:
                pass
    finally:
        draft.unlink(missing_ok=True)


def _write_new(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _not_plain(path: Path, most: int) -> str:
    """Why ``path`` is not a plain file of at most ``most`` bytes ("" when it is), found before it is opened: a
    FIFO blocked its reader for ever, a device or a link to one (``/dev/zero``) never ended, a sparse file of GiBs
    was read whole."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return "is not a plain file (a FIFO, a device or a link to one)"
    if info.st_size > most:
        return f"is {info.st_size:,} bytes, more than KVScope ever writes there ({most:,})"
    return ""


def _exposed(path: Path, secret: bool = False) -> str:
    """Why ``path`` is not this user's alone ("" when it is): another owner, or writable (for the key: readable)
    by others. Not checked where the system has no POSIX owners (Windows): the seal alone decides there."""
    if not hasattr(os, "getuid"):
        return ""
    info = os.stat(path)
    if info.st_uid != os.getuid():
        return "belongs to another user"
    mask = 0o077 if secret else 0o022
    if info.st_mode & mask:
        return "can be read or written by other users" if secret else "can be written by other users"
    return ""


def _mac(purpose: str, name: str, data: bytes | Path) -> str:
    """The seal of ``data``, or of the file at ``data`` read in pieces (a file of hundreds of MB is never held)."""
    digest = hmac.new(_key(), digestmod=hashlib.sha256)
    for part in (purpose.encode(), b"\0", name.encode(), b"\0"):
        digest.update(part)
    if isinstance(data, Path):
        with open(data, "rb") as f:
            while piece := f.read(MAC_PIECE):
                digest.update(piece)
    else:
        digest.update(data)
    return digest.hexdigest()


def private_folder(folder: Path) -> Path:
    """``folder``, made if missing, writable by this user alone: one made with a permissive umask (group-writable
    folders are common) is tightened, since what others could have put in it is refused by its seal anyway."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    _tighten(folder)
    return folder


def _tighten(path: Path) -> None:
    try:
        info = path.lstat()
        if hasattr(os, "getuid") and info.st_uid == os.getuid() and not stat.S_ISLNK(info.st_mode) \
                and info.st_mode & 0o022:
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o022)
    except OSError:
        pass


def seal(path: Path, purpose: str, data: bytes | None = None) -> None:
    """Seal ``path`` (its bytes now, or ``data`` when the caller has them) for ``purpose``."""
    seal_path = path.with_name(path.name + SEAL)
    write_bytes(seal_path, _mac(purpose, path.name, path if data is None else data).encode(), what="a seal")
    for written in (path, seal_path):
        _tighten(written)


def write_sealed(path: Path, purpose: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and seal it."""
    write_bytes(path, data, what=purpose)
    seal(path, purpose, data)


def read_sealed(path: Path, purpose: str, aside: bool = True) -> bytes:
    """``path``'s bytes, once checked: sealed by this user's KVScope for ``purpose``, in folders only this user can
    write. Anything else raises ``Refused`` naming the file, moved aside unless ``aside`` is False (the caller
    puts aside what holds it: a converted model's whole folder)."""
    data, problem = _checked(path, purpose)
    if problem:
        why = f"{purpose} {path} {problem}"
        raise Refused(put_aside(path, why) if aside else why)
    return data


def check_sealed(path: Path, purpose: str) -> None:
    """``read_sealed``'s check without the bytes, for a file another library then reads by its path (a package's
    shared library): the file is read in pieces, and lies in a folder only this user can write, so nobody else
    can swap it between the check and the read."""
    _, problem = _checked(path, purpose, keep=False)
    if problem:
        raise Refused(put_aside(path, f"{purpose} {path} {problem}"))


def _checked(path: Path, purpose: str, keep: bool = True) -> tuple[bytes, str]:
    """The file's bytes (b"" unless ``keep``) and "", or b"" and why they are refused."""
    odd = _not_plain(path, MOST_HELD if keep else MOST_SEALED) if path.is_symlink() or path.exists() else ""
    if odd:
        return b"", f"is refused: it {odd}"
    for place in (path.parent, path):
        exposed = _exposed(place)
        if exposed:
            return b"", f"is refused: {'its folder' if place != path else 'it'} {exposed}"
    seal_path = path.with_name(path.name + SEAL)
    if not seal_path.exists():
        return b"", "is refused: KVScope did not write it (it has no seal)"
    odd_seal = _not_plain(seal_path, MOST_SEAL)
    if odd_seal:
        return b"", f"is refused: its seal {odd_seal}"
    data = path.read_bytes() if keep else b""
    expected = seal_path.read_bytes().strip()         # bytes: a seal of any bytes is compared, never decoded
    if not hmac.compare_digest(expected, _mac(purpose, path.name, data if keep else path).encode()):
        return b"", "is refused: its seal does not match its bytes (written elsewhere, or changed since)"
    return data, ""


def put_aside(path: Path, why: str) -> str:
    """Move ``path`` (and its seal) aside as ``NAME.refused`` for inspection; the one line saying so."""
    kept = path.with_name(path.name + ".refused")
    try:
        if kept.exists():
            kept = path.with_name(f"{path.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, kept)
        seal_path = path.with_name(path.name + SEAL)
        if seal_path.exists():
            os.replace(seal_path, kept.with_name(kept.name + SEAL))
    except OSError as exc:
        return f"{why}; it could not be moved aside ({exc.strerror or exc})"
    return f"{why}; kept aside as {kept}"


# --- a folder another program writes -----------------------------------------------------------------------------
def seal_folder(folder: Path, purpose: str, skip: tuple[str, ...] = ()) -> None:
    """Record every file under ``folder`` (but those under ``skip``) with its SHA-256, in a sealed manifest; every
    entry is made writable by this user alone first, so the next check finds nothing others could change."""
    if not folder.is_dir():
        return
    for path in [folder, *folder.rglob("*")]:
        _tighten(path)
    files = _files(folder, skip)
    write_sealed(folder / MANIFEST, purpose, json.dumps(files, sort_keys=True).encode())


def check_folder(folder: Path, purpose: str, skip: tuple[str, ...] = ()) -> str | None:
    """None when every file under ``folder`` is one the sealed manifest lists with the same bytes (or the folder
    is empty); otherwise the folder is moved aside whole and the one line says why."""
    files = _files(folder, skip)
    if not files:
        return None
    try:
        listed = json.loads(read_sealed(folder / MANIFEST, purpose)) if (folder / MANIFEST).exists() else None
    except Refused as exc:
        return _refuse_folder(folder, str(exc))
    if not isinstance(listed, dict):
        return _refuse_folder(folder, f"{purpose} {folder} is refused: KVScope did not write it (no sealed record "
                                      "of its files)")
    for name, digest in files.items():
        if listed.get(name) != digest:
            return _refuse_folder(folder, f"{purpose} {folder} is refused: {name} is not a file KVScope wrote there")
    for path in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        if _exposed(path):
            return _refuse_folder(folder, f"{purpose} {folder} is refused: {path} {_exposed(path)}")
    return None


def _refuse_folder(folder: Path, why: str) -> str:
    kept = folder.with_name(f"{folder.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(folder, kept)
    except OSError as exc:
        return f"{why}; it could not be moved aside ({exc.strerror or exc})"
    return f"{why}; kept aside as {kept}"


def _files(folder: Path, skip: tuple[str, ...]) -> dict[str, str]:
    out = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if relative == MANIFEST or relative.startswith(tuple(f"{s}/" for s in skip)) or relative in skip:
            continue
        if relative.endswith(MANIFEST + SEAL):
            continue
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            out[relative] = "a symbolic link"          # never listed by a seal: refuses the folder
        elif stat.S_ISREG(mode):
            out[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
