"""The PostgreSQL store, for many machines (the ``postgres`` extra): the store, its schema and its async
connection pool."""
