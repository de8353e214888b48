"""Django adapter for belay (enqueue inside ``transaction.atomic``, migrations,
``manage.py belay_worker``). Arrives with its own issue; the core works without it."""
