"""Google Cloud Storage and Azure Blob when the server hangs, refuses or is not there, and
when credentials are missing: one line naming the place, exit 3, no credential printed,
and within the request budget (``--timeout``), not gcsfs's or obstore's own retry
budgets (bounded here by a generous subprocess timeout, never asserted as a time).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from s3server import SilentServer

KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BOUND_S = 300  # a hang, not a time the test expects: loaded machines are slow


def _ckptctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("AZURE_", "STORAGE_EMULATOR", "GOOGLE_"))}
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True,
                          text=True, timeout=BOUND_S, env={**clean, **env})


def _azure(endpoint: str, key: str = KEY) -> dict:
    return {"AZURE_STORAGE_CONNECTION_STRING":
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};"
            f"BlobEndpoint={endpoint}/devstoreaccount1;"}


@pytest.mark.parametrize("cloud", ["gs", "az"])
def test_a_server_that_never_answers_fails_in_one_line(cloud):
    with SilentServer() as silent:
        env = ({"STORAGE_EMULATOR_HOST": silent.endpoint_url} if cloud == "gs"
               else _azure(silent.endpoint_url))
        p = _ckptctl("--timeout", "3", "ls", f"{cloud}://bkt/run", env=env)
    assert p.returncode == 3, p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"ckptctl: error: {cloud}://bkt/run: ")
    assert "timed out" in line or "unreachable" in line, line
    assert KEY not in p.stdout + p.stderr


@pytest.mark.parametrize("cloud", ["gs", "az"])
def test_a_closed_port_is_unreachable_in_one_line(cloud):
    with SilentServer() as silent:  # a port that was free a moment ago
        url = silent.endpoint_url
    env = {"STORAGE_EMULATOR_HOST": url} if cloud == "gs" else _azure(url)
    p = _ckptctl("--timeout", "3", "ls", f"{cloud}://bkt/run", env=env)
    assert p.returncode == 3, p.stderr
    assert p.stderr.count("\n") == 1 and "unreachable" in p.stderr, p.stderr
    assert KEY not in p.stdout + p.stderr


def test_no_azure_account_names_the_variables_to_set():
    p = _ckptctl("ls", "az://c/run", env={})
    assert p.returncode == 3
    assert p.stderr.strip() == (
        "ckptctl: error: no Azure account: set AZURE_STORAGE_CONNECTION_STRING, or "
        "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or -o account_name=... "
        "-o account_key=...)")


def test_a_wrong_azure_key_is_access_denied_and_never_printed(az_container):
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS1mb3ItY2twdGN0bA=="
    env = _azure(az_container.server.endpoint.rsplit("/", 1)[0], key=wrong)
    p = _ckptctl("ls", az_container.url("run"), env=env)
    assert p.returncode == 3
    assert "access denied" in p.stderr and "AZURE_STORAGE_CONNECTION_STRING" in p.stderr
    assert wrong not in p.stdout + p.stderr and KEY not in p.stdout + p.stderr


def test_an_unknown_azure_storage_option_is_a_usage_error():
    p = _ckptctl("ls", "az://c/run", "-o", "acount_name=x", env={})
    assert p.returncode == 2
    assert "unknown storage option 'acount_name'" in p.stderr
