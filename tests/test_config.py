"""The tier config ``ckptctl.toml`` and storage options per URL (issue 9: "Storage options
per URL" and item 1, "Tier configuration").

- parsing: a good config read back whole; every bad key is exit 2 with one line naming
  the file, the tier and the key;
- discovery: --config, then $CKPTCTL_CONFIG, then ./ckptctl.toml;
- ``TIER:`` and ``TIER:NAME`` anywhere a URL is taken (ls, inspect, verify, seal, reshard,
  consolidate), URLs and paths never taken for a tier;
- which storage option wins, key by key (--src-option/--dst-option > -o > tier > AWS_*),
  shown on two real, different S3 servers (rclone and moto): a copy from one to the other
  only works when each end gets its own endpoint;
- ``ckptctl tiers``: resolved config with secrets masked (the secret never appears in any
  output), every tier probed, an unreachable one reported in one line and exit 3.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from ckptctl.tiering.config import (Config, Tier, find_config, load_config, loads, mask_secrets,
                            merge_options, resolve)
from ckptctl.errors import UsageError

SECRET = "s3cr3t-VALUE-never-shown-1f2e"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string of ASCII text is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_config(path: Path, *tiers: dict) -> Path:
    """``ckptctl.toml`` with one ``[[tier]]`` table per dict."""
    lines = []
    for t in tiers:
        lines.append("[[tier]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in t.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def dead_endpoint() -> str:
    """An http endpoint on a loopback port nobody listens on (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch, tmp_path):
    """No config or AWS setting from the machine running the tests leaks in."""
    for var in ("CKPTCTL_CONFIG", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


# ------------------------------------------------------------------------------ parsing


def test_good_config_is_read_whole(tmp_path):
    (tmp_path / "etc").mkdir()
    f = write_config(
        tmp_path / "etc" / "ckptctl.toml",
        {"name": "hot", "url": "nvme/run1", "keep": {"last": 2}},
        {"name": "warm", "url": "/lustre/proj/run1/", "bwlimit": "2GiB/s",
         "keep": {"last": 10, "every": 5000}},
        {"name": "cold_1", "url": "s3://bucket/run1/", "pack": True,
         "storage_options": {"endpoint_url": "http://127.0.0.1:9000",
                             "config_kwargs": {"read_timeout": 300}},
         "keep": {"every": 10000, "within": "30d", "tags": ["release"]}})
    cfg = load_config(str(f))
    assert cfg.path == str(f)
    assert cfg.tiers == (
        Tier("hot", str(tmp_path / "etc" / "nvme" / "run1"), {}, {"last": 2}, None, False),
        Tier("warm", "/lustre/proj/run1", {}, {"last": 10, "every": 5000}, float(2 << 30),
             False),
        Tier("cold_1", "s3://bucket/run1",
             {"endpoint_url": "http://127.0.0.1:9000", "config_kwargs": {"read_timeout": 300}},
             {"every": 10000, "within": "30d", "tags": ["release"]}, None, True))
    assert cfg.next_tier("hot").name == "warm" and cfg.next_tier("cold_1") is None


def test_design_md_example_parses(tmp_path):
    """The example config of DESIGN.md, "Storage and tiers", as written there."""
    design = Path(__file__).resolve().parents[2] / "shared" / "DESIGN.md"
    if not design.exists():
        pytest.skip("DESIGN.md is outside this checkout")
    text = design.read_text()
    start = text.index("```toml\n", text.index("## Storage and tiers")) + len("```toml\n")
    example = text[start:text.index("```", start)]
    cfg = loads(example, "DESIGN.md")
    assert [t.name for t in cfg.tiers] == ["hot", "warm", "cold"]
    assert cfg.tier("cold").pack and cfg.tier("warm").bwlimit == 2 << 30


BAD = [  # (config text, what the one line must say besides the file name)
    ('[[tier]]\nname = "hot"\nurl = "/x"\nurll = "/y"\n', "tier 'hot': unknown key 'urll'"),
    ('[tiers]\nname = "hot"\n', "unknown key 'tiers'"),
    ('title = "x"\n[[tier]]\nname = "hot"\nurl = "/x"\n', "unknown key 'title'"),
    ('[[tier]]\nurl = "/x"\n', "tier 1: name is required"),
    ('[[tier]]\nname = "Hot"\nurl = "/x"\n', "tier 1: name 'Hot' must be"),
    ('[[tier]]\nname = "a:b"\nurl = "/x"\n', "tier 1: name 'a:b' must be"),
    ('[[tier]]\nname = 3\nurl = "/x"\n', "tier 1: name of type int must be"),
    ('[[tier]]\nname = "hot"\n', "tier 'hot': url is required"),
    ('[[tier]]\nname = "hot"\nurl = 5\n', "tier 'hot': url must be a non-empty string"),
    ('[[tier]]\nname = "hot"\nurl = "s3://"\n', "tier 'hot': url: no bucket"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nstorage_options = "endpoint_url=x"\n',
     "tier 'hot': storage_options must be a table"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nbwlimit = "fast"\n', "tier 'hot': bwlimit: bad rate"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nbwlimit = true\n', "tier 'hot': bwlimit must be a rate"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nkeep = { lats = 2 }\n', "tier 'hot': keep: unknown key 'lats'"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nkeep = 2\n', "tier 'hot': keep must be a table"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nkeep = {}\n', "tier 'hot': keep is empty"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\npack = "yes"\n', "tier 'hot': pack must be true or false"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\n[[tier]]\nname = "hot"\nurl = "/y"\n',
     "tier 'hot' is defined twice"),
    ('[[tier]]\nname = "hot"\nurl = "/x"\nkeep = { last = 2\n', "not valid TOML"),
    ('', "no tiers"),
    ('tier = ["a"]\n', "tier must be an array of tables"),
]


@pytest.mark.parametrize("text,says", BAD, ids=[b[1] for b in BAD])
def test_bad_config_is_one_line_exit_2_naming_file_and_key(cli, tmp_path, text, says):
    f = tmp_path / "tiers.toml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        load_config(str(f))
    assert str(e.value) == f"{f}: {e.value.message}" and says in e.value.message
    for args in (("tiers", "--config", str(f), "--no-check"), ("--config", str(f), "ls", "hot:")):
        code, out, err = cli(*args)
        assert (code, out) == (2, ""), args
        line = _one_line(err)
        assert line.startswith(f"ckptctl: error: {f}: ") and says in line, line


def test_bad_keep_values_are_refused_by_the_policy_words(tmp_path):
    pytest.importorskip("ckptctl.tiering.policy", reason="helper G's policy module not there yet")
    f = tmp_path / "t.toml"
    for keep, says in (('{ within = "soon" }', "keep: not a duration: 'soon'"),
                       ("{ last = -1 }", "keep last must be a positive whole number")):
        f.write_text(f'[[tier]]\nname = "hot"\nurl = "/x"\nkeep = {keep}\n')
        with pytest.raises(UsageError) as e:
            load_config(str(f))
        assert str(e.value).startswith(f"{f}: tier 'hot': {says}"), str(e.value)


def test_secret_values_never_in_config_errors(cli, tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(f'[[tier]]\nname = "cold"\nurl = "s3://b/x"\n'
                 f'storage_options = {{ secret = "{SECRET}" }}\npack = 1\n')
    code, out, err = cli("tiers", "--config", str(f), "--json")
    assert code == 2 and SECRET not in out + err and "pack must be" in err


# ---------------------------------------------------------------------------- discovery


def test_discovery_order(tmp_path, monkeypatch):
    a = write_config(tmp_path / "a.toml", {"name": "a", "url": "/a"})
    b = write_config(tmp_path / "b.toml", {"name": "b", "url": "/b"})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert find_config() is None and load_config(find_config()) == Config(None)
    write_config(work / "ckptctl.toml", {"name": "here", "url": "/here"})
    assert find_config() == "ckptctl.toml"
    monkeypatch.setenv("CKPTCTL_CONFIG", str(b))
    assert find_config() == str(b)
    assert find_config(str(a)) == str(a)  # --config wins over both
    with pytest.raises(UsageError, match="config file not found \\(--config\\)"):
        find_config(str(tmp_path / "missing.toml"))
    monkeypatch.setenv("CKPTCTL_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(UsageError, match=r"gone.toml: config file not found \(\$CKPTCTL_CONFIG\)"):
        find_config()


def test_discovery_through_the_cli(cli, tmp_path, monkeypatch):
    for name in ("a", "b", "here"):
        (tmp_path / name).mkdir()
    a = write_config(tmp_path / "a.toml", {"name": "t", "url": str(tmp_path / "a")})
    b = write_config(tmp_path / "b.toml", {"name": "t", "url": str(tmp_path / "b")})
    work = tmp_path / "work"
    work.mkdir()
    write_config(work / "ckptctl.toml", {"name": "t", "url": str(tmp_path / "here")})
    monkeypatch.chdir(work)
    assert cli("ls", "t:")[1] == f"no checkpoints under {tmp_path / 'here'}\n"
    monkeypatch.setenv("CKPTCTL_CONFIG", str(b))
    assert cli("ls", "t:")[1] == f"no checkpoints under {tmp_path / 'b'}\n"
    # --config before or after the verb, and `--config=FILE`
    for args in (("--config", str(a), "ls", "t:"), ("ls", "t:", "--config", str(a)),
                 ("ls", f"--config={a}", "t:")):
        assert cli(*args) == (0, f"no checkpoints under {tmp_path / 'a'}\n", ""), args
    code, out, err = cli("ls", str(tmp_path), "--config", str(tmp_path / "nope.toml"))
    assert (code, out) == (2, "")
    assert _one_line(err) == f"ckptctl: error: {tmp_path / 'nope.toml'}: config file not " \
                             "found (--config)"


def test_no_config_means_no_tiers(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("tiers")
    assert (code, out) == (2, "")
    assert _one_line(err) == ("ckptctl: error: no tier config: pass --config FILE, set "
                              "CKPTCTL_CONFIG or create ./ckptctl.toml")
    code, out, err = cli("ls", "hot:")
    assert (code, out) == (2, "") and "unknown tier 'hot': no tier config" in _one_line(err)


# ------------------------------------------------------------------------------ resolve

CFG = Config("c.toml", (Tier("hot", "/nvme/run1", {}), Tier("cold", "s3://b/run1/x",
                                                            {"endpoint_url": "http://e:1"})))


@pytest.mark.parametrize("text,url,tier", [
    ("hot:", "/nvme/run1", "hot"),
    ("hot:step-100", "/nvme/run1/step-100", "hot"),
    ("hot:step-100/", "/nvme/run1/step-100", "hot"),
    ("hot:./a//b", "/nvme/run1/a/b", "hot"),
    ("cold:", "s3://b/run1/x", "cold"),
    ("cold:step-100", "s3://b/run1/x/step-100", "cold"),
    ("s3://hot/step-1", "s3://hot/step-1", None),
    ("/hot:step-1", "/hot:step-1", None),
    ("./hot:x", "./hot:x", None),
    ("C:\\ckpt\\step-1", "C:\\ckpt\\step-1", None),
    ("c:/ckpt", "c:/ckpt", None),
    ("Hot:x", "Hot:x", None),
    ("file:///nvme/x", "file:///nvme/x", None),
])
def test_resolve(text, url, tier):
    p = resolve(text, config=CFG)
    assert (p.url, p.tier and p.tier.name) == (url, tier)


def test_resolve_refuses_unknown_tiers_and_escapes(tmp_path, monkeypatch):
    with pytest.raises(UsageError) as e:
        resolve("warm:step-1", config=CFG)
    assert str(e.value) == "unknown tier 'warm' (c.toml defines: hot, cold)"
    for bad in ("hot:../x", "hot:a/../../x", "hot:/etc"):
        with pytest.raises(UsageError, match="must stay under the tier's root"):
            resolve(bad, config=CFG)
    monkeypatch.chdir(tmp_path)  # a local file that holds a colon is no tier
    (tmp_path / "run:7").mkdir()
    assert resolve("run:7", config=CFG) == resolve("run:7", config=None)
    assert resolve("run:7", config=None).url == "run:7"


def test_options_precedence_key_by_key():
    tier = Tier("cold", "s3://b/r", {"endpoint_url": "tier", "key": "tier-key",
                                     "config_kwargs": {"read_timeout": 5, "connect_timeout": 2}})
    cfg = Config("c.toml", (tier,))
    from ckptctl.cli.common import resolve_place

    common = ["endpoint_url=dash-o", "config_kwargs.read_timeout=300", "use_ssl=false"]
    own = ["endpoint_url=own"]
    p = resolve("cold:s", config=cfg, options=merge_options(
        {"endpoint_url": "dash-o", "config_kwargs": {"read_timeout": 300}, "use_ssl": False},
        {"endpoint_url": "own"}))
    assert p.storage_options == {"endpoint_url": "own", "key": "tier-key", "use_ssl": False,
                                 "config_kwargs": {"read_timeout": 300, "connect_timeout": 2}}
    # the CLI helper does the same for plain URLs (no tier): own > -o
    q = resolve_place(None, "s3://b/r", common, own, own_flag="--dst-option")
    assert q.storage_options == {"endpoint_url": "own", "use_ssl": False,
                                 "config_kwargs": {"read_timeout": 300}}
    with pytest.raises(UsageError, match="--dst-option expects key=value"):
        resolve_place(None, "s3://b/r", [], ["endpoint_url"], own_flag="--dst-option")


def test_mask_secrets():
    opts = {"key": "AK", "secret": SECRET, "token": "t", "password": "p", "endpoint_url":
            "http://user:pw@h:9", "client_kwargs": {"aws_secret_access_key": SECRET,
                                                    "region_name": "us"},
            "my_api_token": "x", "sse_customer_key": "k", "anon": False, "max_concurrency": 4}
    masked = mask_secrets(opts)
    assert masked == {"key": "***", "secret": "***", "token": "***", "password": "***",
                      "endpoint_url": "http://user:***@h:9",
                      "client_kwargs": {"aws_secret_access_key": "***", "region_name": "us"},
                      "my_api_token": "***", "sse_customer_key": "***", "anon": False,
                      "max_concurrency": 4}
    assert opts["secret"] == SECRET  # a copy: the original is untouched


# --------------------------------------------------------- every verb takes TIER:NAME


def test_every_verb_takes_tier_names(cli, tmp_path, tiny_dcp):
    import shutil

    hot = tmp_path / "nvme"
    hot.mkdir()
    shutil.copytree(tiny_dcp, hot / "step-42")
    f = write_config(tmp_path / "t.toml", {"name": "hot", "url": str(hot)},
                     {"name": "warm", "url": str(tmp_path / "lustre")})
    c = ("--config", str(f))
    code, out, err = cli(*c, "ls", "hot:", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [x["name"] for x in doc["checkpoints"]] == ["step-42"]
    code, out, err = cli(*c, "inspect", "hot:step-42", "--json")
    assert code == 0 and json.loads(out)["url"] == str(hot / "step-42"), err
    code, out, err = cli(*c, "seal", "hot:step-42", "--json")
    assert code == 0 and json.loads(out)["url"] == str(hot / "step-42"), err
    code, out, err = cli(*c, "verify", "hot:step-42", "--level", "full", "--json")
    assert code == 0 and json.loads(out)["ok"], err
    code, out, err = cli(*c, "reshard", "hot:step-42", "warm:step-42-ws2", "--world-size", "2",
                         "--json")
    assert code == 0 and json.loads(out)["dst"] == str(tmp_path / "lustre" / "step-42-ws2"), err
    code, out, err = cli(*c, "consolidate", "warm:step-42-ws2", "warm:hf-42", "--only", "model",
                         "--json")
    assert code == 0, err
    assert (tmp_path / "lustre" / "hf-42" / "model.safetensors").is_file()
    code, out, err = cli(*c, "verify", "cold:step-42")
    assert (code, out) == (2, "")
    assert _one_line(err) == f"ckptctl: error: unknown tier 'cold' ({f} defines: hot, warm)"


# ------------------------------------------------- per-URL options on two real S3 servers


def _tier_s3(name: str, bucket, prefix: str, endpoint: str | None = None, **extra) -> dict:
    o = bucket.storage_options
    return {"name": name, "url": bucket.url(prefix),
            "storage_options": {"endpoint_url": endpoint or o["endpoint_url"], "key": o["key"],
                                "secret": o["secret"], **extra}}


def test_ls_uses_the_tiers_endpoint_and_dash_o_overrides_it(cli, tmp_path, s3_bucket,
                                                              tiny_dcp, monkeypatch):
    s3_bucket.upload(tiny_dcp, "run/step-42")
    o = s3_bucket.storage_options
    # the environment names a dead endpoint: the tier's own wins over it ...
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead_endpoint())
    good = write_config(tmp_path / "good.toml", _tier_s3("warm", s3_bucket, "run"))
    code, out, err = cli("--config", str(good), "ls", "warm:", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["root"] == s3_bucket.url("run")
    assert [(x["name"], x["step"]) for x in doc["checkpoints"]] == [("step-42", 42)]
    assert any(r.op == "LIST" for r in s3_bucket.server.request_log())
    # ... and the environment still gives what neither the tier nor -o sets (the keys)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", o["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", o["secret"])
    keyless = write_config(tmp_path / "keyless.toml",
                           {"name": "warm", "url": s3_bucket.url("run"),
                            "storage_options": {"endpoint_url": o["endpoint_url"]}})
    code, out, err = cli("--config", str(keyless), "ls", "warm:", "--json")
    assert code == 0 and [x["name"] for x in json.loads(out)["checkpoints"]] == ["step-42"], err
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # the tier names a dead endpoint: -o endpoint_url wins over it, key by key (the
    # tier's key and secret still apply)
    dead = dead_endpoint()
    bad = write_config(tmp_path / "bad.toml", _tier_s3("warm", s3_bucket, "run", dead))
    code, out, err = cli("--config", str(bad), "--timeout", "5", "ls", "warm:")
    assert (code, out) == (3, "")
    assert _one_line(err).endswith("remote unreachable (connection refused)")
    code, out, err = cli("--config", str(bad), "ls", "warm:", "-o",
                         f"endpoint_url={s3_bucket.storage_options['endpoint_url']}", "--json")
    assert code == 0, err
    assert [x["name"] for x in json.loads(out)["checkpoints"]] == ["step-42"]


def test_consolidate_between_two_s3_servers_with_per_url_options(cli, tmp_path, s3_bucket,
                                                                 moto_bucket):
    """rclone (tier "warm", whose own endpoint is dead) -> moto: -o names a third, dead
    endpoint for both ends; only --src-option / --dst-option make it work."""
    import s3fs
    import torch
    from safetensors.torch import load as st_load

    from conftest import write_tiny_dcp

    sd = write_tiny_dcp(tmp_path / "src")
    s3_bucket.upload(tmp_path / "src", "run/step-42")
    rclone_ep = s3_bucket.storage_options["endpoint_url"]
    moto_ep = moto_bucket.storage_options["endpoint_url"]
    assert rclone_ep != moto_ep
    f = write_config(tmp_path / "t.toml", _tier_s3("warm", s3_bucket, "run", dead_endpoint()))
    dst = moto_bucket.url("hf/step-42")
    moto_bucket.server.reset_log()
    s3_bucket.server.reset_log()
    o = moto_bucket.storage_options  # the same test credentials on both servers
    args = ("--config", str(f), "consolidate", "warm:step-42", dst, "--only", "model",
            "-o", f"endpoint_url={dead_endpoint()}", "-o", f"key={o['key']}",
            "-o", f"secret={o['secret']}")
    code, out, err = cli(*args, "--timeout", "5", "--dst-option", f"endpoint_url={moto_ep}")
    assert (code, out) == (3, ""), err  # the source still points at a dead endpoint
    assert _one_line(err).endswith("remote unreachable (connection refused)")
    code, out, err = cli(*args, "--src-option", f"endpoint_url={rclone_ep}", "--dst-option",
                         f"endpoint_url={moto_ep}", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["src"], doc["dst"]) == (s3_bucket.url("run/step-42"), dst)
    # reads went to rclone only, writes to moto only
    assert not [r for r in s3_bucket.server.request_log() if r.op in ("PUT", "POST", "DELETE")]
    assert any(r.op == "GET" for r in s3_bucket.server.request_log())
    assert any(r.op in ("PUT", "POST") for r in moto_bucket.server.request_log())
    fs = s3fs.S3FileSystem(**moto_bucket.storage_options, skip_instance_cache=True,
                           use_listings_cache=False)
    got = st_load(fs.cat_file(moto_bucket.path("hf/step-42/model.safetensors")))
    assert sorted(got) == sorted(f"model.{k}" for k in sd["model"])
    for k, v in sd["model"].items():  # bit for bit
        t = got[f"model.{k}"]
        assert t.dtype == v.dtype and torch.equal(t.view(torch.uint8), v.view(torch.uint8)), k
    code, out, err = cli("verify", "--level", "full", dst, "-o", f"endpoint_url={moto_ep}",
                         "-o", f"key={moto_bucket.storage_options['key']}",
                         "-o", f"secret={moto_bucket.storage_options['secret']}")
    assert code == 0, err


def test_reshard_from_tier_to_tier_on_two_s3_servers(cli, tmp_path, s3_bucket, moto_bucket,
                                                    tiny_dcp):
    """Each tier's own storage options, no flags: rclone tier -> moto tier."""
    s3_bucket.upload(tiny_dcp, "run/step-42")
    f = write_config(tmp_path / "t.toml", _tier_s3("warm", s3_bucket, "run"),
                     _tier_s3("cold", moto_bucket, "run1"))
    code, out, err = cli("--config", str(f), "reshard", "warm:step-42", "cold:step-42",
                         "--world-size", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["dst"] == moto_bucket.url("run1/step-42")
    code, out, err = cli("--config", str(f), "verify", "--level", "full", "cold:step-42",
                         "--json")
    assert code == 0 and json.loads(out)["ok"], err
    code, out, err = cli("--config", str(f), "ls", "cold:", "--json")
    assert [x["name"] for x in json.loads(out)["checkpoints"]] == ["step-42"], err


# ------------------------------------------------------------------------- ckptctl tiers


def test_tiers_prints_resolved_config_masks_secrets_and_probes(cli, tmp_path, s3_bucket):
    o = s3_bucket.storage_options
    f = write_config(
        tmp_path / "t.toml",
        {"name": "hot", "url": str(tmp_path / "nvme" / "run1"), "keep": {"last": 2}},
        {"name": "cold", "url": s3_bucket.url("run1"), "bwlimit": "200MiB/s", "pack": True,
         "keep": {"every": 10000, "within": "30d"},
         "storage_options": {"endpoint_url": o["endpoint_url"], "key": o["key"],
                             "secret": o["secret"],
                             "client_kwargs": {"aws_secret_access_key": o["secret"]}}})
    outputs = []
    for extra in ((), ("--json",), ("--no-check",), ("--no-check", "--json")):
        code, out, err = cli("tiers", "--config", str(f), *extra)
        assert code == 0, err
        outputs.append(out + err)
        if "--json" not in extra:
            assert "secret=***" in out and "client_kwargs.aws_secret_access_key=***" in out
            assert "200.0 MiB/s" in out and "every=10000, within=30d" in out
    assert all(o["secret"] not in x and o["key"] not in x for x in outputs)
    doc = json.loads(cli("tiers", "--config", str(f), "--json")[1])
    assert doc["ok"] is True and doc["config"] == str(f)
    cold = doc["tiers"][1]
    assert (cold["order"], cold["name"], cold["url"], cold["bwlimit_bytes_per_second"],
            cold["pack"],
            cold["keep"], cold["ok"]) == (2, "cold", s3_bucket.url("run1"), 200 * 2**20, True,
                                          {"every": 10000, "within": "30d"}, True)
    assert cold["storage_options"] == {"endpoint_url": o["endpoint_url"], "key": "***",
                                       "secret": "***",
                                       "client_kwargs": {"aws_secret_access_key": "***"}}
    # the probe wrote, read back and deleted: nothing is left behind anywhere
    log = s3_bucket.server.request_log()
    probes = [r for r in log if ".ckptctl-probe-" in r.key]
    assert {r.op for r in probes} >= {"PUT", "GET"}, probes  # deleted by DeleteObjects:
    assert any(r.method == "POST" and r.path.endswith("?delete") for r in log)  # no key shown
    assert s3_bucket.fs().find(s3_bucket.path()) == []
    assert not (tmp_path / "nvme").exists()  # the local root it made for the probe is gone


def test_tiers_exit_3_with_an_unreachable_tier_after_checking_all(cli, tmp_path, s3_bucket):
    o = s3_bucket.storage_options
    (tmp_path / "a-file").write_text("x")
    f = write_config(
        tmp_path / "t.toml",
        {"name": "hot", "url": str(tmp_path / "nvme")},
        {"name": "nowhere", "url": "s3://bucket/run1",
         "storage_options": {"endpoint_url": dead_endpoint(), "key": "k",
                             "secret": SECRET}},
        {"name": "blocked", "url": str(tmp_path / "a-file" / "run1")},
        {"name": "wrongkey", "url": s3_bucket.url("run1"),
         "storage_options": {"endpoint_url": o["endpoint_url"], "key": o["key"],
                             "secret": SECRET}},
        {"name": "cold", "url": s3_bucket.url("run1"),
         "storage_options": {"endpoint_url": o["endpoint_url"], "key": o["key"],
                             "secret": o["secret"]}})
    code, out, err = cli("tiers", "--config", str(f), "--timeout", "2")
    assert code == 3
    assert _one_line(err) == ("ckptctl: error: 3 tiers of 5 not reachable or not writable: "
                              "nowhere, blocked, wrongkey")
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert rows["hot"].endswith("ok (writable)") and rows["cold"].endswith("ok (writable)")
    assert rows["nowhere"].endswith("FAILED: remote unreachable (connection refused)")
    assert rows["blocked"].endswith("FAILED: a parent is not a directory")
    assert "FAILED: access denied (wrong secret key" in rows["wrongkey"]
    assert SECRET not in out + err
    code, out, err = cli("tiers", "--config", str(f), "--timeout", "2", "--json")
    assert code == 3 and SECRET not in out + err
    doc = json.loads(out)
    assert doc["ok"] is False
    assert [(t["name"], t["ok"], t["code"]) for t in doc["tiers"]] == [
        ("hot", True, None), ("nowhere", False, "REMOTE_UNREACHABLE"),
        ("blocked", False, "IO_ERROR"), ("wrongkey", False, "IO_ERROR"), ("cold", True, None)]


def test_tiers_check_of_a_silent_server_is_bounded(cli, tmp_path):
    from s3server import SilentServer

    with SilentServer() as silent:
        f = write_config(tmp_path / "t.toml",
                         {"name": "hot", "url": str(tmp_path / "nvme")},
                         {"name": "silent", "url": "s3://b/run",
                          "storage_options": {"endpoint_url": silent.endpoint_url,
                                              "key": "k", "secret": SECRET}})
        t0 = time.monotonic()
        code, out, err = cli("tiers", "--config", str(f), "--timeout", "1", "--json")
        wall = time.monotonic() - t0
    assert code == 3 and SECRET not in out + err
    doc = json.loads(out)
    assert [t["ok"] for t in doc["tiers"]] == [True, False]
    assert doc["tiers"][1]["code"] in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE")
    assert wall < 30, wall  # generous: one request's budget is about 1 s here


def test_tiers_config_env_and_relative_urls(cli, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    write_config(conf / "run.toml", {"name": "hot", "url": "data/hot"})
    monkeypatch.setenv("CKPTCTL_CONFIG", str(conf / "run.toml"))
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("tiers", "--json")
    assert code == 0, err
    assert json.loads(out)["tiers"][0]["url"] == str(conf / "data" / "hot")
    assert os.listdir(conf) == ["run.toml"]


def test_resolve_place_without_ctx_finds_the_running_command(tmp_path):
    """``resolve_place(text, ...)`` (no context passed) still sees the global --config."""
    import typer
    from typer.testing import CliRunner

    from ckptctl.cli.common import resolve_place

    f = write_config(tmp_path / "t.toml", {"name": "t", "url": str(tmp_path / "t")})
    app = typer.Typer()

    @app.callback()
    def _root(config: str = typer.Option(None, "--config")):
        pass

    @app.command()
    def show(text: str):
        print(resolve_place(text, ["anon=true"]).url)

    r = CliRunner().invoke(app, ["--config", str(f), "show", "t:step-1"])
    assert (r.exit_code, r.output) == (0, f"{tmp_path / 't' / 'step-1'}\n"), r.output
