"""The local backbone: a Kafka node (or a small cluster) in KRaft mode from the Apache jars fetched with Maven, and
a Redis server from the OS package; started by ``sluicegate up``, ``sluicegate dev`` and the test fixtures."""
