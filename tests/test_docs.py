"""The generated docs (README reference, man page, completions) match the live CLI, every
command and option is documented, and shell completion really answers.

Commands are discovered from the typer app, so a new command is covered without touching
this file: it fails here until it has help text and ``make docs`` has been run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import docsgen as docs  # the generator lives beside the tests, outside the package

ROOT = docs.ROOT
PROG = docs.prog_name()
COMMANDS = docs.commands()
NAMES = [c.name for c in COMMANDS]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("_CKPTCTL_")}
    env.pop("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", None)
    env.update(extra)
    return env


def _run_cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``ckptctl ARGS`` in a fresh interpreter (the entry point's own code path)."""
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=120)


def complete_bash(line: str) -> list[str]:
    """What the bash completion protocol offers for the last word of ``line``."""
    words = line.split(" ")
    r = _run_cli([], COMP_WORDS=line, COMP_CWORD=str(len(words) - 1),
                 **{docs.complete_var(PROG): "complete_bash"})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _reference_region() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(docs.MARK_START) == 1 and text.count(docs.MARK_END) == 1
    return text[text.index(docs.MARK_START):text.index(docs.MARK_END)]


# ------------------------------------------------------------------------- (a) up to date

def test_generated_files_are_up_to_date():
    bad = docs.stale(ROOT)
    assert not bad, ("stale generated docs (run `make docs`):\n"
                     + "\n".join(f"{k}:\n{v}" for k, v in bad.items()))


def test_generation_is_deterministic(monkeypatch):
    first = docs.generated_files(ROOT)
    monkeypatch.setenv("COLUMNS", "37")
    monkeypatch.setenv("TERMINAL_WIDTH", "37")
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    assert docs.generated_files(ROOT) == first
    for rel, text in first.items():
        assert "\x1b[" not in text, f"{rel} has ANSI escapes"
        assert not any(c in text for c in "╭│╰"), f"{rel} has rich boxes"


def test_check_reports_stale_and_write_fixes_it(tmp_path, capsys):
    readme = ("# Title\n\nHand-written intro.\n\n" + docs.MARK_START + "\nSTALE-PLACEHOLDER\n"
              + docs.MARK_END + "\n\n## After\n\nMore hand-written text.\n")
    (tmp_path / "README.md").write_text(readme)
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    for rel in docs.generated_files(tmp_path):
        assert f"stale: {rel}" in err

    assert docs.main(["--root", str(tmp_path)]) == 0
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0
    out = (tmp_path / "README.md").read_text()
    assert out.startswith("# Title\n\nHand-written intro.\n\n" + docs.MARK_START)
    assert out.endswith(docs.MARK_END + "\n\n## After\n\nMore hand-written text.\n")
    assert "STALE-PLACEHOLDER" not in out

    man = tmp_path / "man" / f"{PROG}.1"
    man.write_text(man.read_text().replace(".SH FILES", ".SH FILEZ"))
    capsys.readouterr()
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"stale: man/{PROG}.1" in err and "FILEZ" in err and "stale: README.md" not in err


def test_readme_without_markers_gets_a_section_appended(tmp_path):
    (tmp_path / "README.md").write_text("# Title\n\nText.\n")
    docs.write(tmp_path)
    out = (tmp_path / "README.md").read_text()
    assert out.startswith("# Title\n\nText.\n\n" + docs.README_SECTION + "\n\n" + docs.MARK_START)
    assert out.rstrip().endswith(docs.MARK_END)
    assert docs.stale(tmp_path) == {}


@pytest.mark.parametrize("readme", [
    f"{docs.MARK_START}\nno end\n",
    f"{docs.MARK_END}\n{docs.MARK_START}\n",
    f"{docs.MARK_START}\n{docs.MARK_END}\n{docs.MARK_START}\n{docs.MARK_END}\n",
])
def test_broken_markers_are_refused_not_clobbered(tmp_path, readme, capsys):
    (tmp_path / "README.md").write_text(readme)
    assert docs.main(["--root", str(tmp_path)]) == 2
    assert (tmp_path / "README.md").read_text() == readme
    assert "cli-reference" in capsys.readouterr().err


# ------------------------------------------------------------------------- (b) all documented

def test_there_are_commands():
    assert {"inspect", "ls", "verify", "seal"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_command_is_in_readme_and_man_page(name):
    node = next(c for c in COMMANDS if c.name == name)
    region = _reference_region()
    assert f"### `{node.ctx.command_path}`" in region
    assert docs.help_text(node) in region
    man = (ROOT / "man" / f"{PROG}.1").read_text()
    assert f".SS {docs.roff_escape(name)}\n" in man or node.is_group
    for param in docs.visible_params(node):
        for opt in getattr(param, "opts", []):
            if opt.startswith("-"):
                assert docs.roff_escape(opt) in man


def test_every_command_is_completed_by_bash():
    groups = [c for c in docs.walk() if c.is_group]
    for group in groups:
        line = " ".join((PROG, *group.path, ""))
        offered = set(complete_bash(line))
        children = {c.path[-1] for c in COMMANDS if c.path[:-1] == group.path}
        assert children <= offered, f"{line!r}: missing {children - offered}"


def test_man_page_sections():
    man = (ROOT / "man" / f"{PROG}.1").read_text()
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "EXIT STATUS",
                    "ENVIRONMENT", "FILES"):
        assert f"\n.SH {section}\n" in man
    exit_status = man.split("\n.SH EXIT STATUS\n")[1].split("\n.SH ")[0]
    for code in ("0", "1", "2", "3", "130"):
        assert f"\\fB{code}\\fR" in exit_status
    env = man.split("\n.SH ENVIRONMENT\n")[1].split("\n.SH ")[0]
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert f"\\fB{var}\\fR" in env
    assert "ckptctl.manifest.json" in man.split("\n.SH FILES\n")[1]


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff not installed")
def test_man_page_renders_without_warnings():
    r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(ROOT / "man" / f"{PROG}.1")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


# ------------------------------------------------------------------------- (c) help text

def test_app_has_help_and_documented_global_options():
    app_node = docs.walk()[0]
    assert docs.raw_help(app_node).strip()
    for p in docs.visible_params(app_node):
        assert (getattr(p, "help", None) or "").strip(), f"global {p.name} has no help"


@pytest.mark.parametrize("name", NAMES)
def test_command_and_every_parameter_have_help(name):
    node = next(c for c in COMMANDS if c.name == name)
    assert docs.raw_help(node).strip(), f"`{PROG} {name}` has no help text (docstring)"
    short = node.command.get_short_help_str(limit=200)
    assert short.strip(), f"`{PROG} {name}` has no one-line summary"
    undocumented = [p.name for p in docs.visible_params(node)
                    if not (getattr(p, "help", None) or "").strip()]
    assert not undocumented, f"`{PROG} {name}`: parameters without help: {undocumented}"


# ------------------------------------------------------------------------- (d) light --help

_PROBE = textwrap.dedent("""
    import json, sys
    from ckptctl.cli.main import main
    code = None
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
    sys.stderr.write("\\nPROBE " + json.dumps({"code": code, "heavy": heavy}) + "\\n")
""")


def _probe(args: list[str], **env: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=ROOT, env=_env(**env),
                       capture_output=True, text=True, timeout=120)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("PROBE ")]
    assert line, r.stderr
    return json.loads(line[-1][6:]), r.stdout


def test_help_lists_every_command_without_importing_torch_or_numpy():
    result, out = _probe(["--help"], COLUMNS="200")
    assert result["code"] in (0, None)
    assert result["heavy"] == [], f"--help imported {result['heavy'][:5]}"
    top = [c.path[0] for c in COMMANDS if len(c.path) == 1]
    missing = [n for n in top if n not in out]
    assert not missing, f"--help does not list {missing}"


def test_completion_request_is_light_too():
    # every TAB runs the program: it must not pay for torch or numpy
    result, out = _probe([], COMP_WORDS=f"{PROG} ", COMP_CWORD="1",
                         **{docs.complete_var(PROG): "complete_bash"})
    assert result["heavy"] == [], f"completion imported {result['heavy'][:5]}"
    assert "verify" in out.split()


# ------------------------------------------------------------------------- (e) completion

def test_bash_completion_offers_verify():
    assert complete_bash(f"{PROG} ver") == ["verify"]


def test_bash_completion_offers_options():
    assert "--level" in complete_bash(f"{PROG} verify --le")
    assert {"--json", "--quiet", "--storage-option"} <= set(complete_bash(f"{PROG} inspect --"))


def test_zsh_and_fish_protocols_offer_verify():
    var = docs.complete_var(PROG)
    r = _run_cli([], _TYPER_COMPLETE_ARGS=f"{PROG} ver", **{var: "complete_zsh"})
    assert r.returncode == 0 and '"verify"' in r.stdout, r.stdout + r.stderr
    r = _run_cli([], _TYPER_COMPLETE_ARGS=f"{PROG} ver", _TYPER_COMPLETE_FISH_ACTION="get-args",
                 **{var: "complete_fish"})
    assert r.returncode == 0 and r.stdout.startswith("verify"), r.stdout + r.stderr


@pytest.mark.parametrize("shell", docs.SHELLS)
def test_completion_files_are_what_the_program_serves(shell):
    # `_CKPTCTL_COMPLETE=source_SHELL ckptctl` is click's protocol for the same script
    r = _run_cli([], **{docs.complete_var(PROG): f"source_{shell}"})
    assert r.returncode == 0, r.stderr
    path = ROOT / "completions" / f"{PROG}.{shell}"
    assert path.read_text().strip() == r.stdout.strip()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_script_completes_in_a_real_bash(tmp_path):
    shim = tmp_path / PROG
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckptctl "$@"\n')
    shim.chmod(0o755)
    script = textwrap.dedent(f"""
        source "{ROOT / 'completions' / (PROG + '.bash')}"
        complete -p {PROG}
        COMP_WORDS=({PROG} ver); COMP_CWORD=1
        _{PROG}_completion {PROG}
        printf 'REPLY:%s\\n' "${{COMPREPLY[@]}}"
        COMP_WORDS=({PROG} ""); COMP_CWORD=1
        _{PROG}_completion {PROG}
        printf 'REPLY:%s\\n' "${{COMPREPLY[@]}}"
    """)
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], cwd=ROOT,
                       env=_env(PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"-F _{PROG}_completion {PROG}" in r.stdout
    replies = [ln[6:] for ln in r.stdout.splitlines() if ln.startswith("REPLY:")]
    assert replies[0] == "verify"
    top = {c.path[0] for c in COMMANDS}
    assert top <= set(replies[1:])


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh not installed")
def test_zsh_script_parses():
    r = subprocess.run(["zsh", "-n", str(ROOT / "completions" / f"{PROG}.zsh")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish not installed")
def test_fish_script_parses():
    r = subprocess.run(["fish", "--no-execute", str(ROOT / "completions" / f"{PROG}.fish")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_readme_session_is_what_ckptctl_prints(torch_ckpts, tmp_path):
    """The README's sample session is a real run (tests/readme_session.py): the same
    commands on the demo's checkpoint print the same, timings aside. Refresh it with
    `.venv/bin/python tests/readme_session.py`."""
    import readme_session as session

    got = session.run(torch_ckpts.dcp["fsdp"], tmp_path)
    want = session.block_of((ROOT / "README.md").read_text())
    assert session.mask(want) == session.mask(got), (
        "README.md's session differs from a real run: .venv/bin/python tests/readme_session.py")
