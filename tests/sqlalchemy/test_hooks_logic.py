"""The session hooks' bookkeeping, apart from any session or database:
grouping wake-ups into one pg_notify batch per connection and channel, and
choosing what a rollback drops and what a commit may send."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from belay_sqlalchemy.hooks import Wakeup, batches, boundary, ready_at, surviving

CONNS = [object(), object()]
root = SimpleNamespace(nested=False, parent=None)
savepoint = SimpleNamespace(nested=True, parent=root)
flush = SimpleNamespace(nested=False, parent=savepoint)  # a flush's subtransaction
deeper = SimpleNamespace(nested=True, parent=savepoint)


def wakeup(scope: tuple[Any, ...], conn: int = 0, channel: str = "c",
           payloads: tuple[bytes, ...] = (b"p",)) -> Wakeup:
    return Wakeup(scope, CONNS[conn], channel, payloads)  # type: ignore[arg-type]


wakeups = st.lists(st.builds(
    wakeup,
    scope=st.just((root,)),
    conn=st.integers(0, 1),
    channel=st.sampled_from(["a", "b"]),
    payloads=st.lists(st.sampled_from([b"1", b"2", b"3"]), max_size=3).map(tuple),
))


@given(wakeups)
def test_batches_send_each_payload_once_per_connection_and_channel(queued) -> None:
    sent = batches(queued)
    keys = [(id(conn), channel) for conn, channel, _ in sent]
    assert len(keys) == len(set(keys))
    assert all(len(payloads) == len(set(payloads)) for _, _, payloads in sent)
    assert {(id(c), ch, p) for c, ch, ps in sent for p in ps} == {
        (id(w.conn), w.channel, p) for w in queued for p in w.payloads}


def test_batches_keep_the_order_things_were_queued_in() -> None:
    queued = [wakeup((root,), payloads=(b"2",)), wakeup((root,), 1, "x"),
              wakeup((root,), payloads=(b"1", b"2"))]
    assert [(CONNS.index(c), ch, ps) for c, ch, ps in batches(queued)] == [
        (0, "c", [b"2", b"1"]), (1, "x", [b"p"])]


def test_a_rollback_undoes_the_nearest_savepoint_or_the_root() -> None:
    assert boundary(flush) is savepoint  # type: ignore[arg-type]
    assert boundary(deeper) is deeper  # type: ignore[arg-type]
    assert boundary(root) is root  # type: ignore[arg-type]


def test_a_rolled_back_savepoint_drops_what_was_queued_inside_it() -> None:
    outer, inner, innermost = (wakeup((root,)), wakeup((savepoint, root)),
                               wakeup((deeper, savepoint, root)))
    assert surviving([outer, inner, innermost], savepoint) == [outer]
    assert surviving([outer, inner, innermost], deeper) == [outer, inner]
    assert surviving([outer, inner, innermost], root) == []


def test_a_release_sends_what_was_queued_at_its_parents_level_or_inside() -> None:
    outer, inner, innermost = (wakeup((root,)), wakeup((savepoint, root)),
                               wakeup((deeper, savepoint, root)))
    # Releasing `deeper` leaves its notifications at `savepoint`'s level.
    assert ready_at([outer, inner, innermost], savepoint) == ([inner, innermost], [outer])
    assert ready_at([outer, inner, innermost], root) == ([outer, inner, innermost], [])
