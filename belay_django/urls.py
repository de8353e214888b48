"""The belay dashboard's URLs: ``path("belay/", include("belay_django.urls"))``.

See :mod:`belay_django.dashboard` for who may see it and act in it.
"""

from __future__ import annotations

from django.urls import re_path

from belay_django.dashboard import view

app_name = "belay_dashboard"
urlpatterns = [re_path(r"^(?P<path>.*)$", view, name="dashboard")]
