"""Reusable test helpers (a real pagekeeper server as a subprocess, ...)."""
