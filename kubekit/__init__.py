"""Machinery shared by every kubestrata component.

API clients with rate limits, watch caches, work queues, certificates, the
label and annotation keys, local control planes for tests and ``kubestrata up``,
and the ``kubestrata`` command line.
"""
