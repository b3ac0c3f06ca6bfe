"""The README's sample session, from a real run: the commands below, run in-process on
the demo's checkpoint (``make demo``'s torchrun FSDP2 save: the test fixtures'
``fsdp/step-20``, the same bytes but for the path and save id in its ``.metadata``), their output pasted between the session markers.

    .venv/bin/python tests/readme_session.py        # rewrite README.md's session

``tests/test_docs.py`` runs the same commands and fails when the README says anything
but what ckptctl prints, timings and ids aside (:func:`mask`): the session cannot drift.
"""
from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- session -->", "<!-- /session -->"
CHECKPOINT = "demo-out/run1/step-20"
COMMANDS = [
    f"ckptctl inspect {CHECKPOINT}",
    f"ckptctl seal {CHECKPOINT} --tag demo",
    f"ckptctl verify {CHECKPOINT} --level full",
    f"ckptctl reshard {CHECKPOINT} demo-out/tp2 --mesh dp=2,tp=2 --rules llama --dry-run",
    f"ckptctl consolidate {CHECKPOINT} demo-out/hf --to safetensors --only model "
    "--strip-prefix model. --dtype bf16",
]
_SECONDS = re.compile(r"(\(|in )\d+(?:\.\d+)?s\b")
_ID = re.compile(r"\b(xxh3-128|sha256):[0-9a-f]{32,64}\b")


def mask(text: str) -> str:
    """The session with its timings and ids blanked: they differ on every run (a DCP
    ``.metadata`` holds the path it was saved to and a save id, so a seal's id does too).

    >>> mask("sealed (0.14s)\\nid xxh3-128:b4956cbd1b18d47146fa099365e4fb20\\nread in 0.13s")
    'sealed (Ns)\\nid xxh3-128:ID\\nread in Ns'
    """
    return _ID.sub(lambda m: m.group(1) + ":ID", _SECONDS.sub(lambda m: m.group(1) + "Ns", text))


def run(fsdp_step: Path, workdir: Path) -> str:
    """The session block: :data:`COMMANDS` run in ``workdir`` on a copy of the DCP
    checkpoint ``fsdp_step``, each ``$ command`` followed by what it printed."""
    from ckptctl.cli.main import main

    target = workdir / CHECKPOINT
    shutil.rmtree(workdir / "demo-out", ignore_errors=True)
    shutil.copytree(fsdp_step, target)
    for f in target.iterdir():
        f.chmod(0o644)
    here = os.getcwd()
    parts = []
    os.chdir(workdir)
    try:
        for cmd in COMMANDS:
            out = io.StringIO()
            with redirect_stdout(out), redirect_stderr(out):
                try:
                    main(shlex.split(cmd)[1:])
                except SystemExit as e:
                    if e.code not in (0, None):
                        raise RuntimeError(f"`{cmd}` exited {e.code}: {out.getvalue()}")
            parts.append(f"$ {cmd}\n{out.getvalue().rstrip()}")
    finally:
        os.chdir(here)
    return "\n\n".join(parts) + "\n"


def block_of(readme: str) -> str:
    """What the README's session holds (inside its code fence)."""
    start, end = readme.index(START), readme.index(END)
    return readme[start + len(START):end].strip().removeprefix("```").removesuffix("```") \
        .strip("\n") + "\n"


def splice(readme: str, session: str) -> str:
    start, end = readme.index(START), readme.index(END)
    return readme[:start] + f"{START}\n```\n{session.rstrip()}\n```\n" + readme[end:]


def main() -> int:
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_torch import TorchCkpts, ensure_cache

    step = TorchCkpts.at(ensure_cache()).dcp["fsdp"]
    with tempfile.TemporaryDirectory() as tmp:
        session = run(step, Path(tmp))
    README.write_text(splice(README.read_text(), session))
    print(f"wrote the session of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
