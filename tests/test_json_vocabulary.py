"""One vocabulary across verbs (issue 21 part 4, issue 35 item 9): every verb is run with
``--json`` on small real checkpoints (DCP written by torch, its pack, its reshard), every
key path of every document is collected, and the test fails when

* two names of one meaning (:data:`ckptctl.catalog.vocabulary.SYNONYMS`) both appear, or the
  one that appears is not the chosen one (a retired key is back);
* verbs that describe one checkpoint (an ``ls`` row, ``inspect``, ``verify``, ``latest``,
  ``seal``, ``pin``, ``rm``; unsealed, sealed, with a user's file beside it, packed) give
  a key they share two values (:func:`disagreements`): a key whose meaning differs between
  verbs;
* a size, count or rate (:func:`~ckptctl.catalog.vocabulary.must_be_int`) is not an integer;
* a verb that has ``--json`` is not in the walk;
* the README's "JSON vocabulary" table is not the one :data:`VOCABULARY` generates.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl.catalog.vocabulary import RETIRED, SYNONYMS, VOCABULARY, must_be_int
from conftest import run_cli, write_tiny_dcp

ROOT = Path(__file__).resolve().parents[1]

def key_paths(doc, where: str = "$"):
    """(path, key, value) of every key of a JSON document, list items as ``[]``.

    >>> [(p, k) for p, k, _ in key_paths({"a": [{"b": 1}], "c": 2})]
    [('$.a', 'a'), ('$.a[].b', 'b'), ('$.c', 'c')]
    """
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield f"{where}.{k}", k, v
            yield from key_paths(v, f"{where}.{k}")
    elif isinstance(doc, list):
        for v in doc:
            yield from key_paths(v, where + "[]")


def _ok(*args: str, codes=(0,)) -> dict:
    code, out, err = run_cli(*args, "--json")
    assert code in codes, (args, code, out, err)
    return json.loads(out)


@pytest.fixture(scope="module")
def documents(tmp_path_factory, monkeypatch_module) -> dict[str, list[dict]]:
    """verb -> the --json documents of its runs (success, findings and errors)."""
    d = tmp_path_factory.mktemp("vocab")
    monkeypatch_module.setenv("XDG_CACHE_HOME", str(d / "cache"))
    run = d / "run"
    run.mkdir()
    write_tiny_dcp(run / "step-42")
    ck = str(run / "step-42")
    cfg = d / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{run}"\n'
                   f'[[tier]]\nname = "warm"\nurl = "{d / "warm"}"\nbwlimit = "1MiB/s"\n')
    docs: dict[str, list[dict]] = {}

    def add(verb: str, *args: str, codes=(0,)) -> dict:
        doc = _ok(*args, codes=codes)
        docs.setdefault(verb, []).append(doc)
        return doc

    add("ls", "ls", str(run))
    add("inspect", "inspect", ck)
    add("verify", "verify", ck, "--level", "full")
    add("latest", "latest", str(run))
    (d / "empty").mkdir()
    add("latest", "latest", str(d / "empty"), codes=(1,))  # none: a document, url null
    add("pin", "pin", ck, "--reason", "paper")
    add("gc", "gc", str(run), "--keep-last", "1", "--dry-run")
    add("unpin", "unpin", ck)
    add("reshard", "reshard", ck, str(d / "r2"), "--world-size", "2", "--dry-run")
    add("reshard", "reshard", ck, str(d / "r2"), "--world-size", "2")
    add("consolidate", "consolidate", ck, str(d / "c"), "--to", "safetensors", "--only",
        "model")
    add("diff", "diff", ck, str(d / "r2"))
    add("diff", "diff", ck, str(d / "c"), codes=(1,))
    add("promote", "promote", ck, str(d / "pr"), "--dry-run")
    add("promote", "promote", ck, str(d / "pr"))
    add("seal", "seal", ck)
    add("pack", "pack", ck, str(d / "p"))
    add("inspect", "inspect", str(d / "p"))
    add("unpack", "unpack", str(d / "p"), str(d / "u"))
    add("verify", "verify", str(run), "--all", "--level", "quick")
    add("tiers", "tiers", "--config", str(cfg))
    add("plan", "plan", "--config", str(cfg), "--checkpoint", ck, "--save-seconds", "60",
        "--mtbf", "2.8h", "--measure", "hot", "--measure-size", "1MiB")
    add("watch", "--config", str(cfg), "watch", "--once", "--settle", "0", "--no-nice")
    add("watch", "--config", str(cfg), "watch", "--status")
    add("rm", "rm", str(d / "u"))
    add("rm", "rm", str(d / "nope"), codes=(3,))  # an error document
    add("man", "man")
    add("report", "report", str(run), "--save-seconds", "60", "--mtbf", "2.8h")
    add("report", "--config", str(cfg), "report", "--against", ck)
    return docs


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _keys(documents) -> dict[str, set[str]]:
    """key -> the paths (``verb:$.a.b``) it appears at."""
    seen: dict[str, set[str]] = {}
    for verb, docs in documents.items():
        for doc in docs:
            for path, key, _ in key_paths(doc):
                seen.setdefault(key, set()).add(f"{verb}:{path}")
    return seen


def test_every_verb_with_json_is_walked(documents):
    import typer

    from ckptctl.cli.main import app

    group = typer.main.get_command(app)
    with_json = {name for name, cmd in group.commands.items()
                 if any("--json" in p.opts for p in cmd.params)}
    assert with_json == set(group.commands), set(group.commands) - with_json  # every verb
    assert set(documents) == with_json, set(documents) ^ with_json


def test_one_name_per_meaning(documents):
    seen = _keys(documents)
    bad = []
    for chosen, *others in SYNONYMS:
        for other in others:
            if other in seen:
                bad.append(f"{other!r} means {chosen!r}: at {sorted(seen[other])[:3]}")
    assert not bad, "\n".join(bad)


def test_retired_keys_are_gone(documents):
    seen = _keys(documents)
    gone = set(RETIRED) - {"created"} - set(VOCABULARY)  # created: kept, one meaning now
    assert not gone & set(seen), {k: sorted(seen[k])[:3] for k in gone & set(seen)}


def test_sizes_counts_and_rates_are_integers(documents):
    bad = []
    for verb, docs in documents.items():
        for doc in docs:
            for path, key, value in key_paths(doc):
                if not must_be_int(key) or value is None:
                    continue
                if isinstance(value, dict):  # {name: count}
                    values = list(value.values())
                else:
                    values = [value]
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                    bad.append(f"{verb}:{path} = {value!r}")
    assert not bad, "\n".join(bad)


def test_times_are_iso_utc(documents):
    for verb, docs in documents.items():
        for doc in docs:
            for path, key, value in key_paths(doc):
                if key in ("modified", "created", "initiated", "pinned_at", "now",
                           "started") and value is not None:
                    assert isinstance(value, str) and value.endswith("Z"), (verb, path, value)


def test_pack_unpack_inspect_seal_agree_on_the_id(documents):
    """One meaning, one key, one value: the checkpoint's manifest id everywhere."""
    (seal,) = documents["seal"]
    (pack,) = documents["pack"]
    (unpack,) = documents["unpack"]
    plain, packed = documents["inspect"]
    assert seal["manifest_id"] == pack["manifest_id"] == unpack["manifest_id"]
    assert packed["pack"]["manifest_id"] == packed["manifest_id"] == seal["manifest_id"] \
        != pack["pack_id"]
    assert plain.get("manifest_id") is None  # inspected before it was sealed


def test_readme_lists_the_vocabulary():
    import docsgen

    readme = (ROOT / "README.md").read_text()
    assert docsgen.vocabulary_table() in readme
    for key in VOCABULARY:
        assert f"`{key.split(',')[0]}" in readme, key


# ------------------------------------------------- one value per key (issue 35, item 9)

#: Keys whose value is free text about the object it sits in (why a state, why a pin):
#: two verbs may say different things there without a second meaning.
FREE_TEXT = {"reason", "message", "note", "notes"}
#: Keys that measure one run rather than describe the checkpoint.
PER_RUN = {"seconds", "bytes_per_second", "action", "changed"}


def disagreements(views: dict[str, dict]) -> list[str]:
    """What several verbs say differently of one checkpoint: ``views`` maps a verb to the
    part of its ``--json`` document that describes it (an ``ls`` row, ``inspect``'s whole
    document...); each key two or more of them carry must have one value there.

    >>> disagreements({"ls": {"num_files": 3, "step": 7}, "verify": {"num_files": 2,
    ...                "step": 7}, "inspect": {"num_files": 3}})
    ["num_files: {'ls': 3, 'verify': 2, 'inspect': 3}"]
    """
    shared: dict[str, dict[str, object]] = {}
    for verb, view in views.items():
        for key, value in view.items():
            if key not in FREE_TEXT | PER_RUN:
                shared.setdefault(key, {})[verb] = value
    return [f"{key}: {values}" for key, values in sorted(shared.items())
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1]


def _in(workdir: Path, *args: str, codes=(0,)) -> dict:
    """``ckptctl ARGS --json`` run in ``workdir`` (places given relative to it)."""
    import os

    here = os.getcwd()
    os.chdir(workdir)
    try:
        return _ok(*args, codes=codes)
    finally:
        os.chdir(here)


def _row(ls_doc: dict, name: str) -> dict:
    return next(c for c in ls_doc["checkpoints"] if c["name"] == name)


def describe(workdir: Path, root: str, name: str, *, seal: bool = False) -> dict[str, dict]:
    """Every verb's view of the checkpoint ``root/name`` (paths relative to ``workdir``):
    first, with ``seal``, ``seal`` of it (sealing, or verifying its seal); then its ``ls``
    row, ``inspect``, ``verify --level full`` and ``latest`` (the newest under ``root``)."""
    ck = f"{root}/{name}"
    views = {"seal": _in(workdir, "seal", ck)} if seal else {}
    views.update({"ls": _row(_in(workdir, "ls", root), name),
                  "inspect": _in(workdir, "inspect", ck),
                  "verify": _in(workdir, "verify", ck, "--level", "full"),
                  "latest": _in(workdir, "latest", root)})
    for verb in ("inspect", "verify"):  # what they list of its insides is theirs alone
        for key in ("tensors", "objects", "tree", "dtypes", "layout", "closure", "metadata"):
            views[verb].pop(key, None)
    return views


@pytest.fixture(scope="module")
def described(tmp_path_factory, torch_ckpts) -> dict[str, dict[str, dict]]:
    """A DCP checkpoint torch wrote (FSDP, 4 ranks) as every verb describes it, given as
    relative paths: unsealed, sealed, sealed with a user's NOTES.md beside it, pinned, its
    pack, and the pack's removal. Phase -> verb -> view."""
    from fixtures_torch import copy_ckpt

    work = tmp_path_factory.mktemp("one-value")
    copy_ckpt(torch_ckpts["fsdp"], work / "run" / "step-20")
    out = {"unsealed": describe(work, "run", "step-20")}
    out["sealed"] = describe(work, "run", "step-20", seal=True)
    out["sealed"]["seal (again)"] = _in(work, "seal", "run/step-20")
    (work / "run" / "step-20" / "NOTES.md").write_text("eval: 3.1\n")
    out["with NOTES.md"] = describe(work, "run", "step-20", seal=True)
    out["pinned"] = {"pin": _in(work, "pin", "run/step-20", "--reason", "paper"),
                     "ls": _row(_in(work, "ls", "run"), "step-20")}
    _in(work, "pack", "run/step-20", "cold/step-20")
    out["pack"] = describe(work, "cold", "step-20")
    out["pack"]["seal of its source"] = {"manifest_id": out["sealed"]["seal"]["manifest_id"]}
    row = _row(_in(work, "ls", "cold"), "step-20")
    out["rm"] = {"ls": row, "rm": _in(work, "rm", "cold/step-20")}
    return out


@pytest.mark.parametrize("phase", ["unsealed", "sealed", "with NOTES.md", "pinned", "pack",
                                   "rm"])
def test_a_key_has_one_value_in_every_verb(described, phase):
    """For one checkpoint, a key several verbs carry has one value: a key whose meaning
    differs between verbs (num_files with and without the manifest) fails here."""
    views = described[phase]
    assert len(views) > 1
    assert not disagreements(views), "\n".join(disagreements(views))


def test_the_shared_values_are_the_checkpoints(described):
    """What the views agree on is right: the files it owns (a user's NOTES.md is not one
    until a seal lists it; the manifest never), its step, its id, the place as given."""
    names = {"unsealed": 5, "sealed": 5, "with NOTES.md": 5}
    for phase, n in names.items():
        views = described[phase]
        assert {v["num_files"] for v in views.values() if "num_files" in v} == {n}, phase
        assert {v["url"] for v in views.values() if "url" in v} == {"run/step-20"}, phase
        assert {v["step"] for v in views.values() if "step" in v} == {20}, phase
    notes = described["with NOTES.md"]
    assert [p["code"] for p in notes["verify"]["problems"]] == ["EXTRA_FILE"]
    assert notes["verify"]["problems"][0]["path"] == "run/step-20/NOTES.md"
    assert notes["verify"]["ok"] is True and notes["verify"]["num_warnings"] == 1
    sealed = described["sealed"]
    assert sealed["inspect"]["manifest_id"] == sealed["seal"]["manifest_id"] is not None
    assert described["pack"]["ls"]["num_files"] == 2  # the pack's index and data file
    assert described["rm"]["rm"]["url"] == "cold/step-20"


def test_the_check_fails_on_a_key_whose_meaning_differs(described, tmp_path, monkeypatch,
                                                         torch_ckpts):
    """With inspect counting the manifest among the files again (as it did before issue
    35), the walk over the same checkpoint fails, naming num_files and bytes."""
    import importlib

    from ckptctl.formats.manifest import MANIFEST
    from fixtures_torch import copy_ckpt

    inspect_mod = importlib.import_module("ckptctl.catalog.inspect")  # ops.inspect: the verb

    counted = inspect_mod.counted_files

    def with_manifest(files, manifest=None, **kw):
        own = counted(files, manifest, **kw)
        return {**own, **({MANIFEST: files[MANIFEST]} if MANIFEST in files else {})}

    monkeypatch.setattr(inspect_mod, "counted_files", with_manifest)
    copy_ckpt(torch_ckpts["fsdp"], tmp_path / "run" / "step-20")
    views = describe(tmp_path, "run", "step-20", seal=True)
    found = disagreements(views)
    assert [d.split(":")[0] for d in found] == ["bytes", "num_files"], found
