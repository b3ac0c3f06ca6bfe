"""A conversion never carries what the safe loader refused (issue 17, item 3): a DCP
checkpoint whose bytes entry is a pickle naming ``posix.system`` (or ``io.open``) is
refused by reshard and consolidate as seal refuses it, one line naming the entry and the
global, before a byte is written: nothing is sealed, nothing looks valid, the payload never
runs. ``--drop NAME`` leaves the entry out, and torch's own ``dcp.load`` reads the rest."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from conftest import TESTS, dcp_save
from test_cli_errors import _opts
from test_hostile import _Evil

torch = pytest.importorskip("torch")


class _System:
    """Pickles as ``os.system(cmd)``: torch.save writes the global ``posix.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_dcp(path, marker, *, payload=_System, zstd: bool = False) -> dict:
    """A real DCP checkpoint (torch wrote it) whose bytes entry ``extra.payload`` runs code
    (creating ``marker``) when a full unpickler loads it; returns its tensors."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g),
               "h": torch.arange(6, dtype=torch.int64).to(torch.bfloat16)}
    dcp_save(path, {"model": dict(tensors), "extra": {"payload": payload(str(marker))},
                    "step": 5}, zstd=zstd)
    return tensors


@pytest.fixture(params=["plain", "zstd"])
def hostile(request, tmp_path):
    """(source checkpoint, its tensors, the marker the payload would create)."""
    marker = tmp_path / "PAYLOAD-RAN"
    src = tmp_path / "src" / "step-5"
    tensors = _hostile_dcp(src, marker, zstd=request.param == "zstd")
    return src, tensors, marker


def _one_line(err: str, *words) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    for w in words:
        assert w in err, err


def _nothing_committed(cli, parent, dst) -> None:
    """DST left nothing that looks valid: no manifest, no .metadata, not listed, not latest."""
    assert not (dst / "ckptctl.manifest.json").exists() and not (dst / ".metadata").exists()
    if parent.exists():
        code, out, err = cli("ls", str(parent), "--json")
        assert code == 0, err
        assert [c["name"] for c in json.loads(out)["checkpoints"]
                if c["state"] in ("sealed", "complete")] == []
        assert cli("latest", str(parent))[0] == 1


CONVERSIONS = {
    "reshard": ("reshard", "--world-size", "2"),
    "consolidate-dcp": ("consolidate", "--to", "dcp"),
    "consolidate-torch": ("consolidate", "--to", "torch"),
}


def _convert(cli, kind, src, dst, *extra):
    verb, *opts = CONVERSIONS[kind]
    return cli(verb, str(src), str(dst), *opts, *extra)


def test_the_fixture_is_live(hostile, tmp_path):
    """torch's own ``dcp.load`` of the source runs the payload (in a child process): the
    marker the other tests look for is what it creates."""
    src, _, marker = hostile
    script = ("import sys, warnings, torch.distributed.checkpoint as dcp\n"
              "warnings.simplefilter('ignore')\n"
              "dcp.load({'extra': {'payload': 0}}, checkpoint_id=sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(src)], capture_output=True, timeout=300)
    assert marker.exists()


def test_seal_and_pack_refuse_the_source(hostile, cli, tmp_path):
    """The baseline the conversions follow: seal refuses it (exit 1), and so does pack (it
    seals an unsealed source first): the source stays unsealed and no pack is made."""
    src, _, marker = hostile
    code, _, err = cli("seal", str(src))
    assert code == 1
    _one_line(err, "UNSAFE_INPUT", "posix.system")
    code, _, err = cli("pack", str(src), str(tmp_path / "packs" / "step-5"))
    assert code == 1
    _one_line(err, "posix.system")
    assert not (src / "ckptctl.manifest.json").exists()
    assert not (tmp_path / "packs" / "step-5").exists()
    assert not marker.exists()


@pytest.mark.parametrize("kind", sorted(CONVERSIONS))
def test_conversion_refuses_an_object_the_safe_loader_refuses(hostile, cli, tmp_path, kind):
    src, _, marker = hostile
    parent = tmp_path / "out"
    dst = parent / "step-5"
    code, out, err = _convert(cli, kind, src, dst)
    assert code == 1, (code, out, err)
    _one_line(err, str(src), "object entry 'extra.payload' names posix.system",
              "safe loader", "--drop 'extra.payload'")
    assert not dst.exists()
    _nothing_committed(cli, parent, dst)
    assert not marker.exists()


def test_refusal_in_json_is_unsafe_input(hostile, cli, tmp_path):
    src, _, marker = hostile
    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--world-size", "2",
                         "--json")
    assert code == 1
    e = json.loads(out)["error"]
    assert e["code"] == "UNSAFE_INPUT" and e["exit_code"] == 1 and "extra.payload" in e["message"]
    assert not (tmp_path / "o").exists() and not marker.exists()


def test_other_globals_are_refused_too(tmp_path, cli):
    """test_hostile's hostile fixture ``_Evil`` (``open(path, "w")``, pickled as ``io.open``)."""
    marker = tmp_path / "opened"
    src = tmp_path / "src" / "step-5"
    _hostile_dcp(src, marker, payload=_Evil)
    code, _, err = cli("consolidate", str(src), str(tmp_path / "o"), "--to", "dcp")
    assert code == 1
    _one_line(err, "'extra.payload' names io.open")
    assert not (tmp_path / "o").exists() and not marker.exists()


def _load_with_torch(dst, tensors) -> dict:
    """``torch.distributed.checkpoint.load`` of ``dst`` into fresh tensors (torch's own
    reader, run in a child process so that nothing it unpickles can touch this one)."""
    script = (
        "import sys, pickle, warnings, torch, torch.distributed.checkpoint as dcp\n"
        "shapes = pickle.loads(bytes.fromhex(sys.argv[2]))\n"
        "sd = {'model': {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}, 'step': 0}\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    dcp.load(sd, checkpoint_id=sys.argv[1])\n"
        "md = dcp.FileSystemReader(sys.argv[1]).read_metadata()\n"
        "sys.stdout.buffer.write(pickle.dumps(({k: v.view(torch.uint8).flatten().numpy().tobytes()\n"
        "    for k, v in sd['model'].items()}, sd['step'], sorted(md.state_dict_metadata))))\n")
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    p = subprocess.run([sys.executable, "-c", script, str(dst), pickle.dumps(shapes).hex()],
                       capture_output=True, timeout=300, cwd=TESTS)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return pickle.loads(p.stdout)


@pytest.mark.parametrize("kind,drop", [("reshard", "extra.payload"),
                                       ("consolidate-dcp", "extra.*")])
def test_drop_leaves_the_entry_out(hostile, cli, tmp_path, kind, drop):
    src, tensors, marker = hostile
    dst = tmp_path / "out" / "step-5"
    code, out, err = _convert(cli, kind, src, dst, "--drop", drop, "--json")
    assert code == 0, (code, out, err)
    doc = json.loads(out)
    assert doc["dropped"] == ["extra.payload"] and doc["manifest_id"]
    assert cli("verify", str(dst), "--level", "full")[0] == 0
    loaded, step, names = _load_with_torch(dst, tensors)
    assert "extra.payload" not in names and step == 5
    assert names == sorted([f"model.{k}" for k in tensors] + ["step"])
    for k, v in tensors.items():
        assert loaded[k] == v.view(torch.uint8).flatten().numpy().tobytes(), k
    assert not marker.exists()


def test_drop_says_what_it_left_out_and_refuses_a_glob_that_names_nothing(hostile, cli,
                                                                           tmp_path):
    src, _, marker = hostile
    code, out, err = cli("consolidate", str(src), str(tmp_path / "m.pt"), "--to", "torch",
                         "--drop", "extra.payload", "--drop", "model.h")
    assert code == 0, err
    assert "left out (--drop): extra.payload, model.h" in out
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(sd["model"]) == ["b", "w"] and "extra" not in sd and sd["step"] == 5
    code, _, err = cli("reshard", str(src), str(tmp_path / "x"), "--world-size", "2",
                       "--drop", "extra.nope")
    assert code == 2
    _one_line(err, "--drop 'extra.nope' names no entry")
    assert not (tmp_path / "x").exists() and not marker.exists()


def test_the_writer_itself_never_carries_a_refused_object(hostile, tmp_path):
    """Past the up-front check (a library caller with its own plan), the copier scans the
    bytes it is about to write: refused, and the output removed, nothing sealed."""
    from ckptctl.errors import Finding
    from ckptctl.formats import open_checkpoint
    from ckptctl.layout import parse_mesh, preset
    from ckptctl.convert.copier import copy_to_dcp
    from ckptctl.convert.planner import make_plan

    src, _, marker = hostile
    ck = open_checkpoint(str(src))
    plan = make_plan(ck, preset("fsdp", parse_mesh("dp=2")))
    assert "extra.payload" in plan.objects
    dst = tmp_path / "out"
    with pytest.raises(Finding, match="'extra.payload' names posix.system") as e:
        copy_to_dcp(ck, plan, str(dst), max_memory=1 << 20, workers=2)
    assert e.value.code == "UNSAFE_INPUT"
    assert not dst.exists() and not marker.exists()


def test_several_refused_objects_are_all_counted(tmp_path, cli):
    marker = tmp_path / "ran"
    src = tmp_path / "src" / "step-1"
    dcp_save(src, {"w": torch.ones(2), "a": _System(str(marker)), "b": _Evil(str(marker)),
                   "c": _System(str(marker))})
    code, _, err = cli("reshard", str(src), str(tmp_path / "o"), "--world-size", "1")
    assert code == 1
    _one_line(err, "'a' names posix.system", "2 more object entries", "b, c")
    code, _, err = cli("reshard", str(src), str(tmp_path / "o"), "--world-size", "1",
                       "--drop", "[abc]")
    assert code == 0, err
    assert not marker.exists()


def test_s3_source_refused_then_dropped(tmp_path, s3_bucket, cli):
    marker = tmp_path / "PAYLOAD-RAN"
    local = tmp_path / "src" / "step-5"
    _hostile_dcp(local, marker)
    s3_bucket.upload(local, "src/step-5")
    opts = _opts(s3_bucket)
    dst = s3_bucket.url("out/step-5")
    code, _, err = cli("reshard", s3_bucket.url("src/step-5"), dst, "--world-size", "2", *opts)
    assert code == 1
    _one_line(err, "'extra.payload' names posix.system")
    assert s3_bucket.fs().find(s3_bucket.path("out")) == []  # no object written at all
    code, _, err = cli("reshard", s3_bucket.url("src/step-5"), dst, "--world-size", "2",
                       "--drop", "extra.payload", *opts)
    assert code == 0, err
    code, out, err = cli("ls", s3_bucket.url("out"), "--json", *opts)
    assert [c["state"] for c in json.loads(out)["checkpoints"]] == ["sealed"], (out, err)
    assert not marker.exists()
