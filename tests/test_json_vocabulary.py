"""One vocabulary across verbs (issue 21 part 4): every verb is run with ``--json`` on small
real checkpoints (DCP written by torch, its pack, its reshard), every key path of every
document is collected, and the test fails when

* two names of one meaning (:data:`ckptctl.ops.vocabulary.SYNONYMS`) both appear, or the
  one that appears is not the chosen one (a retired key is back);
* a size, count or rate (:func:`~ckptctl.ops.vocabulary.must_be_int`) is not an integer;
* a verb that has ``--json`` is not in the walk;
* the README's "JSON vocabulary" table is not the one :data:`VOCABULARY` generates.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl.ops.vocabulary import RETIRED, SYNONYMS, VOCABULARY, must_be_int
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
