"""The tier config ``ckptctl.toml``: named places, hottest first (DESIGN.md, "Storage and
tiers"), and ``TIER:`` / ``TIER:NAME`` anywhere a URL is taken.

Pure: reads one TOML file (stdlib ``tomllib``), touches no storage.

>>> cfg = loads('''
... [[tier]]
... name = "hot"
... url = "/nvme/run1"
... keep = { last = 2 }
... [[tier]]
... name = "cold"
... url = "s3://bucket/run1"
... storage_options = { endpoint_url = "http://127.0.0.1:9000", secret = "s3cr3t" }
... ''', "ckptctl.toml")
>>> [t.name for t in cfg.tiers], cfg.next_tier("hot").name
(['hot', 'cold'], 'cold')
>>> resolve("cold:step-100", config=cfg).url
's3://bucket/run1/step-100'
>>> mask_secrets(cfg.tier("cold").storage_options)
{'endpoint_url': 'http://127.0.0.1:9000', 'secret': '***'}
"""
from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field

from ..errors import UsageError

#: The file looked for in the working directory when neither --config nor
#: ``$CKPTCTL_CONFIG`` names one.
CONFIG_NAME = "ckptctl.toml"
CONFIG_ENV = "CKPTCTL_CONFIG"

TIER_KEYS = ("name", "url", "storage_options", "keep", "bwlimit", "pack", "max_chain")
#: A pack tier's longest delta chain unless its ``max_chain`` says otherwise
#: (:data:`ckptctl.formats.pack.DEFAULT_MAX_CHAIN`; a reader follows at most 64).
DEFAULT_MAX_CHAIN = 8
MAX_CHAIN_LIMIT = 64
KEEP_KEYS = ("last", "every", "within", "hourly", "daily", "tags")
_NAME = re.compile(r"[a-z0-9_-]+\Z")
#: ``TIER:`` or ``TIER:NAME``; a URL (``s3://``) and a Windows path (``C:\\x``, ``c:/x``)
#: never match (see :func:`tier_reference`).
_REF = re.compile(r"([a-z0-9_-]+):(.*)\Z", re.S)
_WINDOWS = re.compile(r"[A-Za-z]:[\\/]")

#: Storage option names whose values are secrets (exact, lower case) ...
SECRET_KEYS = frozenset({"key", "secret", "token", "password", "passwd", "session_token"})
#: ... and parts of names that make any option a secret.
SECRET_PARTS = ("secret", "token", "password", "passwd", "credential", "access_key",
                "private_key")
MASK = "***"


@dataclass(frozen=True)
class Tier:
    """One place of the config: where (``url``, ``storage_options``), what to keep
    (``keep``: gc's policy words, None keeps everything), how fast (``bwlimit`` in bytes/s,
    None: unlimited), whether it stores packs, and a pack's longest delta chain there
    (``max_chain``: a hop that would go deeper gets a full pack; 0: every pack full)."""

    name: str
    url: str
    storage_options: dict = field(default_factory=dict)
    keep: dict | None = None
    bwlimit: float | None = None
    pack: bool = False
    max_chain: int = DEFAULT_MAX_CHAIN


@dataclass(frozen=True)
class Config:
    """The tiers of one config file, hottest first (``path`` None: no config)."""

    path: str | None
    tiers: tuple[Tier, ...] = ()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; a UsageError listing the known ones else.

        >>> Config("c.toml", (Tier("hot", "/a"),)).tier("warm")
        Traceback (most recent call last):
        ckptctl.errors.UsageError: unknown tier 'warm' (c.toml defines: hot)
        """
        for t in self.tiers:
            if t.name == name:
                return t
        if self.path is None:
            raise UsageError(f"unknown tier {name!r}: no tier config (pass --config FILE, set "
                             f"{CONFIG_ENV} or create ./{CONFIG_NAME})")
        raise UsageError(f"unknown tier {name!r} ({self.path} defines: "
                         f"{', '.join(self.names) or 'no tiers'})")

    def next_tier(self, name: str) -> Tier | None:
        """The tier after ``name`` (the next colder one), None for the last.

        >>> c = Config("c.toml", (Tier("hot", "/a"), Tier("cold", "/b")))
        >>> c.next_tier("hot").name, c.next_tier("cold")
        ('cold', None)
        """
        i = self.names.index(self.tier(name).name)
        return self.tiers[i + 1] if i + 1 < len(self.tiers) else None


@dataclass(frozen=True)
class Place:
    """Where a verb goes: a URL and its storage options, and the tier it came from (None
    for a plain URL or path)."""

    url: str
    storage_options: dict = field(default_factory=dict)
    tier: Tier | None = None


def find_config(explicit: str | None = None) -> str | None:
    """The config file to use: ``explicit`` (--config), else ``$CKPTCTL_CONFIG``, else
    ``./ckptctl.toml`` when there is one; None when there is none. A file named by
    --config or the variable must exist (UsageError).

    >>> find_config("/no/such/tiers.toml")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: /no/such/tiers.toml: config file not found (--config)
    """
    if explicit:
        return _existing(explicit, "--config")
    env = os.environ.get(CONFIG_ENV)
    if env:
        return _existing(env, f"${CONFIG_ENV}")
    return CONFIG_NAME if os.path.isfile(CONFIG_NAME) else None


def _existing(path: str, source: str) -> str:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        what = "is not a file" if os.path.exists(path) else "config file not found"
        raise UsageError(f"{what} ({source})", path)
    return path


def load_config(path: str | None) -> Config:
    """Read and check the config at ``path`` (None: no config, no tiers). Anything wrong
    is a UsageError (exit 2) of one line naming the file, the tier and the key.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp(), "ckptctl.toml")
    >>> _ = f.write_text('[[tier]]\\nname = "hot"\\nurl = "/nvme"\\nkeep = { lats = 2 }\\n')
    >>> load_config(str(f))                     # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.UsageError: /tmp/.../ckptctl.toml: tier 'hot': keep: unknown key 'lats' (known: last, every, within, hourly, daily, tags)
    >>> load_config(None)
    Config(path=None, tiers=())
    """
    if path is None:
        return Config(None)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read the config ({e.strerror or type(e).__name__})",
                         path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("not UTF-8 text", path) from None
    return loads(text, path, base=os.path.dirname(os.path.abspath(path)))


def loads(text: str, path: str = CONFIG_NAME, *, base: str | None = None) -> Config:
    """:func:`load_config` of TOML ``text`` (``path`` names it in errors; relative local
    tier URLs are taken relative to ``base``, default the working directory).

    >>> loads('[[tier]]\\nname = "Hot"\\nurl = "/x"\\n', "t.toml")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: t.toml: tier 1: name 'Hot' must be lower-case letters, digits, '-' or '_'
    """
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"not valid TOML ({e})", path) from None
    unknown = [k for k in doc if k != "tier"]
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r} (a config holds [[tier]] tables only)",
                         path)
    raw = doc.get("tier")
    if raw is None:
        raise UsageError("no tiers (define [[tier]] tables with a name and a url)", path)
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise UsageError("tier must be an array of tables ([[tier]])", path)
    tiers: list[Tier] = []
    for i, t in enumerate(raw):
        tier = _tier(t, i, path, base)
        if any(x.name == tier.name for x in tiers):
            raise UsageError(f"tier {tier.name!r} is defined twice", path)
        tiers.append(tier)
    return Config(path, tuple(tiers))


def _tier(t: dict, i: int, path: str, base: str | None) -> Tier:
    name = t.get("name")
    where = f"tier {name!r}" if isinstance(name, str) and _NAME.match(name) else f"tier {i + 1}"

    def bad(message: str) -> UsageError:
        return UsageError(f"{where}: {message}", path)

    for key in t:
        if key not in TIER_KEYS:
            raise bad(f"unknown key {key!r} (known: {', '.join(TIER_KEYS)})")
    if name is None:
        raise bad("name is required")
    if not isinstance(name, str) or not _NAME.match(name):
        shown = repr(name) if isinstance(name, str) else f"of type {type(name).__name__}"
        raise bad(f"name {shown} must be lower-case letters, digits, '-' or '_'")
    url = t.get("url")
    if url is None:
        raise bad("url is required")
    if not isinstance(url, str) or not url.strip():
        raise bad("url must be a non-empty string")
    url = _tier_url(url.strip(), base, bad)
    opts = t.get("storage_options", {})
    if not isinstance(opts, dict):
        raise bad("storage_options must be a table (storage_options = { endpoint_url = ... })")
    keep = t.get("keep")
    if keep is not None:
        keep = _keep(keep, bad)
    bwlimit = t.get("bwlimit")
    if bwlimit is not None:
        bwlimit = _bwlimit(bwlimit, bad)
    pack = t.get("pack", False)
    if not isinstance(pack, bool):
        raise bad("pack must be true or false")
    max_chain = t.get("max_chain", DEFAULT_MAX_CHAIN)
    if isinstance(max_chain, bool) or not isinstance(max_chain, int) \
            or not 0 <= max_chain <= MAX_CHAIN_LIMIT:
        raise bad(f"max_chain must be a whole number from 0 to {MAX_CHAIN_LIMIT} (the longest "
                  f"chain of delta packs; default {DEFAULT_MAX_CHAIN}), not {max_chain!r}")
    return Tier(name, url, dict(opts), keep, bwlimit, pack, max_chain)


def _tier_url(url: str, base: str | None, bad) -> str:
    """A local tier URL made absolute (``~`` expanded, relative to the config's folder);
    a remote one checked for a bucket."""
    from ..storage import split_url

    if "://" in url:
        try:
            split_url(url)
        except UsageError as e:
            raise bad(f"url: {e.message}") from None
        return url.rstrip("/") or url
    url = os.path.expanduser(url)
    if not os.path.isabs(url):
        url = os.path.join(base or os.getcwd(), url)
    return os.path.normpath(url)


def _keep(keep, bad) -> dict:
    if not isinstance(keep, dict):
        raise bad("keep must be a table (keep = { last = 3 })")
    for key in keep:
        if key not in KEEP_KEYS:
            raise bad(f"keep: unknown key {key!r} (known: {', '.join(KEEP_KEYS)})")
    if not keep:
        raise bad("keep is empty (omit it to keep everything)")
    from .policy import Policy

    try:
        Policy.from_dict(dict(keep))
    except UsageError as e:
        raise bad(e.message if e.message.startswith("keep") else f"keep: {e.message}") from None
    return dict(keep)


def _bwlimit(value, bad) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad("bwlimit must be a rate such as \"200MiB/s\"")
    from ..storage.ratelimit import parse_rate

    try:
        return parse_rate(value)
    except (UsageError, ValueError, TypeError) as e:
        raise bad(f"bwlimit: {getattr(e, 'message', None) or e}") from None


def tier_reference(text: str) -> tuple[str, str] | None:
    """(tier, name) when ``text`` reads ``TIER:`` or ``TIER:NAME``, else None: URLs,
    paths and Windows-looking paths are never tier references.

    >>> tier_reference("warm:"), tier_reference("warm:run1/step-100")
    (('warm', ''), ('warm', 'run1/step-100'))
    >>> tier_reference("s3://b/x"), tier_reference("/x"), tier_reference("C:\\\\x"), tier_reference("c:/x")
    (None, None, None, None)
    """
    if _WINDOWS.match(text):
        return None
    m = _REF.match(text)
    if m is None or m.group(2).startswith("//"):
        return None
    return m.group(1), m.group(2)


def resolve(text: str, *, config: Config | None, options: dict | None = None) -> Place:
    """The place ``text`` names: ``TIER:`` is the tier's root, ``TIER:NAME`` the checkpoint
    (or folder) NAME under it; anything else is a URL or path, kept as is. ``options``
    (the command line's) win over the tier's storage options, key by key (nested tables
    such as ``config_kwargs`` merged key by key too).

    >>> cfg = Config("c.toml", (Tier("warm", "s3://b/run", {"endpoint_url": "http://a:1",
    ...                                                       "key": "k"}),))
    >>> p = resolve("warm:step-7", config=cfg, options={"endpoint_url": "http://b:2"})
    >>> p.url, p.storage_options, p.tier.name
    ('s3://b/run/step-7', {'endpoint_url': 'http://b:2', 'key': 'k'}, 'warm')
    >>> resolve("/data/step-7", config=cfg).url
    '/data/step-7'
    >>> resolve("cold:", config=cfg)
    Traceback (most recent call last):
    ckptctl.errors.UsageError: unknown tier 'cold' (c.toml defines: warm)
    """
    options = dict(options or {})
    ref = tier_reference(text)
    if ref is None:
        return Place(text, options, None)
    name, rel = ref
    config = config or Config(None)
    if name not in config.names and os.path.exists(text):
        return Place(text, options, None)  # a local file that happens to hold a colon
    tier = config.tier(name)
    return Place(_join(tier.url, rel, text), merge_options(tier.storage_options, options), tier)


def _join(root: str, rel: str, text: str) -> str:
    if not rel.strip("/") or rel == ".":
        return root
    norm = posixpath.normpath(rel)
    if (rel.startswith("/") or "\\" in rel or "\x00" in rel or norm == ".."
            or norm.startswith("../")):
        raise UsageError(f"{text!r}: the name after the tier must stay under the tier's root "
                         f"(TIER:NAME, e.g. {text.split(':', 1)[0]}:step-100)")
    return root.rstrip("/") + "/" + norm if root != "/" else "/" + norm


def merge_options(low: dict | None, high: dict | None) -> dict:
    """``high`` over ``low``, key by key; nested tables are merged the same way.

    >>> merge_options({"endpoint_url": "a", "config_kwargs": {"read_timeout": 5, "x": 1}},
    ...               {"config_kwargs": {"read_timeout": 300}})
    {'endpoint_url': 'a', 'config_kwargs': {'read_timeout': 300, 'x': 1}}
    """
    out = dict(low or {})
    for k, v in (high or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_options(out[k], v)
        else:
            out[k] = v
    return out


def is_secret(key: str) -> bool:
    """Whether a storage option called ``key`` holds a secret.

    >>> [k for k in ("key", "secret", "aws_session_token", "db_password", "endpoint_url",
    ...              "max_concurrency") if is_secret(k)]
    ['key', 'secret', 'aws_session_token', 'db_password']
    """
    k = str(key).lower()
    return k in SECRET_KEYS or k.endswith("_key") or any(p in k for p in SECRET_PARTS)


_USERINFO = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*):[^/@\s]*@")


def mask_secrets(options: dict) -> dict:
    """A copy of ``options`` fit to show: secret values (see :func:`is_secret`), at any
    depth, and passwords inside URLs replaced by ``***``.

    >>> mask_secrets({"key": "AKIA123", "client_kwargs": {"aws_secret_access_key": "x"},
    ...               "endpoint_url": "http://u:pw@host:9000"})
    {'key': '***', 'client_kwargs': {'aws_secret_access_key': '***'}, 'endpoint_url': 'http://u:***@host:9000'}
    """
    out: dict = {}
    for k, v in (options or {}).items():
        if is_secret(k) and not isinstance(v, dict):
            out[k] = MASK
        elif isinstance(v, dict):
            out[k] = mask_secrets(v)
        elif isinstance(v, list):
            out[k] = [mask_secrets(x) if isinstance(x, dict) else _mask_text(x) for x in v]
        else:
            out[k] = _mask_text(v)
    return out


def _mask_text(v):
    return _USERINFO.sub(lambda m: m.group("head") + ":" + MASK + "@", v) \
        if isinstance(v, str) else v


def secret_values(options: dict) -> list[str]:
    """Every secret string in ``options`` (to scrub from messages).

    >>> secret_values({"key": "AKIA123", "n": 1, "client_kwargs": {"token": "tok"}})
    ['AKIA123', 'tok']
    """
    found: list[str] = []
    for k, v in (options or {}).items():
        if isinstance(v, dict):
            found += secret_values(v)
        elif is_secret(k) and isinstance(v, str) and v:
            found.append(v)
    return found
