"""Shared fixtures: real checkpoints written by torch (fixtures_torch), real S3 servers on
loopback (fixtures_s3), and a tiny in-process DCP checkpoint for the fast tests."""
from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

pytest_plugins = ["fixtures_torch", "fixtures_s3"]
collect_ignore = ["fixtures"]  # generator scripts, run by fixtures_torch

TESTS = Path(__file__).parent


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``ckptctl ARGS`` in-process: (exit code, stdout, stderr)."""
    from ckptctl.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    return run_cli


def write_tiny_dcp(path: Path, *, zstd: bool = False) -> dict:
    """A small DCP checkpoint from one process (no process group); returns its state dict."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {"emb.weight": torch.randn(10, 4, generator=g),
                  "norm.weight": torch.ones(4, dtype=torch.bfloat16),
                  "head.bias": torch.arange(3, dtype=torch.int64)},
        "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]},
        "step": 42,
    }
    writer = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        writer = dcp.FileSystemWriter(str(path), _extensions=[ZStandard()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=None if writer else str(path), storage_writer=writer)
    return sd


@pytest.fixture
def tiny_dcp(tmp_path) -> Path:
    p = tmp_path / "step-42"
    write_tiny_dcp(p)
    return p
