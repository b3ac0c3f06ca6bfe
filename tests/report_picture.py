"""The README's picture of a report: ``man/report.png``, a screenshot of ``ckptctl report``'s
page for a small real run, rendered by headless Chromium (tests/browser.py).

    .venv/bin/python tests/report_picture.py [OUT.png]      # `make docs` runs it

The run is made here, so a fresh clone needs no ``make demo``: the demo's own generator
(``tests/fixtures/write_dcp.py``: torchrun, FSDP2 over 4 CPU ranks, Adam) launched once per
checkpoint, the same seeded training stopped after 1, 2 and 3 steps and saved as
``run1/step-10``, ``step-20`` and ``step-30``: one run whose consecutive checkpoints differ.
It is cached under ``tests/.cache/report-run/`` (keyed by the generator's bytes and the torch
version), and the slow browser test (tests/test_report_browser.py) reports the same run.
The report is made in a scratch folder as ``ckptctl report demo-out/run1``, so the picture
shows the demo's path, not a temporary one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WRITE_DCP = TESTS / "fixtures" / "write_dcp.py"
CACHE = TESTS / ".cache" / "report-run"
#: checkpoint step -> Adam steps trained before it was saved
STEPS = {10: 1, 20: 2, 30: 3}
PICTURE = ROOT / "man" / "report.png"
WIDTH, HEIGHT = 1200, 900  # the viewport, CSS pixels
MAX_HEIGHT = 2400  # the picture's height at most: the top of a long page
MAX_BYTES = 400_000
TIMEOUT_S = 600


def _launch(out: Path, adam_steps: int, step: int, log: Path, tries: int = 2) -> None:
    """One torchrun launch of the demo's generator; a failed launch (a port clash, gloo
    aborting a rank at exit on a loaded machine) is tried once more."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(WRITE_DCP), "--layout", "fsdp", "--out", str(out), "--steps", str(adam_steps),
           "--step", str(step)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for attempt in range(tries):
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                           timeout=TIMEOUT_S)
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n# rc={p.returncode}\n{p.stdout}{p.stderr}\n")
        if p.returncode == 0:
            return
        shutil.rmtree(out, ignore_errors=True)
    tail = "\n".join((p.stdout + p.stderr).splitlines()[-40:])
    raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{tail}")


def _generate(root: Path) -> None:
    """``root/run1/step-N`` for each of :data:`STEPS`."""
    run = root / "run1"
    run.mkdir()
    for step, adam_steps in STEPS.items():
        tmp = root / f"tmp-{step}"
        _launch(tmp, adam_steps, step, root / "generate.log")
        (tmp / "fsdp" / f"step-{step}").rename(run / f"step-{step}")
        shutil.rmtree(tmp)


def _key() -> str:
    h = hashlib.sha256(WRITE_DCP.read_bytes())
    h.update(f"torch={version('torch')} steps={sorted(STEPS.items())}".encode())
    return h.hexdigest()[:16]


def demo_run(dst: Path) -> Path:
    """A writable copy of the cached run at ``dst`` (which must not exist; made on first
    use): ``dst/step-10``, ``step-20``, ``step-30``. Returns ``dst``."""
    sys.path.insert(0, str(TESTS))
    from fixtures_torch import copy_ckpt, ensure_cache

    cached = ensure_cache(CACHE, _key(), _generate) / "run1"
    dst.parent.mkdir(parents=True, exist_ok=True)
    return copy_ckpt(cached, dst)


def main(argv: list[str]) -> int:
    from browser import render

    out = Path(argv[0]) if argv else PICTURE
    with tempfile.TemporaryDirectory(prefix="ckptctl-report-picture-") as tmp:
        work = Path(tmp)
        demo_run(work / "demo-out" / "run1")
        p = subprocess.run([sys.executable, "-m", "ckptctl", "report", "demo-out/run1",
                            "--output", "report.html", "--save-seconds", "60", "--mtbf", "2.8h",
                            "--interval", "30m"], cwd=work, check=False,
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"`ckptctl report demo-out/run1` exited {p.returncode}:\n{p.stderr}")
        shot = work / "report.png"
        page = render(work / "report.html", shot, width=WIDTH, height=HEIGHT,
                      max_height=MAX_HEIGHT)
        if page.problems() or not page.charts:
            sys.exit("the report does not render cleanly, no picture:\n  "
                     + "\n  ".join(page.problems() or ["no [data-chart] on the page"]))
        size = shot.stat().st_size
        if size > MAX_BYTES:  # the first screen only
            page = render(work / "report.html", shot, width=WIDTH, height=HEIGHT,
                          full_page=False)
            size = shot.stat().st_size
        if size > MAX_BYTES:
            sys.exit(f"the picture is {size} bytes, over {MAX_BYTES}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} "
          f"({size // 1000} kB, {len(page.charts)} charts)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
