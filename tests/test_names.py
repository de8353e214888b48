"""Reserved names and lock keys (contract §§5.2, 7, 8.4, 9.2); pure."""

from __future__ import annotations

from belay import names


def test_channel_is_belay_plus_the_sanitized_database_name():
    assert names.notify_channel("app_prod") == "belay_app_prod"
    assert names.notify_channel("my-app.db") == "belay_my_app_db"


def test_channel_sanitizes_bytes_as_the_reference_does():
    # "é" is two bytes in UTF-8: the reference's byte regex makes each one "_".
    assert names.notify_channel("café") == "belay_caf__"


def test_channel_is_cut_to_postgres_identifier_length():
    channel = names.notify_channel("x" * 100)
    assert len(channel.encode()) == 63 and channel.startswith("belay_x")


def test_scopes_locks_and_keys():
    assert names.job_scope(42) == "job:42"
    assert names.workflow_scope("nightly") == "wf:nightly"
    assert names.signal_lock("job:42") == "belay_sig:job:42"
    assert names.workflow_lock("nightly") == "belay_wf:nightly"
    assert names.queue_lock("ai") == "belay:ai"
    assert names.spawn_key(7, "chunks", 3) == "$spawn:7:chunks:3"
    assert names.window_key("digest", 7_199, 3_600) == "digest@1"
    assert names.window_key("digest", 7_200, 3_600) == "digest@2"
