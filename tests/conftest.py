"""Session setup shared by every test.

- One kernel cache for the whole session: ``FLASHINFER_H3_CACHE_DIR`` is pointed at a fresh
  temporary directory (removed at the end) unless the caller set it, so each module is compiled
  once per session and never lands in the user's real cache.
- ``@pytest.mark.gpu`` tests skip without a CUDA GPU; ``@pytest.mark.nvcc`` tests skip without
  nvcc. Both say why in the skip reason.
- The pip-installed CUDA tools (cuobjdump, nvdisasm of nvidia-cuda-cuobjdump/-nvdisasm, in the
  ``[test]`` extra) are put on ``PATH`` when present.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_CREATED_CACHE: str | None = None


def _pip_cuda_bin_dirs() -> list[Path]:
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13/bin", "cuda_cuobjdump/bin", "cuda_nvdisasm/bin"):
            if (Path(root) / sub).is_dir():
                dirs.append(Path(root) / sub)
    return dirs


def pytest_configure(config: pytest.Config) -> None:
    global _CREATED_CACHE
    if not os.environ.get("FLASHINFER_H3_CACHE_DIR", "").strip():
        _CREATED_CACHE = tempfile.mkdtemp(prefix="flashinfer_h3_test_cache_")
        os.environ["FLASHINFER_H3_CACHE_DIR"] = _CREATED_CACHE
    path = os.environ.get("PATH", "").split(os.pathsep)
    extra = [str(d) for d in _pip_cuda_bin_dirs() if str(d) not in path]
    if extra:
        os.environ["PATH"] = os.pathsep.join(extra + path)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CREATED_CACHE is not None:
        shutil.rmtree(_CREATED_CACHE, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@functools.lru_cache(maxsize=1)
def has_nvcc() -> bool:
    from flashinfer_h3.jit import find_nvcc

    return find_nvcc() is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch sees none)"))
        if item.get_closest_marker("nvcc") is not None and not has_nvcc():
            item.add_marker(pytest.mark.skip(reason="needs nvcc (none on PATH or CUDA_HOME)"))


@pytest.fixture(scope="session")
def session_cache_dir() -> Path:
    """The session's kernel cache root (shared by all tests; do not corrupt files in it)."""
    return Path(os.environ["FLASHINFER_H3_CACHE_DIR"])


_FAKE_NVCC = r"""#!{python}
# A stand-in for nvcc that records each call and writes plausible outputs, so the JIT's cache,
# lock and recovery logic can be tested in milliseconds. Behaviour knobs come from env vars.
import os, sys, time
args = sys.argv[1:]
if "--version" in args:
    print("nvcc: NVIDIA (R) Cuda compiler driver")
    print("Cuda compilation tools, release {release}, V{release}.0")
    print("Build fake_{release}")
    sys.exit(0)
out = args[args.index("-o") + 1]
kind = "compile" if "-c" in args else "link"
with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
    f.write(f"{{kind}} {{os.getpid()}} {{out}}\n")
started = os.environ.get("FAKE_NVCC_STARTED")
if started:
    open(started, "w").close()
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
if os.environ.get("FAKE_NVCC_FAIL"):
    print("fake_nvcc: error: deliberate failure for " + out, file=sys.stderr)
    sys.exit(2)
if kind == "compile":
    src = args[args.index("-c") + 1]
    with open(args[args.index("--dependency-output") + 1], "w") as f:
        f.write(out + ": " + src + "\n")
    with open(out, "wb") as f:
        f.write(b"fake object\n")
    print("ptxas info    : Used 42 registers, used 0 barriers", file=sys.stderr)
else:
    with open(out, "wb") as f:
        f.write(b"\x7fELF" + os.urandom(256))
"""


class FakeNvcc:
    def __init__(self, path: Path, log: Path) -> None:
        self.path, self.log = path, log

    def calls(self, kind: str | None = None) -> list[str]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [ln for ln in lines if kind is None or ln.startswith(kind + " ")]


@pytest.fixture
def fake_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Factory: ``fake_nvcc(release="13.0")`` installs a fake nvcc (FLASHINFER_H3_NVCC) and an
    isolated cache dir for this test, and returns a FakeNvcc whose ``calls()`` lists its runs."""
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "fake_nvcc.log"
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    for var in (
        "FAKE_NVCC_SLEEP",
        "FAKE_NVCC_FAIL",
        "FAKE_NVCC_STARTED",
        "FLASHINFER_H3_DISABLE_JIT",
        "FLASHINFER_H3_PREBUILT_DIR",
        "FLASHINFER_H3_NVCC_FLAGS",
    ):
        monkeypatch.delenv(var, raising=False)

    def make(release: str = "13.0") -> FakeNvcc:
        path = tmp_path / f"nvcc_{release}"
        path.write_text(_FAKE_NVCC.format(python=sys.executable, release=release))
        path.chmod(0o755)
        monkeypatch.setenv("FLASHINFER_H3_NVCC", str(path))
        return FakeNvcc(path, log)

    return make


@pytest.fixture(scope="module")
def torch_one_thread():
    """One torch CPU thread for a module: the reference runs many small elementwise ops, and on a
    busy 2-core machine torch's thread barriers then cost more than the work (5x measured)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
