"""Write a real FSDP2-sharded DCP checkpoint of about ``--size-gb`` (benchmark input).

    .venv/bin/python bench/make_dcp.py OUT [--size-gb 2] [--ranks 4] [--no-adam]

Runs itself under ``torchrun --standalone --nproc_per_node=RANKS`` (gloo, CPU). The model
is a stack of big ``nn.Linear`` layers (fp32, uneven dims: 4099 inputs, an odd number of
outputs, so dim 0 does not split evenly over the ranks), built on the meta device and
``fully_shard``-ed over a 1-D ``dp`` mesh before any memory is allocated: each rank only
ever holds its own shards. Weights are random; with Adam (the default) one optimizer step
on random gradients fills ``exp_avg`` and ``exp_avg_sq``, so the checkpoint holds three
fp32 tensors per parameter (``model.*``, ``optim.state.*.exp_avg``,
``optim.state.*.exp_avg_sq``) plus the small ``step`` tensors and param groups. Each rank
writes ``__<rank>_0.distcp`` with ``dcp.save``; rank 0 writes ``.metadata``.

Tensor sizes: a weight is about ``--tensor-mb`` (default 300 MB), so a 1 GB checkpoint
has a handful of tensors and a 3 GB one a dozen or so.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

IN_FEATURES = 4099  # odd: rows are not a power-of-two number of bytes


def layer_dims(size_bytes: int, tensor_bytes: int, adam: bool) -> list[int]:
    """Output sizes of the Linear layers (weight + bias) adding up to about ``size_bytes``."""
    per_param = 4 * (3 if adam else 1)
    params = size_bytes / per_param
    per_tensor = max(IN_FEATURES, tensor_bytes / 4)
    n = max(2, round(params / per_tensor))
    weights = [1 + 0.04 * ((i % 3) - 1) for i in range(n)]  # vary the widths a little
    rows = params / (IN_FEATURES + 1)  # weight rows + bias entries
    return [max(3, int(rows * w / sum(weights)) | 1) for w in weights]  # all odd


def worker(a) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dims = layer_dims(int(a.size_gb * 1e9), int(a.tensor_mb * 1e6), a.adam)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(IN_FEATURES, d) for d in dims))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=gen)
    opt = None
    if a.adam:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for p in model.parameters():
            g = p.detach().clone()
            g.to_local().normal_(0.0, 1.0, generator=gen)
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    if opt is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": 1}
    else:
        state = {"model": get_state_dict(model, [])[0], "step": 1}
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(a.out))
    dist.barrier()
    if rank == 0:
        total = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
        n = sum(1 for _ in model.parameters())
        print(f"{a.out}: {len(dims)} Linear({IN_FEATURES}, d) layers, d in {dims}, "
              f"{n} parameter tensors{' + Adam' if a.adam else ''}, {world} ranks, {total} bytes, "
              f"dcp.save {time.perf_counter() - t0:.1f}s", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--tensor-mb", type=float, default=300.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--no-adam", dest="adam", action="store_false")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return
    if os.path.exists(a.out) and os.listdir(a.out):
        sys.exit(f"{a.out} exists and is not empty")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.ranks}", os.path.abspath(__file__), a.out, "--worker",
           "--size-gb", str(a.size_gb), "--tensor-mb", str(a.tensor_mb)]
    if not a.adam:
        cmd.append("--no-adam")
    r = subprocess.run(cmd, env=env)
    if r.returncode:
        sys.exit(r.returncode)


if __name__ == "__main__":
    main()
