"""The composition root: the ``sluicegate`` command, ``sluicegate up`` and the local dev stack (Kafka + Redis).

It sits on top of every service and imports them; nothing in ``schemas``, the runtime library
(``sluicegate``) or any service imports this package.
"""
