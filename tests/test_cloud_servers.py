"""The loopback GCS and Azure Blob servers (cloudservers.py, fixtures_cloud.py): round trips,
ranges, paging, and what each does with conditional writes -- the product's exclusive
creates rely on them, and each emulator differs from its cloud somewhere."""

from __future__ import annotations

import json
import os
import socket
from urllib.parse import quote, urlencode

import pytest

import cloudservers

# -------------------------------------------------------------------------- the fixtures


@pytest.fixture(params=["gcs", "azure"])
def store(request):
    return request.getfixturevalue("gcs_bucket" if request.param == "gcs" else "az_container")


def test_fresh_bucket_is_empty_and_env_is_set(store):
    assert store.list() == {}
    assert store.env and all(os.environ[k] == v for k, v in store.env.items())
    scheme = "gs" if isinstance(store.server, cloudservers.GcsServer) else "az"
    name = store.name
    assert store.url() == f"{scheme}://{name}" and store.url("/a/b/") == f"{scheme}://{name}/a/b"
    assert 3 <= len(name) <= 63 and name == name.lower()
    assert all(c.isalnum() or c == "-" for c in name)


def test_put_get_list_delete(store):
    store.put("run1/step-10/a.bin", b"0123456789")
    store.put("run1/step-10/sub dir/ü+%.txt", b"")  # awkward names survive the round trip
    store.put("run2/x", b"xy")
    assert store.get("run1/step-10/a.bin") == b"0123456789"
    assert store.get("run1/step-10/sub dir/ü+%.txt") == b""
    assert store.list() == {"run1/step-10/a.bin": 10, "run1/step-10/sub dir/ü+%.txt": 0, "run2/x": 2}
    assert store.list("run1/") == {"run1/step-10/a.bin": 10, "run1/step-10/sub dir/ü+%.txt": 0}
    store.put("run2/x", b"overwritten")
    assert store.get("run2/x") == b"overwritten"
    store.delete("run2/x")
    assert store.list("run2/") == {}
    with pytest.raises(cloudservers.CloudServerError) as e:
        store.get("run2/x")
    assert e.value.status == 404


def test_upload_keeps_relative_paths(store, tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "a.txt").write_bytes(b"a")
    (tmp_path / ".hidden").write_bytes(b"hh")
    (tmp_path / "d" / "e" / "f.bin").write_bytes(b"fff")
    keys = store.upload(tmp_path, "/ckpt/step-1/")
    assert sorted(keys) == ["ckpt/step-1/.hidden", "ckpt/step-1/a.txt", "ckpt/step-1/d/e/f.bin"]
    assert store.list("ckpt/") == {"ckpt/step-1/.hidden": 2, "ckpt/step-1/a.txt": 1,
                                   "ckpt/step-1/d/e/f.bin": 3}
    assert store.upload(tmp_path / "d") == ["e/f.bin"]


def test_list_follows_pages(store, monkeypatch):
    monkeypatch.setattr(cloudservers, "PAGE", 2)
    for i in range(5):
        store.put(f"p/{i}", b"x" * i)
    store.put("q", b"")
    assert store.list("p/") == {f"p/{i}": i for i in range(5)}


def test_ranged_read_gcs(gcs_bucket):
    gcs_bucket.put("r", b"0123456789")
    path = f"/storage/v1/b/{gcs_bucket.bucket}/o/r?alt=media"
    status, headers, body = gcs_bucket.server.request("GET", path, headers={"Range": "bytes=2-5"})
    assert (status, body, headers["content-range"]) == (206, b"2345", "bytes 2-5/10")
    assert gcs_bucket.server.get(gcs_bucket.bucket, "r", range=(2, 5)) == b"2345"


def test_ranged_read_azure(az_container):
    az_container.put("r", b"0123456789")
    srv = az_container.server
    status, headers, body = srv.request("GET", az_container.container, "r",
                                        headers={"Range": "bytes=2-5"})
    assert (status, body, headers["content-range"]) == (206, b"2345", "bytes 2-5/10")
    assert srv.get(az_container.container, "r", range=(2, 5)) == b"2345"


@pytest.mark.parametrize("start", [cloudservers.start_fake_gcs, cloudservers.start_azurite])
def test_a_server_stops_by_pid(start):
    """A server of its own (not the session's): stop() ends the process and forgets it."""
    srv = start()
    assert srv in cloudservers._RUNNING and os.path.exists(f"/proc/{srv.pid}")
    srv.stop()
    assert srv not in cloudservers._RUNNING and srv._proc.returncode is not None
    assert not srv.log_path.parent.exists()


@pytest.mark.parametrize("start", [cloudservers.start_fake_gcs, cloudservers.start_azurite])
def test_a_taken_port_is_retried_with_another(start, monkeypatch):
    """The port picked was taken before the server bound it: the server exits, and is
    started again on a new port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused at once
        ports = [taken.getsockname()[1]]
        real = cloudservers.free_port
        monkeypatch.setattr(cloudservers, "free_port", lambda: ports.pop() if ports else real())
        srv = start()
        try:
            assert srv.port != taken.getsockname()[1]
            assert srv.log_path.name == "server-1.log"
            assert "in use" in (srv.log_path.parent / "server-0.log").read_text().lower()
        finally:
            srv.stop()


# --------------------------------------------------- conditional writes: fake-gcs-server


def _media(bucket, key: str, data: bytes, **cond) -> int:
    q = urlencode({"uploadType": "media", "name": key, **cond})
    return bucket.server.request("POST", f"/upload/storage/v1/b/{bucket.bucket}/o?{q}", data)[0]


def _multipart(bucket, key: str, data: bytes, **cond) -> int:
    """An upload the way gcsfs sends small files (``uploadType=multipart``)."""
    body = (b"--==0==\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            + json.dumps({"name": key}).encode()
            + b"\r\n--==0==\r\nContent-Type: application/octet-stream\r\n\r\n"
            + data + b"\r\n--==0==--")
    q = urlencode({"uploadType": "multipart", **cond})
    return bucket.server.request("POST", f"/upload/storage/v1/b/{bucket.bucket}/o?{q}", body,
                                 {"Content-Type": 'multipart/related; boundary="==0=="'})[0]


def _generation(bucket, key: str) -> str:
    return bucket.server.stat(bucket.bucket, key)["generation"]


def test_gcs_multipart_upload_honours_if_generation_match(gcs_bucket):
    assert _multipart(gcs_bucket, "k", b"one", ifGenerationMatch="0") == 200  # new object
    assert _multipart(gcs_bucket, "k", b"two", ifGenerationMatch="0") == 412  # exists
    assert gcs_bucket.get("k") == b"one"
    gen = _generation(gcs_bucket, "k")
    assert _multipart(gcs_bucket, "k", b"three", ifGenerationMatch=gen) == 200
    assert _multipart(gcs_bucket, "k", b"four", ifGenerationMatch=gen) == 412  # stale
    assert gcs_bucket.get("k") == b"three"


def test_gcs_media_upload_ignores_if_generation_match(gcs_bucket):
    assert _media(gcs_bucket, "k", b"one", ifGenerationMatch="0") == 200  # new object
    # fake-gcs-server ignores preconditions on media uploads (real GCS: 412)
    assert _media(gcs_bucket, "k", b"two", ifGenerationMatch="0") == 200
    assert gcs_bucket.get("k") == b"two"
    gen = _generation(gcs_bucket, "k")
    assert _media(gcs_bucket, "k", b"three", ifGenerationMatch=gen) == 200
    # fake-gcs-server: a stale generation is not checked either (real GCS: 412)
    assert _media(gcs_bucket, "k", b"four", ifGenerationMatch=gen) == 200
    assert gcs_bucket.get("k") == b"four"


def test_gcs_resumable_upload_ignores_if_generation_match(gcs_bucket):
    gcs_bucket.put("k", b"one")
    q = urlencode({"uploadType": "resumable", "name": "k", "ifGenerationMatch": "0"})
    status, headers, _ = gcs_bucket.server.request(
        "POST", f"/upload/storage/v1/b/{gcs_bucket.bucket}/o?{q}", json.dumps({"name": "k"}).encode(),
        {"Content-Type": "application/json"})
    assert status == 200
    session = headers["location"].split("127.0.0.1:", 1)[1]
    session = session[session.index("/"):]
    # fake-gcs-server drops the precondition of a resumable upload (real GCS: 412)
    assert gcs_bucket.server.request("PUT", session, b"two")[0] == 200
    assert gcs_bucket.get("k") == b"two"


# ----------------------------------------------------------------- conditional writes: Azurite

_BLOCK = {"x-ms-blob-type": "BlockBlob"}


def _put(container, blob: str, data: bytes, **headers):
    status, h, _ = container.server.request("PUT", container.container, blob, body=data,
                                            headers={**_BLOCK, **headers})
    return status, h.get("x-ms-error-code")


def test_azurite_put_blob_if_none_match_star(az_container):
    assert _put(az_container, "b", b"one", **{"If-None-Match": "*"}) == (201, None)
    assert _put(az_container, "b", b"two", **{"If-None-Match": "*"}) == (409, "BlobAlreadyExists")
    assert az_container.get("b") == b"one"


def test_azurite_put_blob_if_match(az_container):
    etag = az_container.put("b", b"one")
    assert _put(az_container, "b", b"two", **{"If-Match": etag}) == (201, None)
    assert _put(az_container, "b", b"three", **{"If-Match": etag}) == (412, "ConditionNotMet")
    assert az_container.get("b") == b"two"
    assert _put(az_container, "new", b"x", **{"If-Match": etag}) == (412, "ConditionNotMet")
    assert az_container.list() == {"b": 3}


def test_azurite_put_block_list_if_none_match_star(az_container):
    """A blob written in blocks (large uploads) commits with Put Block List: same rule."""
    srv, c = az_container.server, az_container.container
    block = "YjA="  # base64("b0")
    commit = f'<?xml version="1.0" encoding="utf-8"?><BlockList><Latest>{block}</Latest></BlockList>'
    for name in ("old", "new"):
        assert srv.request("PUT", c, name, query={"comp": "block", "blockid": block},
                           body=b"blk")[0] == 201
    az_container.put("old", b"one")
    for name, want in (("old", 409), ("new", 201)):
        status, _, _ = srv.request("PUT", c, name, query={"comp": "blocklist"}, body=commit.encode(),
                                   headers={"If-None-Match": "*"})
        assert status == want
    assert az_container.get("old") == b"one" and az_container.get("new") == b"blk"


def test_azure_names_need_quoting(az_container):
    """Blob names are sent percent-encoded in the path (the signature covers that form)."""
    name = "a b/c?d#e&f=g"
    az_container.put(name, b"z")
    assert az_container.list() == {name: 1} and az_container.get(name) == b"z"
    assert quote(name, safe="/~") in az_container.server._path(az_container.container, name)
