"""The composition root: the ``sluicegate`` command (:mod:`cli.main`) and what only it uses.

* :mod:`cli.stack`: ``sluicegate up``, which starts and supervises every service of the local stack;
* :mod:`cli.backbone`: the local Kafka (KRaft, from Maven jars) and Redis that ``up`` and the tests start;
* :mod:`cli.bench`: ``sluicegate bench``, the load generator;
* :mod:`cli.tools`: the client commands ``sluicegate batch`` and ``sluicegate usage``.

It sits on top of every service and imports them; nothing in ``schemas``, the runtime library (``sluicegate``) or
any service imports this package.
"""
