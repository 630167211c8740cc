"""Client commands of the ``sluicegate`` command line: ``sluicegate batch`` and ``sluicegate usage``."""
