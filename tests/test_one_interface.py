"""Issue 21 part 4, "One interface": every verb reads the same way.

* ``--help`` is click's plain help: no type metavars (``<str>``, ``<int range>``,
  ``<bool>``), and at 80 columns every line fits;
* a usage error says what is wrong in plain words (no "int range", no ``x>=1``);
* ``promote --pack-level`` (``--level`` is verify's depth; the old spelling still works,
  hidden, with a warning);
* the man page's ENVIRONMENT and FILES name every variable and file ckptctl reads or
  writes; completions offer ``--to``, ``--rules`` and tier names;
* every ``--option`` a message or help text names is an option of some command.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _group():
    import typer

    from ckptctl.cli.main import app

    return typer.main.get_command(app)


def _help(name: str, width: int = 80) -> str:
    group = _group()
    cmd = group if not name else group.commands[name]
    root = group.make_context("ckptctl", [], resilient_parsing=True, terminal_width=width,
                              max_content_width=width)
    ctx = root if not name else cmd.make_context(name, [], parent=root,
                                                 resilient_parsing=True)
    return cmd.get_help(ctx)


VERBS = [""] + sorted(_group().commands)


@pytest.mark.parametrize("name", VERBS)
def test_help_has_no_type_metavars(name):
    text = _help(name)
    bad = re.findall(r"<(?:str|text|int(?: range)?|float(?: range)?|bool|boolean|path)>|"
                     r"\b(?:BOOLEAN|INTEGER|FLOAT|TEXT)\b", text)
    assert not bad, (name, bad)
    assert "╭" not in text  # plain help: the same text as README.md and the man page


@pytest.mark.parametrize("name", VERBS)
def test_help_fits_80_columns(name):
    long = [line for line in _help(name).splitlines() if len(line) > 80]
    assert not long, long


@pytest.mark.parametrize("args, words", [
    (["verify", ".", "--workers", "abc"], "'abc' is not a whole number"),
    (["gc", ".", "--keep-last", "0"], "0 is not 1 or more"),
    (["pack", "a", "b", "--level", "99"], "99 is not between 1 and 22"),
    (["diff", "a", "b", "--atol", "xyz"], "'xyz' is not a number"),
    (["promote", "a", "b", "--pack-level", "0"], "0 is not between 1 and 22"),
])
def test_usage_errors_in_plain_words(cli, args, words):
    code, out, err = cli(*args)
    assert code == 2 and out == "", (code, out, err)
    assert words in err, err
    assert not re.search(r"int range|float range|x[<>]=?|[<>]=?x|valid int\b", err), err
    code, out, _ = cli(*args, "--json")
    assert code == 2 and words in out


def test_promote_pack_level(cli, tiny_dcp, tmp_path):
    help_text = _help("promote")
    assert "--pack-level N" in help_text and "--level" not in help_text.replace(
        "pack --level", "")
    code, out, err = cli("promote", str(tiny_dcp), str(tmp_path / "p1"), "--pack",
                         "--pack-level", "5", "-q")
    assert code == 0, err
    code, out, err = cli("promote", str(tiny_dcp), str(tmp_path / "p2"), "--pack",
                         "--level", "5", "-q")  # the old spelling: still taken, with a warning
    assert code == 0 and "promote --level is now --pack-level" in err, err
    for p in ("p1", "p2"):
        assert cli("verify", str(tmp_path / p), "--level", "full")[0] == 0


# ------------------------------------------------------------------ man: ENVIRONMENT, FILES

def _env_vars_read() -> set[str]:
    """Every environment variable the package reads: ``os.environ.get("X")``,
    ``env.get("X")``, ``env["X"]``, ``"X" in env``, and the names in module constants named
    ``*_ENV``/``ENV_*`` (tuples of them, or one)."""
    names: set[str] = set()
    var = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")
    envish = {"environ", "env", "environment"}

    def is_env(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in envish) or \
            (isinstance(node, ast.Attribute) and node.attr in envish)

    for path in (ROOT / "ckptctl").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for n in ast.walk(tree):
            args = []
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr in ("get", "pop", "setdefault") and is_env(n.func.value):
                args = n.args[:1]
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr == "getenv":
                args = n.args[:1]
            elif isinstance(n, ast.Subscript) and is_env(n.value):
                args = [n.slice]
            elif isinstance(n, ast.Compare) and any(is_env(c) for c in n.comparators):
                args = [n.left]
            elif isinstance(n, ast.Assign) and len(n.targets) == 1 and \
                    isinstance(n.targets[0], ast.Name) and \
                    (n.targets[0].id.endswith("_ENV") or n.targets[0].id.startswith("ENV_")):
                args = [n.value]
            for a in args:
                names |= {c.value for c in ast.walk(a) if isinstance(c, ast.Constant)
                          and isinstance(c.value, str) and var.match(c.value)}
    return names


def _man_section(name: str) -> str:
    man = (ROOT / "man" / "ckptctl.1").read_text(encoding="utf-8")
    return man.split(f"\n.SH {name}\n")[1].split("\n.SH ")[0]


def test_man_environment_names_every_variable_read():
    read = _env_vars_read()
    assert {"AWS_PROFILE", "CKPTCTL_TIMEOUT", "CKPTCTL_CONFIG", "XDG_CACHE_HOME"} <= read
    listed = set()
    for line in _man_section("ENVIRONMENT").splitlines():
        if line.startswith("\\fB"):  # a .TP tag: the variables it documents
            listed |= set(re.findall(r"[A-Z][A-Z0-9_]{2,}", line.replace("\\fB", " ")
                                     .replace("\\fR", " ")))
    missing = read - listed
    missing -= {"OPENBLAS_NUM_THREADS"}  # set by ckptctl (one BLAS thread), not read
    assert not missing, sorted(missing)


def test_man_files_names_every_marker_and_state_file():
    from ckptctl.formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER
    from ckptctl.writing.distributed import DIST_DIR
    from ckptctl.tiering.promote import JOURNAL

    files = _man_section("FILES").replace("\\-", "-").replace("\\", "")
    for name in (MANIFEST, WRITING_MARKER, PIN_FILE, DIST_DIR, JOURNAL, "ckptctl.toml",
                 "ckptctl.pack.json", "ckptctl/watch/", "status.json", "events.jsonl",
                 "ckptctl/promote/", ".ckptctl-probe-"):
        assert name in files, name


# ------------------------------------------------------------------------------ completions

def _complete(line: str, cwd: Path) -> list[str]:
    """What bash completion offers for the last word of ``line``, run in ``cwd``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("_CKPTCTL_")}
    env.pop("CKPTCTL_CONFIG", None)
    env.update(COMP_WORDS=line, COMP_CWORD=str(len(line.split(" ")) - 1),
               _CKPTCTL_COMPLETE="complete_bash", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "ckptctl"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_completions_offer_to_rules_and_tiers(tmp_path):
    (tmp_path / "hot" / "step-100").mkdir(parents=True)
    (tmp_path / "hot" / "step-200").mkdir()
    (tmp_path / "llama-rules.toml").write_text("")
    (tmp_path / "ckptctl.toml").write_text(
        f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n'
        '[[tier]]\nname = "cold"\nurl = "s3://bucket/run1"\n')
    assert _complete("ckptctl reshard a b --to ", tmp_path) == ["dcp", "megatron-legacy"]
    assert _complete("ckptctl consolidate a b --to d", tmp_path) == \
        ["dcp", "deepspeed-universal"]
    assert _complete("ckptctl reshard a b --rules ll", tmp_path) == ["llama", "llama-rules.toml"]
    offered = _complete("ckptctl promote ", tmp_path)
    assert {"hot:", "cold:"} <= set(offered) and "hot/" in offered  # tiers, then paths
    assert _complete("ckptctl inspect hot:step-", tmp_path) == ["hot:step-100", "hot:step-200"]
    assert _complete("ckptctl gc co", tmp_path) == ["cold:"]
    assert _complete("ckptctl ls /no/such/pl", tmp_path) == []  # the shell's own completion
    (tmp_path / "ckptctl.toml").write_text("[[tier]]\nnot toml")  # a bad config: no tiers
    assert _complete("ckptctl inspect h", tmp_path) == []


# -------------------------------------------------------------------------------- hints

#: options of other programs that ckptctl's text names on purpose (owner, for the reader)
FOREIGN_OPTIONS = {"--ckpt-format": "Megatron's checkpoint format flag",
                   "--resume": "the training script's, in `--resume \"$(ckptctl latest)\"`",
                   "--signal": "systemctl kill's"}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?P<glob>-\*)?")


def _all_options() -> set[str]:
    group = _group()
    names = set(group.context_settings.get("help_option_names", ["--help"]))
    for cmd in [group, *group.commands.values()]:
        for p in cmd.params:
            names |= set(getattr(p, "opts", ())) | set(getattr(p, "secondary_opts", ()))
    return {n for n in names if n.startswith("--")}


def options_named(source: str) -> list[tuple[str, int]]:
    """(option, line) for every ``--option`` a string of ``source`` names (messages, help,
    docstrings; ``--keep-*`` stands for every option it starts).

    >>> options_named('raise UsageError("give --keep-last or --keep-*; see --help")')
    [('--keep-last', 1), ('--keep-*', 1), ('--help', 1)]
    """
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out += [(m.group(0), n.lineno) for m in OPTION.finditer(n.value)]
    return out


def test_every_option_a_message_names_exists():
    """A hint ("give --keep-last", "rerun with --force") names an option some command has;
    the rest are other programs' (FOREIGN_OPTIONS)."""
    known = _all_options()
    bad = []
    for path in sorted((ROOT / "ckptctl").rglob("*.py")):
        for option, line in options_named(path.read_text(encoding="utf-8")):
            if option.endswith("-*"):
                ok = any(k.startswith(option[:-1]) for k in known)
            else:
                ok = option in known or option in FOREIGN_OPTIONS
            if not ok:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {option}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------- verify a .pt without torch

NO_TORCH_VERIFY = """
import json, sys
from ckptctl.cli.main import main
try:
    main(["verify", "--level", "full", "--check-finite", "--json", sys.argv[1]])
except SystemExit as e:
    code = e.code
assert "torch" not in sys.modules, "verify imported torch"
sys.exit(code)
"""


def _verify_without_torch(path: Path) -> tuple[int, dict]:
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", NO_TORCH_VERIFY, str(path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert "verify imported torch" not in p.stderr, p.stderr[-2000:]
    return p.returncode, json.loads(p.stdout)


def test_verify_torch_save_without_importing_torch(tmp_path):
    import torch

    pt = tmp_path / "model.pt"
    torch.save({"model": {"w": torch.arange(64.0).view(8, 8), "b": torch.ones(8).bfloat16()},
                "step": 7}, pt)
    code, doc = _verify_without_torch(pt)
    assert code == 0 and doc["ok"] and doc["content"] == "crc", doc
    assert (doc["step"], doc["num_tensors_checked"], doc["num_files"]) == (7, 2, 1)
    data = bytearray(pt.read_bytes())  # one flipped bit inside w's bytes
    at = data.find(torch.arange(64.0).numpy().tobytes()[8:16])
    data[at] ^= 0x01
    pt.write_bytes(bytes(data))
    code, doc = _verify_without_torch(pt)
    assert code == 1 and not doc["ok"], doc
    assert {p["code"] for p in doc["problems"]} & {"CRC_MISMATCH", "HASH_MISMATCH"}, doc


def test_verify_legacy_torch_save_still_reads_with_torch(cli, tmp_path):
    """The legacy (non-zip) format has no records to check: torch loads it, as before."""
    import torch

    pt = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, pt, _use_new_zipfile_serialization=False)
    code, out, err = cli("verify", "--level", "full", str(pt))
    assert code == 0, out + err


# ------------------------------------------------------------------ diff --cast

def test_diff_cast_compares_an_export_across_dtypes(cli, tiny_dcp, tmp_path):
    """consolidate --dtype bf16 of an fp32 checkpoint, diffed against its source: without
    --cast a dtype mismatch; with it equal within bf16's rounding; an explicit tolerance
    wins; a real change is still found."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "hf"
    code, _, err = cli("consolidate", str(tiny_dcp), str(out), "--only", "model",
                       "--dtype", "bf16", "-q")
    assert code == 0, err
    code, text, _ = cli("diff", str(out), str(tiny_dcp), "--only", "model.*", "--json")
    doc = json.loads(text)
    assert code == 1 and doc["counts"]["dtype_mismatch"] == 1, doc  # emb.weight fp32 -> bf16
    code, text, err = cli("diff", str(out), str(tiny_dcp), "--only", "model.*", "--cast",
                          "--json")
    doc = json.loads(text)
    assert code == 0 and doc["equal"], (doc, err)
    (emb,) = [e for e in doc["entries"] if e["name"] == "model.emb.weight"]
    assert (emb["status"], emb["dtype"], emb["dtype_b"]) == \
        ("equal_within_tolerance", "bfloat16", "float32"), emb
    assert "rtol=0.0078125" in emb["note"] and emb["changed"] > 0
    code, text, _ = cli("diff", str(out), str(tiny_dcp), "--only", "model.*", "--cast",
                        "--rtol", "1e-9", "--json")  # an explicit tolerance is the one used
    assert code == 1 and json.loads(text)["counts"]["different"] == 1, text
    # one value really changed: different, whatever the cast
    (f,) = list(out.glob("*.safetensors"))
    t = load_file(str(f))
    t["model.emb.weight"] = t["model.emb.weight"].clone()
    t["model.emb.weight"].view(torch.int16).view(-1)[0] ^= 0x4000  # the exponent: far off
    save_file(t, str(f))
    code, text, _ = cli("diff", str(out), str(tiny_dcp), "--only", "model.*", "--cast",
                        "--json")
    doc = json.loads(text)
    (emb,) = [e for e in doc["entries"] if e["name"] == "model.emb.weight"]
    assert code == 1 and emb["status"] == "different" and emb["outside_tolerance"] == 1, emb
