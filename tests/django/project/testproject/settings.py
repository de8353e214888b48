"""A tiny Django project for belay_django's tests.

The database comes from ``BELAY_DJANGO_TEST_DATABASE`` (a PostgreSQL URL);
the in-process tests point it at each test's own database.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(
    os.environ.get("BELAY_DJANGO_TEST_DATABASE", "postgresql://postgres@127.0.0.1:5432/postgres")
)

SECRET_KEY = "belay-django-tests"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "testproject.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "belay_django",
    "testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        # Lets the tests count the connections Django opens.
        "OPTIONS": {"application_name": "belay-test-django"},
    },
    # Not belay's: the checks refuse it as settings.BELAY['DATABASE'].
    "other": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
BELAY = {
    "QUEUES": {"default": 4, "mailers": 2},
    "NOTIFY": True,
    "POLL_INTERVAL": 0.2,
    "SHUTDOWN_GRACE": 5,
}
TASKS = {"default": {"BACKEND": "belay_django.tasks.BelayBackend",
                     "QUEUES": ["default", "mailers"]}}
