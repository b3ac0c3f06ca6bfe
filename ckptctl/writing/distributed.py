"""Run a conversion (``reshard``, ``consolidate``, ``pack``; ``promote`` with its own commit,
see :func:`~ckptctl.tiering.promote.promote`) or ``verify --level full`` as one process of many
under a launcher that already exists (``torchrun``, ``srun``): each process takes its share
of the work by ``RANK``/``WORLD_SIZE``, rank 0 commits. No cluster code of ours.

The writer protocol (DESIGN.md, "Scale-out"):

1. every process opens the source and computes the same plan; output file ``i`` of the
   writer's own ordered list is written by process ``i % WORLD_SIZE``, so no byte of the
   output depends on how many processes wrote it;
2. rank 0 prepares DST like a one-process writer (``--force`` clears it, the
   ``.ckptctl-writing`` marker goes in first), then says "go", or why not, to the others;
3. each process writes its files (durable once closed) and reports to rank 0 their
   hashes and sizes (for DCP also where each chunk landed), or the error that stopped it
   (its own files removed);
4. rank 0, once every process succeeded, writes the format's markers (``.metadata``, the
   HF index), removes the marker and writes the manifest (from the reported hashes:
   nothing is re-read); if any failed it removes every file of the run and exits
   non-zero, as a one-process run does. Other ranks never write markers or the manifest.

Synchronisation: a gloo process group when the launcher exported ``MASTER_ADDR`` and
``MASTER_PORT`` (torchrun does; torch is imported only then), else small JSON files in
DST's ``.ckptctl-dist/`` (rank 0 writes ``go.json``, rank k ``k.json``, rank 0 polls and
removes them before it commits; the writing marker stays in place the whole time, so
``ls``/``verify`` call the folder incomplete). Every message carries rank 0's random nonce,
so a file left by a killed run is never taken for this run's. When rank 0 refuses DST
(not empty, no ``--force``) the file transport cannot say so (DST is not ours to write
into): the others give up at the timeout; gloo tells them at once. ``$CKPTCTL_DIST_TIMEOUT``
(seconds, default 1800) bounds every wait; ``$CKPTCTL_DISTRIBUTED=0`` makes each process
a plain one-process run (``files``/``gloo`` force a transport).

>>> g = Group.from_env({"RANK": "1", "WORLD_SIZE": "4"})
>>> g.rank, g.world_size, g.backend, g.mine(["a", "b", "c", "d", "e", "f"])
(1, 4, 'files', ['b', 'f'])
>>> Group.from_env({}).active, Group.from_env({"RANK": "0", "WORLD_SIZE": "4",
...                                            "CKPTCTL_DISTRIBUTED": "0"}).active
(False, False)
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

from ..errors import EXIT_INTERRUPTED, EXIT_OPERATIONAL, CkptError, UsageError, shorten

T = TypeVar("T")

#: Folder of the file rendezvous inside DST (removed by rank 0 before it commits).
DIST_DIR = ".ckptctl-dist"
ENV_SWITCH = "CKPTCTL_DISTRIBUTED"
ENV_TIMEOUT = "CKPTCTL_DIST_TIMEOUT"
#: Where ``verify`` (which writes nothing into the checkpoint) meets without a process group.
ENV_DIR = "CKPTCTL_DIST_DIR"
DEFAULT_TIMEOUT = 1800.0


class RankFailed(CkptError):
    """Another process of the run failed (or never answered): this one stops too, with that
    process's exit code, and rank 0 commits nothing."""

    def __init__(self, message: str, exit_code: int = EXIT_OPERATIONAL, code: str | None = None):
        super().__init__(None, message, code=code)
        self.exit_code = exit_code


def error_doc(e: BaseException) -> dict:
    """What a process reports when its share failed: exit code, problem code, one line.

    >>> error_doc(UsageError("bad"))["exit_code"], error_doc(KeyboardInterrupt())["exit_code"]
    (2, 130)
    """
    if isinstance(e, CkptError):
        return {"exit_code": e.exit_code, "code": str(e.code), "message": str(e)}
    if isinstance(e, KeyboardInterrupt):
        return {"exit_code": EXIT_INTERRUPTED, "code": "INTERRUPTED", "message": "interrupted"}
    return {"exit_code": EXIT_OPERATIONAL, "code": "INTERNAL",
            "message": f"internal error: {type(e).__name__}: {shorten(e, 200)}"}


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"${name} must be an integer, got {env[name]!r}") from None


@dataclass
class Group:
    """This process in a run of ``world_size`` processes; ``backend`` says how they meet:
    ``none`` (one process: today's behaviour exactly), ``gloo`` or ``files``."""

    rank: int = 0
    world_size: int = 1
    backend: str = "none"
    timeout: float = DEFAULT_TIMEOUT
    run_id: str = ""
    _owned: bool = field(default=False, repr=False)
    _nonce: str = field(default="", repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 timeout: float | None = None) -> "Group":
        """This process as the launcher describes it: ``RANK``/``WORLD_SIZE`` (torchrun),
        else ``SLURM_PROCID``/``SLURM_NTASKS`` (srun); one process when neither is set or
        ``$CKPTCTL_DISTRIBUTED`` is ``0``."""
        env = os.environ if env is None else env
        switch = env.get(ENV_SWITCH, "").strip().lower()
        if switch in ("0", "false", "no", "off"):
            return cls()
        if switch not in ("", "1", "true", "yes", "on", "gloo", "files"):
            raise UsageError(f"${ENV_SWITCH} must be 0, 1, gloo or files, got {switch!r}")
        if "RANK" in env and "WORLD_SIZE" in env:
            rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            rank, world = _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS")
        else:
            return cls()
        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"rank {rank} of world size {world}: not a valid process "
                             "(check RANK/WORLD_SIZE)")
        if world == 1:
            return cls()
        if timeout is None:
            raw = env.get(ENV_TIMEOUT)
            try:
                timeout = float(raw) if raw else DEFAULT_TIMEOUT
            except ValueError:
                raise UsageError(f"${ENV_TIMEOUT} must be seconds, got {raw!r}") from None
            if timeout <= 0:
                raise UsageError(f"${ENV_TIMEOUT} must be positive, got {raw!r}")
        if switch in ("gloo", "files"):
            backend = switch
        else:
            backend = "gloo" if env.get("MASTER_ADDR") and env.get("MASTER_PORT") else "files"
        run_id = (env.get("CKPTCTL_RUN_ID") or env.get("TORCHELASTIC_RUN_ID")
                  or (f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
                      if "SLURM_JOB_ID" in env else ""))
        return cls(rank, world, backend, timeout, run_id)

    @property
    def active(self) -> bool:
        """More than one process shares the work."""
        return self.world_size > 1

    def mine(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items`` (in the writer's own order): item ``i`` goes to
        process ``i % world_size``."""
        return list(items[self.rank::self.world_size])

    def rank_0_alone(self, verb: str) -> str | None:
        """For a verb that does not split yet (``pack``): None on rank 0 (it runs the whole
        job), else the line that says this process has nothing to do."""
        if self.rank == 0:
            return None
        return f"rank {self.rank}/{self.world_size}: {verb} runs on rank 0 alone"

    def tag(self, doc: dict) -> dict:
        """A ``--json`` document, with ``rank`` and ``processes`` when several ran."""
        return {**doc, "rank": self.rank, "processes": self.world_size} if self.active else doc

    # ------------------------------------------------------------ collectives
    def _pg(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            import atexit
            from datetime import timedelta

            try:
                dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size,
                                        timeout=timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - torch raises several kinds
                raise RankFailed(f"cannot join the gloo process group at "
                                 f"{os.environ.get('MASTER_ADDR')}:"
                                 f"{os.environ.get('MASTER_PORT')}: {shorten(e, 200)}") from None
            self._owned = True
            atexit.register(self.close)
        return dist

    def close(self) -> None:
        """Leave the process group this object joined (not one the caller made)."""
        if self._owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owned = False

    def broadcast(self, doc: Any, place=None) -> Any:
        """Rank 0's ``doc`` on every process. ``place``: the Store of the file rendezvous."""
        if not self.active:
            return doc
        if self.backend == "gloo":
            dist = self._pg()
            box = [doc]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as e:  # noqa: BLE001 - a peer died or timed out
                raise RankFailed(f"rank {self.rank}: waiting for rank 0: {shorten(e, 200)}") from None
            return box[0]
        if self.rank == 0:
            self._nonce = os.urandom(8).hex()
            _put(place, "go.json", {"run": self.run_id, "nonce": self._nonce, "doc": doc})
            return doc
        got = self._wait(place, "go.json", lambda m: True, "rank 0 to prepare the destination")
        self._nonce = got["nonce"]
        return got["doc"]

    def gather(self, doc: Any, place=None) -> list | None:
        """Every process's ``doc`` in rank order on rank 0 (None elsewhere)."""
        if not self.active:
            return [doc]
        if self.backend == "gloo":
            dist = self._pg()
            out = [None] * self.world_size if self.rank == 0 else None
            try:
                dist.gather_object(doc, out, dst=0)
            except Exception as e:  # noqa: BLE001 - a peer died or timed out
                raise RankFailed(f"rank {self.rank}: gathering results: {shorten(e, 200)}") from None
            return out
        if self.rank != 0:
            _put(place, f"{self.rank}.json",
                 {"run": self.run_id, "nonce": self._nonce, "rank": self.rank, "doc": doc})
            return None
        docs = [doc]
        for r in range(1, self.world_size):
            got = self._wait(place, f"{r}.json", lambda m: m.get("nonce") == self._nonce,
                             f"rank {r} to report")
            docs.append(got["doc"])
        return docs

    def _wait(self, place, name: str, accept: Callable[[dict], bool], what: str) -> dict:
        """Poll ``place``/.ckptctl-dist/``name`` until it holds a message of this run."""
        rel = f"{DIST_DIR}/{name}"
        deadline = time.monotonic() + self.timeout
        pause = 0.02
        while True:
            msg = _get(place, rel)
            if msg is not None and msg.get("run") == self.run_id and accept(msg):
                return msg
            if time.monotonic() > deadline:
                raise RankFailed(f"rank {self.rank}: gave up waiting for {what} after "
                                 f"{self.timeout:g}s ({place.display(rel)}; "
                                 f"${ENV_TIMEOUT} sets the wait)")
            time.sleep(pause)
            pause = min(0.5, pause * 1.5)

    def clear(self, place) -> None:
        """Rank 0: remove the rendezvous files (before it commits, or when it gives up)."""
        if self.backend != "files" or self.rank != 0 or place is None:
            return
        for r in range(1, self.world_size):
            place.remove(f"{DIST_DIR}/{r}.json")
        place.remove(f"{DIST_DIR}/go.json")
        if place.is_local:
            try:
                os.rmdir(place.full(DIST_DIR))
            except OSError:
                pass


def _put(place, name: str, msg: dict) -> None:
    place.write_atomic(f"{DIST_DIR}/{name}", json.dumps(msg).encode())


def _get(place, rel: str) -> dict | None:
    try:
        if not place.exists(rel):
            return None
        msg = json.loads(place.read(rel))
    except (CkptError, ValueError):
        return None  # not there yet, or being replaced
    return msg if isinstance(msg, dict) else None


def rendezvous_place(group: Group):
    """Where ``verify``'s ``files`` rendezvous meets (it writes nothing into the checkpoint):
    the folder ``$CKPTCTL_DIST_DIR`` names. Writers meet in their DST."""
    if group.backend != "files":
        return None
    where = os.environ.get(ENV_DIR)
    if not where:
        raise UsageError(f"verify under a launcher without MASTER_ADDR/MASTER_PORT meets "
                         f"through files: set ${ENV_DIR} to a folder every process can reach "
                         f"(or ${ENV_SWITCH}=0 to verify in each process alone)")
    import re

    from ..storage import open_store

    # one folder per run: several verify jobs may share $CKPTCTL_DIST_DIR
    run = re.sub(r"[^A-Za-z0-9._-]", "_", group.run_id) or "run"
    return open_store(f"{where.rstrip('/')}/{run}")


def _raise_first_failure(docs: list[dict], own: BaseException | None) -> None:
    for r, d in enumerate(docs):
        if d.get("error") is None:
            continue
        if r == 0 and own is not None:
            raise own
        e = d["error"]
        raise RankFailed(f"rank {r} failed: {e['message']}", e["exit_code"], e["code"])


def write_shared(group: Group, out, write: Callable[[], dict],
                 finish: Callable[[list[dict]], T], *, planned: Sequence[str] = ()) -> T | dict:
    """The writer protocol (module docstring) around one :class:`~ckptctl.writing.output.OutputDir`
    ``out`` (not entered yet). ``write()`` writes this process's share and returns its
    report (JSON-able; ``hashes``: file -> [digest, size]). ``finish(reports)``, on rank 0
    once every process succeeded (reports in rank order), writes the format's markers,
    calls ``out.commit()`` and the manifest, and returns the result. Other ranks get their
    own report back. ``planned``: every file the run may write; rank 0 removes them all
    when the run fails, also those of a process that died without reporting.

    >>> write_shared(Group(), out, write=lambda: {"hashes": {}}, finish=len)   # doctest: +SKIP
    1
    """
    place = out.store if group.backend == "files" else None
    if group.rank != 0:
        go = group.broadcast(None, place)
        if go.get("error") is not None:
            e = go["error"]
            raise RankFailed(f"rank 0 failed: {e['message']}", e["exit_code"], e["code"])
        out.join()
        own, report = None, None
        try:
            report = write()
        except BaseException as e:  # noqa: BLE001 - reported to rank 0, then re-raised
            out.cancelled.set()
            out._cleanup()
            own = e
        group.gather({"error": error_doc(own)} if own else {"error": None, **report}, place)
        if own is not None:
            raise own
        return report
    try:
        out.__enter__()
    except BaseException as e:
        if group.backend == "gloo":  # a files rendezvous cannot write into a DST it refused
            group.broadcast({"error": error_doc(e)})
        raise
    try:
        for rel in planned:
            out._track(rel)
        group.broadcast({"error": None}, place)
        own, report = None, {}
        try:
            report = write()
        except BaseException as e:  # noqa: BLE001 - every process must reach the gather
            out.cancelled.set()
            own = e
        docs = group.gather({"error": error_doc(own)} if own else {"error": None, **report},
                            place)
        for d in docs:  # what the others wrote is this run's to remove on failure
            for rel in (d.get("hashes") or {}):
                out._track(rel)
        group.clear(place)
        _raise_first_failure(docs, own)
        result = finish(docs)
    except BaseException:
        exc = sys.exc_info()
        try:
            group.clear(place)
        finally:
            out.__exit__(*exc)
        raise
    out.__exit__(None, None, None)
    return result


# --------------------------------------------------------------------------- DCP shares


def dcp_report(writer) -> dict:
    """What a :class:`~ckptctl.formats.dcp_write.DcpWriter` wrote, JSON-able: file hashes,
    and each chunk's place, for rank 0's ``.metadata``."""
    m = writer.meta
    return {"hashes": {rel: list(v) for rel, v in sorted(writer.hashes.items())},
            "tensors": {fqn: [dtype, list(shape), [[list(o), list(s)] for o, s in chunks]]
                        for fqn, (dtype, shape, chunks) in sorted(m.tensors.items())},
            "objects": sorted(m.objects),
            "storage": [[fqn, None if off is None else list(off), rel, a, n]
                        for (fqn, off), (rel, a, n) in m.storage.items()]}


def merge_dcp(writer, report: dict) -> None:
    """Add another process's :func:`dcp_report` to ``writer`` (rank 0's)."""
    for rel, (digest, size) in report["hashes"].items():
        writer.hashes[rel] = (digest, int(size))
    for fqn, (dtype, shape, chunks) in report["tensors"].items():
        entry = writer.meta.tensors.setdefault(fqn, (dtype, tuple(shape), []))
        entry[2].extend((tuple(o), tuple(s)) for o, s in chunks)
    writer.meta.objects.update(report["objects"])
    for fqn, off, rel, a, n in report["storage"]:
        writer.meta.storage[(fqn, None if off is None else tuple(off))] = (rel, a, n)


# --------------------------------------------------------------------------- verify


def full_shared(group: Group, checker, *, run: bool = True) -> None:
    """``verify --level full`` as one process of ``group``: read this process's share of
    the files (``checker.full()`` picks it), then :func:`gather_verify`. Every process
    reaches the gather, also one whose checks stopped early (``run`` False: the
    checkpoint did not open) or failed: its error goes to rank 0."""
    place = rendezvous_place(group)
    group.broadcast(None, place)  # files: rank 0's nonce, so no old report is taken for new
    first = len(checker.problems)
    store = getattr(checker, "store", None)
    before = store.stats.bytes_read if store is not None else 0
    error = None
    try:
        if run:
            checker.full()
    except Exception as e:  # noqa: BLE001 - every process must reach the gather
        error = e
    share = dict(getattr(checker, "_share", {}))
    share["bytes"] = (store.stats.bytes_read - before) if store is not None else 0
    gather_verify(group, checker, first, share, error, place)


def gather_verify(group: Group, checker, first_problem: int, share: dict,
                  error: BaseException | None, place=None) -> None:
    """Rank 0 of ``verify --level full``: fold every process's findings into ``checker``
    (problems since index ``first_problem``, NaN/Inf counts, files read, tensors seen,
    what was proven, bytes read); other ranks send theirs. ``share``: this process's
    ``files``, ``crc_files``, ``tensors`` and full-level ``bytes``."""
    r = checker.result
    mine = {"error": error_doc(error) if error else None,
            "problems": [vars(p) for p in checker.problems[first_problem:]
                         if p.code != "NON_FINITE"],
            "non_finite": r.non_finite, "files_read": r.files_read,
            "files": sorted(share.get("files", ())), "crc_files": sorted(share.get("crc_files", ())),
            "tensors": sorted(share.get("tensors", ())), "bytes": int(share.get("bytes", 0))}
    docs = group.gather(mine, place)
    if group.rank != 0:
        if error is not None:
            raise error
        return
    group.clear(place)
    _raise_first_failure(docs, error)
    del checker.problems[first_problem:]
    nf: dict[str, dict] = {}
    files, crc, tensors = set(), set(), set()
    for d in docs:
        for p in d["problems"]:
            checker.add(p["code"], p["message"], path=p["path"], entry=p["entry"],
                        severity=p["severity"])
        for name, c in d["non_finite"].items():
            acc = nf.setdefault(name, {"nan": 0, "inf": 0})
            acc["nan"] += c["nan"]
            acc["inf"] += c["inf"]
        files.update(d["files"])
        crc.update(d["crc_files"])
        tensors.update(d["tensors"])
    for name, counts in sorted(nf.items()):
        checker.add("NON_FINITE", f"{counts['nan']} NaN, {counts['inf']} Inf", entry=name)
    r.non_finite = dict(sorted(nf.items()))
    r.files_read = sum(d["files_read"] for d in docs)
    r.tensors_checked = len(tensors)
    checker._other_bytes = sum(d["bytes"] for d in docs[1:])
    if r.content != "hashes" and files:
        plain = files - crc
        r.content = "crc" if not plain else "decoded-only" if not crc else "crc+decoded-only"


__all__ = ["DIST_DIR", "Group", "RankFailed", "dcp_report", "error_doc", "full_shared",
           "gather_verify", "merge_dcp", "rendezvous_place", "write_shared"]
