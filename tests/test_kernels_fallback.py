"""flash-attn counts only when it imports and runs: a real, broken flash_attn package on sys.path (CPU).

The auto order on CUDA is flash -> torch varlen -> SDPA. CUDA is pretended (`_cuda`), and where a
probe must run a kernel it runs on the CPU tensors of the fake package (`probe_device`).
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from embedpipe.kernels import cuda as kcuda

attn = importlib.import_module("embedpipe.kernels.attention")

BROKEN_IMPORT = "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
BROKEN_KERNEL = ("def flash_attn_varlen_func(*args, **kwargs):\n"
                 "    raise RuntimeError('FlashAttention only supports Ampere GPUs or newer.')\n")
WORKING = ("def flash_attn_varlen_func(q, k, v, *args, **kwargs):\n"
           "    return q.clone()\n")


@pytest.fixture
def fake_flash(tmp_path, monkeypatch):
    """Install a flash_attn package whose __init__ is `source`; probes and module caches are reset around it."""

    def install(source: str) -> None:
        pkg = tmp_path / "flash_attn"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        reset()

    def reset() -> None:
        sys.modules.pop("flash_attn", None)
        kcuda.flash_problem.cache_clear()
        kcuda.varlen_problem.cache_clear()

    monkeypatch.setattr(attn, "_cuda", lambda: True)
    monkeypatch.setattr(attn, "_logged", set())
    yield install
    reset()


def test_a_flash_attn_that_does_not_import_is_not_available(fake_flash, caplog):
    fake_flash(BROKEN_IMPORT)
    assert importlib.util.find_spec("flash_attn") is not None  # found: the old check counted it as available
    problem = kcuda.flash_problem(None)
    assert problem.startswith("flash-attn is installed but does not import: ImportError: ") and "undefined symbol" in problem
    assert "flash" not in attn.available_backends(device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="embedpipe.kernels.attention"):
        assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "varlen"  # flash -> varlen
    record = next(r for r in caplog.records if "attention backend: varlen" in r.getMessage())
    assert record.levelno == logging.WARNING and "passed over flash: flash-attn is installed but does not import" \
        in record.getMessage()
    with pytest.raises(ValueError, match=r"'flash' is not available.*does not import.*undefined symbol"):
        attn.select_backend(device="cuda", requested="flash", dtype=torch.bfloat16)


def test_a_flash_attn_whose_kernel_fails_is_not_available_and_varlen_then_sdpa_follow(fake_flash, monkeypatch):
    fake_flash(BROKEN_KERNEL)
    monkeypatch.setattr(attn, "probe_device", lambda: "cpu")  # the probe calls the fake kernel on CPU tensors
    assert kcuda.flash_problem("cpu").startswith("flash-attn imports but its kernel fails on cpu: RuntimeError: "
                                                 "FlashAttention only supports Ampere")
    monkeypatch.setitem(attn._PROBLEMS, "varlen", lambda device: None)  # varlen works
    assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "varlen"
    monkeypatch.setitem(attn._PROBLEMS, "varlen", lambda device: "torch's varlen_attn fails on cuda: no kernel")
    assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "sdpa"  # varlen -> SDPA


def test_a_working_flash_attn_is_chosen_first(fake_flash, monkeypatch):
    fake_flash(WORKING)
    monkeypatch.setattr(attn, "probe_device", lambda: "cpu")
    assert kcuda.flash_problem("cpu") is None
    assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "flash"
    assert attn.select_backend(device="cuda", dtype=torch.float32) == "sdpa"  # flash kernels are half only


def test_no_flash_attn_is_a_plain_absence(fake_flash):
    assert kcuda.flash_problem(None) == "flash-attn is not installed (pip install 'embedpipe[gpu]')"
    assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "varlen"
