"""Large files to Google Cloud Storage and Azure Blob, whose stores have no multipart
uploads of their own: ``promote`` streams a file larger than ``--part-size`` through one
write (bounded memory), hashed on the way, and publishes it only if it hashes to the
manifest's digest."""
from __future__ import annotations

import pytest


def _big_dcp(path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(3_000_000, generator=torch.Generator().manual_seed(5))},
                 checkpoint_id=str(path))


@pytest.mark.parametrize("cloud", ["gs", "az"])
def test_a_file_larger_than_a_part_is_streamed_and_proven(cloud, tmp_path, cli, request):
    box = request.getfixturevalue("gcs_bucket" if cloud == "gs" else "az_container")
    src = tmp_path / "step-1"
    _big_dcp(src)
    assert cli("seal", str(src))[0] == 0
    big = src / "__0_0.distcp"
    assert big.stat().st_size > 6 << 20
    code, out, err = cli("promote", str(src), box.url("run/step-1"), "--part-size", "5MiB")
    assert code == 0, err
    assert box.get("run/step-1/__0_0.distcp") == big.read_bytes()
    assert cli("verify", box.url("run/step-1"), "--level", "full")[0] == 0
    back = tmp_path / "back" / "step-1"
    code, _, err = cli("promote", box.url("run/step-1"), str(back), "--part-size", "5MiB")
    assert code == 0, err
    assert (back / "__0_0.distcp").read_bytes() == big.read_bytes()


@pytest.mark.parametrize("cloud", ["gs", "az"])
def test_a_large_file_that_differs_from_its_manifest_is_never_published(cloud, tmp_path, cli,
                                                                         request):
    box = request.getfixturevalue("gcs_bucket" if cloud == "gs" else "az_container")
    src = tmp_path / "step-1"
    _big_dcp(src)
    assert cli("seal", str(src))[0] == 0
    big = src / "__0_0.distcp"
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0xFF  # after the seal: the manifest holds the true digest
    big.write_bytes(bytes(data))
    code, out, err = cli("promote", str(src), box.url("run/step-1"), "--part-size", "5MiB")
    assert code == 1, err
    assert "HASH_MISMATCH" in err or "differs" in err or "hash" in err.lower(), err
    assert "run/step-1/__0_0.distcp" not in box.list("run/")
    assert "run/step-1/ckptctl.manifest.json" not in box.list("run/")
