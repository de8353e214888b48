"""The Django admin for belay: read-mostly views of jobs, with actions.

Jobs list with filters by queue, state and kind; a job's page shows its
input, result, errors, step journal (with costs) and event stream. Nothing is
edited in place: the retry, cancel and signal actions go through the belay
client (fenced, settled, with wake-ups), never through ``save()``.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html

from belay.errors import BelayError, NotRetryable
from belay_django.models import Event, Job, Step


def _pretty(value: Any) -> str:
    shown: str = format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True,
                                                         default=repr, ensure_ascii=False))
    return shown


def _usd(micros: int | None) -> str:
    return "—" if micros is None else f"${micros / 1_000_000:.4f}"


class _ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class StepInline(_ReadOnlyInline):
    model = Step
    fields = ("seq", "name", "value_shown", "cost", "tokens", "inserted_at")
    readonly_fields = fields
    verbose_name_plural = "step journal"

    @admin.display(description="value")
    def value_shown(self, step: Step) -> str:
        return _pretty(step.decoded_value)

    @admin.display(description="cost (USD)")
    def cost(self, step: Step) -> str:
        return _usd(step.usd_micros)


class EventInline(_ReadOnlyInline):
    model = Event
    fields = ("seq", "payload_shown", "inserted_at")
    readonly_fields = fields
    verbose_name_plural = "events"

    @admin.display(description="payload")
    def payload_shown(self, event: Event) -> str:
        return _pretty(event.payload)


class SignalForm(forms.Form):
    name = forms.CharField(help_text="the signal name the job awaits (ctx.await_signal)")
    payload = forms.JSONField(initial=dict, required=False,
                              help_text='a JSON object, e.g. {"approved": true}')

    def clean_payload(self) -> dict[str, Any]:
        payload = self.cleaned_data.get("payload")
        if payload in (None, ""):
            return {}
        if not isinstance(payload, dict):
            raise forms.ValidationError("the payload is a JSON object")
        return payload


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "queue", "state", "attempts", "priority", "ready_at",
                    "inserted_at", "finished_at", "spent")
    list_filter = ("queue", "state", "kind")
    search_fields = ("=id", "kind", "unique_key", "workflow_id", "cron_name")
    list_per_page = 50
    show_full_result_count = False  # a count over a big belay_jobs is slow
    actions = ("retry_jobs", "cancel_jobs", "signal_jobs")
    inlines = (StepInline, EventInline)
    fieldsets = (
        (None, {"fields": ("id", "kind", "queue", "state", "attempts", "priority",
                           "cancel_requested")}),
        ("Data", {"fields": ("input_shown", "meta_shown", "result_shown", "errors_shown")}),
        ("Timing", {"fields": ("inserted_at", "ready_at", "started_at", "finished_at",
                               "lease_until", "leased_by")}),
        ("Spend", {"fields": ("spent", "budget")}),
        ("Relations", {"fields": ("parent_id", "workflow_id", "wf_name", "wf_deps",
                                  "await_scope", "await_name", "cron_name", "cron_slot",
                                  "unique_key", "unique_mode", "partition_key")}),
    )
    readonly_fields = ("id", "kind", "queue", "state", "attempts", "priority",
                       "cancel_requested", "input_shown", "meta_shown", "result_shown",
                       "errors_shown", "inserted_at", "ready_at", "started_at", "finished_at",
                       "lease_until", "leased_by", "spent", "budget", "parent_id",
                       "workflow_id", "wf_name", "wf_deps", "await_scope", "await_name",
                       "cron_name", "cron_slot", "unique_key", "unique_mode", "partition_key")

    # Read-mostly: the change page only shows; the actions act.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The actions need "change" on the list; a job's own page is view-only.
        return obj is None and super().has_change_permission(request, obj)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        # The list never needs the (possibly large) payload columns.
        queryset = super().get_queryset(request)
        view = getattr(request.resolver_match, "url_name", None) or ""
        if view.endswith("changelist"):
            queryset = queryset.defer("input", "meta", "result", "errors")
        return queryset

    @admin.display(description="attempts")
    def attempts(self, job: Job) -> str:
        return f"{job.attempt}/{job.max_attempts}"

    @admin.display(description="spent")
    def spent(self, job: Job) -> str:
        return f"{_usd(job.spent_usd_micros)}, {job.spent_tokens} tokens"

    @admin.display(description="budget")
    def budget(self, job: Job) -> str:
        tokens = "no token limit" if job.budget_tokens is None else f"{job.budget_tokens} tokens"
        return f"{_usd(job.budget_usd_micros)}, {tokens}"

    @admin.display(description="input")
    def input_shown(self, job: Job) -> str:
        return _pretty(job.input)

    @admin.display(description="meta")
    def meta_shown(self, job: Job) -> str:
        return _pretty(job.meta)

    @admin.display(description="result")
    def result_shown(self, job: Job) -> str:
        return _pretty(job.decoded_result)

    @admin.display(description="errors")
    def errors_shown(self, job: Job) -> str:
        return _pretty(job.errors)

    # -- Actions (through the belay client) ------------------------------------------

    @admin.action(description="Retry the selected failed or cancelled jobs",
                  permissions=("change",))
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        from belay_django.adapter import client

        retried, refused = [], []
        for job_id in queryset.values_list("id", flat=True):
            try:
                client().retry_job(job_id)
                retried.append(job_id)
            except NotRetryable as exc:
                refused.append(f"{job_id} ({exc})")
        if retried:
            self.message_user(request, f"Retried {len(retried)} job(s): "
                              f"{', '.join(map(str, retried))}.", messages.SUCCESS)
        if refused:
            self.message_user(request, f"Not retried: {'; '.join(refused)}.", messages.WARNING)

    @admin.action(description="Cancel the selected jobs", permissions=("change",))
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        from belay_django.adapter import client

        outcomes: dict[str, list[int]] = {}
        for job_id in queryset.values_list("id", flat=True):
            outcomes.setdefault(client().cancel_job(job_id), []).append(job_id)
        wording = {"cancelled": "Cancelled", "requested": "Cancel requested (running; it "
                   "stops at its next step)", "noop": "Already finished, left as is"}
        for status, ids in outcomes.items():
            self.message_user(
                request, f"{wording[status]}: {', '.join(map(str, ids))}.",
                messages.WARNING if status == "noop" else messages.SUCCESS)

    @admin.action(description="Send a signal to the selected jobs…", permissions=("change",))
    def signal_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        from belay_django.adapter import client

        form = SignalForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            name, payload = form.cleaned_data["name"], form.cleaned_data["payload"]
            woken: list[int] = []
            ids = list(queryset.values_list("id", flat=True))
            try:
                for job_id in ids:
                    woken += client().signal_job(job_id, name, payload)
            except BelayError as exc:
                self.message_user(request, f"Signal not sent: {exc}", messages.ERROR)
                return None
            self.message_user(
                request, f"Signal {name!r} delivered to {len(ids)} job(s); woke "
                f"{', '.join(map(str, woken)) or 'none (a job takes it when it awaits)'}.",
                messages.SUCCESS)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Send a signal",
            "opts": self.model._meta,
            "form": form,
            "jobs": queryset,
            "action": "signal_jobs",
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/belay_django/job/signal.html", context)
