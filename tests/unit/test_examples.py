"""The examples as a reader without an extra meets them: one line saying what to install, not
a traceback. Run in this process, with the extra's package hidden."""

from __future__ import annotations

import runpy
import sys

import pytest

from tests.procs import ROOT


def test_the_torch_example_without_torch_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `.venv` that scripts/demo made has no torch: examples/train_torch.py ended in
    `ModuleNotFoundError: No module named 'torch'`, with a traceback, in every worker's log."""
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    monkeypatch.setattr(sys, "argv", ["train_torch.py"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / "examples" / "train_torch.py"), run_name="__main__")
    assert str(ended.value.code).startswith(
        "examples/train_torch.py needs torch: pip install 'mscluster-grpc[torch]'"
    )
