"""The asynchronous Vault (OpenBao) client: KV v2 and any other call on its own bounded threads,
token and AppRole login, errors translated.

May not know buckets or certificates: ``storage`` and ``cluster`` use it.
"""
