"""Environment fingerprint of a run: enough to tell whether two results may be compared."""
from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata as _md
import importlib.util
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def _version(dist: str, module: str | None = None) -> str | None:
    if module is not None and importlib.util.find_spec(module) is None:
        return None
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None if module is None else "unknown"


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    commit = _run(["git", "rev-parse", "HEAD"], root)
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


# the files whose content decides what a run computes and measures
SOURCE_GLOBS = ("k3lab/**/*.py", "kernels/**/*.py", "data/*.json", "pyproject.toml")


def source_digest(root: Path = REPO_ROOT) -> str | None:
    """sha256 (16 hex digits) over the paths and bytes of SOURCE_GLOBS under `root`, read from the files
    themselves: unlike `commit` it stays right on a copy of the tree whose .git is missing or stale (the
    lent GPU machines). `k3lab digest REV` gives the digest of a commit to compare with."""
    root = Path(root)
    files = sorted({p for g in SOURCE_GLOBS for p in root.glob(g)
                    if p.is_file() and "__pycache__" not in p.parts})
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def source_digest_of(rev: str, root: Path = REPO_ROOT) -> str:
    """source_digest of commit `rev` of the repository at `root` (git archive into a temporary folder)."""
    import io
    import tarfile
    import tempfile

    try:
        r = subprocess.run(["git", "archive", "--format=tar", rev], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"git archive {rev}: {e}") from None
    if r.returncode != 0:
        raise ValueError(f"git archive {rev}: {r.stderr.decode(errors='replace').strip()}")
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tf:
            tf.extractall(d, filter="data")
        out = source_digest(Path(d))
    if out is None:
        raise ValueError(f"commit {rev} holds none of {SOURCE_GLOBS}")
    return out


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090', None -> 'cpu'."""
    if not name:
        return "cpu"
    s = name.lower()
    for junk in ("nvidia", "geforce", "amd", "instinct", "tesla"):
        s = s.replace(junk, " ")
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "gpu"


def fingerprint() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "triton": _version("triton", "triton"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "fla": _version("fla-core", "fla"),
        "k3lab": _version("k3lab"),
        "gpu": None, "gpu_slug": "cpu", "sm_count": None, "l2_bytes": None, "gpu_mem_bytes": None,
        "capability": None, "driver": None, "gpu_count": 0,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=p.name, gpu_slug=gpu_slug(p.name), sm_count=p.multi_processor_count,
                   l2_bytes=getattr(p, "L2_cache_size", None), gpu_mem_bytes=p.total_memory,
                   capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count())
        drv = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = drv.splitlines()[0].strip() if drv else None
    env.update(git_state())
    env["source_digest"] = source_digest()
    return env
