"""Configuration: the environment -> one frozen ``Settings`` (the Go scheduler's variables and
defaults, plus ours), and the bucket API's and Vault's configuration. An invalid value is a
``ConfigError`` naming the variable.

May not do I/O or hold secrets in reprs.
"""
