"""The shop's belay workers: `manage.py belay_worker` imports this module."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

import belay
from shop.models import Order


@belay.worker(queue="mailers", max_attempts=5)
def send_receipt(ctx: belay.Context) -> Any:
    order = Order.objects.get(pk=ctx.input["order_id"])
    # … hand the e-mail to your mail provider here …
    order.receipt_sent_at = timezone.now()
    order.save(update_fields=["receipt_sent_at"])
    return {"receipt_for": order.email, "total_cents": order.total_cents}
