"""Exit codes and error lines an operator can rely on (issue 8, item 1): a missing place
exits 3 with one line saying so (never 0 "no checkpoints"), on disk and on both loopback
S3 servers; a URL without a bucket and a bad flag value are usage errors (exit 2) that
name what is wrong; a file that is not a checkpoint says so.

(Ctrl-C's "interrupted" is tested in test_json_schema.py and test_crash.py.)
"""
from __future__ import annotations

import json

import pytest

from fixtures_torch import copy_ckpt


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ missing places: exit 3


def test_ls_missing_local_path_exits_3(cli, tmp_path):
    code, out, err = cli("ls", str(tmp_path / "nope"))
    assert (code, out) == (3, "")
    assert _one_line(err) == f"ckptctl: error: {tmp_path / 'nope'}: no such file or directory"


def test_ls_empty_folder_is_no_checkpoints(cli, tmp_path):
    code, out, err = cli("ls", str(tmp_path))
    assert (code, err) == (0, "") and out == f"no checkpoints under {tmp_path}\n"


@pytest.fixture(params=["rclone", "moto"])
def bucket(request):
    """A fresh bucket on each loopback S3 server."""
    return request.getfixturevalue("s3_bucket" if request.param == "rclone" else "moto_bucket")


def _opts(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


def test_ls_s3_missing_bucket_and_prefix_exit_3(cli, bucket):
    missing = f"s3://{bucket.bucket}-gone/run"
    code, out, err = cli("ls", missing, *_opts(bucket))
    assert (code, out) == (3, "")
    assert _one_line(err) == f"ckptctl: error: {missing}: no such bucket"
    code, out, err = cli("ls", bucket.url("no/such/prefix"), *_opts(bucket))
    # S3 has no folders: a prefix with nothing under it is an empty place (issue 17, item 8)
    assert (code, err) == (0, "")
    assert out == f"no checkpoints under {bucket.url('no/such/prefix')}\n"
    code, out, err = cli("ls", bucket.url(), *_opts(bucket))  # there, and empty
    assert (code, err) == (0, "") and out == f"no checkpoints under {bucket.url()}\n"


def test_s3_file_that_is_not_a_checkpoint(cli, bucket, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("hello\n")
    bucket.upload(d, "run")
    url = bucket.url("run/notes.txt")
    for verb in ("ls", "inspect", "verify"):
        code, out, err = cli(verb, url, *_opts(bucket))
        assert (code, out) == (3, ""), (verb, err)
        assert _one_line(err) == f"ckptctl: error: {url}: not a checkpoint", verb


def test_s3_missing_destination_bucket_exits_3(cli, bucket, tiny_dcp):
    dst = f"s3://{bucket.bucket}-gone/out"
    for cmd in (("consolidate", str(tiny_dcp), dst, "--to", "torch"),
                ("reshard", str(tiny_dcp), dst, "--world-size", "2")):
        code, out, err = cli(*cmd, *_opts(bucket))
        assert (code, out) == (3, ""), (cmd, err)
        line = _one_line(err)
        assert line.startswith(f"ckptctl: error: {dst}") and line.endswith(": no such bucket"), \
            line


def test_unknown_storage_option_is_a_usage_error(cli):
    code, out, err = cli("ls", "s3://ckpts/run", "-o", "endpoint=http://127.0.0.1:9",
                         "--timeout", "5")
    assert (code, out) == (2, ""), err
    line = _one_line(err)
    assert line.startswith("ckptctl: error: s3://ckpts/run: unknown storage option 'endpoint'"), \
        line
    assert "TypeError" not in line


@pytest.mark.parametrize("url", ["s3://", "s3:///run", "S3://"])
def test_url_without_bucket_is_a_usage_error(cli, url):
    for verb in ("ls", "inspect"):
        code, out, err = cli(verb, url)
        assert (code, out) == (2, "")
        line = _one_line(err)
        assert line.startswith(f"ckptctl: error: {url}: no bucket in the URL"), line


# ------------------------------------------------------------ bad flag values: exit 2


@pytest.mark.parametrize("args,flag", [
    (("verify", "X", "--workers", "0"), "--workers"),
    (("seal", "X", "--workers", "-1"), "--workers"),
    (("reshard", "X", "Y", "--world-size", "2", "--workers", "0"), "--workers"),
    (("consolidate", "X", "Y", "--workers", "0"), "--workers"),
    (("reshard", "X", "Y", "--world-size", "2", "--max-memory", "-1GiB"), "--max-memory"),
    (("consolidate", "X", "Y", "--max-memory=0"), "--max-memory"),
    (("consolidate", "X", "Y", "--max-memory", "lots"), "--max-memory"),
    (("consolidate", "X", "Y", "--max-shard-size", "-5GB"), "--max-shard-size"),
    (("reshard", "X", "Y", "--world-size", "0"), "--world-size"),
    (("--timeout", "0", "ls", "X"), "--timeout"),
])
def test_bad_flag_value_exits_2_naming_the_flag(cli, tmp_path, args, flag):
    args = [str(tmp_path / a) if a in ("X", "Y") else a for a in args]
    code, out, err = cli(*args)
    assert (code, out) == (2, ""), (code, out, err)
    assert flag in err and "Traceback" not in err, err
    assert not (tmp_path / "Y").exists()


# ------------------------------------------------------ a file that is not a checkpoint


def test_file_that_is_not_a_checkpoint(cli, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    for verb in ("inspect", "verify", "seal", "ls"):
        code, out, err = cli(verb, str(notes))
        assert (code, out) == (3, ""), (verb, code, out, err)
        line = _one_line(err)
        assert line == f"ckptctl: error: {notes}: not a checkpoint", (verb, line)
        assert "empty" not in line


def test_empty_folder_is_empty(cli, tmp_path):
    code, _, err = cli("inspect", str(tmp_path))
    assert code == 3 and _one_line(err).endswith("empty: no checkpoint files here")


def test_ls_of_one_checkpoint_file_lists_it(cli, tmp_path, torch_ckpts):
    f = copy_ckpt(torch_ckpts.nested_pt, tmp_path / "step-7.pt")
    code, out, err = cli("ls", str(f))
    assert code == 0, err
    rows = out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[:4] == ["step-7.pt", "7", "torch", "complete"]
    st = copy_ckpt(torch_ckpts.hf_single / "model.safetensors", tmp_path / "model.safetensors")
    code, out, err = cli("ls", str(st), "--json")
    assert code == 0, err
    (row,) = json.loads(out)["checkpoints"]
    assert (row["name"], row["url"], row["format"], row["state"], row["num_files"]) == \
        ("model.safetensors", str(st), "safetensors", "complete", 1)


def test_nested_storage_option_given_flat_is_a_usage_error(cli):
    code, out, err = cli("ls", "s3://bucket/x", "-o", "config_kwargs=read_timeout")
    assert code == 2 and err.count("\n") == 1, err
    assert "config_kwargs.read_timeout" in err and "internal error" not in err
