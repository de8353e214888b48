from __future__ import annotations

from django.db import models


class Order(models.Model):
    email = models.EmailField()
    total_cents = models.IntegerField()
    receipt_sent_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} for {self.email}"
