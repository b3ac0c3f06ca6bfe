"""Retention of DeepSpeed save folders (issue 18): gc keeps the tag ``latest`` names even
when the policy would not (a rolled-back ``latest``: DeepSpeed resumes from it), and removes
the other tags with every file they hold; the save folder's own files stay."""
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
