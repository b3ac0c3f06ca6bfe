"""Tiers on Google Cloud Storage and Azure Blob: a ``ckptctl.toml`` of a local hot tier,
a warm tier on Azurite and a packed cold tier on fake-gcs-server; ``tiers`` checks them,
``watch --once`` drains hot -> warm -> cold and trims the hot tier, and what lands in each
cloud restores to the training job's bytes."""
from __future__ import annotations

import filecmp
import json
import shutil


def _same_tree(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_watch_drains_to_azure_then_packs_into_gcs(tiny_dcp, tmp_path, az_container, gcs_bucket,
                                                   cli):
    from ckptctl.ops import seal
    from conftest import write_tiny_dcp

    hot = tmp_path / "hot"
    hot.mkdir()
    seal(str(tiny_dcp))  # the training job's bytes, manifest included
    shutil.copytree(tiny_dcp, hot / "step-42")
    write_tiny_dcp(hot / "step-50")
    seal(str(hot / "step-50"))
    kept = tmp_path / "kept-50"
    shutil.copytree(hot / "step-50", kept)
    config = tmp_path / "ckptctl.toml"
    config.write_text(f'''
[[tier]]
name = "hot"
url = "{hot}"
keep = {{ last = 1 }}

[[tier]]
name = "warm"
url = "{az_container.url('run')}"
keep = {{ last = 2 }}

[[tier]]
name = "cold"
url = "{gcs_bucket.url('run')}"
pack = true
''')
    code, out, err = cli("tiers", "--config", str(config))
    assert code == 0, err
    assert "every one reachable and writable" in out
    code, out, err = cli("watch", "--config", str(config), "--once", "--json")
    assert code == 0, err
    warm = json.loads(cli("ls", az_container.url("run"), "--json")[1])["checkpoints"]
    cold = json.loads(cli("ls", gcs_bucket.url("run"), "--json")[1])["checkpoints"]
    assert [(c["name"], c["state"]) for c in warm] == [("step-42", "sealed"), ("step-50", "sealed")]
    assert [(c["name"], c["state"]) for c in cold] == [("step-42", "sealed"), ("step-50", "sealed")]
    assert sorted(p.name for p in hot.iterdir()) == ["step-50"]  # trimmed to its last 1
    for name in ("step-42", "step-50"):
        assert cli("verify", gcs_bucket.url(f"run/{name}"), "--level", "full")[0] == 0
        back = tmp_path / "back" / name
        code, _, err = cli("unpack", gcs_bucket.url(f"run/{name}"), str(back))
        assert code == 0, err
        want = tiny_dcp if name == "step-42" else kept
        assert _same_tree(want, back), name
