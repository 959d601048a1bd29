"""A chaos soak of the relay on a stack of its own: `python -m scripts.soak` (see __main__.py).

settings.py  ports, directory, database, topics, relay settings
stack.py     the soak's Postgres and Kafka, through scripts/services.py
database.py  the soak database made fresh; the ledger and the rows left read back
topics.py    the topics made fresh; read back with read_committed
writer.py    a writer process: transactions whose per-key commit order is known
chaos.py     relays as processes, and harm to them and to the stack
checks.py    the verdict: pure functions over what a run left behind
"""
