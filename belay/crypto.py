"""Encrypted job input, as the reference writes it (extra ``crypto``).

An encrypted input is the JSON object ``{"$enc": base64(iv ‖ tag ‖ ciphertext)}``:
AES-256-GCM over the input's JSON, a 12-byte IV, a 16-byte tag, additional
data ``belay.input.v1``. Either implementation can decrypt what the other
wrote, given the same 32-byte key.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from typing import Any

from belay.codec import dumps_object, loads
from belay.errors import ConfigurationError

AAD = b"belay.input.v1"
MARKER = "$enc"


class DecryptionError(Exception):
    """An encrypted input could not be decrypted (no key, wrong key, damaged)."""


def parse_key(key: bytes | str | None) -> bytes | None:
    """A 32-byte key, given raw or as base64 or hex text."""
    if key is None:
        return None
    if isinstance(key, str):
        text = key.strip()
        try:
            key = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            raise ConfigurationError(
                "encryption_key must be 32 bytes, or 64 hex digits, or base64 of 32 bytes"
            ) from None
    if not isinstance(key, bytes) or len(key) != 32:
        raise ConfigurationError("encryption_key must be 32 bytes long (AES-256)")
    return key


def _aesgcm(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigurationError(
            "encrypted input needs the 'crypto' extra: pip install 'belay[crypto]'"
        ) from None
    return AESGCM(key)


def is_encrypted(value: Any) -> bool:
    return isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get(MARKER), str)


def encrypt_input(value: Mapping[str, Any], key: bytes | None) -> dict[str, str]:
    if key is None:
        raise ConfigurationError(
            "encrypt=True needs an encryption key: belay.Belay(url, encryption_key=…)"
        )
    plaintext = dumps_object(value, what="input")
    iv = os.urandom(12)
    sealed = _aesgcm(key).encrypt(iv, plaintext, AAD)  # ciphertext ‖ tag
    ciphertext, tag = sealed[:-16], sealed[-16:]
    return {MARKER: base64.b64encode(iv + tag + ciphertext).decode()}


def decrypt_input(value: Mapping[str, Any], key: bytes | None) -> Any:
    if key is None:
        raise DecryptionError("the job's input is encrypted but no encryption key is configured")
    try:
        raw = base64.b64decode(value[MARKER], validate=True)
    except (ValueError, binascii.Error):
        raise DecryptionError("the encrypted input is not valid base64") from None
    if len(raw) < 28:
        raise DecryptionError("the encrypted input is too short to hold an IV and a tag")
    iv, tag, ciphertext = raw[:12], raw[12:28], raw[28:]
    try:
        plaintext = _aesgcm(key).decrypt(iv, ciphertext + tag, AAD)
    except Exception:  # cryptography's InvalidTag: the key or the data is wrong
        raise DecryptionError("decrypting the input failed: wrong key, or damaged data") from None
    return loads(plaintext)
