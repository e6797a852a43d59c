"""Reliability: durable state (recovery = a never-crashed twin), crashes of the service and
of its clients, hostile input, load. ``campaign.py`` runs the long versions (make crash /
fuzz / soak); docs/reliability.md says what is promised and how each test checks it."""
