"""The shared rate limiter (``--bwlimit``) and the retry loop of the transfer layer.

Timing is proven on a fake clock (``clock``/``sleep`` injected): exact and fast. One test
runs real threads on the real clock, with bounds generous enough never to flake.
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from ckptctl.errors import CkptError, NotFoundError, StorageError, UsageError
from ckptctl.storage import RateLimiter, is_transient, parse_rate, with_retries
from ckptctl.storage.failures import storage_error

MIB = 1 << 20


class FakeClock:
    """A clock that moves only when someone sleeps."""

    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


# ------------------------------------------------------------------ parse_rate
@pytest.mark.parametrize("text, want", [
    ("200MiB/s", 200 * MIB), ("200MiB", 200 * MIB), ("100M", 100 * MIB), ("100m/s", 100 * MIB),
    ("1.5GB/s", 1.5e9), ("1.5GB", 1.5e9), ("2GiB/s", 2 << 30), ("500KB/s", 500e3),
    ("64KiB", 64 << 10), ("1T", 1 << 40), ("1e6", 1e6), ("123", 123.0), ("0.5MB/s", 5e5),
    (" 10 MiB/s ", 10 * MIB), (1e6, 1e6), (42, 42.0),
    ("0", None), ("off", None), ("OFF", None), ("", None), (None, None), (0, None),
])
def test_parse_rate(text, want):
    assert parse_rate(text) == want


@pytest.mark.parametrize("text", ["fast", "10 MiB per second", "-5MB/s", "1.2.3M", "MiB",
                                  "10Mbit/s", "5 GiB/min", "nan", "inf"])
def test_parse_rate_refuses(text):
    with pytest.raises(UsageError) as e:
        parse_rate(text)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


# ------------------------------------------------------------------ the bucket
def test_no_limit_never_waits():
    c = FakeClock()
    lim = RateLimiter(None, clock=c.clock, sleep=c.sleep)
    for _ in range(1000):
        lim.acquire(1 << 30)
    assert c.slept == [] and lim.rate is None


def test_default_burst():
    assert RateLimiter(200 * MIB).burst == 50 * MIB  # a quarter second
    assert RateLimiter(1 * MIB).burst == MIB  # at least 1 MiB
    assert RateLimiter(100, burst=10).burst == 10


def test_refuses_a_rate_that_is_not_positive():
    for bad in (0, -1.0):
        with pytest.raises(UsageError):
            RateLimiter(bad)


def test_a_request_bigger_than_the_burst_passes_after_its_debt():
    c = FakeClock()
    lim = RateLimiter(10 * MIB, burst=MIB, clock=c.clock, sleep=c.sleep)
    lim.acquire(64 * MIB)  # 64x the burst: goes, and pays 63 MiB of debt
    assert c.now == pytest.approx(6.3)
    lim.acquire(MIB)  # the bucket is empty now: waits a full MiB's worth
    assert c.now == pytest.approx(6.4)


def test_long_run_rate_and_every_10s_window_within_10_percent():
    """Random part sizes (4 KiB .. 64 MiB, many above the burst) from a sender that goes as
    fast as it is let: the bytes granted in any 10 s window stay within rate * 10 s + burst
    + one request (the first grant in the window paid its debt before the window began),
    within 10% of the rate, and the run as a whole is within 1% of the rate."""
    c = FakeClock()
    rate = 200 * MIB
    lim = RateLimiter(rate, clock=c.clock, sleep=c.sleep)
    rng = random.Random(1)
    grants: list[tuple[float, int]] = []
    while c.now < 120:
        n = rng.choice([4 << 10, MIB, 8 * MIB, 64 * MIB])
        lim.acquire(n)
        grants.append((c.now, n))
        c.now += rng.random() * 0.01  # the send itself takes a little
    total = sum(n for _, n in grants)
    assert total / c.now == pytest.approx(rate, rel=0.01)
    times = [t for t, _ in grants]
    sizes = [n for _, n in grants]
    j = 0
    window = 0
    for i, t in enumerate(times):  # every window that starts at a grant
        while j < len(times) and times[j] < t + 10:
            window += sizes[j]
            j += 1
        assert window <= rate * 10 + lim.burst + max(sizes)
        assert window <= rate * 10 * 1.10
        if times[-1] >= t + 10:  # a full window: not starved either
            assert window >= rate * 10 * 0.90
        window -= sizes[i]


def test_idle_time_refills_only_up_to_the_burst():
    c = FakeClock()
    lim = RateLimiter(MIB, burst=MIB, clock=c.clock, sleep=c.sleep)
    lim.acquire(MIB)
    c.now += 3600  # an hour idle
    lim.acquire(MIB)  # from the (full) bucket
    assert c.slept == []
    lim.acquire(2 * MIB)  # and no more than the burst was saved up
    assert c.slept == [pytest.approx(2.0)]


def test_threads_share_one_bucket_and_are_served_in_order():
    """Eight threads ask at the same instant (the clock stands still): each is charged in
    turn, so the waits are 1, 2, ... 8 units of debt — none skips the queue, none is
    charged twice."""
    waits: list[float] = []
    lock = threading.Lock()

    def sleep(s):
        with lock:
            waits.append(s)

    lim = RateLimiter(MIB, burst=MIB, clock=lambda: 0.0, sleep=sleep)
    start = threading.Barrier(8)

    def worker():
        start.wait()
        lim.acquire(MIB)

    threads = [threading.Thread(target=worker) for _ in range(9 - 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(waits) == [pytest.approx(k) for k in range(1, 8)]  # the first: the burst


def test_real_threads_real_clock():
    """4 threads push 24 MiB in 256 KiB pieces at 16 MiB/s: the first 4 MiB come from the
    burst, the rest takes 1.25 s. Generous bounds: the machine may be busy."""
    lim = RateLimiter(16 * MIB, burst=4 * MIB)
    t0 = time.monotonic()

    def worker():
        for _ in range(24):
            lim.acquire(256 << 10)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 10


# ------------------------------------------------------------------ retries
class _Resp(Exception):
    """An error carrying an S3 answer, like botocore's ClientError."""

    def __init__(self, code: str, status: int):
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize("error, transient", [
    (ConnectionResetError(), True), (BrokenPipeError(), True), (TimeoutError(), True),
    (ConnectionRefusedError(), True), (_Resp("SlowDown", 503), True),
    (_Resp("InternalError", 500), True), (_Resp("", 502), True), (_Resp("Throttling", 400), True),
    (_Resp("NoSuchKey", 404), False), (_Resp("AccessDenied", 403), False),
    (FileNotFoundError(), False), (PermissionError(), False), (ValueError("bad"), False),
    (OSError(28, "No space left on device"), False),
])
def test_is_transient_raw(error, transient):
    assert is_transient(error) is transient


def test_is_transient_follows_the_cause():
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        assert is_transient(e)


def _mapped(exc: BaseException) -> CkptError:
    return storage_error("s3://b/x", exc, remote=True, budget=60)


@pytest.mark.parametrize("error, transient", [
    (TimeoutError(), True), (ConnectionRefusedError(), True), (ConnectionResetError(), True),
    (_Resp("SlowDown", 503), True), (_Resp("InternalError", 500), True),
    (_Resp("RequestTimeout", 400), True),
    (_Resp("NoSuchKey", 404), False), (_Resp("AccessDenied", 403), False),
    (_Resp("InvalidPart", 400), False), (OSError(28, "No space"), False),
])
def test_is_transient_for_a_store_error(error, transient):
    err = _mapped(error)
    assert isinstance(err, CkptError) and is_transient(err) is transient


def test_an_error_the_circuit_breaker_raises_is_not_retried(s3_bucket):
    """After a server was found dead, the store fails at once without asking it: retrying
    that would spin until the breaker clears."""
    from ckptctl.storage import open_store
    from ckptctl.storage.failures import forget_dead_servers, mark_dead

    st = open_store(s3_bucket.url("p"), s3_bucket.storage_options)
    mark_dead(st._server(), "timed out after 3 s", "REMOTE_TIMEOUT", 60)
    calls = []
    try:
        with pytest.raises(StorageError, match="timed out") as e:
            with_retries(lambda: calls.append(1) or st.read("x"), sleep=lambda s: None)
    finally:
        forget_dead_servers()
    assert len(calls) == 1 and not is_transient(e.value)
    assert is_transient(StorageError("s3://b/x", "timed out", code="REMOTE_TIMEOUT"))


def test_with_retries_backs_off_with_full_jitter():
    calls, slept, seen = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset")
        return 42

    got = with_retries(flaky, attempts=5, base=0.5, cap=1.5, sleep=slept.append,
                       on_retry=lambda k, e, d: seen.append((k, type(e).__name__, d)))
    assert got == 42 and len(calls) == 4
    assert [k for k, _, _ in seen] == [1, 2, 3] and slept == [d for _, _, d in seen]
    for k, d in zip((1, 2, 3), slept):
        assert 0 <= d <= min(1.5, 0.5 * 2 ** (k - 1))


def test_with_retries_jitter_spreads_the_waits():
    delays = []
    for _ in range(200):
        with pytest.raises(TimeoutError):
            with_retries(lambda: (_ for _ in ()).throw(TimeoutError()), attempts=2, base=1.0,
                         sleep=delays.append)
    assert len(delays) == 200 and all(0 <= d <= 1.0 for d in delays)
    assert min(delays) < 0.1 and max(delays) > 0.9  # full jitter: the whole range is used


def test_with_retries_gives_up_after_the_attempts_with_the_last_error():
    errors = iter([ConnectionResetError("1"), ConnectionResetError("2"), TimeoutError("3")])

    def fail():
        raise next(errors)

    slept = []
    with pytest.raises(TimeoutError, match="3"):
        with_retries(fail, attempts=3, sleep=slept.append)
    assert len(slept) == 2


def test_with_retries_raises_a_permanent_error_at_once():
    calls = []

    def missing():
        calls.append(1)
        raise NotFoundError("s3://b/x", "not found")

    with pytest.raises(NotFoundError):
        with_retries(missing, sleep=lambda s: pytest.fail("must not sleep"))
    assert calls == [1]


def test_with_retries_never_swallows_an_interrupt():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with_retries(interrupted, sleep=lambda s: pytest.fail("must not sleep"))
    with pytest.raises(ValueError):
        with_retries(lambda: 1, attempts=0)
