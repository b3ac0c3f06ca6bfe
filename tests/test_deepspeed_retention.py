"""Retention and tiering of DeepSpeed save folders (issue 18): gc keeps the tag ``latest``
names even when the policy would not (a rolled-back ``latest``: DeepSpeed resumes from it),
and removes the other tags with every file they hold; the save folder's own files stay;
watch drains such a folder tag by tag."""
from __future__ import annotations

import json

from fixtures_torch import copy_ckpt


def test_gc_keeps_the_tag_latest_names(deepspeed_ckpts, tmp_path, cli):
    save = copy_ckpt(deepspeed_ckpts.variant("z2-fp32").save_dir, tmp_path / "run")
    (save / "latest").write_text("global_step2")  # rolled back
    code, out, err = cli("gc", str(save), "--keep-last", "1", "--json")
    assert code == 0, err
    keep = json.loads(out)["decision"]["keep"] if "decision" in json.loads(out) else None
    assert (save / "global_step2").is_dir() and (save / "global_step3").is_dir(), keep
    (save / "latest").write_text("global_step3")
    code, out, err = cli("gc", str(save), "--keep-last", "1")
    assert code == 0, err
    assert not (save / "global_step2").exists() and (save / "global_step3").is_dir()
    assert sorted(p.name for p in save.iterdir()) == ["global_step3", "latest",
                                                        "zero_to_fp32.py", "zero_to_torch.py"]


def test_watch_drains_a_deepspeed_save_folder(deepspeed_ckpts, tmp_path, cli):
    """watch with a DeepSpeed save folder as its first tier: each tag is promoted (sealed
    in warm, its files byte for byte) and hot is trimmed to its keep, never the tag
    ``latest`` names."""
    hot = copy_ckpt(deepspeed_ckpts.variant("z2-fp32").save_dir, tmp_path / "hot")
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{hot}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n'
                   'keep = { last = 5 }\n')
    code, out, err = cli("--config", str(cfg), "watch", "--once", "--settle", "0",
                         "--no-nice", "--json")
    assert code == 0, out + err
    code, out, err = cli("ls", str(tmp_path / "warm"), "--json")
    rows = {r["name"]: r["state"] for r in json.loads(out)["checkpoints"]}
    assert rows == {"global_step2": "sealed", "global_step3": "sealed"}, rows
    for tag in ("global_step2", "global_step3"):
        src = deepspeed_ckpts.variant("z2-fp32").save_dir / tag
        for f in src.iterdir():
            assert (tmp_path / "warm" / tag / f.name).read_bytes() == f.read_bytes()
    assert not (hot / "global_step2").exists() and (hot / "global_step3").is_dir()
    code, out, err = cli("verify", str(tmp_path / "warm" / "global_step3"), "--level", "full")
    assert code == 0, out + err
