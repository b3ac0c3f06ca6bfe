"""``latest``: the newest committed checkpoint under a root, for resume scripts.

Committed means ``sealed`` (a manifest, every file it lists there at its size) or
``complete`` (the format's own commit marker, every data file present); newest means the
highest step, then the newest commit time, then the name (natural order); a tie at the
answer's step is reported (``tie``: the others, and what decided). With
``verified``, candidates are checked newest first with ``verify --level full`` (content
hashes, or every zip record's CRC) and the first that passes is the answer.

On a remote root the listing alone ranks the candidates (``ls(check="listing")``): only
the newest few are read (their manifest or format metadata), so 10,000 checkpoints on S3
cost about ten LIST requests and a handful of GETs. A candidate that reads as damaged
drops out and the next is read, so the answer is the one a full read of every checkpoint
would give (steps are taken from names like ``step-1200`` until a checkpoint is read).

>>> r = latest("/ckpt/run1")                                  # doctest: +SKIP
>>> r.url                                                     # doctest: +SKIP
'/ckpt/run1/step-12000'
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..catalog.ls import CheckpointRow, confirm, ls
from .policy import Item, newest_first


@dataclass
class LatestResult:
    root: str
    url: str | None  # None: no committed checkpoint (that passed verification)
    name: str | None = None
    step: int | None = None
    state: str | None = None
    #: with ``verified``: each candidate tried, newest first, and the first problem found
    rejected: list[dict] = field(default_factory=list)
    #: the framework's own pointer files in the answer's folder (Megatron's tracker,
    #: DeepSpeed's ``latest``) that name another checkpoint: what that framework resumes
    #: from instead (``{"file", "names", "present"}``, :func:`~ckptctl.formats.locate.pointers`)
    disagrees: list[dict] = field(default_factory=list)
    #: other committed checkpoints at the answer's step, and what broke the tie:
    #: ``{"others": [names], "chosen_by": "modified" | "name"}`` (:func:`tie_break`); None
    #: when the answer's step is its own
    tie: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def tie_note(self) -> str | None:
        """The tie at the answer's step in words (for stderr), or None.

        >>> LatestResult("r", "r/b", "b", 5, "sealed", tie={"others": ["a"],
        ...              "chosen_by": "modified"}).tie_note()
        'step 5 has 2 committed checkpoints (b, a): took b, the one modified last'
        """
        if not self.tie:
            return None
        names = [self.name, *self.tie["others"]]
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        how = ("the one modified last" if self.tie["chosen_by"] == "modified" else
               "the last by name (natural order): their modification times are equal")
        return (f"step {self.step} has {len(names)} committed checkpoints ({shown}): "
                f"took {self.name}, {how}")


def tie_break(answer: CheckpointRow, candidates: list[CheckpointRow]) -> dict | None:
    """The other ``candidates`` (committed, newest first, not yet ruled out) at ``answer``'s
    step and what put ``answer`` first (:func:`~ckptctl.tiering.policy.newest_first`): a later
    modification time, else the name; None without a tie (or without a step).

    >>> rows = [CheckpointRow(n, n, 5, "dcp", "sealed", "", 1, 1, t) for n, t in
    ...         [("b", 2.0), ("a", 2.0), ("c", 1.0)]]
    >>> tie_break(rows[0], rows)
    {'others': ['a', 'c'], 'chosen_by': 'name'}
    >>> tie_break(rows[2], rows[2:]) is None
    True
    """
    if answer.step is None:
        return None
    others = [r for r in candidates if r.step == answer.step and r.name != answer.name]
    if not others:
        return None
    newer = (answer.modified or 0.0) > max(r.modified or 0.0 for r in others)
    return {"others": [r.name for r in others], "chosen_by": "modified" if newer else "name"}


def committed_newest_first(rows: list[CheckpointRow]) -> list[CheckpointRow]:
    """The committed rows of an ``ls``, newest first (:func:`~ckptctl.tiering.policy.newest_first`).

    >>> rows = [CheckpointRow(n, n, s, "dcp", st, "", 1, 1, 0.0) for n, s, st in
    ...         [("step-1", 1, "sealed"), ("step-3", 3, "incomplete"), ("step-2", 2, "complete")]]
    >>> [r.name for r in committed_newest_first(rows)]
    ['step-2', 'step-1']
    """
    by_name = {r.name: r for r in rows}
    items = [Item(r.name, r.step, r.modified, r.state) for r in rows]
    return [by_name[i.name] for i in newest_first(items) if i.committed]


def latest(root: str, storage_options: dict | None = None, *,
           verified: bool = False) -> LatestResult:
    """The newest committed checkpoint under ``root`` (``url`` None when there is none).

    >>> import pathlib, tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for s in (100, 200):
    ...     (root / f"step-{s}").mkdir()
    ...     save_file({"w": np.zeros(2)}, str(root / f"step-{s}" / "model.safetensors"))
    >>> _ = (root / "step-300").mkdir(), (root / "step-300" / ".ckptctl-writing").write_text("{}")
    >>> latest(str(root)).name, latest(str(root), verified=True).name
    ('step-200', 'step-200')
    >>> latest(tempfile.mkdtemp()).url is None
    True
    """
    listing = ls(root, storage_options, check="auto")
    rows = listing.checkpoints
    rejected: list[dict] = []
    tried: set[str] = set()
    while True:
        row = next((r for r in committed_newest_first(rows) if r.name not in tried), None)
        if row is None:
            return LatestResult(listing.root, None, rejected=rejected)
        if not row.exact:  # from the listing alone: read it (and the next few) for real
            rows = _confirm_newest(rows, tried, storage_options)
            continue
        tried.add(row.name)
        if verified:
            from ..integrity.verify import verify

            r = verify(row.url, storage_options, level="full", located=row.located,
                       uploads=False)
            errors = [p for p in r.problems if p.severity == "error"]
            if errors:
                p = errors[0]
                rejected.append({"url": row.url, "code": p.code, "message": p.message,
                                 "path": p.path})
                continue
        folder, _, leaf = row.name.rpartition("/")
        disagrees = [p for p in listing.pointers
                     if p["file"].rpartition("/")[0] == folder and p["names"] != leaf]
        tie = tie_break(row, [r for r in committed_newest_first(rows) if r.name not in tried])
        return LatestResult(listing.root, row.url, row.name, row.step, row.state, rejected,
                            disagrees, tie)


#: Provisional candidates ``latest`` reads at once (in parallel): the newest one is nearly
#: always the answer, a few more cover a damaged newest without another round trip each.
CONFIRM_AHEAD = 2


def _confirm_newest(rows: list[CheckpointRow], tried: set[str],
                    storage_options: dict | None) -> list[CheckpointRow]:
    """``rows`` with the newest few provisional committed candidates read for real."""
    todo = {r.name for r in committed_newest_first(rows)
            if r.name not in tried and not r.exact}
    pick = [r.name for r in committed_newest_first(rows) if r.name in todo][:CONFIRM_AHEAD]
    idx = [i for i, r in enumerate(rows) if r.name in pick]
    fresh = confirm([rows[i] for i in idx], storage_options)
    out = list(rows)
    for i, r in zip(idx, fresh):
        out[i] = r
    return out
