"""Encrypted input (reference interop): {"$enc": base64(iv ‖ tag ‖ ciphertext)}, AES-256-GCM."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

import belay
from belay.crypto import DecryptionError, decrypt_input, encrypt_input, is_encrypted, parse_key
from belay.testing import drain
from tests.helpers import job_row

VECTOR = json.loads((Path(__file__).parent / "fixtures" / "enc" / "vector.json").read_text())
KEY = bytes.fromhex(VECTOR["key_hex"])


def test_decrypts_what_erlang_crypto_encrypted():
    """The vector was made by OTP's crypto exactly as the reference's encrypt_input does."""
    assert decrypt_input({"$enc": VECTOR["enc"]}, KEY) == json.loads(VECTOR["plaintext"])


def test_round_trip_and_layout():
    sealed = encrypt_input({"user_id": 42, "note": "héllo"}, KEY)
    assert list(sealed) == ["$enc"] and is_encrypted(sealed)
    raw = base64.b64decode(sealed["$enc"])
    assert len(raw) == 12 + 16 + len(b'{"user_id":42,"note":"h\xc3\xa9llo"}')
    assert decrypt_input(sealed, KEY) == {"user_id": 42, "note": "héllo"}
    assert encrypt_input({"a": 1}, KEY) != encrypt_input({"a": 1}, KEY)  # a fresh IV each time


@pytest.mark.parametrize(("key", "value", "message"), [
    (None, {"$enc": VECTOR["enc"]}, "no encryption key"),
    (b"\x00" * 32, {"$enc": VECTOR["enc"]}, "wrong key"),
    (KEY, {"$enc": "!!not base64!!"}, "base64"),
    (KEY, {"$enc": base64.b64encode(b"short").decode()}, "too short"),
])
def test_decryption_failures_are_clear(key, value, message):
    with pytest.raises(DecryptionError, match=message):
        decrypt_input(value, key)


@pytest.mark.parametrize("key", [KEY, KEY.hex(), base64.b64encode(KEY).decode()])
def test_keys_as_bytes_hex_or_base64(key):
    assert parse_key(key) == KEY


@pytest.mark.parametrize("key", [b"short", "zz" * 32, "not base64 !", b"\x00" * 31])
def test_bad_keys_are_refused(key):
    with pytest.raises(belay.ConfigurationError, match="32 bytes"):
        parse_key(key)


@pytest.fixture
def registry() -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name="t.secret", registry=reg)
    def secret(ctx: belay.Context) -> Any:
        return ctx.input

    @belay.worker(name="t.always_secret", encrypted=True, registry=reg)
    def always_secret(ctx: belay.Context) -> Any:
        return ctx.input["card"]

    return reg


def test_encrypted_enqueue_stores_only_ciphertext_and_the_worker_sees_plaintext(
    db_url, clock, registry, sql_conn
):
    with belay.Belay(db_url, clock=clock, registry=registry, encryption_key=KEY) as client:
        job = client.enqueue("t.secret", {"card": "4242"}, encrypt=True)
        stored = job_row(sql_conn, job.id)["input"]
        assert is_encrypted(stored) and "4242" not in json.dumps(stored)
        assert drain(client=client, registry=registry) == {"succeeded": 1}
        assert client.get_job(job.id).result == {"card": "4242"}


def test_an_encrypted_worker_encrypts_every_enqueue(db_url, clock, registry, sql_conn):
    with belay.Belay(db_url, clock=clock, registry=registry, encryption_key=KEY) as client:
        job = client.enqueue("t.always_secret", {"card": "4242"})
        assert is_encrypted(job_row(sql_conn, job.id)["input"])
        drain(client=client, registry=registry)
        assert client.get_job(job.id).result == "4242"


def test_encrypting_without_a_key_is_refused_before_anything_is_written(client, sql_conn):
    with pytest.raises(belay.ConfigurationError, match="encryption_key"):
        client.enqueue("t.secret", {"card": "4242"}, encrypt=True)
    assert sql_conn.execute("SELECT count(*) FROM belay_jobs").fetchone() == (0,)


@pytest.mark.parametrize("worker_key", [None, b"\x07" * 32], ids=["no key", "wrong key"])
def test_a_worker_that_cannot_decrypt_keeps_the_job(db_url, clock, registry, sql_conn,
                                                    worker_key):
    with belay.Belay(db_url, clock=clock, registry=registry, encryption_key=KEY) as producer:
        job = producer.enqueue("t.secret", {"card": "4242"}, encrypt=True)
    with belay.Belay(db_url, clock=clock, registry=registry,
                     encryption_key=worker_key) as keyless:
        assert drain(client=keyless, registry=registry) == {"snooze": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])
    assert is_encrypted(row["input"])  # untouched: the right worker runs it later
