"""Orbax checkpoints on object stores (issue 39 with issue 38; ckptctl/formats/orbax.py):
the verbs that need no array data judge a CheckpointManager root by its files alone on
s3:// (moto) and gs:// (fake-gcs-server) -- steps, commit states, latest, gc of whole
steps, verify --level quick -- and promote carries a local Orbax step there and back byte
for byte. On s3:// the arrays are read through tensorstore's own s3 driver (inspect,
consolidate bit for bit against Orbax's restore, seal, verify --level full), on gs://
through its gcs driver pointed at the emulator; on az:// reading them is refused by name,
one line, exit 3; an S3 server that answers ranged reads with HTTP 200 (rclone serve s3)
is an I/O error, never a finding."""

import json
from pathlib import Path

import pytest
from fixtures_orbax import TMP_SUFFIX, safetensors_entries

REFUSED = "Orbax arrays on an object store"


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _opts(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


@pytest.fixture(params=["s3", "gs"])
def place(request):
    """(bucket, its CLI options) on moto (s3://) or fake-gcs-server (gs://, its
    environment set by the fixture)."""
    if request.param == "s3":
        b = request.getfixturevalue("moto_bucket")
        return b, _opts(b)
    return request.getfixturevalue("gcs_bucket"), []


def _ls(cli, url: str, opts) -> dict:
    code, out, err = cli("ls", url, "--json", *opts)
    assert code == 0, err
    return {r["name"]: r for r in json.loads(out)["checkpoints"]}


def test_ls_and_latest_of_a_manager_root(orbax_ckpts, cli, place):
    bucket, opts = place
    bucket.upload(orbax_ckpts.manager, "run")
    rows = _ls(cli, bucket.url("run"), opts)
    assert {n: (r["step"], r["format"], r["state"]) for n, r in rows.items()} == {
        "10": (10, "orbax", "complete"), "20": (20, "orbax", "complete")}
    code, out, err = cli("latest", bucket.url("run"), *opts)
    assert (code, out.strip()) == (0, bucket.url("run/20")), err


def test_saves_in_flight_are_incomplete_and_never_latest(orbax_ckpts, cli, place):
    bucket, opts = place
    bucket.upload(orbax_ckpts.inflight, "run")
    rows = _ls(cli, bucket.url("run"), opts)
    assert {n: (r["step"], r["state"]) for n, r in rows.items()} == {
        "10": (10, "complete"), f"20{TMP_SUFFIX}": (20, "incomplete"),
        f"30{TMP_SUFFIX}": (30, "incomplete")}
    assert all("NOT_COMMITTED" in rows[f"{s}{TMP_SUFFIX}"]["reason"] for s in (20, 30))
    code, out, err = cli("latest", bucket.url("run"), *opts)
    assert (code, out.strip()) == (0, bucket.url("run/10")), err


def test_verify_quick_judges_by_the_files(orbax_ckpts, cli, place):
    bucket, opts = place
    bucket.upload(orbax_ckpts.manager, "run")
    code, out, err = cli("verify", bucket.url("run/20"), "--level", "quick", "--json", *opts)
    doc = json.loads(out)
    assert (code, doc["ok"], doc["format"], doc["step"]) == (0, True, "orbax", 20), out + err


def test_orbax_arrays_on_gcs(orbax_ckpts, cli, gcs_bucket, tmp_path):
    """inspect and consolidate read the arrays through tensorstore's gcs driver, pointed
    at the emulator STORAGE_EMULATOR_HOST names: what Orbax's own restore gives."""
    from ckptctl.model import DTYPES

    gcs_bucket.upload(orbax_ckpts.manager, "run")
    url = gcs_bucket.url("run/20")
    oracle = orbax_ckpts.oracle("manager-20")
    code, out, err = cli("inspect", url, "--json")
    assert code == 0, err
    got = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in json.loads(out)["tensors"]}
    assert got == {k: (a.dtype.name, a.shape) for k, a in oracle.items()}
    code, _, err = cli("consolidate", url, str(tmp_path / "hf"), "--to", "safetensors")
    assert code == 0, err
    got = safetensors_entries(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(oracle)
    for k, a in oracle.items():
        assert got[k] == (DTYPES[a.dtype.name].safetensors, a.shape, a.tobytes()), k


def test_array_reads_on_azure_are_refused_by_name(orbax_ckpts, cli, az_container, tmp_path):
    """az:// has no tensorstore driver: what reads arrays is refused, one line, exit 3,
    nothing written; ls still judges the steps by their files."""
    az_container.upload(orbax_ckpts.manager, "run")
    url = az_container.url("run/20")
    for args in (("inspect", url), ("verify", url, "--level", "structure"),
                 ("verify", url, "--level", "full"), ("seal", url),
                 ("consolidate", url, str(tmp_path / "out"), "--to", "safetensors")):
        code, out, err = cli(*args)
        assert (code, out) == (3, ""), (args, err)
        assert REFUSED in _one_line(err), err
    assert not (tmp_path / "out").exists()
    assert "run/20/ckptctl.manifest.json" not in az_container.list("run")
    assert set(_ls(cli, az_container.url("run"), [])) == {"10", "20"}


def test_an_unfinished_step_on_gcs_has_no_commit_file(orbax_ckpts, cli, gcs_bucket):
    """On gs:// Orbax writes a step in place, ``commit_success.txt`` last."""
    gcs_bucket.upload(orbax_ckpts.manager, "run")
    gcs_bucket.delete("run/20/commit_success.txt")
    rows = _ls(cli, gcs_bucket.url("run"), [])
    assert (rows["20"]["state"], rows["10"]["state"]) == ("incomplete", "complete")
    assert "commit_success.txt" in rows["20"]["reason"]
    code, out, err = cli("latest", gcs_bucket.url("run"))
    assert (code, out.strip()) == (0, gcs_bucket.url("run/10")), err


def test_gc_removes_whole_old_steps(orbax_ckpts, cli, place):
    bucket, opts = place
    bucket.upload(orbax_ckpts.manager, "run")
    before = _keys(bucket, "run")
    code, _, err = cli("gc", bucket.url("run"), "--keep-last", "1", *opts)
    assert code == 0, err
    left = _keys(bucket, "run")
    assert left == {k for k in before if k.startswith("run/20/")}, left  # 10 whole, 20 kept
    assert set(_ls(cli, bucket.url("run"), opts)) == {"20"}


def _keys(bucket, prefix: str) -> set[str]:
    if hasattr(bucket, "list"):  # fake-gcs
        return set(bucket.list(prefix))
    fs = bucket.fs()
    return {k[len(bucket.bucket) + 1:] for k in fs.find(bucket.path(prefix))}


def test_promote_a_local_step_to_s3_and_back(orbax_ckpts, cli, moto_bucket, tmp_path):
    import shutil

    src = tmp_path / "run" / "20"
    shutil.copytree(orbax_ckpts.manager / "20", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    opts = _opts(moto_bucket)
    dst = moto_bucket.url("run/20")
    code, out, err = cli("promote", str(src), dst, *[o.replace("--storage-option", "--dst-option")
                                                     for o in opts])
    assert code == 0, err
    code, out, err = cli("verify", dst, "--level", "quick", "--json", *opts)
    doc = json.loads(out)
    assert (code, doc["sealed"]) == (0, True), out + err
    assert _ls(cli, moto_bucket.url("run"), opts)["20"]["state"] == "sealed"
    back = tmp_path / "back" / "20"
    code, out, err = cli("promote", dst, str(back), *[o.replace("--storage-option",
                                                                "--src-option") for o in opts])
    assert code == 0, err
    assert _tree(back) == _tree(src)  # every file, the seal's manifest included
    code, out, err = cli("verify", str(back), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["content"] == "hashes", out + err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------ arrays on s3://


@pytest.mark.parametrize("name", ["manager-20", "zarr3", "plain"])
def test_orbax_arrays_on_s3(orbax_ckpts, cli, moto_bucket, tmp_path, name):
    """inspect and consolidate read the arrays through tensorstore's s3 driver (moto):
    what Orbax's own restore gives, bit for bit."""
    from ckptctl.model import DTYPES

    moto_bucket.upload(orbax_ckpts.step_dir(name), "run/ck")
    opts = _opts(moto_bucket)
    url = moto_bucket.url("run/ck")
    oracle = orbax_ckpts.oracle(name)
    code, out, err = cli("inspect", url, "--json", *opts)
    assert code == 0, err
    doc = json.loads(out)
    got = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in doc["tensors"]}
    assert got == {k: (a.dtype.name, a.shape) for k, a in oracle.items()}
    out_dir = tmp_path / "hf"
    code, _, err = cli("consolidate", url, str(out_dir), "--to", "safetensors", *opts)
    assert code == 0, err
    got = safetensors_entries(out_dir / "model.safetensors")
    assert sorted(got) == sorted(oracle)
    for k, a in oracle.items():
        assert got[k] == (DTYPES[a.dtype.name].safetensors, a.shape, a.tobytes()), k
    assert moto_bucket.storage_options["secret"] not in out + err


def test_seal_and_full_verify_on_s3(orbax_ckpts, cli, moto_bucket):
    """seal decodes every chunk (through tensorstore's s3 driver) before it writes the
    manifest; verify --level full then proves the hashes."""
    moto_bucket.upload(orbax_ckpts.manager, "run")
    opts = _opts(moto_bucket)
    url = moto_bucket.url("run/20")
    code, out, err = cli("verify", url, "--level", "full", "--json", *opts)
    assert code == 0 and json.loads(out)["content"] == "decoded-only", out + err
    code, out, err = cli("seal", url, *opts)
    assert code == 0, err
    code, out, err = cli("verify", url, "--level", "full", "--json", *opts)
    assert code == 0 and json.loads(out)["content"] == "hashes", out + err
    assert _ls(cli, moto_bucket.url("run"), opts)["20"]["state"] == "sealed"


def test_a_server_that_answers_ranges_with_200_is_an_io_error(orbax_ckpts, cli, s3_bucket,
                                                               tmp_path):
    """rclone serve s3 answers a ranged GET with HTTP 200 (and the right bytes):
    tensorstore's s3 driver takes them for the whole object. That is the server, not the
    checkpoint: exit 3 saying so, never a MALFORMED_CHUNK finding."""
    s3_bucket.upload(orbax_ckpts.manager, "run")
    opts, url = _opts(s3_bucket), s3_bucket.url("run/20")
    code, out, err = cli("consolidate", url, str(tmp_path / "out"), "--to", "safetensors",
                         *opts)
    assert (code, out) == (3, "") and "HTTP 200, not 206" in _one_line(err), err
    code, out, err = cli("verify", url, "--level", "full", *opts)
    assert (code, out) == (3, "") and "HTTP 200, not 206" in _one_line(err), err
    assert s3_bucket.storage_options["secret"] not in err


def test_orbax_arrays_on_s3_with_the_environments_keys(orbax_ckpts, cli, moto_bucket,
                                                       monkeypatch):
    """Keys from the AWS variables reach tensorstore as its ``environment`` credentials:
    no credentials file is written anywhere."""
    import glob
    import tempfile

    moto_bucket.upload(orbax_ckpts.step_dir("manager-20"), "run/ck")
    for k, v in moto_bucket.server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    pattern = [f"{d}/ckptctl-ts-*" for d in ("/dev/shm", tempfile.gettempdir())]
    before = {p for g in pattern for p in glob.glob(g)}
    code, out, err = cli("inspect", moto_bucket.url("run/ck"), "--json")
    assert code == 0, err
    assert len(json.loads(out)["tensors"]) == len(orbax_ckpts.oracle("manager-20"))
    assert {p for g in pattern for p in glob.glob(g)} == before


def test_watch_drains_an_orbax_run_to_a_packed_s3_tier(orbax_ckpts, tmp_path, moto_bucket):
    """A CheckpointManager root as the hot tier: its committed steps go to warm (local)
    and on to S3 as packs, each tier trimmed; Orbax's save in flight is never touched."""
    import shutil

    from ckptctl.catalog.ls import ls
    from ckptctl.service.watch import Watcher
    from ckptctl.tiering.config import load_config

    hot, warm = tmp_path / "hot", tmp_path / "warm"
    shutil.copytree(orbax_ckpts.manager, hot)
    shutil.copytree(orbax_ckpts.inflight / f"30{TMP_SUFFIX}", hot / f"30{TMP_SUFFIX}")
    for p in [hot, *hot.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    opts = {k: v for k, v in moto_bucket.storage_options.items() if not isinstance(v, dict)}
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{hot}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "warm"\nurl = "{warm}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "cold"\nurl = "{moto_bucket.url("run")}"\n'
                   f'pack = true\nstorage_options = {{ '
                   + ", ".join(f"{k} = {json.dumps(v)}" for k, v in opts.items()) + " }\n")
    p = Watcher(load_config(str(cfg)), settle=0).run_once()
    doc = p.to_dict()
    assert doc["failed"] == [], doc
    assert doc["pending"] == [{"tier": "hot", "name": f"30{TMP_SUFFIX}", "why": "incomplete"}]
    assert sorted((h.name, h.src, h.dst) for h in p.promoted) == [
        ("10", "hot", "warm"), ("10", "warm", "cold"), ("20", "hot", "warm"),
        ("20", "warm", "cold")]
    states = lambda url, o=None: {r.name: r.state for r in ls(url, o).checkpoints}  # noqa: E731
    assert states(str(hot)) == {"20": "sealed", f"30{TMP_SUFFIX}": "incomplete"}
    assert states(str(warm)) == {"20": "sealed"}
    assert states(moto_bucket.url("run"), moto_bucket.storage_options) == {
        "10": "sealed", "20": "sealed"}
