"""Cache, lock and recovery logic of build_module, driven by a fake nvcc (fast, no CUDA).

The fake nvcc (conftest.fake_nvcc) logs every call and writes plausible objects and an ELF-looking
.so, so these tests count compiles exactly. Real nvcc builds are in test_jit_build.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer_h3.jit import (
    JitBuildError,
    KernelConfig,
    MissingJitCacheError,
    MissingToolchainError,
    build_module,
    read_manifest,
    valid_so,
)

CFG = KernelConfig("utils", arch="sm_90a")


def _build_count(fake) -> int:
    return len(fake.calls("link"))


def test_first_build_then_cache_hit(fake_nvcc, capfd: pytest.CaptureFixture[str]) -> None:
    fake = fake_nvcc()
    so = build_module(CFG)
    assert so.is_file() and valid_so(so, read_manifest(so.parent))
    assert len(fake.calls("compile")) == 1 and _build_count(fake) == 1
    err = capfd.readouterr().err
    assert "compiling utils kernels for sm_90a" in err
    assert re.search(r"compiled utils for sm_90a in \d+\.\d s", err)
    # Second call: no compile, no log line.
    assert build_module(CFG) == so
    assert _build_count(fake) == 1
    assert "compiling" not in capfd.readouterr().err
    # Build artefacts and the log are kept next to the .so.
    names = {p.name for p in so.parent.iterdir()}
    assert {"utils.cu", "build.ninja", "build.log", "manifest.json", so.name} <= names
    assert "Used 42 registers" in (so.parent / "build.log").read_text()
    manifest = json.loads((so.parent / "manifest.json").read_text())
    assert manifest["config"] == {"module": "utils", "head_dim": 128, "arch": "sm_90a", "flags": {}}
    assert manifest["nvcc"] == "Build fake_13.0"


_BUILD_SCRIPT = """
import os, sys, time
from flashinfer_h3.jit import KernelConfig, build_module
gate = os.environ.get("WAIT_FOR")
if gate:  # start building only once the other process is inside nvcc, i.e. holds the lock
    deadline = time.monotonic() + 60
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            sys.exit("the other build never reached nvcc")
        time.sleep(0.01)
print(build_module(KernelConfig("utils", arch="sm_90a")))
"""


def test_two_processes_build_once(fake_nvcc, tmp_path: Path, monkeypatch) -> None:
    fake = fake_nvcc()
    started = tmp_path / "compile_started"
    monkeypatch.setenv("FAKE_NVCC_STARTED", str(started))
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "2")
    cmd = [sys.executable, "-c", _BUILD_SCRIPT]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    first = subprocess.Popen(cmd, env=dict(os.environ), **pipes)
    second = subprocess.Popen(cmd, env={**os.environ, "WAIT_FOR": str(started)}, **pipes)
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert out1.strip() == out2.strip() and out1.strip().endswith(".so")
    assert len(fake.calls("compile")) == 1 and _build_count(fake) == 1, fake.calls()
    assert "compiling utils" in err1
    assert "waiting for another process" in err2 and "compiling" not in err2


@pytest.mark.parametrize("damage", ["truncate", "garbage_same_size", "no_manifest", "bad_manifest"])
def test_corrupt_or_partial_so_is_rebuilt(fake_nvcc, damage: str) -> None:
    fake = fake_nvcc()
    so = build_module(CFG)
    data = so.read_bytes()
    if damage == "truncate":
        so.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_same_size":
        so.write_bytes(b"\x7fELF" + bytes(len(data) - 4))
    elif damage == "no_manifest":
        (so.parent / "manifest.json").unlink()
    else:
        (so.parent / "manifest.json").write_text("{ not json")
    assert not valid_so(so, read_manifest(so.parent))
    again = build_module(CFG)
    assert again == so
    assert _build_count(fake) == 2 and len(fake.calls("compile")) == 2
    assert valid_so(again, read_manifest(again.parent))


def test_killed_build_leftovers_are_not_reused(fake_nvcc) -> None:
    fake = fake_nvcc()
    so = build_module(CFG)
    # What a build killed during the link leaves behind: objects newer than the sources, a
    # half-written .so, no manifest. Everything is recompiled from scratch.
    (so.parent / "manifest.json").unlink()
    so.write_bytes(b"\x7fEL")
    (so.parent / "utils.o").write_bytes(b"partial")
    build_module(CFG)
    assert len(fake.calls("compile")) == 2 and _build_count(fake) == 2


def test_nvcc_failure_shows_the_log_tail(fake_nvcc, monkeypatch) -> None:
    fake = fake_nvcc()
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(JitBuildError) as info:
        build_module(CFG)
    msg = str(info.value)
    assert "deliberate failure" in msg  # the tail of the build log
    assert "build.log" in msg
    log = Path(msg.split("full build log: ")[1].split()[0])
    assert log.is_file() and "deliberate failure" in log.read_text()
    assert isinstance(info.value, RuntimeError)
    # A failed build leaves nothing loadable, and the next try builds again.
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    so = build_module(CFG)
    assert valid_so(so, read_manifest(so.parent))
    assert _build_count(fake) == 1


def test_disable_jit_turns_a_miss_into_an_error(fake_nvcc, monkeypatch) -> None:
    fake = fake_nvcc()
    monkeypatch.setenv("FLASHINFER_H3_DISABLE_JIT", "1")
    with pytest.raises(MissingJitCacheError, match="FLASHINFER_H3_DISABLE_JIT=1"):
        build_module(CFG)
    assert fake.calls() == []
    monkeypatch.delenv("FLASHINFER_H3_DISABLE_JIT")
    so = build_module(CFG)
    monkeypatch.setenv("FLASHINFER_H3_DISABLE_JIT", "1")
    assert build_module(CFG) == so  # a cache hit is fine


def test_no_nvcc_raises_what_to_install(fake_nvcc, monkeypatch) -> None:
    fake_nvcc()
    monkeypatch.setenv("FLASHINFER_H3_NVCC", "/nonexistent/bin/nvcc")
    with pytest.raises(MissingToolchainError) as info:
        build_module(CFG)
    msg = str(info.value)
    assert "no nvcc" in msg and "CUDA Toolkit" in msg and "jit-cache" in msg
    assert isinstance(info.value, RuntimeError)


def test_no_nvcc_still_finds_a_cached_build(fake_nvcc, monkeypatch) -> None:
    fake_nvcc()
    so = build_module(CFG)
    monkeypatch.setenv("FLASHINFER_H3_NVCC", "/nonexistent/bin/nvcc")
    assert build_module(CFG) == so


def test_nvcc_too_old_for_the_arch(fake_nvcc) -> None:
    fake = fake_nvcc("12.4")
    with pytest.raises(MissingToolchainError, match=r"CUDA 12\.4.*sm_120a.*12\.8"):
        build_module(KernelConfig("utils", arch="sm_120a"))
    assert fake.calls() == []
    build_module(KernelConfig("utils", arch="sm_90a"))  # 12.4 is fine for Hopper
    assert _build_count(fake) == 1


def test_new_nvcc_gets_a_new_cache_entry(fake_nvcc) -> None:
    fake_nvcc("13.0")
    so_a = build_module(CFG)
    fake = fake_nvcc("13.1")
    so_b = build_module(CFG)
    assert so_a != so_b and so_a.parent.parent == so_b.parent.parent
    assert _build_count(fake) == 2
