"""The PostgreSQL store, for many machines (the ``postgres`` extra): the store (``store``, built on ``database``,
``rollouts`` and ``spans``), its connections, failures and notifications, its schema and its async connection
pool."""

try:
    import psycopg  # noqa: F401 - every module here needs it: this says how to install it, before any of them fails
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the PostgreSQL store needs psycopg 3: pip install 'agl[postgres]' (or pip install 'psycopg[binary]')"
    ) from exc
