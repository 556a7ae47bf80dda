"""History in SQL: the schema, migrations, read-only queries and retention."""
