"""Dead, frozen and silent S3 servers, and write-side failures (issue 7, items 11 and 13).

Every case runs the real CLI in a fresh interpreter against a real server on loopback
(``rclone serve s3``; moto where its behaviour differs) that is killed (SIGKILL), frozen
(SIGSTOP) or replaced by a socket that accepts and never answers, before or in the middle
of the command (the test proxy's ``fault_on`` hook fires on a chosen request). Each must
exit 3 with one line on stderr naming the place and the cause, no traceback, within a
generous multiple of the ``--timeout`` it was given. Write-side: a missing destination
bucket and a full local file system (a small tmpfs) are one line, exit 3.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_tiny_dcp
from s3server import SilentServer, make_bucket, start_rclone, upload_dir

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 3  # --timeout given to every command here
BOUND = 5 * TIMEOUT + 10  # wall-clock bound per command: generous, never flaky
BUCKET = "bkt"
CKPT = "run/step-42"


@pytest.fixture(autouse=True)
def _fresh_breaker():
    from ckptctl.storage.failures import forget_dead_servers

    forget_dead_servers()
    yield
    forget_dead_servers()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("faults") / "step-42"
    write_tiny_dcp(p)
    return p


@pytest.fixture
def server(tmp_path, tiny):
    """A private rclone server (this test may kill or freeze it) holding ``tiny`` at
    ``s3://bkt/run/step-42``."""
    srv = start_rclone(tmp_path / "s3root")
    try:
        make_bucket(srv, BUCKET)
        upload_dir(srv, tiny, f"{BUCKET}/{CKPT}")
        srv.reset_log()
        yield srv
    finally:
        srv.thaw()  # never leave a stopped process behind
        srv.stop()


def ckptctl(args: list[str], endpoint: str, *, timeout: float | None = TIMEOUT,
            env: dict | None = None) -> tuple[int, float, str]:
    """Run ``ckptctl [--timeout T] ARGS`` in a fresh interpreter against ``endpoint``:
    (exit code, wall seconds, stderr)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("AWS_", "CKPTCTL_"))}
    base |= {"AWS_ACCESS_KEY_ID": "ckptctl-test-key",
             "AWS_SECRET_ACCESS_KEY": "ckptctl-test-secret",
             "AWS_EC2_METADATA_DISABLED": "true",
             "AWS_ENDPOINT_URL": endpoint}
    base |= env or {}
    argv = [sys.executable, "-m", "ckptctl"]
    argv += ["--timeout", str(timeout)] if timeout is not None else []
    t0 = time.monotonic()
    r = subprocess.run(argv + args, cwd=ROOT, env=base, capture_output=True, text=True,
                       timeout=600)
    return r.returncode, time.monotonic() - t0, r.stderr


def assert_one_line(rc: int, seconds: float, err: str, *needles: str,
                    bound: float = BOUND) -> str:
    """Exit 3, one line on stderr that holds every needle, no traceback, in time."""
    lines = err.strip().splitlines()
    assert rc == 3, err
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("ckptctl: error: "), line
    assert "Traceback" not in err and "internal error" not in line, line
    for needle in needles:
        assert needle in line, line
    assert seconds < bound, f"took {seconds:.1f} s (bound {bound} s): {line}"
    return line


TIMED_OUT = f"timed out after {TIMEOUT:g} s"
REFUSED = "remote unreachable (connection refused)"
URL = f"s3://{BUCKET}/{CKPT}"
READS = {
    "inspect": ["inspect", URL],
    "ls": ["ls", f"s3://{BUCKET}/run"],
    "verify": ["verify", "--level", "full", URL],
}


def _data_get(r) -> bool:
    return r.op == "GET" and r.key.endswith(".distcp")


def _data_put(r) -> bool:
    return r.method in ("PUT", "POST") and (r.key.endswith((".distcp", ".safetensors", ".pt")))


# ------------------------------------------------------------------ options (unit)

def test_s3_options_carry_timeouts_and_user_options_win(monkeypatch):
    from ckptctl.storage.filesystems import (s3fs_options, make_filesystem, request_timeout,
                                             s3_budget, set_timeout)

    o = s3fs_options({}, timeout=60)
    cfg = o["config_kwargs"]
    assert (cfg["connect_timeout"], cfg["read_timeout"]) == (10.0, 20.0)
    assert cfg["retries"] == {"total_max_attempts": 3, "mode": "standard"}
    assert o["retries"] == 1
    assert cfg["response_checksum_validation"] == "when_required"

    o = s3fs_options({"config_kwargs": {"read_timeout": 300, "retries": {"max_attempts": 9}},
                     "retries": 7}, timeout=9)
    assert o["config_kwargs"]["read_timeout"] == 300
    assert o["config_kwargs"]["connect_timeout"] == 3.0  # ours where the user said nothing
    assert o["config_kwargs"]["retries"] == {"max_attempts": 9}
    assert o["retries"] == 7

    # the filesystem really carries them; s3fs's own retries go on the instance (the
    # constructor would hand them to aiobotocore, which refuses them)
    fs = make_filesystem("s3", {"endpoint_url": "http://127.0.0.1:9", "retries": 5,
                                "config_kwargs": {"read_timeout": 300}})
    assert fs.retries == 5 and fs.config_kwargs["read_timeout"] == 300
    assert fs.config_kwargs["retries"] == {"total_max_attempts": 3, "mode": "standard"}
    assert s3_budget(fs) == 300 * 3 * 5

    monkeypatch.setenv("CKPTCTL_TIMEOUT", "12")
    set_timeout(None)
    assert request_timeout() == 12
    fs = make_filesystem("s3", {"endpoint_url": "http://127.0.0.1:9"})
    assert fs.config_kwargs["read_timeout"] == 4.0 and fs.retries == 1
    assert s3_budget(fs) == 12
    set_timeout(4)
    assert request_timeout() == 4
    set_timeout(None)
    monkeypatch.delenv("CKPTCTL_TIMEOUT")
    assert request_timeout() == 60


def test_timeout_flag_is_validated_and_global(tmp_path):
    rc, _, err = ckptctl(["ls", str(tmp_path)], "http://127.0.0.1:9", timeout=0)
    assert rc == 2 and "--timeout must be a positive number" in err
    rc, _, err = ckptctl(["ls", str(tmp_path)], "http://127.0.0.1:9", timeout=None,
                         env={"CKPTCTL_TIMEOUT": "-1"})
    assert rc == 2 and "--timeout" in err
    # accepted after the command too, like --debug
    rc, _, err = ckptctl(["ls", str(tmp_path), "--timeout", "5"], "http://127.0.0.1:9",
                         timeout=None)
    assert rc == 0, err


# ------------------------------------------------------------------ error words (unit)

def _client_error(code: str, status: int):
    """A botocore ClientError as the server would send it, translated the way s3fs does."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    e = ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                     "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return translate_boto_error(e)


@pytest.mark.parametrize("make, words, code", [
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "no space left on device",
     "IO_ERROR"),
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded", "IO_ERROR"),
    (lambda: OSError(errno.EROFS, "Read-only file system"), "read-only file system",
     "IO_ERROR"),
    (lambda: _client_error("NoSuchBucket", 404), "no such bucket", "MISSING_FILE"),
    (lambda: _client_error("NoSuchKey", 404), "not found", "MISSING_FILE"),
    (lambda: _client_error("AccessDenied", 403), "access denied (AccessDenied", "IO_ERROR"),
    (lambda: _client_error("SignatureDoesNotMatch", 403), "access denied (wrong secret key",
     "IO_ERROR"),
    (lambda: _client_error("SlowDown", 503), "throttling requests (SlowDown)",
     "REMOTE_TIMEOUT"),
    (lambda: _client_error("InternalError", 500), "server error (InternalError)", "IO_ERROR"),
    (lambda: _client_error("WeirdNewCode", 400), "refused by the server (WeirdNewCode)",
     "IO_ERROR"),
])
def test_storage_error_words(make, words, code):
    from ckptctl.errors import CkptError
    from ckptctl.storage.failures import storage_error

    e = storage_error("s3://b/x/model.safetensors", make(), remote=True, budget=60)
    assert isinstance(e, CkptError) and e.exit_code == 3
    assert str(e).startswith("s3://b/x/model.safetensors: ") and words in str(e), str(e)
    assert e.code == code


def test_storage_error_words_for_network_failures():
    import asyncio

    from botocore.exceptions import (ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, ReadTimeoutError)

    from ckptctl.storage.failures import storage_error

    url = "http://127.0.0.1:9/b/x"
    cases = [
        (ReadTimeoutError(endpoint_url=url, error=asyncio.TimeoutError()),
         "timed out after 60 s"),
        (asyncio.TimeoutError(), "timed out after 60 s"),
        (ConnectTimeoutError(endpoint_url=url, error=TimeoutError()),
         "remote unreachable (connect timed out after 60 s)"),
        (EndpointConnectionError(endpoint_url=url,
                                 error=ConnectionRefusedError(errno.ECONNREFUSED, "refused")),
         "remote unreachable (connection refused)"),
        (ConnectionClosedError(endpoint_url=url), "connection closed by the server"),
    ]
    for exc, words in cases:
        e = storage_error("s3://b/x", exc, remote=True, budget=60)
        assert str(e) == f"s3://b/x: {words}" or words in str(e), str(e)
        assert e.code in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE")


def test_storage_error_never_shows_a_secret():
    from ckptctl.storage.failures import storage_error

    secret = "SuperSecretValue1234"
    e = storage_error("s3://b/x", RuntimeError(f"signing failed with {secret}"),
                      remote=True, secrets=[secret])
    assert secret not in str(e) and "***" in str(e) and "RuntimeError" in str(e)


# ------------------------------------------------------------------ reads: dead servers

@pytest.mark.parametrize("cmd", sorted(READS))
def test_read_server_killed_before(server, cmd):
    server.kill()
    rc, t, err = ckptctl(READS[cmd], server.endpoint_url)
    assert_one_line(rc, t, err, REFUSED, "s3://bkt/run")


@pytest.mark.parametrize("cmd", sorted(READS))
def test_read_server_frozen(server, cmd):
    with server.frozen():  # SIGSTOP: the kernel still accepts, nothing answers
        rc, t, err = ckptctl(READS[cmd], server.direct_endpoint_url)
    assert_one_line(rc, t, err, TIMED_OUT, "s3://bkt/run")


@pytest.mark.parametrize("cmd", sorted(READS))
def test_read_silent_socket(cmd):
    with SilentServer() as silent:
        rc, t, err = ckptctl(READS[cmd], silent.endpoint_url)
        assert silent.accepted >= 1
    assert_one_line(rc, t, err, TIMED_OUT, "s3://bkt/run")


@pytest.mark.slow
def test_default_timeout_bounds_a_silent_server():
    """No ``--timeout``: the default budget (60 s) holds (this took 423 s before)."""
    with SilentServer() as silent:
        rc, t, err = ckptctl(READS["inspect"], silent.endpoint_url, timeout=None)
    assert_one_line(rc, t, err, "timed out after 60 s", URL, bound=90)


@pytest.mark.parametrize("action, words", [("kill", "remote unreachable"),
                                           ("freeze", TIMED_OUT)])
def test_verify_full_server_dies_mid_read(server, action, words):
    """The server goes away at the first data GET: an I/O failure, not a finding."""
    fired = server.fault_on(_data_get, action)
    rc, t, err = ckptctl(READS["verify"], server.endpoint_url)
    assert fired.is_set()
    line = assert_one_line(rc, t, err, words, ".distcp")
    assert "MISSING" not in line and "CORRUPT" not in line


def test_consolidate_from_s3_server_killed_mid_read(server, tmp_path):
    fired = server.fault_on(_data_get, "kill")
    rc, t, err = ckptctl(["consolidate", "--only", "model", URL, str(tmp_path / "out")],
                         server.endpoint_url)
    assert fired.is_set()
    assert_one_line(rc, t, err, "remote unreachable", ".distcp")


# ------------------------------------------------------------------ writes to S3

WRITES = {
    "consolidate": lambda src, dst: ["consolidate", "--only", "model", str(src), dst],
    "reshard": lambda src, dst: ["reshard", "--world-size", "2", str(src), dst],
}


@pytest.mark.parametrize("cmd", sorted(WRITES))
@pytest.mark.parametrize("action, words", [("kill", "remote unreachable"),
                                           ("freeze", TIMED_OUT)])
def test_write_server_dies_mid_upload(server, tiny, cmd, action, words):
    fired = server.fault_on(_data_put, action)
    rc, t, err = ckptctl(WRITES[cmd](tiny, f"s3://{BUCKET}/out"), server.endpoint_url)
    assert fired.is_set()
    assert_one_line(rc, t, err, words, f"s3://{BUCKET}/out/")


@pytest.mark.parametrize("cmd", sorted(WRITES))
def test_write_to_silent_socket(tiny, cmd):
    with SilentServer() as silent:
        rc, t, err = ckptctl(WRITES[cmd](tiny, f"s3://{BUCKET}/out"), silent.endpoint_url)
    assert_one_line(rc, t, err, TIMED_OUT, f"s3://{BUCKET}/out")


@pytest.mark.parametrize("cmd", sorted(WRITES))
def test_write_to_missing_bucket(server, tiny, cmd):
    rc, t, err = ckptctl(WRITES[cmd](tiny, "s3://no-such-bucket/out"), server.endpoint_url)
    assert_one_line(rc, t, err, "s3://no-such-bucket/out/", "no such bucket")


def test_write_to_missing_bucket_moto(moto_s3, tiny):
    rc, t, err = ckptctl(WRITES["consolidate"](tiny, "s3://no-such-bucket/out"),
                         moto_s3.endpoint_url)
    assert_one_line(rc, t, err, "s3://no-such-bucket/out/", "no such bucket")


def test_wrong_secret_is_one_line_without_the_secret(server):
    secret = "not-the-secret-7Hq2"
    rc, t, err = ckptctl(READS["inspect"], server.endpoint_url,
                         env={"AWS_SECRET_ACCESS_KEY": secret})
    assert_one_line(rc, t, err, "access denied")
    assert secret not in err


# ------------------------------------------------------------------ Store.open (library)

def test_store_write_atomic_and_open_to_missing_bucket(s3_bucket):
    from ckptctl.errors import NotFoundError
    from ckptctl.storage import open_store

    st = open_store("s3://no-such-bucket-x/p", s3_bucket.storage_options)
    with pytest.raises(NotFoundError, match=r"^s3://no-such-bucket-x/p/a\.json: no such bucket$"):
        st.write_atomic("a.json", b"{}")
    with pytest.raises(NotFoundError, match=r"^s3://no-such-bucket-x/p/b\.bin: no such bucket$"):
        with st.open("b.bin", "wb") as f:
            f.write(b"x" * 1000)


def test_abandoned_s3_write_publishes_nothing(moto_bucket):
    """Leaving ``with store.open(..., "wb")`` by an exception aborts the upload (a
    multipart one too) instead of completing a partial object."""
    from ckptctl.storage import open_store

    st = open_store(moto_bucket.url("p"), moto_bucket.storage_options)
    for size in (1000, 11 << 20):  # one-shot PUT; multipart (5 MiB parts)
        with pytest.raises(RuntimeError, match="writer failed"):
            with st.open(f"f{size}.bin", "wb", block_size=5 << 20) as f:
                f.write(os.urandom(size))
                raise RuntimeError("writer failed")
        assert not st.exists(f"f{size}.bin")
    uploads = st.fs.call_s3("list_multipart_uploads", Bucket=moto_bucket.bucket)
    assert not uploads.get("Uploads")
    with st.open("ok.bin", "wb") as f:  # and the normal path still publishes
        assert f.write(b"abc") == 3
    assert st.read("ok.bin") == b"abc"


# ------------------------------------------------------------------ a full local disk

@pytest.fixture
def small_fs(small_tmpfs):
    """A 512 KiB tmpfs."""
    return small_tmpfs("512k")


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory) -> Path:
    """A DCP checkpoint holding 2 MiB of tensor data (more than the small tmpfs)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    p = tmp_path_factory.mktemp("big") / "step-7"
    g = torch.Generator().manual_seed(7)
    sd = {"model": {"w": torch.randn(512, 1024, generator=g)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(p))
    return p


def test_store_write_no_space_left(small_fs):
    from ckptctl.errors import StorageError
    from ckptctl.storage import open_store

    st = open_store(str(small_fs))
    with pytest.raises(StorageError) as e:
        with st.open("big.bin", "wb") as f:
            for _ in range(8):
                f.write(b"\0" * (128 << 10))
    assert str(e.value) == f"{small_fs}/big.bin: no space left on device"
    with pytest.raises(StorageError, match="no space left on device$"):
        st.write_atomic("big2.bin", b"\0" * (1 << 20))


@pytest.mark.parametrize("cmd", ["consolidate", "consolidate-torch", "reshard"])
def test_cli_write_no_space_left(small_fs, big_dcp, cmd):
    dst = small_fs / "out"
    args = {"consolidate": ["consolidate", str(big_dcp), str(dst)],
            "consolidate-torch": ["consolidate", "--to", "torch", str(big_dcp), str(dst)],
            "reshard": ["reshard", "--world-size", "2", str(big_dcp), str(dst)]}[cmd]
    rc, t, err = ckptctl(args, "http://127.0.0.1:9")
    assert_one_line(rc, t, err, str(small_fs), "no space left on device")
