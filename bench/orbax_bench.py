"""``ckptctl consolidate`` of an Orbax checkpoint to safetensors beside what a JAX user does
today (Orbax's own restore + ``safetensors.numpy.save_file``), same checkpoint, one run.

The goal (issue 39): Orbax -> safetensors against Orbax restore + ``safetensors.numpy.save_file``
on the same checkpoint (wall, peak RSS).

What it does:

1. writes an Orbax checkpoint with orbax-checkpoint itself (not timed; a subprocess with
   ``JAX_PLATFORMS=cpu``): a small LLM-shaped state, ``{"params": ..., "opt_state": ...,
   "step": 1}`` -- bf16 ``params`` in nested dicts (``embed.embedding``, ``layers.<i>.attn.
   {wq,wk,wv,wo}.kernel``, ``layers.<i>.mlp.{w1,w2,w3}.kernel``, the two norms' ``scale``,
   ``final_norm.scale``, ``lm_head.kernel``; ``layers`` a list, as in
   ``tests/fixtures/write_orbax.py``) and the fp32 optax Adam state of one real update
   (``optax.adam`` over fp32 master weights: ``count``, ``mu``, ``nu``, then optax's
   ``EmptyState``), the number of layers chosen for ``--size-mib``; saved with
   ``ocp.StandardCheckpointer().save`` (OCDBT + zarr3, today's default);
2. round-robin, ``--reps`` times each, inputs warm (read once right before each run) or
   ``--cold`` (dropped from the guest page cache with ``posix_fadvise``), every tool a fresh
   process from start to exit (imports included):

   * ``ckptctl consolidate CKPT OUT --to safetensors --only model`` and the same without
     ``--only`` (every tensor);
   * the peer, ``orbax_bench.py --peer CKPT OUT --part model|all`` with ``JAX_PLATFORMS=cpu``:
     ``ocp.StandardCheckpointer().restore(CKPT)`` (no target: the whole tree, on CPU), the
     PyTree flattened to dotted names (``jax.tree_util.tree_flatten_with_path``; the model
     part is the ``params`` subtree; ``None`` leaves, optax's ``EmptyState``, left out), each
     leaf ``np.asarray``-ed and ``safetensors.numpy.save_file(flat, OUT/<file>)`` (the file
     named as ckptctl names its own); it prints its phases' times (import, restore, flatten,
     save);

   wall time, CPU seconds (user + system) and peak RSS (``ru_maxrss`` via ``os.wait4``);
3. after **every** run, checks its output against a reference written once before the
   timed runs by the peer (not timed): the same tensor names, dtypes, shapes and raw bytes
   (``safetensors.numpy.load_file``, ``ndarray.tobytes``); so ckptctl's and the peer's
   outputs equal each other bit for bit, run after run. A difference is printed, written
   into the section as ``MISMATCH`` and the exit status is 1;
4. prints the table and writes it into ``BENCHMARKS.md`` between ``<!-- bench:orbax -->``
   markers.

    .venv/bin/python bench/orbax_bench.py [--size-mib 320] [--reps 3] [--cold]
        [--max-memory 1GiB] [--keep DIR] [--no-write]

safetensors.numpy (0.8) saves and loads ml_dtypes' ``bfloat16`` arrays as ``BF16`` itself,
so the peer passes jax's bf16 leaves through ``np.asarray`` unchanged (the bit-for-bit checks
confirm it; ``load_file`` needs ``ml_dtypes`` imported to know the name ``bfloat16``).
The comparisons run in subprocesses: a child's ``ru_maxrss`` starts from this process's
resident set at fork, so this process holds no tensors (``true``'s peak RSS, in the section,
is that floor).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    ROOT,
    ckptctl_exe,
    files_of,
    load_average,
    machine_facts,
    measure,
    median,
    remove,
    run_rounds,
    table,
    warm,
    work_dir,
    write_section,
)

MiB = 1 << 20
HIDDEN = 512
FFN = 1408
VOCAB = 8192
SEED = 39


# --------------------------------------------------------------------------- writing
def layers_for(size_bytes: int) -> int:
    """Layers so that params (bf16) + Adam mu, nu (fp32) come to about ``size_bytes``."""
    per_param = 2 + 4 + 4
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    fixed = 2 * VOCAB * HIDDEN + HIDDEN
    return max(1, round((size_bytes / per_param - fixed) / per_layer))


def gen_main(out: str, size_mib: float) -> None:
    """Subprocess (JAX_PLATFORMS=cpu): write the Orbax checkpoint, print its description."""
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp

    n_layers = layers_for(int(size_mib * MiB))
    keys = iter(jax.random.split(jax.random.PRNGKey(SEED), 16 * n_layers + 16))

    def normal(shape, scale=0.02):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    def dense(i, o):
        return {"kernel": normal((i, o))}

    master = {
        "embed": {"embedding": normal((VOCAB, HIDDEN), 1.0)},
        "layers": [{
            "attn_norm": {"scale": jnp.ones((HIDDEN,), jnp.float32)},
            "attn": {n: dense(HIDDEN, HIDDEN) for n in ("wq", "wk", "wv", "wo")},
            "mlp_norm": {"scale": jnp.ones((HIDDEN,), jnp.float32)},
            "mlp": {"w1": dense(HIDDEN, FFN), "w2": dense(FFN, HIDDEN), "w3": dense(HIDDEN, FFN)},
        } for _ in range(n_layers)],
        "final_norm": {"scale": jnp.ones((HIDDEN,), jnp.float32)},
        "lm_head": dense(HIDDEN, VOCAB),
    }
    tx = optax.adam(3e-4, b1=0.9, b2=0.95)
    opt_state = tx.init(master)
    grads = jax.tree_util.tree_map(lambda p: jnp.sin(3 * p) / 100 + normal(p.shape, 1e-3),
                                   master)
    updates, opt_state = tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), master)
    state = {"params": params, "opt_state": opt_state, "step": 1}
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    with ocp.StandardCheckpointer() as c:
        c.save(Path(out).resolve(), state)
    t2 = time.perf_counter()
    leaves = jax.tree_util.tree_leaves(state)
    arrays = [x for x in leaves if hasattr(x, "dtype")]
    p_leaves = jax.tree_util.tree_leaves(params)
    print(json.dumps({
        "layers": n_layers, "hidden": HIDDEN, "ffn": FFN, "vocab": VOCAB,
        "params": len(p_leaves), "numel": int(sum(x.size for x in p_leaves)),
        "param_bytes": int(sum(x.nbytes for x in p_leaves)),
        "arrays": len(arrays), "array_bytes": int(sum(x.nbytes for x in arrays)),
        "dir_bytes": sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file()),
        "files": sum(1 for p in Path(out).rglob("*") if p.is_file()),
        "build_s": round(t1 - t0, 1), "save_s": round(t2 - t1, 1),
        "versions": {m: _version(m) for m in ("jax", "jaxlib", "orbax-checkpoint", "optax",
                                              "tensorstore", "safetensors", "numpy",
                                              "ml_dtypes")},
    }), flush=True)


def _version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"


# --------------------------------------------------------------------------- the peer
def peer_main(ckpt: str, out: str, part: str, fname: str) -> None:
    """Subprocess (JAX_PLATFORMS=cpu): what a JAX user does today. Prints its phases."""
    t0 = time.perf_counter()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    t1 = time.perf_counter()
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(Path(ckpt).resolve())
    jax.block_until_ready(restored)
    t2 = time.perf_counter()
    tree = restored["params"] if part == "model" else restored
    prefix = ("params",) if part == "model" else ()
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]:
        if leaf is None:  # optax's EmptyState: no array
            continue
        keys = prefix + tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                              for k in path)
        flat[".".join(keys)] = np.asarray(leaf)
    t3 = time.perf_counter()
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(flat, str(Path(out) / fname))
    t4 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "restore_s": t2 - t1, "flatten_s": t3 - t2,
                      "save_s": t4 - t3, "tensors": len(flat)}), flush=True)


# --------------------------------------------------------------------------- correctness
def load_dir(d: Path) -> dict:
    """{name: ndarray} of every ``*.safetensors`` file in ``d`` (a name twice: an error)."""
    import ml_dtypes  # noqa: F401  (registers the name "bfloat16" that load_file asks numpy for)
    from safetensors.numpy import load_file

    got: dict = {}
    for p in sorted(d.glob("*.safetensors")):
        t = load_file(str(p))
        dup = set(t) & set(got)
        if dup:
            raise RuntimeError(f"{p}: names also in another file: {sorted(dup)[:5]}")
        got.update(t)
    return got


def diff(ref: dict, got: dict) -> list[str]:
    """What differs between two {name: ndarray}: names, dtypes, shapes, raw bytes."""
    out = [f"missing {n}" for n in sorted(set(ref) - set(got))]
    out += [f"extra {n}" for n in sorted(set(got) - set(ref))]
    for n in sorted(set(ref) & set(got)):
        a, b = ref[n], got[n]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{n}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif a.tobytes() != b.tobytes():
            out.append(f"{n}: bytes differ")
    return out


def compare_main(ref: str, got: str) -> None:
    """Subprocess: the differences between two output folders, as JSON."""
    r = load_dir(Path(ref))
    found = diff(r, load_dir(Path(got)))
    print(json.dumps({"tensors": len(r), "bytes": int(sum(x.nbytes for x in r.values())),
                      "dtypes": sorted({str(x.dtype) for x in r.values()}),
                      "diff": found}), flush=True)


def compare(ref: Path, got: Path, env: dict) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--compare", str(ref),
                        str(got)], capture_output=True, text=True, env=env, check=False)
    if r.returncode:
        return {"diff": [f"comparison failed: {r.stderr[-1500:]}"], "tensors": 0}
    return json.loads(r.stdout.strip().splitlines()[-1])


class Checker:
    """The ``output_ok`` of :func:`common.run_rounds`: each output against its reference,
    in a subprocess (this process stays small: a child's ``ru_maxrss`` starts from its
    parent's resident set at fork)."""

    def __init__(self, refs: dict[Path, Path], env: dict):
        self.refs = refs  # output folder -> reference folder
        self.env = env
        self.checked: dict[Path, int] = {o: 0 for o in refs}
        self.bad: list[str] = []

    def __call__(self, out: Path) -> str | None:
        found = compare(self.refs[out], out, self.env)["diff"]
        self.checked[out] += 1
        if found:
            msg = f"MISMATCH in {out.name}: {len(found)} differences, e.g. {found[:5]}"
            print("  " + msg, flush=True)
            self.bad.append(msg)
        return None  # keep timing the other runs; reported loudly at the end


# --------------------------------------------------------------------------- main
HEADERS = ["tool", "part", "runs", "wall s", "min-max", "CPU s", "peak RSS MiB",
           "peer wall / ckptctl wall", "peer RSS / ckptctl RSS"]


def git_rev() -> str:
    """The commit of the work tree, read from ``.git`` (no git command)."""
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            p = ROOT / ".git" / ref
            if p.exists():
                return p.read_text().strip()[:9]
            for line in (ROOT / ".git" / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:9]
            return "?"
        return head[:9]
    except OSError:
        return "?"


def main(argv=None) -> int:
    doc = __doc__.splitlines()
    ap = argparse.ArgumentParser(description=" ".join(doc[:2]).replace("``", "`"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc[3:]))
    ap.add_argument("--size-mib", type=float, default=320.0,
                    help="checkpoint size, MiB: bf16 params + fp32 Adam mu and nu (default 320)")
    ap.add_argument("--reps", type=int, default=3, help="runs per tool (default 3)")
    ap.add_argument("--cold", action="store_true", help="drop the inputs from the page "
                    "cache before each run (default: read them once right before: warm)")
    ap.add_argument("--max-memory", default=None,
                    help="pass --max-memory to ckptctl (default: ckptctl's own, 1GiB)")
    ap.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    ap.add_argument("--gen", nargs=2, metavar=("OUT", "SIZE_MIB"), help=argparse.SUPPRESS)
    ap.add_argument("--compare", nargs=2, metavar=("REF", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=("model", "all"), default="model", help=argparse.SUPPRESS)
    ap.add_argument("--file", default="model.safetensors", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.gen:
        gen_main(a.gen[0], float(a.gen[1]))
        return 0
    if a.peer:
        peer_main(*a.peer, a.part, a.file)
        return 0
    if a.compare:
        compare_main(*a.compare)
        return 0

    log = lambda m: print(m, flush=True)
    t_start = time.monotonic()
    load_before = load_average()
    ck = ckptctl_exe()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore",
               TF_CPP_MIN_LOG_LEVEL="3")
    work = work_dir(a.keep, "orbax-bench-")
    me = os.path.abspath(__file__)
    try:
        # ---------------------------------------------------------------- checkpoint
        ckpt = work / "ckpt"
        log(f"writing an Orbax checkpoint of ~{a.size_mib:g} MiB ({layers_for(int(a.size_mib * MiB))}"
            f" layers) with orbax-checkpoint to {ckpt} ...")
        r = measure([sys.executable, me, "--gen", str(ckpt), str(a.size_mib)], capture=True,
                    env=env, check=False)
        if r.returncode:
            raise RuntimeError(f"writing the checkpoint failed:\n{r.stdout[-2000:]}\n"
                               f"{r.stderr[-3000:]}")
        info = json.loads(next(ln for ln in reversed(r.stdout.splitlines())
                               if ln.startswith("{")))
        log(f"  {info['layers']} layers, {info['params']} params tensors ({info['numel']:,} "
            f"bf16 numbers), {info['arrays']} arrays, {info['array_bytes'] / MiB:.0f} MiB of "
            f"array bytes; folder {info['dir_bytes'] / MiB:.0f} MiB in {info['files']} files; "
            f"written in {r.wall_s:.1f} s (save {info['save_s']} s), peak RSS "
            f"{r.peak_rss_mb:.0f} MiB")
        inputs = files_of(ckpt)

        # ---------------------------------------------------------------- names and references
        out = work / "out"
        remove(out)
        out.mkdir()
        mm = ["--max-memory", a.max_memory] if a.max_memory else []
        ck_cmd = {
            "model": [ck, "consolidate", str(ckpt), str(out / "ck-model"), "--to", "safetensors",
                      "--only", "model", *mm],
            "all": [ck, "consolidate", str(ckpt), str(out / "ck-all"), "--to", "safetensors",
                    *mm],
        }
        # one untimed ckptctl run per part: the file names the peer then writes
        fnames, refs, ref_info = {}, {}, {}
        for part, cmd in ck_cmd.items():
            o = Path(cmd[3])
            measure(cmd, capture=True, env=env)
            st = sorted(p.name for p in o.glob("*.safetensors"))
            if len(st) != 1:
                raise RuntimeError(f"ckptctl wrote {st} for --part {part}: expected one file")
            fnames[part] = st[0]
            remove(o)
        log("reference outputs (the peer, untimed) ...")
        for part in ck_cmd:
            ref = work / f"ref-{part}"
            measure([sys.executable, me, "--peer", str(ckpt), str(ref), "--part", part,
                     "--file", fnames[part]], capture=True, env=env)
            refs[part] = ref
            c = compare(ref, ref, env)
            if c["diff"]:
                raise RuntimeError(f"reading the reference {ref}: {c['diff']}")
            ref_info[part] = c
            log(f"  {part}: {fnames[part]}, {c['tensors']} tensors, {c['bytes'] / MiB:.0f} MiB, "
                f"dtypes {', '.join(c['dtypes'])}")

        cmds = {}
        for part, cmd in ck_cmd.items():
            cmds[f"ckptctl {part}"] = (cmd, out / f"ck-{part}")
            cmds[f"peer {part}"] = ([sys.executable, me, "--peer", str(ckpt),
                                     str(out / f"peer-{part}"), "--part", part, "--file",
                                     fnames[part]], out / f"peer-{part}")
        checker = Checker({o: refs[n.split()[1]] for n, (_, o) in cmds.items()}, env)

        # ---------------------------------------------------------------- timed runs
        log(f"{'cold' if a.cold else 'warm'} runs ({a.reps} per tool, round-robin), each "
            f"output checked against the reference ...")
        series, flushes, left = run_rounds(cmds, a.reps, inputs, a.cold, set(), log, env=env,
                                           output_ok=checker)
        phases = {}
        for n, s in series.items():
            if n.startswith("peer"):
                ph = [json.loads(next(ln for ln in reversed(r.stdout.splitlines())
                                      if ln.startswith("{"))) for r in s.runs]
                phases[n] = {k: statistics.median(p[k] for p in ph)
                             for k in ("import_s", "restore_s", "flatten_s", "save_s")}
        warm(inputs)
        fixed = {
            "true": measure(["true"]),
            "ckptctl --help": measure([ck, "--help"], env=env),
            "python -c 'import jax, orbax.checkpoint, safetensors.numpy'":
                measure([sys.executable, "-c",
                         "import jax, orbax.checkpoint, safetensors.numpy"], env=env),
            "ckptctl inspect CKPT": measure([ck, "inspect", str(ckpt)], env=env),
        }

        # ---------------------------------------------------------------- report
        facts = machine_facts()
        load_after = load_average()
        rows = []
        for part in ck_cmd:
            c, p = series[f"ckptctl {part}"], series[f"peer {part}"]
            for name, s in (("ckptctl consolidate", c), ("Orbax restore + save_file", p)):
                is_peer = s is p
                rows.append([name, "model (`params`)" if part == "model" else "all",
                             len(s.runs), f"{s.wall_s:.2f}", s.spread, f"{s.cpu_s:.1f}",
                             f"{s.peak_rss_mb:.0f}",
                             f"{p.wall_s / c.wall_s:.2f}" if is_peer else "1.00",
                             f"{p.peak_rss_mb / c.peak_rss_mb:.2f}" if is_peer else "1.00"])
        ok = not checker.bad
        checks = sum(checker.checked.values())
        cmdline = " ".join([os.path.relpath(sys.executable, ROOT)
                            if sys.executable.startswith(str(ROOT)) else sys.executable,
                            os.path.relpath(__file__, ROOT),
                            *(argv if argv is not None else sys.argv[1:])])
        v = info["versions"]
        o = [("## consolidate an Orbax checkpoint to safetensors vs Orbax restore + "
              "safetensors.numpy.save_file\n")]
        o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, "
                 f"kernel {facts['kernel']}, Python {facts['python']}; jax {v['jax']} "
                 f"(jaxlib {v['jaxlib']}, `JAX_PLATFORMS=cpu`), orbax-checkpoint "
                 f"{v['orbax-checkpoint']}, optax {v['optax']}, tensorstore {v['tensorstore']}, "
                 f"safetensors {v['safetensors']}, numpy {v['numpy']}, ml_dtypes "
                 f"{v['ml_dtypes']}; ckptctl at `{git_rev()}` (work tree, uncommitted changes "
                 f"possible). Load average {load_before} before, {load_after} after: **noisy** "
                 f"-- a test suite ran in the background on the same two cores during this "
                 f"run, so absolute times are inflated and spread; compare the ratios of the "
                 f"same run.")
        o.append(f"\nCommand:\n\n```\n{cmdline}\n```\n")
        o.append(f"Checkpoint: written by orbax-checkpoint itself (`ocp.StandardCheckpointer()"
                 f".save`, OCDBT + zarr3, the default; not timed): `{{params, opt_state, "
                 f"step}}` of an LLM-shaped model, {info['layers']} layers, hidden "
                 f"{info['hidden']}, ffn {info['ffn']}, vocab {info['vocab']} (embedding, per "
                 f"layer attention wq/wk/wv/wo, SwiGLU w1/w2/w3 and two norm scales, final norm, "
                 f"lm_head; `layers` a list): {info['params']} bf16 `params` tensors "
                 f"({info['numel']:,} numbers, {info['param_bytes'] / MiB:.0f} MiB) and the "
                 f"fp32 `optax.adam` state of one update (`count`, `mu`, `nu`); {info['arrays']} "
                 f"arrays, {info['array_bytes'] / MiB:.0f} MiB; the folder holds "
                 f"{info['files']} files, {info['dir_bytes'] / MiB:.0f} MiB (zstd-compressed "
                 f"chunks). Written in {r.wall_s:.0f} s, peak RSS {r.peak_rss_mb:.0f} MiB.\n")
        o.append("Tools, each one process from start to exit (imports included), output to a "
                 "fresh folder: `ckptctl consolidate CKPT OUT --to safetensors --only model` "
                 f"(writes `{fnames['model']}`) and without `--only` (`{fnames['all']}`: every "
                 "tensor, `opt_state.*` and `step` included)"
                 + (f", `--max-memory {a.max_memory}`" if a.max_memory else
                    " (default `--max-memory 1GiB`, `--workers 4`)")
                 + "; it reads the zarr chunks through tensorstore, no jax or orbax. The peer "
                 "(`bench/orbax_bench.py --peer`, what a JAX user does today): "
                 "`ocp.StandardCheckpointer().restore(CKPT)` on CPU (no target: the whole "
                 "tree), the PyTree flattened to dotted names (`jax.tree_util."
                 "tree_flatten_with_path`; model = the `params` subtree; optax's `EmptyState` "
                 "`None` leaf left out), `np.asarray` per leaf and `safetensors.numpy."
                 "save_file(flat, OUT/<same file name>)`. safetensors.numpy "
                 f"{v['safetensors']} takes ml_dtypes' bfloat16 arrays as they are (`BF16`): "
                 "no conversion needed.\n")
        cache = (f"Cold: before every run the {len(inputs)} input files are dropped from the "
                 f"guest page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`; `fincore` found at "
                 f"most {left} bytes still cached)" if a.cold else
                 f"Warm: the {len(inputs)} input files read once right before every run")
        o.append(f"{cache}. Medians of {a.reps} runs per tool, round-robin. `wall s`: process "
                 "start to exit (outputs then in the page cache; their `fdatasync` right after "
                 "is not in it: median "
                 + ", ".join(f"{n} {median(f):.2f} s" for n, f in flushes.items())
                 + "); `CPU s`: user + system of the process tree; `peak RSS`: `ru_maxrss` "
                 "(`os.wait4`), MiB, the highest of the runs; the ratios: the peer's over "
                 "ckptctl's for the same part (above 1: ckptctl faster / smaller).\n")
        o.append(table(HEADERS, rows))
        verdict = (f"All {checks} outputs (every timed run of both tools) equal the reference "
                   f"bit for bit: same names, dtypes, shapes and raw bytes "
                   f"({ref_info['model']['tensors']} tensors for model, {ref_info['all']['tensors']} for all; "
                   f"`safetensors.numpy.load_file`, `ndarray.tobytes`)." if ok else
                   "**MISMATCH: ckptctl's and the peer's outputs differ**: "
                   + "; ".join(checker.bad[:6]))
        o.append("\n" + verdict)
        o.append("\nWhere the peer's time goes (medians, from the script's own clocks): "
                 + "; ".join(f"{n}: import {ph['import_s']:.2f} s, restore "
                             f"{ph['restore_s']:.2f} s, flatten + `np.asarray` "
                             f"{ph['flatten_s']:.2f} s, `save_file` {ph['save_s']:.2f} s"
                             for n, ph in phases.items()) + ".")
        o.append("\nFixed costs (warm, one run each): " + "; ".join(
            f"`{k}` {x.wall_s:.2f} s, {x.peak_rss_mb:.0f} MiB" for k, x in fixed.items()) + ".")
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            path = write_section("orbax", text, Path(a.md))
            log(f"wrote the orbax section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0 if ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
